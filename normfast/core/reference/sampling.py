"""The heat's importance-sampled estimator from its definition, in float64 (what the engine's
``heat_sampling="energy"`` must equal on fixed draws), and its exact expectation over the draw.

Nothing here imports another part of normfast.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch


def weighted_heat_reference(T, Z, weights, centre, branch: str = "u") -> torch.Tensor:
    """``V2 = (1/M) Σ_i w_i |x_i - c|²`` per row, in float64.

    ``T`` ``[M, N, d]``: the raw displacements ``t_i`` of the M drawn batches (unweighted, uncentered);
    ``Z`` ``[N, d]`` the embeddings; ``weights`` ``[M]``: ``1 / ((N_pool - 1) q)`` of each draw;
    ``centre`` ``[N, d]``: the pool's mean displacement (in ``t`` units). ``x = R t`` for branch "u",
    ``x = t`` for "w" (the centre scaled alike).
    """
    if branch not in ("u", "w"):
        raise ValueError(f"weighted_heat_reference: expected branch 'u' or 'w', got {branch!r}")
    T = torch.as_tensor(np.asarray(T), dtype=torch.float64)
    Z = torch.as_tensor(np.asarray(Z), dtype=torch.float64)
    w = torch.as_tensor(np.asarray(weights), dtype=torch.float64)
    c = torch.as_tensor(np.asarray(centre), dtype=torch.float64)
    scale = torch.linalg.vector_norm(Z, dim=1) if branch == "u" else torch.ones(Z.shape[0], dtype=torch.float64)
    x = (T - c[None]) * scale[None, :, None]
    return (w[:, None] * x.square().sum(-1)).mean(0)


def exact_expectation(values: np.ndarray, q: np.ndarray, m: int) -> np.ndarray:
    """``E[(1/m) Σ_i v_{b_i} / ((P - 1) q_{b_i})]`` over every sequence of m independent draws ``b_i ~ q``,
    enumerated (``P^m`` sequences; for tests with a small population): ``values`` ``[P, ...]``."""
    values = np.asarray(values, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    p = values.shape[0]
    total = np.zeros(values.shape[1:])
    for seq in itertools.product(range(p), repeat=m):
        prob = float(np.prod(q[list(seq)]))
        est = sum(values[b] / ((p - 1) * q[b]) for b in seq) / m
        total += prob * est
    return total

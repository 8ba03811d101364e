"""Reference of the stacked head products (``normfast/kernels/head_stack.py``), the primitive of the grouped head
statistics."""

from __future__ import annotations

import torch


def head_stack_reference(A, Z, G, S, *, has_bias: bool = False) -> dict:
    """Reference for the stacked head products (the primitive of the grouped head statistics).

    ``A`` ``[N, d_in]`` probe activations, ``Z`` ``[N, d_out]`` embeddings,
    ``G`` ``[K1, d_out, da]`` a stack of direction matrices (means: overall,
    per group, ...), ``S`` ``[K2, da, da]`` a stack of symmetric second-moment
    matrices, ``da = d_in + 1`` when ``has_bias`` (the last column of ``G`` and
    the last row/column of ``S`` act on the constant 1 of ``ã = [a, 1]``),
    else ``da = d_in`` and ``ã = a``. Per row ``i`` and stack entry ``k``:

    * ``zdot[i, k] = z_i · (G_k ã_i)``  -- ``[N, K1]``
    * ``sq[i, k]   = |G_k ã_i|²``       -- ``[N, K1]``
    * ``quad[i, k] = ã_iᵀ S_k ã_i``     -- ``[N, K2]``
    * ``norm[i]    = |z_i|``            -- ``[N]``

    Every estimator of the grouped head mode (drift, its group spread, m2,
    heat and its group spread) is an O(N K) epilogue over these; the kernel
    and the torch path compute exactly these products. Computed here one
    matrix at a time in the inputs' dtype (float64 for a reference).
    """
    A, Z, G, S = (torch.as_tensor(x) for x in (A, Z, G, S))
    if has_bias:
        A = torch.cat([A, torch.ones(A.shape[0], 1, dtype=A.dtype, device=A.device)], 1)
    if G.shape[-1] != A.shape[1] or S.shape[-1] != A.shape[1] or S.shape[-2] != A.shape[1]:
        raise ValueError(
            f"head_stack_reference: expected G [K1, d_out, {A.shape[1]}] and "
            f"S [K2, {A.shape[1]}, {A.shape[1]}], got G.shape={tuple(G.shape)}, "
            f"S.shape={tuple(S.shape)}"
        )
    zdot, sq, quad = [], [], []
    for g in G:
        v = A @ g.T
        zdot.append((Z * v).sum(1))
        sq.append((v * v).sum(1))
    for s in S:
        quad.append(((A @ s) * A).sum(1))

    def stacked(columns):  # an empty stack gives [N, 0]
        return torch.stack(columns, 1) if columns else A.new_zeros((A.shape[0], 0))

    return {"zdot": stacked(zdot), "sq": stacked(sq), "quad": stacked(quad), "norm": torch.linalg.vector_norm(Z, dim=1)}

"""Head mode's inputs: the run's head directions stacked and prepared once, the head's inputs and
outputs per chunk, and κ in closed form (``J θ_W = W a``, ``J θ_b = b``)."""

from __future__ import annotations

from typing import Any

import torch

from normfast.encoders import Encoder
from normfast.engine.transmission.jvp import kappa_from_jvp


def head_operands(encoder: Encoder, directions: Any, batches: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack the head's directions as ``G [M, d_out, d_in]`` and ``g [M, d_out]``."""
    head = encoder.head()
    if head is None:
        raise ValueError("head mode needs an encoder with a linear head")
    G = torch.stack([directions.directions[b][head.weight_name] for b in batches])
    if head.transposed:
        G = G.transpose(1, 2)
    g = None
    if head.bias_name is not None and head.bias_name in directions.names:
        g = torch.stack([directions.directions[b][head.bias_name] for b in batches])
    return G.contiguous(), g


def head_drift_operands(encoder: Encoder, directions: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The drift's K group-mean head directions as ``Gd [K, d_out, d_in]`` and ``gd [K, d_out]``."""
    head = encoder.head()
    if head is None:
        raise ValueError("head mode needs an encoder with a linear head")
    means = directions.drift.means
    Gd = torch.stack([m[head.weight_name] for m in means])
    if head.transposed:
        Gd = Gd.transpose(1, 2)
    gd = None
    if head.bias_name is not None and head.bias_name in directions.names:
        gd = torch.stack([m[head.bias_name] for m in means])
    return Gd.contiguous(), gd


def prepared_head(encoder: Encoder, directions: Any, *, dtype: torch.dtype, groups: int) -> Any:
    """The run's head directions (and the drift's group means) centered and grouped once, for every chunk."""
    from normfast.engine.transmission.head.prepare import prepare_head

    G, g = head_operands(encoder, directions, list(range(directions.M)))
    drift = {}
    if directions.drift is not None:
        Gd, gd = head_drift_operands(encoder, directions)
        drift = dict(drift_means=Gd, drift_bias=gd, drift_counts=directions.drift.counts)
    # the heat's importance-sampled draws come centered and weighted: their known-mean estimator
    return prepare_head(G, g, dtype=dtype, groups=groups, known_mean=directions.heat is not None, **drift)


def head_inputs(
    encoder: Encoder, front: dict, cut: int, rows: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's inputs ``a`` (pre-head activations, token rows picked) and outputs ``z = W a + b``."""
    head = encoder.head()
    with torch.no_grad():
        a = encoder(front, cut, output="pre_head_tokens" if rows is not None else "pre_head")
        if rows is not None:
            a = a[rows]
        W = head.weight(encoder).detach()
        z = a.to(W.dtype) @ W.t()
        b = head.bias(encoder)
        if b is not None:
            z = z + b.detach()
    return a, z


def head_kappa(encoder: Encoder, a: torch.Tensor, z: torch.Tensor, decayed: dict[str, torch.Tensor]) -> torch.Tensor:
    """κ in head mode: ``J θ_d = W a (+ b if the bias is decayed)``."""
    return _head_radial(encoder, a, z, set(decayed))


def head_kappa_exempt(
    encoder: Encoder, a: torch.Tensor, z: torch.Tensor, decayed: dict[str, torch.Tensor], names: list[str]
) -> torch.Tensor:
    """``ẑ·(J θ_exempt)/R`` in head mode, over the probed head parameters exempt from decay."""
    return _head_radial(encoder, a, z, {n for n in names if n not in decayed})


def _head_radial(encoder: Encoder, a: torch.Tensor, z: torch.Tensor, subset: set[str]) -> torch.Tensor:
    """``ẑ·(J θ_S)/R`` for a subset ``S`` of the head's parameters (``J θ_W = W a``, ``J θ_b = b``)."""
    head = encoder.head()
    W = head.weight(encoder).detach()
    j = a.to(W.dtype) @ W.t() if head.weight_name in subset else torch.zeros_like(z)
    if head.bias_name is not None and head.bias_name in subset:
        j = j + encoder.get_parameter(head.bias_name).detach()
    return kappa_from_jvp(z, j)

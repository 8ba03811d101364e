"""Transmission: how an update direction ``p_B`` moves each probe embedding.

Per probe item ``i`` the first-order displacement per unit learning rate is
``t_i^B = −J_i p_B`` with ``J_i = ∂z_i/∂P``.

* **jvp mode** -- a forward-mode JVP of the probe forward along ``p_B`` gives
  ``t`` for every item of a chunk at once (every token of a sequence in one
  pass). Several directions share one pass through ``torch.func.vmap`` over
  the tangents (the primal is computed once). Only the tail of the network,
  from the first stage that owns a probed parameter, is differentiated; the
  frozen front comes from a cache.
* **head mode** -- when ``P`` is exactly one final linear map ``z = W a + b``,
  ``t_i^B = −(G_B a_i + g_B)`` in closed form and the statistics follow from
  the probe activations and the stacked directions, without any JVP
  (``normfast.engine.ops.head_stats``).

κ, the effective radial damping, is one more JVP along the decayed parameters
themselves: ``κ_i = ẑ_i · (J_i θ_decayed) / R_i``; ``kappa_exempt`` is the same
along the probed parameters exempt from decay (the regime check,
:mod:`normfast.engine.regime`, compares the two).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.func import functional_call, jvp, vmap

from normfast.encoders import Encoder, forward_ad_safe


class Tail:
    """The probed tail of an encoder, as a function of the probed parameters.

    ``front`` is the cached state at the cut (``encoder(state, 0, cut)``);
    ``output`` is ``"pooled"`` or ``"tokens"``. ``rows`` (bool ``[B, T]``) picks
    the probe rows of token outputs.
    """

    def __init__(self, encoder: Encoder, names: list[str], cut: int, output: str):
        self.encoder = encoder
        self.names = list(names)
        self.cut = cut
        self.output = output
        self._vmap_ok = True

    def params(self) -> dict[str, torch.Tensor]:
        return {n: self.encoder.get_parameter(n).detach() for n in self.names}

    def _fn(self, front: dict):
        enc, cut, output = self.encoder, self.cut, self.output

        def f(params: dict[str, torch.Tensor]) -> torch.Tensor:
            return functional_call(enc, params, (front,), {"start": cut, "output": output}, strict=False)

        return f

    @staticmethod
    def _rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """``[..., B, T, d]`` -> ``[..., n, d]`` (token rows) or unchanged for pooled."""
        if rows is None:
            return x
        return x[..., rows, :]

    def primal(self, front: dict, rows: torch.Tensor | None) -> torch.Tensor:
        with torch.no_grad():
            z = self.encoder(front, self.cut, output=self.output)
        return self._rows(z, rows)

    def jvp(self, front: dict, tangents: dict[str, torch.Tensor],
            rows: torch.Tensor | None) -> torch.Tensor:
        """``J · tangent`` for K stacked tangents ``{name: [K, *shape]}`` -> ``[K, n, d]``."""
        f = self._fn(front)
        params = self.params()
        K = next(iter(tangents.values())).shape[0]
        with forward_ad_safe(), torch.no_grad():
            if K > 1 and self._vmap_ok:
                try:
                    def one(tan: dict[str, torch.Tensor]) -> torch.Tensor:
                        return jvp(f, (params,), (tan,))[1]

                    out = vmap(one)(tangents)
                    return self._rows(out, rows)
                except (RuntimeError, NotImplementedError) as exc:
                    # some ops have no batching rule; fall back to one direction per pass
                    self._vmap_ok = False
                    warnings.warn(f"batched directions unavailable for this model ({type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0][:160]}); using one direction per pass",
                                  stacklevel=2)
            outs = [jvp(f, (params,), ({n: t[k] for n, t in tangents.items()},))[1] for k in range(K)]
        return self._rows(torch.stack(outs), rows)


def kappa_from_jvp(z: torch.Tensor, j_decay: torch.Tensor) -> torch.Tensor:
    """κ = ẑ·(J θ_d) / R = z·(J θ_d) / R², row-wise (NaN for zero-norm rows)."""
    z64 = z.double()
    r2 = z64.square().sum(-1)
    k = (z64 * j_decay.double()).sum(-1) / r2
    return torch.where(r2 > 0, k, torch.full_like(k, float("nan")))


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
    from normfast.engine.head.directions import prepare_head

    G, g = head_operands(encoder, directions, list(range(directions.M)))
    drift = {}
    if directions.drift is not None:
        Gd, gd = head_drift_operands(encoder, directions)
        drift = dict(drift_means=Gd, drift_bias=gd, drift_counts=directions.drift.counts)
    return prepare_head(G, g, dtype=dtype, groups=groups, **drift)


def head_inputs(encoder: Encoder, front: dict, cut: int, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
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


def head_kappa_exempt(encoder: Encoder, a: torch.Tensor, z: torch.Tensor, decayed: dict[str, torch.Tensor],
                      names: list[str]) -> torch.Tensor:
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

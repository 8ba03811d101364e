"""Backend API: the probe-statistics estimator on plain arrays.

Frontends that have their own models call these functions directly. Inputs
are torch tensors or any DLPack array (numpy, CuPy, JAX); results are torch
tensors. CUDA tensors run the Triton kernels of :mod:`normfast.kernels`; CPU
tensors run the same math as torch ops (BLAS), in float64 when the inputs are
float64 and otherwise in float32 with fp32 accumulation.

* :class:`ProbeAccumulator` -- streaming, mergeable per-probe statistics from
  explicit displacements ``t_i^B`` (any probed parameters, "jvp" mode).
* :class:`GroupedAccumulator` -- the same over K groups of directions, with
  the error bars (group ``se_D``, jackknife ``se_V2``/``se_Q``, leave-one-
  group-out values for the jackknife of ``R_eq``).
* :func:`head_stats` -- closed form for a linear head ``z = W a + b`` ("head"
  mode), from the per-batch head directions ``G_B`` (and bias ``g_B``);
  grouped error bars by default (:mod:`normfast.engine.headstats`).
* :func:`prepare_head` -- center and group the head directions once, for
  streaming many probe chunks through :func:`head_stats`.
* :func:`head_flops` -- the FLOP count of the head-mode forms.
* :func:`drift_from_groups` -- the drift statistics from K group-mean
  displacements (the drift from the mean direction over its own M_D batches).
* ``solve_quartic``, ``equilibrium_coefficients``, ``equilibrium_norm`` --
  the equilibrium law, re-exported from :mod:`normfast.core.equilibrium`.

Every statistic dict holds, per branch, ``D, se_D, sign_stability, m2, V2,
Q`` (suffix ``_w`` for the scale-free branch; ``C_uw`` when both; ``se_V2,
se_Q`` and ``loo`` from the grouped estimators), plus
``valid`` (bool ``[N]``), ``reason`` (int8 ``[N]``, codes into
:data:`REASONS`) and ``M``. Invalid rows hold NaN; no row is ever dropped.
"""
from __future__ import annotations

import importlib
from typing import Any

import torch

from normfast.core.checks import as_tensor, check_float, check_ndim, check_same_device, describe
from .accumulator import (
    NON_FINITE_DISPLACEMENT,
    NON_FINITE_EMBEDDING,
    REASONS,
    STAT_KEYS,
    ZERO_NORM,
    GroupedAccumulator,
    ProbeAccumulator,
    stat_names,
)
from .headstats import (UNCERTAINTY_KEYS, HeadDirections, _compute_dtype, _counts_tensor, head_flops, head_stats,
                        prepare_head)
from .uncertainty import group_spread, jackknife_se, leave_one_out_means

__all__ = [
    "REASONS",
    "STAT_KEYS",
    "UNCERTAINTY_KEYS",
    "ProbeAccumulator",
    "GroupedAccumulator",
    "HeadDirections",
    "prepare_head",
    "head_stats",
    "head_flops",
    "drift_from_groups",
    "stat_names",
    "solve_quartic",
    "equilibrium_coefficients",
    "equilibrium_norm",
]

_EQUILIBRIUM = ("solve_quartic", "equilibrium_coefficients", "equilibrium_norm")


def __getattr__(name: str) -> Any:
    # The equilibrium module is imported on first use only.
    if name in _EQUILIBRIUM:
        value = getattr(importlib.import_module("normfast.core.equilibrium"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'normfast.engine.ops' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def drift_from_groups(T: Any, Z: Any, counts: Any = None, *, branch: str = "u") -> dict[str, Any]:
    """Drift statistics from the displacements along K group-mean directions.

    ``T`` ``[K, N, d]``: ``t̄_g = −J p̄_g``, the displacement of every probe
    along the mean update direction ``p̄_g`` of batch group ``g`` (by
    linearity, the mean of that group's per-batch displacements); ``Z``
    ``[N, d]`` the embeddings; ``counts`` ``[K]`` the batches per group
    (default equal); ``branch`` "u" (``x = R t``) or "w" (``x = t``). With
    ``D_g = ẑ·x̄_g`` and ``x̄ = Σ_g n_g x̄_g / M_D`` (the mean over all M_D
    batches): ``D = ẑ·x̄``, ``m2 = |x̄|²`` (noise bias ``V2/M_D``),
    ``se_D² = Σ_g n_g (D_g − D)² / ((K−1) M_D)`` (K−1 degrees of freedom) and
    ``sign_stability`` the share of groups whose ``D_g`` has the sign of D.
    Keys carry the suffix ``_w`` for the w branch; also ``valid``,
    ``reason``, ``M`` (= M_D) and ``loo``: ``{"D", "m2"}`` (suffixed) →
    ``[N, K]`` values over the batches outside each group (for the jackknife
    of everything the drift enters). Computed in float64 for float64 inputs,
    else float32.
    """
    fn = "drift_from_groups"
    if branch not in ("u", "w"):
        raise ValueError(f"{fn}: expected branch 'u' or 'w', got branch={branch!r}")
    T = as_tensor(fn, "T", T)
    Z = as_tensor(fn, "Z", Z)
    check_float(fn, "T", T)
    check_float(fn, "Z", Z)
    check_ndim(fn, "T", T, 3, "3-D [K, N, d]")
    check_ndim(fn, "Z", Z, 2, "2-D [N, d]")
    k = T.shape[0]
    if tuple(T.shape[1:]) != tuple(Z.shape):
        raise ValueError(f"{fn}: expected T of shape [K, N, d] with (N, d)={tuple(Z.shape)} from Z, "
                         f"got {describe('T', T)}")
    if k < 2:
        raise ValueError(f"{fn}: expected at least 2 groups (K >= 2) in T [K, N, d], got {describe('T', T)}")
    check_same_device(fn, T=T, Z=Z)
    cd = _compute_dtype(fn, None, T, Z)
    if counts is None:
        w = torch.ones(k, dtype=cd, device=T.device)
    else:
        w = _counts_tensor(fn, "counts", counts).to(device=T.device, dtype=cd)
        if tuple(w.shape) != (k,) or not bool((w > 0).all()):
            raise ValueError(f"{fn}: expected counts of shape [K]=({k},) with positive batch counts, "
                             f"got {describe('counts', w)}")
    T, Z = T.to(cd), Z.to(cd)
    norm = torch.linalg.vector_norm(Z, dim=1)
    scale = norm if branch == "u" else torch.ones_like(norm)
    zhat = Z / norm[:, None]
    mean_t = torch.einsum("k,knd->nd", w / w.sum(), T)
    group = torch.einsum("knd,nd->nk", T, zhat) * scale[:, None]
    drift = (mean_t * zhat).sum(1) * scale
    se, agree = group_spread(drift, group, w)
    m2 = scale.square() * mean_t.square().sum(1)
    loo_t = leave_one_out_means(T, w)                                       # [K, N, d]
    loo_d = torch.einsum("knd,nd->nk", loo_t, zhat) * scale[:, None]
    loo_m2 = torch.linalg.vector_norm(loo_t, dim=2).square().T * scale.square()[:, None]
    bad = ~torch.isfinite(T).all(2).all(0)
    code = torch.zeros(norm.shape, dtype=torch.int8, device=T.device)
    code[bad] = NON_FINITE_DISPLACEMENT
    code[~torch.isfinite(norm)] = NON_FINITE_EMBEDDING
    code[norm == 0] = ZERO_NORM
    ok = code == 0
    sfx = "" if branch == "u" else "_w"
    out: dict[str, Any] = {}
    for name, value in (("D", drift), ("se_D", se), ("sign_stability", agree), ("m2", m2)):
        out[name + sfx] = torch.where(ok, value, float("nan"))
    out["valid"] = ok
    out["reason"] = code
    out["M"] = int(round(float(w.sum()))) if counts is not None else k
    out["loo"] = {"D" + sfx: torch.where(ok[:, None], loo_d, float("nan")),
                  "m2" + sfx: torch.where(ok[:, None], loo_m2, float("nan"))}
    return out

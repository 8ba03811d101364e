"""Drift statistics from K group-mean displacements (:func:`drift_from_groups`): the drift from
the mean update direction over its own M_D batches, with its error bars."""

from __future__ import annotations

from typing import Any

import torch

from normfast.core.checks import check_choice, check_same_device, compute_dtype, counts_tensor, describe, float_tensor
from normfast.engine.estimators.statkeys import row_codes
from normfast.engine.estimators.uncertainty import group_spread, leave_one_out_means


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
    check_choice(fn, "branch", branch, ("u", "w"))
    T = float_tensor(fn, "T", T, 3, "3-D [K, N, d]")
    Z = float_tensor(fn, "Z", Z, 2, "2-D [N, d]")
    k = T.shape[0]
    if tuple(T.shape[1:]) != tuple(Z.shape):
        raise ValueError(
            f"{fn}: expected T of shape [K, N, d] with (N, d)={tuple(Z.shape)} from Z, got {describe('T', T)}"
        )
    if k < 2:
        raise ValueError(f"{fn}: expected at least 2 groups (K >= 2) in T [K, N, d], got {describe('T', T)}")
    check_same_device(fn, T=T, Z=Z)
    cd = compute_dtype(fn, None, T, Z)
    if counts is None:
        w = torch.ones(k, dtype=cd, device=T.device)
    else:
        w = counts_tensor(fn, "counts", counts, k, dtype=cd, device=T.device)
    T, Z = T.to(cd), Z.to(cd)
    norm = torch.linalg.vector_norm(Z, dim=1)
    scale = norm if branch == "u" else torch.ones_like(norm)
    zhat = Z / norm[:, None]
    mean_t = torch.einsum("k,knd->nd", w / w.sum(), T)
    group = torch.einsum("knd,nd->nk", T, zhat) * scale[:, None]
    drift = (mean_t * zhat).sum(1) * scale
    se, agree = group_spread(drift, group, w)
    m2 = scale.square() * mean_t.square().sum(1)
    loo_t = leave_one_out_means(T, w)  # [K, N, d]
    loo_d = torch.einsum("knd,nd->nk", loo_t, zhat) * scale[:, None]
    loo_m2 = torch.linalg.vector_norm(loo_t, dim=2).square().T * scale.square()[:, None]
    bad = ~torch.isfinite(T).all(2).all(0)
    code = row_codes(norm, bad)
    ok = code == 0
    sfx = "" if branch == "u" else "_w"
    out: dict[str, Any] = {}
    for name, value in (("D", drift), ("se_D", se), ("sign_stability", agree), ("m2", m2)):
        out[name + sfx] = torch.where(ok, value, float("nan"))
    out["valid"] = ok
    out["reason"] = code
    out["M"] = int(round(float(w.sum()))) if counts is not None else k
    out["loo"] = {
        "D" + sfx: torch.where(ok[:, None], loo_d, float("nan")),
        "m2" + sfx: torch.where(ok[:, None], loo_m2, float("nan")),
    }
    return out

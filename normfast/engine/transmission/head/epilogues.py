"""The head-mode statistics from the stacked products: row-wise epilogues, O(N K), and the
statistic dict they fill (:func:`finish`)."""

from __future__ import annotations

from typing import Any

import torch

from normfast.engine.estimators.statkeys import STAT_KEYS, UNCERTAINTY_KEYS
from normfast.engine.estimators.uncertainty import group_spread, jackknife_se
from normfast.engine.transmission.head.prepare import HeadDirections


def _scale(prod: dict[str, torch.Tensor], branch: str) -> torch.Tensor:
    norm = prod["norm"]
    return norm if branch == "u" else torch.ones_like(norm)


def grouped_epilogue(prod: dict[str, torch.Tensor], dirs: HeadDirections, branch: str, *, heat: bool = True):
    """Grouped estimators from ``zdot, sq [N, K+1]`` (drift mean, leave-outs) and ``quad [N, K+1]`` (S_c, S_c,−g)."""
    norm, zdot, sq = prod["norm"], prod["zdot"], prod["sq"]
    s = _scale(prod, branch)
    counts = dirs.drift_group_counts.to(zdot)
    total = counts.sum()
    radial = -(zdot / norm[:, None]) * s[:, None]  # D, then D_−g
    drift, drift_loo = radial[:, 0], radial[:, 1:]
    group = (total * drift[:, None] - (total - counts) * drift_loo) / counts  # D_g
    se_d, agree = group_spread(drift, group, counts)
    m2_all = s.square()[:, None] * sq
    values = {"D": drift, "se_D": se_d, "sign_stability": agree, "m2": m2_all[:, 0]}
    bad = ~(torch.isfinite(zdot).all(1) & torch.isfinite(sq).all(1))
    if not heat:
        return values, None, bad
    v2_all = s.square()[:, None] * prod["quad"].clamp_min(0)
    q_all = m2_all + v2_all
    values.update(V2=v2_all[:, 0], Q=q_all[:, 0], se_V2=jackknife_se(v2_all[:, 1:]), se_Q=jackknife_se(q_all[:, 1:]))
    loo = {"D": drift_loo, "m2": m2_all[:, 1:], "V2": v2_all[:, 1:], "Q": q_all[:, 1:]}
    bad = bad | ~torch.isfinite(prod["quad"][:, 0])
    return values, loo, bad


def s_epilogue(prod: dict[str, torch.Tensor], branch: str):
    norm = prod["norm"]
    s = _scale(prod, branch)
    drift = -(prod["zdot"][:, 0] / norm) * s
    m2 = s.square() * prod["sq"][:, 0]
    v2 = s.square() * prod["quad"][:, 0].clamp_min(0)
    bad = ~(torch.isfinite(prod["zdot"][:, 0]) & torch.isfinite(prod["sq"][:, 0]) & torch.isfinite(prod["quad"][:, 0]))
    return {"D": drift, "m2": m2, "V2": v2, "Q": m2 + v2}, None, bad


def per_batch_epilogue(prod: dict[str, torch.Tensor], m: int, branch: str, heat_denominator: int | None = None):
    """Per-batch estimators from ``zdot, sq [N, M+1]`` (the heat's mean, then every centered batch);
    ``heat_denominator``: M − 1 by default, M about a known centre."""
    norm, zdot, sq = prod["norm"], prod["zdot"], prod["sq"]
    s = _scale(prod, branch)
    drift = -(zdot[:, 0] / norm) * s
    dev = -(zdot[:, 1:] / norm[:, None]) * s[:, None]  # r^B − D
    radial = drift[:, None] + dev
    pos, neg = (radial > 0).sum(1), (radial < 0).sum(1)
    agree = torch.where(drift > 0, pos, torch.where(drift < 0, neg, m - pos - neg)).to(drift.dtype) / m
    dev_sum, dev_sq = dev.sum(1), dev.square().sum(1)
    se = torch.sqrt((dev_sq - dev_sum.square() / m).clamp_min(0) / ((m - 1) * m))
    m2 = s.square() * sq[:, 0]
    v2 = s.square() * sq[:, 1:].sum(1) / (m - 1 if heat_denominator is None else heat_denominator)
    bad = ~(torch.isfinite(zdot).all(1) & torch.isfinite(sq).all(1))
    return {"D": drift, "se_D": se, "sign_stability": agree, "m2": m2, "V2": v2, "Q": m2 + v2}, None, bad


def finish(
    values: dict[str, torch.Tensor],
    code: torch.Tensor,
    loo: dict[str, torch.Tensor] | None,
    branch: str,
    cd: torch.dtype,
    m: int,
    k: int,
) -> dict[str, Any]:
    ok = code == 0
    n = code.shape[0]
    suffix = "" if branch == "u" else "_w"
    nan = torch.tensor(float("nan"), dtype=cd, device=code.device)
    out: dict[str, Any] = {}
    for name in (*STAT_KEYS, *UNCERTAINTY_KEYS):
        value = values.get(name)
        out[name + suffix] = (
            torch.where(ok, value, nan)
            if value is not None
            else torch.full((n,), float("nan"), dtype=cd, device=code.device)
        )
    out["valid"] = ok
    out["reason"] = code
    out["M"] = m
    out["groups"] = k
    if loo is not None:
        out["loo"] = {name + suffix: torch.where(ok[:, None], value, nan) for name, value in loo.items()}
    return out

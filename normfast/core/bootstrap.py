"""Percentile-bootstrap confidence intervals for the experiments' correlations and paired gains.

Every function takes its resamples from a seed (or from a given ``[B, n]`` index
matrix, so that several quantities share the same resampled rows) and drops
non-finite pairs before anything is computed. Intervals are the 2.5th and
97.5th percentiles of the resampled statistic.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = [
    "correlation_with_ci",
    "paired_bootstrap_means",
    "partial_spearman_with_ci",
    "ranks",
    "rowwise_pearson",
    "spearman_ci",
]


def ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks along the last axis (ties share their mean rank); NaNs stay NaN."""
    from scipy.stats import rankdata

    return rankdata(x, axis=-1, nan_policy="omit")


def rowwise_pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson r along the last axis, ignoring positions where ``x`` or ``y`` is NaN
    (NaN where fewer than three pairs remain or a side is constant)."""
    m = np.isfinite(x) & np.isfinite(y)
    n = m.sum(-1)
    x = np.where(m, x, 0.0)
    y = np.where(m, y, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        xc = np.where(m, x - (x.sum(-1) / n)[..., None], 0.0)
        yc = np.where(m, y - (y.sum(-1) / n)[..., None], 0.0)
        den = np.sqrt((xc * xc).sum(-1) * (yc * yc).sum(-1))
        return np.where((n >= 3) & (den > 0), (xc * yc).sum(-1) / den, np.nan)


def correlation_with_ci(x: np.ndarray, y: np.ndarray, resamples: np.ndarray) -> dict[str, Any]:
    """Pearson r and Spearman rho of ``x`` with ``y``, with percentile bootstrap 95% intervals.

    ``resamples`` is a ``[B, n]`` array of row indices, shared across calls so
    that every quantity sees the same bootstrap samples. Rows where ``x`` or
    ``y`` is not finite take no part, in the estimate or in any resample.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    bad = ~(np.isfinite(x) & np.isfinite(y))
    x = np.where(bad, np.nan, x)
    y = np.where(bad, np.nan, y)
    out: dict[str, Any] = {"n": int((~bad).sum()), "n_bootstrap": int(resamples.shape[0])}
    for name in ("pearson", "spearman"):
        fx, fy = (x, y) if name == "pearson" else (ranks(x), ranks(y))
        r = float(rowwise_pearson(fx, fy))
        bx, by = x[resamples], y[resamples]
        if name == "spearman":
            bx, by = ranks(bx), ranks(by)
        boot = rowwise_pearson(bx, by)
        boot = boot[np.isfinite(boot)]
        lo, hi = np.percentile(boot, [2.5, 97.5]) if boot.size else (math.nan, math.nan)
        out[name] = {"r": r, "ci95": [float(lo), float(hi)]}
    return out


def partial_spearman_with_ci(
    x: np.ndarray, y: np.ndarray, control: np.ndarray, resamples: np.ndarray
) -> dict[str, Any]:
    """Spearman rho of ``x`` with ``y`` with ``control`` partialled out (on ranks), bootstrap 95% interval."""

    def partial(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
        ra, rb, rc = ranks(a), ranks(b), ranks(c)
        r_ab, r_ac, r_bc = rowwise_pearson(ra, rb), rowwise_pearson(ra, rc), rowwise_pearson(rb, rc)
        with np.errstate(invalid="ignore", divide="ignore"):
            return (r_ab - r_ac * r_bc) / np.sqrt((1 - r_ac**2) * (1 - r_bc**2))

    bad = ~(np.isfinite(x) & np.isfinite(y) & np.isfinite(control))
    x, y, control = (np.where(bad, np.nan, np.asarray(v, dtype=np.float64)) for v in (x, y, control))
    boot = partial(x[resamples], y[resamples], control[resamples])
    boot = boot[np.isfinite(boot)]
    lo, hi = np.percentile(boot, [2.5, 97.5]) if boot.size else (math.nan, math.nan)
    return {"r": float(partial(x, y, control)), "ci95": [float(lo), float(hi)], "n": int((~bad).sum())}


def spearman_ci(x: np.ndarray, y: np.ndarray, *, resamples: int, seed: int) -> dict[str, float]:
    """Spearman correlation with a percentile bootstrap 95% CI (finite pairs only; NaN under 10 pairs
    or for a constant column). Resamples are drawn from ``seed`` in blocks of 100."""
    from scipy.stats import rankdata

    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    n = int(ok.sum())
    if n < 10:
        return {"rho": math.nan, "ci_low": math.nan, "ci_high": math.nan, "n": n}

    def rho(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        ra, rb = rankdata(a, axis=-1), rankdata(b, axis=-1)
        ra = ra - ra.mean(-1, keepdims=True)
        rb = rb - rb.mean(-1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            return (ra * rb).sum(-1) / np.sqrt((ra * ra).sum(-1) * (rb * rb).sum(-1))

    rng = np.random.default_rng(seed)
    boot = []
    for lo in range(0, resamples, 100):
        idx = rng.integers(0, n, size=(min(100, resamples - lo), n))
        boot.append(rho(x[idx], y[idx]))
    b = np.concatenate(boot)
    b = b[np.isfinite(b)]
    lo, hi = np.percentile(b, [2.5, 97.5]) if b.size else (math.nan, math.nan)
    return {"rho": float(rho(x, y)), "ci_low": float(lo), "ci_high": float(hi), "n": n}


def paired_bootstrap_means(
    per_item: dict[str, np.ndarray], *, resamples: int, seed: int, baseline: str | None = None
) -> dict[str, dict[str, float]]:
    """Mean and percentile 95% CI of each system's per-item metric; paired % gain over ``baseline``.

    All systems share the same resampled items, so the gain CI is paired. Each
    entry: ``mean``, ``ci_low``, ``ci_high``, ``n`` and, against the baseline,
    ``gain_pct_vs_<baseline>``, ``gain_ci_low``, ``gain_ci_high``.
    """
    names = list(per_item)
    n = len(per_item[names[0]])
    out: dict[str, dict[str, float]] = {}
    if n == 0:
        return {k: {"mean": math.nan, "ci_low": math.nan, "ci_high": math.nan, "n": 0} for k in names}
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    boot = {k: per_item[k][idx].mean(axis=1) for k in names}
    for k in names:
        lo, hi = np.percentile(boot[k], [2.5, 97.5])
        out[k] = {"mean": float(per_item[k].mean()), "ci_low": float(lo), "ci_high": float(hi), "n": n}
        if baseline is not None and k != baseline:
            base = float(per_item[baseline].mean())
            with np.errstate(invalid="ignore", divide="ignore"):
                g = 100.0 * (boot[k] - boot[baseline]) / boot[baseline]
            g = g[np.isfinite(g)]
            out[k]["gain_pct_vs_" + baseline] = 100.0 * (out[k]["mean"] - base) / base if base > 0 else math.nan
            if g.size:
                glo, ghi = np.percentile(g, [2.5, 97.5])
                out[k]["gain_ci_low"], out[k]["gain_ci_high"] = float(glo), float(ghi)
    return out

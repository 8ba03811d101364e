"""Small statistics shared by the summaries and the experiments: quantiles, log-log fits, rank correlation."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["correlation", "loglog_fit", "loglog_fit_ci", "paired_bootstrap", "quantiles", "spearman"]


def quantiles(v: np.ndarray) -> dict[str, float]:
    """``p10``, ``median`` and ``p90`` of the finite values of ``v`` (NaN where none is finite)."""
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {"p10": math.nan, "median": math.nan, "p90": math.nan}
    p10, p50, p90 = np.percentile(v, [10, 50, 90])
    return {"p10": float(p10), "median": float(p50), "p90": float(p90)}


def loglog_fit(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Slope and Pearson r of ``log y`` against ``log x`` over finite positive pairs."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    n = int(ok.sum())
    if n < 3:
        return {"slope": math.nan, "intercept": math.nan, "pearson_r": math.nan, "n": n}
    lx, ly = np.log(x[ok]), np.log(y[ok])
    if np.std(lx) == 0 or np.std(ly) == 0:
        return {"slope": math.nan, "intercept": math.nan, "pearson_r": math.nan, "n": n}
    slope, intercept = np.polyfit(lx, ly, 1)
    r = float(np.corrcoef(lx, ly)[0, 1])
    return {"slope": float(slope), "intercept": float(intercept), "pearson_r": r, "n": n}


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    from scipy.stats import spearmanr

    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.ptp(x[ok]) == 0 or np.ptp(y[ok]) == 0:
        return math.nan  # a constant input has no ranking (e.g. V2 = 0 on every row of a zero loss)
    return float(spearmanr(x[ok], y[ok]).statistic)


def loglog_fit_ci(x: np.ndarray, y: np.ndarray, n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """:func:`loglog_fit` plus percentile 95% bootstrap intervals over the (x, y) pairs.

    Adds ``slope_ci95``, ``pearson_r_ci95`` (NaN pairs with fewer than 3 usable
    points), ``n_boot`` (resamples with a defined fit) and ``n_no_prediction``
    (pairs dropped for a non-finite or non-positive value).
    """
    fit: dict[str, Any] = dict(loglog_fit(x, y))
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    lx, ly = np.log(x[ok]), np.log(y[ok])
    fit["n_no_prediction"] = int((~ok).sum())
    if len(lx) < 3:
        fit["slope_ci95"] = fit["pearson_r_ci95"] = [math.nan, math.nan]
        fit["n_boot"] = 0
        return fit
    idx = np.random.default_rng(seed).integers(0, len(lx), size=(n_boot, len(lx)))
    bx, by = lx[idx], ly[idx]
    bx = bx - bx.mean(1, keepdims=True)
    by = by - by.mean(1, keepdims=True)
    sxy, sxx, syy = (bx * by).sum(1), (bx * bx).sum(1), (by * by).sum(1)
    keep = (sxx > 0) & (syy > 0)
    slope = sxy[keep] / sxx[keep]
    r = sxy[keep] / np.sqrt(sxx[keep] * syy[keep])
    fit["slope_ci95"] = [float(v) for v in np.percentile(slope, [2.5, 97.5])]
    fit["pearson_r_ci95"] = [float(v) for v in np.percentile(r, [2.5, 97.5])]
    fit["n_boot"] = int(keep.sum())
    return fit


def correlation(x: np.ndarray, y: np.ndarray, method: str = "spearman") -> float:
    """Spearman or Pearson correlation over the pairs where both are finite (NaN below 3 pairs)."""
    if method not in ("spearman", "pearson"):
        raise ValueError(f"correlation: method must be 'spearman' or 'pearson', got {method!r}")
    if method == "spearman":
        return spearman(x, y)
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.std(x[ok]) == 0 or np.std(y[ok]) == 0:
        return math.nan
    return float(np.corrcoef(x[ok], y[ok])[0, 1])


def _row_corr(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    xc = x - x.mean(axis=-1, keepdims=True)
    yc = y - y.mean(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (xc * yc).sum(-1) / np.sqrt((xc * xc).sum(-1) * (yc * yc).sum(-1))


def paired_bootstrap(
    scores: dict[str, np.ndarray],
    target: np.ndarray,
    *,
    method: str = "spearman",
    baseline: str | None = None,
    resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, dict[str, float]]:
    """Correlation of each ``scores[name]`` with ``target``, and percentile bootstrap CIs.

    Every score is evaluated on the same resamples of the items (drawn with replacement
    from ``numpy.random.default_rng(seed)``), so with ``baseline`` the difference
    ``corr(name) - corr(baseline)`` gets a paired CI as well (key ``"{name} - {baseline}"``).
    Items with a non-finite target or score are dropped first (from all scores alike).
    """
    from scipy.stats import rankdata

    if method not in ("spearman", "pearson"):
        raise ValueError(f"paired_bootstrap: method must be 'spearman' or 'pearson', got {method!r}")
    target = np.asarray(target, dtype=float)
    cols = {k: np.asarray(v, dtype=float) for k, v in scores.items()}
    for k, v in cols.items():
        if v.shape != target.shape:
            raise ValueError(
                f"paired_bootstrap: scores[{k!r}].shape={v.shape} differs from target.shape={target.shape}"
            )
    if baseline is not None and baseline not in cols:
        raise ValueError(f"paired_bootstrap: baseline {baseline!r} is not one of {sorted(cols)}")
    ok = np.isfinite(target) & np.logical_and.reduce([np.isfinite(v) for v in cols.values()])
    target, cols = target[ok], {k: v[ok] for k, v in cols.items()}
    n = int(ok.sum())
    rank = (lambda a: rankdata(a, axis=-1)) if method == "spearman" else (lambda a: a)
    point = {k: float(_row_corr(rank(v), rank(target))) for k, v in cols.items()}
    rng = np.random.default_rng(seed)
    boot: dict[str, list[np.ndarray]] = {k: [] for k in cols}
    for lo in range(0, resamples, 200):
        idx = rng.integers(0, n, size=(min(200, resamples - lo), n))
        t = rank(target[idx])
        for k, v in cols.items():
            boot[k].append(_row_corr(rank(v[idx]), t))
    q = [50 * (1 - level), 50 * (1 + level)]
    out = {}
    draws = {k: np.concatenate(b) for k, b in boot.items()}
    for k in cols:
        lo_, hi_ = np.nanpercentile(draws[k], q)
        out[k] = {"value": point[k], "ci_low": float(lo_), "ci_high": float(hi_), "n": n}
    if baseline is not None:
        for k in cols:
            if k == baseline:
                continue
            d = draws[k] - draws[baseline]
            lo_, hi_ = np.nanpercentile(d, q)
            out[f"{k} - {baseline}"] = {
                "value": point[k] - point[baseline],
                "ci_low": float(lo_),
                "ci_high": float(hi_),
                "n": n,
            }
    return out

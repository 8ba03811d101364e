"""Small statistics shared by the summaries and the experiments: log-log fits, rank correlation."""
from __future__ import annotations

import math
from typing import Any

import numpy as np


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
    if ok.sum() < 3:
        return math.nan
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

"""Small statistics shared by the summaries and the experiments: log-log fits, rank correlation."""
from __future__ import annotations

import math

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

"""Helpers the experiments share: offline models, figures, table cells, option checks, and the
study statistics the library does not have (Spearman correlations of one variable with several on
shared bootstrap resamples, partial ones given a control; bin means with their CIs).

Library code stays in normfast and is called from there (bootstrap CIs and correlations:
:mod:`normfast.core.bootstrap`, :mod:`normfast.core.stats`; strict JSON:
:func:`normfast.data.io.json_ready`).
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import numpy as np

#: The heat's plain draw (the first M of the drift's batches, unweighted), for the experiments whose
#: protocols and committed results predate the engine's default of drawing the heat's batches by their
#: gradient energy (issue 39: ``ProbeConfig.heat_sampling``): they ask for the estimator they were
#: measured with, so that their committed numbers still reproduce. What the default gives instead is
#: measured by ``python -m bench run heat_sampling``.
PLAIN_HEAT = {"heat_sampling": "uniform"}

#: all-MiniLM-L6-v2's last layer: the parameters the demo probes (normfast.apps.demo), and with it the
#: token experiments (e3, corpus, adaptive_m, prober, serve_load, corpus_recipe)
MINILM_LAST_LAYER = r"encoder\.layer\.5\."


#: The token experiments' probe settings: forward mode (jvp), one row per token, plain SGD at η = 1e-3,
#: λ = 1e-2 (the library's defaults today, spelled out because they are the protocols' settings), in the
#: order the experiments that record them write them
TOKEN_PROBE = {"mode": "jvp", "output": "tokens", "optimizer": "sgd", "lr": 1e-3, "weight_decay": 1e-2}


def token_probe(params: str = MINILM_LAST_LAYER, **settings: Any) -> Any:
    """The :class:`normfast.ProbeConfig` of :data:`TOKEN_PROBE` through ``params``; ``settings``: the rest
    (M, batch size, seed, chunk size, the drift's batches, ...)."""
    import normfast

    return normfast.ProbeConfig(params=params, **TOKEN_PROBE, **settings)


def offline() -> None:
    """No hub access, quiet tokenizers: every model an experiment loads ships in a Python package."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def product_protocol(module: str) -> str:
    """The docstring of a product's package (``bench.experiments.e1``, ...), read without importing
    it (they import torch): a product experiment states the protocol its command states."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(module)
    return ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or ""


def names_in(text: str, known: Any, experiment: str, what: str = "model") -> list[str]:
    """The comma-separated names of ``text``; ValueError naming any that ``known`` lacks."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{experiment}: unknown {what}(s) {unknown}; choose from {list(known)}")
    return names


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Any, dpi: int = 120) -> Any:
    """Write ``fig`` to ``path`` (PNG) and close it; returns ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def fmt(x: float | None, digits: int = 3) -> str:
    """``x`` with ``digits`` decimals; "n/a" for None (a statistic a run could not form)."""
    if x is None:
        return "n/a"
    return f"{x:.{digits}f}"


def value_ci(block: dict[str, float], digits: int = 3) -> str:
    """``+v [+lo, +hi]`` of a bootstrap block (``value``, ``ci_low``, ``ci_high``)."""
    return f"{block['value']:+.{digits}f} [{block['ci_low']:+.{digits}f}, {block['ci_high']:+.{digits}f}]"


def missing_extra(experiment: str, exc: Exception) -> Exception:
    """A :class:`bench.harness.UsageError` saying which optional data or model is missing."""
    from bench.harness import UsageError

    return UsageError(f"{experiment}: {exc}")


# ---------------------------------------------------------------------------
# rank correlations with shared bootstrap resamples, bin means


def _ranks(a: np.ndarray) -> np.ndarray:
    """Average ranks along the last axis (ties share their mean rank)."""
    from scipy.stats import rankdata

    return rankdata(a, axis=-1)


def _row_pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    xc = x - x.mean(axis=-1, keepdims=True)
    yc = y - y.mean(axis=-1, keepdims=True)
    den = np.sqrt((xc * xc).sum(-1) * (yc * yc).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return (xc * yc).sum(-1) / den


def _residualize(r: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Residual of ``r`` after a least-squares line in ``c`` (row-wise)."""
    rc = r - r.mean(axis=-1, keepdims=True)
    cc = c - c.mean(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        beta = (rc * cc).sum(-1, keepdims=True) / (cc * cc).sum(-1, keepdims=True)
    return rc - beta * cc


def bootstrap_rank_corrs(
    x: np.ndarray,
    ys: dict[str, np.ndarray],
    *,
    control: np.ndarray | None = None,
    resamples: int = 1000,
    seed: int = 0,
    block: int = 100,
) -> dict[str, dict[str, Any]]:
    """Spearman correlation of ``x`` with each ``ys[name]`` (partial, given ``control``) and bootstrap CIs.

    Items with a non-finite value in ``x``, ``control`` or any ``ys`` are dropped
    first, so every correlation uses the same items and the same resamples
    (``resamples`` draws of the items with replacement from
    ``numpy.random.default_rng(seed)``). The CI is the 2.5 / 97.5 percentile.
    """
    cols = [np.asarray(x, float)] + [np.asarray(v, float) for v in ys.values()]
    if control is not None:
        cols.append(np.asarray(control, float))
    ok = np.logical_and.reduce([np.isfinite(c) for c in cols])
    n = int(ok.sum())
    xs = np.asarray(x, float)[ok]
    yv = {k: np.asarray(v, float)[ok] for k, v in ys.items()}
    ctrl = np.asarray(control, float)[ok] if control is not None else None
    out: dict[str, dict[str, Any]] = {k: {"rho": math.nan, "ci_low": math.nan, "ci_high": math.nan, "n": n} for k in ys}
    if n < 10:
        return out

    def corr(rx: np.ndarray, y: np.ndarray, rc: np.ndarray | None) -> np.ndarray:
        ry = _ranks(y)
        if rc is None:
            return _row_pearson(rx, ry)
        return _row_pearson(_residualize(rx, rc), _residualize(ry, rc))

    rx0 = _ranks(xs)
    rc0 = _ranks(ctrl) if ctrl is not None else None
    for k, y in yv.items():
        out[k]["rho"] = float(corr(rx0, y, rc0))
    rng = np.random.default_rng(seed)
    boot: dict[str, list[np.ndarray]] = {k: [] for k in ys}
    for lo in range(0, resamples, block):
        idx = rng.integers(0, n, size=(min(block, resamples - lo), n))
        rx = _ranks(xs[idx])
        rc = _ranks(ctrl[idx]) if ctrl is not None else None
        for k, y in yv.items():
            boot[k].append(corr(rx, y[idx], rc))
    for k in ys:
        b = np.concatenate(boot[k])
        b = b[np.isfinite(b)]
        if b.size:
            out[k]["ci_low"], out[k]["ci_high"] = (float(v) for v in np.percentile(b, [2.5, 97.5]))
        out[k]["resamples"] = int(b.size)
    return out


def binned(values: np.ndarray, keys: np.ndarray, edges: Sequence[float] | None) -> list[dict[str, Any]]:
    """Mean and normal 95% CI of ``values`` per bin of ``keys`` (integer keys when ``edges`` is None)."""
    ok = np.isfinite(values) & np.isfinite(keys)
    v, k = values[ok], keys[ok]
    rows = []
    if edges is None:
        groups = [(float(b), float(b), k == b) for b in np.unique(k)]
    else:
        groups = [(float(lo), float(hi), (k >= lo) & (k < hi)) for lo, hi in zip(edges[:-1], edges[1:])]
    for lo, hi, m in groups:
        n = int(m.sum())
        if n == 0:
            continue
        mean = float(v[m].mean())
        half = float(1.96 * v[m].std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
        rows.append(
            {
                "lo": lo,
                "hi": hi,
                "center": (lo + hi) / 2,
                "n": n,
                "mean": mean,
                "ci_low": mean - half,
                "ci_high": mean + half,
            }
        )
    return rows

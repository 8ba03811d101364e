"""The figures of a run (``ProbeResult.plots()``, ``normfast report``) and of its per-type table
(``normfast aggregate --plot``)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from normfast.core.stats import loglog_fit
from normfast.engine.diagnostics.regime import describe_short
from normfast.engine.report.ranking import run_ranking
from normfast.engine.report.summary import applicable_rows, result_regime, used_rows

#: font sizes of the figures (points): readable at the size the pages show them
LABEL_SIZE, TICK_SIZE, TITLE_SIZE = 11, 10, 11
RC = {
    "axes.labelsize": LABEL_SIZE,
    "xtick.labelsize": TICK_SIZE,
    "ytick.labelsize": TICK_SIZE,
    "legend.fontsize": TICK_SIZE - 1,
    "axes.titlesize": TITLE_SIZE,
}


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend: every figure here is written to a file, never shown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | os.PathLike) -> Path:
    """Lay ``fig`` out, write it to ``path`` as a 120-dpi PNG (its folder made when missing) and close it;
    returns the path. Every figure normfast writes goes through here."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def make_plots(result, outdir: str | Path, prefix: str = "probe") -> list[Path]:
    """Write the standard figures; returns their paths.

    * ``{prefix}_norm_vs_req.png``: observed norm against R_eq (full and heat-only law), log-log,
      with the 95% intervals of R_eq as error bars;
    * ``{prefix}_heat.png``: the heat V² of every row (sorted) with its 95% interval (a histogram
      when the run has no error bars), and the distribution of D;
    * ``{prefix}_tokens.png`` (token runs): the hottest and coldest tokens.
    """
    with pyplot().rc_context(RC):
        return _make_plots(result, Path(outdir), prefix)


def _make_plots(result, outdir: Path, prefix: str) -> list[Path]:
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    heat, drift = result.heat_column, result.drift_column
    valid = used_rows(result)
    norm = result.column("norm")[valid]
    paths = []

    regime = result_regime(result)
    applies = applicable_rows(result)[valid]
    fig, axes = plt.subplots(1, 2, figsize=(10, 5.0))
    names = result.column_names
    for ax, col, label in ((axes[0], "r_eq", "full law"), (axes[1], "r_eq_heat", "heat-only law (D = 0)")):
        x = result.column(col)[valid]
        ok = np.isfinite(x) & (x > 0) & (norm > 0)
        ax.loglog(x[ok & applies], norm[ok & applies], ".", ms=3, alpha=0.5, label="law applies")
        if np.any(ok & ~applies):
            ax.loglog(
                x[ok & ~applies],
                norm[ok & ~applies],
                ".",
                ms=3,
                alpha=0.4,
                color="0.6",
                label="no prediction (law not applicable, or objective saturated)",
            )
        if f"{col}_lo" in names:
            lo, hi = result.column(f"{col}_lo")[valid], result.column(f"{col}_hi")[valid]
            bar = ok & applies & np.isfinite(lo) & np.isfinite(hi)
            idx = np.nonzero(bar)[0]
            idx = idx[:: max(1, len(idx) // 300)]  # at most ~300 bars stay readable
            if len(idx):
                ax.errorbar(
                    x[idx],
                    norm[idx],
                    xerr=[x[idx] - np.maximum(lo[idx], x[idx] * 1e-3), hi[idx] - x[idx]],
                    fmt="none",
                    ecolor="tab:gray",
                    elinewidth=0.5,
                    alpha=0.5,
                    label="95% interval (jackknife over batch groups)",
                )
        fit = loglog_fit(x[applies], norm[applies])
        if np.isfinite(fit["slope"]):
            xs = np.geomspace(x[ok].min(), x[ok].max(), 50)
            ax.loglog(
                xs,
                np.exp(fit["intercept"]) * xs ** fit["slope"],
                "k-",
                lw=1,
                label=f"slope {fit['slope']:.2f}, r {fit['pearson_r']:.2f}",
            )
        # below the axes: a legend never covers the points
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
        _plain_log_ticks(ax)
        ax.set_xlabel(f"predicted R_eq ({label})")
        ax.set_ylabel("observed norm")
    fig.suptitle(
        f"{result.metadata.get('model')}: observed norm vs equilibrium prediction\n"
        f"{describe_short(regime)}; R_eq = where norms settle if trained at the probe's "
        f"settings",
        fontsize=TITLE_SIZE,
    )
    paths.append(save_figure(fig, outdir / f"{prefix}_norm_vs_req.png"))

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    h_all = result.column(heat)[valid]
    se_col = f"se_{heat}"
    se_all = result.column(se_col)[valid] if se_col in names else np.full(len(h_all), np.nan)
    good = np.isfinite(h_all) & (h_all > 0)
    if np.isfinite(se_all[good]).any():
        # heat against its rank, with its 95% interval: which differences between rows are real
        from normfast.engine.estimators.uncertainty import t_quantile

        order = np.argsort(h_all[good])
        hs, ses = h_all[good][order], se_all[good][order]
        half = t_quantile(int(result.metadata.get("groups") or 2) - 1) * ses
        pick = np.arange(0, len(hs), max(1, len(hs) // 400))
        axes[0].errorbar(
            pick,
            hs[pick],
            yerr=[np.minimum(half[pick], hs[pick] * 0.999), half[pick]],
            fmt=".",
            ms=2,
            color="tab:red",
            ecolor="tab:gray",
            elinewidth=0.4,
        )
        axes[0].set_yscale("log")
        axes[0].set_xlabel("probe items, by heat")
        axes[0].set_ylabel(f"{heat} with 95% interval")
    else:
        h = h_all[good]
        if h.size:
            axes[0].hist(np.log10(h), bins=60, color="tab:red", alpha=0.8)
        axes[0].set_xlabel(f"log10 {heat} (stochastic heat)")
        axes[0].set_ylabel("probe items")
    d = result.column(drift)[valid]
    d = d[np.isfinite(d)]
    if d.size:
        axes[1].hist(d, bins=60, color="tab:blue", alpha=0.8)
    axes[1].axvline(0, color="k", lw=0.8)
    axes[1].set_xlabel(f"{drift} (radial drift)")
    paths.append(save_figure(fig, outdir / f"{prefix}_heat.png"))

    if "token" in result.column_names and result.column("position").max() >= 0:
        p = _plot_tokens(result, outdir / f"{prefix}_tokens.png")
        if p is not None:
            paths.append(p)
    return paths


def _plain_log_ticks(ax: Any) -> None:
    """Log axes labelled 0.1, 0.2, 0.5, 1, 2, 5, ... in plain numbers, without crowded minor labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    for axis in (ax.xaxis, ax.yaxis):
        lo, hi = sorted(abs(v) for v in axis.get_view_interval())
        decades = math.log10(hi / lo) if lo > 0 and hi > 0 else 99.0
        subs = (1.0, 2.0, 5.0) if decades <= 2.5 else (1.0,)  # wide ranges: the decades alone
        axis.set_major_locator(LogLocator(base=10, subs=subs, numticks=12))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())


def _plot_tokens(result, path: Path) -> Path | None:
    """The hottest and coldest tokens, ranked as in the summary (:mod:`normfast.engine.report.ranking`)."""
    import matplotlib.pyplot as plt

    ranked = run_ranking(result)
    if ranked is None:
        return None
    _, ranking = ranked
    k = min(15, len(ranking.order) // 2)
    if k == 0:
        return None
    pick = list(ranking.coldest(k)) + list(ranking.hottest(k))[::-1]  # bottom to top: coldest ..., ... hottest
    fig, ax = plt.subplots(figsize=(7.5, 0.3 * len(pick) + 1.4))
    ax.barh(range(len(pick)), [ranking.values[i] for i in pick], color=["tab:blue"] * k + ["tab:red"] * k)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(range(len(pick)))
    ax.set_yticklabels([ranking.label(int(i)) for i in pick])
    relative = ranking.key == "heat_rel_mean"
    ax.set_xlabel("mean relative heat (log V2 minus the run's median)" if relative else f"{ranking.measure}")
    if not relative:
        ax.set_xscale("log")
    import textwrap

    note = "\n".join(textwrap.wrap(ranking.note(), 70))
    ax.set_title(f"coldest (blue) and hottest (red) tokens; ×n: occurrences\n{note}", fontsize=TICK_SIZE)
    return save_figure(fig, path)


def plot_type_heat(
    table: pa.Table,
    path: str | os.PathLike,
    *,
    quantity: str = "V2",
    min_count: int = 2,
    title: str | None = None,
    ax: Any = None,
) -> Path | None:
    """Type heat (mean ``quantity`` per type ± one standard error) against corpus frequency.

    One point per type with at least ``min_count`` valid occurrences (error bars need two),
    log-log axes, plus the median of the type means per frequency bin (powers of two).
    With ``ax`` draws into it and returns None; otherwise writes ``path``.
    """
    plt = pyplot()
    count = table.column("count").to_numpy().astype(float)
    mean = table.column(f"{quantity}_mean").to_numpy(zero_copy_only=False).astype(float)
    se = table.column(f"{quantity}_se").to_numpy(zero_copy_only=False).astype(float)
    ok = (count >= min_count) & np.isfinite(mean) & (mean > 0)
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
    lo = np.clip(mean[ok] - se[ok], mean[ok] * 1e-3, None)
    err = np.vstack([mean[ok] - lo, np.nan_to_num(se[ok])])
    ax.errorbar(
        count[ok],
        mean[ok],
        yerr=err,
        fmt="o",
        ms=2,
        lw=0.5,
        alpha=0.35,
        color="tab:blue",
        ecolor="tab:blue",
        label=f"type mean ± SE ({int(ok.sum())} types, count ≥ {min_count})",
    )
    if ok.any():
        edges = 2.0 ** np.arange(math.floor(math.log2(count[ok].min())), math.ceil(math.log2(count[ok].max())) + 2)
        centers, medians = [], []
        for a, b in zip(edges[:-1], edges[1:]):
            m = ok & (count >= a) & (count < b)
            if m.sum() >= 3:
                centers.append(math.sqrt(a * b))
                medians.append(float(np.median(mean[m])))
        ax.plot(centers, medians, "-", color="black", lw=1.5, label="median per frequency bin")
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import LogFormatter, NullFormatter

    ax.xaxis.set_major_formatter(LogFormatter(base=10, labelOnlyBase=True))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("corpus frequency (valid occurrences)")
    ax.set_ylabel(f"mean {quantity} per type")
    if title:
        ax.set_title(title, fontsize=TITLE_SIZE)
    ax.legend(fontsize=TICK_SIZE - 1)
    if not own:
        return None
    return save_figure(fig, path)

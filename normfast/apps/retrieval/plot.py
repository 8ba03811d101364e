"""The figure of an alpha sweep: a metric against alpha, overall and per stratum."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np


def plot_sweep(result: Any, path: str | os.PathLike, metric: str = "ndcg@10") -> Path:
    """``metric`` vs alpha on the eval split of ``result`` (a :class:`~normfast.apps.retrieval.sweep.SweepResult`),
    overall (thick) and per stratum.

    The length control is drawn dashed in the same colour; a dotted line marks
    the best alpha. Returns the PNG's path.
    """
    from normfast.engine.report.figures import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = np.asarray(result.alphas)
    groups: list[tuple[str, str | None]] = [("all", None)]
    groups += [(s, s) for s in result.stratum_names()]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for gi, (name, stratum) in enumerate(groups):
        color = "black" if stratum is None else colors[(gi - 1) % len(colors)]
        width = 2.2 if stratum is None else 1.2
        n = result.count("eval", stratum)
        ax.plot(
            x,
            result.curve("norm", metric, "eval", stratum),
            color=color,
            lw=width,
            marker="o",
            ms=3,
            label=f"{name} (n={n}) cos*|d|^a",
        )
        if "length" in result.per_query:
            ax.plot(
                x,
                result.curve("length", metric, "eval", stratum),
                color=color,
                lw=width,
                ls="--",
                label=f"{name} length control cos*len^a",
            )
    best = result.alphas[result.best_index("norm")]
    ax.axvline(best, color="grey", lw=0.8, ls=":")
    ax.axvline(0.0, color="grey", lw=0.5)
    ax.set_xlabel("alpha (exponent of the document norm, or of the length for dashed lines)")
    ax.set_ylabel(metric.upper() if metric != "mrr" else "MRR")
    split, chosen = ("test split", "dev split") if result.select_on == "dev" else ("all queries", "all queries")
    ax.set_title(f"{metric} vs alpha ({split}); dotted: best alpha {best:+.2f} (chosen on {chosen})", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    return save_figure(fig, path)

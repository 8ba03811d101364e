"""E3's figures (binned quantities against frequency and depth) and tables (the README's, every view)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bench.common import pyplot, save
from bench.experiments.e3 import LOG_QUANTITIES, MIN_BIN_COUNT, QUANTITIES, VIEWS


def _label(q: str) -> str:
    names = {
        "norm": "token norm",
        "V2": "heat V²",
        "D": "drift D",
        "r_eq": "R_eq (full law)",
        "r_eq_heat": "R_eq (heat only)",
        "pooled_norm": "pooled norm",
    }
    return f"log10 {names[q]}" if q in LOG_QUANTITIES else names[q]


def plot_bins(summary: dict[str, Any], key: str, path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    # the second series is nudged right so that coinciding bins stay visible
    nudge = 0.04 if key == "zipf" else 0.08
    styles = {
        "first_piece": ("black", "o", "all words, first word-piece", 0.0),
        "single_token": ("tab:red", "s", "single-token words", nudge),
    }
    for ax, q in zip(axes.ravel(), QUANTITIES):
        for view, (color, marker, label, dx) in styles.items():
            rows = [r for r in summary["bins"][view][key][q] if r["n"] >= MIN_BIN_COUNT]
            if not rows:
                continue
            x = np.array([r["center"] for r in rows]) + dx
            y = np.array([r["mean"] for r in rows])
            err = np.array([[r["mean"] - r["ci_low"] for r in rows], [r["ci_high"] - r["mean"] for r in rows]])
            ax.errorbar(x, y, yerr=np.nan_to_num(err), color=color, marker=marker, ms=3, lw=1, capsize=2, label=label)
        target = "zipf" if key == "zipf" else "depth"
        c = summary["correlations"]["first_piece"][target][q]
        ax.set_title(f"{_label(q)}   ρ = {c['rho']:+.3f} [{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]", fontsize=8.5)
        ax.set_xlabel("Zipf frequency" if key == "zipf" else "WordNet hypernym depth (first noun sense)", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0, 0].legend(fontsize=7)
    n = summary["counts"]["words"]
    fig.suptitle(
        f"E3: all-MiniLM-L6-v2 token probe of {n} words, last layer, SimCSE, "
        f"M={summary['protocol']['probe']['M']} -- bin means ± 95% CI "
        f"(ρ: Spearman over all words, bootstrap CI)",
        fontsize=9.5,
    )
    return save(fig, path)


def format_table(summary: dict[str, Any]) -> str:
    lines = []
    for view in VIEWS:
        lines.append(f"\n[{view}]  Spearman rho [95% CI] (n)")
        head = f"{'quantity':<12}" + "".join(f"{t:>30}" for t in ("zipf", "depth", "depth|zipf"))
        lines.append(head)
        for q in QUANTITIES:
            cells = []
            for t in ("zipf", "depth", "depth|zipf"):
                c = summary["correlations"][view][t][q]
                cells.append(f"{c['rho']:+.3f} [{c['ci_low']:+.3f},{c['ci_high']:+.3f}] ({c['n']})")
            lines.append(f"{q:<12}" + "".join(f"{s:>30}" for s in cells))
        for t in ("depth_attested", "depth_synsets", "depth_attested|zipf", "depth_synsets|zipf"):
            lines.append(
                f"{t:<20}"
                + ", ".join(
                    f"{q} {c['rho']:+.3f} [{c['ci_low']:+.3f},{c['ci_high']:+.3f}]"
                    for q, c in summary["correlations"][view][t].items()
                )
                + f" (n={summary['correlations'][view][t]['norm']['n']})"
            )
        lines.append(
            "Spearman(norm, X): "
            + ", ".join(
                f"{q} {c['rho']:+.3f} [{c['ci_low']:+.3f},{c['ci_high']:+.3f}]"
                for q, c in summary["correlations"][view]["norm"].items()
            )
        )
    e = summary["engine"]
    lines.append(
        f"\ndrift |D| > 2 se on {e['drift_significant_fraction']:.1%} of words, D > 0 on "
        f"{e['drift_positive_fraction']:.1%}; bistable {e['bistable_fraction']:.1%}"
    )
    rt = summary["runtime"]
    lines.append(
        f"probe {rt['probe_seconds']:.1f} s ({rt['token_rows_per_second']:.0f} token rows/s, "
        f"{rt['threads']} thread(s)); total {rt['total_seconds']:.1f} s"
    )
    return "\n".join(lines)


def _rho(block: dict) -> str:
    return f"{block['rho']:+.3f} [{block['ci_low']:+.3f}, {block['ci_high']:+.3f}]"


def table_e3(d: dict) -> str:
    c = d["correlations"]["first_piece"]
    partial = c.get("depth|zipf") or c.get("depth_given_zipf")
    label = {
        "norm": "token norm",
        "V2": "heat V²",
        "D": "drift D",
        "r_eq": "R_eq (full law)",
        "r_eq_heat": "R_eq (heat-only law)",
        "pooled_norm": "pooled (sentence) norm of the word",
    }
    head = (
        f"| Spearman ρ [95% CI] with | Zipf frequency (n = {c['zipf']['norm']['n']:,}) "
        f"| WordNet depth (n = {c['depth']['norm']['n']:,}) |"
    )
    rows = [head + (" depth, Zipf held fixed |" if partial else ""), "|---|---|---|" + ("---|" if partial else "")]
    for k in ("norm", "V2", "D", "r_eq", "r_eq_heat", "pooled_norm"):
        line = f"| {label[k]} | {_rho(c['zipf'][k])} | {_rho(c['depth'][k])} |"
        if partial:
            line += f" {_rho(partial[k])} |"
        rows.append(line)
    p = d["protocol"]["probe"]
    rows += [
        "",
        f"{d['counts']['words']:,} words ({d['counts']['token_rows']:,} token rows), value = the first "
        f"word-piece; jvp mode on `{p['params']}`, SimCSE, M = {p['M']}, batch {p['batch_size']}, "
        f"{p['optimizer']} lr {p['lr']} / wd {p['weight_decay']}.",
    ]
    return "\n".join(rows)

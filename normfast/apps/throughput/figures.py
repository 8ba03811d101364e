"""The suite's figures."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from normfast.engine.report.figures import pyplot, save_figure

# ============================================================================
# Figures
# ============================================================================


def _bar(ax, seconds: dict[str, dict], title: str, ratio_base: str) -> None:
    names = list(seconds)
    p50 = np.array([seconds[n]["p50"] for n in names])
    lo = p50 - np.array([seconds[n]["p20"] for n in names])
    hi = np.array([seconds[n]["p80"] for n in names]) - p50
    ax.bar(range(len(names)), p50, yerr=[lo, hi], color=["C0" if n == ratio_base else "C7" for n in names], capsize=3)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=15, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (p50, bars p20-p80)")
    ax.set_title(title, fontsize=9)
    base = seconds.get(ratio_base, {}).get("p50")
    if base:
        for i, n in enumerate(names):
            if n != ratio_base:
                ax.annotate(f"{p50[i] / base:.1f}x", (i, p50[i] + hi[i]), ha="center", va="bottom", fontsize=8)


def plot_head(section: dict, path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    c = section["config"]
    _bar(ax, section["seconds"], f"head mode vs per-sample gradients\nN={c['n']}, d={c['dim']}, M={c['m']}", "normfast")
    return save_figure(fig, path)


def plot_jvp(jacrev: dict | None, minilm: dict | None, path: Path) -> Path:
    plt = pyplot()
    panels = [p for p in (jacrev, minilm) if p is not None]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    for ax, sec in zip(axes[0], panels):
        if sec is jacrev:
            c = sec["config"]
            _bar(ax, sec["seconds"], f"jvp vs per-probe jacrev, MLP {c['widths']}\nN={c['n']}, M={c['m']}", "normfast")
        else:
            c = sec["config"]
            _bar(
                ax,
                sec["seconds"],
                f"MiniLM last layer, token level\n{c['comparison_tokens']} tokens, M={c['m']}, K={c['k']}",
                "batched",
            )
    return save_figure(fig, path)


def plot_scaling(section: dict, path: Path) -> Path:
    plt = pyplot()
    runs = section["runs"]
    n = np.array([r["tokens"] for r in runs], dtype=float)
    fit = section["linear_fit"]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(13, 3.8))
    a1.loglog(n, [r["seconds"] for r in runs], "o", label="measured")
    grid = np.geomspace(n.min(), n.max(), 50)
    a1.loglog(
        grid,
        fit["fixed_seconds"] + fit["seconds_per_token"] * grid,
        "--",
        label=f"{fit['fixed_seconds']:.2f} s + N / {fit['tokens_per_s_marginal']:.0f} per s",
    )
    a1.set_xlabel("token rows N")
    a1.set_ylabel("wall seconds")
    a1.legend(fontsize=8)
    a1.set_title(f"engine, head mode (slope over the top decade {section['loglog_slope_top_decade']:.2f})", fontsize=9)
    a2.semilogx(n, [r["tokens_per_s"] for r in runs], "o-")
    a2.set_xlabel("token rows N")
    a2.set_ylabel("tokens / s")
    a2.set_ylim(bottom=0)
    a2.set_title("throughput (fixed cost amortized as N grows)", fontsize=9)
    a3.semilogx(n, [r["peak_rss_mb"] for r in runs], "o-", label="peak RSS")
    if all(r.get("streaming_peak_rss_mb") is not None for r in runs):
        a3.semilogx(n, [r["streaming_peak_rss_mb"] for r in runs], "^-", label="peak before the final read-back")
    a3.semilogx(n, [r["rss_after_setup_mb"] for r in runs], "s--", label="after set-up")
    a3.set_xlabel("token rows N")
    a3.set_ylabel("MB")
    a3.set_ylim(bottom=0)
    a3.legend(fontsize=8)
    a3.set_title("resident memory (a fresh process per N)", fontsize=9)
    return save_figure(fig, path)

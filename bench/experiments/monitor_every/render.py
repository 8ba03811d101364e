"""The monitor-every study's figure and tables."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.experiments.monitor_every.settings import R_MIN, SLOPE

# ---------------------------------------------------------------------------
# figure and tables


def _summary(result: dict[str, Any]) -> dict[tuple[int, bool, int], dict[str, float]]:
    """Per (every, average, window): the worst slope and r over models and seeds, cells met, median stationarity."""
    out: dict[tuple[int, bool, int], list[dict[str, Any]]] = {}
    for res in result["results"]:
        for r in res["rows"]:
            out.setdefault((r["every"], r["average"], r["window_steps"]), []).append(r)
    return {
        k: {
            "slope_min": min(r["slope"] for r in v),
            "slope_max": max(r["slope"] for r in v),
            "r_min": min(r["pearson_r"] for r in v),
            "met": sum(r["meets_target"] for r in v),
            "cells": len(v),
            "net": statistics.median(r["net_change_median"] for r in v),
            "balance": statistics.median(r["balance_median"] for r in v),
        }
        for k, v in out.items()
    }


def figures(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = _summary(result)
    windows = sorted({k[2] for k in summary})
    everies = sorted({k[0] for k in summary})
    fig, axes = plt.subplots(1, 3, figsize=(13, 5.2))
    for ax, what, label in (
        (axes[0], "slope", "log-log slope (worst over models and seeds)"),
        (axes[1], "r", "Pearson r (lowest over models and seeds)"),
    ):
        for j, window in enumerate(windows):
            for average, style in ((False, "--"), (True, "-")):
                keys = sorted(k for k in summary if k[1] == average and k[2] == window)
                if average:
                    keys = [k for k in sorted(summary) if k[0] == 1 and k[2] == window] + keys
                xs = [k[0] for k in keys]
                ys = [_worst_slope(summary[k]) if what == "slope" else summary[k]["r_min"] for k in keys]
                name = "averaged" if average else "sampled"
                ax.plot(xs, ys, style, marker="o", ms=3.5, color=f"C{j}", label=f"{window} steps, {name}")
        if what == "slope":
            ax.axhspan(*SLOPE, color="0.92", zorder=0)
        else:
            ax.axhspan(R_MIN, 1.0, color="0.92", zorder=0)
        _every_axis(ax, everies, "every (steps per stored row)")
        ax.set_title(f"{label}\ngrey: E1's target; dashed: sampled, solid: averaged", fontsize=9)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    ax = axes[2]
    for j, window in enumerate(windows):
        for measure, style in (("balance", "--"), ("net", "-")):
            keys = sorted(k for k in summary if not k[1] and k[2] == window)
            name = "old balance" if measure == "balance" else "net change"
            ys = [summary[k][measure] for k in keys]
            ax.plot([k[0] for k in keys], ys, style, marker="o", ms=3.5, color=f"C{j}", label=f"{window} steps, {name}")
    ax.set_yscale("log")
    _every_axis(ax, everies, "every (sampled)")
    ax.set_title("stationarity against the decay term (median)\ndashed: old balance; solid: net change", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "monitor_every.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def _every_axis(ax: Any, everies: list[int], label: str) -> None:
    ax.set_xscale("log")
    from matplotlib.ticker import NullLocator

    ax.set_xticks(everies, [str(e) for e in everies])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(label)


def _worst_slope(s: dict[str, float]) -> float:
    """Of the lowest and highest slope, the one further from 1."""
    return s["slope_min"] if abs(1 - s["slope_min"]) >= abs(1 - s["slope_max"]) else s["slope_max"]


def _candidate_label(every: int, average: bool) -> str:
    return f"{every}, {'averaged' if average else 'sampled'}"


def table_every(d: dict[str, Any]) -> str:
    summary = _summary(d)
    windows = sorted({k[2] for k in summary})
    head = " | ".join(f"{w} steps: slope / r (met)" for w in windows)
    rows = [f"| every | {head} | stationarity, {windows[-1]} steps: net change / old balance |"]
    rows.append("|---" * (2 + len(windows)) + "|")
    for every, average in sorted({(k[0], k[1]) for k in summary}, key=lambda c: (c[1], c[0])):
        cells = []
        for w in windows:
            s = summary[(every, average, w)]
            cells.append(f"{_worst_slope(s):.2f} / {s['r_min']:.3f} ({s['met']}/{s['cells']})")
        st = summary[(every, average, windows[-1])]
        rows.append(
            f"| {_candidate_label(every, average)} | {' | '.join(cells)} | {st['net']:.3f} / {st['balance']:.3f} |"
        )
    dec = d["decision"]
    models = sorted({r["model"] for r in d["results"]})
    seeds = sorted({r["seed"] for r in d["results"]})
    rows += [
        "",
        f"Each cell: the slope furthest from 1 and the lowest r over {len(models)} models ({', '.join(models)}) × "
        f"{len(seeds)} seeds ({', '.join(map(str, seeds))}), and in how many of them the law meets E1's target "
        f"(slope in [{SLOPE[0]}, {SLOPE[1]}], r ≥ {R_MIN}). Decision (protocol step 7): every = {dec['every']}, "
        f"{'averaged' if dec['average'] else 'sampled'}, meeting the target in {dec['cells_met']} of {dec['cells']} "
        f"cells, at {dec['wall_ratio']:.2f}× the wall time of training without the monitor on E1's MLP.",
    ]
    return "\n".join(rows)


def table_cost(d: dict[str, Any]) -> str:
    c = d["cost"]
    rows = [
        "| loop | monitor | wall time / without | wall-clock overhead | the monitor's own report | report / wall |",
        "|---|---|---|---|---|---|",
    ]
    loops = [(f"E1's MLP ({c['items']} items)", c["arms"])]
    if "minilm" in c:
        loops.append((f"MiniLM's last layer ({c['minilm']['items']} items)", c["minilm"]["arms"]))
    for label, arms in loops:
        for a in arms:
            if a["monitor_clock_overhead"] is None:
                rows.append(f"| {label} | none | 1.00 | — | — | — |")
                continue
            ratio = a.get("clock_over_wall")
            rows.append(
                f"| {label} | {a['arm']} | {a['wall_ratio']:.2f} | {_signed(a['wall_ratio'] - 1)} | "
                f"{_signed(a['monitor_clock_overhead'])} | {'—' if ratio is None else f'{ratio:.2f}'} |"
            )
    rows += [
        "",
        f"E1's {c['model']}: {c['steps']} steps from scratch per arm, median over {c['rounds']} rounds"
        + (
            f"; MiniLM: {c['minilm']['steps']} steps per arm, median over {c['minilm']['rounds']} rounds"
            if "minilm" in c
            else ""
        )
        + "; each loop in one process with the arms' order rotated (wall time includes `close()`). The monitor's "
        "report is `summary.json`'s `overhead`: the wall time it saw against its clean steps (without the monitor's "
        "work before them).",
    ]
    return "\n".join(rows)


def _signed(x: float) -> str:
    return f"{100 * x:+.0f}%"


def table_decision(d: dict[str, Any]) -> str:
    """The chosen candidate's law per model, window and seed: where it meets E1's target and where not."""
    dec = d["decision"]
    label = _candidate_label(dec["every"], dec["average"])
    windows = sorted({r["window_steps"] for res in d["results"] for r in res["rows"]})
    head = " | ".join(f"{w} steps: slope / r" for w in windows)
    rows = [f"| model | seed | {head} |", "|---" * (2 + len(windows)) + "|"]
    for res in sorted(d["results"], key=lambda r: (r["model"], r["seed"])):
        cells = []
        for w in windows:
            r = next(
                x
                for x in res["rows"]
                if x["every"] == dec["every"] and x["average"] == dec["average"] and x["window_steps"] == w
            )
            mark = "" if r["meets_target"] else " ✗"
            cells.append(f"{r['slope']:.2f} / {r['pearson_r']:.3f}{mark}")
        rows.append(f"| {res['model']} | {res['seed']} | {' | '.join(cells)} |")
    rows += [
        "",
        f"The decision's candidate (every = {label}); ✗: misses E1's target (slope in [{SLOPE[0]}, {SLOPE[1]}], "
        f"r ≥ {R_MIN}).",
    ]
    return "\n".join(rows)


def tables(d: dict[str, Any]) -> dict[str, str]:
    return {
        "monitor-every": table_every(d),
        "monitor-every-cost": table_cost(d),
        "monitor-every-decision": table_decision(d),
    }

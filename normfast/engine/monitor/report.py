"""``normfast report FOLDER`` for a monitor folder: the text, ``report.json``, ``report_items.csv`` and
``monitor_norms.png`` (what the numbers are: :mod:`normfast.engine.monitor.analysis`; every key and
column of the files: :mod:`normfast.engine.monitor.report_schema`)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from normfast.engine.monitor.analysis import analyze
from normfast.engine.monitor.report_schema import FIGURE_FILE, ITEMS_FILE, REPORT_FILE

FIT_LABELS = {
    "realized_law": "law from the realized terms",
    "realized_law_no_remainder": "  the same without the curvature remainder",
    "virtual_law": "law from the virtual estimates (window mean)",
    "virtual_heat_only": "  the same, heat only (D = 0)",
    "virtual_last_state": "  the last recorded state alone",
}


def _pct(x: Any) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


def format_report(result: dict[str, Any], *, top: int = 8) -> str:
    """The report as text (what ``normfast report FOLDER`` prints)."""
    r, w = result, result["window"]
    lines = [
        f"monitor folder {r['folder']}" + ("" if r["finished"] else " (unfinished: its finished blocks)"),
        f"  {r['optimizer']} ({r['law']} law), lr {r['lr']:.3g}, weight decay {r['weight_decay']:.3g}"
        + (f", momentum {r['momentum']:g}" if r["momentum"] else "")
        + (f", beta1 {r['beta1']:g}" if r.get("beta1") else "")
        + f"; {r['n_items']} items, {r['recorded_steps']} recorded steps (every {r['every']})",
        f"  window: the last {w['recorded_steps']} recorded steps (steps {w['first_step']}-{w['last_step']})"
        + (f"; realized terms from {w['term_steps']} steps" if "term_steps" in w else ""),
    ]
    st = r["stationarity"]
    line = f"  stationarity: mean norm moved {_pct(st['norm_halves_median_rel_change'])} between the window's halves"
    if "net_change_median" in st:
        line += (
            f"; net change of R² per step (first to last quarter) / |mean decay| = {st['net_change_median']:.3f} "
            f"(median over items; 0: stationary)"
        )
    lines.append(line)
    if r["fits"]:
        lines.append("")
        lines.append("| prediction of the window-mean norm | slope | r | items without one |")
        lines.append("|---|---|---|---|")
        for key, fit in r["fits"].items():
            lines.append(
                f"| {FIT_LABELS.get(key, key).strip()} | {fit['slope']:.3f} | {fit['pearson_r']:.3f} | "
                f"{fit['n_no_prediction']} |"
            )
    if r["dominant"]:
        d = r["dominant"]
        lines.append("")
        lines.append(f"held up by heat: {d['heat']} items; by drift: {d['drift']} items (from {d['from']})")
    t = r.get("timing")
    if t:
        clean = t.get("clean_steps") or 0
        how = (
            f"the wall time against {t.get('steps')} training steps timed as without the monitor ({clean} clean steps)"
            if clean
            else "the monitor's own time against the training's (no clean step timed: a lower bound)"
        )
        lines.append(
            f"monitor overhead: {_pct(t.get('overhead'))} of the training time (realized terms "
            f"{_pct(t.get('overhead_terms'))}, virtual probes {_pct(t.get('overhead_virtual'))}, the training's own "
            f"steps slowed by {_pct(t.get('overhead_interference')) if clean else 'an unmeasured amount'}; "
            f"{t.get('steps')} steps, {t.get('recorded_steps')} recorded): {how}"
        )
    items = r["items"]
    if top > 0 and "r_eq_realized" in items:
        order = np.argsort(items["observed"])
        pick = list(order[::-1][:top]) + (list(order[:top][::-1]) if len(order) > top else [])
        cols = [("observed", "observed"), ("r_eq_realized", "R_eq realized")]
        if "r_eq_virtual" in items:
            cols.append(("r_eq_virtual", "R_eq virtual"))
        cols += [("task1", "task1"), ("task2", "task2"), ("decay", "decay"), ("remainder", "remainder")]
        lines.append("")
        lines.append(f"the {top} largest and smallest window-mean norms (terms: window means per step)")
        lines.append(
            "| id | " + " | ".join(label for _, label in cols) + (" | held by |" if "dominant" in items else " |")
        )
        lines.append("|---" * (len(cols) + 1 + ("dominant" in items)) + "|")
        for i in pick:
            cells = [f"{items[k][i]:.4g}" for k, _ in cols]
            dom = f" | {items['dominant'][i]}" if "dominant" in items else ""
            lines.append(f"| {items['id'][i]} | " + " | ".join(cells) + dom + " |")
    for note in r["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str | Path, *, lines: int = 6) -> Path:
    """Norms over training for a few items (spread over the range of norms) with the law's window
    prediction, and every item's window-mean norm against the predictions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items, traj, w = result["items"], result["trajectory"], result["window"]
    steps, norms = traj["steps"], traj["norms"]
    observed = items["observed"]
    realized = items.get("r_eq_realized")
    virtual = items.get("r_eq_virtual")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    ax = axes[0]
    order = np.argsort(observed)
    pick = order[np.unique(np.linspace(0, len(order) - 1, min(lines, len(order))).round().astype(int))]
    ax.axvspan(w["first_step"], w["last_step"], color="0.93", zorder=0)
    for k, i in enumerate(pick[::-1]):
        color = f"C{k % 10}"
        ax.plot(steps, norms[:, i], color=color, lw=1.1, label=str(items["id"][i])[:24])
        if realized is not None and np.isfinite(realized[i]):
            ax.hlines(realized[i], w["first_step"], w["last_step"], colors=color, linestyles="--", lw=1.2)
        if virtual is not None and np.isfinite(virtual[i]):
            ax.hlines(virtual[i], w["first_step"], w["last_step"], colors=color, linestyles=":", lw=1.5)
    ax.set_xlabel("training step")
    ax.set_ylabel("embedding norm R")
    what = "dashed: law from the realized terms" + (
        ", dotted: from the virtual estimates" if virtual is not None else ""
    )
    ax.set_title(f"norms over training; grey: the window\n{what}", fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)

    ax = axes[1]
    series = [
        (realized, "realized terms", "o", "tab:blue", "realized_law"),
        (virtual, "virtual estimates", "s", "tab:orange", "virtual_law"),
    ]
    lo, hi = [], []
    for pred, label, marker, color, key in series:
        if pred is None:
            continue
        ok = np.isfinite(pred) & (pred > 0)
        fit = result["fits"].get(key, {})
        ax.loglog(
            pred[ok],
            observed[ok],
            marker,
            ms=3.5,
            alpha=0.6,
            color=color,
            mfc=color if marker == "o" else "none",
            label=f"{label}: slope {fit.get('slope', math.nan):.2f}, r {fit.get('pearson_r', math.nan):.2f}",
        )
        if ok.any():
            lo.append(min(pred[ok].min(), observed[ok].min()))
            hi.append(max(pred[ok].max(), observed[ok].max()))
    if lo:
        xs = np.geomspace(min(lo) * 0.95, max(hi) * 1.05, 10)
        ax.loglog(xs, xs, "k-", lw=0.8, label="y = x")
        ax.legend(fontsize=7, loc="upper left")
    ax.set_xlabel("law's prediction R_eq (window means)")
    ax.set_ylabel("observed window-mean norm")
    ax.set_title("every item: the law against the norm it kept", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def json_result(result: dict[str, Any]) -> dict[str, Any]:
    """The report without the trajectories, JSON-ready (the per-item columns as lists)."""
    from normfast.data.io import json_ready

    out = {k: v for k, v in result.items() if k != "trajectory"}
    out["items"] = {k: np.asarray(v).tolist() for k, v in result["items"].items()}
    return json_ready(out)


def write_items(result: dict[str, Any], path: str | Path) -> Path:
    items = result["items"]
    keys = list(items)
    path = Path(path)
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(keys)
        for i in range(len(items["item"])):
            writer.writerow([items[k][i] for k in keys])
    return path


def monitor_report(
    folder: str | Path, *, out: str | Path | None = None, window: float = 0.5, top: int = 8, plots: bool = True
) -> tuple[str, list[Path]]:
    """Analyze a monitor folder and write ``report.json``, ``report_items.csv`` and (``plots``)
    ``monitor_norms.png`` into ``out`` (default: the folder). Returns ``(text, written paths)``."""
    folder = Path(folder)
    result = analyze(folder, window=window)
    dest = Path(out) if out else (folder if folder.is_dir() else folder.parent)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / REPORT_FILE).write_text(json.dumps(json_result(result), indent=1) + "\n")
    written = [dest / REPORT_FILE, write_items(result, dest / ITEMS_FILE)]
    if plots:
        written.append(plot(result, dest / FIGURE_FILE))
    return format_report(result, top=top), written

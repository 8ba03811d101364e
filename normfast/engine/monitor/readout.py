"""``normfast report FOLDER`` for a monitor folder, its readout: the text, ``report.json``,
``report_items.csv`` and ``monitor_norms.png`` (what the numbers are: :mod:`normfast.engine.monitor.analysis`),
and every key and column of those files.

The docs' Training monitor page renders the files' tables from here (:func:`render_markdown`, the
``schema:monitor-report`` marker of docs/hooks.py), and the tests check that the written files hold
exactly what is registered (:func:`check_report`, :func:`check_items`). These files are derived from
the folder (``normfast report`` writes them again at any time): they carry no version of their own.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from normfast.data.schema import Column, MetadataKey, column_rows, key_rows
from normfast.engine.monitor.analysis import analyze
from normfast.engine.monitor.layout import SUMMARY_KEYS

#: the report's files
REPORT_FILE = "report.json"
ITEMS_FILE = "report_items.csv"
FIGURE_FILE = "monitor_norms.png"

_TERMS = "with realized terms"
_LAW = "with realized terms and weight decay"
_VIRTUAL = "with `virtual=M` and weight decay"

#: every column of ``report_items.csv`` (and of ``report.json``'s ``items``), in the order written
ITEM_COLUMNS: tuple[Column, ...] = (
    Column("item", "int64", "always", "index of the probe item (0-based)"),
    Column("id", "string", "always", "the item's id"),
    Column("observed", "double", "always", "the item's mean norm over the window's recorded steps"),
    *(
        Column(name, "double", _TERMS, f"window mean per step of the realized {what} (rows weighed by `n_steps`)")
        for name, what in (
            ("task1", "first-order task term"),
            ("task2", "second-order task term"),
            ("decay", "decay term"),
            ("remainder", "curvature remainder"),
            ("delta_r2", "change of R² (the four terms' sum)"),
        )
    ),
    Column(
        "r_eq_realized",
        "double",
        _LAW,
        "the law solved with D, Q, κ read off the realized window means at the window's mean R² (and mean R): "
        "equal to the observed norm, by construction, when the window is stationary",
    ),
    Column("r_eq_realized_no_remainder", "double", _LAW, "the same without the curvature remainder in the heat"),
    Column(
        "r_eq_virtual",
        "double",
        _VIRTUAL,
        "the law from the virtual estimates of D, Q, κ averaged over the window's recorded states",
    ),
    Column("r_eq_virtual_heat", "double", _VIRTUAL, "the same with the drift set to zero"),
    Column("virtual_D", "double", _VIRTUAL, "the window mean of the virtual drift (D; AdamW: D_w)"),
    Column("virtual_Q", "double", _VIRTUAL, "the window mean of the virtual second moment (Q; AdamW: Q_w)"),
    Column("virtual_kappa", "double", _VIRTUAL, "the window mean of the virtual κ"),
    Column(
        "dominant",
        "string",
        "with realized terms or `virtual=M`",
        "`heat` or `drift`: the larger of the first-order task term and the heat; from the virtual estimate "
        "when the optimizer has momentum and one was recorded (`dominant.from` says which)",
    ),
)

#: the keys of each entry of ``report.json``'s ``fits``
FIT_KEYS: tuple[MetadataKey, ...] = (
    MetadataKey("slope", "log-log slope of the observed norms against the prediction (1: proportional)"),
    MetadataKey("intercept", "its intercept (log units)"),
    MetadataKey("pearson_r", "Pearson r of the logs"),
    MetadataKey("n", "items with a prediction"),
    MetadataKey("n_no_prediction", "items whose law has no positive root"),
)

#: every key of ``report.json`` (a nested key as ``parent.key``)
REPORT_KEYS: tuple[MetadataKey, ...] = (
    MetadataKey("folder", "the monitor folder read"),
    MetadataKey("finished", "false: an unfinished folder, read from its finished blocks"),
    MetadataKey("law", "`sgd` or `adamw`: the law's branch"),
    MetadataKey("optimizer", "the optimizer's class name"),
    MetadataKey("lr", "η: the mean learning rate over the window's rows"),
    MetadataKey("weight_decay", "λ (metadata)"),
    MetadataKey("momentum", "heavy-ball β of SGD (0 otherwise)"),
    MetadataKey("beta1", "AdamW's β1 (null for SGD)"),
    MetadataKey("n_items", "number of probe items"),
    MetadataKey("every", "the monitor's `every`"),
    MetadataKey("recorded_steps", "rows per item in the folder"),
    MetadataKey("window", "the window: the last `fraction` of the recorded steps"),
    MetadataKey("window.fraction", "the `--window` fraction"),
    MetadataKey("window.recorded_steps", "recorded steps (rows per item) in the window"),
    MetadataKey("window.first_step", "its first step"),
    MetadataKey("window.last_step", "its last step"),
    MetadataKey(
        "window.term_steps",
        "with realized terms: the steps whose terms the window means average (the rows' `n_steps` summed: "
        "every step with `average=True`, one per row without)",
    ),
    MetadataKey("stationarity", "how far the window is from stationary (0: stationary)"),
    MetadataKey(
        "stationarity.norm_halves_median_rel_change",
        "median over items of the relative change of the mean norm between the window's halves",
    ),
    MetadataKey(
        "stationarity.net_change_median",
        "with realized terms: median over items of |change of R² per step between the means over the window's "
        "first and last quarters of recorded steps| / |mean decay term per step|; from the norms, so it does "
        "not depend on how often steps were recorded",
    ),
    MetadataKey(
        "stationarity.balance_median",
        "with realized terms: median over items of |mean ΔR²| / |mean decay|; with every step's terms (every=1 or "
        "`average=True`) it telescopes like the net change, with sampled steps it is mostly sampling noise",
    ),
    MetadataKey("fits", "name -> the fit of the observed window-mean norms against a prediction (keys below)"),
    MetadataKey("fits.realized_law", "against `r_eq_realized`: the check that the realized terms add up"),
    MetadataKey("fits.realized_law_no_remainder", "against `r_eq_realized_no_remainder`"),
    MetadataKey("fits.virtual_law", "against `r_eq_virtual`"),
    MetadataKey("fits.virtual_heat_only", "against `r_eq_virtual_heat`"),
    MetadataKey("fits.virtual_last_state", "against the law at the last recorded state alone (`virtual_r_eq`)"),
    MetadataKey("dominant", "items held up by heat and by drift (null without terms or virtual estimates)"),
    MetadataKey("dominant.heat", "items held up by heat"),
    MetadataKey("dominant.drift", "items held up by drift"),
    MetadataKey("dominant.from", "the terms the split was read from"),
    MetadataKey("virtual", "M of the virtual probe (0: none)"),
    MetadataKey("timing", "`summary.json` as it is (its keys: the table above), or null when absent or unreadable"),
    MetadataKey("notes", "what the report warns about, one line each"),
    MetadataKey("items", "the per-item columns of `report_items.csv` (below), column -> list"),
)


def _problems(blob: Any, keys: Sequence[str], where: str) -> list[str]:
    if not isinstance(blob, dict):
        return [f"{where} is a {type(blob).__name__}, not an object"]
    return [f"{where}.{k}" if where else k for k in blob if k not in keys]


def check_report(report: dict[str, Any]) -> list[str]:
    """Keys of a written ``report.json`` that are not registered here (empty: it conforms)."""
    names = [k.name for k in REPORT_KEYS]
    top = [n for n in names if "." not in n]
    unknown = _problems(report, top, "")
    for parent in ("window", "stationarity", "fits", "dominant"):
        if report.get(parent) is not None:
            unknown += _problems(
                report[parent], [n.split(".", 1)[1] for n in names if n.startswith(parent + ".")], parent
            )
    for name, fit in (report.get("fits") or {}).items():
        unknown += _problems(fit, [k.name for k in FIT_KEYS], f"fits.{name}")
    if report.get("timing") is not None:
        unknown += _problems(report["timing"], [k.name for k in SUMMARY_KEYS], "timing")
    where = "normfast/engine/monitor/readout.py"
    return [f"{REPORT_FILE} key {k!r} is not registered in {where}" for k in unknown] + check_items(
        list(report.get("items") or {})
    )


def check_items(header: Sequence[str]) -> list[str]:
    """Problems with the columns of ``report_items.csv`` (or ``report.json``'s ``items``): unregistered
    columns, or columns out of the registered order (empty: they conform)."""
    order = [c.name for c in ITEM_COLUMNS]
    problems = [f"items column {h!r} is not registered in ITEM_COLUMNS" for h in header if h not in order]
    if not problems and list(header) != [c for c in order if c in header]:
        problems.append(f"items columns out of the registered order: {list(header)}")
    return problems


def render_markdown() -> str:
    """The report's files as the docs show them."""
    return "\n".join(
        [
            f"`{REPORT_FILE}`: the report, JSON (a nested key as `parent.key`).",
            "",
            *key_rows(REPORT_KEYS, header="key"),
            "",
            "Each entry of `fits`:",
            "",
            *key_rows(FIT_KEYS, header="key"),
            "",
            f"`{ITEMS_FILE}`: one row per probe item (the same columns as `{REPORT_FILE}`'s `items`).",
            "",
            *column_rows(ITEM_COLUMNS),
            "",
            f"`{FIGURE_FILE}`: the norms of a few items over training with the law's window prediction, and every "
            "item's window-mean norm against the predictions (`--no-plots` leaves it out).",
        ]
    )


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
    from normfast.engine.report.figures import pyplot, save_figure

    plt = pyplot()
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
    return save_figure(fig, path)


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

"""What ``normfast report FOLDER`` writes into a monitor folder: every key of ``report.json`` and every
column of ``report_items.csv`` (the numbers: :mod:`normfast.engine.monitor.analysis`).

The docs' Training monitor page renders these tables from here (:func:`render_markdown`, the
``schema:monitor-report`` marker of docs/hooks.py), and the tests check that the written files hold
exactly what is registered (:func:`check_report`, :func:`check_items`). These files are derived from
the folder (``normfast report`` writes them again at any time): they carry no version of their own.
"""

from __future__ import annotations

from typing import Any, Sequence

from normfast.data.schema import Column, MetadataKey, column_rows, key_rows
from normfast.engine.monitor.schema import SUMMARY_KEYS

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
    where = "normfast/engine/monitor/report_schema.py"
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

"""A training monitor folder's page (``normfast view FOLDER``): one self-contained HTML file of the
page family (:mod:`normfast.engine.report.page.frame`), its template and script beside this module
(``monitor.html.j2``, ``monitor.js``).

What it shows, from :func:`normfast.engine.monitor.analysis.analyze`:

* the norms over training of chosen items (a selector; by default a few items spread over the
  range of window-mean norms) with their ``R_eq`` over steps: the law solved from the realized
  terms averaged over the ``w`` recorded steps up to each step (``w``: the report's window
  length), so that its last point is the report's prediction; the virtual probe's snapshot
  ``r_eq`` too, when it was recorded;
* the budget terms over training (task = task1 + task2, decay, remainder, and their sum ΔR²),
  averaged over every item or for one chosen item;
* every item's window-mean norm against the law's prediction;
* a sortable table of the items: the window means of the norm and of every realized term with
  their standard errors, the law's predictions, what holds the item up.

Standard errors over the window are *batch means*: the window's recorded steps are cut into
``min(10, w)`` contiguous blocks of (nearly) equal length and the error of the window mean is the
standard deviation of the block means over ``√blocks``. Consecutive steps are correlated (the norm
strongly, the terms less), which a plain ``sd / √w`` over the steps would ignore; blocks of
several steps are nearly independent when they are longer than the correlation.

The page is bounded whatever the run's length: every plotted series has at most ``steps``
points (each the mean over consecutive recorded steps when there are more; the page says how
many), the trajectories of at most ``series`` items are on the page (spread over the range of
window-mean norms), and the table holds at most ``max_items`` items.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from normfast.engine.monitor.analysis import analyze
from normfast.engine.monitor.readout import FIT_LABELS, format_report
from normfast.engine.report.page.frame import data_size, html_path, render_page, rounded, write_html

ASSETS = Path(__file__).parent  # monitor.html.j2, monitor.js (package data)
DEFAULT_STEPS = 300
DEFAULT_SERIES = 60
DEFAULT_SHOWN = 5
MAX_ITEMS = 20_000
SE_BLOCKS = 10
MAX_DATA_BYTES = 9_500_000
DIGITS, SE_DIGITS = 5, 3
FN = "normfast view"


def block_se(x: np.ndarray, blocks: int = SE_BLOCKS) -> np.ndarray:
    """Standard error of the mean over the rows of ``x`` ``[steps, items]``, per item, by batch means:
    ``min(blocks, steps)`` contiguous blocks, the standard deviation of their means over ``√blocks``
    (NaN with fewer than 2 steps)."""
    x = np.asarray(x, dtype=float)
    b = min(int(blocks), x.shape[0])
    if b < 2:
        return np.full(x.shape[1:], np.nan)
    means = np.stack([x[p].mean(0) for p in np.array_split(np.arange(x.shape[0]), b)])
    return means.std(0, ddof=1) / math.sqrt(b)


def spread(order: np.ndarray, k: int) -> np.ndarray:
    """``k`` entries of ``order`` evenly spaced from its last to its first (all of them when fewer)."""
    if k >= len(order):
        return order[::-1]
    at = np.unique(np.linspace(0, len(order) - 1, k).round().astype(int))
    return order[at][::-1]


def _bins(n: int, points: int) -> list[np.ndarray]:
    return np.array_split(np.arange(n), min(n, points))


def _binned(matrix: np.ndarray, parts: Sequence[np.ndarray]) -> np.ndarray:
    """``[points, items]``: the mean of each bin of consecutive recorded steps."""
    return np.stack([matrix[p].mean(0) for p in parts])


def trailing_law(result: dict[str, Any], ends: Sequence[int], items: np.ndarray) -> np.ndarray:
    """``[len(ends), len(items)]``: the law solved from the realized terms averaged over the report's
    window length of recorded steps ending at each of ``ends`` (NaN where fewer steps precede it)."""
    from normfast.engine.monitor.realized import realized_law

    traj, w = result["trajectory"], result["window"]["recorded_steps"]
    out = np.full((len(ends), len(items)), np.nan)
    if not traj["terms"] or not result["weight_decay"] or len(items) == 0:
        return out
    weights = traj["n_steps"][:, None]  # the terms of a row average n_steps steps: weigh them, as the report does
    mats = {k: v[:, items] * weights for k, v in traj["terms"].items()}
    mats["R"] = traj["norms"][:, items]
    mats["R2"] = np.square(mats["R"])
    lr = traj["lr"]
    csum = {k: np.vstack([np.zeros((1, len(items))), np.cumsum(v, 0)]) for k, v in mats.items()}
    cw = np.concatenate([[0.0], np.cumsum(traj["n_steps"])])
    for j, end in enumerate(ends):
        if end + 1 < w:
            continue
        means = {
            k: (c[end + 1] - c[end + 1 - w]) / (w if k in ("R", "R2") else cw[end + 1] - cw[end + 1 - w])
            for k, c in csum.items()
        }
        eta = float(np.mean(lr[end + 1 - w : end + 1]))
        out[j] = realized_law(
            means,
            adamw=result["law"] == "adamw",
            lr=eta,
            weight_decay=result["weight_decay"],
            momentum=result["momentum"],
        )
    return out


def _header(result: dict[str, Any], meta: dict[str, Any], bin_size: int, n_series: int, n_table: int) -> dict:
    lines = [ln.strip() for ln in format_report(result, top=0).splitlines() if ln.strip() and not ln.startswith("|")]
    w = result["window"]
    terms = bool(result["trajectory"]["terms"])
    reading = (
        "Each line is one item's norm R at the recorded steps. Dashed, in the same colour: R_eq, the law "
        "solved from the item's realized terms averaged over the "
        f"{w['recorded_steps']} recorded steps up to that step (the window's length), where the norm "
        "would settle if those terms held; its last point is the window's prediction. Where the window "
        "is stationary the two meet. The budget terms add up to the realized change of R² at each step."
        if terms
        else "Each line is one item's norm R at the recorded steps. This monitor recorded norms only "
        "(terms=False): there are no realized terms and no law to draw."
    )
    sample = (
        f"Plotted: every recorded step ({result['recorded_steps']:,})"
        if bin_size == 1
        else f"Plotted: {math.ceil(result['recorded_steps'] / bin_size):,} points, each the mean over "
        f"{bin_size} consecutive recorded steps (of {result['recorded_steps']:,})"
    )
    n = result["n_items"]
    sample += (
        f"; the trajectories of all {n:,} items are on this page."
        if n_series == n
        else f"; the trajectories of {n_series:,} of the {n:,} items are on this page, spread over the range "
        "of window-mean norms (the table holds " + ("every item" if n_table == n else f"{n_table:,} of them") + ")."
    )
    facts = [
        ("model", meta.get("model")),
        ("optimizer", f"{result['optimizer']} ({result['law']} law)"),
        ("lr (window mean)", f"{result['lr']:.4g}"),
        ("weight decay", result["weight_decay"]),
        ("momentum", result["momentum"]),
        ("beta1", result.get("beta1")),
        ("items", n),
        ("every", result["every"]),
        ("recorded steps", result["recorded_steps"]),
        ("window", f"steps {w['first_step']}-{w['last_step']} ({w['recorded_steps']} recorded steps)"),
        ("realized terms", meta.get("terms", terms)),
        ("virtual probe M", result["virtual"] or "none"),
        ("jvp precision", meta.get("dtype")),
        ("folder", result["folder"] + ("" if result["finished"] else " (unfinished)")),
        ("normfast", (meta.get("versions") or {}).get("normfast")),
    ]
    return {
        "lines": lines,
        "reading": reading,
        "sample": sample,
        "facts": [(k, "" if v is None else str(v)) for k, v in facts],
        "facts_label": "monitor settings",
        "fits": [
            {
                "label": FIT_LABELS.get(k, k).strip(),
                "slope": f["slope"],
                "r": f["pearson_r"],
                "none": f["n_no_prediction"],
            }
            for k, f in result["fits"].items()
        ],
    }


def monitor_page_data(
    folder: str | Path,
    *,
    window: float = 0.5,
    steps: int = DEFAULT_STEPS,
    series: int = DEFAULT_SERIES,
    max_items: int = MAX_ITEMS,
) -> dict[str, Any]:
    """Everything the monitor page shows, as JSON-ready data (see the module docstring)."""
    for name, v in (("steps", steps), ("series", series), ("max_items", max_items)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{FN}: expected {name} to be a positive int, got {v!r}")
    result = analyze(folder, window=window)
    traj, items = result["trajectory"], result["items"]
    meta = traj["metadata"]
    S, n = result["recorded_steps"], result["n_items"]
    first = S - result["window"]["recorded_steps"]
    parts = _bins(S, steps)
    ends = [int(p[-1]) for p in parts]
    x = [float(np.mean(traj["steps"][p])) for p in parts]
    order = np.argsort(items["observed"], kind="stable")
    shown = spread(order, DEFAULT_SHOWN)
    table_items = np.sort(spread(order, max_items))
    terms = traj["terms"]
    win = slice(first, S)

    def payload(n_series: int) -> dict[str, Any]:
        picked = spread(order, n_series)
        chosen = np.array(sorted(set(picked.tolist()) | set(shown.tolist())), np.int64)
        where = {int(i): k for k, i in enumerate(chosen)}
        norms = _binned(traj["norms"][:, chosen], parts)
        s: dict[str, Any] = {
            "item": chosen.tolist(),
            "id": [str(items["id"][i])[:40] for i in chosen],
            "norm": [rounded(norms[:, k], DIGITS) for k in range(len(chosen))],
        }
        if terms:
            law = trailing_law(result, ends, chosen)
            s["r_eq"] = [rounded(law[:, k], DIGITS) for k in range(len(chosen))]
            for name, mat in (
                ("task", terms["task1"] + terms["task2"]),
                ("decay", terms["decay"]),
                ("remainder", terms["remainder"]),
            ):
                b = _binned(mat[:, chosen], parts)
                s[name] = [rounded(b[:, k], SE_DIGITS + 1) for k in range(len(chosen))]
        if traj["virtual_r_eq"] is not None:
            v = _binned(traj["virtual_r_eq"][:, chosen], parts)
            s["virtual_r_eq"] = [rounded(v[:, k], DIGITS) for k in range(len(chosen))]
        t: dict[str, Any] = {
            "n": len(table_items),
            "item": table_items.tolist(),
            "id": [str(items["id"][i])[:40] for i in table_items],
            "series": [where.get(int(i), -1) for i in table_items],
            "q": {},
        }
        cols: list[tuple[str, np.ndarray, np.ndarray | None]] = [
            ("observed", items["observed"], block_se(traj["norms"][win]))
        ]
        cols += [
            (k, items[k], block_se(terms[k][win]))
            for k in ("task1", "task2", "decay", "remainder", "delta_r2")
            if terms
        ]
        cols += [(k, items[k], None) for k in ("r_eq_realized", "r_eq_virtual") if k in items]
        for name, mean, se in cols:
            t["q"][name] = {"mean": rounded(np.asarray(mean)[table_items], DIGITS)}
            if se is not None:
                t["q"][name]["se"] = rounded(se[table_items], SE_DIGITS)
        if "dominant" in items:
            t["dominant"] = [str(items["dominant"][i]) for i in table_items]
        out = {
            "page": "monitor",
            "title": f"{meta.get('model') or 'model'} — training monitor {Path(result['folder']).name}",
            "law": result["law"],
            "window": result["window"],
            "steps": {
                "x": rounded(x, 7),
                "bin": int(max(len(p) for p in parts)),
                "of": S,
                "blocks": min(SE_BLOCKS, S - first),
            },
            "series": s,
            "shown": [where[int(i)] for i in shown],
            "items": t,
            "n_items": n,
            "terms": bool(terms),
        }
        if terms:
            mean_terms = {
                "task": terms["task1"] + terms["task2"],
                "decay": terms["decay"],
                "remainder": terms["remainder"],
            }
            out["mean_terms"] = {k: rounded(_binned(v, parts).mean(1), SE_DIGITS + 1) for k, v in mean_terms.items()}
        out["header"] = _header(result, meta, out["steps"]["bin"], len(chosen), len(table_items))
        return out

    n_series = min(series, n)
    data = payload(n_series)
    while data_size(data) > MAX_DATA_BYTES and n_series > DEFAULT_SHOWN:
        n_series = max(DEFAULT_SHOWN, n_series // 2)
        data = payload(n_series)
    return data


def monitor_page_html(folder: str | Path, **options: Any) -> str:
    """The monitor folder's page as one self-contained HTML string (options: :func:`monitor_page_data`)."""
    return render_page(
        monitor_page_data(folder, **options),
        template="monitor.html.j2",
        script="monitor.js",
        generator="normfast view",
        assets=[ASSETS],
    )


def write_monitor_page(folder: str | Path, path: str | Path, **options: Any) -> Path:
    """Write the monitor folder's page to ``path`` (``.html``); returns the path."""
    path = html_path(path, FN)
    return write_html(monitor_page_html(folder, **options), path)

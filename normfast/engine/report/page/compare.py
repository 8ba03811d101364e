"""The page of a comparison of two runs (``normfast compare RUN_A RUN_B``): one self-contained HTML file
of the page family (:mod:`normfast.engine.report.page.frame`; ``compare.html.j2``, ``compare.js``).

It shows what :func:`normfast.engine.report.compare.compare` finds: the two runs and what differs
between their settings, the test, and per quantity (``heat_rel``, the drift, ``r_eq``) run B's type
means against run A's with light error bars and the flagged types in colour, and the sortable table
of the types with every difference ± its standard error. The page holds at most ``max_types`` types
(the most significant changes first; the table file holds every type): its size is bounded whatever
the runs' size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from normfast.engine.report.page.frame import html_path, render_page, rounded, write_html

DEFAULT_MAX_TYPES = 5000
DIGITS, SE_DIGITS = 6, 3
FN = "normfast compare"

#: what each quantity's difference says, for the reader
ABOUT = {
    "heat_rel": "relative heat: log V2 minus the run's median, so the difference is the change of a type's place "
    "in its run's heat ranking (log units: 0.2 is a factor 1.22), free of the factor that moves every row's heat",
    "D": "radial drift D: the mean radial displacement per virtual batch",
    "D_w": "radial drift D_w of the scale-free (AdamW) branch",
    "r_eq": "the equilibrium norm the law predicts",
}


def compare_page_data(a, b, table: pa.Table | None = None, *, max_types: int = DEFAULT_MAX_TYPES, **options: Any):
    """Everything the comparison's page shows, as JSON-ready data (``table``: the result of
    :func:`~normfast.engine.report.compare.compare` for ``a`` and ``b`` with ``options``, computed
    when not given)."""
    from normfast.engine.report.compare import compare, comparison_info
    from normfast.engine.report.summary import run_line

    if isinstance(max_types, bool) or not isinstance(max_types, int) or max_types < 1:
        raise ValueError(f"{FN}: expected max_types to be a positive int, got {max_types!r}")
    if table is None:
        table = compare(a, b, **options)
    info = comparison_info(table)
    qs = info["quantities"]
    key = info["by"]
    label = "id" if key == "item" else "token"
    shown = table.slice(0, max_types)

    def col(name: str) -> np.ndarray:
        return shown.column(name).to_numpy(zero_copy_only=False)

    types: dict[str, Any] = {
        "n": shown.num_rows,
        "total": table.num_rows,
        "label": [str(s)[:40] for s in shown.column(label).to_pylist()],
        "occurrences": col("occurrences").astype(np.int64).tolist(),
        "q": {},
    }
    for x in qs:
        types["q"][x] = {
            "a": rounded(col(f"{x}_a"), DIGITS),
            "b": rounded(col(f"{x}_b"), DIGITS),
            "se_a": rounded(col(f"{x}_se_a"), SE_DIGITS),
            "se_b": rounded(col(f"{x}_se_b"), SE_DIGITS),
            "diff": rounded(col(f"{x}_diff"), DIGITS),
            "se": rounded(col(f"{x}_se"), SE_DIGITS),
            "z": rounded(col(f"{x}_z"), 4),
            "p": rounded(col(f"{x}_p"), 3),
            "changed": col(f"{x}_changed").astype(int).tolist(),
        }
    flagged = {x: int(table.column(f"{x}_changed").to_numpy(zero_copy_only=False).sum()) for x in qs}
    unit = "inputs" if key == "item" else "token types"
    lines = [
        f"A: {run_line(a.metadata)}",
        f"B: {run_line(b.metadata)}",
        f"what differs between their settings: {info['differs']}",
        f"changed: {sum(int(v > 0) for v in table.column('changed').to_numpy(zero_copy_only=False))} of "
        f"{info['types']:,} {unit} ("
        + ", ".join(f"{x}: {flagged[x]}" for x in qs)
        + f"); {info['tests']:,} tests at q = {info['q']:g}",
    ]
    if info["tests"] == 0:
        lines.append(
            "no test: the runs have no error bars (probed with uncertainty=False); differences are shown alone"
        )
    reading = (
        f"Each difference is B − A of the two runs' type means (the mean over a type's valid occurrences, "
        f"as normfast aggregate counts them) ± its standard error √(se_A² + se_B²). A run's error of a type's "
        f"mean comes from its batch sample: for heat_rel the jackknife over its K batch groups, for the drift and "
        f"r_eq the mean of the rows' standard errors (the runs keep no per-group replicates of those: exact when "
        f"the rows' errors move together, larger otherwise, so the test is conservative). The test: "
        f"{info['test']}."
    )
    sample = (
        f"All {table.num_rows:,} {unit} are on this page."
        if shown.num_rows == table.num_rows
        else f"The {shown.num_rows:,} most significant changes of the {table.num_rows:,} {unit} are on this page; "
        "the table file holds every one."
    )
    facts = [
        ("run A", info["a"]),
        ("run B", info["b"]),
        ("model A", info["model_a"]),
        ("model B", info["model_b"]),
        ("types", "vocabulary entries (token_id)" if key == "token_id" else "probe inputs (pooled rows)"),
        ("min count", info["min_count"]),
        ("false-discovery rate q", info["q"]),
        ("tests", info["tests"]),
    ]
    names = (Path(info["a"]).name, Path(info["b"]).name)
    return {
        "page": "compare",
        "title": f"{names[1]} (B) against {names[0]} (A)",
        "quantities": qs,
        "about": {x: ABOUT.get(x, x) for x in qs},
        "by": key,
        "unit": unit,
        "q": info["q"],
        "types": types,
        "header": {
            "lines": lines,
            "reading": reading,
            "sample": sample,
            "facts": [(k, "" if v is None else str(v)) for k, v in facts],
            "facts_label": "the comparison",
            "runlines": 2,
        },
    }


def compare_page_html(a, b, table: pa.Table | None = None, **options: Any) -> str:
    """The comparison's page as one self-contained HTML string (options: :func:`compare_page_data`)."""
    return render_page(
        compare_page_data(a, b, table, **options),
        template="compare.html.j2",
        script="compare.js",
        generator="normfast compare",
    )


def write_compare_page(a, b, path: str | Path, table: pa.Table | None = None, **options: Any) -> Path:
    """Write the comparison's page to ``path`` (``.html``); returns the path."""
    path = html_path(path, FN)
    return write_html(compare_page_html(a, b, table, **options), path)

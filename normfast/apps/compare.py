"""``normfast compare RUN_A RUN_B``: two probe runs over the same inputs, type by type (driver over
:mod:`normfast.engine.report.compare` and its page, :mod:`normfast.engine.report.page.compare`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from normfast.apps.view import screenshot_arguments, write_screenshot
from normfast.data.manifest import run_stem
from normfast.engine.report.compare import DEFAULT_Q
from normfast.engine.report.page.compare import DEFAULT_MAX_TYPES

compare_description = """\
Compare two probe runs over the same inputs (two models, two checkpoints,
two settings), type by type: for every vocabulary entry (token runs; each
input for pooled runs) the difference B - A of the relative heat heat_rel,
the drift D and r_eq, each with its standard error, and a flag of what
changed.

A run's error of a type's mean comes from its batch sample: heat_rel's is
the jackknife over the run's K batch groups; D's and r_eq's the mean of the
type's rows' standard errors (exact when the rows' errors move together, an
upper bound otherwise). The difference's error is sqrt(se_A^2 + se_B^2).
The test: z = (B - A) / se, two-sided normal p-value, flagged by
Benjamini-Hochberg at false-discovery rate q (default 0.05) over every test
of the table (every type and quantity). A run compared with itself flags
nothing.

Writes a page (one self-contained HTML file: the runs, what differs between
their settings, B against A per quantity, the sortable table) and the table
(Parquet, or CSV when --table ends in .csv). Runs whose inputs differ (their
probe items, or the token ids row by row) are refused in one line.

examples:
  normfast compare runs/base.parquet runs/tuned.parquet
  normfast compare runs/lr-small runs/lr-large --q 0.01 --table lr.csv
  normfast compare runs/a.parquet runs/b.parquet --out ab.html --screenshot ab.png"""


def compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_a", help="run A: a run's .parquet file, a sharded run's .manifest.json, or its folder")
    p.add_argument("run_b", help="run B, over the same inputs as run A (differences are B - A)")
    p.add_argument(
        "--out", default=None, help="the page, .html (default: beside run B, B-vs-A.html from the runs' names)"
    )
    p.add_argument(
        "--table",
        default=None,
        help="the table: .parquet (the default, beside the page: B-vs-A.compare.parquet) or .csv",
    )
    p.add_argument(
        "--q",
        type=float,
        default=DEFAULT_Q,
        help=f"false-discovery rate of the Benjamini-Hochberg flags (default {DEFAULT_Q:g})",
    )
    p.add_argument(
        "--min-count",
        type=int,
        default=1,
        help="keep types with at least this many valid occurrences in each run (default 1)",
    )
    p.add_argument(
        "--max-types",
        type=int,
        default=DEFAULT_MAX_TYPES,
        help=f"the page: at most this many types, the most significant changes first (default "
        f"{DEFAULT_MAX_TYPES:,}; the table holds every type)",
    )
    screenshot_arguments(p)


def compare_main(args: argparse.Namespace) -> int:
    from normfast.core.paths import check_outputs, same_file
    from normfast.data.io import DamagedFile
    from normfast.data.manifest import resolve_run, run_inputs
    from normfast.engine.report.compare import comparison_info, write_comparison
    from normfast.engine.report.page.compare import write_compare_page
    from normfast.engine.result import ProbeResult

    runs: dict[str, list[Path]] = {}
    try:
        a_path, b_path = resolve_run(args.run_a), resolve_run(args.run_b)
        runs = {"run A": run_inputs(a_path), "run B": run_inputs(b_path)}
        default = b_path.with_name(f"{run_stem(b_path)}-vs-{run_stem(a_path)}.html")
        out = Path(args.out) if args.out else default
        table_path = Path(args.table) if args.table else out.with_name(out.stem + ".compare.parquet")
        if out.suffix.lower() not in (".html", ".htm"):
            raise ValueError(f"expected --out to end in .html, got {str(out)!r}")
        if table_path.suffix not in (".parquet", ".csv"):
            raise ValueError(f"expected --table to end in .parquet or .csv, got {str(table_path)!r}")
        if args.max_types < 1:
            raise ValueError(f"expected --max-types to be a positive int, got {args.max_types}")
        # before anything is read: no output may replace one of the runs
        check_outputs(
            inputs=runs["run A"] + runs["run B"],
            files={"--out": out, "--table": table_path, "--screenshot": args.screenshot},
        )
        a, b = ProbeResult.load(a_path), ProbeResult.load(b_path)
        table = a.compare(b, q=args.q, min_count=args.min_count)
        write_compare_page(a, b, out, table=table, max_types=args.max_types)
        write_comparison(table, table_path)
    except DamagedFile as exc:  # which run it belongs to: the file alone may not say
        which = next((label for label, files in runs.items() if any(same_file(f, exc.path) for f in files)), None)
        print(f"normfast compare: error: {which + ': ' if which else ''}{exc}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, FileNotFoundError, KeyError) as exc:
        print(f"normfast compare: error: {str(exc).removeprefix('normfast compare: ')}", file=sys.stderr)
        return 2
    info = comparison_info(table)
    flagged = ", ".join(f"{q} {int(sum(table.column(f'{q}_changed').to_pylist()))}" for q in info["quantities"])
    print(
        f"changed: {int(sum(table.column('changed').to_pylist()))} of {info['types']:,} types ({flagged}); "
        f"{info['tests']:,} tests, Benjamini-Hochberg at q = {info['q']:g}"
    )
    print(f"what differs between the runs' settings: {info['differs']}")
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")
    print(f"wrote {table_path} ({'CSV' if table_path.suffix == '.csv' else 'Parquet'}, {table.num_rows:,} types)")
    return write_screenshot(args, out, "compare")

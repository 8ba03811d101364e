"""``normfast aggregate``: per-type statistics of a token-level run (driver over
:func:`normfast.engine.report.aggregate.aggregate`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

aggregate_description = """\
Group the token rows of a probe run by vocabulary entry (--by token) or by whole
word (--by word, corpus runs) and report, per type, how many occurrences back
it and the mean, standard deviation and standard error of norm, V2, D, kappa,
r_eq and r_eq_heat over them; with runs that have it, also the relative heat
(heat_rel: log V2 minus the run's median, the type's place in the ranking) with
two error bars: heat_rel_se (its contexts' spread) and heat_rel_se_batches (the
batch sample's, the jackknife over the run's K groups). Special tokens and overlap duplicates (corpus
runs with --stride) are left out; only rows with valid statistics count. A
word's value is the mean over its word pieces. The run is streamed batch by
batch (pyarrow group-by per batch, exact merge), so it may be larger than
memory.

The printed hottest and coldest types are ranked as every list of normfast
is (the probe's summary, the run's page): by the mean relative heat, over
the types seen at least twice in a corpus run (every type in a list of
probe items; --min-count sets it), punctuation left out; the first line
says how many types each rule left out. The table keeps every type.

examples:
  normfast aggregate runs/news.parquet --by token --min-count 5
  normfast aggregate runs/news.parquet --by word --casefold --out runs/news.words.csv --plot
  normfast aggregate runs/run.manifest.json --by token       # a sharded run"""


def aggregate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a token-level run: .parquet written by `normfast probe` or a manifest .json")
    p.add_argument(
        "--by",
        default="token",
        choices=["token", "word"],
        help="token: vocabulary entries; word: whole words (corpus runs)",
    )
    p.add_argument(
        "--min-count",
        type=int,
        default=None,
        help="types need at least this many valid occurrences, in the table and the printed lists (default: "
        "the table keeps every type; the lists rank types seen at least twice in a corpus run, every type "
        "otherwise)",
    )
    p.add_argument("--casefold", action="store_true", help="--by word: group words case-insensitively")
    p.add_argument(
        "--out", default=None, help="output table .parquet or .csv (default: next to the run, RUN.by-token.parquet)"
    )
    p.add_argument("--top", type=int, default=10, help="hottest/coldest types printed (default 10)")
    p.add_argument("--plot", action="store_true", help="also draw type heat against corpus frequency (PNG)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (e.g. for a log file)")


def aggregate_main(args: argparse.Namespace) -> int:
    import json

    from normfast.core.paths import check_outputs
    from normfast.data.manifest import run_inputs, run_stem
    from normfast.data.schema import METADATA_KEY
    from normfast.engine.report.aggregate import aggregate, write_table
    from normfast.engine.report.figures import plot_type_heat

    run = Path(args.run)
    try:
        out = Path(args.out) if args.out else run.with_name(f"{run_stem(run)}.by-{args.by}.parquet")
        png = out.with_suffix(".png") if args.plot else None
        check_outputs(inputs=run_inputs(run), files={"--out": out, "the figure": png})
        table = aggregate(
            run,
            by=args.by,
            min_count=1 if args.min_count is None else args.min_count,
            casefold=args.casefold,
            progress=not args.no_progress,
        )
        write_table(table, out)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as exc:
        print(f"normfast aggregate: error: {exc}", file=sys.stderr)
        return 2
    from normfast.engine.report.ranking import default_min_count

    run_meta = json.loads(table.schema.metadata[METADATA_KEY])["run"]
    listed = args.min_count if args.min_count is not None else default_min_count(run_meta)
    print(format_types(table, args.by, args.top, min_count=listed))
    print(f"\nwrote {out} ({table.num_rows} types)")
    if args.plot:
        png = plot_type_heat(table, png, title=f"{run.name}: type heat vs frequency (by {args.by})")
        print(f"wrote {png}")
    return 0


def format_types(table, by: str, top: int = 10, min_count: int = 1) -> str:
    """The hottest and coldest types, ranked as every list is (:mod:`normfast.engine.report.ranking`:
    mean relative heat, types seen at least ``min_count`` times, punctuation left out), with counts."""
    import numpy as np

    from normfast.engine.report.ranking import rank_types

    ranking = rank_types(table, min_count=min_count)
    count = table.column("count").to_numpy()
    names = table.column_names
    heat = "V2" if "V2_mean" in names else "V2_w"
    mean = table.column(f"{heat}_mean").to_numpy(zero_copy_only=False)
    se = table.column(f"{heat}_se").to_numpy(zero_copy_only=False)
    norm = table.column("norm_mean").to_numpy(zero_copy_only=False)
    rel_se = (
        table.column("heat_rel_se_batches").to_numpy(zero_copy_only=False) if "heat_rel_se_batches" in names else None
    )
    lines = [f"{table.num_rows} types; {int(count.sum())} valid occurrences", f"{ranking.note()}:"]

    def rows(idx) -> list[str]:
        out = []
        for i in idx:
            rel = ""
            if ranking.key == "heat_rel_mean":
                batches = f" (batches ± {rel_se[i]:.2g})" if rel_se is not None else ""
                rel = f"relative heat {ranking.values[i]:+.3f}{batches}  "
            out.append(
                f"  {ranking.labels[i]!s:<18} n={int(count[i]):>6}  {rel}{heat} {mean[i]:.4g} ± {se[i]:.2g}  "
                f"norm {norm[i]:.3f}"
            )
        return out

    if len(ranking.order):
        lines.append("hottest:")
        lines += rows(ranking.hottest(top))
        lines.append("coldest:")
        lines += rows(ranking.coldest(top))
    finite = count[np.isfinite(mean)]
    if finite.size:
        lines.append(f"occurrences per type: median {np.median(finite):g}, max {finite.max():g}")
    return "\n".join(lines)

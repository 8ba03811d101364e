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
        "--min-count", type=int, default=1, help="keep types with at least this many valid occurrences (default 1)"
    )
    p.add_argument("--casefold", action="store_true", help="--by word: group words case-insensitively")
    p.add_argument(
        "--out", default=None, help="output table .parquet or .csv (default: next to the run, RUN.by-token.parquet)"
    )
    p.add_argument("--top", type=int, default=10, help="hottest/coldest types printed (default 10)")
    p.add_argument("--plot", action="store_true", help="also draw type heat against corpus frequency (PNG)")
    p.add_argument("--no-progress", action="store_true")


def aggregate_main(args: argparse.Namespace) -> int:
    from normfast.core.paths import check_outputs
    from normfast.data.manifest import run_inputs
    from normfast.engine.report.aggregate import aggregate, write_table
    from normfast.engine.report.figures import plot_type_heat

    run = Path(args.run)
    try:
        stem = run.name[: -len(".manifest.json")] if run.name.endswith(".manifest.json") else run.stem
        out = Path(args.out) if args.out else run.with_name(f"{stem}.by-{args.by}.parquet")
        png = out.with_suffix(".png") if args.plot else None
        check_outputs(inputs=run_inputs(run), files={"--out": out, "the figure": png})
        table = aggregate(
            run, by=args.by, min_count=args.min_count, casefold=args.casefold, progress=not args.no_progress
        )
        write_table(table, out)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as exc:
        print(f"normfast aggregate: error: {exc}", file=sys.stderr)
        return 2
    print(format_types(table, args.by, args.top))
    print(f"\nwrote {out} ({table.num_rows} types)")
    if args.plot:
        png = plot_type_heat(table, png, title=f"{run.name}: type heat vs frequency (by {args.by})")
        print(f"wrote {png}")
    return 0


def format_types(table, by: str, top: int = 10, quantity: str = "V2") -> str:
    """The hottest and coldest types by mean ``quantity`` (types seen at least twice), with counts."""
    import numpy as np

    label = table.column("token" if by == "token" else "word").to_pylist()
    count = table.column("count").to_numpy()
    mean = table.column(f"{quantity}_mean").to_numpy(zero_copy_only=False)
    se = table.column(f"{quantity}_se").to_numpy(zero_copy_only=False)
    norm = table.column("norm_mean").to_numpy(zero_copy_only=False)
    ok = np.flatnonzero((count >= 2) & np.isfinite(mean))
    order = ok[np.argsort(mean[ok], kind="stable")]
    lines = [f"{table.num_rows} types; {int(count.sum())} valid occurrences; {len(ok)} types seen at least twice"]

    rel = (
        table.column("heat_rel_mean").to_numpy(zero_copy_only=False) if "heat_rel_mean" in table.column_names else None
    )
    rel_se = (
        table.column("heat_rel_se_batches").to_numpy(zero_copy_only=False)
        if "heat_rel_se_batches" in table.column_names
        else None
    )

    def relative(i: int) -> str:
        if rel is None:
            return ""
        batches = f" (batches ± {rel_se[i]:.2g})" if rel_se is not None else ""
        return f"  relative heat {rel[i]:+.3f}{batches}"

    def rows(idx) -> list[str]:
        return [
            f"  {label[i]!s:<18} n={int(count[i]):>6}  {quantity} {mean[i]:.4g} ± {se[i]:.2g}  "
            f"norm {norm[i]:.3f}{relative(i)}"
            for i in idx
        ]

    if len(order):
        lines.append(f"hottest (mean {quantity} ± SE):")
        lines += rows(order[::-1][:top])
        lines.append(f"coldest (mean {quantity} ± SE):")
        lines += rows(order[:top])
    finite = count[np.isfinite(mean)]
    if finite.size:
        lines.append(f"occurrences per type: median {np.median(finite):g}, max {finite.max():g}")
    return "\n".join(lines)

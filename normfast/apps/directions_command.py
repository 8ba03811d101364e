"""``normfast directions``: compute a probe's directions alone and save them (driver over
:meth:`normfast.engine.prober.Prober.save`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from normfast.apps.options import (
    computed_prober,
    direction_arguments,
    encoder_arguments,
    model_arguments,
    objective_arguments,
    pairs_arguments,
    per_item_arguments,
    resolve_device,
)

directions_description = """\
Compute the directions of a probe -- the update directions of the M heat
batches and the drift's mean directions over its M_D batches -- and save them
in a folder: one safetensors file per direction and a manifest.json with what
they were made from (the model's weights and tokenizer by content hash, the
objective, the pair source, the direction settings, the normfast version).

They depend on the model, the objective, the pair source and these settings,
never on the probe items: made once, they serve every later probe, which then
pays only its per-item pass. `normfast probe ... --directions FOLDER` and
`normfast serve MODEL --directions FOLDER` read them (and refuse them, naming
what differs, when they were made for other inputs); from Python,
normfast.Prober.load(FOLDER, encoder).

examples:
  normfast directions all-MiniLM-L6-v2 --pairs sentences.txt \\
      --params 'encoder\\.layer\\.5\\.' --out dirs/minilm-l5
  normfast probe all-MiniLM-L6-v2 --probes words.txt --tokens \\
      --params 'encoder\\.layer\\.5\\.' --directions dirs/minilm-l5 --out runs/words.parquet

The pair source is required (for simcse: the items to draw batches from, .txt
one per line). Adaptive M (--target-rse in `normfast probe`) chooses M on the
probe items, so its directions are saved by `normfast probe --directions`."""


def directions_arguments(p: argparse.ArgumentParser) -> None:
    model_arguments(p)
    pairs_arguments(
        p,
        "virtual-batch source, required (.jsonl / .tsv; for an objective of items, plain items: .txt one per "
        "line, .tsv the first column, .jsonl --text-key, or a pairs file's anchors)",
    )
    objective_arguments(p)
    direction_arguments(p)
    per_item_arguments(p)
    encoder_arguments(p)
    p.add_argument("--out", required=True, metavar="FOLDER", help="the folder to write the directions to")
    p.add_argument("--overwrite", action="store_true", help="replace the directions already in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def directions_main(args: argparse.Namespace) -> int:
    from normfast.core.checks import check_device
    from normfast.engine.runner.integrity import check_save_target

    try:
        args.device = resolve_device(args)
        check_device("--device", args.device)
        if not args.pairs:
            raise ValueError(
                "--pairs is required: the directions come from a pair source, kept for every later probe "
                "(for an objective of items: a file of items to draw batches from, .txt one per line)"
            )
        out = Path(args.out)
        # before the model is loaded: --out must be new, empty, or (--overwrite) saved directions only
        check_save_target(out, args.overwrite, f"--out {out}")
        prober = computed_prober(args, args)
        t0 = time.perf_counter()
        folder = prober.save(out, overwrite=args.overwrite)
        seconds = time.perf_counter() - t0
    except (ValueError, TypeError, FileNotFoundError, FileExistsError, ImportError) as exc:
        print(f"normfast directions: error: {exc}", file=sys.stderr)
        return 2
    from normfast.engine.runner.artifact import read_artifact_manifest

    manifest = read_artifact_manifest(folder)
    d = manifest["directions"]
    n_drift = len(d["drift_counts"] or [])
    print(
        f"wrote {folder}: {d['M']} heat + {n_drift} drift directions over {len(d['names'])} parameter tensors "
        f"({d['bytes_per_direction'] / 2**20:.1f} MiB each), {manifest['bytes'] / 2**20:.1f} MiB on disk, "
        f"{d['memory_bytes'] / 2**20:.1f} MiB in memory; {seconds:.1f} s"
    )
    print(
        f"use them: normfast probe {args.model} --probes FILE --directions {folder} --out RUN.parquet (same settings)"
    )
    return 0

"""Adaptive M on the demo's words: how many heat batches a target precision takes, and what it costs.

    python bench/adaptive_m.py [--words 500] [--target-rse 0.1] [--out bench/results]

The demo's probe (all-MiniLM-L6-v2, token rows, SimCSE, the last transformer
layer probed, batch size 32, lr 1e-3, wd 1e-2, the default drift from
M_D = 1 024 batches and K groups) over the first ``--words`` of the demo's
word list (the most frequent English words), run twice in one process:

* fixed: M = 16 heat batches (the default);
* adaptive: ``target_rse`` (default 0.1) for the 90% quantile of se(V2)/V2
  over the first chunk of words, ``max_batches`` 256.

Reported: the M chosen and the rounds it took, the quantile reached on the
pilot chunk and over all rows, the share of rows whose V2 is resolved to
+-20% (95% interval) in each run, and the wall time of the adaptive run
against the fixed one (same process, one after the other; the drift's 1 024
gradients are part of both). A third run, fixed M = 16 with the per-batch
drift of its 16 batches (``drift_batches=None``), gives the cost and the
precision of the drift from M_D batches: the wall-time ratio, and the median
se_D/|D| and share of rows with |D| > 2 se_D of both. Writes
OUT/adaptive_m.json (OUT defaults to runs/).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from normfast.engine.probe import ProbeConfig, probe
from normfast.engine.provenance import library_versions as _library_versions
from normfast.engine.uncertainty import t_quantile

PARAMS = r"encoder\.layer\.5\."  # the demo's probed parameters (normfast.apps.demo)


def summarize(res, pilot_rows: int, quantile: float) -> dict:
    valid = res.column("valid").astype(bool)
    rse = res.column("se_V2") / res.column("V2")
    t = t_quantile(int(res.metadata["groups"]) - 1)
    ok = valid & np.isfinite(rse)
    D, se_d = res.column("D")[valid], res.column("se_D")[valid]
    return {"M": int(res.metadata["M"]), "rows": int(len(res)), "valid_rows": int(valid.sum()),
            "median_se_D_over_abs_D": float(np.median(se_d / np.abs(D))),
            "drift_significant_share": float(np.mean(np.abs(D) > 2 * se_d)),
            "quantile_rse_all_rows": float(np.quantile(rse[ok], quantile)),
            "quantile_rse_pilot_rows": float(np.quantile(rse[:pilot_rows][ok[:pilot_rows]], quantile)),
            "median_rse": float(np.median(rse[ok])),
            "V2_resolved_to_20pct": float(np.mean(t * rse[ok] <= 0.2)),
            "seconds": float(res.metadata["seconds"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--words", type=int, default=500)
    ap.add_argument("--target-rse", type=float, default=0.1)
    ap.add_argument("--quantile", type=float, default=0.9)
    ap.add_argument("--max-batches", type=int, default=256)
    ap.add_argument("--drift-batches", type=int, default=1024, help="M_D (default 1024, the library's default)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs", help="output folder (default runs/; bench/results for the record)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from normfast.data.word_frequencies import top_words
    from normfast.encoders import load_encoder

    encoder = load_encoder("all-MiniLM-L6-v2")
    words = top_words(args.words)
    base = dict(params=PARAMS, mode="jvp", output="tokens", optimizer="sgd", lr=1e-3, weight_decay=1e-2,
                batch_size=32, seed=0, chunk_size=128, drift_batches=args.drift_batches)
    runs = {}
    load_start = os.getloadavg()
    for name, extra in (("fixed_M16", dict(batches=16)),
                        ("adaptive", dict(batches=16, target_rse=args.target_rse, max_batches=args.max_batches,
                                          target_quantile=args.quantile)),
                        ("fixed_M16_per_batch_drift", dict(batches=16, drift_batches=None))):
        t0 = time.perf_counter()
        res = probe(encoder, words, "simcse", None, ProbeConfig(**{**base, **extra}), progress=not args.no_progress,
                    model_name="all-MiniLM-L6-v2")
        wall = time.perf_counter() - t0
        pilot_rows = int(np.sum(res.column("item") < base["chunk_size"]))
        runs[name] = summarize(res, pilot_rows, args.quantile) | {"wall_seconds": wall}
        if "adaptive" in res.metadata:
            runs[name]["adaptive"] = res.metadata["adaptive"]
        print(f"{name}: M = {runs[name]['M']}, {args.quantile:.0%} quantile of se(V2)/V2: pilot "
              f"{runs[name]['quantile_rse_pilot_rows']:.3f}, all rows {runs[name]['quantile_rse_all_rows']:.3f}; "
              f"V2 resolved to +-20%: {runs[name]['V2_resolved_to_20pct']:.0%}; {wall:.0f} s", flush=True)
    summary = {"experiment": "adaptive M on the demo's words", "words": args.words, "target_rse": args.target_rse,
               "quantile": args.quantile, "max_batches": args.max_batches, "config": base, "runs": runs,
               "time_ratio_adaptive_vs_fixed": runs["adaptive"]["wall_seconds"] / runs["fixed_M16"]["wall_seconds"],
               "time_ratio_drift_MD_vs_per_batch": (runs["fixed_M16"]["wall_seconds"]
                                                    / runs["fixed_M16_per_batch_drift"]["wall_seconds"]),
               "threads": torch.get_num_threads(), "load_average": [load_start, os.getloadavg()],
               "versions": _library_versions()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adaptive_m.json").write_text(json.dumps(summary, indent=1))
    print(f"adaptive / fixed wall time: {summary['time_ratio_adaptive_vs_fixed']:.2f}x; wrote {out / 'adaptive_m.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Adaptive M on the demo's words: how many heat batches a target precision takes, and what it costs.

    python -m bench run adaptive_m [--words 500] [--target-rse 0.1] [--out bench/results/adaptive_m]

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
OUT/adaptive_m.json (OUT defaults to runs/adaptive_m).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.common import MINILM_LAST_LAYER, PLAIN_HEAT, TOKEN_PROBE
from bench.harness import Context, JsonStyle

RESULTS = ("adaptive_m.json",)
FIGURES = ()
TABLES = ("adaptive_m",)
JSON = JsonStyle(newline=False, strict=False)
PARAMS = MINILM_LAST_LAYER  # the demo's probed parameters (normfast.apps.demo)


@dataclass
class Config:
    words: int = 500
    target_rse: float = 0.1
    quantile: float = 0.9
    max_batches: int = 256
    drift_batches: int = field(default=1024, metadata={"help": "M_D (the library's default)"})
    batch_size: int = field(default=32, metadata={"help": "items per virtual batch (the demo's)"})
    threads: int = 1

    @classmethod
    def quick(cls) -> "Config":
        return cls(words=16, max_batches=16, drift_batches=16, batch_size=8)


def summarize(res, pilot_rows: int, quantile: float) -> dict:
    from normfast.engine.estimators import t_quantile

    valid = res.column("valid").astype(bool)
    rse = res.column("se_V2") / res.column("V2")
    t = t_quantile(int(res.metadata["groups"]) - 1)
    ok = valid & np.isfinite(rse)
    D, se_d = res.column("D")[valid], res.column("se_D")[valid]
    return {
        "M": int(res.metadata["M"]),
        "rows": int(len(res)),
        "valid_rows": int(valid.sum()),
        "median_se_D_over_abs_D": float(np.median(se_d / np.abs(D))),
        "drift_significant_share": float(np.mean(np.abs(D) > 2 * se_d)),
        "quantile_rse_all_rows": float(np.quantile(rse[ok], quantile)),
        "quantile_rse_pilot_rows": float(np.quantile(rse[:pilot_rows][ok[:pilot_rows]], quantile)),
        "median_rse": float(np.median(rse[ok])),
        "V2_resolved_to_20pct": float(np.mean(t * rse[ok] <= 0.2)),
        "seconds": float(res.metadata["seconds"]),
    }


def run(config: Config, ctx: Context) -> dict[str, Any]:
    import torch

    import normfast
    from normfast.data.word_frequencies import top_words
    from normfast.engine.runner import library_versions

    args = config
    torch.set_num_threads(args.threads)
    encoder = normfast.load_encoder("all-MiniLM-L6-v2")
    words = top_words(args.words)
    base = dict(  # the probe's settings, as the result records them
        params=PARAMS,
        **TOKEN_PROBE,
        batch_size=args.batch_size,
        seed=0,
        chunk_size=128,
        drift_batches=args.drift_batches,
        **PLAIN_HEAT,  # its committed result predates the heat drawn by energy (bench.common.PLAIN_HEAT)
    )
    runs = {}
    load_start = os.getloadavg()
    for name, extra in (
        ("fixed_M16", dict(batches=16)),
        (
            "adaptive",
            dict(batches=16, target_rse=args.target_rse, max_batches=args.max_batches, target_quantile=args.quantile),
        ),
        ("fixed_M16_per_batch_drift", dict(batches=16, drift_batches=None)),
    ):
        t0 = time.perf_counter()
        res = normfast.probe(
            encoder,
            words,
            "simcse",
            None,
            normfast.ProbeConfig(**{**base, **extra}),
            progress=ctx.progress,
            model_name="all-MiniLM-L6-v2",
        )
        wall = time.perf_counter() - t0
        pilot_rows = int(np.sum(res.column("item") < base["chunk_size"]))
        runs[name] = summarize(res, pilot_rows, args.quantile) | {"wall_seconds": wall}
        if "adaptive" in res.metadata:
            runs[name]["adaptive"] = res.metadata["adaptive"]
        print(
            f"{name}: M = {runs[name]['M']}, {args.quantile:.0%} quantile of se(V2)/V2: pilot "
            f"{runs[name]['quantile_rse_pilot_rows']:.3f}, all rows {runs[name]['quantile_rse_all_rows']:.3f}; "
            f"V2 resolved to +-20%: {runs[name]['V2_resolved_to_20pct']:.0%}; {wall:.0f} s",
            flush=True,
        )
    return {
        "experiment": "adaptive M on the demo's words",
        "words": args.words,
        "target_rse": args.target_rse,
        "quantile": args.quantile,
        "max_batches": args.max_batches,
        "config": base,
        "runs": runs,
        "time_ratio_adaptive_vs_fixed": runs["adaptive"]["wall_seconds"] / runs["fixed_M16"]["wall_seconds"],
        "time_ratio_drift_MD_vs_per_batch": (
            runs["fixed_M16"]["wall_seconds"] / runs["fixed_M16_per_batch_drift"]["wall_seconds"]
        ),
        "threads": torch.get_num_threads(),
        "load_average": [load_start, os.getloadavg()],
        "versions": library_versions(),
    }


def tables(result: dict[str, Any]) -> dict[str, str]:
    return {"adaptive_m": table_adaptive_m(result)}


def table_adaptive_m(d: dict) -> str:
    f, a = d["runs"]["fixed_M16"], d["runs"]["adaptive"]
    q = f"{d['quantile']:.0%}"
    rows = [
        f"| run ({d['words']:,} demo words, {f['rows']:,} token rows) | M | {q} quantile of se(V2)/V2, "
        f"first chunk | same, all rows | V2 resolved to ±20% | wall time |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in (("fixed M = 16 (default)", f), (f"adaptive, target {d['target_rse']}", a)):
        rows.append(
            f"| {name} | {r['M']} | {r['quantile_rse_pilot_rows']:.3f} | {r['quantile_rse_all_rows']:.3f} | "
            f"{r['V2_resolved_to_20pct']:.0%} | {r['wall_seconds'] / f['wall_seconds']:.2f}x |"
        )
    rounds = ", ".join(f"M = {x['M']}: {x['quantile_rse']:.3f}" for x in a["adaptive"]["rounds"])
    rows += [
        "",
        f"Rounds of the adaptive run (quantile on the first chunk): {rounds}; "
        f"{'target reached' if a['adaptive']['reached'] else 'target not reached (max_batches)'}. "
        f"Wall time relative to the fixed run, same process; the drift's {d['config']['drift_batches']:,} "
        f"gradients are part of both; {d['threads']} torch thread.",
    ]
    pb = d["runs"].get("fixed_M16_per_batch_drift")
    if pb:
        rows += [
            "",
            f"The drift from M_D = {d['config']['drift_batches']:,} batches against the per-batch drift of "
            f"the 16 heat batches (same words, same M = 16): median se_D/|D| {f['median_se_D_over_abs_D']:.2f} "
            f"against {pb['median_se_D_over_abs_D']:.2f}, |D| > 2 se_D on {f['drift_significant_share']:.0%} "
            f"of rows against {pb['drift_significant_share']:.0%}, at {d['time_ratio_drift_MD_vs_per_batch']:.2f}x "
            f"the wall time.",
        ]
    return "\n".join(rows)

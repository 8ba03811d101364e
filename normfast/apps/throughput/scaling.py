"""Section "scaling": engine wall time and peak memory as N grows, one fresh process per N."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from normfast.encoders import ModuleEncoder

from .measure import environment, peak_rss_mb
from .settings import ScalingSettings

# ============================================================================
# Section "scaling": engine throughput and peak memory vs N, fresh processes
# ============================================================================


class _TokenIds:
    """Deterministic token ids for integer items (a picklable collate function)."""

    def __init__(self, length: int, vocab: int):
        self.length = length
        self.vocab = vocab

    def __call__(self, items: Sequence[int]) -> torch.Tensor:
        i = torch.as_tensor(list(items), dtype=torch.int64)[:, None]
        p = torch.arange(self.length)
        return (i * 7919 + p * 104729 + (i * p) % 13) % self.vocab


def _mean_tokens(x: torch.Tensor) -> torch.Tensor:
    return x.mean(1)


def token_model(s: ScalingSettings, seed: int = 0) -> "ModuleEncoder":
    """Embedding -> Linear+GELU -> linear head, mean-pooled: a token encoder with a head."""
    from normfast.encoders import ModuleEncoder

    torch.manual_seed(seed)
    d = s.dim
    stages = [
        torch.nn.Embedding(s.vocab, d),
        torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU()),
        torch.nn.Linear(d, d),
    ]
    return ModuleEncoder(stages, pooling=_mean_tokens, collate=_TokenIds(s.tokens_per_item, s.vocab)).eval()


def _mark_before_finalize(marks: dict[str, float]) -> None:
    """Record the peak RSS reached before the engine assembles its output file.

    Only in the throwaway scaling process: the engine streams chunks to disk,
    then concatenates them and reads the finished table back for its result.
    The mark separates the streaming loop's peak from that final read-back.
    """
    import normfast.engine.probe as engine

    writer = getattr(engine, "ChunkedParquetWriter", None)
    if writer is None:
        return

    class MarkedWriter(writer):
        def finalize(self, *args: Any, **kwargs: Any) -> Any:
            marks["streaming_peak_rss_mb"] = peak_rss_mb()
            return super().finalize(*args, **kwargs)

    engine.ChunkedParquetWriter = MarkedWriter


def scaling_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One size of the scaling section (run in a fresh process): engine time and peak RSS."""
    from normfast.engine.probe import ProbeConfig, probe

    s = ScalingSettings(**{k: tuple(v) if k == "sizes" else v for k, v in spec["settings"].items()})
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    n_tokens = int(spec["n"])
    encoder = token_model(s)
    items = list(range(max(1, n_tokens // s.tokens_per_item)))
    pairs = [(i, i + 1_000_003) for i in range(s.pairs)]
    config = ProbeConfig(
        params="head",
        mode="head",
        output="tokens",
        batches=s.m,
        batch_size=s.batch_size,
        chunk_size=s.chunk,
        radial_spread=False,
        seed=0,
        drift_batches=None,
    )
    marks: dict[str, float] = {}
    _mark_before_finalize(marks)
    setup_mb = peak_rss_mb()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = probe(
            encoder,
            items,
            "infonce",
            pairs,
            config,
            out=Path(tmp) / "run.parquet",
            progress=False,
            model_name="token-mlp",
        )
        seconds = time.perf_counter() - t0
        valid = float(np.mean(result.column("valid")))
        rows = len(result)
        table_mb = result.table.nbytes / 2**20
    return {
        "tokens": rows,
        "items": len(items),
        "seconds": seconds,
        "tokens_per_s": rows / seconds,
        "peak_rss_mb": peak_rss_mb(),
        "rss_after_setup_mb": setup_mb,
        "streaming_peak_rss_mb": marks.get("streaming_peak_rss_mb"),
        "table_mb": table_mb,
        "valid_fraction": valid,
        "threads": torch.get_num_threads(),
    }


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    code = (
        "import json, sys; from normfast.apps.throughput.scaling import scaling_child; "
        "print('@@' + json.dumps(scaling_child(json.loads(sys.argv[1]))))"
    )
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"normfast throughput: the scaling run for N={spec['n']} failed:\n{proc.stderr[-2000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@")][-1]
    return json.loads(line[2:])


def run_scaling(s: ScalingSettings, progress: bool = True) -> dict[str, Any]:
    from normfast.core.stats import loglog_fit
    from normfast.ops import head_flops

    runs = []
    for n in tqdm(s.sizes, desc="scaling", unit="size", disable=not progress, leave=False):
        runs.append(
            {"n_requested": n, **_run_child({"n": n, "settings": asdict(s), "threads": torch.get_num_threads()})}
        )
    tokens = np.array([r["tokens"] for r in runs], dtype=float)
    seconds = np.array([r["seconds"] for r in runs], dtype=float)
    # seconds = fixed + per_token * N: the fixed part is the directions and set-up
    design = np.stack([np.ones_like(tokens), tokens], 1)
    (fixed, per_token), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    predicted = design @ np.array([fixed, per_token])
    top = tokens >= tokens.max() / 10**1.01 if len(tokens) > 2 else np.ones_like(tokens, bool)
    top_slope = (
        float(np.log(seconds[top][-1] / seconds[top][0]) / np.log(tokens[top][-1] / tokens[top][0]))
        if top.sum() >= 2
        else math.nan
    )
    peaks = np.array([r["peak_rss_mb"] for r in runs])
    growth = peaks - np.array([r["rss_after_setup_mb"] for r in runs])
    streaming = [r["streaming_peak_rss_mb"] for r in runs]
    for r in runs:
        r["flops_head_S_form"] = head_flops(r["tokens"], s.dim, s.dim, s.m, bias=True)["S"]
    return {
        "what": "the engine (normfast.engine.probe, head mode, token-level rows, Parquet output) on a "
        "token encoder (embedding, linear+GELU, linear head; mean pooling) as the number of "
        "token rows N grows; each N in a fresh process (peak RSS = VmHWM)",
        "config": {**asdict(s), "form": "S (radial_spread=False)", "objective": "infonce"},
        "environment": environment(),
        "runs": runs,
        "linear_fit": {
            "fixed_seconds": float(fixed),
            "seconds_per_token": float(per_token),
            "tokens_per_s_marginal": float(1 / per_token) if per_token > 0 else math.nan,
            "max_rel_residual": float(np.max(np.abs(predicted - seconds) / seconds)),
        },
        "loglog_seconds_vs_tokens": loglog_fit(tokens, seconds),
        "loglog_slope_top_decade": top_slope,
        "peak_rss_mb": {
            "min": float(peaks.min()),
            "max": float(peaks.max()),
            "growth_over_setup_mb": [float(x) for x in growth],
            "streaming_loop_growth_over_setup_mb": [
                None if m is None else float(m - r["rss_after_setup_mb"]) for m, r in zip(streaming, runs)
            ],
        },
        "memory_note": "peak_rss_mb includes the engine's final step (the finished Parquet table read "
        "back into the ProbeResult, which grows with N); streaming_peak_rss_mb is the "
        "peak before that step (the chunk loop)",
        "see_also": "python -m bench run streaming: 10^7 tokens streamed through the engine",
    }

"""What a worker stage gets: device, deadline, partial results; timing and environment helpers."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from .common import read_json, write_json


class StageContext:
    """What a stage function gets: device, deadline, partial-result saving, earlier results."""

    def __init__(self, stage: str, deadline: float, results: Path, dry_run: bool, tokens: str = "auto"):
        import torch

        self.stage = stage
        self.tokens = tokens
        self.deadline = deadline
        self.results = results
        self.dry_run = dry_run
        self.gpu = torch.cuda.is_available() and not dry_run
        self.device = torch.device("cuda" if self.gpu else "cpu")
        self.partial: dict[str, Any] = {}

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        write_json(self.results / f"{self.stage}.partial.json", self.partial)

    def earlier(self, stage: str) -> dict[str, Any] | None:
        entry = read_json(self.results / f"{stage}.json")
        return entry.get("result") if entry and entry.get("status") == "ok" else None

    def sync(self) -> None:
        import torch

        if self.gpu:
            torch.cuda.synchronize()


def bench(ctx: StageContext, fn: Callable[[], Any], *, max_s: float = 3.0) -> dict[str, Any]:
    """p20/p50/p80 of ``fn`` in ms: ``triton.testing.do_bench`` on CUDA, a wall clock on CPU.

    ``fn`` has been called (warm) before. The repetition time scales with the
    cost of one call so that a slow op gets at least a few samples and a fast
    one many, within about ``max_s`` seconds.
    """
    ctx.sync()
    t0 = time.perf_counter()
    fn()
    ctx.sync()
    est_ms = (time.perf_counter() - t0) * 1e3
    if ctx.gpu:
        import triton.testing

        rep = min(max(100.0, 20 * est_ms), max(100.0, max_s * 1e3 - 7 * est_ms))
        warmup = min(max(25.0, 2 * est_ms), 300.0)
        q = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.2, 0.5, 0.8])
        return {
            "p20_ms": q[0],
            "p50_ms": q[1],
            "p80_ms": q[2],
            "reps": max(1, int(rep / max(est_ms, 1e-3))),
            "timer": "triton.testing.do_bench",
        }
    from normfast.apps.throughput import percentiles

    reps = max(3, min(20, int(max_s * 1e3 / max(est_ms, 1e-3) / 4)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    q = percentiles(times)
    return {"p20_ms": q["p20"], "p50_ms": q["p50"], "p80_ms": q["p80"], "reps": reps, "timer": "wall clock (CPU)"}


def first_calls(ctx: StageContext, fn: Callable[[], Any]) -> dict[str, float]:
    """Times of the first and second call: the difference is compilation and other set-up."""
    out = {}
    for key in ("first_call_s", "second_call_s"):
        ctx.sync()
        t0 = time.perf_counter()
        fn()
        ctx.sync()
        out[key] = round(time.perf_counter() - t0, 4)
    out["setup_s"] = round(max(0.0, out["first_call_s"] - out["second_call_s"]), 4)
    return out


@contextlib.contextmanager
def tf32_matmul(enabled: bool):
    """cuBLAS fp32 matmuls with or without TF32, restored afterwards.

    The flag is set and restored through one API only: torch refuses to report
    the precision while its legacy and new TF32 switches disagree.
    """
    import torch

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def matmul_precision() -> str:
    import torch

    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError as exc:  # the TF32 switches were set through both APIs
        return f"unknown ({str(exc)[:80]})"


def nvidia_smi() -> dict[str, str] | None:
    fields = (
        "name,driver_version,pstate,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,"
        "temperature.gpu,power.draw,power.limit,memory.used,memory.total"
    )
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0 or not done.stdout.strip():
        return None
    values = [v.strip() for v in done.stdout.strip().splitlines()[0].split(",")]
    return dict(zip(fields.split(","), values))


def cuda_usable() -> bool:
    import torch

    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return False

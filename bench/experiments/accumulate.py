"""Fused accumulator update vs the obvious sequence of torch ops.

    python -m bench run accumulate --device cuda --dtype bfloat16
    python -m bench run accumulate --device cpu --n 20000 --dim 384

Both sides fold ``K`` directions of displacements ``t [K, N, d]`` for ``N``
probes into per-probe running statistics, repeatedly, on the same data:

* ``normfast``: :meth:`normfast.ops.ProbeAccumulator.update`. On CUDA this
  is the fused Triton kernel (one read of ``t``: branch scaling, radial dot,
  squared norm and the shifted-sum merge in one pass). On CPU there is no
  Triton kernel: the accumulator runs its torch path, so the CPU ratio only
  compares two torch implementations.
* ``torch ops``: norm, normalize, scale, radial dot, squared norms, running
  sums and sign counts as separate torch ops (raw sums, no shift).

Accuracy is checked first (both against a float64 brute force), then each
side is timed (p20/p50/p80 of per-update time). Writes OUT/accumulate.json
(OUT: runs/accumulate by default; the committed result: --out bench/results/accumulate)
and prints a markdown table. Only the ratios measured in the same run are
claims.
"""

from __future__ import annotations

import itertools
import platform
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.harness import Context, JsonStyle

RESULTS = ("accumulate.json",)
FIGURES = ()
TABLES = ()
JSON = JsonStyle(indent=2, strict=False)
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class Config:
    device: str | None = field(default=None, metadata={"help": "cuda or cpu (none: cuda when available)"})
    dtype: str = field(default="float32", metadata={"choices": DTYPES})
    n: tuple[int, ...] = field(default=(), metadata={"help": "probes (none: 1e6 on CUDA, 20000 on CPU)"})
    dim: tuple[int, ...] = (64, 384, 1024)
    k: int = field(default=8, metadata={"help": "directions per update"})
    updates: int = 5
    repeats: int = 5
    check_rows: int = 2000

    @classmethod
    def quick(cls) -> "Config":
        return cls(n=(200,), dim=(8,), updates=1, repeats=1, check_rows=50)


class TorchOpsAccumulator:
    """The obvious implementation: raw running sums updated by separate torch ops."""

    def __init__(self, n, d, device):
        import torch

        self.n = 0
        self.sum_x = torch.zeros(n, d, device=device)
        self.sum_sq = torch.zeros(n, device=device)
        self.sum_r = torch.zeros(n, device=device)
        self.sum_r2 = torch.zeros(n, device=device)
        self.pos = torch.zeros(n, dtype=torch.int64, device=device)
        self.neg = torch.zeros(n, dtype=torch.int64, device=device)

    def update(self, t, z):
        import torch

        z = z.float()
        norm = torch.linalg.vector_norm(z, dim=1)
        zhat = z / norm[:, None]
        x = t.float() * norm[None, :, None]
        r = (x * zhat[None]).sum(-1)
        self.sum_r += r.sum(0)
        self.sum_r2 += (r * r).sum(0)
        self.pos += (r > 0).sum(0)
        self.neg += (r < 0).sum(0)
        self.sum_x += x.sum(0)
        self.sum_sq += (x * x).sum((0, 2))
        self.n += t.shape[0]
        return self

    def finalize(self):
        import torch

        m = self.n
        mean = self.sum_x / m
        m2 = (mean * mean).sum(1)
        v2 = (self.sum_sq - m * m2) / (m - 1)
        drift = self.sum_r / m
        var_r = (self.sum_r2 - m * drift * drift) / (m - 1)
        zero = m - self.pos - self.neg
        agree = torch.where(drift > 0, self.pos, torch.where(drift < 0, self.neg, zero))
        return {
            "D": drift,
            "se_D": torch.sqrt(var_r.clamp_min(0) / m),
            "sign_stability": agree.float() / m,
            "m2": m2,
            "V2": v2,
            "Q": m2 + v2,
        }


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_updates(make, t, z, updates, repeats, device):
    """Seconds per update: for each repeat a fresh accumulator takes `updates` updates."""
    per_update = []
    for _ in range(repeats):
        acc = make()
        acc.update(t, z)  # warm-up (compilation, allocator)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(updates):
            acc.update(t, z)
        sync(device)
        per_update.append((time.perf_counter() - t0) / updates)
    return per_update


def run_case(n, d, k, dtype, device, updates, repeats, check_rows):
    import torch

    from normfast import ops
    from normfast.core.reference import brute_force_stats, stat_errors

    g = torch.Generator().manual_seed(n * 31 + d)
    t = 0.3 * torch.randn(1, n, d, generator=g) + torch.randn(k, n, d, generator=g)
    t = t.to(device, dtype)
    z = (0.2 + torch.randn(n, d, generator=g)).to(device, dtype)

    # accuracy on the same data, against a float64 brute force over 2 updates
    rows = slice(0, min(n, check_rows))
    both = torch.cat([t[:, rows], t[:, rows]]).double().cpu()
    want = brute_force_stats(both, z[rows].double().cpu(), "u")
    fused = ops.ProbeAccumulator(n, d, device=device).update(t, z).update(t, z).finalize()
    plain = TorchOpsAccumulator(n, d, device).update(t, z).update(t, z).finalize()
    keys = ["D", "se_D", "m2", "V2", "Q"]
    errors = {
        name: stat_errors({k_: res[k_][rows].cpu() for k_ in keys}, want, keys)
        for name, res in (("normfast", fused), ("torch ops", plain))
    }

    makers = {
        "normfast": lambda: ops.ProbeAccumulator(n, d, device=device),
        "torch ops": lambda: TorchOpsAccumulator(n, d, device),
    }
    times = {name: time_updates(make, t, z, updates, repeats, device) for name, make in makers.items()}
    elem = t.element_size()
    # minimum traffic of one fused update: read t and z, read+write the fp32 mean,
    # ~10 per-row scalars
    bytes_moved = k * n * d * elem + n * d * elem + 2 * n * d * 4 + 10 * n * 8
    out = {"n": n, "dim": d, "k": k, "dtype": str(dtype).replace("torch.", ""), "errors": errors, "methods": {}}
    for name, ts in times.items():
        q = np.percentile(ts, [20, 50, 80])
        out["methods"][name] = {
            "p20_s": float(q[0]),
            "p50_s": float(q[1]),
            "p80_s": float(q[2]),
            "probe_directions_per_s": k * n / float(q[1]),
            "GB_per_s_min_traffic": bytes_moved / float(q[1]) / 1e9,
        }
    out["speedup"] = out["methods"]["torch ops"]["p50_s"] / out["methods"]["normfast"]["p50_s"]
    return out


def run(config: Config, ctx: Context) -> dict[str, Any]:
    import torch

    from normfast.apps.throughput import cpu_model

    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, config.dtype)
    sizes = config.n or ([1_000_000] if device.type == "cuda" else [20_000])

    cases = [
        run_case(n, d, config.k, dtype, device, config.updates, config.repeats, config.check_rows)
        for n, d in itertools.product(sizes, config.dim)
    ]
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        import triton

        env.update(gpu=torch.cuda.get_device_name(device), triton=triton.__version__)
    else:
        env["cpu"] = cpu_model()
    return {
        "benchmark": "accumulate",
        "environment": env,
        "path": (
            "fused Triton kernel vs torch ops"
            if device.type == "cuda"
            else "CPU: ProbeAccumulator's torch path (no Triton kernel on CPU) vs torch ops"
        ),
        "cases": cases,
        "note": "ratios measured in the same run are the result, absolute times are not",
    }


def tables(result: dict[str, Any]) -> dict[str, str]:
    lines = [
        f"{result['path']}; {result['environment']}",
        "",
        "| N | d | K | dtype | normfast ms | torch ops ms | speedup | normfast GB/s "
        "| max err normfast | max err torch ops |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["cases"]:
        nf, to = c["methods"]["normfast"], c["methods"]["torch ops"]
        lines.append(
            f"| {c['n']} | {c['dim']} | {c['k']} | {c['dtype']} | {nf['p50_s'] * 1e3:.2f} | "
            f"{to['p50_s'] * 1e3:.2f} | {c['speedup']:.2f}x | {nf['GB_per_s_min_traffic']:.1f} | "
            f"{max(c['errors']['normfast'].values()):.1e} | "
            f"{max(c['errors']['torch ops'].values()):.1e} |"
        )
    return {"accumulate": "\n".join(lines)}

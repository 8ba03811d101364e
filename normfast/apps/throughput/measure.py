"""Measurement helpers shared by the sections: timing rounds, percentiles, accuracy checks, FLOPs."""

from __future__ import annotations

import math
import os
import platform
import resource
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from normfast.engine.runner.provenance import library_versions

from .settings import BASELINE_PACKAGES

# ============================================================================
# Shared measurement helpers
# ============================================================================


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_name() -> str:
    """The GPU's name, else the CPU's model and core count: the machine a report was measured on."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({cpu_model()}, {os.cpu_count()} cores)"


def environment() -> dict[str, Any]:
    """Device, library versions and thread count of this process, for every JSON."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "device": machine_name(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "versions": library_versions(BASELINE_PACKAGES),
        "load_average": list(load) if load else None,
    }


def percentiles(times: Sequence[float]) -> dict[str, Any]:
    """p20/p50/p80 of repeated timings (seconds), plus every run."""
    q = np.percentile(np.asarray(times, dtype=float), [20, 50, 80])
    return {"p20": float(q[0]), "p50": float(q[1]), "p80": float(q[2]), "runs": [float(t) for t in times]}


def throughput(times: Sequence[float], items: int) -> dict[str, float]:
    """Items per second at the p20/p50/p80 of throughput (the p80/p50/p20 of time)."""
    q = np.percentile(np.asarray(times, dtype=float), [80, 50, 20])
    return {"p20": float(items / q[0]), "p50": float(items / q[1]), "p80": float(items / q[2])}


def peak_rss_mb() -> float:
    """High-water mark of this process's resident memory, in MB.

    ``/proc/self/status`` VmHWM belongs to the current address space, so it is
    not inherited from the parent across fork + exec (``ru_maxrss`` can be).
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def accuracy_check(name: str, max_rel_diff: float, tolerance: float, against: str) -> dict[str, Any]:
    """One accuracy record; NaN or inf never passes."""
    value = float(max_rel_diff)
    return {
        "check": name,
        "max_rel_diff": value,
        "tolerance": float(tolerance),
        "passed": bool(math.isfinite(value) and value <= tolerance),
        "against": against,
    }


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` (scale-relative over the whole tensor)."""
    got, want = got.detach().double(), want.detach().double()
    scale = float(want.abs().max())
    return float((got - want).abs().max()) / scale if scale > 0 else float((got - want).abs().max())


def time_rounds(
    methods: dict[str, Callable[[], Any]],
    repeats: int,
    runs_per_round: dict[str, int] | None = None,
    *,
    desc: str = "timing",
    progress: bool = True,
) -> dict[str, list[float]]:
    """Wall time of each method, interleaved: every round runs every method."""
    runs_per_round = runs_per_round or {}
    total = repeats * sum(runs_per_round.get(name, 1) for name in methods)
    times: dict[str, list[float]] = {name: [] for name in methods}
    with tqdm(total=total, desc=desc, unit="run", disable=not progress, leave=False) as bar:
        for _ in range(repeats):
            for name, fn in methods.items():
                for _ in range(runs_per_round.get(name, 1)):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
                    bar.update()
    return times


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of the matmul-class ops ``fn`` runs (``torch.utils.flop_counter``)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return int(counter.get_total_flops())


class threads:
    """Run a block with ``n`` torch threads (0: unchanged)."""

    def __init__(self, n: int):
        self.n = n
        self.saved = torch.get_num_threads()

    def __enter__(self) -> "threads":
        if self.n:
            torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.set_num_threads(self.saved)

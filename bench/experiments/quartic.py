"""Batched quartic solve: normfast's C++ solver vs numpy baselines.

    python -m bench run quartic
    python -m bench run quartic --rows 200000 --repeats 3 --out /tmp/quartic

Two workloads, each timed in the same process, methods interleaved per repeat:

* ``general``: rows with independent standard-normal coefficients (a full
  quartic, 0-4 positive roots). Baseline: numpy's batched companion-matrix
  eigenvalues (``np.linalg.eigvals`` on an ``[N, 4, 4]`` stack, LAPACK
  ``geev`` per matrix), then the largest positive real part among the roots
  whose imaginary part is negligible.
* ``biquadratic``: ``b = d = 0``. Baseline: the vectorized closed form in
  ``x = R^2`` (the cancellation-free pair of root formulas), in numpy.

First both methods are run on the same rows and compared (max relative
difference where both find a root; rows where only one does). Then each is
timed ``--repeats`` times (p20/p50/p80 wall time, rows/s, and the process CPU
time summed over threads). normfast runs with OpenMP's default thread count and
with one thread. On a shared machine the wall-time gain of the second thread
depends on what else runs; the CPU-time ratio of the one-thread run is the
load-independent figure. Writes OUT/quartic.json (OUT: runs/quartic by default;
the committed result: --out bench/results/quartic) and prints a markdown table.

Only ratios measured in the same run are claims; the absolute times depend on
the machine and, on a shared one, on its load (recorded in the JSON).
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from bench.harness import Context, JsonStyle

RESULTS = ("quartic.json",)
FIGURES = ()
TABLES = ("quartic",)
JSON = JsonStyle(indent=2, strict=False)
# the baseline's test for "real": |Im| <= IMAG_RTOL |lambda|
IMAG_RTOL = 1e-8


@dataclass
class Config:
    rows: int = 1_000_000
    repeats: int = 5
    seed: int = 0

    @classmethod
    def quick(cls) -> "Config":
        return cls(rows=2000, repeats=1)

    def validate(self) -> None:
        if self.rows < 1 or self.repeats < 1:
            raise ValueError(f"quartic: expected rows >= 1 and repeats >= 1, got {self.rows}, {self.repeats}")


def eigvals_largest_positive(coeffs: np.ndarray) -> np.ndarray:
    """numpy baseline: companion-matrix eigenvalues, largest positive (numerically) real one."""
    n = len(coeffs)
    companion = np.zeros((n, 4, 4))
    companion[:, 0, :] = -coeffs[:, 1:] / coeffs[:, :1]
    companion[:, [1, 2, 3], [0, 1, 2]] = 1.0
    eig = np.linalg.eigvals(companion)
    real = (np.abs(eig.imag) <= IMAG_RTOL * np.abs(eig)) & (eig.real > 0)
    best = np.where(real, eig.real, -np.inf).max(axis=1)
    return np.where(np.isfinite(best), best, np.nan)


def biquadratic_closed_form(coeffs: np.ndarray) -> np.ndarray:
    """numpy baseline: a x^2 + c x + e = 0 in x = R^2, both roots without cancellation."""
    a, c, e = coeffs[:, 0], coeffs[:, 2], coeffs[:, 4]
    with np.errstate(invalid="ignore", divide="ignore"):
        q = -0.5 * (c + np.copysign(np.sqrt(c * c - 4.0 * a * e), c))
        x = np.fmax(np.where(q / a > 0, q / a, np.nan), np.where(e / q > 0, e / q, np.nan))
        return np.sqrt(x)


def compare(ours: np.ndarray, theirs: np.ndarray) -> dict:
    both = np.isfinite(ours) & np.isfinite(theirs)
    rel = np.abs(ours[both] - theirs[both]) / np.abs(ours[both])
    return {
        "rows_compared": int(both.sum()),
        "max_rel_diff": float(rel.max()) if rel.size else None,
        "median_rel_diff": float(np.median(rel)) if rel.size else None,
        "only_normfast_finds_a_root": int((np.isfinite(ours) & ~np.isfinite(theirs)).sum()),
        "only_baseline_finds_a_root": int((~np.isfinite(ours) & np.isfinite(theirs)).sum()),
    }


BASELINES = {"general": "numpy_eigvals", "biquadratic": "numpy_closed_form"}


def time_methods(methods: dict[str, Callable[[], object]], repeats: int, n_rows: int) -> dict:
    """Wall time per run, and the process CPU time (all threads) as a load-independent view."""
    wall: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, run in methods.items():  # interleaved: slow drifts in load hit every method alike
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    out = {}
    for name, ts in wall.items():
        p20, p50, p80 = np.percentile(ts, [20, 50, 80])
        out[name] = {
            "seconds_p20": p20,
            "seconds_p50": p50,
            "seconds_p80": p80,
            "rows_per_s_p50": n_rows / p50,
            "seconds_all": ts,
            "cpu_seconds_p50": float(np.median(cpu[name])),
            "cpu_seconds_all": cpu[name],
        }
    return out


def run(config: Config, ctx: Context) -> dict[str, Any]:
    import normfast
    from normfast.apps.throughput import cpu_model
    from normfast.core.equilibrium import solver_threads

    solve_quartic = normfast.solve_quartic
    rng = np.random.default_rng(config.seed)
    general = rng.standard_normal((config.rows, 5))
    biquad = rng.standard_normal((config.rows, 5))
    biquad[:, [1, 3]] = 0.0
    threads = solver_threads()
    load_before = os.getloadavg()

    # agreement first
    agreement = {
        "general": compare(solve_quartic(general)[0], eigvals_largest_positive(general)),
        "biquadratic": compare(solve_quartic(biquad)[0], biquadratic_closed_form(biquad)),
    }

    timings = {
        "general": time_methods(
            {
                "normfast": lambda: solve_quartic(general),
                "normfast_1_thread": lambda: solve_quartic(general, threads=1),
                "numpy_eigvals": lambda: eigvals_largest_positive(general),
            },
            config.repeats,
            config.rows,
        ),
        "biquadratic": time_methods(
            {
                "normfast": lambda: solve_quartic(biquad),
                "normfast_1_thread": lambda: solve_quartic(biquad, threads=1),
                "numpy_closed_form": lambda: biquadratic_closed_form(biquad),
            },
            config.repeats,
            config.rows,
        ),
    }
    ratios = {}
    for workload, base in BASELINES.items():
        t = timings[workload]
        ratios[workload] = {
            f"normfast_vs_{base}": t[base]["seconds_p50"] / t["normfast"]["seconds_p50"],
            f"normfast_1_thread_vs_{base}": t[base]["seconds_p50"] / t["normfast_1_thread"]["seconds_p50"],
            # CPU seconds summed over threads: the work per row, whatever the machine's load
            f"cpu_time_normfast_1_thread_vs_{base}": t[base]["cpu_seconds_p50"]
            / t["normfast_1_thread"]["cpu_seconds_p50"],
        }

    return {
        "benchmark": "quartic",
        "command": ctx.command,
        "rows": config.rows,
        "repeats": config.repeats,
        "seed": config.seed,
        "environment": {
            "cpu": cpu_model(),
            "logical_cpus": os.cpu_count(),
            "openmp_threads": threads,
            "python": platform.python_version(),
            "numpy": np.__version__,
            "normfast": normfast.__version__,
            "platform": platform.platform(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "agreement": agreement,
        "timings": timings,
        "ratios_p50": ratios,
        "claims": "only the ratios (same process, interleaved runs) are claims; absolute times "
        "depend on the machine and its load",
    }


def tables(result: dict[str, Any]) -> dict[str, str]:
    return {"quartic": table_quartic(result), "quartic, every method": timing_table(result)}


def timing_table(result: dict[str, Any]) -> str:
    """Every method's times, the agreement and the load (what a run prints)."""
    env, timings, agreement = result["environment"], result["timings"], result["agreement"]
    lines = [
        f"quartic solve, {result['rows']:,} rows, {result['repeats']} repeats, "
        f"OpenMP threads {env['openmp_threads']}, {env['cpu']}",
        "",
        "| workload | method | p20 s | p50 s | p80 s | rows/s (p50) | speed-up (wall) | CPU s (p50) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for workload, base in BASELINES.items():
        for name, t in timings[workload].items():
            ratio = timings[workload][base]["seconds_p50"] / t["seconds_p50"]
            lines.append(
                f"| {workload} | {name} | {t['seconds_p20']:.3f} | {t['seconds_p50']:.3f} | "
                f"{t['seconds_p80']:.3f} | {t['rows_per_s_p50']:.3g} | {ratio:.1f}x | "
                f"{t['cpu_seconds_p50']:.3f} |"
            )
    lines.append("")
    for workload, a in agreement.items():
        lines.append(
            f"{workload}: max rel diff {a['max_rel_diff']:.2e} over {a['rows_compared']:,} rows; "
            f"root found only by normfast {a['only_normfast_finds_a_root']}, "
            f"only by the baseline {a['only_baseline_finds_a_root']}"
        )
    lines.append(f"\nload average before/after: {env['load_average_before']} / {env['load_average_after']}")
    return "\n".join(lines)


def table_quartic(d: dict) -> str:
    r = d["ratios_p50"]
    a = d["agreement"]
    env = d["environment"]
    gen, bi = r["general"], r["biquadratic"]
    rows = [
        "| workload (10^6 rows) | baseline | normfast speed-up, "
        f"{env['openmp_threads']} threads | 1 thread | max rel. difference |",
        "|---|---|---|---|---|",
        f"| general quartic (standard-normal coefficients) | numpy batched companion-matrix `eigvals` | "
        f"{gen['normfast_vs_numpy_eigvals']:.1f}x | {gen['normfast_1_thread_vs_numpy_eigvals']:.1f}x | "
        f"{a['general']['max_rel_diff']:.1e} |",
        f"| biquadratic (b = d = 0) | vectorized numpy closed form | "
        f"{bi['normfast_vs_numpy_closed_form']:.2f}x | {bi['normfast_1_thread_vs_numpy_closed_form']:.2f}x | "
        f"{a['biquadratic']['max_rel_diff']:.1e} |",
    ]
    return "\n".join(rows)

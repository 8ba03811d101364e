"""Batched quartic solve: normfast's C++ solver vs numpy baselines.

    python bench/quartic.py
    python bench/quartic.py --rows 200000 --repeats 3 --out /tmp/quartic.json

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
load-independent figure. Writes JSON (default
runs/quartic.json; the committed result: --out bench/results/quartic.json) and prints a markdown table.

Only ratios measured in the same run are claims; the absolute times depend on
the machine and, on a shared one, on its load (recorded in the JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

import normfast
from normfast.core import _quartic
from normfast.apps.benchmark import cpu_model
from normfast.core.equilibrium import solve_quartic

RUNS = Path(__file__).resolve().parents[1] / "runs"  # default output (git-ignored)
# the baseline's test for "real": |Im| <= IMAG_RTOL |lambda|
IMAG_RTOL = 1e-8


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
        out[name] = {"seconds_p20": p20, "seconds_p50": p50, "seconds_p80": p80,
                     "rows_per_s_p50": n_rows / p50, "seconds_all": ts,
                     "cpu_seconds_p50": float(np.median(cpu[name])), "cpu_seconds_all": cpu[name]}
    return out



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RUNS / "quartic.json",
                        help="output JSON (default %(default)s; the committed result: --out bench/results/quartic.json)")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    general = rng.standard_normal((args.rows, 5))
    biquad = rng.standard_normal((args.rows, 5))
    biquad[:, [1, 3]] = 0.0
    threads = _quartic.default_threads()
    load_before = os.getloadavg()

    # agreement first
    agreement = {
        "general": compare(solve_quartic(general)[0], eigvals_largest_positive(general)),
        "biquadratic": compare(solve_quartic(biquad)[0], biquadratic_closed_form(biquad)),
    }

    timings = {
        "general": time_methods({
            "normfast": lambda: solve_quartic(general),
            "normfast_1_thread": lambda: solve_quartic(general, threads=1),
            "numpy_eigvals": lambda: eigvals_largest_positive(general),
        }, args.repeats, args.rows),
        "biquadratic": time_methods({
            "normfast": lambda: solve_quartic(biquad),
            "normfast_1_thread": lambda: solve_quartic(biquad, threads=1),
            "numpy_closed_form": lambda: biquadratic_closed_form(biquad),
        }, args.repeats, args.rows),
    }
    baselines = {"general": "numpy_eigvals", "biquadratic": "numpy_closed_form"}
    ratios = {}
    for workload, base in baselines.items():
        t = timings[workload]
        ratios[workload] = {
            f"normfast_vs_{base}": t[base]["seconds_p50"] / t["normfast"]["seconds_p50"],
            f"normfast_1_thread_vs_{base}":
                t[base]["seconds_p50"] / t["normfast_1_thread"]["seconds_p50"],
            # CPU seconds summed over threads: the work per row, whatever the machine's load
            f"cpu_time_normfast_1_thread_vs_{base}":
                t[base]["cpu_seconds_p50"] / t["normfast_1_thread"]["cpu_seconds_p50"],
        }

    result = {
        "benchmark": "quartic",
        "command": " ".join(["bench/quartic.py", *(argv if argv is not None else sys.argv[1:])]),
        "rows": args.rows,
        "repeats": args.repeats,
        "seed": args.seed,
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"## quartic solve, {args.rows:,} rows, {args.repeats} repeats, "
          f"OpenMP threads {threads}, {cpu_model()}\n")
    print("| workload | method | p20 s | p50 s | p80 s | rows/s (p50) | speed-up (wall) "
          "| CPU s (p50) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for workload, base in baselines.items():
        for name, t in timings[workload].items():
            ratio = timings[workload][base]["seconds_p50"] / t["seconds_p50"]
            print(f"| {workload} | {name} | {t['seconds_p20']:.3f} | {t['seconds_p50']:.3f} | "
                  f"{t['seconds_p80']:.3f} | {t['rows_per_s_p50']:.3g} | {ratio:.1f}x | "
                  f"{t['cpu_seconds_p50']:.3f} |")
    print()
    for workload, a in agreement.items():
        print(f"{workload}: max rel diff {a['max_rel_diff']:.2e} over {a['rows_compared']:,} rows; "
              f"root found only by normfast {a['only_normfast_finds_a_root']}, "
              f"only by the baseline {a['only_baseline_finds_a_root']}")
    load_after = result["environment"]["load_average_after"]
    print(f"\nload average before/after: {load_before} / {load_after}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

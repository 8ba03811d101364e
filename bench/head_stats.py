"""Head mode vs per-batch materialization: speed, FLOPs and peak memory.

    python bench/head_stats.py [--n 200000] [--dim 384] [--m 64] [--repeats 3]

Three ways to get the per-probe statistics (D, m2, V2, Q) of a linear
projection head ``z = W a + b`` under M virtual InfoNCE batches, timed in the
same process on the same data:

* ``normfast``: one ordinary backward per batch gives ``G_B``, ``g_B``; then
  :func:`normfast.engine.ops.head_stats` in the S form (``radial_spread=False``),
  including the cost of centering the directions and forming ``S_c``.
* ``naive``: the same backward, then for every batch ``T = A G_Bᵀ + g_B`` is
  materialized for all probes and reduced by separate torch ops.
* ``torch.func``: per-sample gradients of the head (``vmap(grad(...))`` over
  the per-row InfoNCE terms), summed per batch to ``G_B``, then applied to
  every probe as in ``naive``.

All three are checked against a float64 brute force on a subset of probes
before any timing. A fresh subprocess then streams 10^6 probes through head
mode in chunks and reports its peak RSS. Writes runs/head_stats.json
(the committed result: --out bench/results/head_stats.json) and prints a markdown table. CPU timings on a shared VM are noisy: only the
ratios (same run, same machine) are claims.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from normfast.apps.benchmark import (Phases, apply_per_batch, cpu_model, head_directions_backward,
                                head_directions_torch_func, head_flop_counts, make_head_problem,
                                peak_rss_mb, percentiles)
from normfast.engine.ops import head_stats, prepare_head
from normfast.core.reference import brute_force_stats, stat_errors

RUNS = Path(__file__).resolve().parents[1] / "runs"  # default output (git-ignored)
KEYS = ("D", "m2", "V2", "Q")

# ------------------------------------------------------------------ methods
def run_normfast(W, b, A, Z, anchors, positives, phases):
    G, g = phases.directions(head_directions_backward, W, b, anchors, positives)
    return phases.statistics(head_stats, A, Z, G, g, form="S", radial_spread=False)


def run_naive(W, b, A, Z, anchors, positives, phases):
    G, g = phases.directions(head_directions_backward, W, b, anchors, positives)
    return phases.statistics(apply_per_batch, A, Z, G, g)


def run_torch_func(W, b, A, Z, anchors, positives, phases):
    G, g = phases.directions(head_directions_torch_func, W, b, anchors, positives)
    return phases.statistics(apply_per_batch, A, Z, G, g)


METHODS = {"normfast": run_normfast, "naive": run_naive, "torch.func": run_torch_func}


def flop_counts(n, d_in, d_out, m, pairs):
    """Multiply-add FLOPs (2 per MAC) of each method; elementwise work not counted."""
    counts = head_flop_counts(n, d_in, d_out, m, pairs)
    return {name: counts[name] for name in METHODS}


# --------------------------------------------------------------------- utils
def check_accuracy(problem, n_check):
    """Each method vs the float64 brute force on the first n_check probes."""
    W, b, A, Z, anchors, positives = problem
    G, g = head_directions_backward(W, b, anchors, positives)
    G_ps, g_ps = head_directions_torch_func(W, b, anchors, positives)
    A64, Z64 = A[:n_check].double(), Z[:n_check].double()
    T = -(torch.einsum("bji,ni->bnj", G.double(), A64) + g.double()[:, None, :])
    want = brute_force_stats(T, Z64, "u")
    sub = (W, b, A[:n_check], Z[:n_check], anchors, positives)
    errors = {name: stat_errors(fn(*sub, Phases()), want, list(KEYS))
              for name, fn in METHODS.items()}
    errors["G_per_sample_vs_backward"] = float((G_ps - G).abs().max() / G.abs().max())
    return errors


def memory_child(n_total, chunk, d_in, d_out, m, pairs):
    """Stream n_total probes through head mode in chunks; print the peak RSS in MB."""
    W, b, _, _, anchors, positives = make_head_problem(1, d_in, d_out, m, pairs, seed=1)
    base = peak_rss_mb()
    dirs = prepare_head(*head_directions_backward(W, b, anchors, positives))
    dirs.covariance()
    out = {k: torch.empty(n_total) for k in KEYS}
    reason = torch.empty(n_total, dtype=torch.int8)
    g = torch.Generator().manual_seed(2)
    t0 = time.perf_counter()
    for lo in range(0, n_total, chunk):
        hi = min(lo + chunk, n_total)
        a = torch.randn(hi - lo, d_in, generator=g)
        res = head_stats(a, torch.addmm(b, a, W.T), dirs, form="S", radial_spread=False)
        for k in KEYS:
            out[k][lo:hi] = res[k]
        reason[lo:hi] = res["reason"]
    elapsed = time.perf_counter() - t0
    peak = peak_rss_mb()
    print(json.dumps({"peak_rss_mb": peak, "rss_after_imports_mb": base, "probes": n_total,
                      "chunk": chunk, "seconds": elapsed,
                      "all_valid": bool((reason == 0).all())}))


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=200_000, help="probes")
    p.add_argument("--dim", type=int, default=384, help="d_in = d_out of the head")
    p.add_argument("--m", type=int, default=64, help="virtual batches")
    p.add_argument("--pairs", type=int, default=32, help="anchor/positive pairs per batch")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs every method")
    p.add_argument("--fast-runs", type=int, default=3, help="normfast runs per round")
    p.add_argument("--check", type=int, default=2000,
                   help="probes checked against the float64 brute force")
    p.add_argument("--memory-probes", type=int, default=1_000_000)
    p.add_argument("--memory-chunk", type=int, default=50_000)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--direction-threads", type=int, default=1,
                   help="torch threads while computing G_B in every method (0: unchanged)")
    p.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=RUNS / "head_stats.json",
                   help="output JSON (default %(default)s; the committed result: --out bench/results/head_stats.json)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    Phases.direction_threads = args.direction_threads
    if args.memory_child:
        memory_child(args.memory_probes, args.memory_chunk, args.dim, args.dim, args.m, args.pairs)
        return

    load_start = os.getloadavg()
    # the memory run first, in a fresh process, before this one grows
    cmd = [sys.executable, __file__, "--memory-child", "--dim", str(args.dim), "--m", str(args.m),
           "--pairs", str(args.pairs), "--memory-probes", str(args.memory_probes),
           "--memory-chunk", str(args.memory_chunk), "--threads", str(torch.get_num_threads())]
    child = subprocess.run(cmd, check=True, capture_output=True, text=True)
    memory = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"{args.memory_probes} probes in chunks of {args.memory_chunk}: "
          f"peak RSS {memory['peak_rss_mb']:.0f} MB")

    torch.manual_seed(0)
    problem = make_head_problem(args.n, args.dim, args.dim, args.m, args.pairs)
    accuracy = check_accuracy(problem, min(args.check, args.n))
    for name in METHODS:
        worst = max(accuracy[name].values())
        print(f"accuracy vs float64 brute force, {name}: max scale-relative error {worst:.2e}")
        if worst > 1e-3:
            raise SystemExit(f"{name} is not accurate enough ({accuracy[name]}); not timing it")

    # methods interleaved within each round, so that load drifting on a shared
    # machine affects all of them alike
    times = {name: [] for name in METHODS}
    phase_times = {name: [] for name in METHODS}
    outputs = {}
    for round_ in range(args.repeats):
        for name, fn in METHODS.items():
            # normfast's runs are short; several per round sample the load better
            for _ in range(args.fast_runs if name == "normfast" else 1):
                phases = Phases()
                t0 = time.perf_counter()
                outputs[name] = fn(*problem, phases)
                times[name].append(time.perf_counter() - t0)
                phase_times[name].append(phases.seconds)
                print(f"round {round_ + 1}/{args.repeats} {name}: {times[name][-1]:.2f} s ("
                      f"{', '.join(f'{k} {v:.2f} s' for k, v in phases.seconds.items())})",
                      flush=True)
    results = {name: percentiles(ts) for name, ts in times.items()}
    for name in METHODS:
        results[name]["phases_median"] = {
            k: float(np.median([p[k] for p in phase_times[name]])) for k in phase_times[name][0]}
    # the full-size outputs agree too
    agreement = {name: stat_errors(outputs[name], outputs["normfast"], list(KEYS))
                 for name in METHODS}

    flops = flop_counts(args.n, args.dim, args.dim, args.m, args.pairs)
    base = results["normfast"]["p50"]
    report = {
        "benchmark": "head_stats",
        "config": {"n": args.n, "d_in": args.dim, "d_out": args.dim, "M": args.m,
                   "pairs": args.pairs,
                   "repeats": args.repeats, "dtype": "float32", "bias": True, "form": "S",
                   "direction_threads": args.direction_threads, "interleaved": True,
                   "normfast_runs_per_round": args.fast_runs},
        "environment": {"torch": torch.__version__, "numpy": np.__version__,
                        "python": platform.python_version(), "threads": torch.get_num_threads(),
                        "cpu": cpu_model(), "cores": os.cpu_count(), "device": "cpu",
                        "load_average_start": load_start, "load_average_end": os.getloadavg()},
        "seconds": results,
        "speedup_vs_normfast": {name: results[name]["p50"] / base for name in METHODS},
        "flops": flops,
        "flop_ratio_vs_normfast": {name: flops[name] / flops["normfast"] for name in METHODS},
        "accuracy_vs_float64_subset": accuracy,
        "full_size_agreement_with_normfast": agreement,
        "memory_1e6_probes": memory,
        "note": "CPU on a shared VM: ratios measured in the same run are the result, "
                "absolute seconds are not.",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")

    print()
    print(f"N={args.n}, d_in=d_out={args.dim}, M={args.m}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {cpu_model()}")
    print()
    print("| method | median s | of which G_B s | speedup of normfast | GFLOP | FLOP ratio "
          "| max err vs fp64 |")
    print("|---|---|---|---|---|---|---|")
    for name in METHODS:
        print(f"| {name} | {results[name]['p50']:.2f} | "
              f"{results[name]['phases_median']['directions']:.2f} | "
              f"{results[name]['p50'] / base:.1f}x | "
              f"{flops[name] / 1e9:.1f} | {flops[name] / flops['normfast']:.1f}x | "
              f"{max(accuracy[name].values()):.1e} |")
    print()
    print(f"{memory['probes']} probes streamed in chunks of {memory['chunk']}: "
          f"peak RSS {memory['peak_rss_mb']:.0f} MB "
          f"(after imports {memory['rss_after_imports_mb']:.0f} MB)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

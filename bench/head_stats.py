"""Head mode's forms against the naive per-batch loop and against their own GEMM floors.

    python bench/head_stats.py [--n 50000] [--dim 256] [--m 64,256] [--rounds 5] [--out bench/results]

For a linear head ``z = W a + b`` (N probes, d_in = d_out = d, M virtual
InfoNCE batches, directions from one ordinary backward per batch), in one
process on one thread, with every method timed in each round (interleaved,
so that load drifting on a shared machine hits all alike; medians reported):

* ``naive``: the per-batch loop a user writes without normfast -- for every
  batch ``T = A G_Bᵀ + g_B`` for all probes, then the radial dots and sums
  (:func:`normfast.apps.benchmark.apply_per_batch`);
* ``grouped``: :func:`normfast.engine.ops.head_stats` with its defaults (D, m2,
  V2, Q with se_D, sign_stability, se_V2, se_Q from K batch groups);
* ``S``: the bare S form (``uncertainty=False``: no error bars);
* ``per_batch``: the per-batch form (``radial_spread=True``: se_D per batch);
* for each normfast form its *floor*: only the GEMMs it needs (forming its
  matrices from the directions, and the per-probe products over the same row
  chunks; :func:`normfast.apps.benchmark.head.gemm_floor`).

Timed from the directions ``G_B`` on (their backward is the same for all and
is not timed). Before timing, every method is checked against a float64
brute force of its own estimator on the first probes. Targets (issue 13, one
thread, N = 50 000, d = 256): grouped >= 8x the naive loop at M = 64 and
>= 15x at M = 256, within 1.5x of its GEMM floor; bare S >= 40x at M = 64.
Writes OUT/head_stats.json (OUT defaults to runs/).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from normfast.apps.benchmark import apply_per_batch, cpu_model, head_directions_backward, make_head_problem
from normfast.apps.benchmark.head import HEAD_FORMS, form_gemms, gemm_floor
from normfast.core.reference import brute_force_grouped, brute_force_stats, stat_errors
from normfast.engine.ops import head_flops, head_stats
from normfast.engine.uncertainty import DEFAULT_GROUPS, effective_groups

KEYS = {"naive": ("D", "m2", "V2", "Q"), "grouped": ("D", "se_D", "m2", "V2", "Q", "se_V2", "se_Q"),
        "S": ("D", "m2", "V2", "Q"), "per_batch": ("D", "se_D", "m2", "V2", "Q")}
TARGETS = {"grouped_vs_naive": {64: 8.0, 256: 15.0}, "grouped_vs_floor": 1.5, "S_vs_naive": {64: 40.0}}


def forms(groups: int) -> dict[str, dict]:
    return {f: (dict(kw, groups=groups) if f == "grouped" else kw) for f, kw in HEAD_FORMS.items()}


def check(A, Z, G, g, n_check: int, groups: int) -> dict[str, float]:
    """Each method against a float64 brute force of its own estimator (first n_check probes)."""
    A64, Z64 = A[:n_check].double(), Z[:n_check].double()
    T = -(torch.einsum("bji,ni->bnj", G.double(), A64) + g.double()[:, None, :])
    per_batch = brute_force_stats(T, Z64, "u")
    grouped = brute_force_grouped(T, Z64, effective_groups(groups, G.shape[0]), "u")
    sub = (A[:n_check], Z[:n_check], G, g)
    got = {"naive": apply_per_batch(*sub), **{f: head_stats(*sub, **kw) for f, kw in forms(groups).items()}}
    want = {"naive": per_batch, "grouped": grouped, "S": per_batch, "per_batch": per_batch}
    return {name: max(stat_errors(got[name], want[name], list(KEYS[name])).values()) for name in got}


def run_m(m: int, args) -> dict:
    W, b, A, Z, anchors, positives = make_head_problem(args.n, args.dim, args.dim, m, 32, seed=m)
    G, g = head_directions_backward(W, b, anchors, positives)
    errors = check(A, Z, G, g, min(args.check, args.n), args.groups)
    print(f"M={m}: max scale-relative error vs float64: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    bad = {k: v for k, v in errors.items() if not v < 1e-4}
    if bad:
        raise SystemExit(f"not accurate enough, not timing: {bad}")
    methods = {"naive": lambda: apply_per_batch(A, Z, G, g)}
    for form, kw in forms(args.groups).items():
        methods[form] = (lambda kw=kw: head_stats(A, Z, G, g, **kw))
        methods[f"{form}_floor"] = gemm_floor(A, form, args.dim, m, groups=args.groups)
    return {"problem": (A, Z, G, g), "methods": methods, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--m", default="64,256", help="comma-separated M values")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--check", type=int, default=500, help="probes checked against the float64 brute force")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--groups", type=int, default=DEFAULT_GROUPS, help=f"K of the grouped form (default {DEFAULT_GROUPS})")
    ap.add_argument("--out", default="runs", help="output folder (default runs/; bench/results for the record)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ms = [int(x) for x in args.m.split(",")]
    load_start = os.getloadavg()
    setups = {m: run_m(m, args) for m in ms}
    times: dict[int, dict[str, list[float]]] = {m: {k: [] for k in setups[m]["methods"]} for m in ms}
    for r in range(args.rounds):
        for m in ms:
            for name, fn in setups[m]["methods"].items():
                t0 = time.perf_counter()
                fn()
                times[m][name].append(time.perf_counter() - t0)
            med = {k: float(np.median(v)) for k, v in times[m].items()}
            print(f"round {r + 1}/{args.rounds} M={m}: " + ", ".join(f"{k} {v:.2f}s" for k, v in med.items()),
                  flush=True)
    results = {}
    for m in ms:
        med = {k: float(np.median(v)) for k, v in times[m].items()}
        k = effective_groups(args.groups, m)
        flops = head_flops(args.n, args.dim, args.dim, m, bias=True, groups=args.groups)
        results[str(m)] = {
            "median_seconds": med, "all_seconds": times[m],
            "speedup_vs_naive": {f: med["naive"] / med[f] for f in HEAD_FORMS},
            "vs_own_floor": {f: med[f] / med[f"{f}_floor"] for f in HEAD_FORMS},
            "floor_speedup_vs_naive": {f: med["naive"] / med[f"{f}_floor"] for f in HEAD_FORMS},
            "gemms": {f: form_gemms(f, args.n, args.dim, args.dim, m, groups=args.groups) for f in HEAD_FORMS},
            "flops": {"naive": 2 * args.n * m * (args.dim + 1) * args.dim, **flops}, "groups": k,
            "accuracy_max_error": setups[m]["errors"],
        }
    targets = {}
    for m in ms:
        r = results[str(m)]
        if m in TARGETS["grouped_vs_naive"]:
            targets[f"grouped_vs_naive_M{m}"] = {"target": TARGETS["grouped_vs_naive"][m],
                                                 "value": r["speedup_vs_naive"]["grouped"]}
        if m in TARGETS["S_vs_naive"]:
            targets[f"S_vs_naive_M{m}"] = {"target": TARGETS["S_vs_naive"][m], "value": r["speedup_vs_naive"]["S"]}
        targets[f"grouped_vs_floor_M{m}"] = {"target": TARGETS["grouped_vs_floor"], "value": r["vs_own_floor"]["grouped"],
                                             "at_most": True}
    for t in targets.values():
        t["met"] = bool(t["value"] <= t["target"]) if t.get("at_most") else bool(t["value"] >= t["target"])
    report = {"benchmark": "head_stats forms vs the naive per-batch loop and their GEMM floors",
              "config": {"n": args.n, "d_in": args.dim, "d_out": args.dim, "M": ms, "rounds": args.rounds,
                         "threads": torch.get_num_threads(), "dtype": "float32", "bias": True,
                         "groups_default": DEFAULT_GROUPS, "groups": args.groups, "interleaved": True,
                         "timed_from": "G_B"},
              "environment": {"torch": torch.__version__, "cpu": cpu_model(), "cores": os.cpu_count(),
                              "load_average_start": load_start, "load_average_end": os.getloadavg()},
              "results": results, "targets": targets,
              "note": "CPU on a shared machine: the ratios of medians measured in the same run are the result."}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "head_stats.json").write_text(json.dumps(report, indent=1) + "\n")
    print(format_table(report))
    print(f"wrote {out / 'head_stats.json'}")
    return 0


def format_table(d: dict) -> str:
    from tables import head_forms_table  # bench/tables.py, next to this script: the README's renderer

    return head_forms_table(d)


if __name__ == "__main__":
    raise SystemExit(main())

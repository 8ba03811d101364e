"""Head mode's forms against the naive per-batch loop and against their own GEMM floors.

    python -m bench run head_stats [--n 50000] [--dim 256] [--m 64 256] [--rounds 5] [--out bench/results/head_stats]

For a linear head ``z = W a + b`` (N probes, d_in = d_out = d, M virtual
InfoNCE batches, directions from one ordinary backward per batch), in one
process on one thread, with every method timed in each round (interleaved,
so that load drifting on a shared machine hits all alike; medians reported):

* ``naive``: the per-batch loop a user writes without normfast -- for every
  batch ``T = A G_Bᵀ + g_B`` for all probes, then the radial dots and sums
  (:func:`normfast.apps.throughput.apply_per_batch`);
* ``grouped``: :func:`normfast.ops.head_stats` with its defaults (D, m2,
  V2, Q with se_D, sign_stability, se_V2, se_Q from K batch groups);
* ``S``: the bare S form (``uncertainty=False``: no error bars);
* ``per_batch``: the per-batch form (``radial_spread=True``: se_D per batch);
* for each normfast form its *floor*: only the GEMMs it needs (forming its
  matrices from the directions, and the per-probe products over the same row
  chunks; :func:`normfast.apps.throughput.head.gemm_floor`).

Timed from the directions ``G_B`` on (their backward is the same for all and
is not timed). Before timing, every method is checked against a float64
brute force of its own estimator on the first probes. Targets (issue 13, one
thread, N = 50 000, d = 256): grouped >= 8x the naive loop at M = 64 and
>= 15x at M = 256, within 1.5x of its GEMM floor; bare S >= 40x at M = 64.
Writes OUT/head_stats.json (OUT defaults to runs/head_stats).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from bench.harness import Context, JsonStyle

RESULTS = ("head_stats.json",)
FIGURES = ()
TABLES = ("head_stats",)
JSON = JsonStyle(strict=False)
KEYS = {
    "naive": ("D", "m2", "V2", "Q"),
    "grouped": ("D", "se_D", "m2", "V2", "Q", "se_V2", "se_Q"),
    "S": ("D", "m2", "V2", "Q"),
    "per_batch": ("D", "se_D", "m2", "V2", "Q"),
}
TARGETS = {"grouped_vs_naive": {64: 8.0, 256: 15.0}, "grouped_vs_floor": 1.5, "S_vs_naive": {64: 40.0}}


@dataclass
class Config:
    n: int = 50_000
    dim: int = 256
    m: tuple[int, ...] = field(default=(64, 256), metadata={"help": "M values"})
    rounds: int = 5
    check: int = field(default=500, metadata={"help": "probes checked against the float64 brute force"})
    threads: int = 1
    groups: int | None = field(default=None, metadata={"help": "K of the grouped form (none: the default K)"})

    @classmethod
    def quick(cls) -> "Config":
        return cls(n=500, dim=16, m=(8,), rounds=1, check=100)


def forms(groups: int) -> dict[str, dict]:
    from normfast.apps.throughput.floor import HEAD_FORMS

    return {f: (dict(kw, groups=groups) if f == "grouped" else kw) for f, kw in HEAD_FORMS.items()}


def check(A, Z, G, g, n_check: int, groups: int) -> dict[str, float]:
    """Each method against a float64 brute force of its own estimator (first n_check probes)."""
    import torch

    from normfast import ops
    from normfast.apps.throughput import apply_per_batch
    from normfast.core.reference import brute_force_grouped, brute_force_stats, stat_errors
    from normfast.engine.estimators import effective_groups

    A64, Z64 = A[:n_check].double(), Z[:n_check].double()
    T = -(torch.einsum("bji,ni->bnj", G.double(), A64) + g.double()[:, None, :])
    per_batch = brute_force_stats(T, Z64, "u")
    grouped = brute_force_grouped(T, Z64, effective_groups(groups, G.shape[0]), "u")
    sub = (A[:n_check], Z[:n_check], G, g)
    got = {"naive": apply_per_batch(*sub), **{f: ops.head_stats(*sub, **kw) for f, kw in forms(groups).items()}}
    want = {"naive": per_batch, "grouped": grouped, "S": per_batch, "per_batch": per_batch}
    return {name: max(stat_errors(got[name], want[name], list(KEYS[name])).values()) for name in got}


def run_m(m: int, args: Config) -> dict:
    from normfast import ops
    from normfast.apps.throughput import apply_per_batch, head_directions_backward, make_head_problem
    from normfast.apps.throughput.floor import gemm_floor

    W, b, A, Z, anchors, positives = make_head_problem(args.n, args.dim, args.dim, m, 32, seed=m)
    G, g = head_directions_backward(W, b, anchors, positives)
    errors = check(A, Z, G, g, min(args.check, args.n), args.groups)
    print(f"M={m}: max scale-relative error vs float64: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    bad = {k: v for k, v in errors.items() if not v < 1e-4}
    if bad:
        raise RuntimeError(f"head_stats: not accurate enough, not timing: {bad}")
    methods = {"naive": lambda: apply_per_batch(A, Z, G, g)}
    for form, kw in forms(args.groups).items():
        methods[form] = lambda kw=kw: ops.head_stats(A, Z, G, g, **kw)
        methods[f"{form}_floor"] = gemm_floor(A, form, args.dim, m, groups=args.groups)
    return {"problem": (A, Z, G, g), "methods": methods, "errors": errors}


def run(config: Config, ctx: Context) -> dict[str, Any]:
    import torch

    from normfast import ops
    from normfast.apps.throughput import cpu_model
    from normfast.apps.throughput.floor import HEAD_FORMS, form_gemms
    from normfast.engine.estimators import DEFAULT_GROUPS, effective_groups

    args = replace(config, groups=DEFAULT_GROUPS if config.groups is None else config.groups)
    torch.set_num_threads(args.threads)
    ms = list(args.m)
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
            print(
                f"round {r + 1}/{args.rounds} M={m}: " + ", ".join(f"{k} {v:.2f}s" for k, v in med.items()), flush=True
            )
    results = {}
    for m in ms:
        med = {k: float(np.median(v)) for k, v in times[m].items()}
        k = effective_groups(args.groups, m)
        flops = ops.head_flops(args.n, args.dim, args.dim, m, bias=True, groups=args.groups)
        results[str(m)] = {
            "median_seconds": med,
            "all_seconds": times[m],
            "speedup_vs_naive": {f: med["naive"] / med[f] for f in HEAD_FORMS},
            "vs_own_floor": {f: med[f] / med[f"{f}_floor"] for f in HEAD_FORMS},
            "floor_speedup_vs_naive": {f: med["naive"] / med[f"{f}_floor"] for f in HEAD_FORMS},
            "gemms": {f: form_gemms(f, args.n, args.dim, args.dim, m, groups=args.groups) for f in HEAD_FORMS},
            "flops": {"naive": 2 * args.n * m * (args.dim + 1) * args.dim, **flops},
            "groups": k,
            "accuracy_max_error": setups[m]["errors"],
        }
    targets = {}
    for m in ms:
        r = results[str(m)]
        if m in TARGETS["grouped_vs_naive"]:
            targets[f"grouped_vs_naive_M{m}"] = {
                "target": TARGETS["grouped_vs_naive"][m],
                "value": r["speedup_vs_naive"]["grouped"],
            }
        if m in TARGETS["S_vs_naive"]:
            targets[f"S_vs_naive_M{m}"] = {"target": TARGETS["S_vs_naive"][m], "value": r["speedup_vs_naive"]["S"]}
        targets[f"grouped_vs_floor_M{m}"] = {
            "target": TARGETS["grouped_vs_floor"],
            "value": r["vs_own_floor"]["grouped"],
            "at_most": True,
        }
    for t in targets.values():
        t["met"] = bool(t["value"] <= t["target"]) if t.get("at_most") else bool(t["value"] >= t["target"])
    return {
        "benchmark": "head_stats forms vs the naive per-batch loop and their GEMM floors",
        "config": {
            "n": args.n,
            "d_in": args.dim,
            "d_out": args.dim,
            "M": ms,
            "rounds": args.rounds,
            "threads": torch.get_num_threads(),
            "dtype": "float32",
            "bias": True,
            "groups_default": DEFAULT_GROUPS,
            "groups": args.groups,
            "interleaved": True,
            "timed_from": "G_B",
        },
        "environment": {
            "torch": torch.__version__,
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "load_average_start": load_start,
            "load_average_end": os.getloadavg(),
        },
        "results": results,
        "targets": targets,
        "note": "CPU on a shared machine: the ratios of medians measured in the same run are the result.",
    }


def tables(result: dict[str, Any]) -> dict[str, str]:
    return {"head_stats": head_forms_table(result)}


def head_forms_table(d: dict) -> str:
    """Head mode's forms against the naive per-batch loop and their GEMM floors."""
    cfg = d["config"]
    ms = cfg["M"]
    names = {
        "grouped": "grouped, with error bars (the default)",
        "S": "bare S form (`uncertainty=False`)",
        "per_batch": "per-batch form (`radial_spread=True`)",
    }
    head = "| form | " + " | ".join(f"M = {m}: vs naive loop | M = {m}: time / its GEMM floor" for m in ms) + " |"
    rows = [head, "|---|" + "---|---|" * len(ms)]
    for f in ("grouped", "S", "per_batch"):
        cells = []
        for m in ms:
            r = d["results"][str(m)]
            cells.append(f"{r['speedup_vs_naive'][f]:.1f}x | {r['vs_own_floor'][f]:.2f}")
        rows.append(f"| {names[f]} | " + " | ".join(cells) + " |")
    met = "; ".join(
        f"{k.replace('_', ' ')}: {t['value']:.2f} ({'met' if t['met'] else 'NOT met'}, target "
        f"{'<=' if t.get('at_most') else '>='} {t['target']})"
        for k, t in d["targets"].items()
    )
    rows.append("")
    rows.append(
        f"N = {cfg['n']:,}, d_in = d_out = {cfg['d_in']}, bias, fp32, {cfg['threads']} thread, K = "
        f"{cfg.get('groups', cfg['groups_default'])} groups, medians of {cfg['rounds']} interleaved rounds, "
        f"timed from the "
        f"directions G_B; the floor is the same form's GEMMs alone (forming its matrices and the "
        f"per-probe products). Targets: {met}."
    )
    return "\n".join(rows)

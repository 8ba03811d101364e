"""Registers, spills, shared memory and occupancy of every shipped kernel configuration, no GPU needed.

    python bench/kernel_resources.py                         # writes runs/kernel_resources.json
    python bench/kernel_resources.py --out bench/results     # the committed report
    python bench/kernel_resources.py --jobs 2                # two compiler processes

Every public launcher (``accumulate``, ``head_stack``, ``head_stats``,
``project``) is called over the sweep of
:data:`normfast.kernels.resources.SWEEP` -- fp32/bf16/fp16 inputs, branches
u/w/uw, with and without bias, IEEE and TF32 products, dimensions from 1 to
2048 (1, odd and 16-aligned values, which is what Triton specializes on) --
inside ``capture_launches``, so nothing runs; each launch is expanded into
the tile configurations it may choose on a GPU (the autotuning candidates),
for sm_90 and sm_80. Launches that compile to the same code are compiled
once. Each variant is lowered with ``triton.compile`` for that target, and
``cuobjdump --dump-resource-usage`` (in the triton wheel) reads registers,
stack and shared memory from the cubin; the PTX tells whether the products
use tensor-core instructions (``wgmma`` on sm_90, ``mma.sync`` on sm_80).
Theoretical occupancy uses the per-SM limits of
``normfast.kernels.resources.SM_LIMITS``.

A variant fails when it spills (stack > 0), sits at the register cap (255)
or leaves room for fewer than two programs per SM; the exit status is 1 if
any does. The full sweep takes about 15 minutes on one core with a cold Triton cache
(seconds with a warm one: Triton caches compiled kernels on disk); the CI test
(tests/test_kernel_resources.py) compiles a representative subset and
checks that every planned variant is in the committed report and passes.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as dt
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: compile, never interpret

import torch  # noqa: E402
import triton  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from normfast.kernels import resources  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SCHEMA = "normfast-kernel-resources/1"
_PLAN: dict[str, dict] = {}


def _compile(key: str) -> dict:
    entry = _PLAN[key]
    row = resources.describe_variant(entry)
    try:
        row.update(resources.compile_launch(entry["launch"], entry["config"], entry["arch"]))
        row["problems"] = resources.variant_problems(row)
    except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a failure
        row.update(key=key, arch=f"sm_{entry['arch']}",
                   problems=[f"does not compile: {type(exc).__name__}: {str(exc)[:300]}"])
    return resources.to_json(row)


def ptxas_version() -> str:
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError as exc:
        return f"unknown ({exc})"
    release = [line for line in out.splitlines() if "release" in line]
    return "ptxas " + release[0].split("release", 1)[1].strip() if release else "unknown"


def summarize(rows: list[dict]) -> list[dict]:
    """One line per (kernel, operand class, arch): the worst of its variants."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "registers" not in r:
            continue
        cls = r["class"]
        if r["kernel"] == "_head_stack_kernel" and cls.endswith(" MMA") and "TF32" not in cls:
            cls = "bf16/fp16 MMA"
        elif r["kernel"] == "_accumulate_kernel":
            cls = "branch uw" if cls.endswith(", uw") else "branch u or w"
        groups.setdefault((r["kernel"], cls, r["arch"]), []).append(r)
    out = []
    for (kernel, cls, arch), rs in groups.items():
        out.append({"kernel": kernel, "class": cls, "arch": arch, "variants": len(rs),
                    "configs": len({r["config_label"] for r in rs}),
                    "registers_max": max(r["registers"] for r in rs),
                    "stack_max": max(r["stack"] for r in rs),
                    "shared_max": max(r["shared"] for r in rs),
                    "programs_per_sm_min": min(r["programs_per_sm"] for r in rs),
                    "occupancy_min": min(r["occupancy"] for r in rs),
                    "tensor_cores": sorted({str(r["tensor_cores"]) for r in rs}),
                    "failing": sum(bool(r["problems"]) for r in rs)})
    return sorted(out, key=lambda s: (s["kernel"], s["class"], s["arch"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "runs",
                   help="folder for kernel_resources.json (default runs/; the committed report "
                        "is written only with --out bench/results)")
    p.add_argument("--jobs", type=int, default=1, help="compiler processes (default 1)")
    p.add_argument("--limit", type=int, default=None,
                   help="compile only the first N planned variants (a quick look)")
    p.add_argument("--reuse", type=Path, default=None, metavar="JSON",
                   help="take the rows of variants already in this report (same key, same Triton "
                        "and ptxas: the compile is deterministic) instead of compiling them again")
    p.add_argument("--only", default=None, metavar="NAME",
                   help="compile only the variants of kernels whose name contains this (a quick look)")
    args = p.parse_args(argv)
    t0 = time.time()
    _PLAN.update(resources.planned_variants())
    keys = sorted(_PLAN, key=lambda k: (_PLAN[k]["launch"].kernel.__name__, k))
    if args.only:
        keys = [k for k in keys if args.only in _PLAN[k]["launch"].kernel.__name__]
    if args.limit:
        keys = keys[:args.limit]
    print(f"{len(_PLAN)} distinct compiled variants planned ({len(keys)} to compile), "
          f"from {sum(len(e['labels']) for e in _PLAN.values())} launch x configuration x "
          f"target combinations", flush=True)
    rows = []
    if args.reuse:
        old = json.loads(args.reuse.read_text())
        if (old["toolchain"]["triton"], old["toolchain"]["ptxas"]) == (triton.__version__,
                                                                       ptxas_version()):
            known = {r["key"]: r for r in old["variants"] if "registers" in r}
            rows = [known[k] for k in keys if k in known]
            keys = [k for k in keys if k not in known]
            print(f"{len(rows)} variants taken from {args.reuse}", flush=True)
    with tqdm(total=len(keys), desc="compiling", unit="variant") as bar:
        if args.jobs > 1:
            ctx = multiprocessing.get_context("fork")  # the workers inherit the plan
            with cf.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
                for row in pool.map(_compile, keys, chunksize=4):
                    rows.append(row)
                    bar.update()
        else:
            for key in keys:
                rows.append(_compile(key))
                bar.update()
    failing = [r for r in rows if r["problems"]]
    report = {
        "schema": SCHEMA,
        "command": "python bench/kernel_resources.py " + " ".join(argv or sys.argv[1:]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "toolchain": {"triton": triton.__version__, "ptxas": ptxas_version(),
                      "torch": torch.__version__},
        "complete": args.limit is None and args.only is None,
        "seconds": round(time.time() - t0, 1),
        "register_cap": resources.REGISTER_CAP,
        "sm_limits": resources.SM_LIMITS,
        "sweep": resources.to_json(resources.SWEEP),
        "kernel_source_keys": resources.kernel_source_keys(),
        "summary": summarize(rows),
        "failing": len(failing),
        "variants": sorted(rows, key=lambda r: (r["kernel"], r["class"], r.get("arch", ""),
                                                 r["config_label"], r["key"])),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "kernel_resources.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tables import resources_table

    print(resources_table(report))
    for r in failing:
        print(f"FAIL {r['kernel']} {r['class']} {r['config_label']} {r['arch']}: "
              f"{'; '.join(r['problems'])} (e.g. {r['example']})")
    print(f"wrote {path} ({report['seconds']:.0f} s, {len(rows)} variants, {len(failing)} failing)")
    return 1 if failing else 0


if __name__ == "__main__":
    raise SystemExit(main())

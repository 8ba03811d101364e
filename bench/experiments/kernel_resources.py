"""Registers, spills, shared memory and occupancy of every shipped kernel configuration, no GPU needed.

    python -m bench run kernel_resources                       # writes runs/kernel_resources/
    python -m bench run kernel_resources --out bench/results/kernel_resources   # the committed report
    python -m bench run kernel_resources --jobs 2              # two compiler processes

Every registered launcher (``normfast.kernels.kernel_specs()``: today
``head_stack``, ``head_stats``, ``project``, ``accumulate``) is called over
its part of :data:`normfast.kernels.resources.SWEEP` (each record's resource
plan) -- fp32/bf16/fp16 inputs, branches u/w/uw, with and without bias, IEEE
and TF32 products, dimensions from 1 to 2048 (1, odd and 16-aligned values,
which is what Triton specializes on) -- inside ``capture_launches``, so
nothing runs; each launch is expanded into
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
any does. The run compiles for real (``TRITON_INTERPRET=0``): it needs a
process in which the kernels were not imported under the interpreter. The
full sweep takes about 15 minutes on one core with a cold Triton cache
(seconds with a warm one: Triton caches compiled kernels on disk); the CI test
(tests/kernels/test_resources.py) compiles a representative subset and
checks that every planned variant is in the committed report and passes.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as dt
import multiprocessing
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import Context, JsonStyle, UsageError, read_json

RESULTS = ("kernel_resources.json",)
FIGURES = ()
TABLES = ("kernel_resources",)
JSON = JsonStyle(strict=False)
SCHEMA = "normfast-kernel-resources/1"
_PLAN: dict[str, dict] = {}


@dataclass
class Config:
    jobs: int = field(default=1, metadata={"help": "compiler processes"})
    limit: int | None = field(default=None, metadata={"help": "compile only the first N planned variants"})
    reuse: str | None = field(
        default=None,
        metadata={
            "help": "a report whose rows (same key, same Triton and ptxas: the compile is deterministic) are "
            "taken instead of compiling them again"
        },
    )
    only: str | None = field(
        default=None, metadata={"help": "compile only the variants of kernels whose name contains this"}
    )

    @classmethod
    def quick(cls) -> "Config":
        return cls(limit=1)


def _compile(key: str) -> dict:
    from normfast.kernels import resources

    entry = _PLAN[key]
    row = resources.describe_variant(entry)
    try:
        row.update(resources.compile_launch(entry["launch"], entry["config"], entry["arch"]))
        row["problems"] = resources.variant_problems(row)
    except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a failure
        row.update(
            key=key, arch=f"sm_{entry['arch']}", problems=[f"does not compile: {type(exc).__name__}: {str(exc)[:300]}"]
        )
    return resources.to_json(row)


def ptxas_version() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError as exc:
        return f"unknown ({exc})"
    release = [line for line in out.splitlines() if "release" in line]
    return "ptxas " + release[0].split("release", 1)[1].strip() if release else "unknown"


def summarize(rows: list[dict]) -> list[dict]:
    """One line per (kernel, operand class, arch): the worst of its variants."""
    from normfast.kernels.spec import kernel_owner

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "registers" not in r:
            continue
        owner = kernel_owner(r["kernel"])  # the record of the kernel names its summary's classes
        cls = r["class"] if owner is None else owner.summary_class(r["class"])
        groups.setdefault((r["kernel"], cls, r["arch"]), []).append(r)
    out = []
    for (kernel, cls, arch), rs in groups.items():
        out.append(
            {
                "kernel": kernel,
                "class": cls,
                "arch": arch,
                "variants": len(rs),
                "configs": len({r["config_label"] for r in rs}),
                "registers_max": max(r["registers"] for r in rs),
                "stack_max": max(r["stack"] for r in rs),
                "shared_max": max(r["shared"] for r in rs),
                "programs_per_sm_min": min(r["programs_per_sm"] for r in rs),
                "occupancy_min": min(r["occupancy"] for r in rs),
                "tensor_cores": sorted({str(r["tensor_cores"]) for r in rs}),
                "failing": sum(bool(r["problems"]) for r in rs),
            }
        )
    return sorted(out, key=lambda s: (s["kernel"], s["class"], s["arch"]))


def run(args: Config, ctx: Context) -> dict[str, Any]:
    if "normfast.kernels" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise UsageError(
            "kernel_resources compiles for real: run it in a fresh process "
            "(python -m bench run kernel_resources), not where the kernels were imported "
            "under TRITON_INTERPRET=1"
        )
    os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: compile, never interpret
    import torch
    import triton
    from tqdm.auto import tqdm

    from normfast.kernels import resources

    t0 = time.time()
    _PLAN.update(resources.planned_variants())
    keys = sorted(_PLAN, key=lambda k: (_PLAN[k]["launch"].kernel.__name__, k))
    if args.only:
        keys = [k for k in keys if args.only in _PLAN[k]["launch"].kernel.__name__]
    if args.limit:
        keys = keys[: args.limit]
    print(
        f"{len(_PLAN)} distinct compiled variants planned ({len(keys)} to compile), "
        f"from {sum(len(e['labels']) for e in _PLAN.values())} launch x configuration x "
        f"target combinations",
        flush=True,
    )
    rows = []
    if args.reuse:
        old = read_json(Path(args.reuse))
        if (old["toolchain"]["triton"], old["toolchain"]["ptxas"]) == (triton.__version__, ptxas_version()):
            known = {r["key"]: r for r in old["variants"] if "registers" in r}
            rows = [known[k] for k in keys if k in known]
            keys = [k for k in keys if k not in known]
            print(f"{len(rows)} variants taken from {args.reuse}", flush=True)
    with tqdm(total=len(keys), desc="compiling", unit="variant", disable=not ctx.progress) as bar:
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
        "command": ctx.command,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "toolchain": {"triton": triton.__version__, "ptxas": ptxas_version(), "torch": torch.__version__},
        "complete": args.limit is None and args.only is None,
        "seconds": round(time.time() - t0, 1),
        "register_cap": resources.REGISTER_CAP,
        "sm_limits": resources.SM_LIMITS,
        "sweep": resources.to_json(resources.SWEEP),
        "kernel_source_keys": resources.kernel_source_keys(),
        "summary": summarize(rows),
        "failing": len(failing),
        "variants": sorted(
            rows, key=lambda r: (r["kernel"], r["class"], r.get("arch", ""), r["config_label"], r["key"])
        ),
    }
    if failing:
        report["_failed"] = f"{len(failing)} variants fail: " + "; ".join(
            f"{r['kernel']} {r['class']} {r['config_label']} {r['arch']}: {'; '.join(r['problems'])} "
            f"(e.g. {r.get('example')})"
            for r in failing[:20]
        )
    return report


def tables(report: dict[str, Any]) -> dict[str, str]:
    return {"kernel_resources": resources_table(report)}


def resources_table(d: dict) -> str:
    """Worst case per kernel and operand class over every compiled variant, sm_90 | sm_80."""
    from normfast.kernels.spec import kernel_owner

    by = {}
    for s in d["summary"]:
        by.setdefault((s["kernel"], s["class"]), {})[s["arch"]] = s
    rows = [
        "| kernel | operand class | tile configs | variants | registers (max) | stack bytes (max) "
        "| shared KB (max) | programs per SM (min) | products on |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (kernel, cls), arches in by.items():
        a, b = arches.get("sm_90"), arches.get("sm_80")

        def pair(key: str, fmt=str) -> str:
            return " / ".join(fmt(x[key]) if x else "-" for x in (a, b))

        owner = kernel_owner(kernel)  # what runs its products without tensor cores ("-": it has none)
        scalar = "-" if owner is None else owner.scalar_products
        tc = {x["arch"]: ",".join(t for t in x["tensor_cores"] if t != "None") or scalar for x in (a, b) if x}
        rows.append(
            f"| `{kernel}` | {cls} | {max(x['configs'] for x in arches.values())} | "
            f"{sum(x['variants'] for x in arches.values())} | {pair('registers_max')} | "
            f"{pair('stack_max')} | {pair('shared_max', lambda v: f'{v / 1024:.0f}')} | "
            f"{pair('programs_per_sm_min')} | "
            f"{' / '.join(tc.get(k, '-') for k in ('sm_90', 'sm_80'))} |"
        )
    rows.append("")
    # the footer's command is the one the committed README block states (today the runner's
    # `python -m bench run kernel_resources --out bench/results/kernel_resources`): changing it changes the README
    n = len(d["variants"])
    rows.append(
        f"Each cell: sm_90 / sm_80. {n} distinct compiled variants (every tile "
        f"configuration the launchers may choose on a GPU, over fp32/bf16/fp16 inputs, "
        f"branches, bias, IEEE/TF32 and d from 1 to 2048), {d['failing']} of them spilling, "
        f"at the register cap ({d['register_cap']}) or below two programs per SM. "
        f"Triton {d['toolchain']['triton']}, {d['toolchain']['ptxas']}; "
        f"`python -m bench run kernel_resources --out bench/results/kernel_resources`, no GPU needed."
    )
    return "\n".join(rows)

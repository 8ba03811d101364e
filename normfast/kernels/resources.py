"""What a kernel costs the GPU, without a GPU: compile for a CUDA target, read the cubin.

:func:`shipped_launches` calls every registered launcher, inside
:func:`~normfast.kernels.utils.capture_launches`, over its part of the sweep
(:func:`report_sweep`: the targets and input dtypes, and each record's
:class:`~normfast.kernels.spec.ResourcePlan`): the launches the launchers
would make, each with the tile configurations it may choose on a GPU.
:func:`compile_launch` lowers one captured :class:`~normfast.kernels.utils.KernelLaunch`
(one tile configuration of it) to a cubin for ``sm_80`` or ``sm_90`` exactly
as a launch with those arguments would (same specialization of the integer
arguments and pointer alignments, same constexprs and options), then reads
registers, stack and shared memory with ``cuobjdump --dump-resource-usage``
(shipped in the triton wheel next to ``ptxas``), and whether the products
run on tensor cores from the PTX. :func:`occupancy` turns that into programs
per SM from the published per-SM limits.

Needs ``TRITON_INTERPRET=0`` in the process (nothing is launched) and relies
on the launch internals of Triton 3.x (``JITFunction`` binder and argument
packing); a Triton without them raises a clear error.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import subprocess
import tempfile
from typing import Any

import triton

from .spec import KernelSpec, kernel_owner, kernel_specs
from .utils import KernelLaunch, capture_launches, interpreted

__all__ = [
    "REGISTER_CAP",
    "SM_LIMITS",
    "SWEEP",  # noqa: F822 -- the sweep of the kernels registered when it is read (__getattr__ below)
    "TARGETS",
    "compile_key",
    "compile_launch",
    "config_label",
    "describe_variant",
    "kernel_source_keys",
    "occupancy",
    "planned_variants",
    "report_sweep",
    "shipped_launches",
    "to_json",
    "variant_problems",
]

#: Per-SM limits used for the theoretical occupancy (CUDA programming guide,
#: "Compute capabilities", table of technical specifications; the register
#: file is allocated per warp in units of 256 registers, shared memory in
#: units of 128 bytes with 1 KB reserved per block).
SM_LIMITS = {
    80: {"registers": 65536, "max_warps": 64, "max_blocks": 32, "shared": 167936, "shared_per_block": 166912},
    90: {"registers": 65536, "max_warps": 64, "max_blocks": 32, "shared": 233472, "shared_per_block": 232448},
}
#: ptxas's per-thread register ceiling (no launch bounds are set).
REGISTER_CAP = 255
_SHARED_RESERVED = 1024


def _tool(name: str) -> str:
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"resources: {name} not found in the triton wheel (looked at {path})")
    return path


def occupancy(arch: int, registers: int, shared: int, num_warps: int) -> dict[str, Any]:
    """Programs (thread blocks) per SM and the fraction of the SM's warp slots they fill."""
    lim = SM_LIMITS[arch]
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    warps_by_regs = lim["registers"] // regs_per_warp
    by_regs = warps_by_regs // num_warps
    smem = -(-shared // 128) * 128 + _SHARED_RESERVED
    by_smem = lim["shared"] // smem if shared <= lim["shared_per_block"] else 0
    by_warps = lim["max_warps"] // num_warps
    blocks = min(lim["max_blocks"], by_warps, by_regs, by_smem)
    limiter = min(
        (("registers", by_regs), ("shared memory", by_smem), ("warps", by_warps), ("blocks", lim["max_blocks"])),
        key=lambda kv: kv[1],
    )[0]
    return {"programs_per_sm": blocks, "occupancy": blocks * num_warps / lim["max_warps"], "limited_by": limiter}


def _resource_usage(cubin: bytes, name: str) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        text = subprocess.run(
            [_tool("cuobjdump"), "--dump-resource-usage", fh.name], capture_output=True, text=True, check=True
        ).stdout
    block = text.split(f"Function {name}:", 1)
    if len(block) != 2:
        raise RuntimeError(f"resources: no resource line for {name} in cuobjdump output:\n{text}")
    fields = dict(re.findall(r"(\w+):(\d+)", block[1].splitlines()[1]))
    return {
        "registers": int(fields["REG"]),
        "stack": int(fields["STACK"]),
        "static_shared": int(fields["SHARED"]),
        "local": int(fields["LOCAL"]),
    }


_BINDERS: dict[tuple, tuple] = {}


def _lowering_inputs(spec: KernelLaunch, config: dict, arch: int):
    """What ``JITFunction.run`` would hand the compiler for this launch, and a key for it."""
    if interpreted():
        raise RuntimeError("compile_launch: set TRITON_INTERPRET=0 before triton is imported (nothing is launched)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    jit = spec.kernel
    target = GPUTarget("cuda", arch, 32)
    try:
        if (jit, arch) not in _BINDERS:
            backend = make_backend(target)
            _BINDERS[jit, arch] = (backend, create_function_from_signature(jit.signature, jit.params, backend))
        backend, binder = _BINDERS[jit, arch]
        kwargs = dict(spec.meta, **config, debug=False)
        bound, specialization, options = binder(*spec.args, **kwargs)
        options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
    except (AttributeError, TypeError) as exc:  # a Triton without these internals
        raise RuntimeError(
            f"compile_launch: this Triton ({triton.__version__}) does not expose "
            f"the launch internals the report uses: {exc}"
        ) from exc
    key = hashlib.sha256(repr((jit.cache_key, arch, specialization, sorted(kwargs.items()))).encode()).hexdigest()[:16]
    return ASTSource(jit, signature, constexprs, attrs), target, options, key


def compile_key(spec: KernelLaunch, config: dict, arch: int) -> str:
    """Identifies one compiled variant: kernel source, target, argument specialization, constexprs."""
    return _lowering_inputs(spec, config, arch)[3]


def compile_launch(spec: KernelLaunch, config: dict, arch: int) -> dict[str, Any]:
    """Compile one tile configuration of a captured launch for ``sm_<arch>``; its resources."""
    src, target, options, key = _lowering_inputs(spec, config, arch)
    compiled = triton.compile(src, target=target, options=options.__dict__)
    usage = _resource_usage(compiled.asm["cubin"], compiled.metadata.name)
    ptx = compiled.asm["ptx"]
    shared = int(compiled.metadata.shared) + usage["static_shared"]
    res = {
        "key": key,
        "arch": f"sm_{arch}",
        **usage,
        "shared": shared,
        "num_warps": int(compiled.metadata.num_warps),
        "num_stages": int(compiled.metadata.num_stages),
        "tensor_cores": "wgmma" if "wgmma" in ptx else ("mma" if "mma.sync" in ptx else None),
    }
    res.update(occupancy(arch, usage["registers"], shared, res["num_warps"]))
    res["spills"] = usage["stack"] > 0 or usage["local"] > 0
    res["at_register_cap"] = usage["registers"] >= REGISTER_CAP
    return res


# ============================================================================
# The sweep: every launch the launchers can make on a GPU
# ============================================================================

#: What the report sweeps besides each kernel's own problems: the targets and the input dtypes.
TARGETS = {"archs": (90, 80), "dtypes": ("float32", "bfloat16", "float16")}


def report_sweep() -> dict:
    """What the report sweeps: :data:`TARGETS` and each registered record's part (by its ``sweep_key``).

    Each kernel's part lists the problems it is launched on; Triton specializes
    integer arguments on divisibility by 16 and on == 1, so the dimensions
    cover 1, odd and 16-aligned values. Read as :data:`SWEEP` too.
    """
    parts = {s.resources.sweep_key: s.resources.sweep for s in kernel_specs() if s.resources is not None}
    return {**TARGETS, **dict(sorted(parts.items()))}


def __getattr__(name: str) -> Any:
    if name == "SWEEP":  # computed when read: a kernel registered later is in it
        return report_sweep()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def shipped_launches(
    sweep: dict | None = None, specs: tuple[KernelSpec, ...] | None = None
) -> list[tuple[dict, KernelLaunch]]:
    """``(labels, launch)`` for every registered launcher (or ``specs``) over the sweep, captured, not run.

    Needs ``TRITON_INTERPRET=0`` (the GPU candidate lists). The launchers'
    small torch preparations run on meta tensors of the sweep's sizes.
    """
    if interpreted():
        raise RuntimeError("shipped_launches: set TRITON_INTERPRET=0 before triton is imported")
    sw = report_sweep() if sweep is None else sweep
    out: list[tuple[dict, KernelLaunch]] = []
    for spec in kernel_specs() if specs is None else specs:
        plan = spec.resources
        if plan is None:
            continue
        for labels, call in plan.launches(sw[plan.sweep_key], tuple(sw["dtypes"])):
            with capture_launches() as launches:
                call()
            out.extend((dict(labels, kernel=launch.kernel.__name__), launch) for launch in launches)
    return out


def planned_variants(sweep: dict | None = None, specs: tuple[KernelSpec, ...] | None = None) -> dict[str, dict]:
    """Every distinct compiled variant of the sweep: ``key -> {launch, config, arch, labels}``.

    Different launches that compile to the same code (the same kernel,
    specialization, constexprs and options) share one key; their labels are
    all kept.
    """
    sw = report_sweep() if sweep is None else sweep
    variants: dict[str, dict] = {}
    for labels, spec in shipped_launches(sw, specs):
        for config, arch in itertools.product(spec.configs, sw["archs"]):
            key = compile_key(spec, config, arch)
            entry = variants.setdefault(key, {"launch": spec, "config": config, "arch": arch, "labels": []})
            entry["labels"].append(labels)
    return variants


def variant_problems(row: dict) -> list[str]:
    """Why a compiled variant is not fit to ship (empty when it is)."""
    problems = []
    if row["stack"] > 0 or row["local"] > 0:
        problems.append(f"spills ({row['stack']} bytes of stack)")
    if row["registers"] >= REGISTER_CAP:
        problems.append(f"at the register cap ({row['registers']})")
    if row["programs_per_sm"] < 2:
        problems.append(f"{row['programs_per_sm']} program(s) per SM (limited by {row['limited_by']})")
    return problems


def config_label(config: dict) -> str:
    """``BLOCK_N x BLOCK_J x BLOCK_K, w warps, s stages`` (or ``BLOCK_N x BLOCK_D``)."""
    blocks = "x".join(str(v) for k, v in config.items() if k.startswith("BLOCK_"))
    return f"{blocks}, {config['num_warps']}w/{config.get('num_stages', 1)}s"


def describe_variant(entry: dict) -> dict:
    """The JSON row of a planned variant, before its resources are filled in."""
    spec = entry["launch"]
    labels = entry["labels"]
    dtypes = sorted({lab["dtype"] for lab in labels})
    ops = sorted({lab["op"] for lab in labels})
    first = labels[0]
    owner = kernel_owner(spec.kernel.__name__)
    cls = first["dtype"] if owner is None else owner.variant_class(first)
    return {
        "kernel": spec.kernel.__name__,
        "class": cls,
        "config": entry["config"],
        "config_label": config_label(entry["config"]),
        "ops": ops,
        "dtypes": dtypes,
        "meta": {k: v for k, v in spec.meta.items()},
        "problems_covered": len(labels),
        "example": {k: v for k, v in first.items() if k not in ("kernel",)},
    }


def kernel_source_keys() -> dict[str, str]:
    """Triton's source hash of every registered kernel (changes with the kernel or anything it calls)."""
    jits = {k.__name__: k for spec in kernel_specs() for k in spec.jit_kernels}
    return {name: jits[name].cache_key for name in sorted(jits)}


def to_json(obj: Any) -> Any:
    """JSON-safe copy (tuples to lists)."""
    return json.loads(json.dumps(obj, default=str))

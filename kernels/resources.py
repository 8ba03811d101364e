"""What a kernel costs the GPU, without a GPU: compile for a CUDA target, read the cubin.

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

import os
import re
import subprocess
import tempfile
from typing import Any

import triton

from .utils import KernelLaunch, interpreted

#: Per-SM limits used for the theoretical occupancy (CUDA programming guide,
#: "Compute capabilities", table of technical specifications; the register
#: file is allocated per warp in units of 256 registers, shared memory in
#: units of 128 bytes with 1 KB reserved per block).
SM_LIMITS = {
    80: {"registers": 65536, "max_warps": 64, "max_blocks": 32, "shared": 167936,
         "shared_per_block": 166912},
    90: {"registers": 65536, "max_warps": 64, "max_blocks": 32, "shared": 233472,
         "shared_per_block": 232448},
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
    limiter = min((("registers", by_regs), ("shared memory", by_smem), ("warps", by_warps),
                   ("blocks", lim["max_blocks"])), key=lambda kv: kv[1])[0]
    return {"programs_per_sm": blocks, "occupancy": blocks * num_warps / lim["max_warps"],
            "limited_by": limiter}


def _resource_usage(cubin: bytes, name: str) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        text = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", fh.name],
                              capture_output=True, text=True, check=True).stdout
    block = text.split(f"Function {name}:", 1)
    if len(block) != 2:
        raise RuntimeError(f"resources: no resource line for {name} in cuobjdump output:\n{text}")
    fields = dict(re.findall(r"(\w+):(\d+)", block[1].splitlines()[1]))
    return {"registers": int(fields["REG"]), "stack": int(fields["STACK"]),
            "static_shared": int(fields["SHARED"]), "local": int(fields["LOCAL"])}


def compile_launch(spec: KernelLaunch, config: dict, arch: int) -> dict[str, Any]:
    """Compile one tile configuration of a captured launch for ``sm_<arch>``; its resources."""
    if interpreted():
        raise RuntimeError("compile_launch: set TRITON_INTERPRET=0 (nothing is launched)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    jit = spec.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    try:
        binder = create_function_from_signature(jit.signature, jit.params, backend)
        kwargs = dict(spec.meta, **config, debug=False)
        bound, specialization, options = binder(*spec.args, **kwargs)
        options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound,
                                                               specialization, options)
    except (AttributeError, TypeError) as exc:  # a Triton without these internals
        raise RuntimeError(f"compile_launch: this Triton ({triton.__version__}) does not expose "
                           f"the launch internals the report uses: {exc}") from exc
    compiled = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    usage = _resource_usage(compiled.asm["cubin"], compiled.metadata.name)
    ptx = compiled.asm["ptx"]
    shared = int(compiled.metadata.shared) + usage["static_shared"]
    res = {"arch": f"sm_{arch}", **usage, "shared": shared,
           "num_warps": int(compiled.metadata.num_warps),
           "num_stages": int(compiled.metadata.num_stages),
           "tensor_cores": "wgmma" if "wgmma" in ptx else ("mma" if "mma.sync" in ptx else None)}
    res.update(occupancy(arch, usage["registers"], shared, res["num_warps"]))
    res["spills"] = usage["stack"] > 0 or usage["local"] > 0
    res["at_register_cap"] = usage["registers"] >= REGISTER_CAP
    return res

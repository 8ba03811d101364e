"""Shared helpers for the Triton launchers: checks, tile configurations, the one launch path.

Tile sizes come from one place, this module. :func:`block_sizes` is the
heuristic every launch uses in the interpreter (each kernel's record names
its own: :func:`accumulate_block_sizes`, :func:`head_block_sizes`); :func:`head_configs` and
:func:`accumulate_configs` list the candidates used when compiling for a
GPU, autotuned per dimensions, flags and input dtypes (the first candidate
alone with ``NORMFAST_AUTOTUNE=0``). Autotuning under ``TRITON_INTERPRET=1``
would re-run every candidate through the slow interpreter, so it never does.

Every launcher describes its launch as a :class:`KernelLaunch` and hands it
to :func:`launch`. :func:`capture_launches` records those descriptions
instead of running them: that is how the resource report compiles exactly
what the launchers would launch, for every configuration they can choose,
on a machine without a GPU (:mod:`normfast.kernels.resources`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import triton

__all__ = [
    "KERNEL_INPUT_DTYPES",
    "KernelLaunch",
    "MAX_BLOCK_ROWS",
    "MAX_FUSED_DIM",
    "accumulate_block_sizes",
    "accumulate_configs",
    "autotuning",
    "block_sizes",
    "capture_launches",
    "capturing",
    "check_kernel_device",
    "check_kernel_dtype",
    "head_block_sizes",
    "head_configs",
    "head_operand_class",
    "interpreted",
    "last_config",
    "launch",
    "operand_dtype",
]

#: Input dtypes every kernel accepts. Accumulation is always fp32.
KERNEL_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: The ``accumulate`` kernel keeps a whole embedding row in one block. Above
#: this width the register tile would spill, so callers fall back to torch.
MAX_FUSED_DIM = 2048

# Interpreter heuristic of ``accumulate``: elements per tile (rows x padded dim).
_ACCUMULATE_TILE = 4096
# On a GPU: fp32 elements of a tile per thread. Every live tile of the "uw"
# branch (shifts, sums, direction, radial dot) costs about this many
# registers per thread; 4 keeps the kernel near 64 registers.
_ACCUMULATE_PER_THREAD = 4

#: The most probe rows any head-kernel configuration puts in one program.
MAX_BLOCK_ROWS = 64

_CAPTURED: list | None = None


def interpreted() -> bool:
    """True when Triton runs kernels through its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def autotuning() -> bool:
    """Autotune on a GPU unless ``NORMFAST_AUTOTUNE=0``; never in the interpreter."""
    return not interpreted() and os.environ.get("NORMFAST_AUTOTUNE", "1") not in ("", "0")


def capturing() -> bool:
    """True inside :func:`capture_launches` (launchers may skip work after their launch)."""
    return _CAPTURED is not None


def check_kernel_device(fn: str, *tensors: torch.Tensor | None) -> None:
    """Kernels need CUDA tensors, or CPU tensors when the interpreter is on."""
    if _CAPTURED is not None:
        return  # planning only: nothing runs
    for x in tensors:
        if x is None:
            continue
        if x.device.type != "cuda" and not interpreted():
            raise ValueError(
                f"{fn}: expected CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got a tensor on {x.device}"
            )


def check_kernel_dtype(fn: str, name: str, x: torch.Tensor) -> None:
    if x.dtype not in KERNEL_INPUT_DTYPES:
        allowed = ", ".join(str(d).replace("torch.", "") for d in KERNEL_INPUT_DTYPES)
        raise TypeError(f"{fn}: expected {name} to have dtype {allowed}, got {name}.dtype={x.dtype}")


def operand_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype both ``tl.dot`` operands take for inputs of ``dtype``.

    bf16/fp16 activations keep their dtype and the small right factors are
    rounded to it, so the products run on the tensor cores (fp32
    accumulation); fp32 stays fp32 (exact "ieee" products, or TF32 when asked).
    """
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32


def _pow2_between(n: int, lo: int, hi: int) -> int:
    return min(hi, max(lo, triton.next_power_of_2(max(int(n), 1))))


def block_sizes(op: str, **dims: int | None) -> dict:
    """The interpreter's tile configuration of one launch of kernel ``op`` (no autotuning there).

    Each kernel's record names its own (:class:`~normfast.kernels.spec.KernelSpec`'s
    ``tiles``): :func:`accumulate_block_sizes` for ``accumulate`` (``dim=``),
    :func:`head_block_sizes` for ``head_stack`` and its ``head_stats`` /
    ``project`` epilogues (``d_in=``, ``d_out=``). On a GPU the launchers
    use :func:`head_configs` and :func:`accumulate_configs` instead.
    """
    from .spec import kernel_spec

    try:
        spec = kernel_spec(op)
    except ValueError as exc:
        raise ValueError(f"block_sizes: {exc}") from None
    return spec.tiles(**{k: v for k, v in dims.items() if v is not None})


def accumulate_block_sizes(dim: int | None = None) -> dict:
    """``accumulate`` in the interpreter: ``BLOCK_N`` rows times the whole embedding.

    ``BLOCK_D = next_pow2(dim)``; a tile is kept near ``_ACCUMULATE_TILE`` elements.
    """
    block_d = _accumulate_width(dim)
    block_n = max(1, min(64, _ACCUMULATE_TILE // block_d))
    num_warps = 4 if block_n * block_d <= 2048 else 8
    return {"BLOCK_N": block_n, "BLOCK_D": block_d, "num_warps": num_warps, "num_stages": 1}


def head_block_sizes(d_in: int | None = None, d_out: int | None = None) -> dict:
    """``head_stack`` in the interpreter: ``BLOCK_N`` probe rows, ``BLOCK_J`` output columns, ``BLOCK_K`` depth.

    At least 16 each for ``tl.dot``, and no larger than the padded problem needs.
    """
    if d_in is None or d_out is None:
        raise ValueError("block_sizes: the head kernel needs d_in and d_out")
    block_k = _pow2_between(d_in, 16, 32)
    block_j = _pow2_between(max(d_in, d_out), 16, 64)
    return {"BLOCK_N": 64, "BLOCK_J": block_j, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 1}


def _accumulate_width(dim: int | None) -> int:
    if dim is None:
        raise ValueError("block_sizes: accumulate needs dim")
    block_d = triton.next_power_of_2(max(int(dim), 1))
    if block_d > MAX_FUSED_DIM:
        raise ValueError(f"block_sizes: accumulate supports dim <= {MAX_FUSED_DIM}, got dim={dim}")
    return block_d


# Autotuning candidates of the head kernel, by operand class. Each was
# compiled for sm_80 and sm_90 in every flag combination without spills and
# with room for two programs per SM (bench/kernel_resources.py, the
# resource test). Order matters: the first is the fallback on a GPU.
_HEAD_CANDIDATES = {
    # fp32 "ieee": FMA products, whose operand slices live in registers:
    # shallow k-steps, no software pipelining.
    "fma": [
        {"BLOCK_N": 64, "BLOCK_J": 64, "BLOCK_K": 8, "num_warps": 4, "num_stages": 1},
        {"BLOCK_N": 64, "BLOCK_J": 32, "BLOCK_K": 8, "num_warps": 4, "num_stages": 1},
        {"BLOCK_N": 64, "BLOCK_J": 64, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1},
    ],
    # TF32 tensor cores (fp32 operands, 4-byte elements).
    "tf32": [
        {"BLOCK_N": 64, "BLOCK_J": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3},
        {"BLOCK_N": 64, "BLOCK_J": 64, "BLOCK_K": 16, "num_warps": 4, "num_stages": 3},
        {"BLOCK_N": 64, "BLOCK_J": 64, "BLOCK_K": 32, "num_warps": 8, "num_stages": 3},
    ],
    # bf16/fp16 tensor cores. 128-row or 128-column tiles need 8 warps to
    # stay clear of the register cap, and then fit once per SM: left out.
    "mma16": [
        {"BLOCK_N": 64, "BLOCK_J": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
        {"BLOCK_N": 64, "BLOCK_J": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3},
        {"BLOCK_N": 64, "BLOCK_J": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    ],
}


def head_operand_class(dtype: torch.dtype, precision: str) -> str:
    if dtype in (torch.float16, torch.bfloat16):
        return "mma16"
    return "tf32" if precision == "tf32" else "fma"


def head_configs(
    *, d_in: int, d_out: int, dtype: torch.dtype = torch.float32, precision: str = "ieee", for_gpu: bool | None = None
) -> list[dict]:
    """Candidate tile configurations of the head kernel for one launch.

    In the interpreter: the heuristic of :func:`head_block_sizes`. On a GPU: the
    candidates of the operand class (fp32 FMA, TF32, 16-bit tensor cores) for
    the autotuner to choose from (keyed by the padded ``d_in`` and ``d_out``,
    the flags and the dtypes), or the first alone with
    ``NORMFAST_AUTOTUNE=0``. ``for_gpu`` overrides the choice between the
    interpreter's and the GPU's list (default: the GPU's unless interpreted).
    """
    gpu = not interpreted() if for_gpu is None else for_gpu
    if not gpu:
        return [head_block_sizes(d_in=d_in, d_out=d_out)]
    pool = [dict(c) for c in _HEAD_CANDIDATES[head_operand_class(dtype, precision)]]
    return pool if for_gpu or autotuning() else pool[:1]


def accumulate_configs(*, dim: int, branch: str = "u", for_gpu: bool | None = None) -> list[dict]:
    """Candidate tile configurations of ``accumulate`` for one launch.

    In the interpreter: :func:`accumulate_block_sizes`. On a GPU: a whole row per tile
    as there, but at most ``_ACCUMULATE_PER_THREAD`` elements per thread (4
    to 16 warps; the "uw" branch, with twice the live tiles, at most 8) so
    that the live tiles stay in registers and many programs share an SM (a
    memory-bound kernel needs bytes in flight, not big tiles); for rows up to
    512 wide also the same tile over twice the warps. Keyed by ``D`` and the
    branch flags; the autotuner restores the state the kernel updates in
    place between its trial runs. ``for_gpu`` as in :func:`head_configs`.
    """
    gpu = not interpreted() if for_gpu is None else for_gpu
    if not gpu:
        return [accumulate_block_sizes(dim)]
    block_d = _accumulate_width(dim)
    if branch == "uw":
        num_warps = min(8, max(4, block_d // 128))
    else:
        # rows of 1024 or more on 16 warps: on 8, ptxas trims the kernel to 40-48
        # registers for occupancy and spills a few bytes (the resource report)
        num_warps = 16 if block_d >= 1024 else 4
    block_n = max(1, min(64, _ACCUMULATE_PER_THREAD * 32 * num_warps // block_d))
    base = {"BLOCK_N": block_n, "BLOCK_D": block_d, "num_warps": num_warps, "num_stages": 1}
    if num_warps == 4 and (for_gpu or autotuning()):
        return [base, dict(base, num_warps=8)]
    return [base]


@dataclass(frozen=True)
class KernelLaunch:
    """Everything one kernel launch needs, short of running it."""

    name: str  # the launcher's name
    kernel: Any  # the @triton.jit function
    grid: Callable[[dict], tuple]  # from the meta-parameters of the chosen config
    args: tuple  # runtime arguments, in the kernel's order
    meta: dict  # fixed constexprs (flags, precision)
    configs: list  # candidate tile configurations (block sizes, warps, stages)
    key: tuple = ()  # autotuning key: dimension argument names
    restore: tuple = ()  # arguments the kernel updates in place
    extra: dict = field(default_factory=dict)  # what the report should know (dtypes, shapes)


_TUNERS: dict[tuple, Any] = {}
_LAST_CONFIG: dict[str, dict] = {}


def last_config(name: str) -> dict | None:
    """The tile configuration the last launch of launcher ``name`` ran with (the autotuner's pick)."""
    return _LAST_CONFIG.get(name)


def _tuner(spec: KernelLaunch):
    configs = tuple(tuple(sorted(c.items())) for c in spec.configs)
    cache_key = (spec.kernel, configs, spec.key, spec.restore)
    if cache_key not in _TUNERS:
        tconfigs = []
        for c in spec.configs:
            c = dict(c)
            warps, stages = c.pop("num_warps"), c.pop("num_stages")
            tconfigs.append(triton.Config(c, num_warps=warps, num_stages=stages))
        key = list(spec.key) + sorted(spec.meta)
        _TUNERS[cache_key] = triton.autotune(configs=tconfigs, key=key, restore_value=list(spec.restore) or None)(
            spec.kernel
        )
    return _TUNERS[cache_key]


def launch(spec: KernelLaunch) -> None:
    """Run (or, inside :func:`capture_launches`, record) one kernel launch."""
    if _CAPTURED is not None:
        _CAPTURED.append(spec)
        return
    if len(spec.configs) == 1:
        cfg = spec.configs[0]
        spec.kernel[spec.grid(cfg)](*spec.args, **spec.meta, **cfg)
        _LAST_CONFIG[spec.name] = dict(cfg)
        return
    tuner = _tuner(spec)
    tuner[spec.grid](*spec.args, **spec.meta)
    best = getattr(tuner, "best_config", None)
    if best is not None:
        _LAST_CONFIG[spec.name] = dict(best.kwargs, num_warps=best.num_warps, num_stages=best.num_stages)


@contextlib.contextmanager
def capture_launches() -> Iterator[list]:
    """Record the :class:`KernelLaunch` of every launcher called in the block; run nothing.

    Device checks are skipped (CPU tensors stand in for CUDA ones). The
    launchers' small torch preparations still run; their outputs are
    meaningless.
    """
    global _CAPTURED
    if _CAPTURED is not None:
        raise RuntimeError("capture_launches: already capturing")
    _CAPTURED = []
    try:
        yield _CAPTURED
    finally:
        _CAPTURED = None

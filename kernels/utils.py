"""Shared helpers for the Triton launchers: block sizes and dtypes.

Block sizes come from one place, :func:`block_sizes`, so that the launchers
and their tests agree on tiling. The kernels do not autotune: every launch
uses the heuristic below (autotuning under ``TRITON_INTERPRET=1`` would
re-run each candidate through the slow interpreter).
"""
from __future__ import annotations

import os

import torch
import triton

#: Input dtypes every kernel accepts. Accumulation is always fp32.
KERNEL_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: The ``accumulate`` kernel keeps a whole embedding row in one block. Above
#: this width the register tile would spill, so callers fall back to torch.
MAX_FUSED_DIM = 2048

# Elements per register tile in ``accumulate`` (rows x padded embedding dim).
_ACCUMULATE_TILE = 4096


def interpreted() -> bool:
    """True when Triton runs kernels through its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_kernel_device(fn: str, *tensors: torch.Tensor) -> None:
    """Kernels need CUDA tensors, or CPU tensors when the interpreter is on."""
    for x in tensors:
        if x is None:
            continue
        if x.device.type != "cuda" and not interpreted():
            raise ValueError(
                f"{fn}: expected CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), "
                f"got a tensor on {x.device}"
            )


def check_kernel_dtype(fn: str, name: str, x: torch.Tensor) -> None:
    if x.dtype not in KERNEL_INPUT_DTYPES:
        allowed = ", ".join(str(d).replace("torch.", "") for d in KERNEL_INPUT_DTYPES)
        raise TypeError(f"{fn}: expected {name} to have dtype {allowed}, "
                        f"got {name}.dtype={x.dtype}")


def block_sizes(op: str, *, dim: int | None = None, d_in: int | None = None,
                d_out: int | None = None) -> dict:
    """Tile sizes and warp count for one kernel launch.

    ``accumulate``: a tile is ``BLOCK_N`` rows times the whole embedding
    (``BLOCK_D = next_pow2(dim)``), kept near ``_ACCUMULATE_TILE`` elements.
    ``head_stats`` / ``project``: ``BLOCK_N`` probe rows, ``BLOCK_J`` output
    columns, ``BLOCK_K`` reduction depth; at least 16 each for ``tl.dot``,
    and no larger than the padded problem needs.
    """
    if op == "accumulate":
        if dim is None:
            raise ValueError("block_sizes: accumulate needs dim")
        block_d = triton.next_power_of_2(max(int(dim), 1))
        if block_d > MAX_FUSED_DIM:
            raise ValueError(f"block_sizes: accumulate supports dim <= {MAX_FUSED_DIM}, "
                             f"got dim={dim}")
        block_n = max(1, min(64, _ACCUMULATE_TILE // block_d))
        num_warps = 4 if block_n * block_d <= 2048 else 8
        return {"BLOCK_N": block_n, "BLOCK_D": block_d, "num_warps": num_warps}
    if op in ("head_stats", "project"):
        if d_in is None or d_out is None:
            raise ValueError(f"block_sizes: {op} needs d_in and d_out")
        block_k = min(32, max(16, triton.next_power_of_2(int(d_in))))
        block_j = min(64, max(16, triton.next_power_of_2(int(d_out))))
        return {"BLOCK_N": 64, "BLOCK_J": block_j, "BLOCK_K": block_k, "num_warps": 4}
    raise ValueError(f"block_sizes: unknown op {op!r}")

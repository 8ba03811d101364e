"""The head kernel's sweeps, shared by the records of ``head_stack`` and its ``head_stats`` / ``project`` epilogues.

What the resource report compiles (:data:`HEAD_SWEEP`, :func:`sweep_problems`),
the GPU check's timed cases and their labels, each launcher's cost per row
(:mod:`normfast.kernels.costs`), and how the report names a compiled variant
of the kernel.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator

import torch

from . import costs
from .spec import meta_zeros
from .utils import head_configs

__all__ = [
    "HEAD_SWEEP",
    "check_precisions",
    "default_config",
    "epilogue_check_cases",
    "epilogue_cost",
    "epilogue_label",
    "stack_check_cases",
    "stack_cost",
    "stack_label",
    "summary_class",
    "sweep_problems",
    "variant_class",
]

#: The resource report's head problems. Integer arguments are specialized by Triton on
#: divisibility by 16 and on == 1: the dimensions cover 1, odd and 16-aligned values of each;
#: N is odd except once (aligned). (d_in, d_out): tiny, odd/odd, aligned, MiniLM-,
#: BERT-base-, large-sized heads.
HEAD_SWEEP = {
    "n": 1001,
    "aligned_n": 4096,
    "dims": ((1, 1), (3, 5), (64, 64), (384, 256), (385, 257), (768, 768), (769, 512), (2048, 2048)),
    "k1": 3,
    "k2": 2,
    "m": 4,
}


def sweep_problems(h: dict, dtypes: tuple[str, ...]) -> Iterator[tuple[dict, tuple[torch.Tensor, ...]]]:
    """``(labels, (A, Z, G, S))`` on meta tensors for every dtype, product precision and problem of ``h``."""
    for name in dtypes:
        dtype = getattr(torch, name)
        for precision in ("ieee", "tf32") if dtype == torch.float32 else ("ieee",):
            for (d_in, d_out), bias in itertools.product(h["dims"], (False, True)):
                for n in (h["n"], h["aligned_n"]) if (d_in, d_out) == (384, 256) else (h["n"],):
                    labels = {"n": n, "d_in": d_in, "d_out": d_out, "bias": bias, "dtype": name, "precision": precision}
                    da = d_in + int(bias)
                    A, Z = meta_zeros(n, d_in, dtype=dtype), meta_zeros(n, d_out, dtype=dtype)
                    yield labels, (A, Z, meta_zeros(h["k1"], d_out, da), meta_zeros(h["k2"], da, da))


def variant_class(first: dict) -> str:
    """A compiled variant's operand class, from the labels of its first launch."""
    if first["dtype"] == "float32" and first["precision"] == "ieee":
        return "fp32 FMA"
    return "TF32 MMA" if first["precision"] == "tf32" else f"{first['dtype']} MMA"


def summary_class(cls: str) -> str:
    """The resource summary's class: bf16 and fp16 tensor-core variants together."""
    return "bf16/fp16 MMA" if cls.endswith(" MMA") and "TF32" not in cls else cls


def check_precisions(d: int) -> tuple[tuple[str, str], ...]:
    """(dtype, precision) of the GPU check's head cases at width ``d``: bf16 first (the default)."""
    if d == 384:
        return (("bfloat16", "ieee"), ("float32", "tf32"), ("float32", "ieee"))
    return (("bfloat16", "ieee"), ("float32", "ieee"))


def stack_check_cases(gpu: bool) -> dict[int, list[dict]]:
    """``head_stack``: the grouped head statistics' stack at K = 4 groups (five direction
    matrices, five second-moment matrices; the probe's default K = 8 stacks nine and nine)."""
    if not gpu:
        case = {"op": "head_stack", "n": 70, "d_in": 20, "d_out": 24, "k1": 3, "k2": 3}
        return {24: [dict(case, dtype="float32", precision="ieee")]}
    out = {}
    for d in (384, 768):
        # about 2.3 TFLOP at d = 384 (2^20 rows), 2.4 at 768 (2^18)
        case = {"op": "head_stack", "n": 2**20 if d == 384 else 2**18, "d_in": d, "d_out": d, "k1": 5, "k2": 5}
        out[d] = [dict(case, dtype=dtype, precision=precision) for dtype, precision in check_precisions(d)]
    return out


def epilogue_check_cases(op: str) -> Callable[[bool], dict[int, list[dict]]]:
    """``head_stats`` (S form) and ``project`` (per-batch form) through ``normfast.ops``, M = 16."""

    def cases(gpu: bool) -> dict[int, list[dict]]:
        if not gpu:
            return {24: [{"op": op, "n": 70, "d_in": 20, "d_out": 24, "m": 4, "dtype": "float32", "precision": "ieee"}]}
        out = {}
        for d in (384, 768):
            # project does (M+1) d_in d_out MACs per row: fewer rows, same ~1.3 TFLOP
            n = 2**20 if op == "head_stats" else (2**18 if d == 384 else 2**16)
            out[d] = [
                {"op": op, "n": n, "d_in": d, "d_out": d, "m": 16, "dtype": dtype, "precision": precision}
                for dtype, precision in check_precisions(d)
            ]
        return out

    return cases


def stack_label(c: dict) -> str:
    return (
        f"head_stack N={c['n']} d_in={c['d_in']} d_out={c['d_out']} K1={c['k1']} "
        f"K2={c['k2']} {c['dtype']}/{c['precision']}"
    )


def epilogue_label(c: dict) -> str:
    return f"{c['op']} N={c['n']} d_in={c['d_in']} d_out={c['d_out']} M={c['m']} {c['dtype']}/{c['precision']}"


def stack_cost(c: dict, config: dict | None = None, n: int | None = None) -> dict:
    """Per row: ``K1`` direction matrices and ``K2`` quadratic forms (bias on unless the case says)."""
    return costs.head_stack_cost(
        c["d_in"], c["d_out"], c["k1"], c["k2"], dtype=c["dtype"], config=config, bias=c.get("bias", True), n=n
    )


def epilogue_cost(form: str) -> Callable[..., dict]:
    """Per row of a head form (``"S"``, ``"per_batch"``): its stack through the kernel, then the torch epilogue."""

    def cost(c: dict, config: dict | None = None, n: int | None = None) -> dict:
        k1, k2 = costs.head_stack_shape(form, m=c["m"])
        out = costs.head_stack_cost(
            c["d_in"], c["d_out"], k1, k2, dtype=c["dtype"], config=config, bias=c.get("bias", True), n=n
        )
        out["hbm_bytes"] += costs.head_epilogue_bytes(form, m=c["m"])
        return out

    return cost


def default_config(c: dict) -> dict:
    """The tile configuration a GPU launch of a head case falls back to (the first candidate)."""
    return head_configs(
        d_in=c["d_in"], d_out=c["d_out"], dtype=getattr(torch, c["dtype"]), precision=c["precision"], for_gpu=True
    )[0]

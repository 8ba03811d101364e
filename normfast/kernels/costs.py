"""What each kernel computes and moves per probe row: the inputs of a roofline.

Counts are per probe row, for a launch over many rows (the right factors,
read once per launch, are amortized away unless ``n`` is given). FLOPs count
2 per multiply-add. Three traffic figures:

* ``hbm_bytes``: the fewest bytes that must cross the HBM interface (inputs
  read once, outputs written once);
* ``l2_bytes``: what the tiled kernel loads from L2 for the given tile
  configuration (every operand tile of every product, the usual GEMM count:
  pipelined ``tl.dot`` loads bypass L1);
* ``executed_flops``: the products the tensor or FMA units execute,
  including the padding of the last tiles (``useful_flops`` without it).

The torch-path counts follow :func:`normfast.ops.head_mode_stats` and
``ProbeAccumulator``'s torch update on the same device: fp32 compute, every
intermediate written to and read back from memory.

:func:`head_roofline_rows` and :func:`accumulate_roofline_rows` are the
kernels' rows of the paper roofline (``bench/experiments/roofline.py``),
named by their records (:class:`~normfast.kernels.spec.KernelSpec`'s ``roofline``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

__all__ = [
    "ELEMENT_BYTES",
    "HEAD_OPERAND_CLASSES",
    "accumulate_cost",
    "accumulate_roofline_rows",
    "accumulate_torch_cost",
    "floor_seconds",
    "head_epilogue_bytes",
    "head_roofline_rows",
    "head_stack_cost",
    "head_stack_shape",
    "head_torch_cost",
    "head_units",
]

#: Bytes per element of the kernels' input dtypes.
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def head_stack_cost(
    d_in: int,
    d_out: int,
    k1: int,
    k2: int,
    *,
    dtype: str = "float32",
    config: dict | None = None,
    bias: bool = False,
    n: int | None = None,
) -> dict[str, float]:
    """One row through ``head_stack``: ``K1`` direction matrices, ``K2`` quadratic forms.

    ``config`` is a tile configuration (``BLOCK_N``, ``BLOCK_J``,
    ``BLOCK_K``); without one, the L2 and padding figures are omitted.
    """
    elt = ELEMENT_BYTES[dtype]
    useful = 2 * (k1 * d_out * d_in + k2 * d_in * (d_in + 1) / 2)
    useful += 4 * k1 * d_out + 2 * k2 * d_in + 2 * d_out  # epilogues: z·v, |v|², p·a, |z|²
    hbm = (d_in + d_out) * elt + 4 * (2 * k1 + k2 + 1)
    if n:
        hbm += (k1 * d_out * d_in + k2 * d_in * d_in) * elt / n
    out = {"useful_flops": useful, "hbm_bytes": hbm}
    if config:
        bn, bj, bk = config["BLOCK_N"], config["BLOCK_J"], config["BLOCK_K"]
        k_pad = _cdiv(d_in, bk) * bk
        tiles_out = _cdiv(d_out, bj)
        macs = k1 * tiles_out * bj * k_pad * bn
        elems = k1 * tiles_out * (bn * k_pad + bj * k_pad + bn * bj) + bn * d_out
        for t in range(_cdiv(d_in, bj)):
            k_run = _cdiv((t + 1) * bj, bk) * bk  # the triangle: k-tiles up to the diagonal
            macs += k2 * bj * k_run * bn
            elems += k2 * (bn + bj) * min(k_run, k_pad) + k2 * bn * bj
        out["executed_flops"] = 2 * macs / bn + (useful - 2 * (k1 * d_out * d_in + k2 * d_in * (d_in + 1) / 2))
        out["l2_bytes"] = elems * elt / bn
    return out


def head_epilogue_bytes(form: str, *, m: int = 0, groups: int = 0) -> float:
    """Bytes per row of the torch epilogue over ``head_stack``'s outputs.

    About a dozen elementwise passes over per-row vectors (8 bytes each: one
    read, one write), plus, for the per-batch form, eight over the ``[N, M]``
    radial dots (and for the grouped form over ``[N, K+1]``).
    """
    width = {"S": 0, "per_batch": m, "grouped": groups + 1}[form]
    return 12 * 8 + 8 * 8 * width


def head_stack_shape(form: str, *, m: int = 0, groups: int = 0) -> tuple[int, int]:
    """``(K1, K2)`` of each head form: S ``(1, 1)``, per-batch ``(M+1, 0)``, grouped ``(K+1, K+1)``.

    The grouped form (issue 13) stacks the overall and the ``K`` group mean
    directions, and the overall and ``K`` per-group second moments.
    """
    return {"S": (1, 1), "per_batch": (m + 1, 0), "grouped": (groups + 1, groups + 1)}[form]


def head_torch_cost(
    form: str, d_in: int, d_out: int, *, dtype: str = "float32", m: int = 0, groups: int = 0
) -> dict[str, float]:
    """One row through the torch path of the head statistics on the same GPU (fp32 GEMMs).

    Inputs are converted to fp32 (one read, one write) unless they are fp32;
    each GEMM writes its ``[N, width]`` product, which the reductions read
    back (a product with ``z`` or ``a`` written and read again before its row
    sum). The S form multiplies by the full ``S_c`` (no symmetry).
    """
    elt = ELEMENT_BYTES[dtype]
    conv = 0 if elt == 4 else (elt + 4) * (d_in + d_out)
    k1, k2 = head_stack_shape(form, m=m, groups=groups)
    if form == "per_batch":
        k2 = 0
    v_width = k1 * d_out
    p_width = k2 * d_in
    flops = 2 * (v_width * d_in + p_width * d_in) + 4 * v_width + 2 * p_width
    hbm = conv + 4 * d_in + 4 * d_out  # A and Z, fp32
    hbm += 4 * v_width * (1 + 4 + 3)  # write v; z·v and |v|² passes
    if p_width:
        hbm += 4 * d_in + 4 * p_width * (1 + 4)  # second GEMM: write p; p·a pass
    return {
        "useful_flops": flops,
        "hbm_bytes": hbm + head_epilogue_bytes("S" if form == "S" else form, m=m, groups=groups),
    }


def accumulate_cost(d: int, k: int, *, branch: str = "u", dtype: str = "float32") -> dict[str, float]:
    """One row through one ``accumulate`` update of ``K`` directions (memory-bound by design).

    The directions and ``z`` are read once, the fp32 mean vectors read and
    written, the per-row scalars (moments, counts, reason, cross term) read
    and written. About six FLOPs per direction element per branch.
    """
    elt = ELEMENT_BYTES[dtype]
    nb = 2 if branch == "uw" else 1
    hbm = nb * k * d * elt + d * elt + nb * 2 * d * 4 + nb * 2 * (3 * 4 + 2 * 8) + 2 + (2 * 4 if nb == 2 else 0)
    return {"useful_flops": 6 * nb * k * d + 3 * d, "hbm_bytes": hbm}


def accumulate_torch_cost(d: int, k: int, *, branch: str = "u", dtype: str = "float32") -> dict[str, float]:
    """The torch update on the same GPU: five passes over the fp32 directions per branch.

    Conversion to fp32 (unless fp32), the shifted deviations written and
    read twice (their sum and their squared norms), the radial dots read the
    directions once more; "uw" adds the u·w products (both branches read).
    """
    elt = ELEMENT_BYTES[dtype]
    nb = 2 if branch == "uw" else 1
    conv = 0 if elt == 4 else nb * k * d * (elt + 4)
    passes = nb * k * d * 4 * 5 + (2 * k * d * 4 if nb == 2 else 0)
    state = nb * 2 * d * 4 + 3 * d * 4
    return {"useful_flops": 6 * nb * k * d + 3 * d, "hbm_bytes": conv + passes + state}


def floor_seconds(cost: dict[str, float], rate_flops: float, hbm_bytes_per_s: float, rows: int = 1) -> dict[str, float]:
    """Compute and memory floors of ``rows`` rows at the given peaks; the larger binds."""
    flops = cost.get("executed_flops", cost["useful_flops"])
    compute = rows * flops / rate_flops if rate_flops else 0.0
    memory = rows * cost["hbm_bytes"] / hbm_bytes_per_s
    return {
        "compute_s": compute,
        "memory_s": memory,
        "floor_s": max(compute, memory),
        "bound_by": "compute" if compute >= memory else "memory",
        "intensity": cost["useful_flops"] / cost["hbm_bytes"] if cost["hbm_bytes"] else math.inf,
    }


#: Operand classes of the head kernel: (input dtype, product precision, what runs the products,
#: the units whose peak bounds them; :data:`normfast.kernels.spec.UNITS`).
HEAD_OPERAND_CLASSES = {
    "fma": ("float32", "ieee", "fp32 FMA (ieee)", "fp32_fma"),
    "tf32": ("float32", "tf32", "TF32 tensor cores", "tf32_dense"),
    "mma16": ("bfloat16", "ieee", "bf16 tensor cores", "bf16_dense"),
}


def head_units(case: dict) -> str:
    """The units the head kernel's products run on for a case's dtype and precision."""
    if case["dtype"] != "float32":
        return "bf16_dense"
    return "tf32_dense" if case.get("precision") == "tf32" else "fp32_fma"


Row = Callable[[dict, dict, str], dict]


def head_roofline_rows(d: int, p: dict[str, Any], row: Row) -> list[dict]:
    """The head statistics' forms (S, grouped, per-batch) at ``d_in = d_out = d``: the torch path and the kernel.

    ``p`` is the roofline's protocol (``rows``, ``m``, ``groups``, ``bias``);
    ``row(case, cost, units)`` places a case on the roofline. Every GPU tile
    configuration of each operand class gets a row (the first is the default).
    """
    import torch

    from .utils import head_configs

    out = []
    for form in ("S", "grouped", "per_batch"):
        k1, k2 = head_stack_shape(form, m=p["m"], groups=p["groups"])
        base = {
            "op": "head",
            "form": form,
            "d_in": d,
            "d_out": d,
            "k1": k1,
            "k2": k2,
            "m": p["m"] if form == "per_batch" else None,
            "groups": p["groups"] if form == "grouped" else None,
        }
        torch_ms = {}
        for precision, units in (("fp32", "fp32_fma"), ("tf32", "tf32_dense")):
            for dtype in ("float32", "bfloat16"):
                cost = head_torch_cost(form, d, d, dtype=dtype, m=p["m"], groups=p["groups"])
                case = dict(base, path="torch", dtype=dtype, products=f"cuBLAS {precision.upper()} GEMMs", config=None)
                r = row(case, cost, units)
                torch_ms[(dtype, precision)] = r["predicted_ms"]
                out.append(r)
        for cls, (dtype, precision, products, units) in HEAD_OPERAND_CLASSES.items():
            pool = head_configs(d_in=d, d_out=d, dtype=getattr(torch, dtype), precision=precision, for_gpu=True)
            for i, config in enumerate(pool):
                cost = head_stack_cost(d, d, k1, k2, dtype=dtype, config=config, bias=p["bias"], n=p["rows"])
                cost["hbm_bytes"] += head_epilogue_bytes(form, m=p["m"], groups=p["groups"])
                case = dict(base, path="kernel", dtype=dtype, products=products, config=config, default_config=i == 0)
                r = row(case, cost, units)
                # the torch path a user of these inputs gets: fp32 GEMMs (tf32 only when allowed)
                ref = torch_ms[(dtype, "tf32" if cls == "tf32" else "fp32")]
                r["torch_path_predicted_ms"] = ref
                r["predicted_speedup_vs_torch"] = ref / r["predicted_ms"]
                out.append(r)
    return out


def accumulate_roofline_rows(d: int, p: dict[str, Any], row: Row) -> list[dict]:
    """``accumulate`` of ``p["accumulate_k"]`` directions per update at width ``d``: the torch update and the kernel."""
    from .utils import accumulate_configs

    out = []
    for branch in ("u", "uw"):
        for dtype in ("float32", "bfloat16"):
            base = {
                "op": "accumulate",
                "form": f"accumulate[{branch}]",
                "d_in": d,
                "d_out": d,
                "k": p["accumulate_k"],
                "dtype": dtype,
            }
            torch_cost = accumulate_torch_cost(d, p["accumulate_k"], branch=branch, dtype=dtype)
            t = row(dict(base, path="torch", products="torch elementwise", config=None), torch_cost, "fp32_fma")
            out.append(t)
            cost = accumulate_cost(d, p["accumulate_k"], branch=branch, dtype=dtype)
            for i, config in enumerate(accumulate_configs(dim=d, branch=branch, for_gpu=True)):
                case = dict(base, path="kernel", products="memory-bound", config=config, default_config=i == 0)
                r = row(case, cost, "fp32_fma")
                r["torch_path_predicted_ms"] = t["predicted_ms"]
                r["predicted_speedup_vs_torch"] = t["predicted_ms"] / r["predicted_ms"]
                out.append(r)
    return out

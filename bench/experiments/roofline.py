"""Roofline on paper: predicted H200 time of every kernel, form and tile configuration.

    python -m bench run roofline                        # prints, writes runs/roofline/roofline.json
    python -m bench run roofline --out bench/results/roofline    # the committed prediction

No measurement: FLOPs and bytes per probe row from
:mod:`normfast.kernels.costs`, the tile configurations the launchers ship
(:func:`normfast.kernels.head_configs`, ``accumulate_configs``) and the
published peaks of an H200 SXM (:data:`PEAKS`, with their source). For each
case: useful FLOPs, HBM bytes, arithmetic intensity, the compute floor at
the peak of the units the products run on (FMA, TF32 or bf16/fp16 tensor
cores, counting the padded tiles the units execute), the HBM floor, and the
prediction = the larger of the two. Next to each kernel form: the torch
path of the same statistics on the same GPU (fp32 GEMMs with every
intermediate in memory), and for the head statistics the S form, the
grouped form (K groups) and the per-batch form (M batches).

What the prediction leaves out, on purpose (a GPU run measures it):
L2 traffic. Each tiled product re-reads its operand tiles from L2; the
bytes per row are in the JSON (``l2_bytes``) with the L2 bandwidth a case
would need to hold its predicted time (``l2_TBps_needed``). NVIDIA publishes
no L2 bandwidth for the H200, so it is not a ceiling here; where that need
is high the kernel is expected to fall short of its floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.harness import Context, JsonStyle

RESULTS = ("roofline.json",)
FIGURES = ()
TABLES = ("roofline",)
JSON = JsonStyle(strict=False)
SCHEMA = "normfast-roofline/1"

#: Published peaks of the H200 SXM (NVIDIA H200 Tensor Core GPU datasheet,
#: nvidia.com/en-us/data-center/h200/): FP32 67 TFLOPS; TF32 Tensor Core 989
#: and BF16/FP16 Tensor Core 1,979 TFLOPS *with sparsity*, i.e. half that
#: dense; HBM3e 4.8 TB/s.
PEAKS = {
    "fp32_fma": 67e12,
    "tf32_dense": 989e12 / 2,
    "bf16_dense": 1979e12 / 2,
    "hbm_bytes_per_s": 4.8e12,
    "source": "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): FP32 67 TFLOPS, TF32 Tensor "
    "Core 989 TFLOPS and BF16/FP16 Tensor Core 1,979 TFLOPS with 2:4 sparsity (dense: "
    "half), GPU memory bandwidth 4.8 TB/s",
}


def protocol() -> dict[str, Any]:
    """The sizes of the prediction (the gpu_check cases use the same d, M and N)."""
    from normfast.engine.estimators import DEFAULT_GROUPS

    return {
        "dims": (384, 768),
        "rows": 2**20,
        "m": 16,
        "groups": DEFAULT_GROUPS,
        "bias": True,
        "accumulate_k": 8,
        "groups_note": f"K = {DEFAULT_GROUPS} groups for the grouped form (the default, chosen by "
        f"bench/calibration.py); K1 = K2 = K + 1",
    }


# Kernel operand classes: (input dtype, product precision, products, peak key)
CLASSES = {
    "fma": ("float32", "ieee", "fp32 FMA (ieee)", "fp32_fma"),
    "tf32": ("float32", "tf32", "TF32 tensor cores", "tf32_dense"),
    "mma16": ("bfloat16", "ieee", "bf16 tensor cores", "bf16_dense"),
}


@dataclass
class Config:
    """No settings: the prediction is fixed by :func:`protocol` and :data:`PEAKS`."""

    @classmethod
    def quick(cls) -> "Config":
        return cls()  # seconds already


def _row(case: dict, cost: dict, rate: float, rows: int) -> dict:
    from normfast.kernels import costs

    fl = costs.floor_seconds(cost, rate, PEAKS["hbm_bytes_per_s"], rows)
    out = dict(
        case,
        **{k: round(v, 3) for k, v in cost.items()},
        rate_TFLOPs=rate / 1e12,
        intensity=round(fl["intensity"], 2),
        bound_by=fl["bound_by"],
        compute_floor_ms=fl["compute_s"] * 1e3,
        hbm_floor_ms=fl["memory_s"] * 1e3,
        predicted_ms=fl["floor_s"] * 1e3,
        predicted_ns_per_row=fl["floor_s"] / rows * 1e9,
    )
    if "l2_bytes" in cost and fl["floor_s"] > 0:
        out["l2_TBps_needed"] = rows * cost["l2_bytes"] / fl["floor_s"] / 1e12
    return out


def head_rows(d: int, p: dict[str, Any]) -> list[dict]:
    import torch

    from normfast.kernels import costs
    from normfast.kernels.utils import head_configs

    rows, bias = p["rows"], p["bias"]
    out = []
    for form in ("S", "grouped", "per_batch"):
        k1, k2 = costs.head_stack_shape(form, m=p["m"], groups=p["groups"])
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
        for precision, peak in (("fp32", "fp32_fma"), ("tf32", "tf32_dense")):
            for dtype in ("float32", "bfloat16"):
                cost = costs.head_torch_cost(form, d, d, dtype=dtype, m=p["m"], groups=p["groups"])
                r = _row(
                    dict(base, path="torch", dtype=dtype, products=f"cuBLAS {precision.upper()} GEMMs", config=None),
                    cost,
                    PEAKS[peak],
                    rows,
                )
                torch_ms[(dtype, precision)] = r["predicted_ms"]
                out.append(r)
        for cls, (dtype, precision, products, peak) in CLASSES.items():
            pool = head_configs(d_in=d, d_out=d, dtype=getattr(torch, dtype), precision=precision, for_gpu=True)
            for i, config in enumerate(pool):
                cost = costs.head_stack_cost(d, d, k1, k2, dtype=dtype, config=config, bias=bias, n=rows)
                cost["hbm_bytes"] += costs.head_epilogue_bytes(form, m=p["m"], groups=p["groups"])
                r = _row(
                    dict(base, path="kernel", dtype=dtype, products=products, config=config, default_config=i == 0),
                    cost,
                    PEAKS[peak],
                    rows,
                )
                # the torch path a user of these inputs gets: fp32 GEMMs (tf32 only when allowed)
                ref = torch_ms[(dtype, "tf32" if cls == "tf32" else "fp32")]
                r["torch_path_predicted_ms"] = ref
                r["predicted_speedup_vs_torch"] = ref / r["predicted_ms"]
                out.append(r)
    return out


def accumulate_rows(d: int, p: dict[str, Any]) -> list[dict]:
    from normfast.kernels import costs
    from normfast.kernels.utils import accumulate_configs

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
            torch_cost = costs.accumulate_torch_cost(d, p["accumulate_k"], branch=branch, dtype=dtype)
            t = _row(
                dict(base, path="torch", products="torch elementwise", config=None),
                torch_cost,
                PEAKS["fp32_fma"],
                p["rows"],
            )
            out.append(t)
            cost = costs.accumulate_cost(d, p["accumulate_k"], branch=branch, dtype=dtype)
            for i, config in enumerate(accumulate_configs(dim=d, branch=branch, for_gpu=True)):
                r = _row(
                    dict(base, path="kernel", products="memory-bound", config=config, default_config=i == 0),
                    cost,
                    PEAKS["fp32_fma"],
                    p["rows"],
                )
                r["torch_path_predicted_ms"] = t["predicted_ms"]
                r["predicted_speedup_vs_torch"] = t["predicted_ms"] / r["predicted_ms"]
                out.append(r)
    return out


def check_case_rows() -> list[dict]:
    """The prediction for each timed case of ``gpu_check`` on a GPU (its sizes, its N)."""
    import torch

    from bench.experiments.gpu_check.kernel_stage import case_label, kernel_cases
    from normfast.kernels import costs
    from normfast.kernels.utils import head_configs

    out = []
    for c in kernel_cases(gpu=True):
        label = case_label(c)
        if c["op"] == "accumulate":
            cost = costs.accumulate_cost(c["dim"], c["k"], branch=c["branch"], dtype=c["dtype"])
            out.append(_row({"label": label, "op": c["op"], "config": None}, cost, PEAKS["fp32_fma"], c["n"]))
            continue
        if c["op"] == "head_stack":
            k1, k2, form = c["k1"], c["k2"], None
        else:
            form = "S" if c["op"] == "head_stats" else "per_batch"
            k1, k2 = costs.head_stack_shape(form, m=c["m"])
        cls = "mma16" if c["dtype"] != "float32" else ("tf32" if c["precision"] == "tf32" else "fma")
        config = head_configs(
            d_in=c["d_in"], d_out=c["d_out"], dtype=getattr(torch, c["dtype"]), precision=c["precision"], for_gpu=True
        )[0]
        cost = costs.head_stack_cost(
            c["d_in"], c["d_out"], k1, k2, dtype=c["dtype"], config=config, bias=True, n=c["n"]
        )
        if form:
            cost["hbm_bytes"] += costs.head_epilogue_bytes(form, m=c["m"])
        out.append(_row({"label": label, "op": c["op"], "config": config}, cost, PEAKS[CLASSES[cls][3]], c["n"]))
    return out


def run(config: Config, ctx: Context) -> dict[str, Any]:
    p = protocol()
    cases = []
    for d in p["dims"]:
        cases += head_rows(d, p) + accumulate_rows(d, p)
    return {
        "schema": SCHEMA,
        "command": ctx.command,
        "peaks": PEAKS,
        "protocol": p,
        "cases": cases,
        "gpu_check_cases": check_case_rows(),
    }


def tables(result: dict[str, Any]) -> dict[str, str]:
    return {"roofline": roofline_table(result), "roofline, gpu_check cases": roofline_check_table(result)}


def roofline_table(d: dict, dim: int = 384) -> str:
    """Predicted H200 time per form and path at d_in = d_out = ``dim`` (default tile configs)."""
    pk = d["peaks"]
    proto = d["protocol"]
    rows = [
        f"| form (d = {dim}) | path: products | inputs | FLOP / row | HBM bytes / row | FLOP/B "
        f"| bound by | predicted ms, 2^20 rows | vs torch path | L2 TB/s needed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = {"S": "S form", "grouped": f"grouped, K = {proto['groups']}", "per_batch": f"per-batch, M = {proto['m']}"}
    for c in d["cases"]:
        if c["d_in"] != dim or (c["path"] == "kernel" and not c.get("default_config")):
            continue
        form = names.get(c["form"], c["form"])
        if c["op"] == "accumulate":
            form += f", K = {c['k']}"
        path = "normfast kernel" if c["path"] == "kernel" else "torch path"
        speed = c.get("predicted_speedup_vs_torch")
        l2 = c.get("l2_TBps_needed")
        rows.append(
            f"| {form} | {path}: {c['products']} | {c['dtype']} | "
            f"{c['useful_flops'] / 1e6:.2f} M | {c['hbm_bytes']:,.0f} | {c['intensity']:.0f} "
            f"| {c['bound_by']} | {c['predicted_ms']:.2f} | "
            f"{'-' if speed is None else f'{speed:.1f}x'} | "
            f"{'-' if l2 is None else f'{l2:.1f}'} |"
        )
    # the footer's command is the one the committed README block states (today the runner's
    # `python -m bench run roofline --out bench/results/roofline`): changing it changes the README
    rows.append("")
    rows.append(
        f"Peaks: FP32 {pk['fp32_fma'] / 1e12:.0f}, TF32 {pk['tf32_dense'] / 1e12:.1f} and "
        f"BF16 {pk['bf16_dense'] / 1e12:.1f} TFLOP/s dense, HBM "
        f"{pk['hbm_bytes_per_s'] / 1e12:.1f} TB/s ({pk['source']}). Bias on; "
        f"{proto['groups_note']}. Prediction = max(compute floor on the padded tiles, "
        f"HBM floor); L2 is not a ceiling here (no published figure): the last column is "
        f"the L2 bandwidth the tiled kernel would need to hold its prediction. "
        f"`python -m bench run roofline --out bench/results/roofline`."
    )
    return "\n".join(rows)


def roofline_check_table(d: dict) -> str:
    """The prediction for each timed case of the GPU check (default tile configurations)."""
    rows = [
        "| gpu_check case | bound by | compute floor ms | HBM floor ms | predicted ms | L2 TB/s needed |",
        "|---|---|---|---|---|---|",
    ]
    for c in d["gpu_check_cases"]:
        l2 = c.get("l2_TBps_needed")
        rows.append(
            f"| {c['label']} | {c['bound_by']} | {c['compute_floor_ms']:.2f} | "
            f"{c['hbm_floor_ms']:.2f} | {c['predicted_ms']:.2f} | "
            f"{'-' if l2 is None else f'{l2:.1f}'} |"
        )
    return "\n".join(rows)

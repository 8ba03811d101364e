"""Roofline on paper: predicted H200 time of every kernel, form and tile configuration.

    python -m bench run roofline                        # prints, writes runs/roofline/roofline.json
    python -m bench run roofline --out bench/results/roofline    # the committed prediction

No measurement: FLOPs and bytes per probe row from
:mod:`normfast.kernels.costs`, the tile configurations the launchers ship
(:func:`normfast.kernels.head_configs`, ``accumulate_configs``) and the
published peaks of an H200 SXM (:data:`PEAKS`, with their source). Every
registered kernel's record (``normfast.kernels.kernel_specs()``) names its
rows (``roofline``) and the cost and units of its GPU-check cases. For each
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


def kernel_rows(d: int, p: dict[str, Any]) -> list[dict]:
    """Every registered kernel's rows at width ``d`` (its record's ``roofline``), in registry order."""
    from normfast.kernels import kernel_specs

    def row(case: dict, cost: dict, units: str) -> dict:
        return _row(case, cost, PEAKS[units], p["rows"])

    return [r for spec in kernel_specs() for r in spec.roofline(d, p, row)]


def check_case_rows() -> list[dict]:
    """The prediction for each timed case of ``gpu_check`` on a GPU (its sizes, its N, its default tiles)."""
    from bench.experiments.gpu_check.kernel_stage import case_label, kernel_cases
    from normfast.kernels import kernel_spec

    out = []
    for c in kernel_cases(gpu=True):
        spec = kernel_spec(c["op"])
        config = spec.cost_config(c)
        cost = spec.cost(c, config=config, n=c["n"])
        out.append(_row({"label": case_label(c), "op": c["op"], "config": config}, cost, PEAKS[spec.units(c)], c["n"]))
    return out


def run(config: Config, ctx: Context) -> dict[str, Any]:
    p = protocol()
    cases = []
    for d in p["dims"]:
        cases += kernel_rows(d, p)
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
        if c.get("k") is not None:  # directions per update (the head forms count theirs as K1, K2)
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

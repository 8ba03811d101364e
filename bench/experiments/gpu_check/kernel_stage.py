"""Worker stage ``kernels``: each kernel case checked against float64, timed, placed on its roofline."""

from __future__ import annotations

import time
import traceback
import zlib
from functools import partial
from typing import Any

from .common import log
from .context import StageContext, bench, cuda_usable, first_calls, tf32_matmul


def kernel_cases(gpu: bool) -> list[dict[str, Any]]:
    """The timed cases of every registered kernel, most informative first (later ones are dropped
    when time runs out): each kernel's record lists its cases by problem width (``check_cases``),
    and every kernel runs at a width before any runs at the next, narrowest first."""
    from normfast.kernels import kernel_specs

    by_width = [spec.check_cases(gpu) for spec in kernel_specs()]
    widths = sorted({w for cases in by_width for w in cases})
    return [c for w in widths for cases in by_width for c in cases.get(w, [])]


def case_label(c: dict[str, Any]) -> str:
    from normfast.kernels import kernel_spec

    return kernel_spec(c["op"]).case_label(c)


def roofline(
    flops: float, nbytes: float, rate_tflops: float | None, copy_gbps: float | None, p50_ms: float
) -> dict[str, Any]:
    """Achieved rates, their fractions of the ceilings, and which ceiling binds."""
    s = p50_ms / 1e3
    out: dict[str, Any] = {"TFLOPs": flops / s / 1e12 if flops else None, "GBps": nbytes / s / 1e9}
    t_compute = flops / (rate_tflops * 1e12) if flops and rate_tflops else None
    t_memory = nbytes / (copy_gbps * 1e9) if copy_gbps else None
    out["fraction_of_compute_ceiling"] = t_compute / s if t_compute else None
    out["fraction_of_copy_bandwidth"] = t_memory / s if t_memory else None
    floors = {k: v for k, v in (("compute", t_compute), ("memory", t_memory)) if v}
    if floors:
        bound = max(floors, key=floors.get)
        out["bound_by"] = bound
        out["floor_ms"] = floors[bound] * 1e3
        out["fraction_of_roofline"] = floors[bound] / s
    return out


def head_case(ctx: StageContext, c: dict[str, Any], ceilings: dict[str, Any] | None, *, s_form: bool) -> dict:
    """The S form (``head_stats``) or the per-batch form (``project``) through ``normfast.ops``, vs its torch path."""
    import torch

    from normfast import ops
    from normfast.core.reference import head_stats_reference, project_reference, stat_errors
    from normfast.kernels import kernel_spec
    from normfast.kernels.utils import last_config

    spec = kernel_spec(c["op"])
    dev = ctx.device
    n, d_in, d_out, m = c["n"], c["d_in"], c["d_out"], c["m"]
    dtype = getattr(torch, c["dtype"])
    tf32 = c["precision"] == "tf32"
    gen = torch.Generator(device=dev).manual_seed(zlib.crc32(case_label(c).encode()))
    A = torch.randn(n, d_in, device=dev, generator=gen)
    W = torch.randn(d_out, d_in, device=dev, generator=gen) / d_in**0.5
    b = 0.1 * torch.randn(d_out, device=dev, generator=gen)
    Z = torch.addmm(b, A, W.T).to(dtype)
    A = A.to(dtype)
    G = 0.5 * torch.randn(1, d_out, d_in, device=dev, generator=gen) + torch.randn(
        m, d_out, d_in, device=dev, generator=gen
    )
    g = torch.randn(m, d_out, device=dev, generator=gen)
    dirs = ops.prepare_head(G, g)
    form = {"form": "S", "radial_spread": False} if s_form else {"form": "per_batch", "radial_spread": True}

    def fast():
        return ops.head_stats(A, Z, dirs, backend="triton", allow_tf32=tf32, **form)

    def plain():
        return ops.head_stats(A, Z, dirs, backend="torch", **form)

    res: dict[str, Any] = dict(c, label=case_label(c))
    res.update(first_calls(ctx, fast))
    res["config"] = last_config("head_stack")
    got = fast()
    rows = slice(0, min(n, 8192 if ctx.gpu else n))
    reference = head_stats_reference if s_form else project_reference
    ref = reference(A[rows].double(), Z[rows].double(), G.double(), g.double())
    keys = ["D", "m2", "V2", "Q"] + ([] if s_form else ["se_D"])
    errors = stat_errors({k: got[k][rows] for k in keys}, ref, keys)
    if dtype == torch.float32:
        tol = 5e-3 if tf32 else spec.allowed_error(torch.float32)
    else:  # the flash-attention rule: against plain torch in that dtype
        low = [x.to(dtype) for x in (A[rows], Z[rows], G, g)]
        plain_err = stat_errors(reference(*low), ref, keys)
        tol = spec.allowed_error(dtype, max(plain_err.values()))
    res["check"] = check_record(rows.stop, errors, tol)
    del got, ref
    res["kernel"] = bench(ctx, fast)
    with tf32_matmul(tf32):  # the torch path gets the same matmul precision
        plain()
        res["torch_path"] = bench(ctx, plain)
    res.update(kernel_roofline(res, spec.cost(c, n=n), n, c, ceilings))
    res["note"] = (
        "S_c (one GEMM over the M d_out centered rows) is formed in the first call and cached: not in either timing"
        if s_form
        else "the centered directions are prepared once: not in either timing"
    )
    return res


def check_record(rows: int, errors: dict[str, float], tol: float) -> dict[str, Any]:
    worst = max(errors.values())
    return {
        "rows": rows,
        "reference": "float64 on the same (rounded) inputs",
        "max_error": worst,
        "errors": errors,
        "tolerance": tol,
        "passed": bool(worst <= tol),
    }


def kernel_roofline(res: dict, cost: dict, n: int, c: dict, ceilings: dict | None) -> dict:
    """FLOPs and bytes of a case (its kernel's cost model), placed against the measured ceilings.

    The compute ceiling is the GEMM rate of the units the products run on
    (the record's ``units``): bf16/fp16 inputs on tensor cores (the bf16
    GEMM), fp32 with TF32 (the TF32 GEMM), fp32 "ieee" on FMA units (the
    fp32 GEMM with TF32 off). With the tile configuration the launch ran
    with, also the bytes the tiles load from L2 (when the cost model counts them).
    """
    from normfast.kernels import kernel_spec

    spec = kernel_spec(c["op"])
    key = {"bf16_dense": "bf16", "tf32_dense": "tf32", "fp32_fma": "fp32"}[spec.units(c)]
    names = {"bf16": "bf16 GEMM", "tf32": "tf32 GEMM", "fp32": "fp32 GEMM, TF32 off"}
    rate = ceilings["gemm"].get(key, {}).get("TFLOPs") if ceilings else None
    out = {"flops": n * cost["useful_flops"], "bytes": n * cost["hbm_bytes"], "compute_ceiling": names[key]}
    cfg = res.get("config")
    tiled = spec.cost(c, config=cfg) if cfg else {}
    if "l2_bytes" in tiled:
        out["l2_bytes"] = n * tiled["l2_bytes"]
    out.update(
        roofline(
            out["flops"], out["bytes"], rate, ceilings["copy"]["GBps"] if ceilings else None, res["kernel"]["p50_ms"]
        )
    )
    if out.get("l2_bytes") and ceilings and ceilings.get("l2_copy"):
        s = res["kernel"]["p50_ms"] / 1e3
        out["fraction_of_l2_bandwidth"] = out["l2_bytes"] / (ceilings["l2_copy"]["GBps"] * 1e9) / s
    out["speedup_vs_torch_path"] = res["torch_path"]["p50_ms"] / res["kernel"]["p50_ms"]
    return out


def head_stack_case(ctx: StageContext, c: dict[str, Any], ceilings: dict[str, Any] | None) -> dict:
    """The grouped form's stacked products, against the torch version of the same products."""
    import torch

    from normfast.core.reference import head_stack_errors, head_stack_reference
    from normfast.kernels import head_stack, kernel_spec
    from normfast.kernels.utils import last_config

    spec = kernel_spec(c["op"])

    dev = ctx.device
    n, d_in, d_out, k1, k2 = c["n"], c["d_in"], c["d_out"], c["k1"], c["k2"]
    dtype = getattr(torch, c["dtype"])
    tf32 = c["precision"] == "tf32"
    gen = torch.Generator(device=dev).manual_seed(zlib.crc32(case_label(c).encode()))
    da = d_in + 1
    A = torch.randn(n, d_in, device=dev, generator=gen)
    Z = (A @ torch.randn(d_in, d_out, device=dev, generator=gen) / d_in**0.5).to(dtype)
    A = A.to(dtype)
    G = 0.5 * torch.randn(1, d_out, da, device=dev, generator=gen) + torch.randn(
        k1, d_out, da, device=dev, generator=gen
    )
    F = torch.randn(k2, 2 * da, da, device=dev, generator=gen)
    S = F.transpose(1, 2) @ F / (2 * da)  # second moments: symmetric, PSD

    def fast():
        return head_stack(A, Z, G, S, has_bias=True, allow_tf32=tf32)

    def plain():  # what one writes in torch: one GEMM per stacked matrix, fp32
        return head_stack_reference(A.float(), Z.float(), G, S, has_bias=True)

    res: dict[str, Any] = dict(c, label=case_label(c))
    res.update(first_calls(ctx, fast))
    res["config"] = last_config("head_stack")
    got = fast()
    rows = slice(0, min(n, 4096 if ctx.gpu else n))
    args64 = (A[rows].double(), Z[rows].double(), G.double(), S.double())
    errors = head_stack_errors(
        [x[rows] for x in got], head_stack_reference(*args64, has_bias=True), *args64, has_bias=True
    )
    if dtype == torch.float32:
        tol = 5e-3 if tf32 else spec.allowed_error(torch.float32)
    else:
        plain_out = head_stack_reference(A[rows], Z[rows], G.to(dtype), S.to(dtype), has_bias=True)
        plain_err = head_stack_errors(plain_out, head_stack_reference(*args64, has_bias=True), *args64, has_bias=True)
        tol = spec.allowed_error(dtype, max(plain_err.values()))
    res["check"] = check_record(rows.stop, errors, tol)
    del got
    res["kernel"] = bench(ctx, fast)
    with tf32_matmul(tf32):
        plain()
        res["torch_path"] = bench(ctx, plain)
    res.update(kernel_roofline(res, spec.cost(c, n=n), n, c, ceilings))
    res["note"] = (
        "torch path: head_stack_reference in fp32 (one GEMM per stacked matrix, the "
        "products in memory); K1 = K2 = 5 is the grouped form at K = 4 groups "
        "(the probe's default K = 8 stacks 9 and 9)"
    )
    return res


def accumulate_case(ctx: StageContext, c: dict[str, Any], ceilings: dict[str, Any] | None) -> dict:
    import torch

    from normfast import ops
    from normfast.core.reference import brute_force_stats, stat_errors
    from normfast.kernels import kernel_spec
    from normfast.kernels.utils import last_config

    spec = kernel_spec(c["op"])

    dev = ctx.device
    n, d, k, branch = c["n"], c["dim"], c["k"], c["branch"]
    dtype = getattr(torch, c["dtype"])
    gen = torch.Generator(device=dev).manual_seed(zlib.crc32(case_label(c).encode()))

    def displacements():
        t = torch.randn(k, n, d, device=dev, generator=gen)
        t += 0.3 * torch.randn(1, n, d, device=dev, generator=gen)
        return t.to(dtype)

    t = displacements()
    t_w = displacements() if branch == "uw" else None
    z = (0.2 + torch.randn(n, d, device=dev, generator=gen)).to(dtype)
    fused = ops.ProbeAccumulator(n, d, branch=branch, device=dev, backend="triton")
    plain_acc = ops.ProbeAccumulator(n, d, branch=branch, device=dev, backend="torch")

    def fast():
        return fused.update(t, z, t_w=t_w)

    def plain():
        return plain_acc.update(t, z, t_w=t_w)

    res: dict[str, Any] = dict(c, label=case_label(c))
    res.update(first_calls(ctx, fast))
    res["config"] = last_config("accumulate")
    sub = min(n, 4096)
    ts, zs = t[:, :sub], z[:sub]
    tws = None if t_w is None else t_w[:, :sub]
    check = ops.ProbeAccumulator(sub, d, branch=branch, device=dev, backend="triton")
    got = check.update(ts, zs, t_w=tws).update(ts, zs, t_w=tws).finalize()
    both = torch.cat([ts, ts]).double()
    both_w = None if tws is None else torch.cat([tws, tws]).double()
    want = brute_force_stats(both, zs.double(), branch, both_w)
    keys = [key for key in ops.stat_names(branch) if not key.startswith("sign_stability")]
    errors = stat_errors({key: got[key] for key in keys}, want, keys)
    tol = spec.allowed_error(torch.float32)
    res["check"] = {
        "rows": sub,
        "reference": "float64 brute force on the same (rounded) inputs",
        "max_error": max(errors.values()),
        "errors": errors,
        "tolerance": tol,
        "passed": bool(max(errors.values()) <= tol),
    }
    del got, want, both, both_w, check
    res["kernel"] = bench(ctx, fast)
    plain()
    res["torch_path"] = bench(ctx, plain)
    # the fewest bytes one update moves (normfast.kernels.costs.accumulate_cost)
    nbytes = n * spec.cost(c)["hbm_bytes"]
    res["flops"], res["bytes"] = None, nbytes
    res["compute_ceiling"] = None
    res.update(roofline(0, nbytes, None, ceilings["copy"]["GBps"] if ceilings else None, res["kernel"]["p50_ms"]))
    res["note"] = "memory-bound by design: one read of the displacements per update"
    res["speedup_vs_torch_path"] = res["torch_path"]["p50_ms"] / res["kernel"]["p50_ms"]
    return res


def generic_case(ctx: StageContext, c: dict[str, Any], ceilings: dict[str, Any] | None) -> dict:
    """A kernel without a benchmark of its own: its launcher against its reference, on its record's example.

    The float64 truth is the reference on the inputs in float64; the torch
    path is the reference on the inputs as they are. The tolerance is the
    record's (low precision: against the reference's own error in that dtype).
    """
    import torch

    from normfast.core.reference import output_errors
    from normfast.kernels import kernel_spec
    from normfast.kernels.utils import last_config

    spec = kernel_spec(c["op"])
    if spec.example is None:
        raise ValueError(f"{spec.name}: its record lists GPU-check cases but no example to run them on")
    dtype = getattr(torch, c["dtype"])
    gen = torch.Generator(device=ctx.device).manual_seed(zlib.crc32(case_label(c).encode()))
    args = spec.example(c, ctx.device, gen)

    def fast():
        return spec.launcher(*args)

    def plain():
        return spec.reference(*args)

    res: dict[str, Any] = dict(c, label=case_label(c))
    res.update(first_calls(ctx, fast))
    res["config"] = last_config(spec.name)
    want = spec.reference(*(a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args))
    errors = output_errors(fast(), want)
    low = dtype not in (torch.float32, torch.float64)
    tol = spec.allowed_error(dtype, max(output_errors(plain(), want).values()) if low else None)
    res["check"] = check_record(c["n"], errors, tol)
    del want
    res["kernel"] = bench(ctx, fast)
    plain()
    res["torch_path"] = bench(ctx, plain)
    res.update(kernel_roofline(res, spec.cost(c, n=c["n"]), c["n"], c, ceilings))
    res["note"] = "torch path: the kernel's plain-torch reference on the same inputs"
    return res


#: The kernels whose GPU-check cases have a benchmark of their own (through ``normfast.ops``, against
#: the engine's torch path); every other registered kernel runs through :func:`generic_case`.
BENCHMARKS = {
    "head_stack": head_stack_case,
    "head_stats": partial(head_case, s_form=True),
    "project": partial(head_case, s_form=False),
    "accumulate": accumulate_case,
}


def kernels_stage(ctx: StageContext) -> dict[str, Any]:
    import torch

    ceilings = ctx.earlier("ceilings")
    res: dict[str, Any] = {
        "ceilings_used": None
        if ceilings is None
        else {
            "copy_GBps": ceilings["copy"]["GBps"],
            "gemm_TFLOPs": {k: v["TFLOPs"] for k, v in ceilings["gemm"].items()},
        },
        "cases": [],
        "skipped": [],
        "failed_checks": [],
    }
    ctx.partial = res
    # a case costs a few seconds: inputs, compilation, check, two timings
    need = 12.0 if ctx.gpu else 3.0
    for c in kernel_cases(ctx.gpu):
        label = case_label(c)
        if ctx.left() < need:
            res["skipped"].append({"case": label, "reason": f"budget ({ctx.left():.0f} s left)"})
            continue
        t0 = time.time()
        try:
            r = BENCHMARKS.get(c["op"], generic_case)(ctx, c, ceilings)
        except Exception as exc:  # noqa: BLE001 - one case fails, the others still run
            r = dict(
                c,
                label=label,
                error=f"{type(exc).__name__}: {str(exc)[:500]}",
                traceback=traceback.format_exc()[-1500:],
            )
            if ctx.gpu and not cuda_usable():
                # A sticky CUDA error poisons the process: end the stage, a fresh
                # worker takes the next one.
                res["cases"].append(r)
                ctx.save()
                raise
        r["seconds"] = round(time.time() - t0, 2)
        res["cases"].append(r)
        if "error" in r or not r["check"]["passed"]:
            res["failed_checks"].append(label)
        ctx.save()
        log("  " + kernel_line(r))
        if ctx.gpu:
            torch.cuda.empty_cache()
    return res


def kernel_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['label']}: {r['error']}"
    k, p = r["kernel"], r["torch_path"]
    rate = f"{r['TFLOPs']:.1f} TFLOP/s" if r.get("TFLOPs") else f"{r['GBps']:.0f} GB/s"
    frac = r.get("fraction_of_roofline")
    return (
        f"{r['label']}: {k['p50_ms']:.3f} ms [{k['p20_ms']:.3f}, {k['p80_ms']:.3f}], {rate}"
        + (f", {100 * frac:.0f}% of roofline ({r['bound_by']})" if frac else "")
        + f"; torch path {p['p50_ms']:.3f} ms ({r['speedup_vs_torch_path']:.2f}x); "
        f"max err {r['check']['max_error']:.1e}"
        + ("" if r["check"]["passed"] else " FAILED")
        + f"; first call {r['first_call_s']:.2f} s"
    )

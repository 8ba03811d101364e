"""The report: one line per stage, the summary block of the JSON, the markdown tables."""

from __future__ import annotations

import math
from typing import Any

from .common import ORDER


def stage_note(stage: str, entry: dict[str, Any]) -> str:
    res = entry.get("result") or {}
    if entry.get("status") == "skipped":
        return entry.get("reason", "")
    if entry.get("error"):
        return entry["error"].splitlines()[0][:200]
    if stage == "tests" and res.get("junit"):
        c = res["junit"]["counts"]
        return ", ".join(f"{v} {k}" for k, v in c.items() if v)
    if stage == "build":
        return "extension imports" if res.get("import_ok") else "extension does NOT import"
    if stage == "ceilings" and res.get("copy"):
        l2 = f"L2 copy {res['l2_copy']['GBps']:.0f} GB/s, " if res.get("l2_copy") else ""
        return f"copy {res['copy']['GBps']:.0f} GB/s, {l2}" + ", ".join(
            f"{k} {v['TFLOPs']:.1f} TFLOP/s" for k, v in res.get("gemm", {}).items()
        )
    if stage in ("kernels", "e2e") and res:
        done = len(res.get("cases", res.get("runs", [])))
        parts = [f"{done} {'cases' if stage == 'kernels' else 'runs'}"]
        if res.get("failed_checks"):
            parts.append(f"failed checks: {', '.join(res['failed_checks'])[:150]}")
        if res.get("skipped"):
            parts.append(f"{len(res['skipped'])} skipped for time")
        return "; ".join(parts)
    if stage == "env" and res:
        return str((res.get("gpu") or {}).get("name", res.get("device", "")))
    return entry.get("reason", "")


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    st = data["stages"]
    out: dict[str, Any] = {"status": {s: st[s]["status"] for s in ORDER}}
    ceil = (st["ceilings"].get("result") or {}) if st["ceilings"]["status"] == "ok" else {}
    if ceil:
        out["copy_GBps"] = ceil["copy"]["GBps"]
        out["gemm_TFLOPs"] = {k: v["TFLOPs"] for k, v in ceil["gemm"].items()}
        if ceil.get("l2_copy"):
            out["l2_copy_GBps"] = ceil["l2_copy"]["GBps"]
    kern = st["kernels"].get("result") or {}
    out["kernels"] = {
        c["label"]: {
            k: c.get(k)
            for k in ("fraction_of_roofline", "bound_by", "speedup_vs_torch_path", "fraction_of_l2_bandwidth", "config")
        }
        | {"p50_ms": c["kernel"]["p50_ms"], "check_passed": c["check"]["passed"]}
        for c in kern.get("cases", [])
        if "kernel" in c
    }
    runs = (st["e2e"].get("result") or {}).get("runs", {})
    out["e2e_tokens_per_s"] = {k: v.get("tokens_per_s") for k, v in runs.items()}
    return out


def fmt(x: Any, spec: str = ".3g") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return format(x, spec)


def markdown(data: dict[str, Any]) -> str:
    st = data["stages"]
    env = data.get("environment") or {}
    gpu = env.get("gpu", {})
    title = "# normfast GPU check"
    if data["dry_run"]:
        title += " (DRY RUN, CPU, tiny sizes: the numbers mean nothing)"
    lines = [
        title,
        "",
        f"{data['started']}; device {gpu.get('name', env.get('device', '?'))}; "
        f"torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, "
        f"transformers {env.get('transformers', '?')}, python {env.get('python', '?')}; "
        f"commit {str(data['source'].get('git_commit'))[:10]}; "
        f"{data.get('elapsed_s')} s of a {data['budget_s']:.0f} s budget.",
        "",
        "| stage | status | s | note |",
        "|---|---|---|---|",
    ]
    for s in ORDER:
        e = st[s]
        lines.append(f"| {s} | {e['status']} | {fmt(e.get('seconds'), '.1f')} | {stage_note(s, e).replace('|', '/')} |")
    ceil = st["ceilings"].get("result") or {}
    if ceil.get("copy"):
        l2 = ceil.get("l2_copy")
        lines += [
            "",
            "Ceilings (measured here, random data): copy "
            f"{fmt(ceil['copy']['GBps'], '.0f')} GB/s (read + write); "
            + (f"L2-resident copy {fmt(l2['GBps'], '.0f')} GB/s; " if l2 else "")
            + "GEMM "
            + ", ".join(f"{k} {fmt(v['TFLOPs'], '.1f')} TFLOP/s" for k, v in ceil.get("gemm", {}).items())
            + ".",
        ]
    cases = [c for c in (st["kernels"].get("result") or {}).get("cases", []) if "kernel" in c]
    if cases:
        lines += [
            "",
            "| kernel case | p50 ms [p20, p80] | achieved | bound by | of roofline "
            "| of L2 copy | torch path ms | speed-up | max err (tol) | first call s | tiles |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in cases:
            k = c["kernel"]
            rate = (
                f"{fmt(c.get('TFLOPs'), '.1f')} TFLOP/s, " if c.get("TFLOPs") else ""
            ) + f"{fmt(c.get('GBps'), '.0f')} GB/s"
            bound = c.get("bound_by", "–")
            if bound == "compute":
                bound += f" ({c['compute_ceiling']})"
            frac = c.get("fraction_of_roofline")
            frac = f"{100 * frac:.0f}%" if frac else "–"
            l2 = c.get("fraction_of_l2_bandwidth")
            l2 = f"{100 * l2:.0f}%" if l2 else "–"
            cfg = c.get("config") or {}
            tiles = "x".join(str(v) for k, v in cfg.items() if k.startswith("BLOCK_"))
            tiles += f", {cfg['num_warps']}w" if cfg else "–"
            lines.append(
                f"| {c['label']} | {fmt(k['p50_ms'], '.3f')} [{fmt(k['p20_ms'], '.3f')}, "
                f"{fmt(k['p80_ms'], '.3f')}] | {rate} | {bound} | {frac} | {l2} | "
                f"{fmt(c['torch_path']['p50_ms'], '.3f')} | "
                f"{fmt(c['speedup_vs_torch_path'], '.2f')}x | "
                f"{fmt(c['check']['max_error'], '.1e')} ({fmt(c['check']['tolerance'], '.0e')})"
                f"{'' if c['check']['passed'] else ' FAIL'} | {fmt(c['first_call_s'], '.2f')} | "
                f"{tiles} |"
            )
    e2e = st["e2e"].get("result") or {}
    if e2e.get("runs"):
        src = e2e["token_source"]
        src = src["bert"] if src["bert"] == src["minilm"] else f"BERT: {src['bert']}; MiniLM-sized: {src['minilm']}"
        lines += [
            "",
            f"End to end (token-level probe, {src}, {e2e['seq_len']} tokens per sequence, M={e2e['M']}, fp32):",
            "",
            "| run | tokens | s | tokens/s | vs plain forward |",
            "|---|---|---|---|---|",
        ]
        for name, r in e2e["runs"].items():
            note = "" if r.get("measured", True) else " (extrapolated)"
            lines.append(
                f"| {name}{note} | {r.get('tokens')} | {fmt(r.get('seconds'), '.2f')} | "
                f"{fmt(r.get('tokens_per_s'), ',.0f')} | "
                f"{fmt(r.get('vs_forward'), '.2f')} |"
            )
        ten = e2e["runs"].get("minilm_head_10M")
        if ten and not ten.get("measured"):
            lines += ["", f"10M tokens: {ten['note']}."]
    lines.append("")
    return "\n".join(lines)

"""The worker process: runs the Python stages one after the other, each under its time cap."""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any, Callable

from .common import CAPS, FLOORS, log, stage_timeout, write_json
from .context import StageContext
from .e2e import e2e_stage
from .kernel_stage import kernels_stage
from .stages import ceilings_stage, env_stage

STAGE_FUNCTIONS: dict[str, Callable[[StageContext], dict[str, Any]]] = {
    "env": env_stage,
    "ceilings": ceilings_stage,
    "kernels": kernels_stage,
    "e2e": e2e_stage,
}


def run_worker(args) -> int:
    import torch

    if args.dry_run:
        torch.set_num_threads(1)  # tiny CPU work: one thread is faster and steadier
    mode = "dry" if args.dry_run else "gpu"
    caps = dict(CAPS[mode])
    for item in args.stage_cap:
        name, _, seconds = item.partition("=")
        caps[name] = float(seconds)
    injected = dict(item.partition("=")[::2] for item in args.inject)
    results = Path(args.root) / "results"
    selected = args.selected.split(",")
    for stage in args.stages.split(","):
        now = time.time()
        timeout = stage_timeout(stage, selected, args.t_start, args.budget_s, caps, FLOORS[mode], now)
        if timeout < FLOORS[mode][stage]:
            write_json(
                results / f"{stage}.json",
                {"status": "skipped", "seconds": 0.0, "reason": f"budget: {max(timeout, 0):.0f} s left for it"},
            )
            continue
        write_json(results / "current.json", {"stage": stage, "started": now, "timeout": timeout})
        log(f"\n=== {stage} (up to {timeout:.0f} s)")
        ctx = StageContext(stage, now + timeout - 2.0, results, args.dry_run, args.tokens)
        try:
            if injected.get(stage) == "error":
                raise RuntimeError(f"injected failure in stage {stage!r} (--inject)")
            if injected.get(stage) == "hang":
                time.sleep(10 * timeout)
            result = STAGE_FUNCTIONS[stage](ctx)
        except Exception as exc:  # noqa: BLE001 - recorded; a fresh worker runs the next stage
            entry = {
                "status": "error",
                "seconds": round(time.time() - now, 2),
                "error": f"{type(exc).__name__}: {str(exc)[:1000]}",
                "traceback": traceback.format_exc()[-3000:],
                "result": ctx.partial or None,
            }
            write_json(results / f"{stage}.json", entry)
            log(f"=== {stage}: error ({entry['error'].splitlines()[0][:200]})")
            return 3
        failed = result.get("failed_checks") if isinstance(result, dict) else None
        entry = {"status": "failed" if failed else "ok", "seconds": round(time.time() - now, 2), "result": result}
        write_json(results / f"{stage}.json", entry)
        log(f"=== {stage}: {entry['status']} in {entry['seconds']:.1f} s")
    return 0


if __name__ == "__main__":  # the parent starts it: python -m bench.experiments.gpu_check.worker '<plan JSON>'
    import json
    import sys
    from types import SimpleNamespace

    sys.exit(run_worker(SimpleNamespace(**json.loads(sys.argv[1]))))

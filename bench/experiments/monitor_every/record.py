"""Protocol steps 2-5 of the monitor-every study: E1's training loop, the every-step rows of its window,
each candidate's rows made from them, and the law's fits."""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from bench.experiments.monitor_every.settings import R_MIN, SLOPE, TERMS, Config


def train_loop(name: str, cfg: Any, data: Any, steps: int, hook: Any) -> None:
    """E1's training loop (its batches, loss and optimizer); ``hook(step, opt, encoder)`` returns the
    monitor for that step (or None) before the first step it is to see."""
    import torch

    from bench.experiments.e1.data import VARIANT_SPECS, build_encoder, variant_optimizer
    from normfast import InfoNCE

    variant = VARIANT_SPECS[name]
    enc = build_encoder(variant, cfg, data)
    opt = variant_optimizer(variant, cfg, enc.parameters())
    objective = InfoNCE(temperature=cfg.temperature)
    pairs = torch.as_tensor(data.pairs)
    rng = np.random.default_rng(cfg.seed + 2)
    monitor = None
    for step in range(steps):
        idx = torch.as_tensor(rng.integers(0, len(pairs), cfg.batch_size))
        loss = objective.loss(enc(enc.prepare(pairs[idx, 0].tolist())), enc(enc.prepare(pairs[idx, 1].tolist())))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        monitor = hook(step, opt, enc) or monitor
        if monitor is not None:
            monitor.step(opt)  # before_step, opt.step(), after_step
        else:
            opt.step()
    if monitor is not None:
        monitor.close()


def record(name: str, cfg: Any, data: Any, folder: Path) -> tuple[Any, dict[str, Any]]:
    """Protocol step 2: the every-step rows of E1's window and the monitor's metadata."""
    from bench.experiments.e1.training import window_start
    from normfast import TrainingMonitor, read_metadata
    from normfast.data.io import read_parquet

    n = data.x.shape[0]
    start = window_start(cfg)

    def hook(step: int, opt: Any, enc: Any) -> Any:
        if step != start:
            return None
        return TrainingMonitor(enc, list(range(n)), every=1, average=False, out=folder, flush_every=500)

    with warnings.catch_warnings():  # heavy-ball: the shadow decay buffer is warm-started (protocol step 2)
        warnings.filterwarnings("ignore", "TrainingMonitor: the optimizer's momentum buffers", RuntimeWarning)
        train_loop(name, cfg, data, cfg.steps, hook)
    return read_parquet(folder / "monitor.parquet"), read_metadata(folder / "monitor.parquet")  # checksums verified


def candidate(table: Any, meta: dict[str, Any], every: int, average: bool) -> tuple[Any, dict[str, Any]]:
    """Protocol step 3: the rows a monitor at ``every`` (sampled or averaged) writes, from the every-step rows."""
    import pyarrow as pa

    table = table.sort_by([("step", "ascending"), ("item", "ascending")])
    n = int(meta["n_items"])
    steps = np.asarray(table["step"]).reshape(-1, n)[:, 0]
    keep = np.flatnonzero(steps % every == 0)
    out = table.take(pa.array((keep[:, None] * n + np.arange(n)).ravel()))
    if average:
        cols = {k: np.asarray(table[k]).reshape(-1, n) for k in TERMS}
        for k in TERMS:
            means = np.stack([cols[k][max(0, i - every + 1) : i + 1].mean(0) for i in keep])
            out = out.set_column(out.schema.get_field_index(k), k, pa.array(means.ravel()))
        counts = np.repeat([min(every, i + 1) for i in keep], n).astype(np.int64)
        out = out.set_column(out.schema.get_field_index("n_steps"), "n_steps", pa.array(counts))
    return out, {**meta, "every": every, "average": average, "recorded_steps": len(keep)}


def fits(table: Any, meta: dict[str, Any], cfg: Config, total: int) -> list[dict[str, Any]]:
    """Protocol steps 3-5 for one model and seed: every candidate at every window."""
    from normfast.engine.monitor import analyze_table

    rows = []
    candidates = [(e, False) for e in cfg.sampled] + [(e, True) for e in cfg.averaged]
    for every, average in candidates:
        rows_table, rows_meta = candidate(table, meta, every, average)
        for window in cfg.windows:
            r = analyze_table(rows_table, rows_meta, window=min(1.0, window / total))
            fit, st = r["fits"]["realized_law"], r["stationarity"]
            ok = SLOPE[0] <= fit["slope"] <= SLOPE[1] and fit["pearson_r"] >= R_MIN
            rows.append(
                {
                    "every": every,
                    "average": average,
                    "window_steps": window,
                    "recorded_in_window": r["window"]["recorded_steps"],
                    "slope": fit["slope"],
                    "pearson_r": fit["pearson_r"],
                    "meets_target": bool(ok),
                    "net_change_median": st["net_change_median"],
                    "balance_median": st["balance_median"],
                }
            )
    return rows


def unit(name: str, seed: int, cfg: Config) -> dict[str, Any]:
    """Protocol steps 2-5 for one model and seed."""
    import torch

    from bench.experiments.e1 import e1_setup

    e1cfg, data = e1_setup(cfg.size, seed)
    torch.manual_seed(seed)
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        table, meta = record(name, e1cfg, data, Path(tmp) / "every1")
    total = e1cfg.steps - int(e1cfg.steps * (1 - e1cfg.window))
    return {
        "model": name,
        "seed": seed,
        "monitored_steps": total,
        "lr": meta["lr"],
        "weight_decay": meta["weight_decay"],
        "rows": fits(table, meta, cfg, total),
        "seconds": round(time.perf_counter() - t1, 1),
    }

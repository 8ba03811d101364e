"""The pilot: candidate settings in a fixed order, health only; the first that passes is chosen."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, Sequence

import numpy as np
import torch

from bench.training.criteria import health
from bench.training.settings import HealthThresholds, TrainSettings
from bench.training.stationary import split_decay, train


def pilot(
    encoder: Any,
    pair_ids: np.ndarray,
    probe_items: Sequence[Any],
    base: TrainSettings,
    candidates: Sequence[dict[str, Any]],
    *,
    trained: str,
    no_decay: str | None,
    thresholds: HealthThresholds = HealthThresholds(),
    progress: bool = True,
    desc: str = "pilot",
) -> dict[str, Any]:
    """Train each candidate (``TrainSettings`` overrides, e.g. ``{"lr": .1, "weight_decay": 1e-2}``)
    in order from the same initial parameters, health only; stop at the first that passes.

    A candidate whose probe embeddings collapse is stopped there. Never computes the law's
    inputs or a fit. Returns the record: rule, criteria, fixed settings, every candidate's
    health and trajectory, the chosen one (None if none passed) and the times.
    """
    state = {n: p.detach().clone() for n, p in encoder.named_parameters()}
    results, chosen = [], None
    for overrides in candidates:
        with torch.no_grad():  # every candidate starts from the same parameters
            for n, p in encoder.named_parameters():
                p.copy_(state[n])
        s = replace(base, **overrides)
        groups = split_decay(encoder, trained, no_decay)
        label = " ".join(f"{k}={v}" for k, v in overrides.items())
        rec = train(
            encoder,
            pair_ids,
            probe_items,
            s,
            groups,
            stop_on_collapse=True,
            collapse_cosine=thresholds.collapse_cosine,
            progress=progress,
            desc=f"{desc} {label}",
        )
        h = health(rec, s, thresholds)
        results.append(
            {
                **overrides,
                "eta_times_lambda": s.lr * s.weight_decay,
                "steps": s.steps,
                "health": h,
                "train_seconds": round(rec.seconds, 1),
                "train_cpu_seconds": round(rec.cpu_seconds, 1),
                "trajectory": rec.trajectory,
            }
        )
        if h["passed"]:
            chosen = dict(overrides)
            break
    with torch.no_grad():
        for n, p in encoder.named_parameters():
            p.copy_(state[n])
    fixed = {k: v for k, v in asdict(base).items() if not any(k in c for c in candidates) and k not in ("probe_every",)}
    return {
        "rule": "candidates in the listed order; the first that passes (a), (b) and (c) is chosen; a "
        "candidate whose probe embeddings collapse is stopped there; no fit is computed",
        "criteria": thresholds.criteria_text(),
        "fixed": {**fixed, "trained": trained, "no_decay": no_decay, "probe_items": len(probe_items)},
        "candidates_declared": [dict(c) for c in candidates],
        "results": results,
        "chosen": chosen,
    }

"""E1 training: the run to equilibrium, its observed norms, its checkpoints and (optionally) its ledger.

One training run per variant, with torch's own optimizer. In the late window
(the last ``cfg.window`` of the steps) every item's norm is recorded every
``record_every`` steps, a checkpoint (parameters and, for AdamW, the
optimizer's bias-corrected ``v̂``) is kept every ``probe_every`` steps, and,
with ``ledger=True``, every step's realized change of every item's squared norm
is split into its terms (:class:`bench.experiments.e1.ledger.RealizedLedger`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from bench.experiments.e1.data import E1Config, SyntheticConcepts, Variant, build_encoder, variant_optimizer


@dataclass
class Checkpoint:
    step: int
    params: dict[str, torch.Tensor]
    second_moments: dict[str, torch.Tensor] | None


@dataclass
class TrainingRun:
    variant: Variant
    encoder: Any
    optimizer: torch.optim.Optimizer
    observed: np.ndarray  # [n_items] window-mean norm
    observed_halves: tuple[np.ndarray, np.ndarray]
    checkpoints: list[Checkpoint]
    losses: list[float]
    train_seconds: float
    ledger: Any = None  # RealizedLedger when asked for
    meter: dict[str, np.ndarray] | None = None  # dense trajectory statistics, own batch (TrajectoryMeter)
    meter_seconds: float = 0.0
    meter_fresh: dict[str, np.ndarray] | None = None  # the same along a fresh batch (protocol v3's meter)
    meter_fresh_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def window_start(cfg: E1Config) -> int:
    return int(cfg.steps * (1 - cfg.window))


def train(
    variant: Variant,
    cfg: E1Config,
    data: SyntheticConcepts,
    *,
    ledger: bool = False,
    meter: bool = True,
    fresh_meter: bool = True,
    progress: bool = True,
) -> TrainingRun:
    """Train the variant's encoder for ``cfg.steps`` steps; record the window (see the module docstring).

    ``meter``: at every step of the window, feed the update direction of the batch the
    step then takes (its gradient, before the step; AdamW: the optimizer's ``v̂`` as it
    stands) at the present state to a :class:`normfast.engine.trajectory.virtual.TrajectoryMeter`
    (drift, heat, curvature heat; κ every 10 steps): the dense trajectory average.
    ``fresh_meter``: also a second meter fed one fresh virtual batch per step (its own
    generator, independent of the training batches): protocol v3's dense meter, kept
    beside it. Neither touches the training's random stream.
    """
    from bench.experiments.e1.ledger import RealizedLedger
    from normfast.engine.directions import InfoNCE, adam_second_moments

    enc = build_encoder(variant, cfg, data)
    objective = InfoNCE(temperature=cfg.temperature)
    n_items = data.x.shape[0]
    opt = variant_optimizer(variant, cfg, enc.parameters())
    state_all = enc.prepare(list(range(n_items)))
    start = window_start(cfg)
    rng = np.random.default_rng(cfg.seed + 2)
    pairs_t = torch.as_tensor(data.pairs)
    realized = RealizedLedger(enc, state_all, variant, cfg) if ledger else None
    from bench.experiments.e1.data import probe_config
    from normfast.engine.trajectory import TrajectoryMeter

    def new_meter() -> TrajectoryMeter:
        return TrajectoryMeter(
            enc,
            list(range(n_items)),
            probe_config(variant, cfg, n_items, batches=cfg.M, drift_batches=cfg.drift_batches),
            curvature=True,
        )

    tracker = new_meter() if meter else None
    fresh_tracker = new_meter() if fresh_meter else None
    fresh = np.random.default_rng(cfg.seed + 3)
    params = list(enc.parameters())
    names = [n for n, _ in enc.named_parameters()]
    meter_seconds = fresh_seconds = 0.0
    observed: list[torch.Tensor] = []
    checkpoints: list[Checkpoint] = []
    losses: list[float] = []
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc=f"E1 {variant.name}: train", unit="step", disable=not progress, leave=False)
    for step in bar:
        idx = torch.as_tensor(rng.integers(0, len(pairs_t), cfg.batch_size))
        a = enc.prepare(pairs_t[idx, 0].tolist())
        b = enc.prepare(pairs_t[idx, 1].tolist())
        loss = objective.loss(enc(a), enc(b))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        in_window = step >= start
        metered = in_window and (tracker is not None or fresh_tracker is not None)
        sm = adam_second_moments(opt, enc) if metered and variant.optimizer == "adamw" else None
        kappa = (step - start) % 10 == 0
        if tracker is not None and in_window:  # the step's own batch, at the state before the step
            t1 = time.perf_counter()
            grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in zip(names, params)}
            tracker.add(tracker.direction(grads, sm), kappa=kappa)
            meter_seconds += time.perf_counter() - t1
        if fresh_tracker is not None and in_window:  # a fresh batch (v3)
            t1 = time.perf_counter()
            jdx = torch.as_tensor(fresh.integers(0, len(pairs_t), cfg.batch_size))
            fresh_loss = objective.loss(
                enc(enc.prepare(pairs_t[jdx, 0].tolist())), enc(enc.prepare(pairs_t[jdx, 1].tolist()))
            )
            grads = dict(zip(names, torch.autograd.grad(fresh_loss, params)))
            fresh_tracker.add(fresh_tracker.direction(grads, sm), kappa=kappa)
            fresh_seconds += time.perf_counter() - t1
        if realized is not None:
            realized.before_step(record=in_window)
        opt.step()
        if realized is not None:
            realized.after_step(record=in_window)
        losses.append(float(loss.detach()))
        if in_window:
            k = step - start
            if k % cfg.record_every == 0:
                with torch.no_grad():
                    observed.append(enc(state_all).norm(dim=-1))
            if k % cfg.probe_every == 0:
                second = adam_second_moments(opt, enc) if variant.optimizer == "adamw" else None
                checkpoints.append(Checkpoint(step, {n: p.detach().clone() for n, p in enc.named_parameters()}, second))
    train_seconds = time.perf_counter() - t0
    stacked = torch.stack(observed).double()
    half = len(observed) // 2
    return TrainingRun(
        variant,
        enc,
        opt,
        stacked.mean(0).numpy(),
        (stacked[:half].mean(0).numpy(), stacked[half:].mean(0).numpy()),
        checkpoints,
        losses,
        train_seconds,
        realized,
        tracker.statistics() if tracker is not None else None,
        meter_seconds,
        fresh_tracker.statistics() if fresh_tracker is not None else None,
        fresh_seconds,
    )


def load_checkpoint(encoder: Any, ck: Checkpoint) -> None:
    with torch.no_grad():
        for n, p in encoder.named_parameters():
            p.copy_(ck.params[n])

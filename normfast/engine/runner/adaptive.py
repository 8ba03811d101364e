"""Adaptive M: as many heat batches as the error bars need (``ProbeConfig.target_rse``).

The heat's relative standard error ``se(V2)/V2`` falls like ``1/sqrt(M)`` (its batch groups' part:
with the heat drawn by energy, the pool's own level error, which more heat batches cannot reduce,
joins ``se_V2`` in the table but not the rule).
Protocol: start from ``M = batches``; measure the rows of the first chunk of
probe items (the *pilot*: the same rows whatever the run's streaming,
resuming or sharding, so the M chosen depends only on the seed and the
arguments); while the ``target_quantile`` of their ``se(V2)/V2`` exceeds
``target_rse`` and ``M < max_batches``, grow M to
``min(max_batches, max(M + K, ceil_K(M · (q/target)²)))`` (``ceil_K``: the
next multiple of K, so the K groups stay balanced) with the next virtual
batches of the same seed, and measure again. The directions computed on the
way are kept when they fit the memory budget (head mode always), so nothing
is computed twice; otherwise the run streams them again in groups
(directions-outer). Sharded: rank 0 decides and every rank receives M and the
directions. The rounds (M, quantile) go into the run's metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from normfast.engine.directions.gradients import Directions
from normfast.engine.runner.state import ProbeRun
from normfast.engine.transmission.head.dispatch import head_mode_stats
from normfast.engine.transmission.head.inputs import head_inputs, prepared_head
from normfast.engine.transmission.jvp import Tail


@dataclass
class AdaptiveChoice:
    """The outcome: the chosen M, its directions (None: recompute them in groups) and the drift's."""

    M: int
    directions: Directions | None
    drift: Directions | None
    rounds: list[dict[str, float]]


def next_M(M: int, quantile_rse: float, target: float, groups: int, cap: int) -> int:
    """The M that the 1/sqrt(M) law says reaches ``target``, rounded up to a multiple of K, at least M + K."""
    want = M * (quantile_rse / target) ** 2 if math.isfinite(quantile_rse) else 2 * M
    want = int(math.ceil(want / groups)) * groups
    return int(min(cap, max(M + groups, want)))


def quantile_rse(se: torch.Tensor, v2: torch.Tensor, q: float) -> float:
    """The ``q`` quantile of ``se(V2)/V2`` over the rows where it is finite (inf when none is)."""
    rse = (se.double() / v2.double()).cpu().numpy()
    rse = rse[np.isfinite(rse)]
    return float(np.quantile(rse, q)) if rse.size else math.inf


def _concat(parts: Sequence[Directions]) -> Directions:
    first = parts[0]
    dirs = [d for p in parts for d in p.directions]
    losses = [x for p in parts for x in p.losses]
    stats = {b: v for p in parts for b, v in p.batch_stats.items()}
    unused = [n for n in first.unused if all(n in p.unused for p in parts)]
    return Directions(
        first.names,
        first.branch_of,
        dirs,
        first.decayed,
        losses,
        first.drift,
        first.second_moments,
        first.first_batch,
        stats,
        unused,
        first.heat,
    )


class _HeadPilot:
    def __init__(self, run: ProbeRun, items: Sequence[Any]):
        self.run = run
        _, front, rows = run.front(items)
        self.a, self.z = head_inputs(run.encoder, front, run.cut, rows)
        self.parts: list[Directions] = []

    def add(self, dirs: Directions) -> None:
        self.parts.append(dirs)

    def rse(self) -> float:
        run = self.run
        dirs = prepared_head(run.encoder, _concat(self.parts), dtype=run.acc_dtype, groups=run.groups)
        stats = head_mode_stats(self.a, self.z, dirs, branch=run.branch)
        sfx = "" if run.branch == "u" else "_w"
        return quantile_rse(stats["se_V2" + sfx], stats["V2" + sfx], run.config.target_quantile)


class _JvpPilot:
    def __init__(self, run: ProbeRun, items: Sequence[Any]):
        self.run = run
        _, self.front, self.rows = run.front(items)
        self.tail = Tail(run.encoder, run.names, run.cut, run.output)
        self.z = self.tail.primal(self.front, self.rows)
        self.acc = run.new_accumulator(self.z.shape[0], self.z.shape[-1])

    def add(self, dirs: Directions) -> None:
        self.run.jvp_update(self.acc, self.tail, self.front, self.rows, self.z, dirs)

    def rse(self) -> float:
        stats = self.acc.finalize()
        branch = self.run.branches[0]
        sfx = "" if branch == "u" else "_w"
        return quantile_rse(stats["se_V2" + sfx], stats["V2" + sfx], self.run.config.target_quantile)


def _choice_on_root(run: ProbeRun, pilot_items: Sequence[Any]) -> AdaptiveChoice:
    cfg = run.config
    K, target, cap = run.groups, float(cfg.target_rse), int(cfg.max_batches)
    first = run.fresh_directions(list(range(run.M)), run.plan.drift_from_mean)
    pilot = _HeadPilot(run, pilot_items) if run.mode == "head" else _JvpPilot(run, pilot_items)
    pilot.add(first)
    keep_limit = math.inf if run.mode == "head" else run.direction_group_for(cap)
    kept: list[Directions] | None = [first] if first.M <= keep_limit else None
    M, rounds = run.M, []
    while True:
        q = pilot.rse()
        rounds.append({"M": M, "quantile_rse": q})
        if q <= target or M >= cap:
            break
        M_next = next_M(M, q, target, K, cap)
        step = int(min(M_next - M, keep_limit))
        for lo in range(M, M_next, step):
            part = run.fresh_directions(list(range(lo, min(lo + step, M_next))), False)
            pilot.add(part)
            if kept is not None and M_next <= keep_limit:
                kept.append(part)
            else:
                kept = None
        M = M_next
    directions = _concat(kept) if kept is not None else None
    drift = first if run.plan.drift_from_mean else None
    return AdaptiveChoice(M, directions, drift, rounds)


def adaptive_choice(run: ProbeRun, pilot_items: Sequence[Any]) -> AdaptiveChoice:
    """Choose M (see the module docstring) on the probe items of the first chunk; sets ``run.M`` and
    ``run.adaptive``. A collective when sharded.

    A run with a direction store (a :class:`~normfast.engine.prober.Prober`'s) chooses M once, on the
    first call's first chunk, and every later call reuses that M and its directions."""
    store = run.store
    if store is not None and store.choice is not None:
        choice = store.choice
        run.M = choice.M
        if choice.directions is None and store.reader is not None and run.fits():
            choice.directions = run.all_directions()  # a saved artifact: read whole when it fits
        run.adaptive = dict(store.adaptive or {})
        return choice
    choice = _choose(run, pilot_items)
    if store is not None:
        store.choice, store.adaptive = choice, run.adaptive
    return choice


def _choose(run: ProbeRun, pilot_items: Sequence[Any]) -> AdaptiveChoice:
    cfg = run.config
    shard = run.shard
    if shard is None:
        choice = _choice_on_root(run, pilot_items)
    else:
        choice, failure = None, None
        if shard.is_root:
            try:
                choice = _choice_on_root(run, pilot_items)
            except Exception as exc:  # noqa: BLE001 - re-raised on every rank
                failure = exc
        shard.raise_if_root_failed(failure)
        header = shard.broadcast_object(
            None
            if choice is None
            else (choice.M, choice.rounds, choice.directions is not None, choice.drift is not None)
        )
        M, rounds, has_dirs, has_drift = header
        dirs = shard.share_directions(choice.directions if choice else None, run.device) if has_dirs else None
        if has_drift and dirs is None:
            drift = shard.share_directions(choice.drift if choice else None, run.device)
        else:
            drift = dirs if has_drift else None
        choice = AdaptiveChoice(M, dirs, drift, rounds)
        run.adopt_heat(dirs or drift)  # rank 0's heat draw on every rank
    run.M = choice.M
    final = choice.rounds[-1]
    run.adaptive = {
        "target_rse": cfg.target_rse,
        "target_quantile": cfg.target_quantile,
        "max_batches": cfg.max_batches,
        "M": choice.M,
        "quantile_rse": final["quantile_rse"],
        "reached": bool(final["quantile_rse"] <= cfg.target_rse),
        "rounds": choice.rounds,
        "pilot_items": len(pilot_items),
    }
    return choice

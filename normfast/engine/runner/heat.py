"""The heat's batches drawn from the drift's pool by their energy, in a probe run
(``ProbeConfig.heat_sampling="energy"``; the estimator: :mod:`normfast.engine.directions.sampling`).

:func:`resolve_heat_sampling` says which sampling runs (the plain draw where there is no pool to
draw from); :func:`sampled_directions` is the run's direction computation then: one pass over the
M_D drift batches (their group means, each batch's energy, AdamW's v̂), the draw, and the drawn
batches' gradients again, folded as ``sqrt(w) (p - p̄)``. ``run`` is the
:class:`~normfast.engine.runner.state.ProbeRun` (which calls these; not imported here, one way).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from normfast.engine.config import ProbePlan
from normfast.engine.directions.gradients import Directions
from normfast.engine.directions.sampling import draw_heat


def resolve_heat_sampling(plan: ProbePlan, branch: str) -> tuple[str, str | None]:
    """The heat's sampling that runs (``"energy"`` or ``"uniform"``) and, when it is not the one asked
    for, why (:attr:`ProbeConfig.heat_sampling`)."""
    if plan.config.heat_sampling == "uniform":
        return "uniform", None
    if not plan.drift_from_mean:
        return "uniform", "drift_batches=None: no pool of drift batches to draw the heat's from"
    if plan.batch_indices is not None:
        return "uniform", "batch_indices given: the heat's batches are the first M of them"
    if branch == "uw":
        return "uniform", "parameter groups of both optimizer branches: the cross term C_uw needs the plain draw"
    return "energy", None


def sampled_directions(run: Any, batch_ids: Sequence[int], with_drift: bool) -> Directions:
    """heat_sampling="energy": one pass over the M_D drift batches (their group means, each batch's
    energy, AdamW's v̂), the heat's draw from them by energy, then the drawn batches' gradients again
    (the same seeds: the same gradients), folded as ``sqrt(w) (p - p̄)`` (:mod:`~normfast.engine.
    directions.sampling`). ``batch_ids`` are draw indices; draw ``i`` is in group ``i mod K``."""
    cfg = run.config
    pool = run.pool if with_drift else None
    if (with_drift and pool is None) or run.heat_draw is None or run.pool_mean is None:
        pool = run.pool = run.directions_pass(
            run.batches, keep=0, drift_groups=run.groups, check_invariance=True, second_moments=run.given_v
        )
        if pool.second_moments:
            run.keep_second_moments(pool.second_moments)
        energy = np.array([pool.batch_stats[b][1] ** 2 for b in range(len(run.batches))])
        run.heat_draw = draw_heat(energy, run.plan.heat_draws, cfg.seed)
        drift = pool.drift
        run.pool_mean = {n: sum(c * m[n] for c, m in zip(drift.counts, drift.means)) / drift.M for n in run.names}
        if run.store is not None:
            run.store.heat_draw, run.store.pool_mean = run.heat_draw, run.pool_mean
    heat = _drawn(run, list(batch_ids)) if len(batch_ids) else None
    if pool is None:
        return heat
    if heat is None:
        return replace(pool, heat=run.heat_draw)
    return replace(
        heat,
        drift=pool.drift,
        second_moments=pool.second_moments,
        batch_stats={**pool.batch_stats, **heat.batch_stats},
        unused=pool.unused,
    )


def _drawn(run: Any, draw_ids: list[int]) -> Directions:
    """The folded directions of draws ``draw_ids`` (each drawn batch's gradient computed once)."""
    draw = run.heat_draw
    picks = [draw.batches[i] for i in draw_ids]
    distinct = sorted(set(picks))
    second = run.second_moments(run.estimated_v if "w" in run.branches else None)
    grads = run.directions_pass(
        [run.batches[b] for b in distinct], global_ids=distinct, check_invariance=False, second_moments=second
    )
    at = {b: j for j, b in enumerate(distinct)}
    folded = []
    for i, b in zip(draw_ids, picks):
        root = math.sqrt(draw.weights[i])
        g = grads.directions[at[b]]
        folded.append({n: (g[n] - run.pool_mean[n]).mul_(root) for n in run.names})
    return replace(
        grads, directions=folded, losses=[grads.losses[at[b]] for b in picks], first_batch=draw_ids[0], heat=draw
    )

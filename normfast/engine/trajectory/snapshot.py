"""The single-snapshot predictor: a stationary norm from one checkpoint (``r_eq_snapshot``).

Why the engine needs it
-----------------------
The law predicts the *time average* of the norm over a stationary stretch of
training. Its drift term ``D`` is what fails at a single snapshot: at one state
the drift's item-to-item pattern is dominated by where the trajectory happens
to be (E1: the per-item correlation of one checkpoint's drift with the window's
mean drift ranges from −0.65 to +0.72), while heat ``Q`` and damping ``κ`` are
stable. ``r_eq`` from one snapshot is therefore a prediction for a *trajectory
average* only when it is fed trajectory-averaged statistics; a user with one
pretrained checkpoint has none.

The predictor
-------------
The engine has what it needs to make a trajectory itself: the objective, the
pairs and the optimizer preset. From the snapshot it

1. continues a copy of the model for ``T`` virtual optimizer steps on the pair
   source (:func:`normfast.engine.trajectory.virtual.virtual_trajectory`; the caller's
   model is never modified), ``T`` = ``snapshot_relaxations`` relaxation times
   of ``R²``, ``T = relaxations / (2 η' λ κ̃)`` with ``η' = η/(1 − β)`` and
   ``κ̃`` the median κ at the snapshot, at least ``snapshot_min_steps`` and at
   most ``snapshot_max_steps`` (or exactly ``snapshot_steps``);
2. samples, at every step, the state's drift and heat along that step's own
   batch direction, κ every 10 steps, and the curvature heat (what the
   linearized step misses; :class:`~normfast.engine.trajectory.virtual.TrajectoryMeter`);
3. shrinks each item's trajectory-mean first-order drift term toward the
   items' linear regression of that term on the second-order (heat) term, by
   empirical Bayes (:func:`shrink`: the error variance from the two halves of
   the trajectory's blocks of 25 steps);
4. solves the law with the means: heat + curvature heat, the shrunk drift, κ.

Beside it the engine writes the continuation's own answer, ``norm_continued``:
the square root of the mean ``R²`` over the same ``T`` measured steps (the
norm the copy actually kept). On held-out models the two predict the observed
stationary norms about equally well (issue 25: ``r_eq_snapshot`` 0.99/0.99 SGD
and 1.14/0.98 AdamW, slope/r; ``norm_continued`` 0.97/0.99 and 0.94/0.99): the
law applied to the continuation adds no point-prediction power over simulating.
What it adds is the decomposition -- how much of each norm is heat, drift and
decay -- and law-based quantities to reason with; ``norm_continued`` is the
baseline it should be read against.

Its interval: the continuation's sums are also kept over ``SEGMENTS`` contiguous
segments (whole blocks; the last takes the remaining steps), and steps 3-4 are
redone with each segment left out in turn; the spread of those replicates gives a
delete-a-segment jackknife standard error of ``log r_eq_snapshot`` and a 95%
Student-t interval (``r_eq_snapshot_lo/hi``; the same for ``norm_continued``). It
is the continuation's sampling error only: segments half a relaxation time long
are not independent, and the law's bias is not in it (E1 reports the coverage).

In the law's per-step units (the radial-budget ledger's): first-order term
``2η'D`` and second-order term ``η'² Q / R²`` for SGD (heavy-ball: η' =
η/(1−β)); ``2ηR D_w`` and ``η² Q_w`` for AdamW.

Scope (validated; E1, ``python -m bench run e1``, protocol v3, the docs' "E1" page)
------------------------------------------------------------------
E1 chose this predictor before its fits were seen (candidate
``trajectory_shrunk_regression``) and confirmed it on a fresh seed: slope in
[0.85, 1.15] and Pearson r ≥ 0.93 on all four of SGD MLP without biases, with
biases, an embedding table and AdamW (β1 = 0.9). It assumes what the law
assumes -- the snapshot sits in a stationary regime of training with the given
preset, η and λ on a pair distribution like the pair source -- and, more
strongly than ``r_eq``, that the virtual continuation stays in that regime for
``T`` steps. It predicts the norm the item keeps *on average* under continued
training of that kind; it is not a statement about the snapshot's present norm.
When ``T`` is capped below the asked relaxations (``metadata["snapshot"]
["relaxations_covered"]``), the continuation has not forgotten the snapshot and
the prediction is outside the validated scope. Pooled output only (the
trajectory samples every probe item at every step: cost ~ ``T`` × (one
backward over a batch + two jvps over the probe set)).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from normfast.engine.config import ProbeConfig, ProbePlan, as_plan
from normfast.engine.trajectory.virtual import BLOCK

#: contiguous segments of the continuation for the intervals' delete-a-segment jackknife (fewer
#: when the continuation has fewer blocks)
SEGMENTS = 8

SCOPE = (
    "the stationary norm under continued training with this preset, η and λ on the pair source "
    "(validated in E1 on plain-SGD MLPs with and without biases, an embedding table and an AdamW MLP; "
    "outside that scope when the virtual trajectory covers fewer relaxation times than asked)"
)


@dataclass
class SnapshotPrediction:
    """The single-snapshot predictor's output, per probe item (pooled rows, in probe order)."""

    r_eq: np.ndarray  # the predicted stationary norm (NaN: no positive root)
    D: np.ndarray  # the shrunk trajectory drift (``D``; AdamW: ``D_w``)
    Q: np.ndarray  # the trajectory heat plus the curvature heat (``Q``; AdamW: ``Q_w``)
    kappa: np.ndarray  # κ averaged along the trajectory
    norm_continued: np.ndarray  # sqrt of the mean R² over the continuation's measured steps (the plain baseline)
    info: dict[str, Any]  # steps, relaxations covered, shrinkage, seconds, scope (for the metadata)
    trajectory: Any = None  # the :class:`~normfast.engine.trajectory.virtual.Trajectory` (its ``meter`` statistics)
    r_eq_lo: np.ndarray | None = None  # 95% interval of r_eq from the continuation's segments (jackknife)
    r_eq_hi: np.ndarray | None = None
    norm_continued_lo: np.ndarray | None = None  # the same for norm_continued
    norm_continued_hi: np.ndarray | None = None


def shrink(per_block: np.ndarray, prior: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
    """Empirical-Bayes shrinkage of the per-item mean of ``per_block`` ``[blocks, items]`` toward ``prior``.

    The error variance of an item's mean is estimated from the split halves of
    the blocks (``((h1 − h2)/2)²``, pooled over items); the spread of the true
    means around the prior is the spread of the observed means minus that
    error. Every item's mean moves toward its prior by the same factor
    ``w = τ² / (τ² + σ²)``.
    """
    mean = per_block.mean(0)
    h = per_block.shape[0] // 2
    if h == 0:
        return prior.copy(), {"weight": 0.0, "error_var": float("nan"), "signal_var": float("nan")}
    h1, h2 = per_block[:h].mean(0), per_block[per_block.shape[0] - h :].mean(0)
    err = float(np.mean((h1 - h2) ** 2 / 4))
    spread = float(np.mean((mean - prior) ** 2))
    signal = max(spread - err, 0.0)
    w = signal / (signal + err) if signal + err > 0 else 0.0
    return prior + w * (mean - prior), {"weight": w, "error_var": err, "signal_var": signal}


def task_terms(
    config: ProbeConfig, drift: np.ndarray, heat: np.ndarray, norm: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(first-order, second-order) task terms of ``R²``'s change per step, in long-run units."""
    eta = config.lr
    if config.optimizer == "adamw":
        return 2 * eta * norm * drift, eta**2 * heat
    s = 1.0 / (1.0 - config.momentum)
    return 2 * eta * s * drift, (eta * s) ** 2 * heat / norm**2


def relaxation_steps(config: ProbeConfig, kappa: np.ndarray) -> float:
    """One relaxation time of ``R²`` in steps, ``1 / (2 η' λ κ̃)`` (κ̃: the median κ)."""
    eta = config.lr / (1.0 - (config.momentum if config.optimizer == "sgd" else 0.0))
    k = float(np.median(kappa))
    if not (np.isfinite(k) and k > 0 and config.weight_decay > 0):
        raise ValueError(
            f"snapshot predictor: the median κ at the snapshot is {k:.3g} and λ = "
            f"{config.weight_decay}: decay has no radial grip here, so there is no relaxation "
            f"time to continue for (the regime check calls this 'not applicable'); pass "
            f"snapshot_steps explicitly to run the trajectory anyway"
        )
    return 1.0 / (2 * eta * config.weight_decay * k)


def trajectory_steps(config: ProbeConfig, kappa: np.ndarray, steps: int | None = None) -> tuple[int, float]:
    """``T`` and the relaxation times it covers: ``steps`` or ``config.snapshot_steps`` when given (NaN
    coverage where κ gives no relaxation time), else the rule, clipped to [min, max] steps."""
    explicit = steps if steps is not None else config.snapshot_steps
    if explicit is not None:
        try:
            return int(explicit), explicit / relaxation_steps(config, kappa)
        except ValueError:
            return int(explicit), float("nan")
    tau = relaxation_steps(config, kappa)
    steps = max(config.snapshot_min_steps, int(round(config.snapshot_relaxations * tau)))
    steps = min(steps, config.snapshot_max_steps)
    return steps, steps / tau


def snapshot_prediction(
    encoder: Any,
    probes: Sequence[Any],
    objective: Any,
    pairs: Any,
    config: ProbeConfig | ProbePlan,
    *,
    steps: int | None = None,
    second_moments: Mapping[str, torch.Tensor] | None = None,
    progress: bool = True,
) -> SnapshotPrediction:
    """The single-snapshot predictor for every probe item (see the module docstring).

    ``config`` sets the probed parameters, the virtual optimizer (preset, η, λ,
    momentum / betas, eps, ``no_decay``), the batch size, the trajectory's seed
    (``config.seed``) and ``T`` (``snapshot_*``; ``steps`` overrides them).
    ``second_moments``: AdamW's ``v̂`` at the snapshot (else estimated on
    virtual batches). The encoder is not modified. A probe's snapshot stage passes its
    :class:`~normfast.engine.config.ProbePlan` (checked by the probe's entry point, not again here);
    a ``ProbeConfig`` is checked here, once.
    """
    from normfast.engine.trajectory.virtual import TrajectoryMeter, virtual_trajectory

    plan = as_plan(config)
    config = plan.config
    probes = list(probes)
    t0 = time.perf_counter()
    # the meter refuses more than one optimizer preset, and reads κ at the snapshot
    kappa0 = TrajectoryMeter(encoder, probes, plan).kappa()
    explicit = steps is not None or config.snapshot_steps is not None
    steps, covered = trajectory_steps(config, kappa0, steps)
    if steps < 2 * BLOCK:
        raise ValueError(
            f"snapshot_prediction: the virtual trajectory needs at least {2 * BLOCK} steps (two "
            f"blocks of {BLOCK} for the drift's error variance), got {steps}"
        )
    segments = min(SEGMENTS, steps // BLOCK)
    traj = virtual_trajectory(
        encoder,
        probes,
        objective,
        pairs,
        plan,
        steps=steps,
        curvature=True,
        segments=segments,
        second_moments=second_moments,
        progress=progress,
    )
    m = traj.meter
    r_eq, drift, heat, info = _law(config, m)
    norm_continued = np.asarray(m["norm_rms"], dtype=np.float64)
    # the interval: the whole predictor (regression and shrinkage included) recomputed without each
    # segment of the continuation in turn
    with np.errstate(divide="ignore", invalid="ignore"):
        r_lo, r_hi = _interval(np.log(r_eq), [np.log(_law(config, rep)[0]) for rep in m["jackknife"]])
        c_lo, c_hi = _interval(np.log(norm_continued), [np.log(rep["norm_rms"]) for rep in m["jackknife"]])
    info = {
        "steps": int(steps),
        "relaxations_asked": None if explicit else config.snapshot_relaxations,
        "relaxations_covered": covered,
        "kappa_median_at_snapshot": float(np.median(kappa0)),
        "shrinkage": info,
        "interval_segments": segments,
        "rows_heat_negative": int(np.sum(heat < 0)),
        "rows_kappa_nonpositive": int(np.sum(m["kappa"] <= 0)),
        "rows_no_root": int(np.sum(~np.isfinite(r_eq))),
        "seconds": round(time.perf_counter() - t0, 1),
        "scope": SCOPE,
    }
    return SnapshotPrediction(
        r_eq,
        drift,
        heat,
        m["kappa"],
        norm_continued,
        info,
        traj,
        np.exp(r_lo),
        np.exp(r_hi),
        np.exp(c_lo),
        np.exp(c_hi),
    )


def _law(config: ProbeConfig, m: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, float]]:
    """``r_eq_snapshot`` from a trajectory's statistics: shrink each item's first-order drift term toward
    the items' regression of it on the heat term, then solve the law with heat + curvature heat and κ."""
    from normfast.core.equilibrium import equilibrium_norm

    adam = config.optimizer == "adamw"
    dcol, qcol, ccol = ("D_w", "Q_w", "Q_curv_w") if adam else ("D", "Q", "Q_curv")
    t1_blocks = np.stack([task_terms(config, b, m[qcol], m["norm"])[0] for b in m[f"{dcol}_blocks"]])
    t1_mean, t2_mean = task_terms(config, m[dcol], m[qcol], m["norm"])
    slope, intercept = np.polyfit(t2_mean, t1_mean, 1)
    shrunk, info = shrink(t1_blocks, intercept + slope * t2_mean)
    scale = t1_mean / np.where(m[dcol] != 0, m[dcol], 1.0)  # per-step term per unit drift
    drift = shrunk / scale
    heat = m[qcol] + m[ccol]
    law = dict(lr=config.lr, weight_decay=config.weight_decay)
    with warnings.catch_warnings():
        # a negative heat + curvature heat or κ <= 0 is a per-row fact: counted into the info, not warned
        warnings.filterwarnings("ignore", message=r"equilibrium_coefficients: ", category=RuntimeWarning)
        if adam:
            r_eq = equilibrium_norm(None, None, m["kappa"], D_w=drift, Q_w=heat, **law)
        else:
            r_eq = equilibrium_norm(drift, heat, m["kappa"], momentum=config.momentum, **law)
    info = dict(info, regression_slope=float(slope), regression_intercept=float(intercept))
    return np.asarray(r_eq, dtype=np.float64), drift, heat, info


def _interval(full: np.ndarray, replicates: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """95% interval around ``full`` from G delete-one replicates (the probe's own jackknife helpers)."""
    from normfast.engine.estimators.uncertainty import interval, jackknife_se

    return interval(full, jackknife_se(np.stack(replicates, -1)), len(replicates) - 1)

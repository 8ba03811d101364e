"""E1, the controlled equilibrium experiment behind ``normfast validate``.

Small encoders are trained on a scale-invariant InfoNCE objective over
synthetic concepts of varying ambiguity until their embedding norms are
stationary; the engine's prediction of each item's equilibrium norm is then
compared with the norm the item actually keeps. ``--ledger`` adds the
radial-budget ledger: every step's realized change of every item's squared
norm, split into its terms, beside the engine's estimates of the same terms.

Protocol (v4; fixed before any fit of this version was computed; v3 fed the
dense meter of step 3 a fresh batch instead of the step's own; v2 was v3
without the dense estimator, the curvature heat and the snapshot candidates):

1. train for ``steps`` steps with torch's own optimizer on batches drawn from
   a fixed pool of pairs;
2. over the late window (the last ``window`` fraction of steps) record every
   item's norm every ``record_every`` steps and average -> observed norm;
3. trajectory average, dense (the headline): at every step of the window
   sample the state's drift, heat and curvature heat along the update
   direction of the batch the training step then takes (its gradient before
   the step; AdamW: the optimizer's v̂ as it stands)
   (:class:`normfast.engine.trajectory.TrajectoryMeter`; κ every 10 steps);
   solve the corrected law (heat + curvature heat,
   :mod:`normfast.core.equilibrium`) with the window means; also without the
   curvature heat, and heat-only; beside it, v3's dense meter (one fresh
   virtual batch per step from its own generator, independent of the training
   batches), corrected law; the target is read on the own-batch meter.
   Why the step's own batch: both are one-batch samples of the same state
   statistics, but the own-batch samples are the terms that actually moved
   the norms (``python -m bench run e1_adamw``: every AdamW run metered along
   its own batch fits, the same run metered along a fresh batch misses);
4. trajectory average, checkpoints: at checkpoints every ``probe_every`` steps
   run the engine (``normfast.engine.probe``, jvp mode over all parameters,
   virtual batches from the same pool, same batch size, lr, weight decay and
   optimizer preset; for AdamW the optimizer's own ``v̂``; a different seed
   per checkpoint): heat from ``M`` batches, drift from the mean update
   direction over ``drift_batches`` batches; average D, Q and κ (``D_w``,
   ``Q_w``) over the checkpoints and solve the law (full and heat-only), and
   from the last checkpoint alone;
5. single snapshot: the candidates of :data:`.snapshot.SNAPSHOT_PROTOCOL`,
   from the window's last checkpoint only;
6. every predictor: the log-log slope and Pearson r of observed against
   predicted; target for every variant: slope in [0.85, 1.15], r >= 0.93;
7. ledger (``--ledger``): per item and step in the window, ``R'² − R²``
   split into first-order task, second-order task, decay and remainder
   (:mod:`normfast.apps.validate.ledger`), averaged over the window; beside
   each, the engine's estimate of the same term (a) averaged over the
   checkpoints, (b) from the last checkpoint; per term the ratio of means
   (realized / estimated) and the per-item Pearson r.

Why dense: at a checkpoint the drift's batch noise over 64 batches is only
0.1-0.5 of its fluctuation along the window, and that fluctuation
decorrelates within ~20 steps (``python -m bench run e1_drift``): the time
average needs many states, not many batches per state.

Variants (``data.VARIANT_SPECS``): a 2-layer ReLU MLP without biases (κ = 2
exactly), the same with biases, a free embedding table (κ = 1, D = 0: the
classic weight-norm equilibrium), all with SGD (lr 0.01, wd 0.05); the
bias-free MLP with AdamW (lr 1e-3, wd 0.05) at β1 = 0.9 and at β1 = 0; and the
bias-free MLP with heavy-ball SGD (momentum 0.9, lr 1e-3, torch's coupled
weight decay), which tests the law's ``η -> η/(1−β)`` momentum rule.

Layout: :mod:`.data` (concepts, encoders, optimizers), :mod:`.training` (the
run, its checkpoints, the dense meter), :mod:`.ledger` (the realized terms and the engine's
estimates of them), :mod:`.laws` (probing the checkpoints, solving the laws),
:mod:`.snapshot` (the single-snapshot candidates),
:mod:`.experiment` (one run per variant, the JSON), :mod:`.report` (figures,
printed tables), :mod:`.cli` (the command).
"""
from __future__ import annotations

from normfast.apps.validate.cli import validate_arguments, validate_main
from normfast.apps.validate.data import (E1Config, SyntheticConcepts, VARIANT_SPECS, VARIANTS, Variant,
                                         build_encoder, make_concepts)

validate_description = __doc__ + """
Writes equilibrium.json and equilibrium.png (with --ledger also ledger.json and ledger.png) to --out
(default runs/validate; the committed results are produced with --out bench/results)."""


def run(*args, **kwargs):
    """:func:`normfast.apps.validate.experiment.run` (imported on use: it pulls in the engine)."""
    from normfast.apps.validate.experiment import run as _run

    return _run(*args, **kwargs)


__all__ = ["E1Config", "SyntheticConcepts", "Variant", "VARIANTS", "VARIANT_SPECS", "build_encoder",
           "make_concepts", "run", "validate_arguments", "validate_description", "validate_main"]

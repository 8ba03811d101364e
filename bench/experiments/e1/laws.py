"""E1's predictions: the engine at every checkpoint, the laws solved from its statistics, the fits.

* trajectory average: D, Q, κ (``D_w``, ``Q_w`` for AdamW) averaged over the
  checkpoints of the window, then the law solved once -> the full law and the
  heat-only law (``D = 0``);
* last checkpoint: the same from the window's last checkpoint alone;
* with the ledger: the law solved from the *realized* terms (the check that the
  realized balance closes) and the per-term comparison of the engine's
  estimates with the realized terms (:mod:`bench.experiments.e1.ledger`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
from tqdm.auto import tqdm

from bench.experiments.e1.data import E1Config, SyntheticConcepts, Variant, probe_config
from bench.experiments.e1.training import TrainingRun, load_checkpoint

#: the E1 target for every variant: log-log slope of observed on predicted, and Pearson r
TARGET_SLOPE = (0.85, 1.15)
TARGET_R = 0.93

STAT_COLUMNS = (
    "norm",
    "D",
    "Q",
    "D_w",
    "Q_w",
    "kappa",
    "V2",
    "V2_w",
    "m2",
    "m2_w",
    "se_D",
    "se_D_w",
    "r_eq",
    "r_eq_heat",
)


def law_norms(
    variant: Variant,
    stats: dict[str, np.ndarray],
    cfg: E1Config,
    *,
    heat_only: bool = False,
    lr: float | None = None,
    momentum: float | None = None,
) -> np.ndarray:
    """Solve the equilibrium law for per-item statistics (``D``/``Q`` or ``D_w``/``Q_w``, ``kappa``).

    ``lr``, ``momentum``: override the variant's (default: the run's own).
    """
    from normfast.core.equilibrium import equilibrium_norm

    law = dict(lr=variant.lr(cfg) if lr is None else lr, weight_decay=cfg.weight_decay)
    kap = stats["kappa"]
    zero = np.zeros_like(kap)
    if variant.optimizer == "adamw":
        return equilibrium_norm(None, None, kap, D_w=zero if heat_only else stats["D_w"], Q_w=stats["Q_w"], **law)
    beta = variant.momentum if momentum is None else momentum
    return equilibrium_norm(zero if heat_only else stats["D"], stats["Q"], kap, momentum=beta, **law)


@dataclass
class ProbedRun:
    average: dict[str, np.ndarray]  # statistics averaged over the checkpoints
    last: dict[str, np.ndarray]  # the last checkpoint's statistics
    est_average: dict[str, np.ndarray] | None  # ledger terms, averaged over checkpoints
    est_last: dict[str, np.ndarray] | None
    per_checkpoint_drift: np.ndarray  # [checkpoints, items] D (SGD) or D_w (AdamW)
    seconds: float


def probe_checkpoints(run: TrainingRun, cfg: E1Config, data: SyntheticConcepts, *, progress: bool = True) -> ProbedRun:
    """Run the engine at every checkpoint of the window (a different seed per checkpoint)."""
    from bench.experiments.e1.ledger import estimated_terms
    from normfast import probe
    from normfast.data.pairs import PairSource
    from normfast.engine.directions import InfoNCE

    variant = run.variant
    enc = run.encoder
    n_items = data.x.shape[0]
    items = list(range(n_items))
    pairs = PairSource.from_iterable([(int(a), int(b)) for a, b in data.pairs])
    objective = InfoNCE(temperature=cfg.temperature)
    pcfg = probe_config(variant, cfg, n_items, batches=cfg.M, drift_batches=cfg.drift_batches)
    drift_col = "D_w" if variant.optimizer == "adamw" else "D"
    sums: dict[str, np.ndarray] = {}
    est_sums: dict[str, np.ndarray] = {}
    drifts = []
    last: dict[str, np.ndarray] = {}
    est_last = None
    t0 = time.perf_counter()
    cks = run.checkpoints
    for ci, ck in enumerate(
        tqdm(cks, desc=f"E1 {variant.name}: probe", unit="ckpt", disable=not progress, leave=False)
    ):
        load_checkpoint(enc, ck)
        res = probe(
            enc,
            items,
            objective,
            pairs,
            replace(pcfg, seed=cfg.seed * 7919 + ci),
            progress=False,
            second_moments=ck.second_moments,
            model_name=f"E1-{variant.name}",
        )
        cols = {c: res.column(c) for c in STAT_COLUMNS if c in res.table.column_names}
        for c, v in cols.items():
            sums[c] = sums.get(c, 0) + v
        drifts.append(cols[drift_col])
        est = estimated_terms(
            variant.optimizer, cols, lr=variant.lr(cfg), weight_decay=cfg.weight_decay, momentum=variant.momentum
        )
        for k, v in est.items():
            est_sums[k] = est_sums.get(k, 0) + v
        if ci == len(cks) - 1:
            last, est_last = cols, est
    n = len(cks)
    return ProbedRun(
        {k: v / n for k, v in sums.items()},
        last,
        {k: v / n for k, v in est_sums.items()},
        est_last,
        np.stack(drifts),
        time.perf_counter() - t0,
    )


def realized_law(
    variant: Variant, cfg: E1Config, means: dict[str, np.ndarray], *, with_remainder: bool = True
) -> np.ndarray:
    """The law solved with coefficients read off the realized window-mean terms
    (:func:`normfast.engine.monitor.realized.realized_law`, at the variant's η, λ and momentum).

    If the realized terms are complete and the window stationary, the law's root is the
    observed norm whatever the law's assumed scaling with R; ``with_remainder=False`` shows
    what leaving the curvature remainder out does.
    """
    from normfast.engine.monitor import realized_law as solve

    return solve(
        means,
        adamw=variant.optimizer == "adamw",
        lr=variant.lr(cfg),
        weight_decay=cfg.weight_decay,
        momentum=variant.momentum,
        with_remainder=with_remainder,
    )

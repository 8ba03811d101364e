"""Stage 3 of a probe: per-probe statistics from displacements, with their error bars.

* :mod:`.statkeys` -- what every estimator's statistic dict holds (names per branch, row codes);
* :mod:`.accumulator` -- :class:`ProbeAccumulator`, streaming and mergeable (Welford/Chan);
* :mod:`.grouped` -- :class:`GroupedAccumulator`, the same over K batch groups with error bars;
* :mod:`.drift` -- the drift from the mean direction over its own M_D batches;
* :mod:`.uncertainty` -- the shared group partition, jackknife and intervals (R_eq's included).

The closed form of a linear head computes the same dict without displacements
(:mod:`normfast.engine.transmission.head`).
"""

from normfast.engine.estimators.accumulator import ProbeAccumulator
from normfast.engine.estimators.drift import drift_from_groups
from normfast.engine.estimators.grouped import GroupedAccumulator
from normfast.engine.estimators.statkeys import REASONS, STAT_KEYS, UNCERTAINTY_KEYS, stat_names
from normfast.engine.estimators.uncertainty import (
    CONFIDENCE,
    DEFAULT_GROUPS,
    effective_groups,
    equilibrium_intervals,
    group_counts,
    interval,
    jackknife_se,
    t_quantile,
)

__all__ = [
    "CONFIDENCE",
    "DEFAULT_GROUPS",
    "GroupedAccumulator",
    "ProbeAccumulator",
    "REASONS",
    "STAT_KEYS",
    "UNCERTAINTY_KEYS",
    "drift_from_groups",
    "effective_groups",
    "equilibrium_intervals",
    "group_counts",
    "interval",
    "jackknife_se",
    "stat_names",
    "t_quantile",
]

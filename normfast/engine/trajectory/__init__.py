"""Beyond one snapshot: virtual training continued from the model, and what it predicts.

* :mod:`.virtual` -- a copy of the model trained on the pair source, probed along the way
  (:func:`virtual_trajectory`, the dense :class:`TrajectoryMeter`);
* :mod:`.snapshot` -- the single-snapshot predictor ``r_eq_snapshot`` built on such a continuation;
* :mod:`.curvature` -- the curvature heat that the law's linearization of a step misses.
"""

from normfast.engine.trajectory.curvature import curvature_heat
from normfast.engine.trajectory.snapshot import (
    SnapshotPrediction,
    relaxation_steps,
    shrink,
    snapshot_prediction,
    task_terms,
)
from normfast.engine.trajectory.virtual import Trajectory, TrajectoryMeter, start_adam, virtual_trajectory

__all__ = [
    "shrink",
    "task_terms",
    "SnapshotPrediction",
    "Trajectory",
    "TrajectoryMeter",
    "curvature_heat",
    "relaxation_steps",
    "snapshot_prediction",
    "start_adam",
    "virtual_trajectory",
]

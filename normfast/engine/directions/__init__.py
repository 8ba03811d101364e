"""Stage 1 of a probe: virtual batches -> update directions ``p_B`` over the probed parameters.

* :mod:`.objectives` -- the scale-invariant virtual objectives (InfoNCE, CLIP, SupCon, SimCSE) and
  the check that a loss ignores the embedding norm;
* :mod:`.presets` -- how an optimizer maps a gradient to an update direction (``sgd``: the
  scale-invariant branch ``u``; ``adamw``: the scale-free branch ``w``);
* :mod:`.gradients` -- the probed parameters, the batch gradients, AdamW's second moments, and the
  M heat directions plus the drift's group means (:class:`Directions`).
"""

from normfast.engine.directions.gradients import (
    Directions,
    DriftMeans,
    NonFiniteLoss,
    adam_second_moments,
    batch_loss,
    compute_directions,
    decayed_parameters,
    estimate_second_moments,
    iter_gradients,
    resolve_parameters,
)
from normfast.engine.directions.objectives import (
    CLIPLoss,
    InfoNCE,
    Objective,
    SimCSE,
    SupCon,
    check_scale_invariance,
    get_objective,
    objective_settings,
)
from normfast.engine.directions.presets import PRESETS, OptimizerPreset

__all__ = [
    "CLIPLoss",
    "Directions",
    "DriftMeans",
    "InfoNCE",
    "NonFiniteLoss",
    "Objective",
    "OptimizerPreset",
    "PRESETS",
    "SimCSE",
    "SupCon",
    "adam_second_moments",
    "batch_loss",
    "check_scale_invariance",
    "compute_directions",
    "decayed_parameters",
    "estimate_second_moments",
    "get_objective",
    "iter_gradients",
    "objective_settings",
    "resolve_parameters",
]

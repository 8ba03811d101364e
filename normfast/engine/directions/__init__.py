"""Stage 1 of a probe: virtual batches -> update directions ``p_B`` over the probed parameters.

* :mod:`.objectives` -- the scale-invariant virtual objectives (InfoNCE, CLIP, SupCon, SimCSE) and
  the check that a loss ignores the embedding norm;
* :mod:`.presets` -- how an optimizer maps a gradient to an update direction (``sgd``: the
  scale-invariant branch ``u``; ``adamw``: the scale-free branch ``w``);
* :mod:`.parameters` -- the probed parameters, AdamW's second moments of a live optimizer;
* :mod:`.gradients` -- the batch gradients, AdamW's estimated second moments, and the M heat
  directions plus the drift's group means (:class:`Directions`);
* :mod:`.sampling` -- the heat's batches drawn from the drift's by their energy, and their weights.
"""

import importlib
from typing import Any

# name -> the sub-module defining it; imported on first use, so that reading the objectives'
# registry (``normfast probe --help``) does not import torch through the gradients
_LAZY = {
    **dict.fromkeys(
        (
            "Directions",
            "DriftMeans",
            "NonFiniteLoss",
            "batch_loss",
            "compute_directions",
            "decayed_parameters",
            "estimate_second_moments",
            "iter_gradients",
        ),
        "gradients",
    ),
    **dict.fromkeys(
        (
            "CLIPLoss",
            "InfoNCE",
            "Objective",
            "SimCSE",
            "SupCon",
            "check_scale_invariance",
            "get_objective",
            "objective_settings",
        ),
        "objectives",
    ),
    **dict.fromkeys(("adam_second_moments", "last_layer_pattern", "resolve_parameters"), "parameters"),
    **dict.fromkeys(("PRESETS", "OptimizerPreset"), "presets"),
    **dict.fromkeys(("HeatDraw", "draw_heat", "heat_proposal", "pool_level_se"), "sampling"),
}

__all__ = [
    "CLIPLoss",
    "Directions",
    "DriftMeans",
    "HeatDraw",
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
    "draw_heat",
    "estimate_second_moments",
    "get_objective",
    "heat_proposal",
    "iter_gradients",
    "last_layer_pattern",
    "objective_settings",
    "pool_level_se",
    "resolve_parameters",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value

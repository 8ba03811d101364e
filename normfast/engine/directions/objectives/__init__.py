"""Virtual objectives: scale-invariant contrastive losses that only produce update directions.

Every objective here depends on the embeddings only through their directions
(each row is L2-normalized before anything else), so rescaling a row by a
positive factor leaves the loss unchanged. The equilibrium law relies on that:
it is what makes the gradient orthogonal to ``z`` and shrink like ``1/R``.
:func:`check_scale_invariance` tests the property numerically for objectives
users bring themselves.

An objective declares what a virtual batch must hold (``needs``):

``"pairs"``
    ``(anchors, positives)``; ``loss(za, zb)`` with row ``i`` of ``za`` and ``zb``
    a positive pair (InfoNCE, CLIP).
``"labels"``
    ``(items, labels)``; ``loss(za, labels=labels)`` (supervised contrastive).
``"items"``
    items only; the engine encodes them twice with dropout active
    (``uses_dropout``) and passes the two views as ``za, zb`` (SimCSE).

and everything else the code needs to know about it (:mod:`.base`: its settings with their
command-line flags, its chance level and what "saturated" means for it, whether a second encoder
encodes its positives). One module per objective, each registering its class when imported; the
imports below are the registry's order, which is the command line's and the docs' order.
"""

from normfast.engine.directions.objectives.base import (
    LOG_B,
    NEEDS,
    SATURATED_BELOW,
    Chance,
    Objective,
    Setting,
    get_objective,
    objective_class,
    objective_classes,
    objective_settings,
    register,
    temperature,
    unregister,
)
from normfast.engine.directions.objectives.invariance import check_scale_invariance

# isort: off
# Importing an objective's module registers it; the order of these imports is the registry's, the
# order the command line and the docs list the objectives in.
from normfast.engine.directions.objectives.simcse import SimCSE
from normfast.engine.directions.objectives.infonce import InfoNCE
from normfast.engine.directions.objectives.clip import CLIPLoss
from normfast.engine.directions.objectives.supcon import SupCon

# isort: on

__all__ = [
    "CLIPLoss",
    "Chance",
    "InfoNCE",
    "LOG_B",
    "NEEDS",
    "Objective",
    "SATURATED_BELOW",
    "Setting",
    "SimCSE",
    "SupCon",
    "check_scale_invariance",
    "get_objective",
    "objective_class",
    "objective_classes",
    "objective_settings",
    "register",
    "temperature",
    "unregister",
]

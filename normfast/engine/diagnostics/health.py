"""The virtual objective's health: is there a task left for the virtual batches to push on?

Every virtual batch gives the objective's value and a gradient over the probed parameters.
What "no task left" means is the objective's own fact (it declares it:
:mod:`normfast.engine.directions.objectives.base`). A softmax contrastive loss (InfoNCE, SimCSE,
CLIP, SupCon) starts near its *chance level* -- ``log(batch_size)``, a uniform guess among a
batch's candidates -- and falls towards 0 as the model tells every positive from every in-batch
negative. Near 0 the softmax is saturated: its gradient, and with it the drift and the heat the
law balances against weight decay, shrink with the loss (the gradient of the logits is
``(p − onehot)/τ``, of the size of the loss itself). The law still has an answer there -- a norm
far below the present one, set by decay against near-zero task forces -- but it describes the
virtual training's lack of a task, not the items. A loss without a chance level (a margin loss,
say) is never called saturated by the loss-to-chance rule; it may declare a rule of its own.

:func:`objective_health` reduces the batches' values to

* ``loss_mean`` ± ``loss_se`` (the standard error over the K batch groups, batch ``b`` in group
  ``b mod K``, like every other error bar of a run);
* ``chance`` (the objective's chance level at the batch size, None without one), ``chance_formula``
  (e.g. ``log 32``) and ``loss_to_chance`` = ``loss_mean / chance``;
* ``grad_norm`` quantiles (p10, median, p90) of ``‖ĝ_B‖`` over the probed parameters;
* ``saturated``: the objective's verdict (:meth:`~normfast.engine.directions.objectives.Objective.is_saturated`),
  for the softmax losses ``loss_to_chance`` below ``saturated_below`` (3e-4). The threshold sits
  between the cases measured on all-MiniLM-L6-v2 (last layer, SimCSE at temperature 0.05, 16
  batches; ``python -m bench run corpus_recipe``): 30 distinct sentences of mixed topics give
  3.1e-5 of chance at batch size 15 and 6.6e-5 at 30 (median gradient norm 1e-3 to 3e-3),
  isolated common words 1.4e-3 (the demo's words, median gradient norm 0.07, where the heat is
  10⁴ times larger). The mean is sensitive to a rare hard batch: the Lee corpus's 2 683 sentences
  give 7.7e-4 ± 7.7e-4 of chance with the saturated cases' median gradient norm (0.0011). At
  temperature 0.1 the same sentences give 3.4e-3 and 5.5e-3; ``saturation`` says the rule in words.

The regime check (:mod:`.regime`) then classifies every row it would have called "law
applicable" or "heat-dominated" as ``"objective saturated"``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from normfast.engine.directions.objectives.base import Objective

__all__ = ["health_line", "loss_text", "objective_health"]


def objective_health(
    batch_stats: Mapping[int, tuple[float, float]], batch_size: int, groups: int | None, objective: Any
) -> dict[str, Any]:
    """The health of ``objective`` from ``{global batch index: (loss, gradient norm)}`` (see the module
    docstring): its chance level and saturation as the objective declares them (a loss that is no
    :class:`~normfast.engine.directions.objectives.Objective` declares none).

    ``{"batches": 0}`` when no batch was seen (a finished run returned as it was).
    """
    declared = objective if isinstance(objective, Objective) else Objective()
    if not batch_stats:
        return {"batches": 0}
    index = np.asarray(sorted(batch_stats), dtype=np.int64)
    loss = np.asarray([batch_stats[int(b)][0] for b in index], dtype=np.float64)
    grad = np.asarray([batch_stats[int(b)][1] for b in index], dtype=np.float64)
    n = int(loss.size)
    mean = float(loss.mean())
    k = int(groups or 0)
    if k >= 2 and n >= k:
        group_means = np.asarray([loss[index % k == g].mean() for g in range(k) if np.any(index % k == g)])
        se = float(group_means.std(ddof=1) / math.sqrt(group_means.size)) if group_means.size >= 2 else math.nan
    else:
        se = float(loss.std(ddof=1) / math.sqrt(n)) if n >= 2 else math.nan
    chance = declared.chance_level(batch_size)
    ratio = mean / chance if chance else math.nan
    p10, median, p90 = (float(v) for v in np.percentile(grad, [10, 50, 90]))
    return {
        "batches": n,
        "groups": k or None,
        "loss_mean": mean,
        "loss_se": se,
        "batch_size": int(batch_size),
        "chance": chance,
        "chance_formula": None if declared.chance is None else declared.chance.text(int(batch_size)),
        "loss_to_chance": ratio,
        "grad_norm": {"p10": p10, "median": median, "p90": p90},
        "saturated": bool(declared.is_saturated(mean, int(batch_size))),
        "saturated_below": declared.saturated_below if declared.chance is not None else None,
        "saturation": declared.saturation_text(),
    }


def _chance_formula(health: Mapping[str, Any]) -> str | None:
    """How the run's chance level is written (``log 32``); None for a loss without one."""
    chance = health.get("chance")
    if chance is None or not math.isfinite(chance) or not chance:
        return None
    return health.get("chance_formula") or f"log {health['batch_size']}"  # runs written before the formula


def health_line(health: Mapping[str, Any] | None) -> str | None:
    """One summary line: the loss ± se against chance, and the gradient scale (None without a record)."""
    if not health or not health.get("batches"):
        return None
    se = health.get("loss_se")
    pm = f" ± {se:.2g}" if se is not None and math.isfinite(se) else ""
    verdict = "SATURATED" if health.get("saturated") else "not saturated"
    formula = _chance_formula(health)
    rule = (
        f"the threshold is {health['saturated_below']:.0e}"
        if health.get("saturated_below") is not None
        else health.get("saturation") or "no rule"
    )
    if formula is None:
        against = f" ({verdict}; saturated: {rule})"
    else:
        against = f" = {health['loss_to_chance']:.2g} of chance ({formula} = {health['chance']:.3g}; {verdict}, {rule})"
    return (
        f"virtual objective: loss {health['loss_mean']:.3g}{pm} over {health['batches']} batches{against}; "
        f"median gradient norm {health['grad_norm']['median']:.3g} over the probed parameters"
    )


def loss_text(health: Mapping[str, Any] | None) -> str | None:
    """The loss against chance in a few words (the run's page), None without a record."""
    if not health or not health.get("batches"):
        return None
    formula = _chance_formula(health)
    against = " (no chance level)" if formula is None else f" = {health['loss_to_chance']:.2g} of chance ({formula})"
    return f"{health['loss_mean']:.3g}{against}" + (" — saturated" if health.get("saturated") else "")

"""The check that a loss ignores the embedding norm (torch is imported when it runs)."""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

from normfast.engine.directions.objectives.base import Objective

__all__ = ["check_scale_invariance"]


def check_scale_invariance(
    objective: Objective | Callable[..., Any],
    za: Any,
    zb: Any = None,
    labels: Any = None,
    rtol: float = 1e-4,
    *,
    trials: int = 2,
    seed: int = 0,
) -> bool:
    """Whether ``objective`` is unchanged when each embedding row is rescaled by a positive factor.

    Rows of ``za`` (and ``zb``) are multiplied by independent factors drawn
    log-uniformly from [0.1, 10] (``trials`` draws, seeded); the loss must stay
    within ``rtol`` (relative, plus a tiny absolute floor) of the unscaled loss.
    ``objective`` is an :class:`Objective` or a callable ``loss(za, zb, labels)``.
    Returns the verdict and emits a ``UserWarning`` naming the objective when it
    is not scale-invariant (the equilibrium law then does not apply as derived).
    """
    import torch

    from normfast.core.checks import check_finite_scalar
    from normfast.engine.directions.objectives.functional import check_embeddings

    fn = "check_scale_invariance"
    loss_fn = objective.loss if isinstance(objective, Objective) else objective
    if not callable(loss_fn):
        raise TypeError(
            f"{fn}: expected an Objective or a callable loss(za, zb, labels), got {type(objective).__name__}"
        )
    label_tensor = check_embeddings(fn, za, zb, labels)
    rtol = check_finite_scalar(fn, "rtol", rtol, minimum=0.0, strictly=True)
    name = getattr(objective, "name", None) or getattr(objective, "__name__", None) or type(objective).__name__
    gen = torch.Generator().manual_seed(int(seed))

    def factors(n: int, like: torch.Tensor) -> torch.Tensor:
        log_s = (torch.rand(n, generator=gen, dtype=torch.float64) * 2.0 - 1.0) * math.log(10.0)
        return log_s.exp().to(device=like.device, dtype=like.dtype)[:, None]

    with torch.no_grad():
        base = loss_fn(za, zb, label_tensor)
        base_value = float(base)
        invariant = math.isfinite(base_value)
        for _ in range(max(1, int(trials))):
            if not invariant:
                break
            za_s = za * factors(za.shape[0], za)
            zb_s = None if zb is None else zb * factors(zb.shape[0], zb)
            value = float(loss_fn(za_s, zb_s, label_tensor))
            tolerance = rtol * abs(base_value) + 1e-6 * rtol
            invariant = math.isfinite(value) and abs(value - base_value) <= tolerance
    if not invariant:
        warnings.warn(
            f"objective {name!r} is not scale-invariant: rescaling embedding rows "
            "changes the loss. The equilibrium-norm law assumes a loss that depends "
            "only on directions (normalize embeddings before the similarity).",
            UserWarning,
            stacklevel=2,
        )
    return invariant

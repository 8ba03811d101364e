"""The realized radial budget: what an optimizer's actual step did to every item's squared norm.

For one step, with ``z = f(θ)``, ``z' = f(θ')`` and the step ``Δθ = θ' − θ``
that the optimizer actually took, split into its weight-decay part ``Δθ_d``
and its task part ``Δθ_t = Δθ − Δθ_d``::

    R'² − R² = 2 z·J Δθ_t                              first-order task    (task1)
             + |J Δθ_t|²                               second-order task   (task2)
             + 2 z·J Δθ_d + |J Δθ_d|² + 2 J Δθ_t·J Δθ_d  decay (with its tiny second-order parts)
             + (|z'|² − |z + J Δθ|²)                  remainder: what the linearization misses

``J Δθ`` is a forward-mode jvp of the item forward along the actual step,
evaluated in float64 (float32 parameters are exact in float64, so the terms
are free of the rounding of ``R'² − R²``). The four terms sum to ``R'² − R²``
by construction. Used by E1's ledger (:mod:`bench.experiments.e1.ledger`)
and by the training monitor (:mod:`normfast.engine.monitor.recorder`).

The decay part of the step (:class:`DecaySplit`), for torch's optimizers:

* SGD without momentum: ``−ηλθ`` (torch's coupled L2 is then the same as decoupled decay);
* heavy-ball SGD (``momentum`` β, ``dampening`` τ), whose buffer also accumulates the
  coupled decay: a shadow buffer ``b_d ← β b_d + (1−τ) λθ`` run from the optimizer's first
  step (torch's first step sets the buffer to ``λθ``) gives ``Δθ_d = −η b_d``
  (Nesterov: ``−η (λθ + β b_d)``);
* AdamW, and Adam with ``decoupled_weight_decay=True``: ``−ηλθ`` (decoupled);
* any optimizer whose parameter groups have no weight decay: ``0``.

Adam's coupled L2 passes through the preconditioner and cannot be separated
from the task step; it is refused, as is any other optimizer with weight decay.

:func:`realized_law` solves the equilibrium law with coefficients read off
realized window means (the check that the realized balance closes), and
:func:`estimated_terms` gives the law's estimate of each term from probe
statistics, in the same per-step units.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
from torch.func import jvp

#: the realized terms of one step, in the order they are written
TERMS = ("task1", "task2", "decay", "remainder")


@dataclass(frozen=True)
class StepRule:
    """How an optimizer applies weight decay to one parameter at one step."""

    lr: float
    weight_decay: float = 0.0
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    decoupled: bool = False

    @property
    def shadow_buffer(self) -> bool:
        """Whether the decay part needs a shadow momentum buffer (coupled decay through heavy-ball)."""
        return bool(self.momentum) and bool(self.weight_decay) and not self.decoupled

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    if isinstance(optimizer, torch.optim.AdamW):
        return "adamw"
    if isinstance(optimizer, torch.optim.Adam):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    return "other"


def step_rules(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> dict[str, StepRule]:
    """The :class:`StepRule` of every parameter of ``optimizer`` named in ``names`` (``id(p) -> name``),
    read from its parameter groups as they are now (the learning rate of the coming step).

    Raises ``TypeError`` for weight decay that cannot be separated from the task step (Adam's coupled
    L2, optimizers other than torch's SGD/Adam/AdamW).
    """
    kind = _optimizer_kind(optimizer)
    rules: dict[str, StepRule] = {}
    for gi, group in enumerate(optimizer.param_groups):
        wd = float(group.get("weight_decay", 0.0) or 0.0)
        lr = float(group["lr"])
        if kind == "sgd":
            rule = StepRule(
                lr,
                wd,
                float(group.get("momentum", 0.0) or 0.0),
                float(group.get("dampening", 0.0) or 0.0),
                bool(group.get("nesterov", False)),
            )
        elif kind in ("adam", "adamw"):
            decoupled = kind == "adamw" or bool(group.get("decoupled_weight_decay", False))
            if wd and not decoupled:
                raise TypeError(
                    f"step_rules: torch.optim.Adam with weight_decay={wd} (parameter group {gi}) adds L2 "
                    "to the gradient before the preconditioner, so its decay cannot be separated from "
                    "the task step; use torch.optim.AdamW (decoupled decay) or weight_decay=0"
                )
            rule = StepRule(lr, wd, decoupled=True)
        elif wd:
            raise TypeError(
                f"step_rules: {type(optimizer).__name__} with weight_decay={wd} (parameter group {gi}): "
                "the decay part of its step is known for torch.optim.SGD (plain, heavy-ball, Nesterov), "
                "AdamW and Adam(decoupled_weight_decay=True), and for any optimizer without weight decay"
            )
        else:
            rule = StepRule(lr)
        for p in group["params"]:
            if id(p) in names:
                rules[names[id(p)]] = rule
    return rules


class DecaySplit:
    """The weight-decay part ``Δθ_d`` of each step (see the module docstring).

    Call :meth:`before_step` before *every* optimizer step when a parameter needs the
    shadow buffer (heavy-ball SGD with weight decay): the buffer must see every step
    from the optimizer's first, exactly like torch's own momentum buffer.
    """

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def before_step(self, theta: Mapping[str, torch.Tensor], rules: Mapping[str, StepRule]) -> None:
        for n, rule in rules.items():
            if not rule.shadow_buffer:
                continue
            t = theta[n]
            if n not in self.buffers:  # torch's first step: buffer = d_p
                self.buffers[n] = rule.weight_decay * t
            else:
                self.buffers[n].mul_(rule.momentum).add_(t, alpha=rule.weight_decay * (1.0 - rule.dampening))

    def warm_start(self, theta: Mapping[str, torch.Tensor], rules: Mapping[str, StepRule]) -> None:
        """Start the shadow buffers mid-training at their value for a parameter that has not moved,
        ``(1−τ) λθ / (1−β)`` (the error decays as ``β^t``)."""
        for n, rule in rules.items():
            if rule.shadow_buffer and n not in self.buffers:
                self.buffers[n] = (rule.weight_decay * (1.0 - rule.dampening) / (1.0 - rule.momentum)) * theta[n]

    def decay(self, theta: Mapping[str, torch.Tensor], rules: Mapping[str, StepRule]) -> dict[str, torch.Tensor]:
        """``Δθ_d`` per parameter at ``theta`` (the parameters before the step)."""
        out = {}
        for n, t in theta.items():
            rule = rules[n]
            if not rule.weight_decay:
                out[n] = torch.zeros_like(t)
            elif rule.shadow_buffer:
                buf = self.buffers[n]
                out[n] = -rule.lr * (rule.weight_decay * t + rule.momentum * buf) if rule.nesterov else -rule.lr * buf
            else:
                out[n] = -rule.lr * rule.weight_decay * t
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: b.detach().cpu().clone() for n, b in self.buffers.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor], device: torch.device | None = None) -> None:
        self.buffers = {n: b.to(device) if device is not None else b.clone() for n, b in state.items()}


class StepSums:
    """Per-item sums of the realized terms over the steps since the last stored row.

    With ``TrainingMonitor(average=True)`` every step's terms are computed and summed here, and a
    stored row holds their mean over every step since the previous stored one (itself included):
    the window means then use every step, and ``delta_r2`` telescopes, while the table keeps one
    row per ``every`` steps. The sums are float64 and go into the monitor's resume state.
    """

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.steps = 0

    def add(self, terms: Mapping[str, torch.Tensor]) -> None:
        for k, v in terms.items():
            v = v.detach().to(torch.float64)
            self.sums[k] = self.sums[k] + v if k in self.sums else v.clone()
        self.steps += 1

    def take(self) -> tuple[dict[str, torch.Tensor], int]:
        """The means since the last take and the number of steps they average; the sums start again."""
        means, n = {k: v / self.steps for k, v in self.sums.items()}, self.steps
        self.sums, self.steps = {}, 0
        return means, n

    def state_dict(self) -> dict[str, Any]:
        return {"sums": {k: v.detach().cpu().clone() for k, v in self.sums.items()}, "steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device | None = None) -> None:
        self.sums = {k: v.to(device) if device is not None else v.clone() for k, v in state["sums"].items()}
        self.steps = int(state["steps"])


def parameters_as(
    named: Iterable[tuple[str, torch.Tensor]], names: Iterable[str] | None = None, dtype: torch.dtype = torch.float64
) -> dict[str, torch.Tensor]:
    """Copies of the named parameters in ``dtype`` (all of them, or those in ``names``)."""
    keep = None if names is None else set(names)
    return {n: p.detach().to(dtype, copy=True) for n, p in named if keep is None or n in keep}


def step_terms(
    f: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    theta: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    d_decay: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The realized terms of one step, per item (``[n_items]`` each): :data:`TERMS`, plus
    ``decay_first_order`` (``2 z·J Δθ_d``), ``r2`` (``R²`` before) and ``r2_new`` (``R'²``).

    ``f`` maps a parameter dict to the items' embeddings ``[n_items, d]``; ``theta`` and
    ``new`` are the parameters before and after the step, ``d_decay`` the decay part of the
    step (:meth:`DecaySplit.decay`), all with the same keys. Call under ``torch.no_grad()``.
    """
    d_task = {n: new[n] - theta[n] - d_decay[n] for n in theta}
    z, jt = jvp(f, (dict(theta),), (d_task,))
    _, jd = jvp(f, (dict(theta),), (dict(d_decay),))
    z_new = f(dict(new))
    r2 = z.square().sum(-1)
    r2_new = z_new.square().sum(-1)
    lin = z + jt + jd
    return {
        "task1": 2 * (z * jt).sum(-1),
        "task2": jt.square().sum(-1),
        "decay": 2 * (z * jd).sum(-1) + jd.square().sum(-1) + 2 * (jt * jd).sum(-1),
        "remainder": r2_new - lin.square().sum(-1),
        "decay_first_order": 2 * (z * jd).sum(-1),
        "r2": r2,
        "r2_new": r2_new,
    }


# ----------------------------------------------------------------------------
# the law from realized terms, and the law's estimate of each term
# ----------------------------------------------------------------------------
def realized_law(
    means: Mapping[str, np.ndarray],
    *,
    adamw: bool,
    lr: float,
    weight_decay: float,
    momentum: float = 0.0,
    with_remainder: bool = True,
) -> np.ndarray:
    """The law solved with coefficients read off realized window-mean terms, per item.

    Each realized term is turned into the statistic the law expects at the items'
    window-mean ``R²`` (``means["R2"]``; AdamW also ``means["R"]``): ``D = ⟨task1⟩/2η'``,
    ``Q = ⟨task2 + remainder⟩ R²/η'²``, ``κ = −⟨decay⟩ / 2η'λR²`` for SGD, ``η' = η/(1−β)``;
    for AdamW ``D_w = ⟨task1⟩/2ηR``, ``Q_w = ⟨task2 + remainder⟩/η²``. If the realized terms
    are complete and the window stationary, the law's root is the observed norm whatever
    the law's assumed scaling with R (η and λ cancel); ``with_remainder=False`` leaves the
    curvature remainder out.
    """
    from normfast.core.equilibrium import equilibrium_norm

    eta = lr / (1.0 - momentum)
    lam = weight_decay
    r2 = means["R2"]
    heat = means["task2"] + (means["remainder"] if with_remainder else 0.0)
    kappa = -means["decay"] / (2 * eta * lam * r2)
    # the statistics are in long-run units already: the law gets eta' and no momentum
    if adamw:
        R = means["R"]
        return equilibrium_norm(
            None, None, kappa, D_w=means["task1"] / (2 * eta * R), Q_w=heat / eta**2, lr=eta, weight_decay=lam
        )
    return equilibrium_norm(
        means["task1"] / (2 * eta), heat * r2 / eta**2, kappa, momentum=0.0, lr=eta, weight_decay=lam
    )


def estimated_terms(
    optimizer: str,
    stats: Mapping[str, np.ndarray],
    *,
    lr: float,
    weight_decay: float,
    momentum: float = 0.0,
    curvature: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The law's per-step terms at one probe, per item, in the units of :func:`step_terms`::

                           SGD (β: long-run)             AdamW
        first-order task   2η D / (1−β)                  2η R D_w
        second-order task  η² Q / ((1−β)² R²)            η² Q_w
        decay              −2ηλ κ R² / (1−β)             −2ηλ κ R²
        remainder          0 (the law has no such term)  0

    ``stats``: the probe's columns ``norm``, ``kappa`` and ``D``, ``Q`` (SGD) or ``D_w``,
    ``Q_w`` (AdamW). ``curvature``: an estimate of the remainder in the same per-step
    units, if one is made (else the law's 0). With momentum each gradient is spread over
    many steps, so the realized per-step second-order term is only part of the long-run
    noise (the rest is in the first-order term): compare the sum of both orders (``task``).
    """
    R = np.asarray(stats["norm"], dtype=float)
    kap = np.asarray(stats["kappa"], dtype=float)
    eta, lam = lr, weight_decay
    if optimizer == "adamw":
        out = {
            "task1": 2 * eta * R * stats["D_w"],
            "task2": eta**2 * np.asarray(stats["Q_w"]),
            "decay": -2 * eta * lam * kap * R**2,
        }
    else:
        s = 1.0 / (1.0 - momentum)
        out = {
            "task1": 2 * eta * s * np.asarray(stats["D"]),
            "task2": (eta * s) ** 2 * stats["Q"] / R**2,
            "decay": -2 * eta * lam * s * kap * R**2,
        }
    out["remainder"] = np.zeros_like(R) if curvature is None else np.asarray(curvature, dtype=float)
    return with_sums(out)


def with_sums(terms: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``terms`` with the derived rows ``task`` (both orders) and ``total`` (all four terms)."""
    out = dict(terms)
    out["task"] = out["task1"] + out["task2"]
    out["total"] = out["task"] + out["decay"] + out["remainder"]
    return out

"""Virtual trajectories: continue a copy of the model on the pair source and probe along the way.

A pretrained model comes as one snapshot, and a single snapshot's drift is a
poor estimate of the drift's time average, which is what the stationary norm
follows (DESIGN §1, "Snapshot vs trajectory"). The engine can move the model
itself: it has the objective and the pairs. :func:`virtual_trajectory` trains
a *copy* of the encoder for ``steps`` virtual optimizer steps (torch's own
optimizer for the preset: SGD with its momentum and coupled weight decay, or
AdamW with its betas and decoupled decay, on virtual batches of the pair
source) and probes it at ``points`` evenly spaced steps (the last at
``steps``). The caller's model is never modified.

Only the probed parameters move (the others stay frozen); parameters matching
``config.no_decay`` get no weight decay. AdamW starts from the given ``v̂``
(``second_moments``, e.g. from a checkpoint's optimizer state) or, without
one, from ``v̂`` estimated on the configuration's virtual batches, with its
bias correction already spent, so its first steps are not inflated; its first
moment starts at zero.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from normfast.engine.config import ProbeConfig

#: the columns averaged over the probe points
AVERAGED = ("norm", "D", "Q", "V2", "m2", "D_w", "Q_w", "V2_w", "m2_w", "C_uw", "kappa")


@dataclass
class Trajectory:
    """Per-point probe statistics along a virtual trajectory."""

    steps: list[int]                       # the step of each probe point
    columns: dict[str, np.ndarray]         # name -> [points, rows]
    losses: list[float]                    # the virtual objective at every step

    def mean(self) -> dict[str, np.ndarray]:
        """Every column averaged over the probe points."""
        return {k: v.mean(0) for k, v in self.columns.items()}

    def halves(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """The column averaged over the first and the second half of the points."""
        v = self.columns[name]
        h = v.shape[0] // 2
        return v[:h].mean(0), v[h:].mean(0)


def make_optimizer(params_by_decay: tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]],
                   config: ProbeConfig, preset: str) -> torch.optim.Optimizer:
    """torch's optimizer for a preset; ``params_by_decay`` = (decayed, exempt)."""
    decayed, exempt = params_by_decay
    groups = [{"params": decayed, "weight_decay": config.weight_decay}]
    if exempt:
        groups.append({"params": exempt, "weight_decay": 0.0})
    if preset == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps)
    return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum)


def virtual_trajectory(encoder: Any, probes: Sequence[Any], objective: Any, pairs: Any,
                       config: ProbeConfig, *, steps: int, points: int,
                       second_moments: Mapping[str, torch.Tensor] | None = None,
                       columns: Sequence[str] = AVERAGED, progress: bool = True) -> Trajectory:
    """Train a copy of ``encoder`` for ``steps`` virtual steps, probing at ``points`` evenly spaced steps.

    ``config`` is the probe configuration used at every point (its seed is offset
    per point, so each point sees fresh virtual batches) and also sets the virtual
    optimizer: ``optimizer`` (one preset for all probed parameters), ``lr``,
    ``weight_decay``, ``momentum`` / ``betas``, ``eps``, ``no_decay``,
    ``batch_size``. The trajectory's own batches come from ``config.seed``.
    """
    import re

    from normfast.data.pairs import virtual_batches
    from normfast.engine.directions import adam_second_moments, batch_loss, estimate_second_moments, \
        resolve_parameters
    from normfast.engine.objectives import get_objective
    from normfast.engine.probe import _as_pair_source, probe

    fn = "virtual_trajectory"
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{fn}: expected steps to be a positive integer, got steps={steps!r}")
    if isinstance(points, bool) or not isinstance(points, int) or not 1 <= points <= steps:
        raise ValueError(f"{fn}: expected points to be an integer in [1, steps={steps}], got points={points!r}")
    if not isinstance(config.optimizer, str):
        raise ValueError(f"{fn}: expected one optimizer preset for all probed parameters, "
                         f"got optimizer={config.optimizer!r}")
    config.validate()
    if isinstance(objective, str):
        objective = get_objective(objective)
    pairs = _as_pair_source(pairs, objective, probes)
    model = copy.deepcopy(encoder)
    names = resolve_parameters(model, config.params)
    chosen = set(names)
    for n, p in model.named_parameters():
        p.requires_grad_(n in chosen)
    exempt_re = re.compile(config.no_decay) if config.no_decay else None
    decayed = [model.get_parameter(n) for n in names if not (exempt_re and exempt_re.search(n))]
    exempt = [model.get_parameter(n) for n in names if exempt_re and exempt_re.search(n)]
    opt = make_optimizer((decayed, exempt), config, config.optimizer)
    rng = np.random.default_rng(config.seed)
    batches = virtual_batches(len(pairs), steps, config.batch_size, int(rng.integers(2**31)))
    if config.optimizer == "adamw":
        v = second_moments
        if v is None:
            v = estimate_second_moments(model, objective, pairs, names, batches[: max(config.batches, 2)],
                                        seed=config.seed, progress=False, check_invariance=False)
        _start_adam(opt, model, names, v)

    at = sorted({int(round(steps * (k + 1) / points)) for k in range(points)})
    cols: dict[str, list[np.ndarray]] = {}
    losses: list[float] = []
    was_training = model.training
    model.train(bool(getattr(objective, "uses_dropout", False)))
    bar = tqdm(range(1, steps + 1), desc="virtual trajectory", unit="step", disable=not progress, leave=False)
    for step in bar:
        loss = batch_loss(model, objective, pairs, batches[step - 1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step in at:
            model.train(was_training)
            sm = adam_second_moments(opt, model) if config.optimizer == "adamw" else None
            res = probe(model, probes, objective, pairs, replace(config, seed=config.seed * 7919 + step),
                        progress=False, second_moments=sm, distributed=False)
            for c in columns:
                if c in res.column_names:
                    cols.setdefault(c, []).append(res.column(c))
            model.train(bool(getattr(objective, "uses_dropout", False)))
    return Trajectory(at, {k: np.stack(v) for k, v in cols.items()}, losses)


def _start_adam(opt: torch.optim.Optimizer, model: Any, names: Sequence[str],
                v: Mapping[str, torch.Tensor]) -> None:
    """Seed AdamW's state with ``v̂`` (bias correction spent) and a zero first moment."""
    big_step = 1e6  # 1 - beta**step == 1 for any beta < 1 in float arithmetic
    for n in names:
        p = model.get_parameter(n)
        st = opt.state[p]
        st["step"] = torch.tensor(big_step)
        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = v[n].detach().to(p).clone() if n in v else torch.zeros_like(p)

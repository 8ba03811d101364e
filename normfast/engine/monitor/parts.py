"""The training monitor's pieces that are not the recording itself: the optimizer it is given (unwrapped,
its settings, the law it follows), eval mode, and the virtual probe at a recorded state
(:mod:`normfast.engine.monitor.recorder`)."""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from normfast.engine.monitor.realized import StepRule


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a wrapper (accelerate's ``AcceleratedOptimizer``, itself an ``Optimizer``
    subclass; Lightning's ``LightningOptimizer``): followed through ``.optimizer`` / ``._optimizer``."""
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            break
        optimizer = inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"TrainingMonitor: expected a torch.optim.Optimizer (or a wrapper of one), "
                        f"got {type(optimizer).__name__}")
    return optimizer


@contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Every submodule in eval mode (no dropout); each one's own flag restored afterwards."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def law_of(optimizer: torch.optim.Optimizer) -> str:
    """``adamw`` for torch's Adam/AdamW (the scale-free branch of the law), else ``sgd``."""
    return "adamw" if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) else "sgd"


def law_settings(optimizer: torch.optim.Optimizer, rules: Mapping[str, StepRule], names: Sequence[str]) -> dict[str, Any]:
    """η (of the first monitored parameter), λ (the largest of the decayed ones) and β of the law."""
    first = rules[names[0]]
    decays = [r.weight_decay for r in rules.values() if r.weight_decay]
    sgd = law_of(optimizer) == "sgd"
    return {"lr": first.lr, "weight_decay": max(decays) if decays else 0.0, "momentum": first.momentum if sgd else 0.0}


def optimizer_info(optimizer: torch.optim.Optimizer, ids: Mapping[int, str], names: Sequence[str],
                   rules: Mapping[str, StepRule]) -> dict[str, Any]:
    """The optimizer's class, law and settings, with every parameter group's settings (JSON-ready)."""
    groups = []
    for group in optimizer.param_groups:
        count = sum(1 for p in group["params"] if id(p) in ids)
        keep = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
                if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None)))}
        groups.append({**keep, "monitored_tensors": count})
    return {"optimizer": type(optimizer).__name__, "law": law_of(optimizer),
            **law_settings(optimizer, rules, names), "param_groups": groups}


def virtual_probe(monitor: Any, optimizer: torch.optim.Optimizer, rules: Mapping[str, StepRule],
                  step: int) -> dict[str, np.ndarray]:
    """The engine's probe at the present state: ``monitor.virtual`` virtual batches (seed
    ``virtual_seed + step``), the drift per batch, no error bars, the optimizer's settings (for AdamW
    its real ``v̂``); the columns ``virtual_*`` of the monitor's rows."""
    from normfast.engine.config import ProbeConfig
    from normfast.engine.directions.gradients import adam_second_moments
    from normfast.engine.probe import probe

    names = monitor._names
    law = law_of(optimizer)
    settings = law_settings(optimizer, rules, names)
    exempt = [n for n, r in rules.items() if not r.weight_decay]
    no_decay = ("^(" + "|".join(re.escape(n) for n in exempt) + ")$") if exempt and len(exempt) < len(rules) else None
    kw: dict[str, Any] = dict(params=list(names), output="pooled", optimizer=law, lr=settings["lr"],
                              weight_decay=settings["weight_decay"], batches=monitor.virtual, drift_batches=None,
                              uncertainty=False, batch_size=monitor.virtual_batch_size,
                              seed=monitor.virtual_seed + step, chunk_size=len(monitor.probes), no_decay=no_decay)
    second = None
    if law == "adamw":
        group = next(g for g in optimizer.param_groups if any(id(p) in monitor._param_names for p in g["params"]))
        kw.update(betas=tuple(group.get("betas", (0.9, 0.999))), eps=float(group.get("eps", 1e-8)))
        second = adam_second_moments(optimizer, monitor.encoder) or None
        if second is not None and not set(names) <= set(second):
            second = None  # before the optimizer's first step: v̂ from the virtual batches
    else:
        kw["momentum"] = settings["momentum"]
    with eval_mode(monitor.encoder):
        res = probe(monitor.encoder, monitor.probes, monitor.objective, monitor.pairs, ProbeConfig(**kw),
                    progress=False, second_moments=second, ids=monitor.ids, model_name=monitor.model_name,
                    distributed=False)
    d, q = ("D_w", "Q_w") if law == "adamw" else ("D", "Q")
    return {"virtual_D": res.column(d), "virtual_Q": res.column(q), "virtual_kappa": res.column("kappa"),
            "virtual_r_eq": res.column("r_eq"), "virtual_r_eq_heat": res.column("r_eq_heat")}

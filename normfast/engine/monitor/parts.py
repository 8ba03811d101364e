"""What the recorder (:mod:`normfast.engine.monitor.recorder`) is given and reports, apart from the
recording itself: its settings checked, the model as an encoder, the optimizer (unwrapped, its
settings, the law it follows), eval mode, the virtual probe at a recorded state, and the clock."""

from __future__ import annotations

import math
import re
import warnings
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from normfast.engine.monitor.layout import TIMING_KEYS
from normfast.engine.monitor.realized import DecaySplit, StepRule


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
        raise TypeError(
            f"TrainingMonitor: expected a torch.optim.Optimizer (or a wrapper of one), got {type(optimizer).__name__}"
        )
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


def start_buffers(
    encoder: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    theta: Mapping[str, torch.Tensor],
    buffered: Mapping[str, StepRule],
    decay: DecaySplit,
) -> str:
    """How heavy-ball SGD's shadow decay buffer starts, at the first step the monitor sees: ``exact`` when
    the optimizer's momentum buffers do not exist yet, else ``warm-started`` (from an estimate, warned)."""
    named = dict(encoder.named_parameters())
    started = [n for n in buffered if optimizer.state.get(named[n], {}).get("momentum_buffer") is not None]
    if started:
        warnings.warn(
            "TrainingMonitor: the optimizer's momentum buffers already exist (the monitor joined a "
            "running heavy-ball SGD with weight decay): the decay part of its steps starts from an "
            "estimate whose error decays as momentum^t (metadata decay_buffer='warm-started')",
            RuntimeWarning,
            stacklevel=3,
        )
        decay.warm_start(theta, {n: buffered[n] for n in started})
        return "warm-started"
    return "exact"


def device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def law_of(optimizer: torch.optim.Optimizer) -> str:
    """``adamw`` for torch's Adam/AdamW (the scale-free branch of the law), else ``sgd``."""
    return "adamw" if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) else "sgd"


def law_settings(
    optimizer: torch.optim.Optimizer, rules: Mapping[str, StepRule], names: Sequence[str]
) -> dict[str, Any]:
    """η (of the first monitored parameter), λ (the largest of the decayed ones) and β of the law."""
    first = rules[names[0]]
    decays = [r.weight_decay for r in rules.values() if r.weight_decay]
    sgd = law_of(optimizer) == "sgd"
    return {"lr": first.lr, "weight_decay": max(decays) if decays else 0.0, "momentum": first.momentum if sgd else 0.0}


def optimizer_info(
    optimizer: torch.optim.Optimizer, ids: Mapping[int, str], names: Sequence[str], rules: Mapping[str, StepRule]
) -> dict[str, Any]:
    """The optimizer's class, law and settings, with every parameter group's settings (JSON-ready)."""
    groups = []
    for group in optimizer.param_groups:
        count = sum(1 for p in group["params"] if id(p) in ids)
        keep = {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in group.items()
            if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None)))
        }
        groups.append({**keep, "monitored_tensors": count})
    return {
        "optimizer": type(optimizer).__name__,
        "law": law_of(optimizer),
        **law_settings(optimizer, rules, names),
        "param_groups": groups,
    }


def folder_metadata(
    spec: Mapping[str, Any],
    info: Mapping[str, Any] | None,
    *,
    decay_buffer: str | None,
    names: Sequence[str] | None,
    cut_stage: int | None,
    steps: tuple[int | None, int | None, int],
) -> dict[str, Any]:
    """The metadata of ``monitor.parquet`` (:data:`normfast.engine.monitor.layout.METADATA_KEYS`): the
    monitor's settings ``spec``, the optimizer's ``info`` and ``steps`` = (first, last, number) recorded."""
    from normfast.data.io import fingerprint
    from normfast.engine.runner.provenance import library_versions

    info = info or {}
    first, last, recorded = steps
    return {
        **spec,
        **{k: info.get(k) for k in ("optimizer", "law", "lr", "weight_decay", "momentum", "param_groups")},
        "decay_buffer": decay_buffer,
        "n_trained_parameters": len(names or ()),
        "trained_parameters": list(names or ())[:50],
        "cut_stage": cut_stage,
        "first_step": first,
        "last_step": last,
        "recorded_steps": recorded,
        "spec_fingerprint": fingerprint(spec),
        "versions": library_versions(),
    }


def virtual_probe(
    monitor: Any, optimizer: torch.optim.Optimizer, rules: Mapping[str, StepRule], step: int, names: Sequence[str]
) -> dict[str, np.ndarray]:
    """The engine's probe at the present state: ``monitor.virtual`` virtual batches (seed
    ``virtual_seed + step``), the drift per batch, no error bars, the optimizer's settings (for AdamW
    its real ``v̂``); the columns ``virtual_*`` of the monitor's rows. ``names``: the monitored
    parameters."""
    from normfast.engine.config import ProbeConfig
    from normfast.engine.directions.parameters import adam_second_moments
    from normfast.engine.probe import probe

    law = law_of(optimizer)
    settings = law_settings(optimizer, rules, names)
    exempt = [n for n, r in rules.items() if not r.weight_decay]
    no_decay = ("^(" + "|".join(re.escape(n) for n in exempt) + ")$") if exempt and len(exempt) < len(rules) else None
    kw: dict[str, Any] = dict(
        params=list(names),
        output="pooled",
        optimizer=law,
        lr=settings["lr"],
        weight_decay=settings["weight_decay"],
        batches=monitor.virtual,
        drift_batches=None,
        uncertainty=False,
        batch_size=monitor.virtual_batch_size,
        seed=monitor.virtual_seed + step,
        chunk_size=len(monitor.probes),
        no_decay=no_decay,
    )
    second = None
    if law == "adamw":
        monitored = {id(p) for n, p in monitor.encoder.named_parameters() if n in set(names)}
        group = next(g for g in optimizer.param_groups if any(id(p) in monitored for p in g["params"]))
        kw.update(betas=tuple(group.get("betas", (0.9, 0.999))), eps=float(group.get("eps", 1e-8)))
        second = adam_second_moments(optimizer, monitor.encoder) or None
        if second is not None and not set(names) <= set(second):
            second = None  # before the optimizer's first step: v̂ from the virtual batches
    else:
        kw["momentum"] = settings["momentum"]
    with eval_mode(monitor.encoder):
        res = probe(
            monitor.encoder,
            monitor.probes,
            monitor.objective,
            monitor.pairs,
            ProbeConfig(**kw),
            progress=False,
            second_moments=second,
            ids=monitor.ids,
            model_name=monitor.model_name,
            distributed=False,
        )
    d, q = ("D_w", "Q_w") if law == "adamw" else ("D", "Q")
    return {
        "virtual_D": res.column(d),
        "virtual_Q": res.column(q),
        "virtual_kappa": res.column("kappa"),
        "virtual_r_eq": res.column("r_eq"),
        "virtual_r_eq_heat": res.column("r_eq_heat"),
    }


def check_settings(
    *,
    every: Any,
    flush_every: Any,
    virtual_batch_size: Any,
    virtual: Any,
    objective: Any,
    dtype: Any,
    probes: Any,
    ids: Any,
) -> tuple[list[Any], list[str] | None]:
    """The monitor's arguments checked before anything is set up: the probe items as a list and the
    ids as strings (``ValueError``/``TypeError`` naming the argument)."""
    fn = "TrainingMonitor"
    for name, value, low in (
        ("every", every, 1),
        ("flush_every", flush_every, 1),
        ("virtual_batch_size", virtual_batch_size, 2),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{fn}: expected {name} to be an int >= {low}, got {value!r}")
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 0 or virtual == 1:
        raise ValueError(f"{fn}: expected virtual to be 0 (off) or an int >= 2 (virtual batches), got {virtual!r}")
    if virtual and objective is None:
        raise ValueError(f"{fn}: virtual={virtual} needs the virtual batches' objective= (and pairs=)")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{fn}: expected dtype torch.float64 or torch.float32, got {dtype!r}")
    if isinstance(probes, (str, bytes)) or not hasattr(probes, "__len__"):
        raise TypeError(f"{fn}: expected probes to be a sequence of items, got {type(probes).__name__}")
    probes = list(probes)
    if not probes:
        raise ValueError(f"{fn}: expected at least one probe item, got none")
    if ids is not None:
        ids = [str(i) for i in ids]
        if len(ids) != len(probes):
            raise ValueError(f"{fn}: expected one id per probe item ({len(probes)}), got len(ids)={len(ids)}")
    return probes, ids


def as_encoder(model: Any) -> Any:
    """The encoder the monitor probes: a normfast ``Encoder`` as is, else the model through
    :func:`~normfast.encoders.load_encoder` (sharing its parameters)."""

    from normfast.encoders import Encoder, load_encoder

    if isinstance(model, Encoder):
        return model
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"TrainingMonitor: expected the model being trained (an nn.Module) or a normfast "
            f"Encoder sharing its parameters, got {type(model).__name__}"
        )
    return load_encoder(model, device=device_of(model))


def monitored_parameters(encoder: Any, optimizer: torch.optim.Optimizer) -> tuple[list[str], dict[int, str]]:
    """The parameters the monitor follows, at its first step: the encoder's parameters that the optimizer
    updates and that require grad (names in the encoder's order), and ``{id(parameter): name}`` of them."""
    by_id = {id(p): n for n, p in encoder.named_parameters()}
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
    names = [n for n, p in encoder.named_parameters() if id(p) in in_optimizer]
    if not names:
        raise ValueError(
            f"TrainingMonitor: the optimizer updates none of the parameters of the monitored "
            f"{type(encoder).__name__} (does the encoder share the trained model's parameters?)"
        )
    chosen = set(names)
    return names, {i: n for i, n in by_id.items() if n in chosen}


def frozen_tail(
    encoder: Any, names: Sequence[str], probes: Sequence[Any], dtype: torch.dtype
) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
    """What the monitor fixes once: the cut (the stage of the first monitored parameter), the tail's other
    parameters and buffers in ``dtype`` (the jvps' precision), and the probes' state at the cut (the frozen
    front runs once, here)."""
    stage = encoder.stage_of_parameters()
    chosen = set(names)
    cut = min(stage[n] for n in names)
    frozen = {n: p.detach().to(dtype) for n, p in encoder.named_parameters() if n not in chosen and stage[n] >= cut}
    frozen.update({n: b.detach().to(dtype) for n, b in encoder.named_buffers() if b.is_floating_point()})
    with eval_mode(encoder), torch.no_grad():
        state = encoder.prepare(probes)
        front = encoder(state, 0, cut) if cut > 0 else state
    front = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in front.items()}
    return cut, frozen, front


class MonitorClock:
    """The monitor's own time against the training's, as :meth:`TrainingMonitor.summary` reports it.

    The monitor's time is what runs inside its hooks (``before_step``, ``after_step``, the blocks
    flushed there) and inside ``close()`` (the last block and ``monitor.parquet``): ``terms_seconds``
    for norms and realized terms, ``virtual_seconds`` for the virtual probes. The training's time is
    the wall time between consecutive ``after_step`` calls with the monitor's own time taken out.

    That training time is not the training's time without the monitor: interleaved with the
    monitor's work, the training's own steps run slower (cold caches, a busy allocator), and not only
    the step right after the work: on E1's small MLP the first step after it took 1.7 times a step
    far from it, the second 1.2 times. So the clock also times *clean* steps, whose training follows
    at least :data:`CLOCK_DEPTH` ``after_step`` calls without the monitor's work: steps far enough
    from the last measured one (with ``average=False``, most of them), and, from the monitor's third
    step and every :data:`CLOCK_EVERY` steps after, the step after a *stretch* of ``depth`` steps whose
    work the monitor defers to that step's ``after_step`` (the numbers do not change; ``depth`` is 1
    where the monitored parameters are large, as each deferred step holds copies of them);
    ``clean_seconds`` over ``clean_steps``. The overhead is the wall time the clock saw against that
    many clean steps; without a clean step (a short run) it falls back on the hooks' time against the
    training's (a lower bound).
    """

    def __init__(self) -> None:
        self.timing: dict[str, float] = {k: 0.0 for k in TIMING_KEYS}
        self._t_last: float | None = None
        self._own_at_last = 0.0
        self._quiet = 0  # after_step calls in a row without the monitor's work
        self.depth = CLOCK_DEPTH  # the steps a clock stretch defers

    def add(self, key: str, seconds: float) -> None:
        """``seconds`` of the monitor's own time (``terms_seconds`` or ``virtual_seconds``)."""
        self.timing[key] += seconds

    def fit(self, encoder: Any, names: Sequence[str], dtype: torch.dtype) -> None:
        """A stretch of one step where the monitored parameters (``names``, in ``dtype``) are over
        :data:`CLOCK_DEPTH_BYTES`: each deferred step holds copies of them."""
        named = dict(encoder.named_parameters())
        size = sum(named[n].numel() for n in names) * torch.finfo(dtype).bits // 8
        self.depth = 1 if size > CLOCK_DEPTH_BYTES else CLOCK_DEPTH

    def defer(self, steps_seen: int) -> bool:
        """Whether the monitor's ``steps_seen``-th step is in a clock stretch: its work waits for the
        ``after_step`` of the step after the stretch, which is then clean."""
        k = steps_seen - CLOCK_FIRST
        return k >= 0 and k % CLOCK_EVERY < self.depth

    def clean_now(self, steps_seen: int) -> bool:
        """Whether the step that has just trained (the monitor's ``steps_seen``-th) was clean: it
        followed ``depth`` quiet ``after_step`` calls, past the first steps (which warm up)."""
        return self._quiet >= self.depth and steps_seen >= CLOCK_FIRST + self.depth

    def worked(self, did: bool) -> None:
        """At the end of an ``after_step``: whether the monitor did its work there (else a quiet one)."""
        self._quiet = 0 if did else self._quiet + 1

    def step_done(self, now: float, *, clean: bool = False) -> None:
        """At the end of an ``after_step``: the wall time since the previous one, less the monitor's own,
        trained; ``clean``: that step's training followed no monitor work (a clean step)."""
        own = self.timing["terms_seconds"] + self.timing["virtual_seconds"]
        if self._t_last is not None:
            trained = max(0.0, (now - self._t_last) - (own - self._own_at_last))
            self.timing["train_seconds"] += trained
            self.timing["timed_steps"] += 1
            if clean:
                self.timing["clean_seconds"] += trained
                self.timing["clean_steps"] += 1
        self._t_last, self._own_at_last = now, own

    def summary(self, *, steps: int, recorded: int) -> dict[str, Any]:
        """What ``summary.json`` holds (:data:`normfast.engine.monitor.layout.SUMMARY_KEYS`)."""
        return clock_summary(self.timing, steps=steps, recorded=recorded)


#: a clock stretch starts at the monitor's third step and every this many steps after
CLOCK_FIRST, CLOCK_EVERY = 2, 50
#: the steps a clock stretch defers (and the quiet steps before a clean one), and the size of the
#: monitored parameters (bytes, in the monitor's precision) above which a stretch defers one step
CLOCK_DEPTH, CLOCK_DEPTH_BYTES = 3, 2**26


def clock_summary(timing: Mapping[str, float], *, steps: int, recorded: int) -> dict[str, Any]:
    """The monitor's time against the training's: what ``summary.json`` holds (:class:`MonitorClock`)."""
    t = {k: 0.0 for k in TIMING_KEYS} | dict(timing)
    train = t["train_seconds"]
    own = t["terms_seconds"] + t["virtual_seconds"]
    clean_step = t["clean_seconds"] / t["clean_steps"] if t["clean_steps"] else math.nan
    # the training alone: as many clean steps as were timed; without any, the training's time as seen
    base = clean_step * t["timed_steps"] if t["clean_steps"] and t["timed_steps"] else train

    def frac(x: float) -> float:
        return x / base if base > 0 else math.nan

    return {
        "steps": steps,
        "recorded_steps": recorded,
        "train_seconds": train,
        "terms_seconds": t["terms_seconds"],
        "virtual_seconds": t["virtual_seconds"],
        "monitor_seconds": own,
        "wall_seconds": train + own,
        "clean_steps": int(t["clean_steps"]),
        "clean_step_seconds": clean_step,
        "overhead_terms": frac(t["terms_seconds"]),
        "overhead_virtual": frac(t["virtual_seconds"]),
        "overhead_interference": frac(train) - 1 if base > 0 else math.nan,
        "overhead": frac(train + own) - 1 if base > 0 else math.nan,
        "seconds_per_recorded_step": {
            "terms": t["terms_seconds"] / recorded if recorded else math.nan,
            "virtual": t["virtual_seconds"] / recorded if recorded else math.nan,
        },
        "seconds_per_train_step": train / t["timed_steps"] if t["timed_steps"] else math.nan,
    }

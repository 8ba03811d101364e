"""SGD + weight decay to a stationary state, recording what the health criteria and the law need.

:func:`train` -- plain SGD (no momentum) with decoupled-in-effect weight decay on the decayed
group (:func:`split_decay`), a linear lr warm-up, InfoNCE on uniform draws from a pool of
pairs (as the engine's virtual batches are drawn), recording over the late window the probe
items' norms, the embeddings' mean pairwise cosine (:func:`mean_cosine`) and the decayed
weights' norm; a callback runs the engine at checkpoints.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from bench.training.settings import HealthThresholds, TrainSettings
from bench.training.storage import Resume


def split_decay(
    encoder: torch.nn.Module, trained: str, no_decay: str | None
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """``(decayed, exempt)``: the parameters whose names match ``trained`` (a regex, matched at the
    start of the name), split by ``no_decay`` (searched); every other parameter is frozen."""
    pattern = re.compile(trained)
    exempt_re = re.compile(no_decay) if no_decay else None
    decayed, exempt = [], []
    for name, p in encoder.named_parameters():
        on = bool(pattern.match(name))
        p.requires_grad_(on)
        if on:
            (exempt if exempt_re and exempt_re.search(name) else decayed).append(p)
    if not decayed:
        raise ValueError(f"split_decay: no decayed parameter matches trained={trained!r} (no_decay={no_decay!r})")
    return decayed, exempt


@dataclass
class Records:
    losses: list[float]
    trajectory: list[dict[str, float]]
    window_norms: list[np.ndarray]  # [records][n_probes]
    window_cosines: list[float]
    window_weight_norms: list[float]  # norm of the decayed parameters
    window_start: int
    stopped_at: int | None  # step at which a collapsed run was stopped
    seconds: float  # training only (checkpoints excluded)
    cpu_seconds: float = 0.0  # process CPU time of the training only
    loop_seconds: float = 0.0  # the whole loop (training + checkpoints), every segment
    loop_cpu_seconds: float = 0.0
    segments: list[dict[str, Any]] = field(default_factory=list)  # each process that ran part of the loop


def mean_cosine(z: torch.Tensor) -> float:
    """Mean pairwise cosine of the rows of ``z`` (diagonal excluded): 1 means collapse."""
    n = z.shape[0]
    zh = torch.nn.functional.normalize(z.double(), dim=-1)
    return float((zh.sum(0).square().sum() - n) / (n * (n - 1)))


def _norm(params: Sequence[torch.Tensor]) -> float:
    if not params:
        return 0.0
    return float(torch.sqrt(sum(p.detach().double().square().sum() for p in params)))


def train(
    encoder: Any,
    pair_ids: np.ndarray,
    probe_items: Sequence[Any],
    settings: TrainSettings,
    groups: tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]],
    *,
    on_checkpoint: Callable[[int], None] | None = None,
    stop_on_collapse: bool = False,
    collapse_cosine: float = HealthThresholds.collapse_cosine,
    progress: bool = True,
    desc: str = "train",
    resume: Resume | None = None,
) -> Records:
    """SGD + decay on ``groups = (decayed, exempt)`` with InfoNCE on pairs of ``pair_ids`` rows.

    Each step draws ``batch_size`` distinct rows of ``pair_ids`` (``[n, 2]`` items that
    ``encoder.prepare`` accepts) and runs both sides in one call. ``on_checkpoint(i)``
    runs at every ``probe_every``-th step of the window; its time is not training time.
    With ``resume``, the state is saved along the way and an interrupted run continues
    from its last save (see :class:`Resume`).
    """
    from normfast.engine.directions import InfoNCE

    settings.validate()
    decayed, exempt = groups
    param_groups = [{"params": decayed, "weight_decay": settings.weight_decay}]
    if exempt:
        param_groups.append({"params": exempt, "weight_decay": 0.0})
    opt = torch.optim.SGD(param_groups, lr=settings.lr, momentum=0.0)
    objective = InfoNCE(temperature=settings.temperature)
    window_start = settings.window_start
    rng = np.random.default_rng(settings.seed + 2)
    probe_state = encoder.prepare(list(probe_items))
    bs = settings.batch_size
    rec = Records([], [], [], [], [], window_start, None, 0.0)
    checkpoint_seconds = checkpoint_cpu = 0.0
    before = {"train": 0.0, "train_cpu": 0.0, "loop": 0.0, "loop_cpu": 0.0}  # earlier segments
    first = 0
    params = [*decayed, *exempt]
    saved = resume.load(settings, params) if resume is not None else None
    if saved is not None:
        with torch.no_grad():
            for p, t in zip(params, saved["params"]):
                p.copy_(t)
        rng.bit_generator.state = saved["rng"]
        rec = Records(**saved["records"])
        before = saved["seconds"]
        first = saved["step"]
    t0, c0 = time.perf_counter(), time.process_time()
    rec.segments.append({"first_step": first, "pid": os.getpid()})

    def times() -> dict[str, float]:
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return {
            "train": before["train"] + wall - checkpoint_seconds,
            "train_cpu": before["train_cpu"] + cpu - checkpoint_cpu,
            "loop": before["loop"] + wall,
            "loop_cpu": before["loop_cpu"] + cpu,
        }

    def save(done: int) -> None:
        rec.segments[-1]["last_step"] = done
        resume.save(
            {
                "settings": asdict(settings),
                "identity": resume.identity,
                "step": done,
                "rng": rng.bit_generator.state,
                "params": [p.detach().clone() for p in params],
                "records": asdict(rec),
                "seconds": times(),
            }
        )

    bar = tqdm(
        range(first, settings.steps), desc=desc, unit="step", disable=not progress, initial=first, total=settings.steps
    )
    for step in bar:
        if step <= settings.warmup:
            for group in opt.param_groups:
                group["lr"] = settings.lr * min(1.0, (step + 1) / (settings.warmup + 1))
        idx = rng.choice(len(pair_ids), size=bs, replace=False)
        z = encoder(encoder.prepare(np.concatenate([pair_ids[idx, 0], pair_ids[idx, 1]])))
        loss = objective.loss(z[:bs], z[bs:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        rec.losses.append(float(loss.detach()))
        if not np.isfinite(rec.losses[-1]):
            raise FloatingPointError(f"train: the training loss is {rec.losses[-1]} at step {step}")
        done = step + 1
        in_window = step >= window_start
        k = step - window_start
        record = in_window and k % settings.record_every == 0
        traj = done % settings.trajectory_every == 0 or done == settings.steps
        if record or traj:
            with torch.no_grad():
                zp = encoder(probe_state)
            cosine = mean_cosine(zp)
        if record:
            rec.window_norms.append(zp.norm(dim=-1).double().numpy())
            rec.window_cosines.append(cosine)
            rec.window_weight_norms.append(_norm(decayed))
        if traj:
            rec.trajectory.append(
                {
                    "step": done,
                    "loss_mean": float(np.mean(rec.losses[-settings.trajectory_every :])),
                    "norm_median": float(zp.norm(dim=-1).median()),
                    "mean_cosine": cosine,
                    "decayed_weight_norm": _norm(decayed),
                    "exempt_param_norm": _norm(exempt),
                }
            )
            bar.set_postfix(loss=f"{rec.trajectory[-1]['loss_mean']:.3f}", cos=f"{cosine:.2f}")
            if stop_on_collapse and cosine >= collapse_cosine:
                rec.stopped_at = done
                break
        checkpoint = in_window and k % settings.probe_every == 0
        if checkpoint and on_checkpoint is not None:
            tp, cp = time.perf_counter(), time.process_time()
            on_checkpoint(k // settings.probe_every)
            checkpoint_seconds += time.perf_counter() - tp
            checkpoint_cpu += time.process_time() - cp
        if resume is not None and done < settings.steps and (checkpoint if in_window else done % resume.every == 0):
            save(done)
    t = times()
    rec.seconds, rec.cpu_seconds, rec.loop_seconds, rec.loop_cpu_seconds = (
        t["train"],
        t["train_cpu"],
        t["loop"],
        t["loop_cpu"],
    )
    rec.segments[-1]["last_step"] = rec.stopped_at or settings.steps
    if resume is not None and not resume.keep:
        resume.path.unlink(missing_ok=True)
    return rec

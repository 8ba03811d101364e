"""Train to a stationary state and test the equilibrium law on it.

The pieces every experiment of that kind needs, for any :class:`~normfast.encoders.Encoder`
and a pool of (anchor, positive) pairs of its items (E2 on the real MiniLM uses them;
``bench/e2_real_encoder.py``):

* :func:`split_decay` -- the trained parameters, split into decayed and exempt
  (SGD parameter groups, the same exemption the engine gets through
  ``ProbeConfig(no_decay=...)``);
* :func:`train` -- plain SGD (no momentum) with decoupled-in-effect weight decay
  on the decayed group, a linear lr warm-up, InfoNCE on uniform draws from the
  pool (as the engine's virtual batches are drawn), recording over the late
  window the probe items' norms, the embeddings' mean pairwise cosine and the
  decayed weights' norm; a callback runs the engine at checkpoints;
* :func:`health` -- the criteria a run must meet before any fit means
  anything: (a) loss below a fraction of chance, (b) no collapse, (c) norms and
  weights stationary between the window halves;
* :func:`pilot` -- candidate settings in a fixed order, health only (it never
  computes the law's inputs or a fit); the first that passes is chosen;
* :class:`CheckpointLaw` -- the engine at every checkpoint, the statistics
  averaged over the checkpoints, the law solved on the averages (full and
  heat-only), the regime check of the averages, and the last checkpoint alone;
* :class:`CheckpointSnapshots` and :func:`probe_checkpoints` -- the trained
  parameters saved at every checkpoint, probed after training in one worker
  process per core (the laws then hold what probing during training gives);
* :class:`Resume` -- a state file that lets an interrupted :func:`train` (with
  its checkpoints' statistics) go on where it stopped, with the same result.

Plain SGD + weight decay is what the law describes (DESIGN §1); the dropout of
the encoder is off in training, as in the engine's virtual batches, so the
only noise is the minibatch noise.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm


@dataclass(frozen=True)
class HealthThresholds:
    """Training health criteria (see :func:`health`)."""

    loss_fraction_of_chance: float = 0.75
    collapse_cosine: float = 0.9
    norm_change_max: float = 0.05
    weight_change_max: float = 0.02

    def criteria_text(self) -> dict[str, str]:
        return {
            "a_loss": f"every 100-step mean loss in the window < {self.loss_fraction_of_chance} ln(batch)",
            "b_no_collapse": f"mean pairwise cosine of the probe embeddings < {self.collapse_cosine} at "
                             "every record (every trajectory_every steps, and every record_every "
                             "steps in the window)",
            "c_stationary": f"median relative change of the window-mean probe norm between the "
                            f"window halves < {self.norm_change_max}, and of the decayed matrices' "
                            f"norm < {self.weight_change_max}",
        }


@dataclass(frozen=True)
class TrainSettings:
    """SGD + weight decay on InfoNCE pairs, and what is recorded along the way."""

    lr: float
    weight_decay: float
    steps: int
    temperature: float = 0.05
    batch_size: int = 32
    warmup: int = 200
    window: float = 0.4
    record_every: int = 20
    probe_every: int = 60
    trajectory_every: int = 100
    seed: int = 0

    @property
    def window_start(self) -> int:
        return int(self.steps * (1 - self.window))

    def validate(self) -> None:
        fn = "TrainSettings"
        for name in ("steps", "batch_size", "record_every", "probe_every", "trajectory_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{fn}: expected {name} to be a positive int, got {value!r}")
        if not 0 < self.window <= 1:
            raise ValueError(f"{fn}: expected 0 < window <= 1, got window={self.window!r}")
        if not (self.lr > 0 and self.weight_decay > 0 and self.temperature > 0):
            raise ValueError(f"{fn}: expected lr, weight_decay and temperature > 0, got lr={self.lr!r}, "
                             f"weight_decay={self.weight_decay!r}, temperature={self.temperature!r}")
        if self.batch_size < 2:
            raise ValueError(f"{fn}: expected batch_size >= 2, got {self.batch_size}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"{fn}: expected warmup to be an int >= 0, got {self.warmup!r}")
        window_steps = self.steps - self.window_start
        if self.warmup > self.window_start:
            raise ValueError(f"{fn}: the warmup ({self.warmup} steps) must end before the window "
                             f"starts (step {self.window_start})")
        if window_steps < 2 * self.probe_every or window_steps < 2 * self.record_every:
            raise ValueError(f"{fn}: the window ({window_steps} steps) must hold at least two "
                             f"checkpoints and two records, got probe_every={self.probe_every}, "
                             f"record_every={self.record_every}")


def split_decay(encoder: torch.nn.Module, trained: str, no_decay: str | None
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
        raise ValueError(f"split_decay: no decayed parameter matches trained={trained!r} "
                         f"(no_decay={no_decay!r})")
    return decayed, exempt


# ----------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------
@dataclass
class Records:
    losses: list[float]
    trajectory: list[dict[str, float]]
    window_norms: list[np.ndarray]       # [records][n_probes]
    window_cosines: list[float]
    window_weight_norms: list[float]     # norm of the decayed parameters
    window_start: int
    stopped_at: int | None               # step at which a collapsed run was stopped
    seconds: float                       # training only (checkpoints excluded)
    cpu_seconds: float = 0.0             # process CPU time of the training only
    loop_seconds: float = 0.0            # the whole loop (training + checkpoints), every segment
    loop_cpu_seconds: float = 0.0
    segments: list[dict[str, Any]] = field(default_factory=list)  # each process that ran part of the loop


@dataclass
class Resume:
    """Where :func:`train` keeps its state, so that an interrupted run goes on where it stopped.

    The state (trained parameters, the batch generator, the records, the times, and each
    ``parts`` object's ``state_dict()``) is written atomically to ``path`` every ``every``
    steps before the window and after every checkpoint in it; a run started with the same
    settings and an existing ``path`` loads it and continues, drawing the same batches, so
    the result is the one an uninterrupted run gives. A state written with other settings
    or another ``identity`` (whatever else determines the result: the data, the probe's
    settings) is refused (ValueError naming them). ``path`` is removed when the run
    completes unless ``keep``.
    """

    path: Path
    every: int = 500
    parts: dict[str, Any] = field(default_factory=dict)
    keep: bool = False
    identity: dict[str, Any] = field(default_factory=dict)  # what else must match (data, probe settings)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"Resume: expected every to be a positive int, got {self.every!r}")

    def save(self, payload: dict[str, Any]) -> None:
        payload = {**payload, "parts": {k: v.state_dict() for k, v in self.parts.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_save(payload, self.path)

    def load(self, settings: TrainSettings, params: Sequence[torch.Tensor]) -> dict[str, Any] | None:
        if not self.path.exists():
            return None
        payload = torch.load(self.path, weights_only=False)
        for key, mine in (("settings", asdict(settings)), ("identity", self.identity)):
            if payload.get(key) != mine:
                raise ValueError(f"Resume: {self.path} was written with {key} {payload.get(key)}, this run "
                                 f"has {mine}; remove the file to start afresh")
        shapes = [tuple(p.shape) for p in params]
        if [tuple(t.shape) for t in payload["params"]] != shapes:
            raise ValueError(f"Resume: {self.path} holds parameters of shapes "
                             f"{[tuple(t.shape) for t in payload['params']]}, this run trains {shapes}")
        for name, part in self.parts.items():
            part.load_state_dict(payload["parts"][name])
        return payload


def mean_cosine(z: torch.Tensor) -> float:
    """Mean pairwise cosine of the rows of ``z`` (diagonal excluded): 1 means collapse."""
    n = z.shape[0]
    zh = torch.nn.functional.normalize(z.double(), dim=-1)
    return float((zh.sum(0).square().sum() - n) / (n * (n - 1)))


def _norm(params: Sequence[torch.Tensor]) -> float:
    if not params:
        return 0.0
    return float(torch.sqrt(sum(p.detach().double().square().sum() for p in params)))


def train(encoder: Any, pair_ids: np.ndarray, probe_items: Sequence[Any], settings: TrainSettings,
          groups: tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]], *,
          on_checkpoint: Callable[[int], None] | None = None, stop_on_collapse: bool = False,
          collapse_cosine: float = HealthThresholds.collapse_cosine, progress: bool = True,
          desc: str = "train", resume: Resume | None = None) -> Records:
    """SGD + decay on ``groups = (decayed, exempt)`` with InfoNCE on pairs of ``pair_ids`` rows.

    Each step draws ``batch_size`` distinct rows of ``pair_ids`` (``[n, 2]`` items that
    ``encoder.prepare`` accepts) and runs both sides in one call. ``on_checkpoint(i)``
    runs at every ``probe_every``-th step of the window; its time is not training time.
    With ``resume``, the state is saved along the way and an interrupted run continues
    from its last save (see :class:`Resume`).
    """
    from normfast.engine.objectives import InfoNCE

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
        return {"train": before["train"] + wall - checkpoint_seconds,
                "train_cpu": before["train_cpu"] + cpu - checkpoint_cpu,
                "loop": before["loop"] + wall, "loop_cpu": before["loop_cpu"] + cpu}

    def save(done: int) -> None:
        rec.segments[-1]["last_step"] = done
        resume.save({"settings": asdict(settings), "identity": resume.identity, "step": done, "rng": rng.bit_generator.state,
                     "params": [p.detach().clone() for p in params], "records": asdict(rec),
                     "seconds": times()})

    bar = tqdm(range(first, settings.steps), desc=desc, unit="step", disable=not progress,
               initial=first, total=settings.steps)
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
            rec.trajectory.append({"step": done,
                                   "loss_mean": float(np.mean(rec.losses[-settings.trajectory_every:])),
                                   "norm_median": float(zp.norm(dim=-1).median()),
                                   "mean_cosine": cosine, "decayed_weight_norm": _norm(decayed),
                                   "exempt_param_norm": _norm(exempt)})
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
        t["train"], t["train_cpu"], t["loop"], t["loop_cpu"])
    rec.segments[-1]["last_step"] = rec.stopped_at or settings.steps
    if resume is not None and not resume.keep:
        resume.path.unlink(missing_ok=True)
    return rec


def _halves_change(values: np.ndarray) -> np.ndarray:
    """|mean of the second half - mean of the first half| / overall mean, along axis 0."""
    half = len(values) // 2
    first, second = values[:half].mean(0), values[half:].mean(0)
    return np.abs(second - first) / values.mean(0)


def health(rec: Records, settings: TrainSettings,
           thresholds: HealthThresholds = HealthThresholds()) -> dict[str, Any]:
    """(a) loss below a fraction of chance, (b) no collapse, (c) stationarity, on recorded training."""
    chance = float(np.log(settings.batch_size))
    out: dict[str, Any] = {"loss_chance": chance, "stopped_at_step": rec.stopped_at}
    cosines = [t["mean_cosine"] for t in rec.trajectory] + list(rec.window_cosines)
    out["max_mean_cosine"] = float(max(cosines)) if cosines else float("nan")
    out["no_collapse"] = bool(cosines) and out["max_mean_cosine"] < thresholds.collapse_cosine
    window_losses = np.asarray(rec.losses[rec.window_start:])
    if rec.stopped_at is not None or len(rec.window_norms) < 2 or window_losses.size == 0:
        out.update(loss_below_chance=False, stationary=False, passed=False)
        return out
    per100 = [float(window_losses[i:i + 100].mean()) for i in range(0, len(window_losses), 100)]
    out["loss_window_mean"] = float(window_losses.mean())
    out["loss_window_max_100_step_mean"] = max(per100)
    out["loss_threshold"] = thresholds.loss_fraction_of_chance * chance
    out["loss_below_chance"] = out["loss_window_max_100_step_mean"] < out["loss_threshold"]
    norms = np.stack(rec.window_norms)
    out["norm_change_between_window_halves_median"] = float(np.median(_halves_change(norms)))
    weights = np.asarray(rec.window_weight_norms)
    out["decayed_weight_norm_change_between_window_halves"] = float(_halves_change(weights))
    out["decayed_weight_norm_window"] = [float(weights.min()), float(weights.max())]
    out["mean_cosine_window"] = float(np.mean(rec.window_cosines))
    out["stationary"] = (out["norm_change_between_window_halves_median"] < thresholds.norm_change_max
                         and out["decayed_weight_norm_change_between_window_halves"]
                         < thresholds.weight_change_max)
    out["passed"] = bool(out["loss_below_chance"] and out["no_collapse"] and out["stationary"])
    return out


def pilot(encoder: Any, pair_ids: np.ndarray, probe_items: Sequence[Any], base: TrainSettings,
          candidates: Sequence[dict[str, Any]], *, trained: str, no_decay: str | None,
          thresholds: HealthThresholds = HealthThresholds(), progress: bool = True,
          desc: str = "pilot") -> dict[str, Any]:
    """Train each candidate (``TrainSettings`` overrides, e.g. ``{"lr": .1, "weight_decay": 1e-2}``)
    in order from the same initial parameters, health only; stop at the first that passes.

    A candidate whose probe embeddings collapse is stopped there. Never computes the law's
    inputs or a fit. Returns the record: rule, criteria, fixed settings, every candidate's
    health and trajectory, the chosen one (None if none passed) and the times.
    """
    state = {n: p.detach().clone() for n, p in encoder.named_parameters()}
    results, chosen = [], None
    for overrides in candidates:
        with torch.no_grad():  # every candidate starts from the same parameters
            for n, p in encoder.named_parameters():
                p.copy_(state[n])
        s = replace(base, **overrides)
        groups = split_decay(encoder, trained, no_decay)
        label = " ".join(f"{k}={v}" for k, v in overrides.items())
        rec = train(encoder, pair_ids, probe_items, s, groups, stop_on_collapse=True,
                    collapse_cosine=thresholds.collapse_cosine, progress=progress, desc=f"{desc} {label}")
        h = health(rec, s, thresholds)
        results.append({**overrides, "eta_times_lambda": s.lr * s.weight_decay, "steps": s.steps,
                        "health": h, "train_seconds": round(rec.seconds, 1),
                        "train_cpu_seconds": round(rec.cpu_seconds, 1), "trajectory": rec.trajectory})
        if h["passed"]:
            chosen = dict(overrides)
            break
    with torch.no_grad():
        for n, p in encoder.named_parameters():
            p.copy_(state[n])
    fixed = {k: v for k, v in asdict(base).items()
             if not any(k in c for c in candidates) and k not in ("probe_every",)}
    return {
        "rule": "candidates in the listed order; the first that passes (a), (b) and (c) is chosen; a "
                "candidate whose probe embeddings collapse is stopped there; no fit is computed",
        "criteria": thresholds.criteria_text(),
        "fixed": {**fixed, "trained": trained, "no_decay": no_decay, "probe_items": len(probe_items)},
        "candidates_declared": [dict(c) for c in candidates],
        "results": results,
        "chosen": chosen,
    }


# ----------------------------------------------------------------------------
# the law at checkpoints
# ----------------------------------------------------------------------------
class CheckpointLaw:
    """The engine at checkpoints; statistics averaged over them; the law on the averages.

    ``probe_fn(seed)`` runs the engine once (a fresh seed, hence fresh virtual
    batches, per checkpoint) and returns its :class:`~normfast.engine.result.ProbeResult`.
    """

    COLUMNS = ("D", "Q", "V2", "se_D", "kappa", "kappa_exempt", "norm")

    def __init__(self, probe_fn: Callable[[int], Any], seed: int):
        self.probe_fn = probe_fn
        self.seed = seed
        self.columns: dict[str, list[np.ndarray]] = {k: [] for k in self.COLUMNS}
        self.last: dict[str, Any] | None = None  # the last checkpoint's r_eq, r_eq_heat and regime
        self.seconds = 0.0
        self.cpu_seconds = 0.0

    def __call__(self, i: int) -> None:
        """Probe checkpoint ``i`` now, at the current parameters."""
        self.add(self.measure(i))

    def measure(self, i: int) -> dict[str, Any]:
        """The engine at checkpoint ``i`` (seed ``7919·seed + i``): its columns, the last-checkpoint
        entries and its times, without adding them (:meth:`add` does)."""
        t0, c0 = time.perf_counter(), time.process_time()
        res = self.probe_fn(self.seed * 7919 + i)
        return {"columns": {col: np.asarray(res.column(col)) for col in self.COLUMNS},
                "last": {"r_eq": np.asarray(res.column("r_eq")), "r_eq_heat": np.asarray(res.column("r_eq_heat")),
                         "regime": res.metadata.get("regime")},
                "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}

    def add(self, entry: dict[str, Any]) -> None:
        """Append one checkpoint's :meth:`measure` (checkpoints in order)."""
        for col in self.COLUMNS:
            self.columns[col].append(entry["columns"][col])
        self.last = entry["last"]
        self.seconds += entry["seconds"]
        self.cpu_seconds += entry["cpu_seconds"]

    def state_dict(self) -> dict[str, Any]:
        """Everything gathered so far (for :class:`Resume`)."""
        return {"columns": self.columns, "last": self.last, "seconds": self.seconds,
                "cpu_seconds": self.cpu_seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = set(self.COLUMNS) - set(state["columns"])
        if missing:
            raise ValueError(f"CheckpointLaw.load_state_dict: the state lacks the columns {sorted(missing)}")
        self.columns = {k: list(state["columns"][k]) for k in self.COLUMNS}
        self.last, self.seconds, self.cpu_seconds = state["last"], state["seconds"], state["cpu_seconds"]

    @property
    def n(self) -> int:
        return len(self.columns["D"])

    def averages(self) -> dict[str, np.ndarray]:
        if self.n == 0:
            raise RuntimeError("CheckpointLaw: no checkpoint was probed")
        return {k: np.stack(v).mean(0) for k, v in self.columns.items()}

    def predictions(self, lr: float, weight_decay: float) -> dict[str, np.ndarray]:
        """``full``/``heat`` from the averaged D, Q, κ; ``last_full``/``last_heat`` from the last checkpoint."""
        from normfast.core.equilibrium import equilibrium_norm

        avg = self.averages()
        zero = np.zeros_like(avg["D"])
        law = dict(lr=lr, weight_decay=weight_decay)
        return {"full": np.asarray(equilibrium_norm(avg["D"], avg["Q"], avg["kappa"], **law)),
                "heat": np.asarray(equilibrium_norm(zero, avg["Q"], avg["kappa"], **law)),
                "last_full": np.asarray(self.last["r_eq"]),
                "last_heat": np.asarray(self.last["r_eq_heat"])}

    def regime(self, lr: float, weight_decay: float) -> dict[str, Any]:
        """The regime check of the averaged statistics.

        The se of the averaged drift is ``sqrt(mean se_D²) / sqrt(n)``: the checkpoints draw
        independent virtual batches (the drift's own variation along the trajectory is not in it).
        """
        from normfast.engine.regime import classify_rows, run_regime

        avg = self.averages()
        se = np.sqrt(np.mean(np.square(np.stack(self.columns["se_D"])), axis=0) / self.n)
        cols = {**avg, "valid": np.isfinite(avg["D"]) & np.isfinite(avg["kappa"]), "se_D": se}
        rows = classify_rows(cols, lr=lr, weight_decay=weight_decay)
        out = run_regime([{**cols, **rows}])
        out["rows"] = {k: rows[k].tolist() for k in ("regime", "regime_reason")}
        out["last_checkpoint"] = self.last["regime"]
        return out


# ----------------------------------------------------------------------------
# checkpoints probed after training, on every core
# ----------------------------------------------------------------------------
class CheckpointSnapshots:
    """The trained parameters at every checkpoint, one file each in ``folder``, probed later.

    As ``train(on_checkpoint=...)`` it saves ``params`` (a copy) as checkpoint ``i``;
    :func:`probe_checkpoints` then runs the engine on every snapshot and stores each
    result beside it, so an interrupted run loses at most the checkpoints being probed.
    ``identity`` (whatever determines the snapshots: settings, data) is written to the
    folder; a folder written with another identity is refused (ValueError), so results
    of different runs never mix.
    """

    def __init__(self, params: Sequence[torch.Tensor], folder: str | Path, identity: dict[str, Any] | None = None):
        self.params = list(params)
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        tag = self.folder / "identity.json"
        mine = json.dumps(identity or {}, sort_keys=True, default=str)
        if tag.exists() and tag.read_text() != mine:
            raise ValueError(f"CheckpointSnapshots: {self.folder} holds the checkpoints of another run "
                             f"({tag.read_text()[:200]}); remove the folder to start afresh")
        tag.write_text(mine)

    def _path(self, i: int, kind: str) -> Path:
        return self.folder / f"{i:05d}.{kind}.pt"

    def __call__(self, i: int) -> None:
        _atomic_save([p.detach().clone() for p in self.params], self._path(i, "params"))

    def indices(self) -> list[int]:
        return sorted(int(f.name.split(".")[0]) for f in self.folder.glob("*.params.pt"))

    def load_into(self, i: int) -> None:
        """Copy checkpoint ``i``'s parameters into ``params``."""
        saved = torch.load(self._path(i, "params"), weights_only=True)
        with torch.no_grad():
            for p, t in zip(self.params, saved):
                p.copy_(t)

    def has_result(self, i: int) -> bool:
        return self._path(i, "result").exists()

    def result(self, i: int) -> dict[str, Any]:
        return torch.load(self._path(i, "result"), weights_only=False)

    def save_result(self, i: int, result: dict[str, Any]) -> None:
        _atomic_save(result, self._path(i, "result"))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


_JOB: dict[str, Any] = {}  # what a forked probe worker needs (set before the pool forks)


def _probe_job(i: int) -> float:
    """Worker: every law at checkpoint ``i``, the result stored beside the snapshot; returns its CPU seconds."""
    laws, snapshots = _JOB["laws"], _JOB["snapshots"]
    c0 = time.process_time()
    snapshots.load_into(i)
    snapshots.save_result(i, {name: law.measure(i) for name, law in laws.items()})
    return time.process_time() - c0


def _worker_threads(n: int) -> None:
    torch.set_num_threads(n)


def probe_checkpoints(laws: dict[str, CheckpointLaw], snapshots: CheckpointSnapshots, *,
                      workers: int | None = None, progress: bool = True, desc: str = "probe checkpoints"
                      ) -> dict[str, float]:
    """Run every law at every snapshot not probed yet and add all results to the laws in order.

    ``workers`` processes (forked, each on ``threads // workers`` torch threads; default: one
    per torch thread) probe one checkpoint each at a time; each result is stored beside its
    snapshot as it comes (an interrupted call loses only the checkpoints in flight). One
    worker probes in this process; the parameters hold their values from before the call
    afterwards. Returns the phase's wall seconds, its CPU seconds (this process and the
    workers), the workers' share of them and the number of workers.
    """
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    t0, c0 = time.perf_counter(), time.process_time()
    todo = [i for i in snapshots.indices() if not snapshots.has_result(i)]
    threads = torch.get_num_threads()
    workers = max(1, min(workers or threads, len(todo) or 1))
    bar = tqdm(total=len(todo), desc=desc, unit="checkpoint", disable=not progress)
    worker_cpu = 0.0
    current = [p.detach().clone() for p in snapshots.params]
    _JOB.update(laws=laws, snapshots=snapshots)
    try:
        if workers == 1:
            for i in todo:  # its CPU time is this process's own
                _probe_job(i)
                bar.update()
        else:
            with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork"), initializer=_worker_threads,
                                     initargs=(max(1, threads // workers),)) as pool:
                for fut in as_completed([pool.submit(_probe_job, i) for i in todo]):
                    worker_cpu += fut.result()
                    bar.update()
    finally:
        _JOB.clear()
        with torch.no_grad():
            for p, t in zip(snapshots.params, current):
                p.copy_(t)
    bar.close()
    for i in snapshots.indices():
        result = snapshots.result(i)
        for name, law in laws.items():
            law.add(result[name])
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0 + worker_cpu,
            "worker_cpu_seconds": worker_cpu, "workers": workers if todo else 0}

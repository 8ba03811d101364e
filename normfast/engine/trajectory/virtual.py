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
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from normfast.engine.config import ProbeConfig, ProbePlan, as_plan

#: samples per block of the meter's drift (the blocks' spread gives se_D and the snapshot's shrinkage)
BLOCK = 25

#: the columns averaged over the probe points
AVERAGED = ("norm", "D", "Q", "V2", "m2", "D_w", "Q_w", "V2_w", "m2_w", "C_uw", "kappa")


@dataclass
class Trajectory:
    """Per-point probe statistics along a virtual trajectory."""

    steps: list[int]  # the step of each probe point
    columns: dict[str, np.ndarray]  # name -> [points, rows]
    losses: list[float]  # the virtual objective at every step
    meter: dict[str, np.ndarray] | None = None  # TrajectoryMeter.statistics() over every step

    def mean(self) -> dict[str, np.ndarray]:
        """Every column averaged over the probe points."""
        return {k: v.mean(0) for k, v in self.columns.items()}

    def halves(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """The column averaged over the first and the second half of the points."""
        v = self.columns[name]
        h = v.shape[0] // 2
        return v[:h].mean(0), v[h:].mean(0)


def make_optimizer(
    params_by_decay: tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]], config: ProbeConfig, preset: str
) -> torch.optim.Optimizer:
    """torch's optimizer for a preset; ``params_by_decay`` = (decayed, exempt)."""
    decayed, exempt = params_by_decay
    groups = [{"params": decayed, "weight_decay": config.weight_decay}]
    if exempt:
        groups.append({"params": exempt, "weight_decay": 0.0})
    if preset == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps)
    return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum)


class TrajectoryMeter:
    """The law's statistics averaged along a trajectory, from one update direction per state.

    The drift of a state fluctuates along a stationary trajectory far more than
    between batches at one state (E1: the drift's temporal spread is 10-50x the
    spread of its window mean between items, its batch noise at 64 batches only
    0.1-0.5x the temporal spread, and it decorrelates within ~20 steps). Its time
    average is therefore estimated best from many states with few batches each:
    here one direction ``p_B`` per state (a fresh batch's gradient mapped by the
    preset, without momentum), which gives an unbiased one-batch sample of the
    state's ``D = mean_B ẑ·u`` and of its ``Q = mean_B |u|²`` (``u = R t``,
    ``t = −J p_B``; AdamW: ``u = t``) at the cost of one jvp over the probe items.
    Averaged over the states: ``D``, ``Q``, ``κ`` (one more jvp along the decayed
    parameters, when asked), the norm, and optionally the curvature heat
    (:mod:`normfast.engine.trajectory.curvature`, one more forward per sample).

    The probed parameters may move between samples; the frozen front (the stages
    before the first probed parameter) must not. Pooled output; evaluated in
    ``dtype`` (float64 by default: the curvature remainder is a small difference).
    """

    def __init__(
        self,
        encoder: Any,
        probes: Sequence[Any],
        config: ProbeConfig | ProbePlan,
        *,
        curvature: bool = False,
        block: int = BLOCK,
        segment: int | None = None,
        n_segments: int = 0,
        dtype: torch.dtype = torch.float64,
    ):
        from normfast.engine.directions.parameters import resolve_parameters

        fn = "TrajectoryMeter"
        config = as_plan(config).config  # a plan as its caller checked it; a config checked here, once
        if not isinstance(config.optimizer, str):
            raise ValueError(
                f"{fn}: expected one optimizer preset for all probed parameters, got optimizer={config.optimizer!r}"
            )
        probes = list(probes)
        if not probes:
            raise ValueError(f"{fn}: expected at least one probe item, got none")
        self.encoder = encoder
        self.config = config
        self.adam = config.optimizer == "adamw"
        self.names = resolve_parameters(encoder, config.params)
        self.cut = min(encoder.stage_of_parameters()[n] for n in self.names)
        self.dtype = dtype
        self.curvature = curvature
        self.step = config.lr if self.adam else config.lr / (1.0 - config.momentum)
        state = encoder.prepare(probes)
        with torch.no_grad():
            front = encoder(state, 0, self.cut) if self.cut > 0 else state
        self.front = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in front.items()}
        import re

        exempt = re.compile(config.no_decay) if config.no_decay else None
        self.decayed = [n for n in self.names if not (exempt and exempt.search(n))]
        n = len(probes)
        self.sums = {k: torch.zeros(n, dtype=torch.float64) for k in ("D", "Q", "norm", "norm2", "c")}
        self.kappa_sum = torch.zeros(n, dtype=torch.float64)
        self.n = 0
        self.n_kappa = 0
        self.block = block
        self._block_sum = torch.zeros(n, dtype=torch.float64)
        self._block_n = 0
        self.blocks: list[torch.Tensor] = []
        if segment is not None and (segment < block or segment % block):
            raise ValueError(f"{fn}: segment must be a positive multiple of block={block}, got {segment}")
        self.segment = segment
        self.n_segments = n_segments
        self.segments: list[dict[str, torch.Tensor]] = []
        self._segment_start = self._snapshot_sums()

    def _snapshot_sums(self) -> dict[str, Any]:
        """The running sums and counts as they stand (a segment is the difference of two of these)."""
        out: dict[str, Any] = {k: v.clone() for k, v in self.sums.items()}
        out["kappa"] = self.kappa_sum.clone()
        out["n"], out["n_kappa"] = self.n, self.n_kappa
        return out

    def _f(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        from torch.func import functional_call

        chosen = set(self.names)
        frozen = {n: p.detach().to(self.dtype) for n, p in self.encoder.named_parameters() if n not in chosen}
        return functional_call(
            self.encoder, {**frozen, **params}, (self.front,), {"start": self.cut, "output": "pooled"}, strict=False
        )

    def direction(
        self, grads: Mapping[str, torch.Tensor], second_moments: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The preset's update direction ``p_B`` for one batch's gradients (AdamW: ``ĝ/(sqrt(v̂)+eps)``)."""
        if not self.adam:
            return {n: grads[n] for n in self.names}
        if second_moments is None:
            raise ValueError("TrajectoryMeter.direction: AdamW needs the second moments v̂")
        return {n: grads[n] / (second_moments[n].sqrt() + self.config.eps) for n in self.names}

    @torch.no_grad()
    def add(self, direction: Mapping[str, torch.Tensor], *, kappa: bool = True) -> None:
        """One sample at the encoder's present parameters along ``direction`` (``p_B``)."""
        from torch.func import jvp

        from normfast.encoders import forward_ad_safe

        params = {n: self.encoder.get_parameter(n).detach().to(self.dtype) for n in self.names}
        p = {n: direction[n].detach().to(self.dtype) for n in self.names}
        with forward_ad_safe():
            z, jp = jvp(self._f, (params,), (p,))
            r2 = z.square().sum(-1)
            R = r2.sqrt()
            zhat = z / R[:, None]
            t = -jp
            u = t if self.adam else t * R[:, None]
            d = (zhat * u).sum(-1).double()
            self.sums["D"] += d
            self.sums["Q"] += u.square().sum(-1).double()
            self.sums["norm"] += R.double()
            self.sums["norm2"] += r2.double()
            if self.curvature:
                lin = z - self.step * jp
                moved = self._f({n: params[n] - self.step * p[n] for n in self.names})
                self.sums["c"] += (moved.square().sum(-1) - lin.square().sum(-1)).double()
            if kappa:
                self.kappa_sum += self._kappa(params, z, r2)
                self.n_kappa += 1
        self.n += 1
        self._block_sum += d
        self._block_n += 1
        if self._block_n == self.block:
            self.blocks.append(self._block_sum / self.block)
            self._block_sum = torch.zeros_like(self._block_sum)
            self._block_n = 0
        if self.segment is not None and self.n % self.segment == 0 and len(self.segments) < self.n_segments - 1:
            self._close_segment()

    def _close_segment(self) -> None:
        now = self._snapshot_sums()
        self.segments.append({k: now[k] - self._segment_start[k] for k in now})
        self._segment_start = now

    def _kappa(self, params: dict[str, torch.Tensor], z: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
        """κ = ẑ·(J θ_decayed)/R per row at ``params`` (one jvp along the decayed probed parameters)."""
        from torch.func import jvp

        tangent = {n: (params[n] if n in self.decayed else torch.zeros_like(params[n])) for n in self.names}
        _, jd = jvp(self._f, (params,), (tangent,))
        return ((z * jd).sum(-1) / r2).double()

    @torch.no_grad()
    def kappa(self) -> np.ndarray:
        """κ per row at the encoder's present parameters (recorded nowhere: a reading, not a sample)."""
        from normfast.encoders import forward_ad_safe

        params = {n: self.encoder.get_parameter(n).detach().to(self.dtype) for n in self.names}
        with forward_ad_safe():
            z = self._f(params)
            return self._kappa(params, z, z.square().sum(-1)).numpy()

    def statistics(self) -> dict[str, Any]:
        """Means over the samples: ``D``/``Q`` (SGD) or ``D_w``/``Q_w`` (AdamW), ``kappa``, ``norm``,
        ``norm_rms`` (``sqrt`` of the mean ``R²``: the continuation's own stationary-norm estimate),
        ``se_D`` (from the means of consecutive blocks of samples), ``Q_curv``/``Q_curv_w`` and the
        remainder ``c`` per step when measured; ``D_blocks`` (``[blocks, rows]``) the drift's
        means over consecutive blocks of ``block`` samples; ``n`` the number of samples.

        With segments (``n_segments``), also ``jackknife``: one dict of the same statistics per
        segment, computed from every sample but that segment's (its blocks left out of
        ``D_blocks``), for a delete-a-segment jackknife of anything derived from them."""
        if self.n == 0 or self.n_kappa == 0:
            raise ValueError("TrajectoryMeter.statistics: needs at least one sample with kappa")
        total = self._snapshot_sums()
        blocks = torch.stack(self.blocks).numpy() if self.blocks else None
        out = self._means(total, blocks)
        if self.segments:  # the last segment: the samples after the others (one segment or more of them)
            segs = [*self.segments, {k: total[k] - self._segment_start[k] for k in total}]
            per = self.segment // self.block
            out["jackknife"] = []
            for j, seg in enumerate(segs):
                keep = np.ones(len(self.blocks), dtype=bool)
                keep[j * per : (j + 1) * per if j < len(segs) - 1 else None] = False
                out["jackknife"].append(
                    self._means({k: total[k] - seg[k] for k in total}, blocks[keep] if blocks is not None else None)
                )
        return out

    def _means(self, sums: Mapping[str, Any], blocks: np.ndarray | None) -> dict[str, Any]:
        n = sums["n"]
        mean = {k: (sums[k] / n).numpy() for k in self.sums}
        sfx = "_w" if self.adam else ""
        out = {
            f"D{sfx}": mean["D"],
            f"Q{sfx}": mean["Q"],
            "norm": mean["norm"],
            "norm_rms": np.sqrt(mean["norm2"]),
            "kappa": (sums["kappa"] / sums["n_kappa"]).numpy(),
            "n": n,
        }
        if blocks is not None and len(blocks) >= 1:
            out[f"D{sfx}_blocks"] = blocks
            if len(blocks) >= 2:
                out[f"se_D{sfx}"] = blocks.std(0, ddof=1) / np.sqrt(len(blocks))
        if self.curvature:
            out["c"] = mean["c"]
            out[f"Q_curv{sfx}"] = mean["c"] / self.step**2 * (1.0 if self.adam else mean["norm"] ** 2)
        return out


def virtual_trajectory(
    encoder: Any,
    probes: Sequence[Any],
    objective: Any,
    pairs: Any,
    config: ProbeConfig | ProbePlan,
    *,
    steps: int,
    points: int = 0,
    meter: bool = True,
    curvature: bool = False,
    kappa_every: int = 10,
    segments: int = 0,
    second_moments: Mapping[str, torch.Tensor] | None = None,
    measure: Callable[[Any, int, Mapping[str, torch.Tensor] | None], Any] | None = None,
    columns: Sequence[str] = AVERAGED,
    progress: bool = True,
) -> Trajectory:
    """Train a copy of ``encoder`` for ``steps`` virtual steps; measure the law's statistics along it.

    With ``meter`` (the default) every step also feeds a :class:`TrajectoryMeter`
    with its own batch's direction, taken at the state the gradient was computed
    at (pooled output; ``curvature`` adds the curvature heat; κ every
    ``kappa_every`` steps; ``segments`` > 0 also keeps the meter's sums over that many
    contiguous segments of whole blocks (the last one takes the remaining steps), for a
    delete-a-segment jackknife). With ``points > 0`` the engine's full probe also runs
    at ``points`` evenly spaced steps (the last at ``steps``): ``measure(model, step,
    second_moments)`` runs there and returns a probe result (``column_names``,
    ``column(name)``), e.g. ``lambda m, step, v: normfast.probe(m, probes, objective,
    pairs, replace(config, seed=step), second_moments=v, progress=False)`` -- fresh
    virtual batches at every point. (A callback, not a call of the probe loop here: the
    probe loop sits above this module, and its snapshot predictor uses it.)

    ``config`` is the probe configuration (or its :class:`~normfast.engine.config.ProbePlan`, as a
    probe's snapshot stage passes it: not checked again) and also sets the virtual optimizer:
    ``optimizer`` (one preset for all probed parameters), ``lr``,
    ``weight_decay``, ``momentum`` / ``betas``, ``eps``, ``no_decay``,
    ``batch_size``. The trajectory's own batches come from ``config.seed``.
    """
    import re

    from normfast.data.batches import virtual_batches
    from normfast.data.pairs import PairSource, as_pair_source
    from normfast.engine.directions.gradients import batch_loss, estimate_second_moments
    from normfast.engine.directions.objectives import get_objective
    from normfast.engine.directions.parameters import adam_second_moments, resolve_parameters

    fn = "virtual_trajectory"
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{fn}: expected steps to be a positive integer, got steps={steps!r}")
    if isinstance(points, bool) or not isinstance(points, int) or not 0 <= points <= steps:
        raise ValueError(f"{fn}: expected points to be an integer in [0, steps={steps}], got points={points!r}")
    if points and measure is None:
        raise ValueError(f"{fn}: points={points} needs measure= (the probe to run at each point)")
    if not meter and points == 0:
        raise ValueError(f"{fn}: nothing to measure: meter=False and points=0")
    if isinstance(kappa_every, bool) or not isinstance(kappa_every, int) or kappa_every < 1:
        raise ValueError(f"{fn}: expected kappa_every to be a positive integer, got {kappa_every!r}")
    plan = as_plan(config)  # a probe's stage passes its plan (and its objective and pair source) as resolved
    config = plan.config
    if not isinstance(config.optimizer, str):
        raise ValueError(
            f"{fn}: expected one optimizer preset for all probed parameters, got optimizer={config.optimizer!r}"
        )
    if isinstance(objective, str):
        objective = get_objective(objective)
    if not isinstance(pairs, PairSource):
        pairs = as_pair_source(pairs, objective, probes)
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
            v = estimate_second_moments(
                model,
                objective,
                pairs,
                names,
                batches[: max(config.batches, 2)],
                seed=config.seed,
                progress=False,
                check_invariance=False,
            )
        start_adam(opt, model, names, v)

    at = sorted({int(round(steps * (k + 1) / points)) for k in range(points)}) if points else []
    segment = None
    if segments:
        if isinstance(segments, bool) or not isinstance(segments, int) or segments < 2 or steps < segments * BLOCK:
            raise ValueError(
                f"{fn}: expected segments to be an integer >= 2 with steps >= segments x {BLOCK}, "
                f"got segments={segments!r}, steps={steps}"
            )
        segment = BLOCK * (steps // segments // BLOCK)
    tracker = (
        TrajectoryMeter(model, probes, plan, curvature=curvature, segment=segment, n_segments=segments)
        if meter
        else None
    )
    params = [model.get_parameter(n) for n in names]
    cols: dict[str, list[np.ndarray]] = {}
    losses: list[float] = []
    was_training = model.training
    model.train(bool(getattr(objective, "uses_dropout", False)))
    bar = tqdm(range(1, steps + 1), desc="virtual trajectory", unit="step", disable=not progress, leave=False)
    for step in bar:
        loss = batch_loss(model, objective, pairs, batches[step - 1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if tracker is not None:  # at the state the gradient was taken at, before the step
            grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in zip(names, params)}
            sm = adam_second_moments(opt, model) if config.optimizer == "adamw" else None
            tracker.add(tracker.direction(grads, sm), kappa=(step - 1) % kappa_every == 0)
        opt.step()
        losses.append(float(loss.detach()))
        if step in at:
            model.train(was_training)
            sm = adam_second_moments(opt, model) if config.optimizer == "adamw" else None
            res = measure(model, step, sm)
            for c in columns:
                if c in res.column_names:
                    cols.setdefault(c, []).append(res.column(c))
            model.train(bool(getattr(objective, "uses_dropout", False)))
    model.train(was_training)
    return Trajectory(
        at, {k: np.stack(v) for k, v in cols.items()}, losses, tracker.statistics() if tracker is not None else None
    )


def start_adam(opt: torch.optim.Optimizer, model: Any, names: Sequence[str], v: Mapping[str, torch.Tensor]) -> None:
    """Seed AdamW's state with ``v̂`` (bias correction spent) and a zero first moment."""
    big_step = 1e6  # 1 - beta**step == 1 for any beta < 1 in float arithmetic
    for n in names:
        p = model.get_parameter(n)
        st = opt.state[p]
        st["step"] = torch.tensor(big_step)
        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = v[n].detach().to(p).clone() if n in v else torch.zeros_like(p)

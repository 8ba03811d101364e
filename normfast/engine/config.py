"""``ProbeConfig``: everything that defines a probe run besides the model, probes, objective and pairs;
and ``ProbePlan``: one call's config, checked once by its entry point and resolved for the stages.

A config is the user's: mutable, checked by nothing until it is used. An entry point
(:func:`normfast.probe`, :class:`~normfast.engine.prober.Prober`, the CLI, the snapshot's trajectory
when called on its own) turns it into a plan with :meth:`ProbeConfig.resolve`, once; the stages
receive the plan and never check the settings again. The plan holds its own copy of the settings
(:class:`SettledConfig`, closed to changes), so a change to the user's config after the call
began -- an in-place edit of its ``optimizer`` dict or ``batch_indices`` included -- is seen by the
next call, which resolves it afresh, and by no stage of this one.
"""

from __future__ import annotations

import copy
import re
from dataclasses import FrozenInstanceError, dataclass, replace
from typing import Any, Mapping, Sequence

import numpy as np

from normfast.core.checks import check_groups

# Default M_D (DEFAULT_DRIFT_BATCHES): 1024 drift batches put se_D near 0.3 |D| at a per-batch drift
# signal-to-noise of ~0.1 (DESIGN §1); its cost is M_D gradients once per run, whatever the number of probes.
from normfast.engine.defaults import DEFAULT_DRIFT_BATCHES, DEFAULT_GROUPS, MODES
from normfast.engine.directions.presets import PRESETS, OptimizerPreset

OUTPUTS = ("pooled", "tokens")


@dataclass
class ProbeConfig:
    """Everything that defines a probe run besides the model, probes, objective and pairs.

    Attributes:
        params: probed parameters: ``"all"``, ``"head"``, a regex over names, or a list of names.
        mode: ``"head"`` (closed form, needs ``P`` = the final linear map), ``"jvp"``
            (general), or ``"auto"`` (head when applicable).
        output: ``"pooled"`` (one row per input) or ``"tokens"`` (one row per token position).
        optimizer: ``"sgd"`` or ``"adamw"``, or ``{regex: preset}`` for parameter groups
            with different presets (then both branches and the cross term ``C_uw`` appear).
        lr, weight_decay: η and λ of the law (decoupled weight decay).
        momentum: heavy-ball SGD momentum β; the law uses the heuristic η -> η/(1-β). Refused
            unless some probed parameter uses the ``"sgd"`` preset (AdamW's is ``betas[0]``).
        betas, eps: AdamW settings (β2 only matters through ``v̂``).
        no_decay: regex of probed parameters exempt from weight decay (e.g. ``"bias|LayerNorm"``).
        batches: M, the number of virtual batches of the heat (V2) and the second moments (≥ 2).
        drift_batches: M_D, the virtual batches of the drift (``D``/``D_w``, ``m2``, ``se_D``,
            ``sign_stability``), taken from the mean update direction over them (one extra
            directional pass per group, or one GEMM in head mode, for any M_D; DESIGN §1, "drift
            from the mean direction"). Default 1024: with the drift's per-batch signal-to-noise of
            about 0.1, se_D ≈ 0.3 |D|. The first M of them are the heat batches. ``None`` or 0:
            the drift from the M heat batches, per batch (the estimator before M_D existed).
        heat_sampling: how the heat's M batches are chosen. ``"energy"`` (default): drawn from the
            M_D drift batches, whose gradients the drift computes anyway, with probability rising
            with each batch's gradient energy (∝ energy), and weighted so that V2, m2
            and Q stay unbiased; the heat's level then holds across seeds where a few rare batches
            carry most of the energy (:mod:`normfast.engine.directions.sampling`). ``"uniform"``:
            the first M of the drift's batches, unweighted (the plain estimator). The plain one is
            also what runs without a pool to draw from: ``drift_batches=None``, explicit
            ``batch_indices``, or parameter groups of both optimizer branches (the metadata's
            ``heat_sampling`` says which ran and why).
        groups: K, the groups of virtual batches behind every error bar (batch ``b`` belongs to
            group ``b mod K``; capped at M): ``se_D`` and ``sign_stability`` come from the K group
            drifts, ``se_V2``, ``se_Q`` and the R_eq intervals from the delete-a-group jackknife,
            with K−1 degrees of freedom (:mod:`normfast.engine.estimators.uncertainty`). ≥ 2.
        batch_size: pairs / items per virtual batch (≥ 2).
        seed: drives batch sampling and dropout; equal seeds give equal tables.
        batch_indices: the virtual batches themselves instead of a random draw (e.g. a training
            run's batches, or the batches of a brute-force check): sequences of ``batch_size``
            distinct indices into the pair source, in the layout of the draw they replace -- one
            list for both estimates. With the drift from the mean direction (``drift_batches`` =
            M_D) it holds the M_D drift batches, of which the first M (``batches``) are also the
            heat's; with ``drift_batches=None`` it holds the M heat batches, which give the drift
            too. So an explicit run never mixes in randomly drawn batches. The count and the sizes
            are checked here (the error says which setting to change), the indices against the
            pair source when the probe starts; the seed still drives dropout.
        chunk_size: probe items (inputs) per chunk, the unit of streaming and resume.
        directions_per_pass: K directions per forward-mode pass (None: from the memory budget, or
            1 for an encoder whose ``batched_directions`` is False, e.g. a cached front in length groups).
        memory_budget_mb: working-memory budget that sets K and the loop order.
        uncertainty: error bars on every estimate (default): ``se_D``, ``sign_stability``,
            ``se_V2``, ``se_Q`` and 95% intervals of ``r_eq``/``r_eq_heat`` from K batch groups
            (head mode: the grouped closed form; jvp mode: one accumulator per group).
            ``False``: the bare estimates (head mode: the S form; jvp mode: per-batch se_D).
        radial_spread: head mode only: the per-batch form (se_D and sign_stability from every
            batch's radial dot; its cost grows with M; no se_V2).
        target_rse: adaptive M: add K virtual batches at a time (one per group) until the
            ``target_quantile`` of the rows' relative standard error of the heat, se(V2)/V2, is at
            most this (e.g. 0.1), or M reaches ``max_batches``; measured on the first chunk of
            probe items, so the M chosen is the same for a seed however the run is streamed,
            resumed or sharded. None (default): M = ``batches``.
        max_batches, target_quantile: the cap on the adaptive M, and the quantile of se(V2)/V2
            over the first chunk's rows that must reach ``target_rse``.
        snapshot: add the single-snapshot predictor ``r_eq_snapshot`` (with ``D_snapshot``,
            ``Q_snapshot``): a virtual continuation of the model from this snapshot on the pair
            source, the law solved with its shrunk drift and its heat plus curvature heat
            (:mod:`normfast.engine.trajectory.snapshot`, which states its validated scope). Pooled output, one
            optimizer preset. Costly: ``T`` virtual steps, each one backward over a batch and two
            jvps over every probe item.
        snapshot_relaxations, snapshot_min_steps, snapshot_max_steps: ``T`` = this many relaxation
            times of R² (``1/(2η'λκ̃)``, κ̃ the median κ at the snapshot), clipped to
            [min, max] steps; E1 validated 4 relaxations, at least 500 steps.
        snapshot_steps: ``T`` exactly (overrides the rule).
        device: where the model runs (default: the encoder's device).
    """

    params: str | list[str] = "all"
    mode: str = "auto"
    output: str = "pooled"
    optimizer: str | dict[str, str] = "sgd"
    lr: float = 1e-3
    weight_decay: float = 1e-2
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    no_decay: str | None = None
    batches: int = 16
    drift_batches: int | None = DEFAULT_DRIFT_BATCHES
    heat_sampling: str = "energy"
    groups: int = DEFAULT_GROUPS
    batch_size: int = 32
    seed: int = 0
    batch_indices: list[list[int]] | None = None
    chunk_size: int = 64
    directions_per_pass: int | None = None
    memory_budget_mb: float = 2048
    uncertainty: bool = True
    radial_spread: bool = False
    target_rse: float | None = None
    max_batches: int = 256
    target_quantile: float = 0.9
    snapshot: bool = False
    snapshot_relaxations: float = 4.0
    snapshot_min_steps: int = 500
    snapshot_max_steps: int = 20000
    snapshot_steps: int | None = None

    def validate(self) -> None:
        """Check every field; raises ``ValueError``/``TypeError`` naming the field. The same checks as
        :meth:`resolve`, without keeping the plan; nothing is cached, and the config is not changed."""
        self.resolve()

    def resolve(self) -> "ProbePlan":
        """Check every field once and resolve the settings into the :class:`ProbePlan` the stages receive
        (raises ``ValueError``/``TypeError`` naming the field). The config itself is not changed: the plan
        holds its own copy of the settings, with ``batch_indices`` as checked."""
        fn = "ProbeConfig"
        if self.mode not in MODES:
            raise ValueError(f"{fn}: mode must be one of {MODES}, got {self.mode!r}")
        if self.output not in OUTPUTS:
            raise ValueError(f"{fn}: output must be one of {OUTPUTS}, got {self.output!r}")
        for name in ("batches", "batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 2:
                what = "M (virtual batches)" if name == "batches" else name
                raise ValueError(
                    f"{fn}: {what} must be an integer >= 2 (a variance needs two batches), got {name}={v!r}"
                )
        from normfast.engine.directions.sampling import HEAT_SAMPLING

        if self.heat_sampling not in HEAT_SAMPLING:
            raise ValueError(f"{fn}: heat_sampling must be one of {HEAT_SAMPLING}, got {self.heat_sampling!r}")
        self._validate_drift(fn)
        self._validate_adaptive(fn)
        self._validate_snapshot(fn)
        batch_indices = None if self.batch_indices is None else self._validate_batch_indices(fn)
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"{fn}: chunk_size must be a positive integer, got {self.chunk_size!r}")
        if self.directions_per_pass is not None and (
            not isinstance(self.directions_per_pass, int) or self.directions_per_pass < 1
        ):
            raise ValueError(
                f"{fn}: directions_per_pass must be a positive integer or None, got {self.directions_per_pass!r}"
            )
        if not self.memory_budget_mb > 0:
            raise ValueError(f"{fn}: memory_budget_mb must be > 0, got {self.memory_budget_mb!r}")
        names = [self.optimizer] if isinstance(self.optimizer, str) else list(self.optimizer.values())
        for p in names:
            if p not in PRESETS:
                raise ValueError(f"{fn}: optimizer presets must be in {PRESETS}, got {p!r}")
        if self.momentum and "sgd" not in names:
            raise ValueError(
                f"{fn}: momentum (heavy-ball beta) applies to the sgd preset only, got "
                f"momentum={self.momentum!r} with optimizer={self.optimizer!r}; AdamW's first moment is "
                f"betas[0], which leaves the long-run noise unchanged (DESIGN §1): leave momentum at 0"
            )
        # one OptimizerPreset per preset named (each checks lr, weight_decay and momentum), shared by every
        # parameter of its group
        presets = {
            p: OptimizerPreset(
                p, self.lr, self.weight_decay, self.momentum if p == "sgd" else 0.0, tuple(self.betas), self.eps
            )
            for p in dict.fromkeys(names)
        }
        return ProbePlan.settle(self, presets, batch_indices)

    def _validate_drift(self, fn: str) -> None:
        check_groups(fn, self.groups)
        md = self.drift_batches
        if md is None or (isinstance(md, int) and not isinstance(md, bool) and md == 0):
            return
        top = self.max_batches if self.target_rse is not None else self.batches
        if isinstance(md, bool) or not isinstance(md, int) or md < top:
            what = f"max_batches={top}" if self.target_rse is not None else f"batches (M={top})"
            raise ValueError(
                f"{fn}: drift_batches (M_D, the virtual batches of the drift) must be None or 0 "
                f"(drift from the M heat batches) or an integer >= {what} (the heat's batches "
                f"are the first M of the drift's), got drift_batches={md!r}"
            )

    def _validate_adaptive(self, fn: str) -> None:
        if self.target_rse is None:
            return
        t = self.target_rse
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 10:
            raise ValueError(
                f"{fn}: target_rse (the relative standard error of V2 to reach) must be a number in "
                f"(0, 10) or None, got target_rse={t!r}"
            )
        mb = self.max_batches
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < self.batches:
            raise ValueError(
                f"{fn}: max_batches must be an integer >= batches (M={self.batches}), got max_batches={mb!r}"
            )
        q = self.target_quantile
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q <= 1:
            raise ValueError(f"{fn}: target_quantile must be in (0, 1], got target_quantile={q!r}")
        if not self.uncertainty or self.radial_spread:
            raise ValueError(
                f"{fn}: target_rse needs the grouped error bars (uncertainty=True, "
                f"radial_spread=False), got uncertainty={self.uncertainty!r}, "
                f"radial_spread={self.radial_spread!r}"
            )

    def _validate_snapshot(self, fn: str) -> None:
        for name in ("snapshot_min_steps", "snapshot_max_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 50:
                raise ValueError(
                    f"{fn}: {name} must be an integer >= 50 (two blocks of 25 virtual steps), got {name}={v!r}"
                )
        if self.snapshot_max_steps < self.snapshot_min_steps:
            raise ValueError(
                f"{fn}: snapshot_max_steps ({self.snapshot_max_steps}) must be >= "
                f"snapshot_min_steps ({self.snapshot_min_steps})"
            )
        t = self.snapshot_steps
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 50):
            raise ValueError(
                f"{fn}: snapshot_steps must be None (the relaxation rule) or an integer >= 50, got snapshot_steps={t!r}"
            )
        r = self.snapshot_relaxations
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0:
            raise ValueError(f"{fn}: snapshot_relaxations must be a number > 0, got {r!r}")
        if not self.snapshot:
            return
        if self.output != "pooled":
            raise ValueError(
                f"{fn}: snapshot=True needs output='pooled' (the virtual trajectory samples every "
                f"probe item at every step), got output={self.output!r}"
            )
        if not isinstance(self.optimizer, str):
            raise ValueError(
                f"{fn}: snapshot=True needs one optimizer preset for every probed parameter "
                f"(the virtual trajectory runs one optimizer), got optimizer={self.optimizer!r}"
            )

    def _validate_batch_indices(self, fn: str) -> list[list[int]]:
        """The explicit batches, checked (their count and sizes; their range is the pair source's, checked by
        the Prober that binds the plan to it), as lists of ints."""
        from normfast.data.batches import check_batch_indices

        n = len(self.batch_indices) if hasattr(self.batch_indices, "__len__") else None
        if self.drift_from_mean and n is not None and n != self.total_batches:
            options = [f"pass {self.drift_batches} batches"]
            if n >= max(self.batches, self.groups):
                options.append(f"drift_batches={n} to take the drift from these {n}")
            if n == self.batches:
                options.append(f"drift_batches=None for the per-batch drift of the {n} heat batches")
            raise ValueError(
                f"{fn}: batch_indices holds {n} batches but the drift comes from drift_batches="
                f"{self.drift_batches} batches (the first batches={self.batches} of them are also the heat's): "
                + ", or ".join(options)
            )
        return check_batch_indices(
            fn, "batch_indices", self.batch_indices, M=self.total_batches, batch_size=self.batch_size
        )

    @property
    def drift_from_mean(self) -> bool:
        """Whether the drift comes from the mean direction over its own M_D batches."""
        return bool(self.drift_batches)

    @property
    def total_batches(self) -> int:
        """Virtual batches drawn: M_D with the mean-direction drift (the first M are the heat's), else M
        (or the adaptive cap)."""
        heat = self.max_batches if self.target_rse is not None else self.batches
        return int(self.drift_batches) if self.drift_from_mean else heat

    @property
    def effective_groups(self) -> int:
        """K actually used: ``groups``, capped at M (every batch its own group)."""
        from normfast.engine.estimators.uncertainty import effective_groups

        return effective_groups(self.groups, self.batches)


class SettledConfig(ProbeConfig):
    """The settings a :class:`ProbePlan` holds: a checked copy of a :class:`ProbeConfig`, closed to
    changes (an assignment raises ``dataclasses.FrozenInstanceError``), so that nothing reaches a stage
    unchecked. ``dataclasses.replace`` makes another (closed) one; :meth:`ProbeConfig.resolve` on it
    checks it again, like any config."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "_settled", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_settled"):
            raise FrozenInstanceError(
                f"cannot assign to {name!r}: a plan's settings are fixed once checked; make a new ProbeConfig "
                f"(dataclasses.replace(config, {name}=...)) and resolve it"
            )
        object.__setattr__(self, name, value)


@dataclass(frozen=True, eq=False)
class ProbePlan:
    """One call's settings, checked once by its entry point and resolved into what the stages use.

    Made by :meth:`ProbeConfig.resolve`; entry points also accept a plan made earlier (the CLI resolves
    its config before it loads the model). The stages read their settings from ``config``, a copy no
    one can change, and never check them again.

    Attributes:
        config: the settings as checked (:class:`SettledConfig`; ``batch_indices`` as lists of ints).
        presets: one :class:`~normfast.engine.directions.presets.OptimizerPreset` per preset named in
            ``config.optimizer`` (``"sgd"``, ``"adamw"``), shared by every parameter of its group
            (:meth:`presets_for`).
        batch_indices: the explicit virtual batches as checked (int64 arrays), or None: drawn from the seed.
        heat_draws: the heat's batches to draw: M, or adaptive M's cap (``max_batches``).
        total_batches: virtual batches in the run's draw: M_D with the mean-direction drift, else ``heat_draws``.
        groups: K as used (``groups`` capped at M).
        drift_from_mean: whether the drift comes from the mean direction over its own M_D batches.
    """

    config: SettledConfig
    presets: Mapping[str, OptimizerPreset]
    batch_indices: tuple[np.ndarray, ...] | None
    heat_draws: int
    total_batches: int
    groups: int
    drift_from_mean: bool

    @classmethod
    def settle(
        cls, config: ProbeConfig, presets: Mapping[str, OptimizerPreset], batch_indices: list[list[int]] | None
    ) -> "ProbePlan":
        """The plan of a config :meth:`ProbeConfig.resolve` has checked (called by it, not by the stages)."""
        values = {f: copy.deepcopy(getattr(config, f)) for f in config.__dataclass_fields__}
        values["batch_indices"] = batch_indices
        settled = SettledConfig(**values)
        return cls(
            settled,
            dict(presets),
            None if batch_indices is None else tuple(np.asarray(b, dtype=np.int64) for b in batch_indices),
            settled.max_batches if settled.target_rse is not None else settled.batches,
            settled.total_batches,
            settled.effective_groups,
            settled.drift_from_mean,
        )

    def preset_of(self, name: str) -> OptimizerPreset:
        """The optimizer preset of the probed parameter ``name`` (the first group whose regex it matches)."""
        optimizer = self.config.optimizer
        if isinstance(optimizer, str):
            return self.presets[optimizer]
        preset = next((p for pattern, p in optimizer.items() if re.search(pattern, name)), None)
        if preset is None:
            raise ValueError(f"ProbeConfig: parameter {name!r} matches none of the optimizer groups {list(optimizer)}")
        return self.presets[preset]

    def presets_for(self, names: Sequence[str]) -> dict[str, OptimizerPreset]:
        """The optimizer preset of every probed parameter in ``names`` (the plan's objects: none is built)."""
        return {n: self.preset_of(n) for n in names}

    def derived(self, **changes: Any) -> "ProbePlan":
        """This plan with settings its checks do not depend on, chosen by an entry point or an engine stage
        (not a way to change a user's settings, which go through :meth:`ProbeConfig.resolve`): ``params``
        (which the stages resolve against the model, as the corpus recipe resolves ``"last"``), and for a
        pass of the engine's own (the Prober's reference) ``output`` with ``snapshot=False``,
        ``uncertainty=True`` and ``radial_spread=False``, which only drop constraints."""
        relaxed = {"snapshot": False, "uncertainty": True, "radial_spread": False}
        bad = [k for k, v in changes.items() if k not in ("params", "output") and relaxed.get(k, not v) != v]
        if "output" in changes and changes.get("snapshot", self.config.snapshot):
            bad.append("output (with the snapshot on)")
        if bad:
            raise ValueError(f"ProbePlan.derived: {bad} would need the settings checked again: resolve a ProbeConfig")
        return replace(self, config=replace(self.config, **changes))


def as_plan(config: ProbeConfig | ProbePlan | None) -> ProbePlan:
    """An entry point's plan: ``config`` resolved once (the defaults for None), or a plan as it is."""
    if isinstance(config, ProbePlan):
        return config
    if config is None:
        config = ProbeConfig()
    if not isinstance(config, ProbeConfig):
        raise TypeError(f"probe: expected config to be a ProbeConfig, got {type(config).__name__}")
    return config.resolve()

"""``ProbeConfig``: everything that defines a probe run besides the model, probes, objective and pairs."""
from __future__ import annotations

import re
from dataclasses import dataclass


from normfast.engine.directions import (OptimizerPreset, PRESETS)


MODES = ("auto", "jvp", "head")
#: Default M_D: 1024 drift batches put se_D near 0.3 |D| at a per-batch drift signal-to-noise of
#: ~0.1 (DESIGN §1); its cost is M_D gradients once per run, whatever the number of probes.
DEFAULT_DRIFT_BATCHES = 1024
#: Default K, the number of batch groups behind the standard errors.
DEFAULT_GROUPS = 8
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
        momentum: heavy-ball SGD momentum β; the law uses the heuristic η -> η/(1-β).
        betas, eps: AdamW settings (β2 only matters through ``v̂``).
        no_decay: regex of probed parameters exempt from weight decay (e.g. ``"bias|LayerNorm"``).
        batches: M, the number of virtual batches of the heat (V2) and the second moments (≥ 2).
        drift_batches: M_D, the virtual batches of the drift (``D``/``D_w``, ``m2``, ``se_D``,
            ``sign_stability``), taken from the mean update direction over them (one extra
            directional pass per group, or one GEMM in head mode, for any M_D; DESIGN §1, "drift
            from the mean direction"). Default 1024: with the drift's per-batch signal-to-noise of
            about 0.1, se_D ≈ 0.3 |D|. The first M of them are the heat batches. ``None`` or 0:
            the drift from the M heat batches, per batch (the estimator before M_D existed).
        groups: K, the groups of virtual batches behind every standard error (batch ``b`` belongs
            to group ``b mod K``): ``se_D`` and ``sign_stability`` of the drift come from the K
            group drifts (≥ 2, at most M_D).
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
        directions_per_pass: K directions per forward-mode pass (None: from the memory budget).
        memory_budget_mb: working-memory budget that sets K and the loop order.
        radial_spread: compute ``se_D`` and ``sign_stability`` (needs per-batch radial dots;
            in head mode this selects the per-batch form).
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
    groups: int = DEFAULT_GROUPS
    batch_size: int = 32
    seed: int = 0
    batch_indices: list[list[int]] | None = None
    chunk_size: int = 64
    directions_per_pass: int | None = None
    memory_budget_mb: float = 2048
    radial_spread: bool = True

    def validate(self) -> None:
        fn = "ProbeConfig"
        if self.mode not in MODES:
            raise ValueError(f"{fn}: mode must be one of {MODES}, got {self.mode!r}")
        if self.output not in OUTPUTS:
            raise ValueError(f"{fn}: output must be one of {OUTPUTS}, got {self.output!r}")
        for name in ("batches", "batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 2:
                what = "M (virtual batches)" if name == "batches" else name
                raise ValueError(f"{fn}: {what} must be an integer >= 2 (a variance needs two batches), "
                                 f"got {name}={v!r}")
        self._validate_drift(fn)
        if self.batch_indices is not None:
            self._validate_batch_indices(fn)
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"{fn}: chunk_size must be a positive integer, got {self.chunk_size!r}")
        if self.directions_per_pass is not None and (
                not isinstance(self.directions_per_pass, int) or self.directions_per_pass < 1):
            raise ValueError(f"{fn}: directions_per_pass must be a positive integer or None, "
                             f"got {self.directions_per_pass!r}")
        if not self.memory_budget_mb > 0:
            raise ValueError(f"{fn}: memory_budget_mb must be > 0, got {self.memory_budget_mb!r}")
        presets = [self.optimizer] if isinstance(self.optimizer, str) else list(self.optimizer.values())
        for p in presets:
            if p not in PRESETS:
                raise ValueError(f"{fn}: optimizer presets must be in {PRESETS}, got {p!r}")
        OptimizerPreset(presets[0], self.lr, self.weight_decay, self.momentum if presets[0] == "sgd" else 0.0)

    def _validate_drift(self, fn: str) -> None:
        k = self.groups
        if isinstance(k, bool) or not isinstance(k, int) or k < 2:
            raise ValueError(f"{fn}: groups (K, the batch groups behind the standard errors) must be an "
                             f"integer >= 2, got groups={k!r}")
        md = self.drift_batches
        if md is None or (isinstance(md, int) and not isinstance(md, bool) and md == 0):
            return
        if isinstance(md, bool) or not isinstance(md, int) or md < self.batches or md < k:
            raise ValueError(f"{fn}: drift_batches (M_D, the virtual batches of the drift) must be None or 0 "
                             f"(drift from the M heat batches) or an integer >= batches (M={self.batches}) "
                             f"and >= groups (K={k}), got drift_batches={md!r}")

    def _validate_batch_indices(self, fn: str) -> None:
        from normfast.data.pairs import check_batch_indices

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
                + ", or ".join(options))
        self.batch_indices = check_batch_indices(fn, "batch_indices", self.batch_indices, M=self.total_batches,
                                                 batch_size=self.batch_size)

    @property
    def drift_from_mean(self) -> bool:
        """Whether the drift comes from the mean direction over its own M_D batches."""
        return bool(self.drift_batches)

    @property
    def total_batches(self) -> int:
        """Virtual batches drawn: M_D with the mean-direction drift (the first M are the heat's), else M."""
        return int(self.drift_batches) if self.drift_from_mean else self.batches

    def preset_for(self, name: str) -> str:
        if isinstance(self.optimizer, str):
            return self.optimizer
        for pattern, preset in self.optimizer.items():
            if re.search(pattern, name):
                return preset
        raise ValueError(f"ProbeConfig: parameter {name!r} matches none of the optimizer groups "
                         f"{list(self.optimizer)}")

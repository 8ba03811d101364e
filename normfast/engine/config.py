"""``ProbeConfig``: everything that defines a probe run besides the model, probes, objective and pairs."""
from __future__ import annotations

import re
from dataclasses import dataclass


from normfast.engine.directions import (OptimizerPreset, PRESETS)


MODES = ("auto", "jvp", "head")
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
        batches: M, the number of virtual batches (≥ 2).
        batch_size: pairs / items per virtual batch (≥ 2).
        seed: drives batch sampling and dropout; equal seeds give equal tables.
        batch_indices: the virtual batches themselves instead of a random draw: ``M`` sequences of
            ``batch_size`` distinct indices into the pair source (e.g. a training run's batches, or
            the batches of a brute-force check). ``batches`` and ``batch_size`` must agree with it
            (checked, with an error naming the mismatch); indices are checked against the pair
            source when the probe starts. The seed still drives dropout. These batches serve every
            statistic: when the engine takes the drift from its own, larger set of batches
            (``drift_batches``), that set is given by ``drift_batch_indices``, validated the same
            way; with ``batch_indices`` and no ``drift_batch_indices`` the drift comes from these
            same batches, so an explicit run never mixes in randomly drawn batches.
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
        if self.batch_indices is not None:
            from normfast.data.pairs import check_batch_indices

            self.batch_indices = check_batch_indices(fn, "batch_indices", self.batch_indices, M=self.batches,
                                                     batch_size=self.batch_size)
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

    def preset_for(self, name: str) -> str:
        if isinstance(self.optimizer, str):
            return self.optimizer
        for pattern, preset in self.optimizer.items():
            if re.search(pattern, name):
                return preset
        raise ValueError(f"ProbeConfig: parameter {name!r} matches none of the optimizer groups "
                         f"{list(self.optimizer)}")

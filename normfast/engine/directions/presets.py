"""Optimizer presets: how gradients become update directions, and what enters the equilibrium law.

* ``sgd``   -> ``p_B = ĝ_B`` (the scale-invariant branch ``u``); heavy-ball momentum β is treated
  by the documented heuristic ``η -> η / (1 - β)``.
* ``adamw`` -> ``p_B = ĝ_B / (sqrt(v̂) + eps)`` (the scale-free branch ``w``).

:class:`~normfast.engine.config.ProbeConfig` names the presets;
:mod:`normfast.engine.directions.gradients` applies them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

from normfast.engine.defaults import PRESETS

BRANCH_OF_PRESET = {"sgd": "u", "adamw": "w"}


@dataclass
class OptimizerPreset:
    """How gradients become update directions, and what enters the equilibrium law."""

    name: str = "sgd"
    lr: float = 1e-3
    weight_decay: float = 1e-2
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    #: AdamW second moments ``v̂`` (bias-corrected) per parameter name; else estimated.
    second_moments: Mapping[str, torch.Tensor] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.name not in PRESETS:
            raise ValueError(f"OptimizerPreset: expected name in {PRESETS}, got {self.name!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"OptimizerPreset: expected lr > 0, got {self.lr!r}")
        if not (self.weight_decay > 0 and math.isfinite(self.weight_decay)):
            raise ValueError(
                f"OptimizerPreset: expected weight_decay > 0 (the law needs decay), got {self.weight_decay!r}"
            )
        if not 0 <= self.momentum < 1:
            raise ValueError(f"OptimizerPreset: expected 0 <= momentum < 1, got {self.momentum!r}")
        if self.name == "adamw" and self.momentum:
            raise ValueError(
                "OptimizerPreset: momentum applies to sgd; AdamW's beta1 leaves the long-run noise "
                "unchanged and is not a parameter of the law"
            )

    @property
    def branch(self) -> str:
        return BRANCH_OF_PRESET[self.name]

    @property
    def preconditioned(self) -> bool:
        """Whether its directions divide by AdamW's second moments ``v̂`` (given, or estimated from all
        batches)."""
        return self.branch == "w"

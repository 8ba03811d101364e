"""What a training run to a stationary state is (:class:`TrainSettings`) and what it must meet
before any fit means anything (:class:`HealthThresholds`)."""

from __future__ import annotations

from dataclasses import dataclass


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
            raise ValueError(
                f"{fn}: expected lr, weight_decay and temperature > 0, got lr={self.lr!r}, "
                f"weight_decay={self.weight_decay!r}, temperature={self.temperature!r}"
            )
        if self.batch_size < 2:
            raise ValueError(f"{fn}: expected batch_size >= 2, got {self.batch_size}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"{fn}: expected warmup to be an int >= 0, got {self.warmup!r}")
        window_steps = self.steps - self.window_start
        if self.warmup > self.window_start:
            raise ValueError(
                f"{fn}: the warmup ({self.warmup} steps) must end before the window starts (step {self.window_start})"
            )
        if window_steps < 2 * self.probe_every or window_steps < 2 * self.record_every:
            raise ValueError(
                f"{fn}: the window ({window_steps} steps) must hold at least two "
                f"checkpoints and two records, got probe_every={self.probe_every}, "
                f"record_every={self.record_every}"
            )

"""The monitor-every study's settings: the models, the candidates, the cost arms and its config."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.common import names_in

MODELS = ("mlp", "mlp_heavyball", "mlp_adamw")
TERMS = ("task1", "task2", "decay", "remainder", "delta_r2")
#: E1's target for every predictor: slope in [0.85, 1.15], r >= 0.93
SLOPE, R_MIN = (0.85, 1.15), 0.93
#: the cost arms: (every, average); None: without the monitor
ARMS = (None, (1, False), (2, False), (5, False), (10, False), (10, True), (50, True))
#: the MiniLM-sized loop's arms
MINILM_ARMS = (None, (10, False), (10, True), (50, True))


@dataclass
class Config:
    models: str = field(default=",".join(MODELS), metadata={"help": "comma-separated subset of " + ", ".join(MODELS)})
    seeds: tuple[int, ...] = (0, 1, 8)
    size: str = field(default="full", metadata={"choices": ("full", "quick"), "help": "E1's configuration"})
    sampled: tuple[int, ...] = (1, 2, 5, 10, 20, 50)
    averaged: tuple[int, ...] = (2, 5, 10, 20, 50)
    windows: tuple[int, ...] = (500, 2000, 8000)
    cost_steps: int = 2000
    cost_rounds: int = 3
    minilm_steps: int = field(default=80, metadata={"help": "steps per arm of the MiniLM-sized cost loop"})
    minilm_rounds: int = 2
    seed: int = 0

    @classmethod
    def quick(cls) -> "Config":
        return cls(
            models="mlp", seeds=(0,), size="quick", sampled=(1, 10), averaged=(10,), windows=(300, 1200),
            cost_steps=60, cost_rounds=1, minilm_steps=6, minilm_rounds=1,
        )  # fmt: skip

    def model_names(self) -> list[str]:
        return names_in(self.models, MODELS, "monitor_every", "model")

    def validate(self) -> None:
        self.model_names()
        if not self.seeds or 1 not in self.sampled:
            raise ValueError("monitor_every: expected at least one seed, and 1 among --sampled (the reference)")
        if self.cost_rounds < 1 or self.cost_steps < 20:
            raise ValueError("monitor_every: expected --cost-rounds >= 1 and --cost-steps >= 20")

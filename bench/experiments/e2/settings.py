"""E2's protocols: the settings of each (:class:`E2Config`), the pilot's candidates, the targets."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.training import TrainSettings

#: where a full run keeps its resume state, whatever --out is (git-ignored)
RUNS = Path(__file__).resolve().parents[3] / "runs" / "e2"
PAPER = {"model": "DistilBERT, fine-tuned", "slope": 0.88, "pearson_r": 0.97}
TARGET = {"slope": [0.85, 1.15], "pearson_r": 0.90}
LAYER = r"model\.encoder\.layer\.5\."
HEAD = r"dense\.0\.linear\.weight"
PROTOCOLS = ("v3", "A", "B", "v1", "v2")

#: pilot candidates of A and B, in order (see the module docstring)
PILOT_CANDIDATES: tuple[dict[str, Any], ...] = (
    {"lr": 0.2, "weight_decay": 5e-3, "steps": 5000},
    {"lr": 0.1, "weight_decay": 1e-2, "steps": 5000},
    {"lr": 0.1, "weight_decay": 5e-3, "steps": 10000},
    {"lr": 0.05, "weight_decay": 5e-3, "steps": 20000},
)

#: the full run's protocol beyond the pilot's choice (stored in the JSON)
PROTOCOL_FULL = {
    "n_probes": 500,
    "checkpoints": 50,
    "M": 8,
    "drift_batches": 64,
    "record_every": 20,
    "n_boot": 2000,
    "target": TARGET,
    "predictors": "trajectory average of D, Q, κ over the checkpoints -> full law and heat-only law; "
    "the last checkpoint alone beside them",
}

#: the first two protocols (decay on every parameter), from their full runs
HISTORY: tuple[dict[str, Any], ...] = (
    {
        "protocol": "v1",
        "lr": 0.05,
        "weight_decay": 0.1,
        "steps": 3000,
        "warmup": 0,
        "decay": "every parameter of the layer",
        "outcome": "collapse near step 400 (mean pairwise cosine -> 1, loss at chance, no stationary norms)",
    },
    {
        "protocol": "v2",
        "lr": 1.0,
        "weight_decay": 2e-3,
        "steps": 3000,
        "warmup": 200,
        "decay": "every parameter of the layer",
        "outcome": "collapse near step 500 (window: mean "
        "pairwise cosine 0.997, loss 3.460 vs chance 3.466, median norm change 31%)",
    },
    {
        "protocol": "v3 pilot",
        "lr": 0.5,
        "weight_decay": 2e-3,
        "steps": 7500,
        "warmup": 200,
        "decay": "weight matrices only (bias|LayerNorm exempt)",
        "outcome": "collapse near step 6000",
    },
)


@dataclass
class E2Config:
    protocol: str = "v3"
    n_pairs: int = 20_000
    n_probes: int = 500
    temperature: float = 0.05
    batch_size: int = 32
    lr: float = 0.2
    weight_decay: float = 5e-3
    no_decay: str | None = "bias|LayerNorm"
    steps: int = 7500
    warmup: int = 200
    window: float = 0.4
    record_every: int = 20
    probe_every: int = 60
    M: int = 8
    drift_batches: int | None = None
    head_dim: int | None = None
    layer: int = 5
    n_boot: int = 2000
    trajectory_every: int = 100
    seed: int = 0

    @classmethod
    def of(cls, protocol: str, chosen: dict[str, Any] | None = None) -> "E2Config":
        """The settings of a protocol; A and B take η, λ, steps from their pilot's choice."""
        if protocol == "v1":
            return cls(protocol="v1", lr=0.05, weight_decay=0.1, no_decay=None, steps=3000, warmup=0, probe_every=20)
        if protocol == "v2":
            return cls(protocol="v2", lr=1.0, weight_decay=2e-3, no_decay=None, steps=3000, probe_every=20)
        if protocol == "v3":
            return cls()
        if protocol not in ("A", "B"):
            raise ValueError(f"E2Config.of: expected a protocol in {PROTOCOLS}, got {protocol!r}")
        chosen = dict(chosen or PILOT_CANDIDATES[0])
        steps = int(chosen.get("steps", 5000))
        window = int(steps * 0.4)
        return cls(
            protocol=protocol,
            no_decay=None,
            lr=float(chosen["lr"]),
            weight_decay=float(chosen["weight_decay"]),
            steps=steps,
            probe_every=max(1, window // PROTOCOL_FULL["checkpoints"]),
            M=PROTOCOL_FULL["M"],
            drift_batches=PROTOCOL_FULL["drift_batches"],
            head_dim=256 if protocol == "B" else None,
        )

    def quick(self) -> "E2Config":
        """The same protocol at a toy size (for the tests)."""
        return replace(
            self,
            n_pairs=160,
            n_probes=32,
            batch_size=16,
            steps=40,
            warmup=8,
            record_every=4,
            probe_every=8,
            M=4,
            n_boot=500,
            trajectory_every=20,
            drift_batches=8 if self.drift_batches else None,
        )

    def settings(self) -> TrainSettings:
        from bench.training import TrainSettings

        return TrainSettings(
            lr=self.lr,
            weight_decay=self.weight_decay,
            steps=self.steps,
            temperature=self.temperature,
            batch_size=self.batch_size,
            warmup=self.warmup if self.protocol != "v1" else 0,
            window=self.window,
            record_every=self.record_every,
            probe_every=self.probe_every,
            trajectory_every=self.trajectory_every,
            seed=self.seed,
        )

    @property
    def trained(self) -> str:
        layer = rf"model\.encoder\.layer\.{self.layer}\."
        return f"{layer}|{HEAD}" if self.head_dim else layer

    def validate(self) -> None:
        fn = "E2Config"
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"{fn}: expected protocol in {PROTOCOLS}, got {self.protocol!r}")
        for name in ("n_pairs", "n_probes", "n_boot"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{fn}: expected {name} to be a positive int, got {value!r}")
        if self.M < 2:
            raise ValueError(f"{fn}: expected M >= 2, got M={self.M}")
        if self.batch_size > self.n_pairs:
            raise ValueError(f"{fn}: expected batch_size <= n_pairs, got {self.batch_size} > {self.n_pairs}")
        self.settings().validate()


def result_stem(protocol: str) -> str:
    """File name (without suffix) of a protocol's results."""
    return "e2_real_encoder" if protocol == "v3" else f"e2_real_encoder_{protocol}"


def state_path(cfg: E2Config) -> Path:
    """Where a full run keeps its resume state (git-ignored, whatever ``--out`` is)."""
    return RUNS / "state" / f"{result_stem(cfg.protocol)}_seed{cfg.seed}.pt"


def checkpoint_folder(state: str | Path) -> Path:
    """Where a resumable run keeps its checkpoints' snapshots and probe results (beside ``state``)."""
    return Path(state).with_suffix(".checkpoints")

"""The heat-sampling study's settings: the probe, the sets, the variants, the targets and its config."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.harness import JsonStyle

JSON = JsonStyle(newline=False, strict=False)
MODEL = "all-MiniLM-L6-v2"
PARAMS = r"encoder\.layer\.5\."
SETS = {"common": 2000, "rare": 20000}
TRUTH_SEED = 999_999
#: stage A: the proposals compared (independent draws) and the one reported only
PROPOSALS = ("uniform", "energy", "sqrt_energy", "mixture", "mixture_sqrt")
REPORTED_ONLY = ("stratified",)
#: stage B's variants: the plain draw and the engine's default
VARIANTS = ("plain", "sampled")
#: stage C's screened designs (S, M_D')
SCREENS = ((1024, 256), (1024, 512), (2048, 512), (2048, 1024))
TARGETS = {"level_ratio_max": 3.0, "coverage": (0.90, 0.98), "cross_seed_min": 0.75, "wall_ratio_max": 1.15}
STAGES = ("truth", "a", "c", "d", "b")
#: stage D (exploratory): the proposals and heat batches whose interval coverage it simulates
COVERAGE_PROPOSALS = ("uniform", "energy", "mixture")
COVERAGE_M = (16, 32, 64)


@dataclass
class Config:
    words: int = field(default=400, metadata={"help": "words per set"})
    truth_batches: int = field(default=2048, metadata={"help": "N_T, the truth pool's virtual batches"})
    pool: int = field(default=1024, metadata={"help": "N, the pool of stage A (the engine's M_D)"})
    batches: int = field(default=16, metadata={"help": "M, the heat's batches"})
    replicates: int = field(default=4000, metadata={"help": "stage A's replicates"})
    seeds: int = field(default=8, metadata={"help": "stage B's seeds per variant"})
    batch_size: int = 32
    bootstrap: int = 200
    stages: str = field(default=",".join(STAGES), metadata={"help": "comma-separated subset of " + ", ".join(STAGES)})

    @classmethod
    def quick(cls) -> "Config":
        return cls(words=24, truth_batches=64, pool=32, batches=4, replicates=200, seeds=2, batch_size=8, bootstrap=20)

    def stage_names(self) -> list[str]:
        from bench.common import names_in

        return names_in(self.stages, STAGES, "heat_sampling", "stage")


# ---------------------------------------------------------------------------
# the truth pool

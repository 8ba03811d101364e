"""The suite's settings: full and quick sizes of each section, and its constants."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

SECTIONS = ("head", "jacrev", "minilm", "scaling")
#: ``--only`` aliases
SECTION_GROUPS = {"jvp": ("jacrev", "minilm")}
#: probed parameters of the MiniLM section: the last transformer layer
MINILM_LAYER = r"encoder\.layer\.5\."
#: InfoNCE temperature of the head section's virtual batches
TAU = 0.05
HEAD_KEYS = ("D", "m2", "V2", "Q")
JVP_KEYS = ("D", "se_D", "m2", "V2", "Q")
#: the libraries a throughput report names besides normfast's own (the baselines it is compared with)
BASELINE_PACKAGES = ("backpack-for-pytorch", "opacus", "pytest-benchmark")


# ============================================================================
# Settings (full and quick)
# ============================================================================


@dataclass
class HeadSettings:
    n: int = 100_000  # probes
    dim: int = 384  # d_in = d_out of the head
    m: int = 64  # virtual batches
    pairs: int = 32  # anchor/positive pairs per batch
    repeats: int = 3  # rounds; each runs every method
    fast_runs: int = 3  # normfast runs per round (its runs are short)
    check: int = 2000  # probes checked against the float64 brute force
    tolerance: float = 1e-4  # scale-relative, statistics vs float64
    g_tolerance: float = 1e-5  # relative, sum of per-sample gradients vs the backward's G_B


@dataclass
class JacrevSettings:
    widths: tuple[int, ...] = (32, 128, 128, 32)
    n: int = 2048
    chunk: int = 64
    m: int = 16
    pairs: int = 512
    batch_size: int = 32
    repeats: int = 3
    check: int = 256
    tolerance: float = 1e-4
    threads: int = 1  # many small matmuls: one thread is faster and steadier


@dataclass
class MiniLMSettings:
    words: int = 256  # words of the batched-vs-sequential comparison
    engine_words: int = 1024  # words of the throughput figures
    chunk: int = 128  # words per chunk (the engine's chunk_size)
    m: int = 16
    k: int = 16  # directions per vmap'd pass
    batch_size: int = 32
    repeats: int = 3
    check_directions: int = 2  # directions compared against the float64 model
    tolerance: float = 1e-4  # scale-relative, transmissions


@dataclass
class ScalingSettings:
    sizes: tuple[int, ...] = (1_000, 10_000, 100_000, 1_000_000)  # token rows
    tokens_per_item: int = 32
    dim: int = 384
    vocab: int = 4096
    m: int = 16
    batch_size: int = 32
    chunk: int = 256  # items per chunk
    pairs: int = 4096


@dataclass
class Settings:
    head: HeadSettings = field(default_factory=HeadSettings)
    jacrev: JacrevSettings = field(default_factory=JacrevSettings)
    minilm: MiniLMSettings = field(default_factory=MiniLMSettings)
    scaling: ScalingSettings = field(default_factory=ScalingSettings)

    @classmethod
    def quick(cls) -> "Settings":
        """Tiny sizes: every code path and check, in seconds (used by the tests)."""
        return cls(
            head=HeadSettings(n=2000, dim=32, m=6, pairs=8, repeats=2, fast_runs=1, check=500),
            jacrev=JacrevSettings(
                widths=(8, 16, 16, 8), n=64, chunk=32, m=4, pairs=64, batch_size=8, repeats=2, check=32
            ),
            minilm=MiniLMSettings(
                words=6, engine_words=12, chunk=6, m=3, k=3, batch_size=8, repeats=1, check_directions=1
            ),
            scaling=ScalingSettings(
                sizes=(1_000, 4_000), tokens_per_item=16, dim=32, vocab=512, m=4, batch_size=8, chunk=64, pairs=256
            ),
        )

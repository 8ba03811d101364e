"""The test suite: one sub-package per layer of the source tree (tests/engine/<stage>, tests/core, ...)."""

from pathlib import Path

#: the repository root
ROOT = Path(__file__).resolve().parents[1]

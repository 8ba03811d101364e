"""Constants and small helpers shared by the parent and the worker of the GPU check."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
#: the worker process runs this module (``python -m``), from the staged folder
WORKER_MODULE = "bench.experiments.gpu_check.worker"
SCHEMA = "normfast-gpu-check/1"
ORDER = ("build", "tests", "env", "ceilings", "kernels", "e2e")
COMMAND_STAGES = ("build", "tests")
WORKER_STAGES = ("env", "ceilings", "kernels", "e2e")
#: the tests stage: every kernel test file (but the resource report's, which compiles without
#: launching and takes minutes), then the engine paths that launch the kernels
TEST_FILES = tuple(
    str(p.relative_to(REPO))
    for p in sorted((REPO / "tests" / "kernels").glob("test_*.py"))
    if p.name != "test_resources.py"
) + ("tests/engine/transmission/test_head_mode.py", "tests/engine/estimators/test_accumulator.py")
# A few fast tests per file for the dry run (real kernel cases included).
DRY_TEST_SELECTION = (
    "block_sizes or validate or 1-1-1-2-False-u or u-1-1-2 or 1-1-1-1-1-False or invalid_rows or merge_with_empty"
)

# Seconds: the most a stage may take, and the least it is started with.
CAPS = {
    "gpu": {"build": 150, "tests": 200, "env": 30, "ceilings": 45, "kernels": 120, "e2e": 170},
    "dry": {"build": 60, "tests": 90, "env": 30, "ceilings": 30, "kernels": 60, "e2e": 90},
}
FLOORS = {
    "gpu": {"build": 20, "tests": 30, "env": 5, "ceilings": 10, "kernels": 30, "e2e": 45},
    "dry": {"build": 2, "tests": 5, "env": 2, "ceilings": 2, "kernels": 3, "e2e": 3},
}
DEFAULT_BUDGET = {"gpu": 440.0, "dry": 240.0}
# Seconds past its cap before the parent kills a stage (the worker aims to end before).
GRACE = 5.0
WORKER_START_LIMIT = 180.0


def log(msg: str) -> None:
    print(msg, flush=True)


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, data: Any) -> None:
    # Written aside and renamed: a reader never sees half a file.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str, allow_nan=True) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    """The JSON in ``path``, or None while it is missing or half written."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def stage_timeout(
    stage: str,
    selected: list[str],
    t_start: float,
    budget: float,
    caps: dict[str, float],
    floors: dict[str, float],
    now: float,
) -> float:
    """Seconds a stage may run: its cap, less what the later stages need at least."""
    left = budget - (now - t_start)
    later = [s for s in selected if ORDER.index(s) > ORDER.index(stage)]
    return min(caps[stage], left - sum(floors[s] for s in later))

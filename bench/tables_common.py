"""Shared helpers of the README table renderers (bench/tables.py and its per-experiment modules)."""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _f(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    return f"{x:.{digits}f}"


def _ci(block: dict, digits: int = 3) -> str:
    lo, hi = block.get("ci95", [None, None])
    return f"{_f(block.get('value', block.get('estimate')), digits)} [{_f(lo, digits)}, {_f(hi, digits)}]"

"""normfast: probe the optimization statistics that set contrastive embedding norms.

Public API (imported lazily so ``import normfast`` stays light):

* :func:`solve_quartic`, :func:`equilibrium_coefficients`, :func:`equilibrium_norm`
  -- the equilibrium law (``normfast.equilibrium``).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> defining module
_LAZY = {
    "solve_quartic": "normfast.equilibrium",
    "equilibrium_coefficients": "normfast.equilibrium",
    "equilibrium_norm": "normfast.equilibrium",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'normfast' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

"""The engine's defaults and choices, as plain values: nothing here imports torch, so a command
line can show them in its ``--help`` without loading the engine (``normfast probe --help`` stays fast).

The modules that use them import them from here: :mod:`normfast.engine.config` (``MODES``,
``DEFAULT_DRIFT_BATCHES``), :mod:`normfast.engine.directions.presets` (``PRESETS``),
:mod:`normfast.engine.directions.sampling` (``HEAT_SAMPLING``) and
:mod:`normfast.engine.estimators.uncertainty` (``DEFAULT_GROUPS``).
"""

from __future__ import annotations

__all__ = ["DEFAULT_DRIFT_BATCHES", "DEFAULT_GROUPS", "HEAT_SAMPLING", "MODES", "PRESETS"]

#: transmission modes: closed form for a final linear head, forward-mode AD, or the cheaper that applies
MODES = ("auto", "jvp", "head")
#: M_D, the virtual batches of the drift's mean direction
DEFAULT_DRIFT_BATCHES = 1024
#: K, the batch groups behind every error bar
DEFAULT_GROUPS = 8
#: optimizer presets
PRESETS = ("sgd", "adamw")
#: how the heat's batches are chosen: drawn from the drift's by their energy (the default), or the first M
HEAT_SAMPLING = ("energy", "uniform")

"""Backend API: the probe-statistics estimator on plain arrays.

Frontends that have their own models call these functions directly. Inputs
are torch tensors or any DLPack array (numpy, CuPy, JAX); results are torch
tensors. CUDA tensors run the Triton kernels of :mod:`normfast.kernels`; CPU
tensors run the same math as torch ops (BLAS), in float64 when the inputs are
float64 and otherwise in float32 with fp32 accumulation.

* :class:`ProbeAccumulator` -- streaming, mergeable per-probe statistics from
  explicit displacements ``t_i^B`` (any probed parameters, "jvp" mode).
* :class:`GroupedAccumulator` -- the same over K groups of directions, with
  the error bars (group ``se_D``, jackknife ``se_V2``/``se_Q``, leave-one-
  group-out values for the jackknife of ``R_eq``).
* :func:`head_mode_stats` -- closed form for a linear head ``z = W a + b``
  ("head" mode), from the per-batch head directions ``G_B`` (and bias ``g_B``);
  grouped error bars by default (:mod:`normfast.engine.transmission.head`).
  ``head_stats`` is its former name, kept as an alias (the name now belongs to
  the S-form kernel's launcher, :func:`normfast.kernels.head_stats`).
* :func:`prepare_head` -- center and group the head directions once, for
  streaming many probe chunks through :func:`head_mode_stats`.
* :func:`head_flops` -- the FLOP count of the head-mode forms.
* :func:`drift_from_groups` -- the drift statistics from K group-mean
  displacements (the drift from the mean direction over its own M_D batches).
* ``solve_quartic``, ``equilibrium_coefficients``, ``equilibrium_norm`` --
  the equilibrium law, re-exported from :mod:`normfast.core.equilibrium`.

Every statistic dict holds, per branch, ``D, se_D, sign_stability, m2, V2,
Q`` (suffix ``_w`` for the scale-free branch; ``C_uw`` when both; ``se_V2,
se_Q`` and ``loo`` from the grouped estimators), plus
``valid`` (bool ``[N]``), ``reason`` (int8 ``[N]``, codes into
:data:`REASONS`) and ``M``. Invalid rows hold NaN; no row is ever dropped.
"""

from __future__ import annotations

import importlib
from typing import Any

from normfast.engine.estimators.accumulator import ProbeAccumulator
from normfast.engine.estimators.drift import drift_from_groups
from normfast.engine.estimators.grouped import GroupedAccumulator
from normfast.engine.estimators.statkeys import REASONS, STAT_KEYS, UNCERTAINTY_KEYS, stat_names
from normfast.engine.transmission.head import HeadDirections, head_flops, head_mode_stats, prepare_head

#: the former name of :func:`head_mode_stats`, kept for code written against 0.1.0
head_stats = head_mode_stats

__all__ = [
    "REASONS",
    "STAT_KEYS",
    "UNCERTAINTY_KEYS",
    "ProbeAccumulator",
    "GroupedAccumulator",
    "HeadDirections",
    "prepare_head",
    "head_mode_stats",
    "head_stats",
    "head_flops",
    "drift_from_groups",
    "stat_names",
    "solve_quartic",  # noqa: F822 -- these three are imported on first use (__getattr__ below)
    "equilibrium_coefficients",  # noqa: F822
    "equilibrium_norm",  # noqa: F822
]

_EQUILIBRIUM = ("solve_quartic", "equilibrium_coefficients", "equilibrium_norm")


def __getattr__(name: str) -> Any:
    # The equilibrium module is imported on first use only.
    if name in _EQUILIBRIUM:
        value = getattr(importlib.import_module("normfast.core.equilibrium"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'normfast.ops' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

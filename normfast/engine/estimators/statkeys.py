"""What every estimator's statistic dict holds: the statistic names per branch, the per-row
failure codes, and the branch and backend choices (:class:`~normfast.engine.estimators.accumulator.ProbeAccumulator`,
:class:`~normfast.engine.estimators.grouped.GroupedAccumulator`,
:func:`~normfast.engine.transmission.head.head_mode_stats`,
:func:`~normfast.engine.estimators.drift.drift_from_groups`)."""

from __future__ import annotations

import torch

#: Per-row failure codes: ``reason[i]`` indexes this tuple.
REASONS = ("ok", "zero_norm", "non_finite_embedding", "non_finite_displacement")
ZERO_NORM, NON_FINITE_EMBEDDING, NON_FINITE_DISPLACEMENT = 1, 2, 3

BRANCHES = ("u", "w", "uw")
BACKENDS = ("auto", "torch", "triton")

#: Statistic names per branch; the w branch adds the suffix ``_w``.
STAT_KEYS = ("D", "se_D", "sign_stability", "m2", "V2", "Q")
#: Error-bar statistics of the grouped estimators per branch (suffix ``_w`` for the w branch); NaN when not
#: computed.
UNCERTAINTY_KEYS = ("se_V2", "se_Q")


def stat_names(branch: str) -> list[str]:
    """Output keys of the statistics for ``branch`` (without valid/reason/M)."""
    names = []
    if branch in ("u", "uw"):
        names += list(STAT_KEYS)
    if branch in ("w", "uw"):
        names += [k + "_w" for k in STAT_KEYS]
    if branch == "uw":
        names.append("C_uw")
    return names


def branch_suffixes(branch: str) -> list[str]:
    """The state-dict suffixes of ``branch``'s parts: ``_u`` and/or ``_w``."""
    return {"u": ["_u"], "w": ["_w"], "uw": ["_u", "_w"]}[branch]


def row_codes(norm: torch.Tensor, bad_displacement: torch.Tensor) -> torch.Tensor:
    """Failure code per row (int8, 0 = ok); embedding problems take priority over the displacements'."""
    code = torch.zeros(norm.shape, dtype=torch.int8, device=norm.device)
    code[bad_displacement] = NON_FINITE_DISPLACEMENT
    code[~torch.isfinite(norm)] = NON_FINITE_EMBEDDING
    code[norm == 0] = ZERO_NORM
    return code

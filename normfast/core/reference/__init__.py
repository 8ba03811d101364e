"""Plain reference implementations that the fast paths are tested against.

Two parts, kept apart:

1. the equilibrium quartic (:mod:`.quartic`): a pure-numpy batched solver (companion-matrix
   eigenvalues + Newton polishing) that ``normfast.core._quartic`` must match;
2. the probe statistics: a plain-torch reference per Triton kernel, named after it
   (:mod:`.accumulate`, :mod:`.head_stack`, :mod:`.head_stats`), the float64 brute force that
   materializes every displacement ``t_i^B`` (:mod:`.accumulate`), the heat's importance-sampled
   estimator (:mod:`.sampling`), and the tolerances and errors they are compared with (:mod:`.errors`).

Nothing here imports another part of normfast.
"""

from normfast.core.reference.accumulate import (
    accumulate_reference,
    brute_force_drift,
    brute_force_grouped,
    brute_force_stats,
)
from normfast.core.reference.errors import TOLERANCES, allowed_error, head_stack_errors, output_errors, stat_errors
from normfast.core.reference.head_stack import head_stack_reference
from normfast.core.reference.head_stats import head_stats_reference, project_reference
from normfast.core.reference.quartic import solve_quartic_reference
from normfast.core.reference.sampling import exact_expectation, weighted_heat_reference

__all__ = [
    "TOLERANCES",
    "accumulate_reference",
    "allowed_error",
    "brute_force_drift",
    "brute_force_grouped",
    "brute_force_stats",
    "exact_expectation",
    "head_stack_errors",
    "head_stack_reference",
    "head_stats_reference",
    "output_errors",
    "project_reference",
    "solve_quartic_reference",
    "stat_errors",
    "weighted_heat_reference",
]

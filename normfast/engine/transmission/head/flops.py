"""The FLOP model of the head-mode forms (:func:`head_flops`), from the torch backend's layout."""

from __future__ import annotations

from normfast.engine.estimators.uncertainty import DEFAULT_GROUPS, effective_groups
from normfast.engine.transmission.head.products import stack_plan


def head_flops(
    n: int, d_in: int, d_out: int, m: int, *, bias: bool = False, groups: int = DEFAULT_GROUPS
) -> dict[str, int]:
    """Multiply-add FLOPs (2 per MAC) of the head-mode forms for ``n`` probes.

    Per probe: ``da d_out`` per direction matrix and, per quadratic form, the
    folded lower triangle (about ``(da² + 32 da)/2``, :func:`stack_plan`).
    ``S``: forming ``S_c`` (``2 M d_out da²``) plus one of each;
    ``grouped``: the same stacks K+1 deep; ``per_batch``: M + 1 direction
    matrices. ``da = d_in (+1 with bias)``, ``K = min(groups, M)``. Centering
    and the O(n d) epilogues are not counted.
    """
    da = d_in + int(bias)
    k = effective_groups(groups, m)
    form = 2 * m * d_out * da * da
    tri = sum((d_in - c0) * (c1 - c0) for c0, c1 in stack_plan(d_in, d_out, 1, 1)["blocks"]) + da
    return {
        "S": form + 2 * n * (tri + da * d_out),
        "grouped": form + 2 * n * (k + 1) * (tri + da * d_out),
        "per_batch": 2 * n * (m + 1) * da * d_out,
    }

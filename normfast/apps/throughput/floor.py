"""Head mode's forms and their GEMM floor: the matrix products each form cannot avoid
(:func:`form_gemms`), timed alone (:func:`gemm_floor`), against which the forms are measured."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["HEAD_FORMS", "form_gemms", "gemm_floor"]


#: form -> the keyword arguments of head_mode_stats that select it (the first is the default)
HEAD_FORMS = {"grouped": {}, "S": {"uncertainty": False, "form": "S"}, "per_batch": {"radial_spread": True}}


def form_gemms(
    form: str, n: int, d_in: int, d_out: int, m: int, *, bias: bool = True, groups: int | None = None
) -> dict[str, Any]:
    """The GEMM shapes a head-mode form needs: its preparation and its per-probe products.

    ``prep``: ``(rows, da)`` Gram matrices ``XᵀX`` formed from the directions
    (``S_c``, or one per group); ``k1``: direction matrices, one ``[a | 1]·G̃_kᵀ``
    (``d_in × d_out``) each; ``k2``: quadratic forms, multiplied on their
    folded lower triangles in the column blocks of
    :func:`normfast.engine.transmission.head.products.stack_plan` (``quad_gemms``: ``(rows
    of the factor, columns)`` per block, all K2 side by side).
    """
    from normfast.engine.estimators.uncertainty import DEFAULT_GROUPS, effective_groups
    from normfast.engine.transmission.head.products import stack_plan

    da = d_in + int(bias)
    k = effective_groups(groups or DEFAULT_GROUPS, m)
    if form == "grouped":
        sizes = [len(range(g, m, k)) for g in range(k)]
        prep, k1, k2 = [(s * d_out, da) for s in sizes], k + 1, k + 1
    elif form == "S":
        prep, k1, k2 = [(m * d_out, da)], 1, 1
    elif form == "per_batch":
        prep, k1, k2 = [], m + 1, 0
    else:
        raise ValueError(f"form_gemms: unknown form {form!r}")
    plan = stack_plan(d_in, d_out, k1, k2)
    quad = [(d_in - c0, k2 * (c1 - c0)) for c0, c1 in plan["blocks"]]
    return {
        "prep": prep,
        "k1": k1,
        "k2": k2,
        "quad_gemms": quad,
        "rows": plan["rows"],
        "macs_per_probe": k1 * da * d_out + sum(r * c for r, c in quad),
    }


def gemm_floor(
    A: torch.Tensor, form: str, d_out: int, m: int, *, bias: bool = True, groups: int | None = None
) -> Callable[[], None]:
    """A callable that runs only the GEMMs of ``form`` (same shapes, same row chunks, fp32): its floor."""
    n, d_in = A.shape
    spec = form_gemms(form, n, d_in, d_out, m, bias=bias, groups=groups)
    g = torch.Generator().manual_seed(0)
    preps = [torch.randn(rows, da, generator=g) for rows, da in spec["prep"]]
    W, b = torch.randn(spec["k1"], d_in, d_out, generator=g), torch.randn(spec["k1"], d_out, generator=g)
    tri = [torch.randn(r, c, generator=g) for r, c in spec["quad_gemms"]]
    step = min(n, spec["rows"])
    v = torch.empty(step, d_out)
    p = torch.empty(step, max((c for _, c in spec["quad_gemms"]), default=0))

    def run() -> None:
        for x in preps:
            x.T @ x
        for r0 in range(0, n, step):
            a = A[r0 : r0 + step]
            c = a.shape[0]
            for k in range(spec["k1"]):
                torch.addmm(b[k], a, W[k], out=v[:c])
            for f in tri:
                torch.mm(a[:, d_in - f.shape[0] :], f, out=p[:c, : f.shape[1]])

    return run

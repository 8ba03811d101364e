"""Probe statistics of a linear head in closed form, with their error bars (:func:`head_mode_stats`):
the argument checks, the choice of form and backend, and the dispatch."""

from __future__ import annotations

from typing import Any

import torch

from normfast.core.checks import (
    as_tensor,
    check_choice,
    check_groups,
    check_same_device,
    compute_dtype,
    describe,
    float_tensor,
)
from normfast.engine.estimators.statkeys import BACKENDS, STAT_KEYS, row_codes
from normfast.engine.estimators.uncertainty import DEFAULT_GROUPS
from normfast.engine.transmission.head.epilogues import finish, grouped_epilogue, per_batch_epilogue, s_epilogue
from normfast.engine.transmission.head.flops import head_flops
from normfast.engine.transmission.head.prepare import HeadDirections, attach_drift, center_directions, check_directions
from normfast.engine.transmission.head.products import head_products

FORMS = ("auto", "grouped", "S", "per_batch")


def head_mode_stats(
    A: Any,
    Z: Any,
    G: Any,
    g_bias: Any = None,
    *,
    drift_means: Any = None,
    drift_bias: Any = None,
    drift_counts: Any = None,
    branch: str = "u",
    form: str = "auto",
    uncertainty: bool = True,
    groups: int = DEFAULT_GROUPS,
    radial_spread: bool = False,
    backend: str = "auto",
    dtype: torch.dtype | None = None,
    allow_tf32: bool = False,
) -> dict[str, Any]:
    """Probe statistics of a linear head in closed form, with their error bars.

    ``A`` ``[N, d_in]`` are the probe activations feeding the head, ``Z``
    ``[N, d_out]`` the embeddings (``Z = A Wᵀ + b``), ``G`` ``[M, d_out, d_in]``
    the per-batch update directions of ``W`` and ``g_bias`` ``[M, d_out]``
    those of ``b`` (or ``G`` may be a :class:`HeadDirections` from
    :func:`prepare_head`, which then carries ``g_bias``, ``groups`` and the
    drift). The displacement of probe ``i`` along batch ``B`` is
    ``t_i^B = −(G_B a_i + g_B)``.

    Forms (see the module docstring for the estimators): ``"grouped"`` --
    the default (``form="auto"`` with ``uncertainty=True``): ``D, m2, V2, Q``
    exactly as the S form, plus ``se_D`` and ``sign_stability`` from K group
    drifts and ``se_V2``, ``se_Q`` from the delete-a-group jackknife, at a
    cost independent of M. ``uncertainty=False``: the bare ``"S"`` form (or
    ``"per_batch"`` when its FLOPs are fewer, e.g. one probe), error bars
    NaN. ``radial_spread=True`` or ``form="per_batch"``: per-batch radial
    dots (``se_D``, ``sign_stability`` per batch; ``se_V2``/``se_Q`` NaN).

    Drift from its own batches: ``drift_means`` ``[K, d_out, d_in]``,
    ``drift_bias`` ``[K, d_out]``, ``drift_counts`` ``[K]`` are the mean
    update directions of K groups of the drift's M_D batches; ``D``, ``m2``,
    ``se_D`` and ``sign_stability`` then come from them (any form), and the
    heat's groups are K as well.

    Returns, with suffix ``_w`` for branch "w": ``D, se_D, sign_stability,
    m2, V2, Q, se_V2, se_Q``, ``valid`` (bool ``[N]``), ``reason`` (int8),
    ``M``, ``groups`` (K; 0 without error bars) and, for the grouped form,
    ``loo``: ``{"D", "m2", "V2", "Q"}`` (suffixed) → ``[N, K]``
    leave-one-group-out values (for the jackknife of ``R_eq``).

    ``backend``: "auto" (Triton for CUDA tensors computed in float32, torch
    otherwise), "torch" or "triton" (:func:`normfast.kernels.head_stack`; on
    CPU only with ``TRITON_INTERPRET=1``). ``dtype``: compute precision,
    float64 when any input is float64 unless given (float64 runs torch).
    ``allow_tf32`` lets the CUDA kernel use TF32 products (~1e-3 relative).
    Invalid rows hold NaN with a code in ``reason``; no row is dropped.
    """
    fn = "head_mode_stats"
    if branch not in ("u", "w"):
        raise ValueError(
            f"{fn}: expected branch 'u' or 'w' (a head has one update direction "
            f"per batch; use ProbeAccumulator for 'uw'), got branch={branch!r}"
        )
    check_choice(fn, "form", form, FORMS)
    if form == "S" and radial_spread:
        raise ValueError(
            f"{fn}: expected radial_spread=False with form='S' (the S form cannot "
            f"give per-batch se_D or sign_stability), got radial_spread=True"
        )
    if form == "grouped" and (radial_spread or not uncertainty):
        raise ValueError(
            f"{fn}: expected uncertainty=True and radial_spread=False with form='grouped', "
            f"got uncertainty={uncertainty!r}, radial_spread={radial_spread!r}"
        )
    check_choice(fn, "backend", backend, BACKENDS)
    groups = check_groups(fn, groups)
    A = float_tensor(fn, "A", A, 2, "2-D [N, d_in]")
    Z = float_tensor(fn, "Z", Z, 2, "2-D [N, d_out]")
    drift_given = drift_means is not None or drift_bias is not None or drift_counts is not None
    if isinstance(G, HeadDirections):
        if g_bias is not None or drift_given:
            got = describe("g_bias", g_bias) if g_bias is not None else "a drift_means/drift_bias/drift_counts"
            raise ValueError(
                f"{fn}: expected g_bias=None when G is a HeadDirections (prepare_head folds the bias "
                f"and the drift in), got {got}"
            )
        dirs: HeadDirections | None = G
        m, d_out, d_in = G.M, G.d_out, G.d_in
    else:
        dirs = None
        G = as_tensor(fn, "G", G)
        g_bias = None if g_bias is None else as_tensor(fn, "g_bias", g_bias)
        check_directions(fn, G, g_bias)
        m, d_out, d_in = G.shape
    n = A.shape[0]
    if n == 0:
        raise ValueError(f"{fn}: expected at least one probe row, got {describe('A', A)}")
    if Z.shape[0] != n:
        raise ValueError(f"{fn}: expected Z with N={n} rows like A, got {describe('Z', Z)}")
    if A.shape[1] != d_in:
        raise ValueError(f"{fn}: expected A of shape [N, d_in] with d_in={d_in} from G, got {describe('A', A)}")
    if Z.shape[1] != d_out:
        raise ValueError(f"{fn}: expected Z of shape [N, d_out] with d_out={d_out} from G, got {describe('Z', Z)}")
    check_same_device(fn, A=A, Z=Z, G=G.g_bar if isinstance(G, HeadDirections) else G)
    cd = compute_dtype(fn, dtype, A, Z, dirs.g_bar if dirs is not None else G)
    if dirs is None:
        dirs = center_directions(G, g_bias, cd, groups)
        if drift_given:
            attach_drift(fn, dirs, drift_means, drift_bias, drift_counts)
    else:
        dirs = dirs.to(cd)

    if radial_spread or form == "per_batch":
        chosen = "per_batch"
    elif form != "auto":
        chosen = form
    elif uncertainty:
        chosen = "grouped"
    else:
        cost = head_flops(n, d_in, d_out, m, bias=dirs.has_bias)
        chosen = "S" if cost["S"] <= cost["per_batch"] or dirs.drift_means is not None else "per_batch"

    on_gpu = A.device.type == "cuda" and cd == torch.float32
    use_triton = backend == "triton" or (backend == "auto" and on_gpu)
    if use_triton and cd != torch.float32:
        raise ValueError(f"{fn}: backend='triton' computes in float32, got dtype={cd}")
    prod_backend = _stack_backend(use_triton, explicit=backend == "triton" and chosen == "grouped")

    def products(G_stack, S_stack):
        return head_products(A, Z, G_stack, S_stack, dirs.has_bias, prod_backend, dtype=cd, allow_tf32=allow_tf32)

    if use_triton and chosen != "grouped" and dirs.drift_means is None:
        values, reason = _legacy_triton(A, Z, dirs, branch, chosen == "S", allow_tf32)
        return finish(values, reason, None, branch, cd, m, 0)
    if chosen == "grouped":
        values, loo, bad = grouped_epilogue(
            products(dirs.drift_stack(True), dirs.jackknife_covariances()), dirs, branch
        )
    elif chosen == "S":
        values, loo, bad = s_epilogue(products(dirs.drift_stack(False), dirs.covariance()[None]), branch)
    else:
        values, loo, bad = per_batch_epilogue(
            products(dirs.per_batch_stack(), None), dirs.M, branch, dirs.heat_denominator
        )
        if dirs.drift_means is not None:  # the drift, its m2 and se_D from the drift's own groups
            drift, _, bad_d = grouped_epilogue(products(dirs.drift_stack(True), None), dirs, branch, heat=False)
            for key in ("D", "se_D", "sign_stability", "m2"):
                values[key] = drift[key]
            values["Q"] = values["m2"] + values["V2"]
            bad = bad | bad_d
    norm = torch.linalg.vector_norm(Z.to(cd), dim=1)
    code = row_codes(norm, bad)
    return finish(values, code, loo, branch, cd, m, dirs.K if chosen == "grouped" else 0)


def _stack_backend(use_triton: bool, explicit: bool) -> str:
    """ "triton" when the stacked kernel is there; else torch (on the tensors' device), or an error if asked for."""
    if not use_triton:
        return "torch"
    import normfast.kernels as kernels

    if hasattr(kernels, "head_stack"):
        return "triton"
    if explicit:
        raise ValueError(
            "head_mode_stats: backend='triton' for the grouped form needs normfast.kernels.head_stack, "
            "which this installation does not have; use backend='torch' or form='S'/'per_batch'"
        )
    return "torch"


def _legacy_triton(A, Z, dirs: HeadDirections, branch: str, use_s: bool, allow_tf32: bool):
    """The S and per-batch forms on their own fused kernels (:func:`normfast.kernels.head_stats`, ``project``)."""
    from normfast.kernels import KERNEL_INPUT_DTYPES
    from normfast.kernels import head_stats as head_kernel
    from normfast.kernels import project as project_kernel

    A = A if A.dtype in KERNEL_INPUT_DTYPES else A.float()
    Z = Z if Z.dtype in KERNEL_INPUT_DTYPES else Z.float()
    g_bar = dirs.g_bar.contiguous()
    if use_s:
        res, reason = head_kernel(
            A, Z, g_bar, dirs.covariance().contiguous(), branch=branch, has_bias=dirs.has_bias, allow_tf32=allow_tf32
        )
        values = {"D": res[0], "m2": res[1], "V2": res[2], "Q": res[3]}
    else:
        res, reason = project_kernel(
            A, Z, g_bar, dirs.g_centered.contiguous(), branch=branch, has_bias=dirs.has_bias, allow_tf32=allow_tf32
        )
        values = dict(zip(STAT_KEYS, res))
    return values, reason

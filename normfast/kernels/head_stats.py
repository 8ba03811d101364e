"""Closed-form head-mode statistics (S form and per-batch form) as epilogues over :func:`head_stack`.

For a linear head ``z = W a + b`` the displacement of probe ``i`` along
batch ``B`` is ``t_i^B = -G̃_B ã_i`` with ``ã = [a, 1]`` and
``G̃_B = [G_B | g_B]``. Both forms need only stacked products of the probe
rows, which :func:`normfast.kernels.head_stack` forms in one pass over the
rows; what remains is an O(N K) elementwise epilogue, run here as torch ops
on the kernel's outputs:

* S form (:func:`head_stats`): the stack ``[Ḡ]`` and ``[S_c]``;
* per-batch form (:func:`project`): the stack ``[Ḡ, G̃^c_1, ..., G̃^c_M]``.

The fused ``_head_stats_kernel`` and ``_project_kernel`` that used to do
this are retired: their epilogues kept up to 255 registers live and spilled
(bench/NOTES.md, "Resources").
"""

from __future__ import annotations

from functools import partial

import torch

from normfast.core.reference.head_stats import head_stats_reference, project_reference

from . import costs
from .head_stack import head_stack
from .head_sweeps import HEAD_SWEEP, default_config, epilogue_check_cases, epilogue_cost, epilogue_label, sweep_problems
from .spec import KernelSpec, ResourcePlan, meta_zeros, register
from .utils import capturing, head_block_sizes

# Reason codes of normfast.ops.REASONS (literal here: kernels import nothing from the engine).
_ZERO_NORM, _NON_FINITE_EMBEDDING, _NON_FINITE_DISPLACEMENT = 1, 2, 3


def _check_head_operands(
    fn: str, A: torch.Tensor, Z: torch.Tensor, g_bar: torch.Tensor, has_bias: bool
) -> tuple[int, int, int, int]:
    if A.dim() != 2 or Z.dim() != 2 or A.shape[0] != Z.shape[0]:
        raise ValueError(
            f"{fn}: expected A [N, d_in] and Z [N, d_out], got A.shape={tuple(A.shape)}, Z.shape={tuple(Z.shape)}"
        )
    n, d_in = A.shape
    d_out = Z.shape[1]
    da = d_in + int(has_bias)
    if tuple(g_bar.shape) != (d_out, da) or g_bar.dtype != torch.float32 or not g_bar.is_contiguous():
        raise ValueError(
            f"{fn}: expected g_bar contiguous float32 of shape {(d_out, da)}, "
            f"got g_bar.shape={tuple(g_bar.shape)}, dtype={g_bar.dtype}"
        )
    return n, d_in, da, d_out


def _outputs(
    fn: str, n: int, rows: int, device: torch.device, out: torch.Tensor | None, reason: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        out = torch.empty((rows, n), dtype=torch.float32, device=device)
    elif tuple(out.shape) != (rows, n) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(
            f"{fn}: expected out contiguous float32 of shape {(rows, n)}, "
            f"got out.shape={tuple(out.shape)}, dtype={out.dtype}"
        )
    if reason is None:
        reason = torch.empty((n,), dtype=torch.int8, device=device)
    elif tuple(reason.shape) != (n,) or reason.dtype != torch.int8:
        raise ValueError(
            f"{fn}: expected reason int8 of shape {(n,)}, got reason.shape={tuple(reason.shape)}, dtype={reason.dtype}"
        )
    return out, reason


def _check_branch(fn: str, branch: str) -> None:
    if branch not in ("u", "w"):
        raise ValueError(f"{fn}: expected branch 'u' or 'w', got {branch!r}")


def _branch_scale(branch: str, norm: torch.Tensor) -> torch.Tensor:
    return norm if branch == "u" else torch.ones_like(norm)


def _reasons(norm: torch.Tensor, *products: torch.Tensor) -> torch.Tensor:
    # the first failure wins: embedding problems before displacement problems
    bad = torch.zeros(norm.shape, dtype=torch.bool, device=norm.device)
    for p in products:
        bad |= ~torch.isfinite(p)
    code = torch.where(bad, _NON_FINITE_DISPLACEMENT, 0)
    code = torch.where(torch.isfinite(norm), code, _NON_FINITE_EMBEDDING)
    return torch.where(norm == 0, _ZERO_NORM, code).to(torch.int8)


def head_stats(
    A: torch.Tensor,
    Z: torch.Tensor,
    g_bar: torch.Tensor,
    s_c: torch.Tensor,
    *,
    branch: str = "u",
    has_bias: bool = False,
    allow_tf32: bool = False,
    out: torch.Tensor | None = None,
    reason: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """S-form head statistics for every probe row.

    With ``ã = [a, 1]`` when ``has_bias`` (else ``a``), ``R = |z|``,
    ``ẑ = z / R`` and ``s = R`` for branch "u", ``1`` for "w"::

        D  = -s ẑ·(Ḡ ã)      m2 = s² |Ḡ ã|²      V2 = s² ãᵀ S_c ã      Q = m2 + V2

    ``g_bar`` is the mean augmented direction ``[d_out, d_in (+1)]`` and
    ``s_c`` the centered covariance ``Σ_B G̃^cᵀ_B G̃^c_B / (M-1)``, both fp32
    and contiguous (formed by the caller with BLAS). ``A`` ``[N, d_in]`` and
    ``Z`` ``[N, d_out]`` may be fp16/bf16/fp32 with any strides; products
    accumulate in fp32 (see :func:`head_stack` for the operand precision).

    Returns ``out [4, N]`` (rows D, m2, V2, Q; NaN where the row is invalid)
    and ``reason [N]`` int8. Must match
    :func:`normfast.core.reference.head_stats_reference`.
    """
    fn = "head_stats"
    _check_branch(fn, branch)
    n, d_in, da, d_out = _check_head_operands(fn, A, Z, g_bar, has_bias)
    if tuple(s_c.shape) != (da, da) or s_c.dtype != torch.float32 or not s_c.is_contiguous():
        raise ValueError(
            f"{fn}: expected s_c contiguous float32 of shape {(da, da)}, "
            f"got s_c.shape={tuple(s_c.shape)}, dtype={s_c.dtype}"
        )
    out, reason = _outputs(fn, n, 4, A.device, out, reason)
    zdot, sq, quad, norm = head_stack(A, Z, g_bar[None], s_c[None], has_bias=has_bias, allow_tf32=allow_tf32)
    if n == 0 or capturing():
        return out, reason
    s = _branch_scale(branch, norm)
    zv, vv, q = zdot[:, 0], sq[:, 0], quad[:, 0]
    code = _reasons(norm, zv, vv, q)
    ok = code == 0
    m2 = s * s * vv
    v2 = s * s * q.clamp_min(0)  # S_c is PSD; clip rounding below zero
    for row, value in enumerate((-(zv / norm) * s, m2, v2, m2 + v2)):
        out[row].copy_(value.masked_fill(~ok, float("nan")))
    reason.copy_(code)
    return out, reason


def project(
    A: torch.Tensor,
    Z: torch.Tensor,
    g_bar: torch.Tensor,
    g_centered: torch.Tensor,
    *,
    branch: str = "u",
    has_bias: bool = False,
    allow_tf32: bool = False,
    out: torch.Tensor | None = None,
    reason: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-batch head statistics for every probe row.

    With ``ã = [a, 1]`` when ``has_bias`` (else ``a``), ``R = |z|``,
    ``ẑ = z / R``, ``s = R`` for branch "u" and ``1`` for "w",
    ``y_B = G̃^c_B ã`` and the radial dots ``r^B = D - s ẑ·y_B``::

        D = -s ẑ·(Ḡ ã)                 m2 = s² |Ḡ ã|²
        V2 = s² Σ_B |y_B|² / (M-1)      Q = m2 + V2
        se_D = std_B(r^B, ddof=1) / sqrt(M)
        sign_stability = #{B : sign(r^B) = sign(D)} / M    (sign(0) = 0)

    ``g_bar`` ``[d_out, d_in (+1)]`` is the mean augmented direction and
    ``g_centered`` ``[M, d_out, d_in (+1)]`` the centered ones, fp32 and
    contiguous. ``A``/``Z`` may be fp16/bf16/fp32 with any strides; fp32
    accumulation (see :func:`head_stack` for the operand precision).

    Returns ``out [6, N]`` (rows D, se_D, sign_stability, m2, V2, Q; NaN where
    invalid) and ``reason [N]`` int8. Must match
    :func:`normfast.core.reference.project_reference`.
    """
    fn = "project"
    _check_branch(fn, branch)
    n, d_in, da, d_out = _check_head_operands(fn, A, Z, g_bar, has_bias)
    if (
        g_centered.dim() != 3
        or tuple(g_centered.shape[1:]) != (d_out, da)
        or g_centered.dtype != torch.float32
        or not g_centered.is_contiguous()
    ):
        raise ValueError(
            f"{fn}: expected g_centered contiguous float32 of shape "
            f"[M, {d_out}, {da}], got g_centered.shape={tuple(g_centered.shape)}, "
            f"dtype={g_centered.dtype}"
        )
    m = g_centered.shape[0]
    if m < 2:
        raise ValueError(f"{fn}: expected at least 2 virtual batches, got g_centered.shape={tuple(g_centered.shape)}")
    out, reason = _outputs(fn, n, 6, A.device, out, reason)
    stack = torch.cat([g_bar[None], g_centered])
    zdot, sq, _, norm = head_stack(A, Z, stack, None, has_bias=has_bias, allow_tf32=allow_tf32)
    if n == 0 or capturing():
        return out, reason
    s = _branch_scale(branch, norm)
    drift = -(zdot[:, 0] / norm) * s
    dev = -(zdot[:, 1:] / norm[:, None]) * s[:, None]  # r^B - D, [N, M]
    radial = drift[:, None] + dev
    n_pos = (radial > 0).sum(1)
    n_neg = (radial < 0).sum(1)
    agree = torch.where(drift > 0, n_pos, torch.where(drift < 0, n_neg, m - n_pos - n_neg))
    # deviations re-centered by their (rounding-size) mean: the ddof=1 spread of the r^B
    dev_sum, dev_sq = dev.sum(1), dev.square().sum(1)
    var_r = (dev_sq - dev_sum.square() / m).clamp_min(0) / (m - 1)
    spread = sq[:, 1:].sum(1)
    m2 = s * s * sq[:, 0]
    v2 = s * s * spread / (m - 1)
    code = _reasons(norm, zdot[:, 0], sq[:, 0], spread, dev_sq)
    ok = code == 0
    values = (drift, torch.sqrt(var_r / m), agree.to(torch.float32) / m, m2, v2, m2 + v2)
    for row, value in enumerate(values):
        out[row].copy_(value.masked_fill(~ok, float("nan")))
    reason.copy_(code)
    return out, reason


# The records: epilogues over head_stack's kernel (its sweep, its tiles, no kernel of their own).


def _head_stats_launches(h: dict, dtypes: tuple[str, ...]):
    for labels, (A, Z, G, S) in sweep_problems(h, dtypes):
        flags = {"has_bias": labels["bias"], "allow_tf32": labels["precision"] == "tf32"}
        for branch in ("u", "w"):
            yield (
                dict(labels, op="head_stats", branch=branch),
                partial(head_stats, A, Z, G[0], S[0], branch=branch, **flags),
            )


def _project_launches(h: dict, dtypes: tuple[str, ...]):
    for labels, (A, Z, G, _) in sweep_problems(h, dtypes):
        flags = {"has_bias": labels["bias"], "allow_tf32": labels["precision"] == "tf32"}
        g_centered = meta_zeros(h["m"], labels["d_out"], G.shape[-1])
        for branch in ("u", "w"):
            yield (
                dict(labels, op="project", branch=branch),
                partial(project, A, Z, G[0], g_centered, branch=branch, **flags),
            )


def _epilogue_spec(launcher, reference, form: str, launches) -> KernelSpec:
    return KernelSpec(
        name=launcher.__name__,
        launcher=launcher,
        reference=reference,
        tiles=head_block_sizes,
        cost=epilogue_cost(form),
        units=costs.head_units,
        cost_config=default_config,
        resources=ResourcePlan("head", HEAD_SWEEP, launches),
        check_cases=epilogue_check_cases(launcher.__name__),
        case_label=epilogue_label,
    )


register(_epilogue_spec(head_stats, head_stats_reference, "S", _head_stats_launches))
register(_epilogue_spec(project, project_reference, "per_batch", _project_launches))

"""Per-batch head-mode statistics: ``Ã·G̃^cᵀ_B`` tiles reduced in the epilogue.

The per-batch form of :mod:`normfast.kernels.head_stats`: instead of the
covariance ``S_c`` it walks the ``M`` centered directions ``G̃^c_B`` and, for
each, reduces the tile ``Ã·G̃^cᵀ_B`` to a radial deviation and a squared norm
per probe. That gives the spread of the per-batch radial dots (``se_D``,
sign stability) exactly, at ``M·d_in·d_out`` per probe instead of ``d_in²``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .head_stats import _augmented_rows_dot, _check_head_operands, _mean_direction_pass, _outputs
from .utils import block_sizes, check_kernel_device


@triton.jit(do_not_specialize=["M"])
def _project_kernel(
    A_ptr,          # [N, DIN] probe activations (any strides)
    Z_ptr,          # [N, DOUT] probe embeddings (any strides)
    GBAR_ptr,       # [DOUT, DA] fp32 mean augmented direction Ḡ, contiguous
    GC_ptr,         # [M, DOUT, DA] fp32 centered augmented directions G̃^c_B, contiguous
    OUT_ptr,        # [6, N] fp32 out: D, se_D, sign_stability, m2, V2, Q
    REASON_ptr,     # [N] int8 out: codes of normfast.ops.REASONS (0 = ok)
    N, DIN, DA, DOUT,
    M,              # number of virtual batches (>= 2)
    stride_an, stride_ak,
    stride_zn, stride_zj,
    SCALE_BY_NORM: tl.constexpr,  # branch u (x = R t) rather than w (x = t)
    HAS_BIAS: tl.constexpr,       # DA = DIN + 1, the last column is the bias
    BLOCK_N: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" (exact fp32) or "tf32"
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    row_ok = rows < N

    # Phase 1: mean direction first, so that D (and its sign) is known
    # before the per-batch sweep.
    zv, vv, zz = _mean_direction_pass(A_ptr, Z_ptr, GBAR_ptr, rows, N, DIN, DA, DOUT,
                                      stride_an, stride_ak, stride_zn, stride_zj,
                                      HAS_BIAS, BLOCK_N, BLOCK_J, BLOCK_K, DOT_PRECISION)
    norm = tl.sqrt(zz)
    if SCALE_BY_NORM:
        s = norm
    else:
        s = tl.full((BLOCK_N,), 1.0, tl.float32)
    drift = -(zv / norm) * s

    # Phase 2: one centered batch at a time: y = G̃^c_B ã, radial deviation
    # r^B - D = -s ẑ·y and |y|², summed over B.
    dev_sum = tl.zeros((BLOCK_N,), tl.float32)
    dev_sq = tl.zeros((BLOCK_N,), tl.float32)
    spread = tl.zeros((BLOCK_N,), tl.float32)
    n_pos = tl.zeros((BLOCK_N,), tl.float32)
    n_neg = tl.zeros((BLOCK_N,), tl.float32)
    g_batch = GC_ptr
    for b in range(M):
        zy = tl.zeros((BLOCK_N,), tl.float32)
        yy = tl.zeros((BLOCK_N,), tl.float32)
        for j0 in range(0, DOUT, BLOCK_J):
            js = j0 + tl.arange(0, BLOCK_J)
            y = _augmented_rows_dot(A_ptr, g_batch, rows, js, N, DIN, DA, DOUT,
                                    stride_an, stride_ak,
                                    HAS_BIAS, BLOCK_N, BLOCK_J, BLOCK_K, DOT_PRECISION)
            z = tl.load(Z_ptr + rows[:, None] * stride_zn + js[None, :] * stride_zj,
                        mask=row_ok[:, None] & (js < DOUT)[None, :], other=0.0).to(tl.float32)
            zy += tl.sum(z * y, axis=1)
            yy += tl.sum(y * y, axis=1)
        dev = -(zy / norm) * s
        radial = drift + dev
        n_pos += (radial > 0).to(tl.float32)
        n_neg += (radial < 0).to(tl.float32)
        dev_sum += dev
        dev_sq += dev * dev
        spread += yy
        g_batch += DOUT * DA

    # Phase 3: epilogue. Deviations are re-centered by their (rounding-size)
    # mean so that se_D is the ddof=1 standard error of the M radial dots.
    m_f = M * 1.0
    var_r = tl.maximum(dev_sq - dev_sum * dev_sum / m_f, 0.0) / (m_f - 1.0)
    se = tl.sqrt(var_r / m_f)
    agree = tl.where(drift > 0, n_pos, tl.where(drift < 0, n_neg, m_f - n_pos - n_neg))
    m2 = s * s * vv
    v2 = s * s * spread / (m_f - 1.0)
    bad_t = (((zv * 0.0) != 0.0) | ((vv * 0.0) != 0.0)
             | ((spread * 0.0) != 0.0) | ((dev_sq * 0.0) != 0.0))
    code = tl.where(norm == 0.0, 1, tl.where((norm * 0.0) != 0.0, 2, tl.where(bad_t, 3, 0)))
    ok = code == 0
    nan = float("nan")
    tl.store(OUT_ptr + rows, tl.where(ok, drift, nan), mask=row_ok)
    tl.store(OUT_ptr + N + rows, tl.where(ok, se, nan), mask=row_ok)
    tl.store(OUT_ptr + 2 * N + rows, tl.where(ok, agree / m_f, nan), mask=row_ok)
    tl.store(OUT_ptr + 3 * N + rows, tl.where(ok, m2, nan), mask=row_ok)
    tl.store(OUT_ptr + 4 * N + rows, tl.where(ok, v2, nan), mask=row_ok)
    tl.store(OUT_ptr + 5 * N + rows, tl.where(ok, m2 + v2, nan), mask=row_ok)
    tl.store(REASON_ptr + rows, code.to(tl.int8), mask=row_ok)


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
    accumulation (IEEE fp32 ``tl.dot`` unless ``allow_tf32``).

    Returns ``out [6, N]`` (rows D, se_D, sign_stability, m2, V2, Q; NaN where
    invalid) and ``reason [N]`` int8. Must match
    :func:`normfast.reference.project_reference`.
    """
    fn = "project"
    if branch not in ("u", "w"):
        raise ValueError(f"{fn}: expected branch 'u' or 'w', got {branch!r}")
    n, d_in, da, d_out = _check_head_operands(fn, A, Z, g_bar, has_bias)
    if (g_centered.dim() != 3 or tuple(g_centered.shape[1:]) != (d_out, da)
            or g_centered.dtype != torch.float32 or not g_centered.is_contiguous()):
        raise ValueError(f"{fn}: expected g_centered contiguous float32 of shape "
                         f"[M, {d_out}, {da}], got g_centered.shape={tuple(g_centered.shape)}, "
                         f"dtype={g_centered.dtype}")
    m = g_centered.shape[0]
    if m < 2:
        raise ValueError(f"{fn}: expected at least 2 virtual batches, "
                         f"got g_centered.shape={tuple(g_centered.shape)}")
    check_kernel_device(fn, A, Z, g_bar, g_centered)
    out, reason = _outputs(fn, n, 6, A.device, out, reason)
    if n == 0:
        return out, reason
    cfg = block_sizes("project", d_in=da, d_out=d_out)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
    _project_kernel[grid](
        A, Z, g_bar, g_centered, out, reason,
        n, d_in, da, d_out, m,
        A.stride(0), A.stride(1), Z.stride(0), Z.stride(1),
        SCALE_BY_NORM=branch == "u", HAS_BIAS=bool(has_bias),
        BLOCK_N=cfg["BLOCK_N"], BLOCK_J=cfg["BLOCK_J"], BLOCK_K=cfg["BLOCK_K"],
        DOT_PRECISION="tf32" if allow_tf32 else "ieee", num_warps=cfg["num_warps"],
    )
    return out, reason

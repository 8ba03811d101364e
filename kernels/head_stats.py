"""Closed-form head-mode statistics, S form: tiled ``Ã·Ḡᵀ`` and ``Ã·S_c``.

For a linear head ``z = W a + b`` the displacement of probe ``i`` along
batch ``B`` is ``t_i^B = -G̃_B ã_i`` with ``ã = [a, 1]`` and
``G̃_B = [G_B | g_B]``. With the mean ``Ḡ`` of the augmented directions and
their centered covariance ``S_c = Σ_B G̃^cᵀ_B G̃^c_B / (M-1)`` every probe
needs three row reductions: ``ẑ·Ḡã``, ``|Ḡã|²`` and ``ãᵀ S_c ã``. The kernel
forms them tile by tile in registers; no ``N x d`` product reaches memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import block_sizes, check_kernel_device, check_kernel_dtype


@triton.jit
def _load_augmented_rows(
    A_ptr,          # [N, DIN] probe activations
    rows,           # [BLOCK_N] int64 row indices
    ks,             # [BLOCK_K] column indices into ã = [a, 1]
    N, DIN,
    stride_an, stride_ak,
    HAS_BIAS: tl.constexpr,  # column DIN of ã is the constant 1
):
    a = tl.load(A_ptr + rows[:, None] * stride_an + ks[None, :] * stride_ak,
                mask=(rows < N)[:, None] & (ks < DIN)[None, :], other=0.0).to(tl.float32)
    if HAS_BIAS:
        a = tl.where((ks == DIN)[None, :], 1.0, a)
    return a


@triton.jit
def _augmented_rows_dot(
    A_ptr,          # [N, DIN] probe activations
    G_ptr,          # [DOUT, DA] fp32 contiguous right factor (used transposed)
    rows,           # [BLOCK_N] int64 row indices
    js,             # [BLOCK_J] output columns of this tile
    N, DIN, DA, DOUT,
    stride_an, stride_ak,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One [BLOCK_N, BLOCK_J] tile of Ã·Gᵀ, reduced over DA in BLOCK_K steps.
    acc = tl.zeros((BLOCK_N, BLOCK_J), tl.float32)
    for k0 in range(0, DA, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = _load_augmented_rows(A_ptr, rows, ks, N, DIN, stride_an, stride_ak, HAS_BIAS)
        g = tl.load(G_ptr + js[None, :] * DA + ks[:, None],
                    mask=(ks < DA)[:, None] & (js < DOUT)[None, :], other=0.0)
        acc += tl.dot(a, g, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _mean_direction_pass(
    A_ptr, Z_ptr, GBAR_ptr, rows, N, DIN, DA, DOUT,
    stride_an, stride_ak, stride_zn, stride_zj,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Row reductions over the tiles of v = Ḡã: z·v, |v|², |z|².
    zv = tl.zeros((BLOCK_N,), tl.float32)
    vv = tl.zeros((BLOCK_N,), tl.float32)
    zz = tl.zeros((BLOCK_N,), tl.float32)
    for j0 in range(0, DOUT, BLOCK_J):
        js = j0 + tl.arange(0, BLOCK_J)
        v = _augmented_rows_dot(A_ptr, GBAR_ptr, rows, js, N, DIN, DA, DOUT, stride_an, stride_ak,
                                HAS_BIAS, BLOCK_N, BLOCK_J, BLOCK_K, DOT_PRECISION)
        z = tl.load(Z_ptr + rows[:, None] * stride_zn + js[None, :] * stride_zj,
                    mask=(rows < N)[:, None] & (js < DOUT)[None, :], other=0.0).to(tl.float32)
        zv += tl.sum(z * v, axis=1)
        vv += tl.sum(v * v, axis=1)
        zz += tl.sum(z * z, axis=1)
    return zv, vv, zz


@triton.jit
def _head_stats_kernel(
    A_ptr,          # [N, DIN] probe activations (any strides)
    Z_ptr,          # [N, DOUT] probe embeddings (any strides)
    GBAR_ptr,       # [DOUT, DA] fp32 mean augmented direction Ḡ, contiguous
    SC_ptr,         # [DA, DA] fp32 centered covariance S_c, contiguous, symmetric
    OUT_ptr,        # [4, N] fp32 out: D, m2, V2, Q
    REASON_ptr,     # [N] int8 out: codes of normfast.ops.REASONS (0 = ok)
    N, DIN, DA, DOUT,
    stride_an, stride_ak,
    stride_zn, stride_zj,
    SCALE_BY_NORM: tl.constexpr,  # branch u (x = R t) rather than w (x = t)
    HAS_BIAS: tl.constexpr,       # DA = DIN + 1, the last column of Ḡ and S_c is the bias
    BLOCK_N: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" (exact fp32) or "tf32"
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    row_ok = rows < N

    # Phase 1: mean direction, ẑ·Ḡã and |Ḡã|² (and |z|² on the way).
    zv, vv, zz = _mean_direction_pass(A_ptr, Z_ptr, GBAR_ptr, rows, N, DIN, DA, DOUT,
                                      stride_an, stride_ak, stride_zn, stride_zj,
                                      HAS_BIAS, BLOCK_N, BLOCK_J, BLOCK_K, DOT_PRECISION)

    # Phase 2: spread, ãᵀ S_c ã as row sums of (Ã S_c) ∘ Ã, tile by tile.
    q = tl.zeros((BLOCK_N,), tl.float32)
    for j0 in range(0, DA, BLOCK_K):
        js = j0 + tl.arange(0, BLOCK_K)
        as_tile = _augmented_rows_dot(A_ptr, SC_ptr, rows, js, N, DIN, DA, DA, stride_an, stride_ak,
                                      HAS_BIAS, BLOCK_N, BLOCK_K, BLOCK_K, DOT_PRECISION)
        a_j = _load_augmented_rows(A_ptr, rows, js, N, DIN, stride_an, stride_ak, HAS_BIAS)
        q += tl.sum(as_tile * a_j, axis=1)

    # Phase 3: epilogue, branch scaling x̄ = -s Ḡã (s = R for u, 1 for w).
    norm = tl.sqrt(zz)
    if SCALE_BY_NORM:
        s = norm
    else:
        s = tl.full((BLOCK_N,), 1.0, tl.float32)
    drift = -(zv / norm) * s
    m2 = s * s * vv
    v2 = s * s * tl.maximum(q, 0.0)  # S_c is PSD; clip rounding below zero
    bad_t = ((zv * 0.0) != 0.0) | ((vv * 0.0) != 0.0) | ((q * 0.0) != 0.0)
    code = tl.where(norm == 0.0, 1, tl.where((norm * 0.0) != 0.0, 2, tl.where(bad_t, 3, 0)))
    ok = code == 0
    nan = float("nan")
    tl.store(OUT_ptr + rows, tl.where(ok, drift, nan), mask=row_ok)
    tl.store(OUT_ptr + N + rows, tl.where(ok, m2, nan), mask=row_ok)
    tl.store(OUT_ptr + 2 * N + rows, tl.where(ok, v2, nan), mask=row_ok)
    tl.store(OUT_ptr + 3 * N + rows, tl.where(ok, m2 + v2, nan), mask=row_ok)
    tl.store(REASON_ptr + rows, code.to(tl.int8), mask=row_ok)


def _check_head_operands(fn: str, A: torch.Tensor, Z: torch.Tensor, g_bar: torch.Tensor,
                         has_bias: bool) -> tuple[int, int, int, int]:
    if A.dim() != 2 or Z.dim() != 2 or A.shape[0] != Z.shape[0]:
        raise ValueError(f"{fn}: expected A [N, d_in] and Z [N, d_out], "
                         f"got A.shape={tuple(A.shape)}, Z.shape={tuple(Z.shape)}")
    n, d_in = A.shape
    d_out = Z.shape[1]
    da = d_in + int(has_bias)
    if (tuple(g_bar.shape) != (d_out, da) or g_bar.dtype != torch.float32
            or not g_bar.is_contiguous()):
        raise ValueError(f"{fn}: expected g_bar contiguous float32 of shape {(d_out, da)}, "
                         f"got g_bar.shape={tuple(g_bar.shape)}, dtype={g_bar.dtype}")
    check_kernel_dtype(fn, "A", A)
    check_kernel_dtype(fn, "Z", Z)
    return n, d_in, da, d_out


def _outputs(fn: str, n: int, rows: int, device: torch.device, out: torch.Tensor | None,
             reason: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        out = torch.empty((rows, n), dtype=torch.float32, device=device)
    elif tuple(out.shape) != (rows, n) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"{fn}: expected out contiguous float32 of shape {(rows, n)}, "
                         f"got out.shape={tuple(out.shape)}, dtype={out.dtype}")
    if reason is None:
        reason = torch.empty((n,), dtype=torch.int8, device=device)
    elif tuple(reason.shape) != (n,) or reason.dtype != torch.int8:
        raise ValueError(f"{fn}: expected reason int8 of shape {(n,)}, got reason.shape="
                         f"{tuple(reason.shape)}, dtype={reason.dtype}")
    return out, reason


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
    accumulate in fp32 (IEEE fp32 ``tl.dot`` unless ``allow_tf32``).

    Returns ``out [4, N]`` (rows D, m2, V2, Q; NaN where the row is invalid)
    and ``reason [N]`` int8. Must match
    :func:`normfast.reference.head_stats_reference`.
    """
    fn = "head_stats"
    if branch not in ("u", "w"):
        raise ValueError(f"{fn}: expected branch 'u' or 'w', got {branch!r}")
    n, d_in, da, d_out = _check_head_operands(fn, A, Z, g_bar, has_bias)
    if tuple(s_c.shape) != (da, da) or s_c.dtype != torch.float32 or not s_c.is_contiguous():
        raise ValueError(f"{fn}: expected s_c contiguous float32 of shape {(da, da)}, "
                         f"got s_c.shape={tuple(s_c.shape)}, dtype={s_c.dtype}")
    check_kernel_device(fn, A, Z, g_bar, s_c)
    out, reason = _outputs(fn, n, 4, A.device, out, reason)
    if n == 0:
        return out, reason
    cfg = block_sizes("head_stats", d_in=da, d_out=d_out)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
    _head_stats_kernel[grid](
        A, Z, g_bar, s_c, out, reason,
        n, d_in, da, d_out,
        A.stride(0), A.stride(1), Z.stride(0), Z.stride(1),
        SCALE_BY_NORM=branch == "u", HAS_BIAS=bool(has_bias),
        BLOCK_N=cfg["BLOCK_N"], BLOCK_J=cfg["BLOCK_J"], BLOCK_K=cfg["BLOCK_K"],
        DOT_PRECISION="tf32" if allow_tf32 else "ieee", num_warps=cfg["num_warps"],
    )
    return out, reason

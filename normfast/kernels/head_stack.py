"""Stacked head products: ``z·(G_k ã)``, ``|G_k ã|²`` and ``ãᵀ S_k ã`` for every probe row.

Every closed-form head statistic (S form, per-batch form, grouped form) is
an O(N K) epilogue over these products, so one kernel serves them all. A
program owns ``BLOCK_N`` probe rows and walks the whole stack: first the
``K1`` direction matrices (``Ã·G_kᵀ`` in ``BLOCK_J``-column tiles, each tile
reduced to a radial dot and a squared norm per row and dropped), then the
``K2`` quadratic forms. The row block of ``A`` is read from memory once and
re-read from cache by every product; no ``N x d`` intermediate is written.

The quadratic forms use the symmetry of ``ãᵀSã``: the launcher folds each
``S_k`` into the lower triangle ``L = tril(S + Sᵀ, -1) + diag(S)`` (same
quadratic form, any ``S``), and the kernel multiplies only the blocks on or
below the diagonal, about half the products of a full ``Ã·S``.

The bias of ``ã = [a, 1]`` never enters the tiled loops: its column of
``G_k`` is a rank-one term added to each output tile, and its row and
column of ``S_k`` a linear term and a constant. The loops run over ``d_in``
only. The launcher pads every operand to widths and row strides that are
multiples of 16 (zeros add nothing), so the kernel is only ever compiled for
aligned, vectorizable layouts; a block of rows starts at a 64-bit offset and
is addressed with 32-bit offsets inside it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import (
    MAX_BLOCK_ROWS,
    KernelLaunch,
    check_kernel_device,
    check_kernel_dtype,
    head_configs,
    launch,
    operand_dtype,
)


@triton.jit
def _rows_times_t(
    A_ptr,  # [N, DIN] probe activations (the first row of this program's block)
    B_ptr,  # [J, LDB] right factor, used transposed: Ã·Bᵀ
    rows,  # [BLOCK_N] int32 rows of this program's block (A_ptr points at its first)
    row_ok,  # [BLOCK_N] rows that exist
    js,  # [BLOCK_J] rows of B (output columns) of this tile
    k_end,  # reduce over columns [0, min(k_end, DIN)) of A and B
    DIN,
    J,
    LDB,
    stride_an,
    stride_ak,
    BLOCK_N: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One [BLOCK_N, BLOCK_J] tile of A·Bᵀ, fp32 accumulation. B tiles are
    # loaded k-contiguous and transposed in registers (the operand layout the
    # tensor-core instructions take for every input dtype).
    acc = tl.zeros((BLOCK_N, BLOCK_J), tl.float32)
    j_ok = js < J
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < DIN
        a = tl.load(
            A_ptr + rows[:, None] * stride_an + ks[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        b = tl.load(B_ptr + js[:, None] * LDB + ks[None, :], mask=j_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit(do_not_specialize=["K1", "K2"])
def _head_stack_kernel(
    A_ptr,  # [N, DIN] probe activations (the dot operand dtype; rows 16-aligned)
    Z_ptr,  # [N, DOUT] probe embeddings (rows 16-aligned)
    GW_ptr,  # [K1, DOUT, LDG] direction matrices without their bias column, contiguous
    GB_ptr,  # [K1, DOUT] fp32 bias columns of the G_k (read only when HAS_BIAS)
    LW_ptr,  # [K2, DIN, LDL] folded lower triangles tril(S+Sᵀ,-1)+diag(S) of the a-block
    LB_ptr,  # [K2, DIN + 1] fp32 folded bias row S_kb + S_bk, then S_bb (when HAS_BIAS)
    ZDOT_ptr,  # [N, K1] fp32 out: z·(G_k ã)
    SQ_ptr,  # [N, K1] fp32 out: |G_k ã|²
    QUAD_ptr,  # [N, K2] fp32 out: ãᵀ S_k ã
    NORM_ptr,  # [N] fp32 out: |z|
    N,
    DIN,
    DOUT,  # DIN, DOUT: the widths padded to multiples of 16 (zeros)
    K1,
    K2,  # stack depths (either may be 0)
    LDG,
    LDL,  # row strides of GW and LW (multiples of 16)
    stride_an,
    stride_ak,
    stride_zn,
    stride_zj,
    HAS_BIAS: tl.constexpr,  # ã = [a, 1]: bias column of G_k, bias row/column of S_k
    BLOCK_N: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" (exact fp32) or "tf32"; 16-bit operands ignore it
):
    # 64-bit block origins; 32-bit offsets inside a block (the launcher checks they fit).
    pid = tl.program_id(0).to(tl.int64)
    first = pid * BLOCK_N
    A_ptr += first * stride_an
    Z_ptr += first * stride_zn
    rows = tl.arange(0, BLOCK_N)
    row_ok = rows < N - first
    out_rows = first + rows

    # Phase 1: |z|, one pass over the row block of Z.
    zz = tl.zeros((BLOCK_N,), tl.float32)
    for j0 in range(0, DOUT, BLOCK_J):
        js = j0 + tl.arange(0, BLOCK_J)
        z = tl.load(
            Z_ptr + rows[:, None] * stride_zn + js[None, :] * stride_zj,
            mask=row_ok[:, None] & (js < DOUT)[None, :],
            other=0.0,
        ).to(tl.float32)
        zz += tl.sum(z * z, axis=1)
    tl.store(NORM_ptr + out_rows, tl.sqrt(zz), mask=row_ok)

    # Phase 2: the direction stack. Per G_k, tiles v = Ã·G_kᵀ (+ bias column),
    # reduced to z·v and |v|² per row as they are formed.
    g_k = GW_ptr
    gb_k = GB_ptr
    for k in range(K1):
        zv = tl.zeros((BLOCK_N,), tl.float32)
        vv = tl.zeros((BLOCK_N,), tl.float32)
        for j0 in range(0, DOUT, BLOCK_J):
            js = j0 + tl.arange(0, BLOCK_J)
            v = _rows_times_t(
                A_ptr,
                g_k,
                rows,
                row_ok,
                js,
                DIN,
                DIN,
                DOUT,
                LDG,
                stride_an,
                stride_ak,
                BLOCK_N,
                BLOCK_J,
                BLOCK_K,
                DOT_PRECISION,
            )
            if HAS_BIAS:
                gb = tl.load(gb_k + js, mask=js < DOUT, other=0.0)
                v += gb[None, :]
            z = tl.load(
                Z_ptr + rows[:, None] * stride_zn + js[None, :] * stride_zj,
                mask=row_ok[:, None] & (js < DOUT)[None, :],
                other=0.0,
            ).to(tl.float32)
            zv += tl.sum(z * v, axis=1)
            vv += tl.sum(v * v, axis=1)
        tl.store(ZDOT_ptr + out_rows * K1 + k, zv, mask=row_ok)
        tl.store(SQ_ptr + out_rows * K1 + k, vv, mask=row_ok)
        g_k += DOUT * LDG  # pointer increments: 64-bit, whatever K1 * DOUT * LDG is
        gb_k += DOUT

    # Phase 3: the quadratic forms. Column tile j of Ã·L_kᵀ needs only the
    # k-tiles up to the diagonal (L_k is zero above it); each tile is reduced
    # against the matching columns of ã as it is formed.
    l_k = LW_ptr
    lb_k = LB_ptr
    for k in range(K2):
        q = tl.zeros((BLOCK_N,), tl.float32)
        for j0 in range(0, DIN, BLOCK_J):
            js = j0 + tl.arange(0, BLOCK_J)
            p = _rows_times_t(
                A_ptr,
                l_k,
                rows,
                row_ok,
                js,
                j0 + BLOCK_J,
                DIN,
                DIN,
                LDL,
                stride_an,
                stride_ak,
                BLOCK_N,
                BLOCK_J,
                BLOCK_K,
                DOT_PRECISION,
            )
            if HAS_BIAS:
                cross = tl.load(lb_k + js, mask=js < DIN, other=0.0)
                p += cross[None, :]
            a_j = tl.load(
                A_ptr + rows[:, None] * stride_an + js[None, :] * stride_ak,
                mask=row_ok[:, None] & (js < DIN)[None, :],
                other=0.0,
            ).to(tl.float32)
            q += tl.sum(p * a_j, axis=1)
        if HAS_BIAS:
            q += tl.load(lb_k + DIN)
        tl.store(QUAD_ptr + out_rows * K2 + k, q, mask=row_ok)
        l_k += DIN * LDL
        lb_k += DIN + 1


def _padded(x: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """``x [..., R, C]`` in a zero-padded ``[..., rows, cols]`` buffer of ``dtype``."""
    out = torch.zeros((*x.shape[:-2], rows, cols), dtype=dtype, device=x.device)
    out[..., : x.shape[-2], : x.shape[-1]] = x
    return out


def _pad16(n: int) -> int:
    return max(16, -(-n // 16) * 16)


def _aligned_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` when its rows are unit-stride, 16-element aligned and ``width`` wide; else a padded copy.

    The kernel then only ever sees row strides and widths that are multiples
    of 16 (vector loads, uniform masks: the register budget of the aligned
    case), and in-block offsets that fit in 32 bits. The zero columns add
    nothing to any product. Costs one copy of ``x`` when its width is not a
    multiple of 16 or its layout is unusual; none for contiguous rows of 16k.
    """
    if (
        x.shape[1] == width
        and x.stride(1) == 1
        and x.stride(0) % 16 == 0
        and x.data_ptr() % 16 == 0
        and MAX_BLOCK_ROWS * x.stride(0) < 2**31
    ):
        return x
    return torch.nn.functional.pad(x, (0, width - x.shape[1])).contiguous()


def head_stack_operands(
    G: torch.Tensor, S: torch.Tensor, d_in: int, d_out: int, has_bias: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """Lay out the right factors for the kernel: ``(GW, GB, LW, LB)``, padded to 16-element multiples.

    With ``p = pad16(d_in)`` and ``q = pad16(d_out)``: ``GW [K1, q, p]`` is
    ``G_k`` without its bias column, in the dot's operand ``dtype``; ``LW
    [K2, p, p]`` the folded lower triangle ``tril(S+Sᵀ, -1) + diag(S)`` of the
    a-block of each ``S_k``, same dtype. ``GB [K1, q]`` and ``LB [K2, p + 1]``
    (fp32): the bias column of ``G_k``, and the folded bias row ``S_kb +
    S_bk`` (zero-padded to ``p``) followed by ``S_bb``. Padding is zeros
    throughout. Forming these costs ``O((K1 d_out + K2 d_in) d_in)``, nothing
    per probe row.
    """
    f32 = torch.float32
    p, q = _pad16(d_in), _pad16(d_out)
    Gf, Sf = G.to(f32), S.to(f32)
    gw = _padded(Gf[..., :d_in], q, p, dtype)
    sym = Sf + Sf.transpose(1, 2)
    folded = torch.tril(sym[:, :d_in, :d_in], diagonal=-1)
    folded += torch.diag_embed(torch.diagonal(Sf[:, :d_in, :d_in], dim1=1, dim2=2))
    lw = _padded(folded, p, p, dtype)
    if has_bias:
        gb = _padded(Gf[..., d_in][:, None], 1, q, f32)[:, 0]
        lb = torch.zeros((S.shape[0], p + 1), dtype=f32, device=S.device)
        lb[:, :d_in] = sym[:, d_in, :d_in]
        lb[:, p] = Sf[:, d_in, d_in]
    else:  # never read; any fp32 pointer will do
        gb = lb = torch.zeros(1, dtype=f32, device=G.device)
    return gw, gb, lw, lb


def head_stack(
    A: torch.Tensor,
    Z: torch.Tensor,
    G: torch.Tensor,
    S: torch.Tensor | None,
    *,
    has_bias: bool = False,
    allow_tf32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked head products for every probe row.

    With ``ã = [a, 1]`` when ``has_bias`` (else ``ã = a``, ``da = d_in (+1)``),
    for every row ``i``, direction matrix ``G_k`` and second-moment matrix
    ``S_k``::

        zdot[i, k] = z_i · (G_k ã_i)      sq[i, k] = |G_k ã_i|²
        quad[i, k] = ã_iᵀ S_k ã_i         norm[i]  = |z_i|

    ``A`` ``[N, d_in]`` and ``Z`` ``[N, d_out]``: fp32, bf16 or fp16, any
    strides. ``G`` ``[K1, d_out, da]`` and ``S`` ``[K2, da, da]`` (``None`` or
    ``K2 = 0`` for no quadratic forms; ``S`` need not be symmetric: the
    quadratic form only sees ``(S + Sᵀ)/2``), any float dtype, on A's device.
    Products accumulate in fp32. For bf16/fp16 ``A`` the right factors are
    rounded to ``A``'s dtype and the products run on tensor cores; for fp32
    ``A`` they are exact fp32 (``"ieee"``) unless ``allow_tf32``.

    Returns fp32 ``zdot [N, K1]``, ``sq [N, K1]``, ``quad [N, K2]``,
    ``norm [N]`` (contiguous). Non-finite inputs propagate (no row is
    dropped). Must match :func:`normfast.core.reference.head_stack_reference`.
    """
    fn = "head_stack"
    n, d_in, d_out, k1, k2, S = _check_stack_operands(fn, A, Z, G, S, has_bias)
    check_kernel_device(fn, A, Z, G, S)
    dev = A.device
    f32 = torch.float32
    zdot = torch.empty((n, k1), dtype=f32, device=dev)
    sq = torch.empty((n, k1), dtype=f32, device=dev)
    quad = torch.empty((n, k2), dtype=f32, device=dev)
    norm = torch.empty((n,), dtype=f32, device=dev)
    if n == 0:
        return zdot, sq, quad, norm
    p, q = _pad16(d_in), _pad16(d_out)
    A = _aligned_rows(A, p)
    Z = _aligned_rows(Z, q)
    op_dtype = operand_dtype(A.dtype)
    gw, gb, lw, lb = head_stack_operands(G, S, d_in, d_out, has_bias, op_dtype)
    precision = "tf32" if allow_tf32 and op_dtype == f32 else "ieee"
    configs = head_configs(d_in=d_in, d_out=d_out, dtype=op_dtype, precision=precision)
    launch(
        KernelLaunch(
            name=fn,
            kernel=_head_stack_kernel,
            grid=lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),),
            args=(
                A,
                Z,
                gw,
                gb,
                lw,
                lb,
                zdot,
                sq,
                quad,
                norm,
                n,
                p,
                q,
                k1,
                k2,
                gw.shape[-1],
                lw.shape[-1],
                A.stride(0),
                A.stride(1),
                Z.stride(0),
                Z.stride(1),
            ),
            meta={"HAS_BIAS": bool(has_bias), "DOT_PRECISION": precision},
            configs=configs,
            key=("DIN", "DOUT"),
        )
    )
    return zdot, sq, quad, norm


def _check_stack_operands(
    fn: str, A: torch.Tensor, Z: torch.Tensor, G: torch.Tensor, S: torch.Tensor | None, has_bias: bool
):
    if A.dim() != 2 or Z.dim() != 2 or A.shape[0] != Z.shape[0]:
        raise ValueError(
            f"{fn}: expected A [N, d_in] and Z [N, d_out] with the same N, "
            f"got A.shape={tuple(A.shape)}, Z.shape={tuple(Z.shape)}"
        )
    check_kernel_dtype(fn, "A", A)
    check_kernel_dtype(fn, "Z", Z)
    n, d_in = A.shape
    d_out = Z.shape[1]
    da = d_in + int(bool(has_bias))
    if d_in == 0 or d_out == 0:
        raise ValueError(
            f"{fn}: expected non-empty d_in and d_out, got A.shape={tuple(A.shape)}, Z.shape={tuple(Z.shape)}"
        )
    if not isinstance(G, torch.Tensor) or G.dim() != 3 or tuple(G.shape[1:]) != (d_out, da):
        raise ValueError(
            f"{fn}: expected G [K1, d_out, da] = [K1, {d_out}, {da}] "
            f"(da = d_in{' + 1 with has_bias' if has_bias else ''}), "
            f"got G.shape={tuple(getattr(G, 'shape', ()))}"
        )
    if S is None:
        S = torch.zeros((0, da, da), dtype=torch.float32, device=A.device)
    if not isinstance(S, torch.Tensor) or S.dim() != 3 or tuple(S.shape[1:]) != (da, da):
        raise ValueError(
            f"{fn}: expected S [K2, da, da] = [K2, {da}, {da}], got S.shape={tuple(getattr(S, 'shape', ()))}"
        )
    for name, x in (("G", G), ("S", S)):
        if not x.is_floating_point():
            raise TypeError(f"{fn}: expected {name} to be a float tensor, got {name}.dtype={x.dtype}")
        if x.device != A.device:
            raise ValueError(f"{fn}: expected {name} on {A.device} like A, got {name} on {x.device}")
    if Z.device != A.device:
        raise ValueError(f"{fn}: expected Z on {A.device} like A, got Z on {Z.device}")
    if max(_pad16(d_out), _pad16(d_in)) * _pad16(d_in) >= 2**31:
        raise ValueError(
            f"{fn}: expected d_out * d_in and d_in**2 below 2**31 (one direction "
            f"or second-moment matrix per offset range), got G.shape={tuple(G.shape)}"
        )
    return n, d_in, d_out, G.shape[0], S.shape[0], S


#: the jitted kernel itself (its record's ``jit_kernels``: its source hash is part of the resource report)
KERNEL = _head_stack_kernel

__all__ = ["head_stack", "head_stack_operands"]


def _register():
    """This kernel's record (its sweeps and cases are in :mod:`.head_sweeps`, shared with its epilogues).

    Imported here rather than at the top: Triton's source hash of a kernel includes the line
    it starts on, and the committed resource report is keyed by those hashes.
    """
    from functools import partial

    from normfast.core.reference.head_stack import head_stack_reference

    from . import costs, head_sweeps
    from .spec import KernelSpec, ResourcePlan, register
    from .utils import head_block_sizes

    def launches(h: dict, dtypes: tuple[str, ...]):
        for labels, (A, Z, G, S) in head_sweeps.sweep_problems(h, dtypes):
            flags = {"has_bias": labels["bias"], "allow_tf32": labels["precision"] == "tf32"}
            yield dict(labels, op="head_stack"), partial(head_stack, A, Z, G, S, **flags)

    return register(
        KernelSpec(
            name="head_stack",
            launcher=head_stack,
            reference=head_stack_reference,
            tiles=head_block_sizes,
            cost=head_sweeps.stack_cost,
            units=costs.head_units,
            cost_config=head_sweeps.default_config,
            jit_kernels=(_head_stack_kernel,),
            variant_class=head_sweeps.variant_class,
            summary_class=head_sweeps.summary_class,
            scalar_products="FMA",
            resources=ResourcePlan("head", head_sweeps.HEAD_SWEEP, launches),
            check_cases=head_sweeps.stack_check_cases,
            case_label=head_sweeps.stack_label,
            roofline=costs.head_roofline_rows,
        )
    )


#: this kernel's record (:class:`~normfast.kernels.spec.KernelSpec`)
SPEC = _register()

"""The three stacked head products, per chunk of probe rows (:func:`head_products`), and their layout
(:func:`stack_plan`, shared with the FLOP model and the benchmark's GEMM floor)."""

from __future__ import annotations

from typing import Any

import torch

# Elements of scratch memory head_products may allocate per probe chunk; a chunk's
# products then stay in the last-level cache between the GEMM and its epilogue.
_HEAD_SCRATCH = 1 << 20
# Width of the column blocks of the folded quadratic forms (torch backend).
_TRI_BLOCK = 32


def stack_plan(d_in: int, d_out: int, k1: int, k2: int) -> dict[str, Any]:
    """How the torch backend lays out the stacked products (shared with the benchmark's GEMM floor).

    ``blocks``: the column blocks ``[c0, c1)`` (``_TRI_BLOCK`` wide) of the
    folded quadratic forms: block ``[c0, c1)`` multiplies ``a[:, c0:]`` by rows
    ``c0..`` of the lower triangles, so the K2 forms cost about
    ``(1 + 1/b)/2`` of a full ``a·S`` for ``b`` blocks. ``rows``: probe rows per
    chunk, so that one chunk's products fit in ``_HEAD_SCRATCH`` elements.
    """
    blocks = [(c0, min(c0 + _TRI_BLOCK, d_in)) for c0 in range(0, d_in, _TRI_BLOCK)] if k2 else []
    width = d_out + k2 * min(_TRI_BLOCK, d_in) + d_in + d_out
    return {"blocks": blocks, "rows": max(64, _HEAD_SCRATCH // width)}


def fold_quadratic(S: torch.Tensor) -> torch.Tensor:
    """``tril(S + Sᵀ, −1) + diag(S)`` of every ``S`` in ``[K, d, d]``: the same quadratic form, lower triangle only."""
    folded = torch.tril(S + S.transpose(1, 2), diagonal=-1)
    folded += torch.diag_embed(torch.diagonal(S, dim1=1, dim2=2))
    return folded


def head_products(
    A: torch.Tensor,
    Z: torch.Tensor,
    G_stack: torch.Tensor,
    S_stack: torch.Tensor | None,
    has_bias: bool,
    backend: str = "torch",
    *,
    dtype: torch.dtype | None = None,
    allow_tf32: bool = False,
) -> dict[str, torch.Tensor]:
    """The stacked head products, :func:`normfast.core.reference.head_stack_reference`'s contract.

    ``G_stack`` ``[K1, d_out, da]``, ``S_stack`` ``[K2, da, da]`` (None:
    ``K2 = 0``), ``da = d_in (+1 with a bias)``, ``ã = [a, 1]``. Returns
    ``zdot [N, K1] = z·(G_k ã)``, ``sq [N, K1] = |G_k ã|²``,
    ``quad [N, K2] = ãᵀS_kã`` and ``norm [N] = |z|``.

    Backend "torch": per chunk of rows (:func:`stack_plan`), one GEMM per
    direction matrix (``[a | 1]·G̃_kᵀ``, reduced to its dot and square while in
    cache), and the quadratic forms on their folded lower triangles
    (:func:`fold_quadratic`) in column blocks, all K2 side by side per block:
    about half the multiply-adds of ``a·S_k`` (the Triton kernel uses the
    same symmetry). The bias enters as an ``addmm`` term and a linear term;
    scratch is allocated once and reused.
    "triton": :func:`normfast.kernels.head_stack` (one fused pass that reads
    ``a`` once and never writes an ``N × K d`` product).
    """
    cd = dtype or (torch.float64 if A.dtype == torch.float64 else torch.float32)
    da = G_stack.shape[2]
    if S_stack is None:
        S_stack = torch.empty((0, da, da), dtype=cd, device=A.device)
    if backend == "triton":
        from normfast.kernels import KERNEL_INPUT_DTYPES, head_stack

        A_k = A if A.dtype in KERNEL_INPUT_DTYPES else A.float()
        Z_k = Z if Z.dtype in KERNEL_INPUT_DTYPES else Z.float()
        zdot, sq, quad, norm = head_stack(
            A_k,
            Z_k,
            G_stack.float().contiguous(),
            S_stack.float().contiguous(),
            has_bias=has_bias,
            allow_tf32=allow_tf32,
        )
        return {"zdot": zdot, "sq": sq, "quad": quad, "norm": norm}
    n, d_in = A.shape
    k1, d_out, _ = G_stack.shape
    k2 = S_stack.shape[0]
    dev_kw = {"dtype": cd, "device": A.device}
    plan = stack_plan(d_in, d_out, k1, k2)
    # one [d_in, d_out] factor per direction matrix, and per triangular block of columns
    # [c0, c1) the rows c0.. of every folded S_k side by side: [d_in - c0, K2 (c1 - c0)]
    g_w = G_stack[:, :, :d_in].to(cd).transpose(1, 2).contiguous()
    g_b = G_stack[:, :, d_in].to(cd) if has_bias else None
    folded = fold_quadratic(S_stack[:, :d_in, :d_in].to(cd))
    tri = [
        folded[:, c0:, c0:c1].permute(1, 0, 2).reshape(d_in - c0, k2 * (c1 - c0)).contiguous()
        for c0, c1 in plan["blocks"]
    ]
    s_b = (S_stack[:, d_in, :d_in] + S_stack[:, :d_in, d_in]).to(cd).T.contiguous() if has_bias else None
    s_c = S_stack[:, d_in, d_in].to(cd) if has_bias else None
    step = min(n, plan["rows"])
    zdot = torch.empty((n, k1), **dev_kw)
    sq = torch.empty((n, k1), **dev_kw)
    quad = torch.zeros((n, k2), **dev_kw)
    norm = torch.empty(n, **dev_kw)
    v_buf = torch.empty((step, d_out), **dev_kw)
    p_buf = torch.empty((step, max((k2 * (c1 - c0) for c0, c1 in plan["blocks"]), default=0)), **dev_kw)
    for r0 in range(0, n, step):
        a = A[r0 : r0 + step].to(cd)
        z = Z[r0 : r0 + step].to(cd)
        c = a.shape[0]
        rows = slice(r0, r0 + c)
        v = v_buf[:c]
        for k in range(k1):  # one direction matrix at a time: its product stays in cache for the reductions
            if g_b is None:
                torch.mm(a, g_w[k], out=v)
            else:
                torch.addmm(g_b[k], a, g_w[k], out=v)
            zdot[rows, k] = torch.bmm(v[:, None, :], z[:, :, None]).view(c)
            sq[rows, k] = torch.linalg.vector_norm(v, dim=1).square_()
        torch.linalg.vector_norm(z, dim=1, out=norm[rows])
        if k2:
            q = quad[rows]
            for (c0, c1), f in zip(plan["blocks"], tri):
                w = c1 - c0
                p = p_buf[:c, : k2 * w]
                torch.mm(a[:, c0:], f, out=p)
                q += torch.bmm(p.view(c, k2, w), a[:, c0:c1, None]).view(c, k2)
            if s_b is not None:
                q.addmm_(a, s_b)
                q += s_c
    return {"zdot": zdot, "sq": sq, "quad": quad, "norm": norm}

"""Fused streaming update of the per-probe accumulators (one read of ``t``).

For every probe row the kernel reads ``z`` once and each of the ``K`` new
displacement rows once, and in the same pass: scales them into the branch
vectors (``u = R t`` or ``w = t``), takes the radial dot with ``ẑ``, and folds
vector sum, squared deviation, radial sums and sign counts into the running
state with the shifted-sum (Welford/Chan) update described in
:func:`accumulate`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import MAX_FUSED_DIM, KernelLaunch, accumulate_configs, check_kernel_device, check_kernel_dtype, launch


@triton.jit(do_not_specialize=["K", "n_old"])
def _accumulate_kernel(
    T_ptr,  # [K, N, D] displacements of the first branch (u before scaling by R, or w)
    TW_ptr,  # [K, N, D] w-branch displacements (read only when HAS_W)
    Z_ptr,  # [N, D] probe embeddings
    MEAN_ptr,  # [N, D] fp32 running mean vector of the first branch, contiguous
    MEANW_ptr,  # [N, D] fp32 running mean vector of the w branch (only when HAS_W)
    MOM_ptr,  # [NB, 3, N] fp32 per branch: M2 = sum |x - mean|^2, radial mean, radial M2
    CNT_ptr,  # [NB, 2, N] int64 per branch: #(r > 0), #(r < 0)
    CROSS_ptr,  # [N] fp32 running mean of u.w (only when HAS_W)
    REASON_ptr,  # [N] int8 first failure code per row (0 = ok)
    K,  # number of new directions in this update
    N,  # number of probes
    D,  # embedding width
    n_old,  # directions already in the state (0 = empty state)
    stride_tk,
    stride_tn,
    stride_td,
    stride_wk,
    stride_wn,
    stride_wd,
    stride_zn,
    stride_zd,
    SCALE_BY_NORM: tl.constexpr,  # first branch is u = R t (else w = t)
    HAS_W: tl.constexpr,  # a second, unscaled w branch and the cross term follow
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # >= D: a whole row per block
):
    # Phase 1: the tile of rows, the embedding, its norm and direction.
    # 64-bit block origins, 32-bit offsets inside a block (the launcher checks
    # they fit): no 64-bit offset tile stays live across the direction loop.
    first_row = tl.program_id(0).to(tl.int64) * BLOCK_N
    T_ptr += first_row * stride_tn
    TW_ptr += first_row * stride_wn
    Z_ptr += first_row * stride_zn
    MEAN_ptr += first_row * D
    MEANW_ptr += first_row * D
    rloc = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    rows = first_row + rloc  # for the per-row state, [NB, *, N]
    row_ok = rloc < N - first_row
    tile_ok = row_ok[:, None] & (cols < D)[None, :]
    z = tl.load(Z_ptr + rloc[:, None] * stride_zn + cols[None, :] * stride_zd, mask=tile_ok, other=0.0).to(tl.float32)
    norm = tl.sqrt(tl.sum(z * z, axis=1))
    zhat = z / norm[:, None]
    if SCALE_BY_NORM:
        scale = norm
    else:
        scale = tl.full((BLOCK_N,), 1.0, tl.float32)

    # Phase 2: shifts. An empty state is shifted by its first new direction,
    # a filled one by its current means, so every sum below is of deviations.
    first = n_old == 0
    state_offs = rloc[:, None] * D + cols[None, :]
    mean_u = tl.load(MEAN_ptr + state_offs, mask=tile_ok, other=0.0)
    x0 = (
        tl.load(T_ptr + rloc[:, None] * stride_tn + cols[None, :] * stride_td, mask=tile_ok & first, other=0.0).to(
            tl.float32
        )
        * scale[:, None]
    )
    shift_u = tl.where(first, x0, mean_u)
    rshift_u = tl.where(first, tl.sum(x0 * zhat, axis=1), tl.load(MOM_ptr + 1 * N + rows, mask=row_ok, other=0.0))
    s1_u = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    s2_u = tl.zeros((BLOCK_N,), tl.float32)
    r1_u = tl.zeros((BLOCK_N,), tl.float32)
    r2_u = tl.zeros((BLOCK_N,), tl.float32)
    pos_u = tl.zeros((BLOCK_N,), tl.int32)
    neg_u = tl.zeros((BLOCK_N,), tl.int32)
    if HAS_W:
        mean_w = tl.load(MEANW_ptr + state_offs, mask=tile_ok, other=0.0)
        w0 = tl.load(
            TW_ptr + rloc[:, None] * stride_wn + cols[None, :] * stride_wd, mask=tile_ok & first, other=0.0
        ).to(tl.float32)
        shift_w = tl.where(first, w0, mean_w)
        rshift_w = tl.where(first, tl.sum(w0 * zhat, axis=1), tl.load(MOM_ptr + 4 * N + rows, mask=row_ok, other=0.0))
        cshift = tl.where(first, tl.sum(x0 * w0, axis=1), tl.load(CROSS_ptr + rows, mask=row_ok, other=0.0))
        s1_w = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        s2_w = tl.zeros((BLOCK_N,), tl.float32)
        r1_w = tl.zeros((BLOCK_N,), tl.float32)
        r2_w = tl.zeros((BLOCK_N,), tl.float32)
        pos_w = tl.zeros((BLOCK_N,), tl.int32)
        neg_w = tl.zeros((BLOCK_N,), tl.int32)
        c1 = tl.zeros((BLOCK_N,), tl.float32)

    # Phase 3: one pass over the K new directions.
    # Walk the direction axis by pointer increments (64-bit, whatever K * N * D is).
    t_ptrs = T_ptr + rloc[:, None] * stride_tn + cols[None, :] * stride_td
    w_ptrs = TW_ptr + rloc[:, None] * stride_wn + cols[None, :] * stride_wd
    for k in range(K):
        x = tl.load(t_ptrs, mask=tile_ok, other=0.0).to(tl.float32) * scale[:, None]
        t_ptrs += stride_tk
        dev = x - shift_u
        s1_u += dev
        s2_u += tl.sum(dev * dev, axis=1)
        r = tl.sum(x * zhat, axis=1)
        dr = r - rshift_u
        r1_u += dr
        r2_u += dr * dr
        pos_u += (r > 0).to(tl.int32)
        neg_u += (r < 0).to(tl.int32)
        if HAS_W:
            xw = tl.load(w_ptrs, mask=tile_ok, other=0.0).to(tl.float32)
            w_ptrs += stride_wk
            dev_w = xw - shift_w
            s1_w += dev_w
            s2_w += tl.sum(dev_w * dev_w, axis=1)
            rw = tl.sum(xw * zhat, axis=1)
            drw = rw - rshift_w
            r1_w += drw
            r2_w += drw * drw
            pos_w += (rw > 0).to(tl.int32)
            neg_w += (rw < 0).to(tl.int32)
            c1 += tl.sum(x * xw, axis=1) - cshift

    # Phase 4: merge the shifted sums into the state:
    # mean' = s + S1/n',  M2' = M2 + S2 - |S1|^2/n'.
    n_new = (n_old + K).to(tl.float32)
    m2_u = tl.where(first, 0.0, tl.load(MOM_ptr + rows, mask=row_ok, other=0.0))
    rm2_u = tl.where(first, 0.0, tl.load(MOM_ptr + 2 * N + rows, mask=row_ok, other=0.0))
    state_offs = rloc[:, None] * D + cols[None, :]  # recomputed: not live across the loop
    tl.store(MEAN_ptr + state_offs, shift_u + s1_u / n_new, mask=tile_ok)
    tl.store(MOM_ptr + rows, m2_u + s2_u - tl.sum(s1_u * s1_u, axis=1) / n_new, mask=row_ok)
    tl.store(MOM_ptr + 1 * N + rows, rshift_u + r1_u / n_new, mask=row_ok)
    tl.store(MOM_ptr + 2 * N + rows, rm2_u + r2_u - r1_u * r1_u / n_new, mask=row_ok)
    old_pos_u = tl.load(CNT_ptr + rows, mask=row_ok, other=0)
    old_neg_u = tl.load(CNT_ptr + N + rows, mask=row_ok, other=0)
    tl.store(CNT_ptr + rows, old_pos_u + pos_u.to(tl.int64), mask=row_ok)
    tl.store(CNT_ptr + N + rows, old_neg_u + neg_u.to(tl.int64), mask=row_ok)
    # A non-finite deviation or radial sum means a non-finite displacement.
    bad_t = ((s2_u * 0.0) != 0.0) | ((r2_u * 0.0) != 0.0)
    if HAS_W:
        m2_w = tl.where(first, 0.0, tl.load(MOM_ptr + 3 * N + rows, mask=row_ok, other=0.0))
        rm2_w = tl.where(first, 0.0, tl.load(MOM_ptr + 5 * N + rows, mask=row_ok, other=0.0))
        tl.store(MEANW_ptr + state_offs, shift_w + s1_w / n_new, mask=tile_ok)
        tl.store(MOM_ptr + 3 * N + rows, m2_w + s2_w - tl.sum(s1_w * s1_w, axis=1) / n_new, mask=row_ok)
        tl.store(MOM_ptr + 4 * N + rows, rshift_w + r1_w / n_new, mask=row_ok)
        tl.store(MOM_ptr + 5 * N + rows, rm2_w + r2_w - r1_w * r1_w / n_new, mask=row_ok)
        old_pos_w = tl.load(CNT_ptr + 2 * N + rows, mask=row_ok, other=0)
        old_neg_w = tl.load(CNT_ptr + 3 * N + rows, mask=row_ok, other=0)
        tl.store(CNT_ptr + 2 * N + rows, old_pos_w + pos_w.to(tl.int64), mask=row_ok)
        tl.store(CNT_ptr + 3 * N + rows, old_neg_w + neg_w.to(tl.int64), mask=row_ok)
        tl.store(CROSS_ptr + rows, cshift + c1 / n_new, mask=row_ok)
        bad_t = bad_t | ((s2_w * 0.0) != 0.0) | ((r2_w * 0.0) != 0.0) | ((c1 * 0.0) != 0.0)

    # Phase 5: the first failure per row wins; embedding problems before
    # displacement problems (codes as in normfast.ops.REASONS).
    code = tl.where(norm == 0.0, 1, tl.where((norm * 0.0) != 0.0, 2, tl.where(bad_t, 3, 0)))
    old_code = tl.load(REASON_ptr + rows, mask=row_ok, other=0)
    tl.store(REASON_ptr + rows, tl.where(old_code != 0, old_code, code.to(tl.int8)), mask=row_ok)


def _int32_addressable(x: torch.Tensor) -> torch.Tensor:
    """``x`` when a block of rows spans fewer than 2**31 elements along its strides, else contiguous."""
    row, col = x.stride(-2), x.stride(-1)
    if 64 * abs(row) + MAX_FUSED_DIM * abs(col) < 2**31:
        return x
    return x.contiguous()


def accumulate(
    t: torch.Tensor,
    z: torch.Tensor,
    mean: torch.Tensor,
    moments: torch.Tensor,
    counts: torch.Tensor,
    reason: torch.Tensor,
    n_seen: int,
    *,
    branch: str = "u",
    t_w: torch.Tensor | None = None,
    cross: torch.Tensor | None = None,
) -> None:
    """Fold ``K`` new directions into the packed accumulator state, in place.

    Per probe row ``i`` (``R = |z_i|``, ``ẑ = z_i / R``) and branch vector
    ``x^B`` (``u = R t`` for ``branch`` "u", ``w = t`` for "w"; for "uw",
    ``t`` is the u-branch and ``t_w`` the w-branch), with shift ``s`` = the
    current mean (or the first new vector when ``n_seen == 0``)::

        S1 = sum_k (x_k - s)        S2 = sum_k |x_k - s|^2        n' = n + K
        mean' = s + S1 / n'         M2' = M2 + S2 - |S1|^2 / n'

    and the same for the scalar radial dots ``r_k = ẑ·x_k`` (radial mean and
    radial M2), ``#(r > 0)``, ``#(r < 0)``, and for "uw" the running mean of
    ``u·w``. Rows whose embedding has zero or non-finite norm, or whose
    displacements are non-finite, get a reason code (first one sticks).

    Must match :func:`normfast.core.reference.accumulate_reference`.

    Shapes: ``t``/``t_w`` ``[K, N, D]`` (any strides, fp16/bf16/fp32), ``z``
    ``[N, D]``; the state is fp32 and contiguous: ``mean [NB, N, D]``,
    ``moments [NB, 3, N]`` (M2, radial mean, radial M2), ``counts [NB, 2, N]``
    int64, ``cross [N]`` (for "uw"), ``reason [N]`` int8; ``NB`` is 2 for
    "uw", else 1. ``D`` must be at most ``MAX_FUSED_DIM`` (a whole row lives
    in one block); wider embeddings use the torch path.
    """
    fn = "accumulate"
    if branch not in ("u", "w", "uw"):
        raise ValueError(f"{fn}: expected branch 'u', 'w' or 'uw', got {branch!r}")
    if t.dim() != 3 or z.dim() != 2 or t.shape[1:] != z.shape:
        raise ValueError(
            f"{fn}: expected t [K, N, D] and z [N, D], got t.shape={tuple(t.shape)}, z.shape={tuple(z.shape)}"
        )
    K, N, D = t.shape
    nb = 2 if branch == "uw" else 1
    if (branch == "uw") != (t_w is not None) or (branch == "uw") != (cross is not None):
        raise ValueError(f"{fn}: t_w and cross are required for branch 'uw' and only then")
    if t_w is not None and t_w.shape != t.shape:
        raise ValueError(f"{fn}: expected t_w.shape == t.shape={tuple(t.shape)}, got t_w.shape={tuple(t_w.shape)}")
    if D > MAX_FUSED_DIM:
        raise ValueError(f"{fn}: expected D <= {MAX_FUSED_DIM}, got t.shape={tuple(t.shape)}")
    expected = {
        "mean": (mean, (nb, N, D), torch.float32),
        "moments": (moments, (nb, 3, N), torch.float32),
        "counts": (counts, (nb, 2, N), torch.int64),
        "reason": (reason, (N,), torch.int8),
    }
    if cross is not None:
        expected["cross"] = (cross, (N,), torch.float32)
    for name, (x, shape, dtype) in expected.items():
        if tuple(x.shape) != shape or x.dtype != dtype or not x.is_contiguous():
            raise ValueError(
                f"{fn}: expected {name} contiguous {dtype} of shape {shape}, "
                f"got {name}.shape={tuple(x.shape)}, dtype={x.dtype}"
            )
    for name, x in (("t", t), ("z", z), ("t_w", t_w)):
        if x is not None:
            check_kernel_dtype(fn, name, x)
    check_kernel_device(fn, t, z, t_w, mean)
    if K == 0:
        return
    # 32-bit offsets inside a block of rows (the kernel adds them to a 64-bit origin)
    t, t_w, z = (None if x is None else _int32_addressable(x) for x in (t, t_w, z))
    tw = t if t_w is None else t_w
    cross_arg = moments if cross is None else cross  # never read without HAS_W
    launch(
        KernelLaunch(
            name=fn,
            kernel=_accumulate_kernel,
            grid=lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),),
            args=(
                t,
                tw,
                z,
                mean[0],
                mean[nb - 1],
                moments,
                counts,
                cross_arg,
                reason,
                K,
                N,
                D,
                int(n_seen),
                t.stride(0),
                t.stride(1),
                t.stride(2),
                tw.stride(0),
                tw.stride(1),
                tw.stride(2),
                z.stride(0),
                z.stride(1),
            ),
            meta={"SCALE_BY_NORM": branch in ("u", "uw"), "HAS_W": branch == "uw"},
            configs=accumulate_configs(dim=D, branch=branch),
            key=("D",),
            # the autotuner's trial runs must not fold the directions in twice
            restore=("MEAN_ptr", "MEANW_ptr", "MOM_ptr", "CNT_ptr", "CROSS_ptr", "REASON_ptr"),
        )
    )


#: the jitted kernel itself (its record's ``jit_kernels``: its source hash is part of the resource report)
KERNEL = _accumulate_kernel

#: The resource report's problems: every branch at widths 1, odd and 16-aligned up to MAX_FUSED_DIM.
ACCUMULATE_SWEEP = {"branches": ("u", "w", "uw"), "n": 1000, "dims": (1, 3, 64, 100, 384, 768, 1000, 1024, 2048)}


def _resource_launches(sw: dict, dtypes: tuple[str, ...]):
    from functools import partial

    from .spec import meta_zeros

    n = sw["n"]
    for name in dtypes:
        dtype = getattr(torch, name)
        for branch in sw["branches"]:
            for dim in sw["dims"]:
                nb = 2 if branch == "uw" else 1
                t = meta_zeros(3, n, dim, dtype=dtype)
                state = (
                    meta_zeros(nb, n, dim),
                    meta_zeros(nb, 3, n),
                    meta_zeros(nb, 2, n, dtype=torch.int64),
                    meta_zeros(n, dtype=torch.int8),
                )
                extra = {"t_w": t, "cross": meta_zeros(n)} if branch == "uw" else {}
                labels = {"op": "accumulate", "dtype": name, "branch": branch, "n": n, "dim": dim}
                yield labels, partial(accumulate, t, t[0], *state, 0, branch=branch, **extra)


def _check_cases(gpu: bool) -> dict[int, list[dict]]:
    if not gpu:
        return {24: [{"op": "accumulate", "n": 70, "dim": 24, "k": 3, "dtype": "float32", "branch": "u"}]}
    out = {}
    for d in (384, 768):
        branches = (("float32", "u"), ("bfloat16", "u")) + ((("float32", "uw"),) if d == 384 else ())
        out[d] = [{"op": "accumulate", "n": 2**20, "dim": d, "k": 8, "dtype": t, "branch": b} for t, b in branches]
    return out


def _cost(c: dict, config: dict | None = None, n: int | None = None) -> dict:
    from . import costs

    # memory-bound: the tiles do not change what crosses HBM
    return costs.accumulate_cost(c["dim"], c["k"], branch=c["branch"], dtype=c["dtype"])


def _register():
    """This kernel's record.

    Imported here rather than at the top: Triton's source hash of a kernel includes the line
    it starts on, and the committed resource report is keyed by those hashes.
    """
    from normfast.core.reference.accumulate import accumulate_reference

    from . import costs
    from .spec import KernelSpec, ResourcePlan, register
    from .utils import accumulate_block_sizes

    return register(
        KernelSpec(
            name="accumulate",
            launcher=accumulate,
            reference=accumulate_reference,
            tiles=accumulate_block_sizes,
            cost=_cost,
            jit_kernels=(_accumulate_kernel,),
            variant_class=lambda first: first["dtype"] + (", uw" if first["branch"] == "uw" else ""),
            summary_class=lambda cls: "branch uw" if cls.endswith(", uw") else "branch u or w",
            resources=ResourcePlan("accumulate", ACCUMULATE_SWEEP, _resource_launches),
            check_cases=_check_cases,
            case_label=lambda c: f"accumulate[{c['branch']}] N={c['n']} d={c['dim']} K={c['k']} {c['dtype']}",
            roofline=costs.accumulate_roofline_rows,
        )
    )


#: this kernel's record (:class:`~normfast.kernels.spec.KernelSpec`)
SPEC = _register()

"""Backend API: the probe-statistics estimator on plain arrays.

Frontends that have their own models call these functions directly. Inputs
are torch tensors or any DLPack array (numpy, CuPy, JAX); results are torch
tensors. CUDA tensors run the Triton kernels of :mod:`normfast.kernels`; CPU
tensors run the same math as torch ops (BLAS), in float64 when the inputs are
float64 and otherwise in float32 with fp32 accumulation.

* :class:`ProbeAccumulator` -- streaming, mergeable per-probe statistics from
  explicit displacements ``t_i^B`` (any probed parameters, "jvp" mode).
* :func:`head_stats` -- closed form for a linear head ``z = W a + b`` ("head"
  mode), from the per-batch head directions ``G_B`` (and bias ``g_B``).
* :func:`prepare_head` -- center the head directions once, for streaming many
  probe chunks through :func:`head_stats`.
* :func:`head_flops` -- the FLOP count of the two head-mode forms.
* ``solve_quartic``, ``equilibrium_coefficients``, ``equilibrium_norm`` --
  the equilibrium law, re-exported from :mod:`normfast.core.equilibrium`.

Every statistic dict holds, per branch, ``D, se_D, sign_stability, m2, V2,
Q`` (suffix ``_w`` for the scale-free branch; ``C_uw`` when both), plus
``valid`` (bool ``[N]``), ``reason`` (int8 ``[N]``, codes into
:data:`REASONS`) and ``M``. Invalid rows hold NaN; no row is ever dropped.
"""
from __future__ import annotations

import importlib
from typing import Any

import torch

from normfast.core.checks import as_tensor, check_float, check_ndim, check_same_device, describe
from .accumulator import (
    BACKENDS,
    NON_FINITE_DISPLACEMENT,
    NON_FINITE_EMBEDDING,
    REASONS,
    STAT_KEYS,
    ZERO_NORM,
    ProbeAccumulator,
    stat_names,
)

__all__ = [
    "REASONS",
    "STAT_KEYS",
    "ProbeAccumulator",
    "HeadDirections",
    "prepare_head",
    "head_stats",
    "head_flops",
    "stat_names",
    "solve_quartic",
    "equilibrium_coefficients",
    "equilibrium_norm",
]

_EQUILIBRIUM = ("solve_quartic", "equilibrium_coefficients", "equilibrium_norm")
_FORMS = ("auto", "S", "per_batch")
# Elements of scratch memory the torch head path may allocate per probe chunk.
_HEAD_SCRATCH = 1 << 24


def __getattr__(name: str) -> Any:
    # The equilibrium module is imported on first use only.
    if name in _EQUILIBRIUM:
        value = getattr(importlib.import_module("normfast.core.equilibrium"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'normfast.engine.ops' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _compute_dtype(fn: str, dtype: torch.dtype | None, *tensors: torch.Tensor) -> torch.dtype:
    if dtype is None:
        wide = any(x.dtype == torch.float64 for x in tensors if x is not None)
        return torch.float64 if wide else torch.float32
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{fn}: expected dtype None, torch.float32 or torch.float64, "
                        f"got dtype={dtype}")
    return dtype


# ============================================================================
# Head mode
# ============================================================================


class HeadDirections:
    """The M head directions of a linear head, augmented and centered.

    ``g_bar`` ``[d_out, d_in (+1)]`` is the mean of ``G̃_B = [G_B | g_B]``
    (bias column last when there is a bias) and ``g_centered``
    ``[M, d_out, d_in (+1)]`` holds ``G̃_B - g_bar``. The covariance
    ``S_c = Σ_B G̃^cᵀ_B G̃^c_B / (M-1)`` is formed on first use and cached.
    Build with :func:`prepare_head`.
    """

    def __init__(self, g_bar: torch.Tensor, g_centered: torch.Tensor, has_bias: bool) -> None:
        self.g_bar = g_bar
        self.g_centered = g_centered
        self.has_bias = has_bias
        self._s_c: torch.Tensor | None = None

    @property
    def M(self) -> int:
        return self.g_centered.shape[0]

    @property
    def d_out(self) -> int:
        return self.g_centered.shape[1]

    @property
    def d_in(self) -> int:
        return self.g_centered.shape[2] - int(self.has_bias)

    @property
    def dtype(self) -> torch.dtype:
        return self.g_bar.dtype

    @property
    def device(self) -> torch.device:
        return self.g_bar.device

    def covariance(self) -> torch.Tensor:
        """``S_c`` ``[d_in (+1), d_in (+1)]``, one GEMM over the ``M·d_out`` centered rows."""
        if self._s_c is None:
            flat = self.g_centered.reshape(self.M * self.d_out, -1)
            self._s_c = (flat.T @ flat).div_(self.M - 1)
        return self._s_c

    def __repr__(self) -> str:
        return (f"HeadDirections(M={self.M}, d_out={self.d_out}, d_in={self.d_in}, "
                f"has_bias={self.has_bias}, dtype={self.dtype}, device={self.device})")


def prepare_head(G: Any, g_bias: Any = None, *, dtype: torch.dtype | None = None) -> HeadDirections:
    """Center the per-batch head directions once.

    ``G`` ``[M, d_out, d_in]`` holds ``∂L_B/∂W`` (or the optimizer's update
    direction) for each virtual batch, ``g_bias`` ``[M, d_out]`` the bias
    part (``None`` for a bias-free head). The result is float64 when ``G`` is
    float64 (or ``dtype=torch.float64``), else float32.
    """
    fn = "prepare_head"
    G = as_tensor(fn, "G", G)
    g_bias = None if g_bias is None else as_tensor(fn, "g_bias", g_bias)
    _check_directions(fn, G, g_bias)
    cd = _compute_dtype(fn, dtype, G, g_bias)
    return _prepare(G, g_bias, cd)


def _check_directions(fn: str, G: torch.Tensor, g_bias: torch.Tensor | None) -> None:
    check_float(fn, "G", G)
    check_ndim(fn, "G", G, 3, "3-D [M, d_out, d_in]")
    if g_bias is not None:
        check_float(fn, "g_bias", g_bias)
        check_ndim(fn, "g_bias", g_bias, 2, "2-D [M, d_out]")
        if tuple(g_bias.shape) != tuple(G.shape[:2]):
            raise ValueError(f"{fn}: expected g_bias of shape [M, d_out]={tuple(G.shape[:2])} "
                             f"matching G, got {describe('g_bias', g_bias)}")
        check_same_device(fn, G=G, g_bias=g_bias)
    if G.shape[0] < 2:
        raise ValueError(f"{fn}: expected at least 2 virtual batches (M >= 2) in "
                         f"G [M, d_out, d_in], got {describe('G', G)}")
    if G.shape[1] == 0 or G.shape[2] == 0:
        raise ValueError(f"{fn}: expected non-empty d_out and d_in in G [M, d_out, d_in], "
                         f"got {describe('G', G)}")


def _prepare(G: torch.Tensor, g_bias: torch.Tensor | None, cd: torch.dtype) -> HeadDirections:
    m, d_out, d_in = G.shape
    has_bias = g_bias is not None
    aug = torch.empty((m, d_out, d_in + int(has_bias)), dtype=cd, device=G.device)
    aug[:, :, :d_in] = G
    if has_bias:
        aug[:, :, d_in] = g_bias
    g_bar = aug.mean(0)
    aug -= g_bar  # centered in place: no statistic needs the raw directions again
    return HeadDirections(g_bar, aug, has_bias)


def head_flops(n: int, d_in: int, d_out: int, m: int, *, bias: bool = False) -> dict[str, int]:
    """Multiply-add FLOPs (2 per MAC) of the two head-mode forms for ``n`` probes.

    ``S``: forming ``S_c`` (``2 M d_out da²``) plus ``2 n (da² + da d_out)``;
    ``per_batch``: ``2 n (M + 1) da d_out``; ``da = d_in (+1 with bias)``.
    Centering and the O(n d) epilogues are not counted.
    """
    da = d_in + int(bias)
    return {"S": 2 * m * d_out * da * da + 2 * n * (da * da + da * d_out),
            "per_batch": 2 * n * (m + 1) * da * d_out}


def head_stats(
    A: Any,
    Z: Any,
    G: Any,
    g_bias: Any = None,
    *,
    branch: str = "u",
    form: str = "auto",
    radial_spread: bool = True,
    backend: str = "auto",
    dtype: torch.dtype | None = None,
    allow_tf32: bool = False,
) -> dict[str, Any]:
    """Probe statistics of a linear head in closed form (no per-probe displacements).

    ``A`` ``[N, d_in]`` are the probe activations feeding the head, ``Z``
    ``[N, d_out]`` the embeddings (``Z = A Wᵀ + b``), ``G`` ``[M, d_out, d_in]``
    the per-batch update directions of ``W`` and ``g_bias`` ``[M, d_out]``
    those of ``b`` (or ``G`` may be a :class:`HeadDirections` from
    :func:`prepare_head`, with ``g_bias=None``). The displacement of probe
    ``i`` along batch ``B`` is ``t_i^B = -(G_B a_i + g_B)``; the result equals
    feeding every ``t_i^B`` through a :class:`ProbeAccumulator`.

    With ``ã = [a, 1]``, centered ``G̃^c_B``, ``s = R`` (branch "u") or ``1``
    ("w"): ``x̄ = -s Ḡã``, ``D = ẑ·x̄``, ``m2 = s²|Ḡã|²``, and ``V2`` either
    ``s² ãᵀ S_c ã`` (``form="S"``, cost ~``N d_in²``) or
    ``s² Σ_B |G̃^c_B ã|²/(M-1)`` (``form="per_batch"``, ~``N M d_in d_out``,
    which also gives ``se_D`` and ``sign_stability`` exactly).

    ``radial_spread=True`` (default) always uses the per-batch form.
    ``radial_spread=False`` with ``form="auto"`` picks the cheaper form by
    :func:`head_flops`; the S form cannot see the per-batch radial dots, so
    its ``se_D`` and ``sign_stability`` are NaN. ``branch`` is "u" or "w"
    (one head has one update direction per batch).

    ``backend``: "auto" (Triton kernels for CUDA tensors computed in float32,
    torch otherwise), "torch" or "triton" (on CPU only with
    ``TRITON_INTERPRET=1``). ``dtype``: compute precision, float64 when any
    input is float64 unless given; float64 always runs the torch path.
    ``allow_tf32`` lets the CUDA kernels use TF32 products (faster, ~1e-3
    relative). Results are torch tensors of the compute dtype.
    """
    fn = "head_stats"
    if branch not in ("u", "w"):
        raise ValueError(f"{fn}: expected branch 'u' or 'w' (a head has one update direction "
                         f"per batch; use ProbeAccumulator for 'uw'), got branch={branch!r}")
    if form not in _FORMS:
        raise ValueError(f"{fn}: expected form to be one of {_FORMS}, got form={form!r}")
    if form == "S" and radial_spread:
        raise ValueError(f"{fn}: expected radial_spread=False with form='S' (the S form cannot "
                         f"give se_D or sign_stability), got radial_spread=True")
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: expected backend to be one of {BACKENDS}, got backend={backend!r}")
    A = as_tensor(fn, "A", A)
    Z = as_tensor(fn, "Z", Z)
    check_float(fn, "A", A)
    check_float(fn, "Z", Z)
    check_ndim(fn, "A", A, 2, "2-D [N, d_in]")
    check_ndim(fn, "Z", Z, 2, "2-D [N, d_out]")
    if isinstance(G, HeadDirections):
        if g_bias is not None:
            raise ValueError(f"{fn}: expected g_bias=None when G is a HeadDirections (its bias "
                             f"is already folded in), got {describe('g_bias', g_bias)}")
        dirs: HeadDirections | None = G
        m, d_out, d_in = G.M, G.d_out, G.d_in
    else:
        dirs = None
        G = as_tensor(fn, "G", G)
        g_bias = None if g_bias is None else as_tensor(fn, "g_bias", g_bias)
        _check_directions(fn, G, g_bias)
        m, d_out, d_in = G.shape
    n = A.shape[0]
    if n == 0:
        raise ValueError(f"{fn}: expected at least one probe row, got {describe('A', A)}")
    if Z.shape[0] != n:
        raise ValueError(f"{fn}: expected Z with N={n} rows like A, got {describe('Z', Z)}")
    if A.shape[1] != d_in:
        raise ValueError(f"{fn}: expected A of shape [N, d_in] with d_in={d_in} from G, "
                         f"got {describe('A', A)}")
    if Z.shape[1] != d_out:
        raise ValueError(f"{fn}: expected Z of shape [N, d_out] with d_out={d_out} from G, "
                         f"got {describe('Z', Z)}")
    check_same_device(fn, A=A, Z=Z, G=G.g_bar if isinstance(G, HeadDirections) else G)
    cd = _compute_dtype(fn, dtype, A, Z, dirs.g_bar if dirs is not None else G)
    if dirs is None:
        dirs = _prepare(G, g_bias, cd)
    elif dirs.dtype != cd:
        dirs = HeadDirections(dirs.g_bar.to(cd), dirs.g_centered.to(cd), dirs.has_bias)

    if radial_spread or form == "per_batch":
        use_s = False
    elif form == "S":
        use_s = True
    else:
        cost = head_flops(n, d_in, d_out, m, bias=dirs.has_bias)
        use_s = cost["S"] <= cost["per_batch"]

    on_gpu = A.device.type == "cuda" and cd == torch.float32
    use_triton = backend == "triton" or (backend == "auto" and on_gpu)
    if use_triton and cd != torch.float32:
        raise ValueError(f"{fn}: backend='triton' computes in float32, got dtype={cd}")
    if use_triton:
        values, reason = _head_triton(A, Z, dirs, branch, use_s, allow_tf32)
    else:
        values, reason = _head_torch(A, Z, dirs, branch, use_s, cd)

    suffix = "" if branch == "u" else "_w"
    out: dict[str, Any] = {name + suffix: values[name] for name in STAT_KEYS}
    out["valid"] = reason == 0
    out["reason"] = reason
    out["M"] = m
    return out


def _head_triton(A, Z, dirs: HeadDirections, branch: str, use_s: bool, allow_tf32: bool):
    from normfast.kernels import KERNEL_INPUT_DTYPES
    from normfast.kernels import head_stats as head_kernel
    from normfast.kernels import project as project_kernel

    A = A if A.dtype in KERNEL_INPUT_DTYPES else A.float()
    Z = Z if Z.dtype in KERNEL_INPUT_DTYPES else Z.float()
    g_bar = dirs.g_bar.contiguous()
    if use_s:
        res, reason = head_kernel(A, Z, g_bar, dirs.covariance().contiguous(), branch=branch,
                                  has_bias=dirs.has_bias, allow_tf32=allow_tf32)
        nan = torch.full_like(res[0], float("nan"))
        values = {"D": res[0], "se_D": nan, "sign_stability": nan.clone(),
                  "m2": res[1], "V2": res[2], "Q": res[3]}
    else:
        res, reason = project_kernel(A, Z, g_bar, dirs.g_centered.contiguous(), branch=branch,
                                     has_bias=dirs.has_bias, allow_tf32=allow_tf32)
        values = dict(zip(STAT_KEYS, res))
    return values, reason


def _head_torch(A, Z, dirs: HeadDirections, branch: str, use_s: bool, cd: torch.dtype):
    # Probe chunks bound the scratch memory. Scratch buffers are allocated
    # once and reused with out= (CPU tensors have no caching allocator:
    # fresh multi-MB buffers per chunk cost page faults, badly so once the
    # heap is fragmented).
    n, d_in = A.shape
    m, d_out, da = dirs.g_centered.shape
    dev_kw = {"dtype": cd, "device": A.device}
    g_w = dirs.g_bar[:, :d_in]
    g_b = dirs.g_bar[:, d_in] if dirs.has_bias else None
    if use_s:
        s_c = dirs.covariance()
        s_aa = s_c[:d_in, :d_in]
        cross_row = 2 * s_c[d_in, :d_in] if dirs.has_bias else None
        width = 2 * d_out + 2 * d_in
    else:
        flat_c = dirs.g_centered.reshape(m * d_out, da)
        c_w = flat_c[:, :d_in]
        c_b = flat_c[:, d_in] if dirs.has_bias else None
        width = 2 * d_out + 2 * m * d_out
    step = min(n, max(1, _HEAD_SCRATCH // max(width, 1)))
    v_buf = torch.empty((step, d_out), **dev_kw)
    prod_out = torch.empty((step, d_out), **dev_kw)
    if use_s:
        p_buf = torch.empty((step, d_in), **dev_kw)
        prod_in = torch.empty((step, d_in), **dev_kw)
    else:
        y_buf = torch.empty((step, m * d_out), **dev_kw)
        y_sq = torch.empty((step, m * d_out), **dev_kw)
    values = {k: torch.empty(n, **dev_kw) for k in STAT_KEYS}
    reason = torch.empty(n, dtype=torch.int8, device=A.device)
    for r0 in range(0, n, step):
        a = A[r0:r0 + step].to(cd)
        z = Z[r0:r0 + step].to(cd)
        c = a.shape[0]
        norm = torch.linalg.vector_norm(z, dim=1)
        scale = norm if branch == "u" else torch.ones_like(norm)
        v = v_buf[:c]
        if g_b is None:
            torch.mm(a, g_w.T, out=v)
        else:
            torch.addmm(g_b, a, g_w.T, out=v)
        zv = torch.mul(z, v, out=prod_out[:c]).sum(1)
        drift = -(zv / norm) * scale
        m2 = scale.square() * torch.mul(v, v, out=prod_out[:c]).sum(1)
        if use_s:
            p = p_buf[:c]
            if cross_row is None:
                torch.mm(a, s_aa, out=p)
            else:
                torch.addmm(cross_row, a, s_aa, out=p)
            q = torch.mul(p, a, out=prod_in[:c]).sum(1)
            if dirs.has_bias:
                q += s_c[d_in, d_in]
            v2 = scale.square() * q.clamp_min(0)
            se = torch.full_like(drift, float("nan"))
            agree = se.clone()
            bad = ~torch.isfinite(zv) | ~torch.isfinite(m2) | ~torch.isfinite(q)
        else:
            y = y_buf[:c]
            if c_b is None:
                torch.mm(a, c_w.T, out=y)
            else:
                torch.addmm(c_b, a, c_w.T, out=y)
            y3 = y.view(c, m, d_out)
            zy = torch.bmm(y3, z.unsqueeze(2)).squeeze(2)       # [c, M]
            dev = -(zy / norm[:, None]) * scale[:, None]        # r^B - D
            spread = torch.mul(y, y, out=y_sq[:c]).sum(1)
            radial = drift[:, None] + dev
            pos = (radial > 0).sum(1)
            neg = (radial < 0).sum(1)
            agree = torch.where(drift > 0, pos, torch.where(drift < 0, neg, m - pos - neg))
            agree = agree.to(cd) / m
            dev_sum, dev_sq = dev.sum(1), dev.square().sum(1)
            var_r = (dev_sq - dev_sum.square() / m).clamp_min(0) / (m - 1)
            se = torch.sqrt(var_r / m)
            v2 = scale.square() * spread / (m - 1)
            bad = (~torch.isfinite(zv) | ~torch.isfinite(m2) | ~torch.isfinite(spread)
                   | ~torch.isfinite(dev_sq))
        code = torch.zeros(norm.shape, dtype=torch.int8, device=A.device)
        code[bad] = NON_FINITE_DISPLACEMENT
        code[~torch.isfinite(norm)] = NON_FINITE_EMBEDDING
        code[norm == 0] = ZERO_NORM
        ok = code == 0
        chunk = {"D": drift, "se_D": se, "sign_stability": agree, "m2": m2, "V2": v2,
                 "Q": m2 + v2}
        for k in STAT_KEYS:
            values[k][r0:r0 + c] = torch.where(ok, chunk[k], float("nan"))
        reason[r0:r0 + c] = code
    return values, reason

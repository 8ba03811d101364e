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
* :func:`drift_from_groups` -- the drift statistics from K group-mean
  displacements (the drift from the mean direction over its own M_D batches).
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
    "drift_from_groups",
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

    def __init__(self, g_bar: torch.Tensor, g_centered: torch.Tensor, has_bias: bool,
                 drift_stack: torch.Tensor | None = None,
                 drift_counts: torch.Tensor | None = None) -> None:
        self.g_bar = g_bar
        self.g_centered = g_centered
        self.has_bias = has_bias
        #: ``[K+1, d_out, da]``: the drift's overall mean direction, then each group mean minus it.
        self.drift_stack = drift_stack
        #: ``[K]`` float: batches per drift group.
        self.drift_counts = drift_counts
        self._s_c: torch.Tensor | None = None

    def to(self, dtype: torch.dtype) -> "HeadDirections":
        """The same directions in another precision."""
        if dtype == self.dtype:
            return self
        stack = None if self.drift_stack is None else self.drift_stack.to(dtype)
        counts = None if self.drift_counts is None else self.drift_counts.to(dtype)
        return HeadDirections(self.g_bar.to(dtype), self.g_centered.to(dtype), self.has_bias, stack, counts)

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

    @property
    def drift_K(self) -> int:
        """Groups of the drift's own batches (0 when the drift comes from the M heat batches)."""
        return 0 if self.drift_stack is None else self.drift_stack.shape[0] - 1

    def __repr__(self) -> str:
        return (f"HeadDirections(M={self.M}, d_out={self.d_out}, d_in={self.d_in}, "
                f"has_bias={self.has_bias}, drift_groups={self.drift_K}, dtype={self.dtype}, "
                f"device={self.device})")


def prepare_head(G: Any, g_bias: Any = None, *, drift_means: Any = None, drift_bias: Any = None,
                 drift_counts: Any = None, dtype: torch.dtype | None = None) -> HeadDirections:
    """Center the per-batch head directions once.

    ``G`` ``[M, d_out, d_in]`` holds ``∂L_B/∂W`` (or the optimizer's update
    direction) for each virtual batch, ``g_bias`` ``[M, d_out]`` the bias
    part (``None`` for a bias-free head). The result is float64 when ``G`` is
    float64 (or ``dtype=torch.float64``), else float32.

    The drift from its own batches: ``drift_means`` ``[K, d_out, d_in]`` (and
    ``drift_bias`` ``[K, d_out]`` with a bias) are the mean update directions
    of K groups of the drift's M_D batches, ``drift_counts`` ``[K]`` their
    batch counts (default: equal). Then ``D``, ``m2``, ``se_D`` and
    ``sign_stability`` come from them (see :func:`head_stats`).
    """
    fn = "prepare_head"
    G = as_tensor(fn, "G", G)
    g_bias = None if g_bias is None else as_tensor(fn, "g_bias", g_bias)
    _check_directions(fn, G, g_bias)
    cd = _compute_dtype(fn, dtype, G, g_bias)
    dirs = _prepare(G, g_bias, cd)
    if drift_means is not None or drift_bias is not None or drift_counts is not None:
        _attach_drift(fn, dirs, drift_means, drift_bias, drift_counts)
    return dirs


def _counts_tensor(fn: str, name: str, counts: Any) -> torch.Tensor:
    if isinstance(counts, (list, tuple)):
        return torch.tensor([float(c) for c in counts])
    return as_tensor(fn, name, counts)


def _attach_drift(fn: str, dirs: HeadDirections, drift_means: Any, drift_bias: Any, drift_counts: Any) -> None:
    if drift_means is None:
        raise ValueError(f"{fn}: expected drift_means [K, d_out, d_in] with drift_bias/drift_counts, got None")
    Gd = as_tensor(fn, "drift_means", drift_means)
    check_float(fn, "drift_means", Gd)
    check_ndim(fn, "drift_means", Gd, 3, "3-D [K, d_out, d_in]")
    k = Gd.shape[0]
    if tuple(Gd.shape[1:]) != (dirs.d_out, dirs.d_in):
        raise ValueError(f"{fn}: expected drift_means of shape [K, d_out, d_in] with (d_out, d_in)="
                         f"{(dirs.d_out, dirs.d_in)} from G, got {describe('drift_means', Gd)}")
    if k < 2:
        raise ValueError(f"{fn}: expected at least 2 drift groups (K >= 2) in drift_means [K, d_out, d_in], "
                         f"got {describe('drift_means', Gd)}")
    if (drift_bias is None) == dirs.has_bias:
        raise ValueError(f"{fn}: expected drift_bias [K, d_out] exactly when g_bias is given "
                         f"(has_bias={dirs.has_bias}), got drift_bias="
                         f"{'None' if drift_bias is None else describe('drift_bias', drift_bias)}")
    gd = None
    if drift_bias is not None:
        gd = as_tensor(fn, "drift_bias", drift_bias)
        check_float(fn, "drift_bias", gd)
        if tuple(gd.shape) != (k, dirs.d_out):
            raise ValueError(f"{fn}: expected drift_bias of shape [K, d_out]={(k, dirs.d_out)}, "
                             f"got {describe('drift_bias', gd)}")
    if drift_counts is None:
        counts = torch.ones(k, dtype=dirs.dtype, device=dirs.device)
    else:
        counts = _counts_tensor(fn, "drift_counts", drift_counts).to(dtype=dirs.dtype, device=dirs.device)
        if tuple(counts.shape) != (k,) or not bool((counts > 0).all()):
            raise ValueError(f"{fn}: expected drift_counts of shape [K]=({k},) with positive batch counts, "
                             f"got {describe('drift_counts', counts)} = {counts.tolist()}")
    check_same_device(fn, G=dirs.g_bar, drift_means=Gd)
    aug = torch.empty((k, dirs.d_out, dirs.d_in + int(dirs.has_bias)), dtype=dirs.dtype, device=dirs.device)
    aug[:, :, :dirs.d_in] = Gd
    if gd is not None:
        aug[:, :, dirs.d_in] = gd
    mean = (aug * (counts / counts.sum())[:, None, None]).sum(0)
    dirs.drift_stack = torch.cat([mean[None], aug - mean], 0)
    dirs.drift_counts = counts


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
    drift_means: Any = None,
    drift_bias: Any = None,
    drift_counts: Any = None,
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

    Drift from its own batches (``drift_means`` ``[K, d_out, d_in]``,
    ``drift_bias`` ``[K, d_out]``, ``drift_counts`` ``[K]``: the mean update
    directions of K groups of the drift's M_D batches, see
    :func:`prepare_head`; or a :class:`HeadDirections` that carries them):
    then ``D``, ``m2``, ``se_D`` and ``sign_stability`` come from the group
    means by one GEMM with the stacked ``[Ḡ_D, Ḡ_1 − Ḡ_D, …]`` and the
    epilogue of :func:`drift_from_groups` (the heat statistics keep the M
    batches, and ``Q = m2 + V2``); ``radial_spread`` is then moot.

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
    has_drift = drift_means is not None or (isinstance(G, HeadDirections) and G.drift_stack is not None)
    if form == "S" and radial_spread and not has_drift:
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
        if drift_means is not None or drift_bias is not None or drift_counts is not None:
            raise ValueError(f"{fn}: expected drift_means/drift_bias/drift_counts=None when G is a "
                             f"HeadDirections (attach the drift with prepare_head), got drift_means="
                             f"{'None' if drift_means is None else describe('drift_means', drift_means)}")
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
        if drift_means is not None or drift_bias is not None or drift_counts is not None:
            _attach_drift(fn, dirs, drift_means, drift_bias, drift_counts)
    else:
        dirs = dirs.to(cd)
    if dirs.drift_stack is not None:
        radial_spread = False  # se_D and sign stability come from the drift groups

    if form == "per_batch" or (radial_spread and form == "auto"):
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

    if dirs.drift_stack is not None:
        stack_backend = "torch"
        if use_triton:
            import normfast.kernels as kernels  # the stacked kernel, once it is there

            stack_backend = "triton" if hasattr(kernels, "head_stack") else "torch"
        prod = _head_products(A, Z, dirs.drift_stack, None, dirs.has_bias, stack_backend,
                              dtype=cd, allow_tf32=allow_tf32)
        drift = _drift_epilogue(prod["zdot"], prod["sq"][:, 0], prod["norm"], dirs.drift_counts, branch)
        ok = reason == 0
        nan = torch.tensor(float("nan"), dtype=cd, device=A.device)
        for name, value in drift.items():
            values[name] = torch.where(ok, value.to(cd), nan)
        values["Q"] = values["m2"] + values["V2"]
        bad = ok & ~(torch.isfinite(prod["zdot"]).all(1) & torch.isfinite(prod["sq"][:, 0]))
        reason = torch.where(bad, torch.full_like(reason, NON_FINITE_DISPLACEMENT), reason)
        for name in STAT_KEYS:
            values[name] = torch.where(bad, nan, values[name])

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


# ============================================================================
# Stacked head products and the drift from group means
# ============================================================================


def _head_products(A: torch.Tensor, Z: torch.Tensor, G_stack: torch.Tensor, S_stack: torch.Tensor | None,
                   has_bias: bool, backend: str = "torch", *, dtype: torch.dtype | None = None,
                   allow_tf32: bool = False) -> dict[str, torch.Tensor]:
    """The stacked head products, :func:`normfast.core.reference.head_stack_reference`'s contract.

    ``G_stack`` ``[K1, d_out, da]``, ``S_stack`` ``[K2, da, da]`` (or None:
    ``K2 = 0``), ``da = d_in (+1 with a bias)``, ``ã = [a, 1]``. Returns
    ``zdot [N, K1] = z·(G_k ã)``, ``sq [N, K1] = |G_k ã|²``,
    ``quad [N, K2] = ãᵀS_kã`` and ``norm [N] = |z|``. Backend "torch": stacked
    GEMMs over row chunks (scratch bounded by ``_HEAD_SCRATCH``); "triton":
    :func:`normfast.kernels.head_stack` (one fused pass that reads ``a`` once).
    """
    cd = dtype or (torch.float64 if A.dtype == torch.float64 else torch.float32)
    if S_stack is None:
        S_stack = torch.empty((0, G_stack.shape[2], G_stack.shape[2]), dtype=cd, device=A.device)
    if backend == "triton":
        from normfast.kernels import KERNEL_INPUT_DTYPES, head_stack

        A_k = A if A.dtype in KERNEL_INPUT_DTYPES else A.float()
        Z_k = Z if Z.dtype in KERNEL_INPUT_DTYPES else Z.float()
        zdot, sq, quad, norm = head_stack(A_k, Z_k, G_stack.float().contiguous(), S_stack.float().contiguous(),
                                          has_bias=has_bias, allow_tf32=allow_tf32)
        return {"zdot": zdot, "sq": sq, "quad": quad, "norm": norm}
    n, d_in = A.shape
    k1, d_out, da = G_stack.shape
    k2 = S_stack.shape[0]
    dev_kw = {"dtype": cd, "device": A.device}
    # [d_in, K1*d_out] weights and [K1*d_out] bias row of the stacked directions
    g_w = G_stack[:, :, :d_in].reshape(k1 * d_out, d_in).T.to(cd)
    g_b = G_stack[:, :, d_in].reshape(k1 * d_out).to(cd) if has_bias else None
    s_w = S_stack[:, :d_in, :d_in].permute(1, 0, 2).reshape(d_in, k2 * d_in).to(cd)
    s_b = (2 * S_stack[:, d_in, :d_in]).reshape(k2 * d_in).to(cd) if has_bias else None
    s_c = S_stack[:, d_in, d_in].to(cd) if has_bias else None
    width = 2 * k1 * d_out + 2 * k2 * d_in + d_out
    step = min(n, max(1, _HEAD_SCRATCH // max(width, 1)))
    zdot = torch.empty((n, k1), **dev_kw)
    sq = torch.empty((n, k1), **dev_kw)
    quad = torch.empty((n, k2), **dev_kw)
    norm = torch.empty(n, **dev_kw)
    v_buf = torch.empty((step, k1 * d_out), **dev_kw)
    p_buf = torch.empty((step, k2 * d_in), **dev_kw) if k2 else None
    for r0 in range(0, n, step):
        a = A[r0:r0 + step].to(cd)
        z = Z[r0:r0 + step].to(cd)
        c = a.shape[0]
        v = v_buf[:c]
        if g_b is None:
            torch.mm(a, g_w, out=v)
        else:
            torch.addmm(g_b, a, g_w, out=v)
        v3 = v.view(c, k1, d_out)
        zdot[r0:r0 + c] = torch.bmm(v3, z.unsqueeze(2)).squeeze(2)
        sq[r0:r0 + c] = torch.linalg.vector_norm(v3, dim=2).square()
        norm[r0:r0 + c] = torch.linalg.vector_norm(z, dim=1)
        if k2:
            pq = p_buf[:c]
            if s_b is None:
                torch.mm(a, s_w, out=pq)
            else:
                torch.addmm(s_b, a, s_w, out=pq)
            q = torch.bmm(pq.view(c, k2, d_in), a.unsqueeze(2)).squeeze(2)
            quad[r0:r0 + c] = q if s_c is None else q + s_c
    return {"zdot": zdot, "sq": sq, "quad": quad, "norm": norm}


def _drift_epilogue(zdot: torch.Tensor, sq_mean: torch.Tensor, norm: torch.Tensor, counts: torch.Tensor,
                    branch: str) -> dict[str, torch.Tensor]:
    """D, se_D, sign_stability, m2 from ``zdot [N, K+1]`` (overall mean, then group deviations)."""
    scale = norm if branch == "u" else torch.ones_like(norm)
    drift = -(zdot[:, 0] / norm) * scale                     # ẑ·x̄, x̄ = -s Ḡ_D ã
    group = drift[:, None] - (zdot[:, 1:] / norm[:, None]) * scale[:, None]   # D_g
    se, agree = _group_spread(drift, group, counts.to(drift))
    return {"D": drift, "se_D": se, "sign_stability": agree, "m2": scale.square() * sq_mean}


def _group_spread(drift: torch.Tensor, group: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``se_D`` and the group sign stability from the group drifts ``D_g`` ``[N, K]``.

    ``se_D² = Σ_g n_g (D_g − D)² / ((K−1) M_D)``: unbiased for ``Var(D)`` when
    the batches are i.i.d., whatever the group sizes ``n_g`` (each ``D_g`` has
    variance ``σ²/n_g``), K−1 degrees of freedom; equal groups give
    ``sd(D_g)/√K``. ``sign_stability`` = share of groups whose ``D_g`` has
    the sign of ``D`` (sign(0) = 0).
    """
    k = group.shape[1]
    total = counts.sum()
    dev = group - drift[:, None]
    se = torch.sqrt((dev.square() * counts).sum(1) / ((k - 1) * total))
    agree = (torch.sign(group) == torch.sign(drift)[:, None]).to(drift.dtype).mean(1)
    return se, agree


def drift_from_groups(T: Any, Z: Any, counts: Any = None, *, branch: str = "u") -> dict[str, Any]:
    """Drift statistics from the displacements along K group-mean directions.

    ``T`` ``[K, N, d]``: ``t̄_g = −J p̄_g``, the displacement of every probe
    along the mean update direction ``p̄_g`` of batch group ``g`` (by
    linearity, the mean of that group's per-batch displacements); ``Z``
    ``[N, d]`` the embeddings; ``counts`` ``[K]`` the batches per group
    (default equal); ``branch`` "u" (``x = R t``) or "w" (``x = t``). With
    ``D_g = ẑ·x̄_g`` and ``x̄ = Σ_g n_g x̄_g / M_D`` (the mean over all M_D
    batches): ``D = ẑ·x̄``, ``m2 = |x̄|²`` (noise bias ``V2/M_D``),
    ``se_D² = Σ_g n_g (D_g − D)² / ((K−1) M_D)`` (K−1 degrees of freedom) and
    ``sign_stability`` the share of groups with the sign of D. Keys carry the
    suffix ``_w`` for the w branch; also ``valid``, ``reason`` and ``M``
    (= M_D). Computed in float64 for float64 inputs, else float32.
    """
    fn = "drift_from_groups"
    if branch not in ("u", "w"):
        raise ValueError(f"{fn}: expected branch 'u' or 'w', got branch={branch!r}")
    T = as_tensor(fn, "T", T)
    Z = as_tensor(fn, "Z", Z)
    check_float(fn, "T", T)
    check_float(fn, "Z", Z)
    check_ndim(fn, "T", T, 3, "3-D [K, N, d]")
    check_ndim(fn, "Z", Z, 2, "2-D [N, d]")
    k = T.shape[0]
    if tuple(T.shape[1:]) != tuple(Z.shape):
        raise ValueError(f"{fn}: expected T of shape [K, N, d] with (N, d)={tuple(Z.shape)} from Z, "
                         f"got {describe('T', T)}")
    if k < 2:
        raise ValueError(f"{fn}: expected at least 2 groups (K >= 2) in T [K, N, d], got {describe('T', T)}")
    check_same_device(fn, T=T, Z=Z)
    cd = _compute_dtype(fn, None, T, Z)
    if counts is None:
        w = torch.ones(k, dtype=cd, device=T.device)
    else:
        w = _counts_tensor(fn, "counts", counts).to(device=T.device, dtype=cd)
        if tuple(w.shape) != (k,) or not bool((w > 0).all()):
            raise ValueError(f"{fn}: expected counts of shape [K]=({k},) with positive batch counts, "
                             f"got {describe('counts', w)}")
    T, Z = T.to(cd), Z.to(cd)
    norm = torch.linalg.vector_norm(Z, dim=1)
    scale = norm if branch == "u" else torch.ones_like(norm)
    zhat = Z / norm[:, None]
    mean_t = torch.einsum("k,knd->nd", w / w.sum(), T)
    group = torch.einsum("knd,nd->nk", T, zhat) * scale[:, None]
    drift = (mean_t * zhat).sum(1) * scale
    se, agree = _group_spread(drift, group, w)
    m2 = scale.square() * mean_t.square().sum(1)
    bad = ~torch.isfinite(T).all(2).all(0)
    code = torch.zeros(norm.shape, dtype=torch.int8, device=T.device)
    code[bad] = NON_FINITE_DISPLACEMENT
    code[~torch.isfinite(norm)] = NON_FINITE_EMBEDDING
    code[norm == 0] = ZERO_NORM
    ok = code == 0
    sfx = "" if branch == "u" else "_w"
    out: dict[str, Any] = {}
    for name, value in (("D", drift), ("se_D", se), ("sign_stability", agree), ("m2", m2)):
        out[name + sfx] = torch.where(ok, value, float("nan"))
    out["valid"] = ok
    out["reason"] = code
    out["M"] = int(round(float(w.sum()))) if counts is not None else k
    return out

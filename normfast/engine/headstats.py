"""Head mode: the probe statistics of a linear head in closed form, with error bars.

For a linear head ``z = W a + b`` the displacement of probe ``i`` along
virtual batch ``B`` is ``t_i^B = −G̃_B ã_i`` (``ã = [a, 1]``,
``G̃_B = [G_B | g_B]``). Every statistic is then a row-wise epilogue over
three stacked products (:func:`normfast.core.reference.head_stack_reference`,
computed by :func:`_head_products`): for a stack of direction matrices
``G_k`` the radial dots ``z·(G_k ã)`` and squares ``|G_k ã|²``, for a stack
of symmetric matrices ``S_k`` the quadratic forms ``ãᵀ S_k ã``. The stacks
are formed once from the M directions (cost independent of N); the per-probe
cost is ``N·da·(K1·d_out + K2·da)`` multiply-adds.

Three forms (``s = R`` for the scale-invariant branch "u", ``1`` for "w"):

``grouped`` (the default; ``uncertainty=True``)
    The M heat batches fall into K groups (batch ``b`` in group ``b mod K``;
    sizes differ by at most one); the drift's batches likewise (its own
    M_D batches, or the heat's). Stacks: ``G = [Ḡ_D, Ḡ_D,−1, …, Ḡ_D,−K]``
    (the drift's mean direction and its K leave-one-group-out means) and
    ``S = [S_c, S_c,−1, …, S_c,−K]`` (the heat's covariance of the M
    directions and of the M − n_g left when group g is removed, each about
    its own mean, ``1/(count − 1)``). Then exactly as in the S form
    ``D = −s ẑ·Ḡ_D ã``, ``m2 = s²|Ḡ_D ã|²``, ``V2 = s² ãᵀS_cã``,
    ``Q = m2 + V2``, and from the leave-one-out values: the group drifts
    ``D_g = (M_D D − (M_D − n_g) D_−g)/n_g`` give ``se_D`` (unbiased, K−1
    dof) and ``sign_stability``; the delete-a-group jackknife of
    ``V2_−g`` and ``Q_−g = m2_−g + V2_−g`` gives ``se_V2`` and ``se_Q``
    (:mod:`normfast.engine.uncertainty`; K−1 dof, on the wide side for
    ``V2``). The leave-one-out values themselves are returned (``loo``) for
    the jackknife of ``R_eq``. Cost ``(K+1)(d_out + da)`` product columns
    per probe, independent of M.
``S`` (``uncertainty=False``: the bare form)
    ``G = [Ḡ_D]``, ``S = [S_c]``: ``D, m2, V2, Q`` only; error bars NaN.
``per_batch`` (``radial_spread=True``)
    ``G = [Ḡ, G̃^c_1, …, G̃^c_M]``: every batch's radial dot, so ``se_D``
    (``std(r, ddof=1)/√M``) and ``sign_stability`` per batch; ``V2`` from
    the squares. Cost grows with M. ``se_V2``/``se_Q`` NaN.

Without the drift's own batches ``Ḡ_D`` is the heat's mean ``Ḡ`` and the
drift groups are the heat groups. Every form equals feeding every ``t_i^B``
through a :class:`~normfast.engine.accumulator.ProbeAccumulator` (a
``GroupedAccumulator`` for the grouped estimators), which the tests check
against a float64 brute force.
"""
from __future__ import annotations

from typing import Any

import torch

from normfast.core.checks import as_tensor, check_float, check_ndim, check_same_device, describe
from normfast.engine.accumulator import (BACKENDS, NON_FINITE_DISPLACEMENT, NON_FINITE_EMBEDDING, STAT_KEYS,
                                         ZERO_NORM)
from normfast.engine.uncertainty import (DEFAULT_GROUPS, effective_groups, group_counts, group_spread,
                                         jackknife_se)

FORMS = ("auto", "grouped", "S", "per_batch")
#: Error-bar statistics per branch (suffix ``_w`` for the w branch); NaN when not computed.
UNCERTAINTY_KEYS = ("se_V2", "se_Q")
# Elements of scratch memory _head_products may allocate per probe chunk; a chunk's
# products then stay in the last-level cache between the GEMM and its epilogue.
_HEAD_SCRATCH = 1 << 20
# Width of the column blocks of the folded quadratic forms (torch backend).
_TRI_BLOCK = 32


def _compute_dtype(fn: str, dtype: torch.dtype | None, *tensors: torch.Tensor | None) -> torch.dtype:
    if dtype is None:
        wide = any(x.dtype == torch.float64 for x in tensors if x is not None)
        return torch.float64 if wide else torch.float32
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{fn}: expected dtype None, torch.float32 or torch.float64, got dtype={dtype}")
    return dtype


# ============================================================================
# The directions, prepared once
# ============================================================================


class HeadDirections:
    """The M head directions of a linear head, augmented, centered and grouped.

    ``g_bar`` ``[d_out, da]`` is the mean of ``G̃_B = [G_B | g_B]`` (bias
    column last), ``g_centered`` ``[M, d_out, da]`` holds ``G̃_B − g_bar``.
    ``groups`` K: heat batch ``b`` belongs to group ``b mod K`` (K is capped
    at M). ``drift_means`` ``[K, d_out, da]`` / ``drift_counts`` ``[K]``: the
    drift's own group mean directions (None: the drift comes from the heat
    batches). The stacks of :func:`head_stats` are formed on first use and
    cached. Build with :func:`prepare_head`.
    """

    def __init__(self, g_bar: torch.Tensor, g_centered: torch.Tensor, has_bias: bool, *,
                 groups: int = DEFAULT_GROUPS, drift_means: torch.Tensor | None = None,
                 drift_counts: torch.Tensor | None = None) -> None:
        self.g_bar = g_bar
        self.g_centered = g_centered
        self.has_bias = has_bias
        self.groups = int(groups)
        self.drift_means = drift_means
        self.drift_counts = drift_counts
        self._cache: dict[str, torch.Tensor] = {}

    # -- shape -------------------------------------------------------------------
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

    @property
    def K(self) -> int:
        """Groups actually used (``groups`` capped at M; the drift's own K when it has one)."""
        if self.drift_means is not None:
            return self.drift_means.shape[0]
        return effective_groups(self.groups, self.M)

    @property
    def drift_K(self) -> int:
        """Groups of the drift's own batches (0 when the drift comes from the M heat batches)."""
        return 0 if self.drift_means is None else self.drift_means.shape[0]

    @property
    def heat_counts(self) -> torch.Tensor:
        return torch.tensor(group_counts(self.M, self.K), dtype=self.dtype, device=self.device)

    @property
    def drift_group_counts(self) -> torch.Tensor:
        return self.heat_counts if self.drift_counts is None else self.drift_counts

    def to(self, dtype: torch.dtype) -> "HeadDirections":
        """The same directions in another precision."""
        if dtype == self.dtype:
            return self
        cast = (lambda x: None if x is None else x.to(dtype))
        return HeadDirections(self.g_bar.to(dtype), self.g_centered.to(dtype), self.has_bias, groups=self.groups,
                              drift_means=cast(self.drift_means), drift_counts=cast(self.drift_counts))

    # -- stacks ------------------------------------------------------------------
    def covariance(self) -> torch.Tensor:
        """``S_c`` ``[da, da]``, one GEMM over the ``M·d_out`` centered rows, ``/(M−1)``."""
        if "S_c" not in self._cache:
            flat = self.g_centered.reshape(self.M * self.d_out, -1)
            self._cache["S_c"] = (flat.T @ flat).div_(self.M - 1)
        return self._cache["S_c"]

    def jackknife_covariances(self) -> torch.Tensor:
        """``[K+1, da, da]``: ``S_c`` and the K leave-one-group-out covariances ``S_c,−g``.

        With ``C_h = Σ_{B∈h} G̃^cᵀ_B G̃^c_B`` per group (about the overall mean;
        the same GEMM work as ``S_c`` alone) and ``s_g = Σ_{B∈g} G̃^c_B`` (the
        batches outside g sum to ``−s_g``):
        ``S_c,−g = (Σ_{h≠g} C_h − s_gᵀ s_g/(M − n_g)) / (M − n_g − 1)`` -- sums
        of the other groups, no cancellation -- NaN when fewer than two
        batches are left.
        """
        if "S_jk" not in self._cache:
            k, m = self.K, self.M
            da = self.g_centered.shape[2]
            c = self.g_centered
            blocks = [c[g::k].reshape(-1, da) for g in range(k)]    # group g: batches g, g + K, ...
            grams = torch.stack([b.T @ b for b in blocks])         # C_h
            total = grams.sum(0)
            out = torch.empty((k + 1, da, da), dtype=c.dtype, device=c.device)
            out[0] = total / (m - 1)
            for g, block in enumerate(blocks):
                left = m - c[g::k].shape[0]
                if left < 2:
                    out[g + 1] = float("nan")
                    continue
                s_g = c[g::k].sum(0)
                others = grams[torch.arange(k, device=c.device) != g].sum(0)
                out[g + 1] = (others - (s_g.T @ s_g) / left) / (left - 1)
            self._cache["S_jk"] = out
        return self._cache["S_jk"]

    def drift_stack(self, grouped: bool) -> torch.Tensor:
        """``[K+1, d_out, da]``: the drift's mean direction and its leave-one-group-out means (grouped), else ``[1, ...]``."""
        key = "G_jk" if grouped else "G_bar"
        if key not in self._cache:
            if self.drift_means is None:
                k = self.K
                c = self.g_centered
                counts = self.heat_counts
                # group means about the overall one (whose own offset is zero)
                means = torch.stack([c[g::k].mean(0) for g in range(k)])
                centre = self.g_bar
            else:
                counts = self.drift_counts.to(torch.float64)
                means = self.drift_means.to(torch.float64)
                centre = (means * (counts / counts.sum())[:, None, None]).sum(0)
                means = means - centre
            if grouped:
                total = counts.sum()
                loo = -(counts / (total - counts))[:, None, None] * means   # Ḡ_−g − Ḡ
                stack = torch.cat([centre[None], centre[None] + loo], 0)
            else:
                stack = centre[None]
            self._cache[key] = stack.to(self.dtype)
        return self._cache[key]

    def per_batch_stack(self) -> torch.Tensor:
        """``[M+1, d_out, da]``: the heat's mean direction, then every centered batch direction."""
        return torch.cat([self.g_bar[None], self.g_centered], 0)

    def __repr__(self) -> str:
        return (f"HeadDirections(M={self.M}, d_out={self.d_out}, d_in={self.d_in}, has_bias={self.has_bias}, "
                f"groups={self.K}, drift_groups={self.drift_K}, dtype={self.dtype}, device={self.device})")


def prepare_head(G: Any, g_bias: Any = None, *, drift_means: Any = None, drift_bias: Any = None,
                 drift_counts: Any = None, groups: int = DEFAULT_GROUPS,
                 dtype: torch.dtype | None = None) -> HeadDirections:
    """Center and group the per-batch head directions once (for streaming many probe chunks).

    ``G`` ``[M, d_out, d_in]`` holds ``∂L_B/∂W`` (or the optimizer's update
    direction) for each virtual batch, ``g_bias`` ``[M, d_out]`` the bias
    part (``None`` for a bias-free head). ``groups``: K, the batch groups of
    the error bars (capped at M). The result is float64 when ``G`` is float64
    (or ``dtype=torch.float64``), else float32.

    The drift from its own batches: ``drift_means`` ``[K, d_out, d_in]`` (and
    ``drift_bias`` ``[K, d_out]`` with a bias) are the mean update directions
    of the K groups of the drift's M_D batches, ``drift_counts`` ``[K]`` their
    batch counts (default: equal). Then ``D``, ``m2``, ``se_D`` and
    ``sign_stability`` come from them; K is theirs.
    """
    fn = "prepare_head"
    G = as_tensor(fn, "G", G)
    g_bias = None if g_bias is None else as_tensor(fn, "g_bias", g_bias)
    _check_directions(fn, G, g_bias)
    _check_groups(fn, groups)
    cd = _compute_dtype(fn, dtype, G, g_bias)
    dirs = _prepare(G, g_bias, cd, groups)
    if drift_means is not None or drift_bias is not None or drift_counts is not None:
        _attach_drift(fn, dirs, drift_means, drift_bias, drift_counts)
    return dirs


def _check_groups(fn: str, groups: Any) -> None:
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 2:
        raise ValueError(f"{fn}: expected groups (K, the batch groups of the error bars) to be an integer "
                         f">= 2, got groups={groups!r}")


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


def _prepare(G: torch.Tensor, g_bias: torch.Tensor | None, cd: torch.dtype, groups: int) -> HeadDirections:
    m, d_out, d_in = G.shape
    has_bias = g_bias is not None
    aug = torch.empty((m, d_out, d_in + int(has_bias)), dtype=cd, device=G.device)
    aug[:, :, :d_in] = G
    if has_bias:
        aug[:, :, d_in] = g_bias
    g_bar = aug.mean(0)
    aug -= g_bar  # centered in place: no statistic needs the raw directions again
    return HeadDirections(g_bar, aug, has_bias, groups=groups)


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
    if k > dirs.M:
        raise ValueError(f"{fn}: expected at most M={dirs.M} drift groups (the heat's M batches form the same K "
                         f"groups), got {describe('drift_means', Gd)}")
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
    dirs.drift_means, dirs.drift_counts = aug, counts
    dirs._cache.clear()


def head_flops(n: int, d_in: int, d_out: int, m: int, *, bias: bool = False,
               groups: int = DEFAULT_GROUPS) -> dict[str, int]:
    """Multiply-add FLOPs (2 per MAC) of the head-mode forms for ``n`` probes.

    Per probe: ``da d_out`` per direction matrix and, per quadratic form, the
    folded lower triangle (about ``(da² + 32 da)/2``, :func:`stack_plan`).
    ``S``: forming ``S_c`` (``2 M d_out da²``) plus one of each;
    ``grouped``: the same stacks K+1 deep; ``per_batch``: M + 1 direction
    matrices. ``da = d_in (+1 with bias)``, ``K = min(groups, M)``. Centering
    and the O(n d) epilogues are not counted.
    """
    da = d_in + int(bias)
    k = effective_groups(groups, m)
    form = 2 * m * d_out * da * da
    tri = sum((d_in - c0) * (c1 - c0) for c0, c1 in stack_plan(d_in, d_out, 1, 1)["blocks"]) + da
    return {"S": form + 2 * n * (tri + da * d_out),
            "grouped": form + 2 * n * (k + 1) * (tri + da * d_out),
            "per_batch": 2 * n * (m + 1) * da * d_out}


# ============================================================================
# head_stats
# ============================================================================


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
    fn = "head_stats"
    if branch not in ("u", "w"):
        raise ValueError(f"{fn}: expected branch 'u' or 'w' (a head has one update direction "
                         f"per batch; use ProbeAccumulator for 'uw'), got branch={branch!r}")
    if form not in FORMS:
        raise ValueError(f"{fn}: expected form to be one of {FORMS}, got form={form!r}")
    if form == "S" and radial_spread:
        raise ValueError(f"{fn}: expected radial_spread=False with form='S' (the S form cannot "
                         f"give per-batch se_D or sign_stability), got radial_spread=True")
    if form == "grouped" and (radial_spread or not uncertainty):
        raise ValueError(f"{fn}: expected uncertainty=True and radial_spread=False with form='grouped', "
                         f"got uncertainty={uncertainty!r}, radial_spread={radial_spread!r}")
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: expected backend to be one of {BACKENDS}, got backend={backend!r}")
    _check_groups(fn, groups)
    A = as_tensor(fn, "A", A)
    Z = as_tensor(fn, "Z", Z)
    check_float(fn, "A", A)
    check_float(fn, "Z", Z)
    check_ndim(fn, "A", A, 2, "2-D [N, d_in]")
    check_ndim(fn, "Z", Z, 2, "2-D [N, d_out]")
    drift_given = drift_means is not None or drift_bias is not None or drift_counts is not None
    if isinstance(G, HeadDirections):
        if g_bias is not None or drift_given:
            got = describe("g_bias", g_bias) if g_bias is not None else "a drift_means/drift_bias/drift_counts"
            raise ValueError(f"{fn}: expected g_bias=None when G is a HeadDirections (prepare_head folds the bias "
                             f"and the drift in), got {got}")
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
        dirs = _prepare(G, g_bias, cd, groups)
        if drift_given:
            _attach_drift(fn, dirs, drift_means, drift_bias, drift_counts)
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
        return _head_products(A, Z, G_stack, S_stack, dirs.has_bias, prod_backend, dtype=cd, allow_tf32=allow_tf32)

    if use_triton and chosen != "grouped" and dirs.drift_means is None:
        values, reason = _legacy_triton(A, Z, dirs, branch, chosen == "S", allow_tf32)
        return _finish(values, reason, None, branch, cd, m, 0)
    if chosen == "grouped":
        values, loo, bad = _grouped_epilogue(products(dirs.drift_stack(True), dirs.jackknife_covariances()),
                                             dirs, branch)
    elif chosen == "S":
        values, loo, bad = _s_epilogue(products(dirs.drift_stack(False), dirs.covariance()[None]), branch)
    else:
        values, loo, bad = _per_batch_epilogue(products(dirs.per_batch_stack(), None), dirs.M, branch)
        if dirs.drift_means is not None:  # the drift, its m2 and se_D from the drift's own groups
            drift, _, bad_d = _grouped_epilogue(products(dirs.drift_stack(True), None), dirs, branch,
                                                heat=False)
            for key in ("D", "se_D", "sign_stability", "m2"):
                values[key] = drift[key]
            values["Q"] = values["m2"] + values["V2"]
            bad = bad | bad_d
    norm = torch.linalg.vector_norm(Z.to(cd), dim=1)
    code = torch.zeros(n, dtype=torch.int8, device=A.device)
    code[bad] = NON_FINITE_DISPLACEMENT
    code[~torch.isfinite(norm)] = NON_FINITE_EMBEDDING
    code[norm == 0] = ZERO_NORM
    return _finish(values, code, loo, branch, cd, m, dirs.K if chosen == "grouped" else 0)


def _finish(values: dict[str, torch.Tensor], code: torch.Tensor, loo: dict[str, torch.Tensor] | None, branch: str,
            cd: torch.dtype, m: int, k: int) -> dict[str, Any]:
    ok = code == 0
    n = code.shape[0]
    suffix = "" if branch == "u" else "_w"
    nan = torch.tensor(float("nan"), dtype=cd, device=code.device)
    out: dict[str, Any] = {}
    for name in (*STAT_KEYS, *UNCERTAINTY_KEYS):
        value = values.get(name)
        out[name + suffix] = (torch.where(ok, value, nan) if value is not None
                              else torch.full((n,), float("nan"), dtype=cd, device=code.device))
    out["valid"] = ok
    out["reason"] = code
    out["M"] = m
    out["groups"] = k
    if loo is not None:
        out["loo"] = {name + suffix: torch.where(ok[:, None], value, nan) for name, value in loo.items()}
    return out


def _stack_backend(use_triton: bool, explicit: bool) -> str:
    """"triton" when the stacked kernel is there; else torch (on the tensors' device), or an error if asked for."""
    if not use_triton:
        return "torch"
    import normfast.kernels as kernels

    if hasattr(kernels, "head_stack"):
        return "triton"
    if explicit:
        raise ValueError("head_stats: backend='triton' for the grouped form needs normfast.kernels.head_stack, "
                         "which this installation does not have; use backend='torch' or form='S'/'per_batch'")
    return "torch"


def _legacy_triton(A, Z, dirs: HeadDirections, branch: str, use_s: bool, allow_tf32: bool):
    """The S and per-batch forms on their own fused kernels (``head_stats``, ``project``)."""
    from normfast.kernels import KERNEL_INPUT_DTYPES
    from normfast.kernels import head_stats as head_kernel
    from normfast.kernels import project as project_kernel

    A = A if A.dtype in KERNEL_INPUT_DTYPES else A.float()
    Z = Z if Z.dtype in KERNEL_INPUT_DTYPES else Z.float()
    g_bar = dirs.g_bar.contiguous()
    if use_s:
        res, reason = head_kernel(A, Z, g_bar, dirs.covariance().contiguous(), branch=branch,
                                  has_bias=dirs.has_bias, allow_tf32=allow_tf32)
        values = {"D": res[0], "m2": res[1], "V2": res[2], "Q": res[3]}
    else:
        res, reason = project_kernel(A, Z, g_bar, dirs.g_centered.contiguous(), branch=branch,
                                     has_bias=dirs.has_bias, allow_tf32=allow_tf32)
        values = dict(zip(STAT_KEYS, res))
    return values, reason


# ---------------------------------------------------------------------------
# epilogues: O(N K) over the stacked products


def _scale(prod: dict[str, torch.Tensor], branch: str) -> torch.Tensor:
    norm = prod["norm"]
    return norm if branch == "u" else torch.ones_like(norm)


def _grouped_epilogue(prod: dict[str, torch.Tensor], dirs: HeadDirections, branch: str, *, heat: bool = True):
    """Grouped estimators from ``zdot, sq [N, K+1]`` (drift mean, leave-outs) and ``quad [N, K+1]`` (S_c, S_c,−g)."""
    norm, zdot, sq = prod["norm"], prod["zdot"], prod["sq"]
    s = _scale(prod, branch)
    counts = dirs.drift_group_counts.to(zdot)
    total = counts.sum()
    radial = -(zdot / norm[:, None]) * s[:, None]                 # D, then D_−g
    drift, drift_loo = radial[:, 0], radial[:, 1:]
    group = (total * drift[:, None] - (total - counts) * drift_loo) / counts   # D_g
    se_d, agree = group_spread(drift, group, counts)
    m2_all = s.square()[:, None] * sq
    values = {"D": drift, "se_D": se_d, "sign_stability": agree, "m2": m2_all[:, 0]}
    bad = ~(torch.isfinite(zdot).all(1) & torch.isfinite(sq).all(1))
    if not heat:
        return values, None, bad
    v2_all = s.square()[:, None] * prod["quad"].clamp_min(0)
    q_all = m2_all + v2_all
    values.update(V2=v2_all[:, 0], Q=q_all[:, 0], se_V2=jackknife_se(v2_all[:, 1:]),
                  se_Q=jackknife_se(q_all[:, 1:]))
    loo = {"D": drift_loo, "m2": m2_all[:, 1:], "V2": v2_all[:, 1:], "Q": q_all[:, 1:]}
    bad = bad | ~torch.isfinite(prod["quad"][:, 0])
    return values, loo, bad


def _s_epilogue(prod: dict[str, torch.Tensor], branch: str):
    norm = prod["norm"]
    s = _scale(prod, branch)
    drift = -(prod["zdot"][:, 0] / norm) * s
    m2 = s.square() * prod["sq"][:, 0]
    v2 = s.square() * prod["quad"][:, 0].clamp_min(0)
    bad = ~(torch.isfinite(prod["zdot"][:, 0]) & torch.isfinite(prod["sq"][:, 0]) & torch.isfinite(prod["quad"][:, 0]))
    return {"D": drift, "m2": m2, "V2": v2, "Q": m2 + v2}, None, bad


def _per_batch_epilogue(prod: dict[str, torch.Tensor], m: int, branch: str):
    norm, zdot, sq = prod["norm"], prod["zdot"], prod["sq"]
    s = _scale(prod, branch)
    drift = -(zdot[:, 0] / norm) * s
    dev = -(zdot[:, 1:] / norm[:, None]) * s[:, None]            # r^B − D
    radial = drift[:, None] + dev
    pos, neg = (radial > 0).sum(1), (radial < 0).sum(1)
    agree = torch.where(drift > 0, pos, torch.where(drift < 0, neg, m - pos - neg)).to(drift.dtype) / m
    dev_sum, dev_sq = dev.sum(1), dev.square().sum(1)
    se = torch.sqrt((dev_sq - dev_sum.square() / m).clamp_min(0) / ((m - 1) * m))
    m2 = s.square() * sq[:, 0]
    v2 = s.square() * sq[:, 1:].sum(1) / (m - 1)
    bad = ~(torch.isfinite(zdot).all(1) & torch.isfinite(sq).all(1))
    return {"D": drift, "se_D": se, "sign_stability": agree, "m2": m2, "V2": v2, "Q": m2 + v2}, None, bad


# ============================================================================
# The stacked products
# ============================================================================


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


def _head_products(A: torch.Tensor, Z: torch.Tensor, G_stack: torch.Tensor, S_stack: torch.Tensor | None,
                   has_bias: bool, backend: str = "torch", *, dtype: torch.dtype | None = None,
                   allow_tf32: bool = False) -> dict[str, torch.Tensor]:
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
        zdot, sq, quad, norm = head_stack(A_k, Z_k, G_stack.float().contiguous(), S_stack.float().contiguous(),
                                          has_bias=has_bias, allow_tf32=allow_tf32)
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
    tri = [folded[:, c0:, c0:c1].permute(1, 0, 2).reshape(d_in - c0, k2 * (c1 - c0)).contiguous()
           for c0, c1 in plan["blocks"]]
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
        a = A[r0:r0 + step].to(cd)
        z = Z[r0:r0 + step].to(cd)
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
                p = p_buf[:c, :k2 * w]
                torch.mm(a[:, c0:], f, out=p)
                q += torch.bmm(p.view(c, k2, w), a[:, c0:c1, None]).view(c, k2)
            if s_b is not None:
                q.addmm_(a, s_b)
                q += s_c
    return {"zdot": zdot, "sq": sq, "quad": quad, "norm": norm}

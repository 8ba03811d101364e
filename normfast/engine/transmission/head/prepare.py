"""The M head directions of a linear head, augmented, centered and grouped once (:func:`prepare_head`)."""

from __future__ import annotations

from typing import Any

import torch

from normfast.core.checks import (
    as_tensor,
    check_float,
    check_groups,
    check_ndim,
    check_same_device,
    compute_dtype,
    counts_tensor,
    describe,
    float_tensor,
)
from normfast.engine.estimators.uncertainty import DEFAULT_GROUPS, effective_groups, group_counts


class HeadDirections:
    """The M head directions of a linear head, augmented, centered and grouped.

    ``g_bar`` ``[d_out, da]`` is the mean of ``G̃_B = [G_B | g_B]`` (bias
    column last), ``g_centered`` ``[M, d_out, da]`` holds ``G̃_B − g_bar``.
    ``groups`` K: heat batch ``b`` belongs to group ``b mod K`` (K is capped
    at M). ``drift_means`` ``[K, d_out, da]`` / ``drift_counts`` ``[K]``: the
    drift's own group mean directions (None: the drift comes from the heat
    batches). The stacks of :func:`~normfast.engine.transmission.head.dispatch.head_mode_stats` are
    formed on first use and cached. Build with :func:`prepare_head`.

    ``known_mean``: the directions are the heat's importance-sampled draws, already centered about
    the drift's mean direction and weighted (:mod:`normfast.engine.directions.sampling`):
    ``g_centered`` holds them as given, ``g_bar`` is zero, and the heat's covariance is their mean
    outer product ``Σ_B G̃ᵀG̃ / M`` (no sample mean taken out). It needs the drift's own group means.
    """

    def __init__(
        self,
        g_bar: torch.Tensor,
        g_centered: torch.Tensor,
        has_bias: bool,
        *,
        groups: int = DEFAULT_GROUPS,
        drift_means: torch.Tensor | None = None,
        drift_counts: torch.Tensor | None = None,
        known_mean: bool = False,
    ) -> None:
        self.g_bar = g_bar
        self.g_centered = g_centered
        self.has_bias = has_bias
        self.known_mean = bool(known_mean)
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

        def cast(x):
            return None if x is None else x.to(dtype)

        return HeadDirections(
            self.g_bar.to(dtype),
            self.g_centered.to(dtype),
            self.has_bias,
            groups=self.groups,
            drift_means=cast(self.drift_means),
            drift_counts=cast(self.drift_counts),
            known_mean=self.known_mean,
        )

    # -- stacks ------------------------------------------------------------------
    @property
    def heat_denominator(self) -> int:
        """What the summed squares of the M centered directions are divided by: M − 1 (a sample mean
        was taken out), or M about a known centre (``known_mean``)."""
        return self.M if self.known_mean else self.M - 1

    def covariance(self) -> torch.Tensor:
        """``S_c`` ``[da, da]``, one GEMM over the ``M·d_out`` centered rows, ``/(M−1)`` (``/M`` about a
        known centre)."""
        if "S_c" not in self._cache:
            flat = self.g_centered.reshape(self.M * self.d_out, -1)
            self._cache["S_c"] = (flat.T @ flat).div_(self.heat_denominator)
        return self._cache["S_c"]

    def jackknife_covariances(self) -> torch.Tensor:
        """``[K+1, da, da]``: ``S_c`` and the K leave-one-group-out covariances ``S_c,−g``.

        With ``C_h = Σ_{B∈h} G̃^cᵀ_B G̃^c_B`` per group (about the overall mean;
        the same GEMM work as ``S_c`` alone) and ``s_g = Σ_{B∈g} G̃^c_B`` (the
        batches outside g sum to ``−s_g``):
        ``S_c,−g = (Σ_{h≠g} C_h − s_gᵀ s_g/(M − n_g)) / (M − n_g − 1)`` -- sums
        of the other groups, no cancellation -- NaN when fewer than two
        batches are left. About a known centre (``known_mean``): ``Σ_{h≠g} C_h / (M − n_g)``.
        """
        if "S_jk" not in self._cache:
            k, m = self.K, self.M
            da = self.g_centered.shape[2]
            c = self.g_centered
            blocks = [c[g::k].reshape(-1, da) for g in range(k)]  # group g: batches g, g + K, ...
            grams = torch.stack([b.T @ b for b in blocks])  # C_h
            total = grams.sum(0)
            out = torch.empty((k + 1, da, da), dtype=c.dtype, device=c.device)
            out[0] = total / self.heat_denominator
            for g, block in enumerate(blocks):
                left = m - c[g::k].shape[0]
                if left < 2:
                    out[g + 1] = float("nan")
                    continue
                others = grams[torch.arange(k, device=c.device) != g].sum(0)
                if self.known_mean:
                    out[g + 1] = others / left
                    continue
                s_g = c[g::k].sum(0)
                out[g + 1] = (others - (s_g.T @ s_g) / left) / (left - 1)
            self._cache["S_jk"] = out
        return self._cache["S_jk"]

    def drift_stack(self, grouped: bool) -> torch.Tensor:
        """``[K+1, d_out, da]``: the drift's mean direction and its leave-one-group-out means (grouped), else
        ``[1, ...]``."""
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
                loo = -(counts / (total - counts))[:, None, None] * means  # Ḡ_−g − Ḡ
                stack = torch.cat([centre[None], centre[None] + loo], 0)
            else:
                stack = centre[None]
            self._cache[key] = stack.to(self.dtype)
        return self._cache[key]

    def per_batch_stack(self) -> torch.Tensor:
        """``[M+1, d_out, da]``: the heat's mean direction, then every centered batch direction."""
        return torch.cat([self.g_bar[None], self.g_centered], 0)

    def __repr__(self) -> str:
        return (
            f"HeadDirections(M={self.M}, d_out={self.d_out}, d_in={self.d_in}, has_bias={self.has_bias}, "
            f"groups={self.K}, drift_groups={self.drift_K}, known_mean={self.known_mean}, dtype={self.dtype}, "
            f"device={self.device})"
        )


def prepare_head(
    G: Any,
    g_bias: Any = None,
    *,
    drift_means: Any = None,
    drift_bias: Any = None,
    drift_counts: Any = None,
    groups: int = DEFAULT_GROUPS,
    dtype: torch.dtype | None = None,
    known_mean: bool = False,
) -> HeadDirections:
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

    ``known_mean``: ``G`` (and ``g_bias``) are the heat's importance-sampled draws, already centered
    about the drift's mean direction and weighted (:class:`HeadDirections`); needs the drift.
    """
    fn = "prepare_head"
    G = as_tensor(fn, "G", G)
    g_bias = None if g_bias is None else as_tensor(fn, "g_bias", g_bias)
    check_directions(fn, G, g_bias)
    groups = check_groups(fn, groups)
    cd = compute_dtype(fn, dtype, G, g_bias)
    if known_mean and drift_means is None:
        raise ValueError(
            f"{fn}: known_mean=True (directions centered about the drift's mean) needs drift_means, got None"
        )
    dirs = center_directions(G, g_bias, cd, groups, known_mean=known_mean)
    if drift_means is not None or drift_bias is not None or drift_counts is not None:
        attach_drift(fn, dirs, drift_means, drift_bias, drift_counts)
    return dirs


def check_directions(fn: str, G: torch.Tensor, g_bias: torch.Tensor | None) -> None:
    check_float(fn, "G", G)
    check_ndim(fn, "G", G, 3, "3-D [M, d_out, d_in]")
    if g_bias is not None:
        check_float(fn, "g_bias", g_bias)
        check_ndim(fn, "g_bias", g_bias, 2, "2-D [M, d_out]")
        if tuple(g_bias.shape) != tuple(G.shape[:2]):
            raise ValueError(
                f"{fn}: expected g_bias of shape [M, d_out]={tuple(G.shape[:2])} "
                f"matching G, got {describe('g_bias', g_bias)}"
            )
        check_same_device(fn, G=G, g_bias=g_bias)
    if G.shape[0] < 2:
        raise ValueError(
            f"{fn}: expected at least 2 virtual batches (M >= 2) in G [M, d_out, d_in], got {describe('G', G)}"
        )
    if G.shape[1] == 0 or G.shape[2] == 0:
        raise ValueError(f"{fn}: expected non-empty d_out and d_in in G [M, d_out, d_in], got {describe('G', G)}")


def center_directions(
    G: torch.Tensor, g_bias: torch.Tensor | None, cd: torch.dtype, groups: int, *, known_mean: bool = False
) -> HeadDirections:
    m, d_out, d_in = G.shape
    has_bias = g_bias is not None
    aug = torch.empty((m, d_out, d_in + int(has_bias)), dtype=cd, device=G.device)
    aug[:, :, :d_in] = G
    if has_bias:
        aug[:, :, d_in] = g_bias
    if known_mean:  # already centered (about the drift's mean) and weighted
        return HeadDirections(torch.zeros_like(aug[0]), aug, has_bias, groups=groups, known_mean=True)
    g_bar = aug.mean(0)
    aug -= g_bar  # centered in place: no statistic needs the raw directions again
    return HeadDirections(g_bar, aug, has_bias, groups=groups)


def attach_drift(fn: str, dirs: HeadDirections, drift_means: Any, drift_bias: Any, drift_counts: Any) -> None:
    if drift_means is None:
        raise ValueError(f"{fn}: expected drift_means [K, d_out, d_in] with drift_bias/drift_counts, got None")
    Gd = float_tensor(fn, "drift_means", drift_means, 3, "3-D [K, d_out, d_in]")
    k = Gd.shape[0]
    if tuple(Gd.shape[1:]) != (dirs.d_out, dirs.d_in):
        raise ValueError(
            f"{fn}: expected drift_means of shape [K, d_out, d_in] with (d_out, d_in)="
            f"{(dirs.d_out, dirs.d_in)} from G, got {describe('drift_means', Gd)}"
        )
    if k < 2:
        raise ValueError(
            f"{fn}: expected at least 2 drift groups (K >= 2) in drift_means [K, d_out, d_in], "
            f"got {describe('drift_means', Gd)}"
        )
    if k > dirs.M:
        raise ValueError(
            f"{fn}: expected at most M={dirs.M} drift groups (the heat's M batches form the same K "
            f"groups), got {describe('drift_means', Gd)}"
        )
    if (drift_bias is None) == dirs.has_bias:
        raise ValueError(
            f"{fn}: expected drift_bias [K, d_out] exactly when g_bias is given "
            f"(has_bias={dirs.has_bias}), got drift_bias="
            f"{'None' if drift_bias is None else describe('drift_bias', drift_bias)}"
        )
    gd = None
    if drift_bias is not None:
        gd = as_tensor(fn, "drift_bias", drift_bias)
        check_float(fn, "drift_bias", gd)
        if tuple(gd.shape) != (k, dirs.d_out):
            raise ValueError(
                f"{fn}: expected drift_bias of shape [K, d_out]={(k, dirs.d_out)}, got {describe('drift_bias', gd)}"
            )
    if drift_counts is None:
        counts = torch.ones(k, dtype=dirs.dtype, device=dirs.device)
    else:
        counts = counts_tensor(fn, "drift_counts", drift_counts, k, dtype=dirs.dtype, device=dirs.device)
    check_same_device(fn, G=dirs.g_bar, drift_means=Gd)
    aug = torch.empty((k, dirs.d_out, dirs.d_in + int(dirs.has_bias)), dtype=dirs.dtype, device=dirs.device)
    aug[:, :, : dirs.d_in] = Gd
    if gd is not None:
        aug[:, :, dirs.d_in] = gd
    dirs.drift_means, dirs.drift_counts = aug, counts
    dirs._cache.clear()

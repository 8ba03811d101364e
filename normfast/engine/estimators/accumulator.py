"""Streaming per-probe accumulators for the probe statistics.

A :class:`ProbeAccumulator` holds, for ``N`` probes of width ``d`` and each
branch (``u = R t`` scale-invariant, ``w = t`` scale-free), everything needed
for the statistics of :data:`normfast.ops.STAT_KEYS` over the directions seen
so far: the running mean vector, ``M2 = Σ_B |x^B - x̄|²``, the running mean
and M2 of the radial dots ``r^B = ẑ·x^B``, and the counts of positive and
negative radial dots; for the "uw" branch also the running mean of ``u·w``.

Updates use shifted sums (numerically a Welford update for a block of
directions) and :meth:`ProbeAccumulator.merge` uses Chan's parallel formula,
so chunking the directions, or splitting them across ranks, changes results
only at rounding level.

State layout (``state_dict()``; every value a plain tensor)::

    n           int64 []        directions seen (M)
    reason      int8  [N]       first failure per row, codes of REASONS (0 = ok)
    mean{s}     dtype [N, d]    running mean vector of the branch
    M2{s}       dtype [N]       Σ_B |x^B - mean|²
    rmean{s}    dtype [N]       running mean of the radial dots
    rM2{s}      dtype [N]       Σ_B (r^B - rmean)²
    npos{s}     int64 [N]       #(r^B > 0)
    nneg{s}     int64 [N]       #(r^B < 0)
    cross       dtype [N]       running mean of u^B·w^B ("uw" only)

with suffix ``{s}`` = ``_u`` and/or ``_w``. To combine accumulators from
several ranks, gather their state dicts and :meth:`merge` them; the state is
not a sum, so a plain all-reduce(sum) would not be exact.
"""

from __future__ import annotations

from typing import Any

import torch

from normfast.core.checks import (
    as_tensor,
    check_choice,
    check_float,
    check_ndim,
    check_positive_int,
    check_same_device,
    describe,
)
from normfast.engine.estimators.statkeys import BACKENDS, BRANCHES, branch_suffixes, row_codes

# Elements of scratch memory the torch path may allocate per step.
_TORCH_SCRATCH = 1 << 25


class ProbeAccumulator:
    """Streaming, mergeable accumulator of the per-probe statistics.

    Parameters
    ----------
    n_probes, dim:
        Number of probe rows ``N`` and embedding width ``d``.
    branch:
        ``"u"`` (scale-invariant, ``u = R t``; SGD), ``"w"`` (scale-free,
        ``w = t``; AdamW) or ``"uw"`` (both, plus ``C_uw = mean u·w``).
    device, dtype:
        Where the state lives and its precision: float32 (default; the Triton
        kernel's state) or float64 (CPU references, tests).
    backend:
        ``"auto"`` runs the fused Triton kernel for float32 state on CUDA when
        ``dim <= normfast.kernels.MAX_FUSED_DIM`` and torch otherwise;
        ``"torch"`` / ``"triton"`` force one (``"triton"`` on CPU needs
        ``TRITON_INTERPRET=1``).

    known_mean:
        The displacements are deviations about a known centre, already weighted
        (the heat's importance-sampled draws, :mod:`normfast.engine.directions.sampling`):
        the heat is then their mean square, ``V2 = Σ_B |x^B|² / M``, and ``m2``,
        ``Q`` and ``D`` of these displacements are not the row's (the drift's
        mean direction gives those). Default False: the plain estimator.

    Every row is kept: rows whose embedding has zero or non-finite norm, or
    whose displacements are non-finite, finalize to NaN statistics with a
    code in ``reason`` (see :data:`normfast.engine.estimators.statkeys.REASONS`).
    """

    def __init__(
        self,
        n_probes: int,
        dim: int,
        *,
        branch: str = "u",
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        backend: str = "auto",
        known_mean: bool = False,
    ) -> None:
        fn = "ProbeAccumulator"
        n_probes = check_positive_int(fn, "n_probes", n_probes)
        dim = check_positive_int(fn, "dim", dim)
        check_choice(fn, "branch", branch, BRANCHES)
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{fn}: expected dtype torch.float32 or torch.float64, got dtype={dtype}")
        check_choice(fn, "backend", backend, BACKENDS)
        device = torch.device(device)
        if backend == "triton":
            from normfast.kernels import MAX_FUSED_DIM

            if dtype != torch.float32 or dim > MAX_FUSED_DIM:
                raise ValueError(
                    f"{fn}: backend='triton' needs dtype=torch.float32 and dim <= "
                    f"{MAX_FUSED_DIM}, got dtype={dtype}, dim={dim}"
                )
        self.n_probes, self.dim, self.branch = n_probes, dim, branch
        self.dtype, self.device, self.backend = dtype, device, backend
        self.known_mean = bool(known_mean)
        nb = 2 if branch == "uw" else 1
        self._mean = torch.zeros((nb, n_probes, dim), dtype=dtype, device=device)
        self._moments = torch.zeros((nb, 3, n_probes), dtype=dtype, device=device)
        self._counts = torch.zeros((nb, 2, n_probes), dtype=torch.int64, device=device)
        self._cross = torch.zeros(n_probes, dtype=dtype, device=device) if branch == "uw" else None
        self._reason = torch.zeros(n_probes, dtype=torch.int8, device=device)
        self._n = 0

    # ------------------------------------------------------------------ info
    @property
    def M(self) -> int:
        """Number of directions (virtual batches) accumulated so far."""
        return self._n

    def running_drift(self, branch: int = 0) -> torch.Tensor:
        """The drift so far, per probe: the running mean radial dot of branch ``branch`` (0 for the first
        of ``"u"``/``"w"``/``"uw"``, 1 for ``"uw"``'s ``w``), invalid rows included (a view, not a copy)."""
        return self._moments[branch, 1]

    def __repr__(self) -> str:
        return (
            f"ProbeAccumulator(n_probes={self.n_probes}, dim={self.dim}, "
            f"branch={self.branch!r}, M={self._n}, device={self.device}, dtype={self.dtype})"
        )

    def _use_triton(self) -> bool:
        if self.backend == "triton":
            return True
        if self.backend == "torch" or self.device.type != "cuda" or self.dtype != torch.float32:
            return False
        from normfast.kernels import MAX_FUSED_DIM

        return self.dim <= MAX_FUSED_DIM

    # ---------------------------------------------------------------- update
    def update(self, t: Any, z: Any, *, t_w: Any = None) -> "ProbeAccumulator":
        """Add ``K`` directions: ``t`` ``[N, d]`` (one) or ``[K, N, d]``.

        ``z`` ``[N, d]`` are the probe embeddings (the same every update).
        ``t`` is the displacement per unit learning rate of the branch ("u":
        scaled by ``R = |z|`` here; "w": used as is); for "uw" ``t`` is the
        u-branch displacement and ``t_w`` the w-branch one, same shape.
        ``K = 0`` is a no-op. Inputs may be fp16/bf16/fp32/fp64 torch tensors
        or any DLPack array; they must live on the accumulator's device.
        """
        fn = "ProbeAccumulator.update"
        t = as_tensor(fn, "t", t)
        z = as_tensor(fn, "z", z)
        if t_w is not None:
            t_w = as_tensor(fn, "t_w", t_w)
        if self.branch == "uw" and t_w is None:
            raise ValueError(f"{fn}: expected t_w (the w-branch displacements) for branch='uw', got t_w=None")
        if self.branch != "uw" and t_w is not None:
            raise ValueError(
                f"{fn}: expected t_w=None for branch={self.branch!r} (t_w is only "
                f"used by branch='uw'), got {describe('t_w', t_w)}"
            )
        check_float(fn, "t", t)
        check_float(fn, "z", z)
        check_ndim(fn, "t", t, (2, 3), f"[N, d] or [K, N, d] with N={self.n_probes}, d={self.dim}")
        check_ndim(fn, "z", z, 2, f"[N, d] with N={self.n_probes}, d={self.dim}")
        expected = (self.n_probes, self.dim)
        if tuple(z.shape) != expected:
            raise ValueError(f"{fn}: expected z of shape (N, d)={expected}, got {describe('z', z)}")
        if tuple(t.shape[-2:]) != expected:
            raise ValueError(f"{fn}: expected t of shape [K, N, d] with (N, d)={expected}, got {describe('t', t)}")
        if t_w is not None:
            check_float(fn, "t_w", t_w)
            if t_w.shape != t.shape:
                raise ValueError(f"{fn}: expected t_w.shape == t.shape={tuple(t.shape)}, got {describe('t_w', t_w)}")
        check_same_device(fn, accumulator=self._mean, t=t, z=z, t_w=t_w)
        if t.dim() == 2:
            t = t.unsqueeze(0)
            t_w = None if t_w is None else t_w.unsqueeze(0)
        if t.shape[0] == 0:
            return self
        if self._use_triton():
            self._update_triton(t, z, t_w)
        else:
            self._update_torch(t, z, t_w)
        return self

    def _update_triton(self, t: torch.Tensor, z: torch.Tensor, t_w: torch.Tensor | None) -> None:
        from normfast.kernels import KERNEL_INPUT_DTYPES, accumulate

        def kernel_dtype(x):
            return x if x is None or x.dtype in KERNEL_INPUT_DTYPES else x.float()

        accumulate(
            kernel_dtype(t),
            kernel_dtype(z),
            self._mean,
            self._moments,
            self._counts,
            self._reason,
            self._n,
            branch=self.branch,
            t_w=kernel_dtype(t_w),
            cross=self._cross,
        )
        self._n += t.shape[0]

    def _update_torch(self, t: torch.Tensor, z: torch.Tensor, t_w: torch.Tensor | None) -> None:
        # Chunks of directions bound the scratch memory; each chunk is one
        # shifted-sum update, so chunking changes results only by rounding.
        step = max(1, _TORCH_SCRATCH // (self.n_probes * self.dim))
        z = z.to(self.dtype)
        norm = torch.linalg.vector_norm(z, dim=1)
        zhat = z / norm[:, None]
        for k0 in range(0, t.shape[0], step):
            chunk = t[k0 : k0 + step].to(self.dtype)
            chunk_w = None if t_w is None else t_w[k0 : k0 + step].to(self.dtype)
            self._update_torch_chunk(chunk, norm, zhat, chunk_w)

    def _update_torch_chunk(
        self, t: torch.Tensor, norm: torch.Tensor, zhat: torch.Tensor, t_w: torch.Tensor | None
    ) -> None:
        # Same math as the fused kernel, arranged for few passes over t: the
        # deviations are formed once, with the branch scaling folded in and
        # their sign flipped (s - x) so that one fused op makes them; squared
        # norms are row reductions (vector_norm along d, exact enough; along
        # several axes at once it is not); radial dots a batched GEMV.
        k = t.shape[0]
        first = self._n == 0
        n_new = self._n + k
        scaled = self.branch in ("u", "uw")
        sources = [(t, norm if scaled else None)]
        if t_w is not None:
            sources.append((t_w, None))
        bad = torch.zeros(self.n_probes, dtype=torch.bool, device=self.device)
        for b, (src, scale) in enumerate(sources):
            mean, moments, counts = self._mean[b], self._moments[b], self._counts[b]
            if scale is None:
                shift = src[0] if first else mean
                neg_dev = shift - src
                radial = torch.einsum("knd,nd->kn", src, zhat)
            else:
                shift = src[0] * scale[:, None] if first else mean
                neg_dev = torch.addcmul(shift, src, scale[None, :, None], value=-1)
                radial = torch.einsum("knd,nd->kn", src, zhat) * scale
            neg_s1 = neg_dev.sum(0)  # -S1
            s2 = torch.linalg.vector_norm(neg_dev, dim=2).square().sum(0)
            del neg_dev
            s1_sq = torch.linalg.vector_norm(neg_s1, dim=1).square()
            rshift = radial[0] if first else moments[1].clone()
            dr = radial - rshift
            r1, r2 = dr.sum(0), dr.square().sum(0)
            m2_old = 0.0 if first else moments[0]
            rm2_old = 0.0 if first else moments[2]
            moments[0] = m2_old + s2 - s1_sq / n_new
            moments[2] = rm2_old + r2 - r1.square() / n_new
            moments[1] = rshift + r1 / n_new
            if first:
                torch.add(shift, neg_s1, alpha=-1.0 / n_new, out=mean)
            else:
                mean.add_(neg_s1, alpha=-1.0 / n_new)
            counts[0] += (radial > 0).sum(0)
            counts[1] += (radial < 0).sum(0)
            bad |= ~torch.isfinite(s2) | ~torch.isfinite(r2)
        if t_w is not None:
            prod = torch.einsum("knd,knd->kn", t, t_w) * norm  # u·w = R (t·t_w)
            cshift = prod[0] if first else self._cross.clone()
            c1 = (prod - cshift).sum(0)
            self._cross.copy_(cshift + c1 / n_new)
            bad |= ~torch.isfinite(c1)
        code = row_codes(norm, bad)
        self._reason.copy_(torch.where(self._reason != 0, self._reason, code))
        self._n = n_new

    # ----------------------------------------------------------------- merge
    def merge(self, other: "ProbeAccumulator") -> "ProbeAccumulator":
        """Combine with an accumulator of DIFFERENT directions for the SAME probes.

        Chan's parallel formula: with ``δ = mean_b - mean_a``,
        ``mean = mean_a + δ n_b/n``, ``M2 = M2_a + M2_b + |δ|² n_a n_b / n``
        (the same for the radial dots); counts add; failure codes combine
        (first non-zero). Exact up to rounding, in any order.
        """
        fn = "ProbeAccumulator.merge"
        if not isinstance(other, ProbeAccumulator):
            raise TypeError(f"{fn}: expected a ProbeAccumulator, got {type(other).__name__}")
        mine = (self.n_probes, self.dim, self.branch, self.dtype, self.device)
        theirs = (other.n_probes, other.dim, other.branch, other.dtype, other.device)
        if mine != theirs:
            raise ValueError(
                f"{fn}: expected an accumulator with (n_probes, dim, branch, dtype, device)={mine}, got {theirs}"
            )
        if other._n == 0:
            return self
        if other.known_mean != self.known_mean:
            raise ValueError(
                f"{fn}: expected an accumulator with known_mean={self.known_mean} (the same heat estimator), "
                f"got known_mean={other.known_mean}"
            )
        if self._n == 0:
            self.load_state_dict(other.state_dict())
            return self
        na, nb = self._n, other._n
        n = na + nb
        delta = other._mean - self._mean
        self._moments[:, 0] += other._moments[:, 0] + delta.square().sum(2) * (na * nb / n)
        self._mean += delta * (nb / n)
        rdelta = other._moments[:, 1] - self._moments[:, 1]
        self._moments[:, 2] += other._moments[:, 2] + rdelta.square() * (na * nb / n)
        self._moments[:, 1] += rdelta * (nb / n)
        self._counts += other._counts
        if self._cross is not None:
            self._cross += (other._cross - self._cross) * (nb / n)
        self._reason.copy_(torch.where(self._reason != 0, self._reason, other._reason))
        self._n = n
        return self

    # -------------------------------------------------------------- finalize
    def finalize(self) -> dict[str, Any]:
        """The statistics over the ``M`` directions seen so far.

        Per branch (keys of :data:`~normfast.engine.estimators.statkeys.STAT_KEYS`; suffix ``_w`` for the w branch):
        ``D`` mean radial dot, ``se_D = std(r, ddof=1)/sqrt(M)``,
        ``sign_stability`` = fraction of directions whose radial dot has the
        sign of ``D`` (``sign(0) = 0``: a zero dot agrees only with ``D = 0``),
        ``m2 = |mean x|²``, ``V2 = M2/(M-1)`` (``known_mean``: ``Σ|x|²/M``), ``Q = m2 + V2``; "uw" adds
        ``C_uw = mean u·w``. Also ``valid`` (bool), ``reason`` (int8) and
        ``M``. Invalid rows are NaN. Raises ``ValueError`` when ``M < 2``.
        """
        if self._n < 2:
            raise ValueError(f"ProbeAccumulator.finalize: expected at least 2 directions (M >= 2), got M={self._n}")
        m = self._n
        out: dict[str, Any] = {}
        valid = self._reason == 0
        nan = torch.tensor(float("nan"), dtype=self.dtype, device=self.device)
        for b, suffix in enumerate(branch_suffixes(self.branch)):
            key = "" if suffix == "_u" else "_w"
            m2_dev, rmean, rm2 = self._moments[b]
            pos, neg = self._counts[b]
            m2 = self._mean[b].square().sum(1)
            if self.known_mean:  # the mean square about the known centre: Σ|x - x̄|² + M |x̄|², over M
                v2 = m2_dev.clamp_min(0) / m + m2
            else:
                v2 = m2_dev.clamp_min(0) / (m - 1)
            agree = torch.where(rmean > 0, pos, torch.where(rmean < 0, neg, m - pos - neg))
            stats = {
                "D": rmean.clone(),
                "se_D": torch.sqrt(rm2.clamp_min(0) / ((m - 1) * m)),
                "sign_stability": agree.to(self.dtype) / m,
                "m2": m2,
                "V2": v2,
                "Q": m2 + v2,
            }
            for name, value in stats.items():
                out[name + key] = torch.where(valid, value, nan)
        if self._cross is not None:
            out["C_uw"] = torch.where(valid, self._cross, nan)
        out["valid"] = valid
        out["reason"] = self._reason.clone()
        out["M"] = m
        return out

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the state as named plain tensors (layout in the module docstring)."""
        state = {"n": torch.tensor(self._n, dtype=torch.int64), "reason": self._reason.clone()}
        for b, suffix in enumerate(branch_suffixes(self.branch)):
            state["mean" + suffix] = self._mean[b].clone()
            for i, name in enumerate(("M2", "rmean", "rM2")):
                state[name + suffix] = self._moments[b, i].clone()
            state["npos" + suffix] = self._counts[b, 0].clone()
            state["nneg" + suffix] = self._counts[b, 1].clone()
        if self._cross is not None:
            state["cross"] = self._cross.clone()
        return state

    def _expected_state(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        n, d = self.n_probes, self.dim
        spec: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"n": ((), torch.int64), "reason": ((n,), torch.int8)}
        for suffix in branch_suffixes(self.branch):
            spec["mean" + suffix] = ((n, d), self.dtype)
            for name in ("M2", "rmean", "rM2"):
                spec[name + suffix] = ((n,), self.dtype)
            spec["npos" + suffix] = ((n,), torch.int64)
            spec["nneg" + suffix] = ((n,), torch.int64)
        if self.branch == "uw":
            spec["cross"] = ((n,), self.dtype)
        return spec

    def load_state_dict(self, state: dict[str, Any]) -> "ProbeAccumulator":
        """Replace the state by ``state`` (as produced by :meth:`state_dict`); validated first."""
        fn = "ProbeAccumulator.load_state_dict"
        spec = self._expected_state()
        missing = sorted(set(spec) - set(state))
        unexpected = sorted(set(state) - set(spec))
        if missing or unexpected:
            raise ValueError(
                f"{fn}: expected keys {sorted(spec)} for branch={self.branch!r}, "
                f"missing {missing}, unexpected {unexpected}"
            )
        tensors = {}
        for name, (shape, dtype) in spec.items():
            x = torch.as_tensor(as_tensor(fn, name, state[name]))
            if tuple(x.shape) != shape:
                raise ValueError(f"{fn}: expected {name} of shape {shape}, got {describe(name, x)}")
            if x.dtype.is_floating_point != dtype.is_floating_point:
                raise TypeError(f"{fn}: expected {name} with dtype {dtype}, got {describe(name, x)}")
            tensors[name] = x
        n = int(tensors["n"])
        if n < 0:
            raise ValueError(f"{fn}: expected n >= 0, got n={n}")
        self._n = n
        self._reason.copy_(tensors["reason"])
        for b, suffix in enumerate(branch_suffixes(self.branch)):
            self._mean[b].copy_(tensors["mean" + suffix])
            for i, name in enumerate(("M2", "rmean", "rM2")):
                self._moments[b, i].copy_(tensors[name + suffix])
            self._counts[b, 0].copy_(tensors["npos" + suffix])
            self._counts[b, 1].copy_(tensors["nneg" + suffix])
        if self._cross is not None:
            self._cross.copy_(tensors["cross"])
        return self

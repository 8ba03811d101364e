"""Per-probe statistics with error bars from K batch groups (:class:`GroupedAccumulator`)."""

from __future__ import annotations

from typing import Any

import torch

from normfast.core.checks import as_tensor, check_groups
from normfast.engine.estimators.accumulator import ProbeAccumulator
from normfast.engine.estimators.statkeys import branch_suffixes
from normfast.engine.estimators.uncertainty import DEFAULT_GROUPS, group_spread, jackknife_se


class GroupedAccumulator:
    """Per-probe statistics with error bars: K :class:`ProbeAccumulator` s, one per batch group.

    Direction ``b`` (its global batch index: ``first_batch`` of the update
    plus its position) goes to group ``b mod K``, so the grouping does not
    depend on how the directions are chunked or ordered. :meth:`finalize`
    returns what one accumulator over all directions returns (merged with
    Chan's formula, exact up to rounding) except that ``se_D`` and
    ``sign_stability`` come from the K group drifts ``D_g`` (the estimator of
    :func:`normfast.engine.estimators.uncertainty.group_spread`: K−1 degrees of
    freedom), plus ``se_V2``/``se_Q`` (delete-a-group jackknife) and ``loo``
    -- ``{"D", "m2", "V2", "Q", "C_uw"}`` (suffixed by branch) → ``[N, K]``
    values over all directions outside each group -- and ``groups`` (K). A
    leave-one-out set of fewer than two directions gives NaN there. The
    grouped head-mode estimators of :func:`normfast.ops.head_mode_stats` are
    the same numbers in closed form. ``known_mean``: the heat's importance-sampled
    draws (:class:`ProbeAccumulator`); draw ``i`` is in group ``i mod K``.
    Memory: K times one accumulator.
    """

    def __init__(
        self,
        n_probes: int,
        dim: int,
        *,
        groups: int = DEFAULT_GROUPS,
        branch: str = "u",
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        backend: str = "auto",
        known_mean: bool = False,
    ) -> None:
        groups = check_groups("GroupedAccumulator", groups)
        self.groups = [
            ProbeAccumulator(
                n_probes, dim, branch=branch, device=device, dtype=dtype, backend=backend, known_mean=known_mean
            )
            for _ in range(groups)
        ]
        self.K = groups
        self.n_probes, self.dim, self.branch = n_probes, dim, branch
        self.dtype, self.device = dtype, self.groups[0].device

    @property
    def M(self) -> int:
        return sum(g.M for g in self.groups)

    @property
    def counts(self) -> list[int]:
        return [g.M for g in self.groups]

    def __repr__(self) -> str:
        return (
            f"GroupedAccumulator(n_probes={self.n_probes}, dim={self.dim}, branch={self.branch!r}, "
            f"K={self.K}, M={self.M}, counts={self.counts})"
        )

    def update(self, t: Any, z: Any, *, t_w: Any = None, first_batch: int = 0) -> "GroupedAccumulator":
        """Add directions ``first_batch, first_batch + 1, ...``: ``t`` ``[N, d]`` or ``[k, N, d]`` (see
        :meth:`ProbeAccumulator.update`)."""
        fn = "GroupedAccumulator.update"
        if isinstance(first_batch, bool) or not isinstance(first_batch, int) or first_batch < 0:
            raise ValueError(f"{fn}: expected first_batch to be a non-negative int, got {first_batch!r}")
        t = as_tensor(fn, "t", t)
        t_w = None if t_w is None else as_tensor(fn, "t_w", t_w)
        if t.dim() == 2:
            t = t.unsqueeze(0)
            t_w = None if t_w is None else t_w.unsqueeze(0)
        ids = (torch.arange(t.shape[0]) + first_batch) % self.K
        for g in range(self.K):
            pick = torch.nonzero(ids == g).flatten()
            if len(pick) == 0:
                continue
            pick = pick.to(t.device)
            self.groups[g].update(t.index_select(0, pick), z, t_w=None if t_w is None else t_w.index_select(0, pick))
        return self

    def merge(self, other: "GroupedAccumulator") -> "GroupedAccumulator":
        """Combine group by group with an accumulator of DIFFERENT directions for the SAME probes."""
        if not isinstance(other, GroupedAccumulator) or other.K != self.K:
            raise ValueError(f"GroupedAccumulator.merge: expected a GroupedAccumulator with K={self.K}, got {other!r}")
        for mine, theirs in zip(self.groups, other.groups):
            mine.merge(theirs)
        return self

    def _merged(self, skip: int | None = None) -> ProbeAccumulator:
        first = self.groups[0]
        out = ProbeAccumulator(
            first.n_probes,
            first.dim,
            branch=first.branch,
            device=first.device,
            dtype=first.dtype,
            backend=first.backend,
            known_mean=first.known_mean,
        )
        for g, acc in enumerate(self.groups):
            if g != skip:
                out.merge(acc)
        return out

    def finalize(self) -> dict[str, Any]:
        """The statistics over all directions, with the grouped error bars (see the class docstring)."""
        fn = "GroupedAccumulator.finalize"
        empty = [g for g, n in enumerate(self.counts) if n == 0]
        if empty:
            raise ValueError(
                f"{fn}: expected at least one direction in each of the K={self.K} groups, got counts={self.counts}"
            )
        out = self._merged().finalize()
        valid = out["valid"]
        nan = torch.tensor(float("nan"), dtype=self.dtype, device=self.device)
        counts = torch.tensor(self.counts, dtype=self.dtype, device=self.device)
        suffixes = [("" if s == "_u" else "_w") for s in branch_suffixes(self.branch)]
        loo_parts: dict[str, list[torch.Tensor]] = {}
        for g in range(self.K):
            left = self.M - self.counts[g]
            if left >= 2:
                part = self._merged(skip=g).finalize()
            else:
                part = {
                    k: torch.full((self.n_probes,), float("nan"), dtype=self.dtype, device=self.device)
                    for k in out
                    if isinstance(out[k], torch.Tensor) and out[k].is_floating_point()
                }
            for key in ("D", "m2", "V2", "Q"):
                for sfx in suffixes:
                    loo_parts.setdefault(key + sfx, []).append(part[key + sfx])
            if "C_uw" in out:
                loo_parts.setdefault("C_uw", []).append(part["C_uw"])
        loo = {k: torch.where(valid[:, None], torch.stack(v, 1), nan) for k, v in loo_parts.items()}
        for b, sfx in enumerate(suffixes):
            group_drift = torch.stack([acc.running_drift(b) for acc in self.groups], 1)  # D_g
            se, agree = group_spread(out["D" + sfx], group_drift, counts)
            out["se_D" + sfx] = torch.where(valid, se, nan)
            out["sign_stability" + sfx] = torch.where(valid, agree, nan)
            out["se_V2" + sfx] = jackknife_se(loo["V2" + sfx])
            out["se_Q" + sfx] = jackknife_se(loo["Q" + sfx])
        out["loo"] = loo
        out["groups"] = self.K
        return out

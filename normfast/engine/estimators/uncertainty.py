"""Error bars from K groups of virtual batches: the shared estimators.

Every standard error of normfast comes from the same partition: virtual batch
``b`` (its global index, so the partition does not depend on how batches are
chunked, sharded or added later) belongs to group ``b mod K``. The groups
are independent replicates of the whole measurement, which gives two kinds of
error bar:

* **The drift** (a mean over batches, linear in the update direction): from
  the group drifts ``D_g`` and group sizes ``n_g``,
  ``se_D² = Σ_g n_g (D_g − D)² / ((K−1) M)`` -- unbiased for ``Var(D)`` for
  any group sizes (each ``D_g`` has variance ``σ²/n_g``), K−1 degrees of
  freedom. Equal groups give ``sd(D_g)/√K``. ``sign_stability`` is the share
  of groups whose ``D_g`` has the sign of ``D``.
* **Everything else** (the heat ``V2``, the second moment ``Q``, the
  equilibrium norms ``R_eq``; non-linear in the batches): the delete-a-group
  jackknife. With ``θ_{−g}`` the statistic recomputed without group ``g``
  (the drift's and the heat's group ``g`` together), ``θ̄ = mean_g θ_{−g}``:
  ``se² = (K−1)/K · Σ_g (θ_{−g} − θ̄)²``. It needs no derivative of the
  quartic and carries every covariance (D with Q, the u with the w branch).
  For a mean it equals the between-group formula above; for a smooth
  statistic it is consistent, with K−1 degrees of freedom; for a symmetric
  statistic such as ``V2`` its expectation is at least the true variance
  (the Efron–Stein inequality), so it errs on the wide side. Groups that
  differ by one batch (K not dividing M) are treated as equal.

95% intervals are ``θ ± t_{0.975, K−1} · se``: with few groups the Student t
quantile of K−1 degrees of freedom (12.7 at K = 2, 3.18 at K = 4, 2.36 at
K = 8), never the normal 1.96. Whether the nominal coverage holds is an
empirical question answered by ``python -m bench run calibration``.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np
import torch

# Default K, the batch groups behind every error bar (chosen by ``python -m bench run calibration``).
from normfast.engine.defaults import DEFAULT_GROUPS  # noqa: F401 - re-exported: the estimators' default

#: Two-sided confidence of the reported intervals.
CONFIDENCE = 0.95


def group_of(batch: int, groups: int) -> int:
    """The group of virtual batch ``batch`` (its global index) among ``groups``."""
    return batch % groups


def group_counts(n_batches: int, groups: int, offset: int = 0) -> list[int]:
    """Batches per group when batch ``offset + b`` (``b < n_batches``) belongs to group ``(offset + b) mod K``."""
    counts = [0] * groups
    for b in range(offset, offset + n_batches):
        counts[b % groups] += 1
    return counts


def effective_groups(groups: int, n_batches: int) -> int:
    """K actually used: ``groups``, or every batch its own group when there are fewer batches."""
    return max(2, min(int(groups), int(n_batches)))


@lru_cache(maxsize=64)
def t_quantile(dof: int, confidence: float = CONFIDENCE) -> float:
    """Two-sided Student t quantile, e.g. ``t_quantile(3) = 3.182`` for 95%."""
    # the function scipy.stats.t.ppf evaluates, without importing all of scipy.stats (most of a
    # second, on every probe's first chunk)
    from scipy.special import stdtrit

    if dof < 1:
        return float("nan")
    return float(stdtrit(dof, 0.5 + confidence / 2))


def group_spread(drift: torch.Tensor, group: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``se_D`` and the group sign stability from the group drifts ``D_g`` ``[N, K]`` (see module doc)."""
    k = group.shape[1]
    counts = counts.to(drift)
    total = counts.sum()
    dev = group - drift[:, None]
    se = torch.sqrt((dev.square() * counts).sum(1) / ((k - 1) * total))
    agree = (torch.sign(group) == torch.sign(drift)[:, None]).to(drift.dtype).mean(1)
    return se, agree


def jackknife_se(loo: Any) -> Any:
    """Delete-a-group jackknife standard error from the leave-one-group-out values ``[..., K]``.

    ``sqrt((K−1)/K · Σ_g (θ_{−g} − θ̄)²)``; NaN where any ``θ_{−g}`` is NaN.
    Accepts torch tensors or numpy arrays (returns the same kind).
    """
    if isinstance(loo, torch.Tensor):
        k = loo.shape[-1]
        dev = loo - loo.mean(-1, keepdim=True)
        return torch.sqrt(dev.square().sum(-1) * ((k - 1) / k))
    loo = np.asarray(loo, dtype=float)
    k = loo.shape[-1]
    dev = loo - loo.mean(-1, keepdims=True)
    return np.sqrt((dev**2).sum(-1) * ((k - 1) / k))


def leave_one_out_means(group_means: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x̄_{−g} = (Σ_h n_h x̄_h − n_g x̄_g) / (M − n_g)`` for group means ``[K, ...]``."""
    counts = counts.to(group_means)
    shape = (-1,) + (1,) * (group_means.dim() - 1)
    w = counts.view(shape)
    total = (group_means * w).sum(0, keepdim=True)
    return (total - w * group_means) / (counts.sum() - counts).view(shape)


def interval(value: Any, se: Any, dof: int, lower: float | None = None) -> tuple[Any, Any]:
    """``value ± t_{K−1} se`` (numpy), the lower end clipped at ``lower`` when given."""
    value = np.asarray(value, dtype=float)
    half = t_quantile(dof) * np.asarray(se, dtype=float)
    lo, hi = value - half, value + half
    if lower is not None:
        lo = np.maximum(lo, lower)
    return lo, hi


def equilibrium_intervals(
    loo: dict[str, np.ndarray],
    kappa: np.ndarray,
    law: dict[str, Any],
    r_eq: np.ndarray,
    r_heat: np.ndarray,
    branches: tuple[str, ...],
    level: tuple[dict[str, np.ndarray], float] | None = None,
) -> dict[str, np.ndarray]:
    """Jackknife 95% intervals of ``r_eq`` and ``r_eq_heat`` from leave-one-group-out statistics.

    ``loo`` holds ``[N, K]`` arrays ``D``, ``Q`` (and ``D_w``, ``Q_w``, ``C_uw``
    for the w branch); the quartic is solved once per group (κ, exact, stays).
    ``level``: ``(stats, σ)``, the error of the heat's common level that the groups
    cannot see (the pool's own, log units: ``heat_sampling="energy"``) with the
    row statistics ``D, m2, V2`` (and ``_w``): ``r_eq`` solved again with every
    ``V2`` scaled by ``e^{±σ}``, half the difference as a second standard error,
    added in quadrature to the jackknife's.
    Returns ``r_eq_lo, r_eq_hi, r_eq_heat_lo, r_eq_heat_hi`` (NaN where a
    leave-one-out solve has no positive root) and ``se_r_eq, se_r_eq_heat``.
    """
    from normfast.core.equilibrium import equilibrium_norm

    first = loo["D" if "u" in branches else "D_w"]
    n, k = first.shape
    flat = {key: np.asarray(v, dtype=float).reshape(-1) for key, v in loo.items()}
    kap = np.repeat(np.asarray(kappa, dtype=float), k)
    zero = np.zeros(n * k)
    D = flat.get("D", zero)
    Q = flat.get("Q", zero)
    extra: dict[str, Any] = {}
    if "w" in branches:
        extra = dict(D_w=flat["D_w"], Q_w=flat["Q_w"], C_uw=flat.get("C_uw", zero))
    full = np.asarray(equilibrium_norm(D, Q, kap, **law, **extra), dtype=float).reshape(n, k)
    heat_extra = dict(extra, D_w=zero) if extra else {}
    heat = np.asarray(equilibrium_norm(zero, Q, kap, **law, **heat_extra), dtype=float).reshape(n, k)
    shifted = _level_shifted(level, kappa, law, branches) if level is not None and level[1] > 0 else None
    out = {}
    for name, centre, values in (("r_eq", r_eq, full), ("r_eq_heat", r_heat, heat)):
        se = jackknife_se(values)
        if shifted is not None:
            se = np.hypot(se, shifted[name])
        lo, hi = interval(centre, se, k - 1, lower=0.0)
        out[f"se_{name}"], out[f"{name}_lo"], out[f"{name}_hi"] = se, lo, hi
    return out


def _level_shifted(
    level: tuple[dict[str, np.ndarray], float], kappa: np.ndarray, law: dict[str, Any], branches: tuple[str, ...]
) -> dict[str, np.ndarray]:
    """Half the change of ``r_eq`` and ``r_eq_heat`` when every row's heat moves by ``e^{±σ}`` (the level)."""
    from normfast.core.equilibrium import equilibrium_norm

    stats, sigma = level
    kap = np.asarray(kappa, dtype=float)
    zero = np.zeros_like(kap)
    out: dict[str, np.ndarray] = {}
    for name, with_drift in (("r_eq", True), ("r_eq_heat", False)):
        ends = []
        for factor in (math.exp(sigma), math.exp(-sigma)):
            q = {sfx: np.asarray(stats["m2" + sfx]) + factor * np.asarray(stats["V2" + sfx]) for sfx in _sfx(branches)}
            d = {sfx: np.asarray(stats["D" + sfx]) if with_drift else zero for sfx in _sfx(branches)}
            extra = {}
            if "w" in branches:
                extra = dict(D_w=d["_w"], Q_w=q["_w"], C_uw=np.asarray(stats.get("C_uw", zero)))
            ends.append(
                np.asarray(equilibrium_norm(d.get("", zero), q.get("", zero), kap, **law, **extra), dtype=float)
            )
        out[name] = np.abs(ends[0] - ends[1]) / 2
    return out


def _sfx(branches: tuple[str, ...]) -> list[str]:
    return ["" if b == "u" else "_w" for b in branches]

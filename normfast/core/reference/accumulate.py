"""The probe statistics from their definitions: a float64 brute force that materializes every
displacement ``t_i^B`` (plain, per group, drift from groups) and the ``accumulate`` kernel's
reference (a plain Welford loop)."""

from __future__ import annotations

import numpy as np
import torch

# Codes of normfast.engine.estimators.statkeys.REASONS (kept literal here so this module imports
# nothing from the package it checks).
_OK, _ZERO_NORM, _NON_FINITE_EMBEDDING, _NON_FINITE_DISPLACEMENT = 0, 1, 2, 3


def _as(x, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x).to(dtype)


def nan_where_invalid(stats: dict, reason: torch.Tensor) -> dict:
    valid = reason == _OK
    out = {k: torch.where(valid, v, torch.full_like(v, float("nan"))) for k, v in stats.items()}
    out["valid"] = valid
    out["reason"] = reason
    return out


def embedding_codes(Z: torch.Tensor, bad_displacement: torch.Tensor) -> torch.Tensor:
    """Reason per row from the definitions; embedding problems come first."""
    norm = torch.linalg.vector_norm(Z.to(torch.float64), dim=1)
    reason = torch.full(norm.shape, _OK, dtype=torch.int8)
    reason[bad_displacement.cpu()] = _NON_FINITE_DISPLACEMENT
    reason[~torch.isfinite(Z).all(1).cpu()] = _NON_FINITE_EMBEDDING
    reason[(norm == 0).cpu()] = _ZERO_NORM
    return reason.to(Z.device)


def brute_force_stats(T, Z, branch: str = "u", T_w=None, *, dtype: torch.dtype = torch.float64) -> dict:
    """Every statistic straight from its definition, in float64.

    ``T`` ``[M, N, d]`` holds ALL displacements ``t_i^B`` at once (``T_w``
    likewise for branch "uw"), ``Z`` ``[N, d]`` the embeddings. ``u = R t``,
    ``w = t``; ``r^B = ẑ·x^B``; ``D = mean r``; ``se_D = std(r, ddof=1)/√M``;
    ``sign_stability = mean[sign(r^B) == sign(D)]``; ``m2 = |mean x|²``;
    ``V2 = Σ_B |x^B - x̄|²/(M-1)``; ``Q = m2 + V2``; ``C_uw = mean u·w``.
    Another ``dtype`` evaluates the same formulas in that precision (the
    plain-torch low-precision baseline of the tolerance rule).
    """
    if branch not in ("u", "w", "uw"):
        raise ValueError(f"brute_force_stats: unknown branch {branch!r}")
    T, Z = _as(T, dtype), _as(Z, dtype)
    m = T.shape[0]
    norm = torch.linalg.vector_norm(Z, dim=1)
    zhat = Z / norm[:, None]
    branches = []
    if branch in ("u", "uw"):
        branches.append(("", T * norm[None, :, None]))
    if branch == "w":
        branches.append(("_w", T))
    if branch == "uw":
        T_w = _as(T_w, dtype)
        branches.append(("_w", T_w))
    stats = {}
    bad = torch.zeros(Z.shape[0], dtype=torch.bool, device=Z.device)
    for suffix, X in branches:
        radial = (X * zhat[None]).sum(-1)
        drift = radial.mean(0)
        mean = X.mean(0)
        m2 = (mean * mean).sum(-1)
        v2 = ((X - mean[None]) ** 2).sum((0, 2)) / (m - 1)
        stats["D" + suffix] = drift
        stats["se_D" + suffix] = radial.std(0, correction=1) / np.sqrt(m)
        agree = torch.sign(radial) == torch.sign(drift)[None]
        stats["sign_stability" + suffix] = agree.to(dtype).mean(0)
        stats["m2" + suffix] = m2
        stats["V2" + suffix] = v2
        stats["Q" + suffix] = m2 + v2
    raw = [T] + ([T_w] if branch == "uw" else [])
    for X in raw:
        bad |= ~torch.isfinite(X).all(-1).all(0)
    if branch == "uw":
        stats["C_uw"] = (branches[0][1] * branches[1][1]).sum(-1).mean(0)
    out = nan_where_invalid(stats, embedding_codes(Z, bad))
    out["M"] = m
    return out


def brute_force_drift(T, Z, groups: int, branch: str = "u", *, dtype: torch.dtype = torch.float64) -> dict:
    """The drift from the mean direction, straight from its definition, in float64.

    ``T`` ``[M_D, N, d]`` holds EVERY displacement ``t_i^B`` of the drift's
    ``M_D`` batches, ``Z`` ``[N, d]`` the embeddings; batch ``B`` belongs to
    group ``B mod groups``. With ``x = R t`` ("u") or ``t`` ("w"), the group
    means ``x̄_g`` and their counts ``n_g``: ``D_g = ẑ·x̄_g``, ``D = ẑ·mean_B x``,
    ``m2 = |mean_B x|²``, ``se_D = sqrt(Σ_g n_g (D_g − D)² / ((K−1) M_D))``,
    ``sign_stability = mean_g [sign(D_g) == sign(D)]``. Keys carry ``_w`` for
    the w branch.
    """
    if branch not in ("u", "w"):
        raise ValueError(f"brute_force_drift: unknown branch {branch!r}")
    T, Z = _as(T, dtype), _as(Z, dtype)
    m = T.shape[0]
    norm = torch.linalg.vector_norm(Z, dim=1)
    zhat = Z / norm[:, None]
    X = T * norm[None, :, None] if branch == "u" else T
    ids = torch.arange(m) % groups
    counts = torch.stack([(ids == g).sum() for g in range(groups)]).to(dtype)
    means = torch.stack([X[ids == g].mean(0) for g in range(groups)])  # [K, N, d]
    mean = X.mean(0)
    drift = (mean * zhat).sum(1)
    group = (means * zhat[None]).sum(2)  # [K, N]
    se = torch.sqrt(((group - drift[None]) ** 2 * counts[:, None]).sum(0) / ((groups - 1) * m))
    agree = (torch.sign(group) == torch.sign(drift)[None]).to(dtype).mean(0)
    sfx = "" if branch == "u" else "_w"
    stats = {"D" + sfx: drift, "se_D" + sfx: se, "sign_stability" + sfx: agree, "m2" + sfx: (mean * mean).sum(1)}
    out = nan_where_invalid(stats, embedding_codes(Z, ~torch.isfinite(T).all(-1).all(0)))
    out["M"] = m
    return out


def brute_force_grouped(
    T, Z, groups: int, branch: str = "u", T_drift=None, *, dtype: torch.dtype = torch.float64
) -> dict:
    """The grouped estimators (error bars), straight from their definitions, in float64.

    ``T`` ``[M, N, d]`` every heat displacement, ``T_drift`` ``[M_D, N, d]``
    every drift displacement (None: the heat's); batch ``b`` of either set
    is in group ``b mod K``. ``x = R t`` ("u") or ``t`` ("w"). ``D``, ``m2``
    from the drift set's mean, ``V2`` from the heat set, ``Q = m2 + V2``;
    ``se_D``, ``sign_stability`` from the group drifts (as
    :func:`brute_force_drift`); for each group ``g`` the statistics
    recomputed without the batches of group ``g`` in both sets
    (``loo``: ``D, m2, V2, Q`` → ``[N, K]``) and
    ``se_θ = sqrt((K−1)/K Σ_g (θ_−g − mean θ_−g)²)`` for ``V2`` and ``Q``.
    """
    T = _as(T, dtype)
    Z = _as(Z, dtype)
    X_drift = T if T_drift is None else _as(T_drift, dtype)
    sfx = "" if branch == "u" else "_w"
    drift = brute_force_drift(X_drift, Z, groups, branch, dtype=dtype)
    heat = brute_force_stats(T, Z, branch, dtype=dtype)
    norm = torch.linalg.vector_norm(Z, dim=1)
    zhat = Z / norm[:, None]
    scale = norm if branch == "u" else torch.ones_like(norm)
    ids, ids_d = torch.arange(T.shape[0]) % groups, torch.arange(X_drift.shape[0]) % groups
    loo = {k: [] for k in ("D", "m2", "V2", "Q")}
    for g in range(groups):
        h = T[ids != g] * scale[None, :, None]
        dd = X_drift[ids_d != g] * scale[None, :, None]
        mean_h, mean_d = h.mean(0), dd.mean(0)
        v2 = (
            ((h - mean_h[None]) ** 2).sum((0, 2)) / (h.shape[0] - 1)
            if h.shape[0] >= 2
            else torch.full_like(norm, float("nan"))
        )
        m2 = (mean_d**2).sum(1)
        loo["D"].append((mean_d * zhat).sum(1))
        loo["m2"].append(m2)
        loo["V2"].append(v2)
        loo["Q"].append(m2 + v2)
    loo = {k: torch.stack(v, 1) for k, v in loo.items()}

    def jack(values):
        dev = values - values.mean(1, keepdim=True)
        return torch.sqrt((dev**2).sum(1) * (groups - 1) / groups)

    stats = {
        "D" + sfx: drift["D" + sfx],
        "se_D" + sfx: drift["se_D" + sfx],
        "sign_stability" + sfx: drift["sign_stability" + sfx],
        "m2" + sfx: drift["m2" + sfx],
        "V2" + sfx: heat["V2" + sfx],
        "Q" + sfx: drift["m2" + sfx] + heat["V2" + sfx],
        "se_V2" + sfx: jack(loo["V2"]),
        "se_Q" + sfx: jack(loo["Q"]),
    }
    bad = ~torch.isfinite(T).all(-1).all(0) | ~torch.isfinite(X_drift).all(-1).all(0)
    out = nan_where_invalid(stats, embedding_codes(Z, bad))
    out["loo"] = {k + sfx: torch.where(out["valid"][:, None], v, float("nan")) for k, v in loo.items()}
    out["M"] = T.shape[0]
    return out


def accumulate_reference(state: dict, t, z, *, branch: str = "u", t_w=None) -> dict:
    """Reference for the ``accumulate`` kernel: a plain Welford loop, one direction at a time.

    ``state`` uses the layout of ``ProbeAccumulator.state_dict()``; a new
    dict is returned (computed in the state's float dtype). ``t`` is
    ``[K, N, d]``; branch scaling and reason codes as in the kernel.
    """
    new = {k: v.clone() for k, v in state.items()}
    dtype = next(v.dtype for k, v in state.items() if k.startswith("mean"))
    z = torch.as_tensor(z).to(dtype)
    norm = torch.linalg.vector_norm(z, dim=1)
    zhat = z / norm[:, None]
    suffixes = {"u": ["_u"], "w": ["_w"], "uw": ["_u", "_w"]}[branch]
    sources = [torch.as_tensor(t)] + ([torch.as_tensor(t_w)] if branch == "uw" else [])
    n = int(new["n"])
    bad = torch.zeros(z.shape[0], dtype=torch.bool, device=z.device)
    for k in range(sources[0].shape[0]):
        n += 1
        xs = []
        for suffix, src in zip(suffixes, sources):
            x = src[k].to(dtype)
            if suffix == "_u":
                x = x * norm[:, None]
            xs.append(x)
            delta = x - new["mean" + suffix]
            new["mean" + suffix] = new["mean" + suffix] + delta / n
            new["M2" + suffix] = new["M2" + suffix] + (delta * (x - new["mean" + suffix])).sum(1)
            r = (x * zhat).sum(1)
            rdelta = r - new["rmean" + suffix]
            new["rmean" + suffix] = new["rmean" + suffix] + rdelta / n
            new["rM2" + suffix] = new["rM2" + suffix] + rdelta * (r - new["rmean" + suffix])
            new["npos" + suffix] = new["npos" + suffix] + (r > 0).to(torch.int64)
            new["nneg" + suffix] = new["nneg" + suffix] + (r < 0).to(torch.int64)
            bad |= ~torch.isfinite(src[k]).all(1)
        if branch == "uw":
            new["cross"] = new["cross"] + ((xs[0] * xs[1]).sum(1) - new["cross"]) / n
    new["n"] = torch.tensor(n, dtype=torch.int64)
    if sources[0].shape[0] > 0:
        code = embedding_codes(z, bad)
        new["reason"] = torch.where(new["reason"] != 0, new["reason"], code)
    return new

"""Plain reference implementations that the fast paths are tested against.

Two parts, kept apart:

1. the equilibrium quartic: a pure-numpy batched solver (companion-matrix
   eigenvalues + Newton polishing) that ``normfast.core._quartic`` must match;
2. the probe statistics: plain-torch references for every Triton kernel and a
   float64 brute force that materializes every displacement ``t_i^B``.
"""
from __future__ import annotations

import numpy as np
import torch

# ============================================================================
# 1. Equilibrium quartic
# ============================================================================
#
# An independent check of normfast.core._quartic: companion-matrix eigenvalues
# (LAPACK through np.linalg.eigvals) instead of derivative-bracketed iteration.
# Same contract: rows (a, b, c, d, e), largest positive real root (NaN where
# none) and the number of distinct positive roots.

#: An eigenvalue counts as real when |Im| <= REF_IMAG_RTOL * |lambda|. Double
#: roots come out of the eigensolver split by about sqrt(eps) ~ 1e-8.
REF_IMAG_RTOL = 1e-6
#: Positive roots closer than this (relative) count once.
REF_MERGE_RTOL = 1e-6
#: Newton steps applied to every real candidate (each kept only if it lowers |p|).
REF_NEWTON_STEPS = 4
#: A polished candidate is a root only if |p(y)| <= REF_RESIDUAL_RTOL * sum_i |c_i| y^i. Eigenvalues
#: of a companion matrix whose coefficients span many decades carry absolute errors of about
#: eps * (largest root): a small complex pair can come out real, and then this test rejects it
#: (true roots, double ones included, polish to residuals near eps).
REF_RESIDUAL_RTOL = 1e-9


def _monic_scaled(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rescale rows (descending, leading coefficient nonzero) by R = 2^k y.

    Returns monic coefficients ``[n, deg]`` (the leading 1 dropped) with every
    root of modulus below 2, and ``k``. Powers of two only, so the substitution
    itself is exact; coefficients spanning 1e-200..1e200 stay finite.
    """
    deg = rows.shape[1] - 1
    mant, expo = np.frexp(rows)  # rows = mant * 2**expo, |mant| in [0.5, 1)
    lead_m, lead_e = mant[:, :1], expo[:, :1]
    dist = np.arange(1, deg + 1)
    with np.errstate(invalid="ignore"):
        k_i = np.ceil((expo[:, 1:] - lead_e + 1) / dist)
    k_i = np.where(rows[:, 1:] != 0, k_i, -np.inf)
    k_max = k_i.max(axis=1) if deg else np.zeros(len(rows))
    k = np.where(np.isfinite(k_max), k_max, 0).astype(np.int64)  # a_n R^n alone: any scale
    shift = -(dist[None, :] * k[:, None]) - lead_e
    monic = np.ldexp(rows[:, 1:], shift.astype(np.int32)) / lead_m
    return monic, k


def _horner(monic: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Value and derivative of y^deg + sum monic[:, i] y^(deg-1-i) at y ``[n, m]``."""
    f = np.ones_like(y)
    df = np.zeros_like(y)
    for i in range(monic.shape[1]):
        df = df * y + f
        f = f * y + monic[:, i : i + 1]
    return f, df


def _largest_positive(monic: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n, deg = monic.shape
    companion = np.zeros((n, deg, deg))
    companion[:, 0, :] = -monic
    companion[:, np.arange(1, deg), np.arange(deg - 1)] = 1.0
    eig = np.linalg.eigvals(companion)
    real = (np.abs(eig.imag) <= REF_IMAG_RTOL * np.abs(eig)) & (eig.real > 0)
    y = np.where(real, eig.real, np.nan)
    f, df = _horner(monic, y)
    for _ in range(REF_NEWTON_STEPS):
        with np.errstate(divide="ignore", invalid="ignore"):
            y_new = y - f / df
        f_new, df_new = _horner(monic, y_new)
        better = np.abs(f_new) < np.abs(f)  # a step is kept only if it lowers |p|
        y = np.where(better, y_new, y)
        f = np.where(better, f_new, f)
        df = np.where(better, df_new, df)
    with np.errstate(invalid="ignore", over="ignore"):
        magnitude = np.ones_like(y)
        for i in range(monic.shape[1]):
            magnitude = magnitude * np.abs(y) + np.abs(monic[:, i : i + 1])
        y = np.where(np.abs(f) <= REF_RESIDUAL_RTOL * magnitude, y, np.nan)
    y = np.sort(y, axis=1)  # NaN last
    valid = np.isfinite(y) & (y > 0)
    distinct = valid.copy()
    distinct[:, 1:] &= ~(valid[:, :-1] & (y[:, 1:] - y[:, :-1] <= REF_MERGE_RTOL * y[:, 1:]))
    count = distinct.sum(axis=1).astype(np.int8)
    largest = np.where(valid, y, -np.inf).max(axis=1)
    return np.where(count > 0, largest, np.nan), count


def solve_quartic_reference(coeffs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Plain-numpy reference for :func:`normfast.solve_quartic`.

    Rows ``(a, b, c, d, e)`` of ``a R^4 + b R^3 + c R^2 + d R + e = 0``. Per
    degree (leading zeros lower it), a companion-matrix eigenvalue problem on
    the power-of-two rescaled monic polynomial; real positive eigenvalues are
    polished by Newton steps on that polynomial. Returns ``(roots float64[N],
    n_positive int8[N])`` with the same conventions as the C++ solver (NaN and
    0 for rows with no positive root, all-zero rows or non-finite rows) except
    the merging rule: roots within ``REF_MERGE_RTOL`` count once.
    """
    c = np.asarray(coeffs, dtype=np.float64)
    if c.ndim != 2 or c.shape[1] != 5:
        raise ValueError("solve_quartic_reference: expected coeffs of shape [N, 5], "
                         f"got coeffs.shape={c.shape}")
    n = len(c)
    roots = np.full(n, np.nan)
    count = np.zeros(n, np.int8)
    usable = np.isfinite(c).all(axis=1)
    nonzero = c != 0
    first = np.where(nonzero.any(axis=1), nonzero.argmax(axis=1), 5)
    degree = 4 - first
    for deg in range(1, 5):
        idx = np.flatnonzero(usable & (degree == deg))
        if len(idx) == 0:
            continue
        monic, k = _monic_scaled(c[idx, 4 - deg :])
        y, m = _largest_positive(monic)
        roots[idx] = np.ldexp(y, k.astype(np.int32))
        count[idx] = m
    return roots, count


# ============================================================================
# 2. Probe statistics (kernel references, float64 brute force, tolerances)
# ============================================================================
#
# Codes of normfast.engine.ops.REASONS (kept literal here so this module imports
# nothing from the package it checks).
_OK, _ZERO_NORM, _NON_FINITE_EMBEDDING, _NON_FINITE_DISPLACEMENT = 0, 1, 2, 3

#: Allowed error of a fast path against the float64 brute force, by the
#: dtype of the inputs. Errors are scale-relative (see :func:`stat_errors`).
#: float32/float64: ``rtol``. float16/bfloat16 follow the flash-attention
#: rule: ``error <= factor * (error of the plain-torch reference run in that
#: dtype) + atol``.
TOLERANCES: dict[torch.dtype, dict[str, float | None]] = {
    torch.float64: {"rtol": 1e-10, "factor": None, "atol": 0.0},
    torch.float32: {"rtol": 1e-5, "factor": None, "atol": 0.0},
    torch.float16: {"rtol": None, "factor": 2.0, "atol": 1e-3},
    torch.bfloat16: {"rtol": None, "factor": 2.0, "atol": 8e-3},
}


def allowed_error(dtype: torch.dtype, plain_error: float | None = None) -> float:
    """Tolerance from :data:`TOLERANCES`; low precision needs the plain-torch error."""
    tol = TOLERANCES[dtype]
    if tol["factor"] is None:
        return float(tol["rtol"])
    if plain_error is None:
        raise ValueError(f"allowed_error: {dtype} needs the plain-torch error of the same "
                         f"computation")
    return float(tol["factor"]) * float(plain_error) + float(tol["atol"])


def _as(x, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x).to(dtype)


def _nan_where_invalid(stats: dict, reason: torch.Tensor) -> dict:
    valid = reason == _OK
    out = {k: torch.where(valid, v, torch.full_like(v, float("nan"))) for k, v in stats.items()}
    out["valid"] = valid
    out["reason"] = reason
    return out


def _embedding_codes(Z: torch.Tensor, bad_displacement: torch.Tensor) -> torch.Tensor:
    """Reason per row from the definitions; embedding problems come first."""
    norm = torch.linalg.vector_norm(Z.to(torch.float64), dim=1)
    reason = torch.full(norm.shape, _OK, dtype=torch.int8)
    reason[bad_displacement.cpu()] = _NON_FINITE_DISPLACEMENT
    reason[~torch.isfinite(Z).all(1).cpu()] = _NON_FINITE_EMBEDDING
    reason[(norm == 0).cpu()] = _ZERO_NORM
    return reason.to(Z.device)


def brute_force_stats(T, Z, branch: str = "u", T_w=None, *,
                      dtype: torch.dtype = torch.float64) -> dict:
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
    out = _nan_where_invalid(stats, _embedding_codes(Z, bad))
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
    means = torch.stack([X[ids == g].mean(0) for g in range(groups)])      # [K, N, d]
    mean = X.mean(0)
    drift = (mean * zhat).sum(1)
    group = (means * zhat[None]).sum(2)                                   # [K, N]
    se = torch.sqrt(((group - drift[None]) ** 2 * counts[:, None]).sum(0) / ((groups - 1) * m))
    agree = (torch.sign(group) == torch.sign(drift)[None]).to(dtype).mean(0)
    sfx = "" if branch == "u" else "_w"
    stats = {"D" + sfx: drift, "se_D" + sfx: se, "sign_stability" + sfx: agree,
             "m2" + sfx: (mean * mean).sum(1)}
    out = _nan_where_invalid(stats, _embedding_codes(Z, ~torch.isfinite(T).all(-1).all(0)))
    out["M"] = m
    return out


def brute_force_grouped(T, Z, groups: int, branch: str = "u", T_drift=None, *,
                        dtype: torch.dtype = torch.float64) -> dict:
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
        v2 = ((h - mean_h[None]) ** 2).sum((0, 2)) / (h.shape[0] - 1) if h.shape[0] >= 2 else \
            torch.full_like(norm, float("nan"))
        m2 = (mean_d ** 2).sum(1)
        loo["D"].append((mean_d * zhat).sum(1))
        loo["m2"].append(m2)
        loo["V2"].append(v2)
        loo["Q"].append(m2 + v2)
    loo = {k: torch.stack(v, 1) for k, v in loo.items()}

    def jack(values):
        dev = values - values.mean(1, keepdim=True)
        return torch.sqrt((dev ** 2).sum(1) * (groups - 1) / groups)

    stats = {"D" + sfx: drift["D" + sfx], "se_D" + sfx: drift["se_D" + sfx],
             "sign_stability" + sfx: drift["sign_stability" + sfx], "m2" + sfx: drift["m2" + sfx],
             "V2" + sfx: heat["V2" + sfx], "Q" + sfx: drift["m2" + sfx] + heat["V2" + sfx],
             "se_V2" + sfx: jack(loo["V2"]), "se_Q" + sfx: jack(loo["Q"])}
    bad = ~torch.isfinite(T).all(-1).all(0) | ~torch.isfinite(X_drift).all(-1).all(0)
    out = _nan_where_invalid(stats, _embedding_codes(Z, bad))
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
        code = _embedding_codes(z, bad)
        new["reason"] = torch.where(new["reason"] != 0, new["reason"], code)
    return new


def _augment(A, G, g_bias):
    if g_bias is None:
        return A, G
    ones = torch.ones(A.shape[0], 1, dtype=A.dtype, device=A.device)
    return torch.cat([A, ones], 1), torch.cat([G, g_bias[:, :, None].to(G.dtype)], 2)


def _head_common(A, Z, G, g_bias, branch):
    if branch not in ("u", "w"):
        raise ValueError(f"head reference: unknown branch {branch!r}")
    A, Z, G = torch.as_tensor(A), torch.as_tensor(Z), torch.as_tensor(G)
    g_bias = None if g_bias is None else torch.as_tensor(g_bias)
    At, Gt = _augment(A, G, g_bias)
    g_bar = Gt.mean(0)
    g_c = Gt - g_bar[None]
    norm = torch.linalg.vector_norm(Z, dim=1)
    zhat = Z / norm[:, None]
    scale = norm if branch == "u" else torch.ones_like(norm)
    v = At @ g_bar.T
    drift = -scale * (zhat * v).sum(1)
    m2 = scale ** 2 * (v * v).sum(1)
    bad = ~torch.isfinite(A).all(1) | (~torch.isfinite(Gt).all()).expand(A.shape[0])
    return At, g_c, zhat, scale, drift, m2, bad


def head_stats_reference(A, Z, G, g_bias=None, *, branch: str = "u") -> dict:
    """Reference for the ``head_stats`` kernel (S form), in the inputs' dtype.

    ``ã = [a, 1]``, ``G̃_B = [G_B | g_B]``, ``Ḡ = mean G̃_B``,
    ``S_c = Σ_B (G̃_B - Ḡ)ᵀ(G̃_B - Ḡ)/(M-1)``, ``s = R`` ("u") or 1 ("w"):
    ``D = -s ẑ·Ḡã``, ``m2 = s²|Ḡã|²``, ``V2 = s² ãᵀS_cã``, ``Q = m2 + V2``.
    """
    At, g_c, zhat, scale, drift, m2, bad = _head_common(A, Z, G, g_bias, branch)
    m = g_c.shape[0]
    s_c = torch.einsum("bji,bjk->ik", g_c, g_c) / (m - 1)
    v2 = scale ** 2 * ((At @ s_c) * At).sum(1)
    suffix = "" if branch == "u" else "_w"
    stats = {"D" + suffix: drift, "m2" + suffix: m2, "V2" + suffix: v2, "Q" + suffix: m2 + v2}
    out = _nan_where_invalid(stats, _embedding_codes(torch.as_tensor(Z), bad))
    out["M"] = m
    return out


def project_reference(A, Z, G, g_bias=None, *, branch: str = "u") -> dict:
    """Reference for the ``project`` kernel (per-batch form), in the inputs' dtype.

    As :func:`head_stats_reference`, but ``V2 = s² Σ_B |G̃^c_B ã|²/(M-1)``
    and the radial dots ``r^B = D - s ẑ·(G̃^c_B ã)`` give
    ``se_D = std(r, ddof=1)/√M`` and ``sign_stability``; one batch at a time.
    """
    At, g_c, zhat, scale, drift, m2, bad = _head_common(A, Z, G, g_bias, branch)
    m = g_c.shape[0]
    radial, spread = [], torch.zeros_like(drift)
    for b in range(m):
        y = At @ g_c[b].T
        radial.append(drift - scale * (zhat * y).sum(1))
        spread = spread + (y * y).sum(1)
    radial = torch.stack(radial)
    suffix = "" if branch == "u" else "_w"
    v2 = scale ** 2 * spread / (m - 1)
    agree = torch.sign(radial) == torch.sign(drift)[None]
    stats = {
        "D" + suffix: drift,
        "se_D" + suffix: radial.std(0, correction=1) / np.sqrt(m),
        "sign_stability" + suffix: agree.to(drift.dtype).mean(0),
        "m2" + suffix: m2,
        "V2" + suffix: v2,
        "Q" + suffix: m2 + v2,
    }
    out = _nan_where_invalid(stats, _embedding_codes(torch.as_tensor(Z), bad))
    out["M"] = m
    return out


def head_stack_reference(A, Z, G, S, *, has_bias: bool = False) -> dict:
    """Reference for the stacked head products (the primitive of the grouped head statistics).

    ``A`` ``[N, d_in]`` probe activations, ``Z`` ``[N, d_out]`` embeddings,
    ``G`` ``[K1, d_out, da]`` a stack of direction matrices (means: overall,
    per group, ...), ``S`` ``[K2, da, da]`` a stack of symmetric second-moment
    matrices, ``da = d_in + 1`` when ``has_bias`` (the last column of ``G`` and
    the last row/column of ``S`` act on the constant 1 of ``ã = [a, 1]``),
    else ``da = d_in`` and ``ã = a``. Per row ``i`` and stack entry ``k``:

    * ``zdot[i, k] = z_i · (G_k ã_i)``  -- ``[N, K1]``
    * ``sq[i, k]   = |G_k ã_i|²``       -- ``[N, K1]``
    * ``quad[i, k] = ã_iᵀ S_k ã_i``     -- ``[N, K2]``
    * ``norm[i]    = |z_i|``            -- ``[N]``

    Every estimator of the grouped head mode (drift, its group spread, m2,
    heat and its group spread) is an O(N K) epilogue over these; the kernel
    and the torch path compute exactly these products. Computed here one
    matrix at a time in the inputs' dtype (float64 for a reference).
    """
    A, Z, G, S = (torch.as_tensor(x) for x in (A, Z, G, S))
    if has_bias:
        A = torch.cat([A, torch.ones(A.shape[0], 1, dtype=A.dtype, device=A.device)], 1)
    if G.shape[-1] != A.shape[1] or S.shape[-1] != A.shape[1] or S.shape[-2] != A.shape[1]:
        raise ValueError(f"head_stack_reference: expected G [K1, d_out, {A.shape[1]}] and "
                         f"S [K2, {A.shape[1]}, {A.shape[1]}], got G.shape={tuple(G.shape)}, "
                         f"S.shape={tuple(S.shape)}")
    zdot, sq, quad = [], [], []
    for g in G:
        v = A @ g.T
        zdot.append((Z * v).sum(1))
        sq.append((v * v).sum(1))
    for s in S:
        quad.append(((A @ s) * A).sum(1))
    def stacked(columns):  # an empty stack gives [N, 0]
        return torch.stack(columns, 1) if columns else A.new_zeros((A.shape[0], 0))

    return {"zdot": stacked(zdot), "sq": stacked(sq), "quad": stacked(quad),
            "norm": torch.linalg.vector_norm(Z, dim=1)}


def head_stack_errors(got, want: dict, A, Z, G, S, *, has_bias: bool = False) -> dict[str, float]:
    """Max error of each stacked product relative to its natural size, over all rows.

    ``got`` is ``(zdot, sq, quad, norm)`` (or a dict of them), ``want`` the
    truth (e.g. :func:`head_stack_reference` in float64). The size of each
    entry is the same product with absolute values, ``|z|·(|G_k||ã|)``,
    ``|(|G_k||ã|)|²``, ``|ã|ᵀ|S_k||ã|`` and ``|z|``: it bounds the rounding
    error of any summation order, so the ratio is comparable to the
    tolerances of :data:`TOLERANCES`. A shape mismatch or a NaN where the
    truth is finite counts as ``inf``.
    """
    keys = ("zdot", "sq", "quad", "norm")
    got = got if isinstance(got, dict) else dict(zip(keys, got))
    A, Z, G, S = (torch.as_tensor(x).detach().cpu().to(torch.float64) for x in (A, Z, G, S))
    if has_bias:
        A = torch.cat([A, torch.ones(A.shape[0], 1, dtype=A.dtype)], 1)
    v_abs = torch.einsum("kjd,nd->nkj", G.abs(), A.abs())
    scale = {"zdot": torch.einsum("nj,nkj->nk", Z.abs(), v_abs), "sq": v_abs.square().sum(-1),
             "quad": torch.einsum("nd,kde,ne->nk", A.abs(), S.abs(), A.abs()),
             "norm": torch.linalg.vector_norm(Z, dim=1)}
    errors = {}
    for key in keys:
        g = torch.as_tensor(got[key]).detach().cpu().to(torch.float64)
        w = torch.as_tensor(want[key]).detach().cpu().to(torch.float64).reshape(scale[key].shape)
        if tuple(g.shape) != tuple(w.shape):
            errors[key] = float("inf")
        elif w.numel() == 0:
            errors[key] = 0.0
        else:
            diff = (g - w).abs().nan_to_num(nan=float("inf"))
            errors[key] = float((diff / scale[key].clamp_min(torch.finfo(torch.float64).tiny)).max())
    return errors


def _scale_of(key: str, want: dict) -> torch.Tensor:
    """Natural size of a statistic: |D|, se_D <= sqrt(Q); m2, V2, se_V2, se_Q <= Q; |C_uw| <= sqrt(Q Q_w)."""
    suffix = "_w" if key.endswith("_w") else ""
    q = want["Q" + suffix].to(torch.float64).abs()
    if key == "C_uw":
        return torch.sqrt(want["Q"].to(torch.float64).abs() * want["Q_w"].to(torch.float64).abs())
    if key.startswith(("D", "se_D")):
        return torch.sqrt(q)
    return q


def stat_errors(got: dict, want: dict, keys=None) -> dict[str, float]:
    """Scale-relative max error per statistic over the rows ``want`` marks valid.

    ``|got - want| / scale`` with the scales of :func:`_scale_of`. Returns
    ``inf`` for a key whose NaN pattern differs (a valid row that came out
    NaN, or an invalid one that did not). ``sign_stability`` is reported as
    the fraction of valid rows that differ at all (a radial dot within
    rounding of zero may flip sign), ``sign_stability_batches`` as the
    largest difference in batches (``M`` times the fraction).
    """
    valid = want["valid"].cpu()
    if keys is None:
        keys = [k for k in want if k not in ("valid", "reason", "M", "loo", "groups") and k in got]
    errors = {}
    for key in keys:
        g = torch.as_tensor(got[key]).detach().cpu().to(torch.float64)
        w = torch.as_tensor(want[key]).detach().cpu().to(torch.float64)
        if not torch.equal(torch.isnan(g), torch.isnan(w)) or not torch.isnan(w[~valid]).all():
            errors[key] = float("inf")
            continue
        if valid.sum() == 0:
            errors[key] = 0.0
            continue
        diff = (g - w).abs()[valid]
        if key.startswith("sign_stability"):
            errors[key] = float((diff > 0.5 / int(want["M"])).to(torch.float64).mean())
            batches = key.replace("sign_stability", "sign_stability_batches")
            errors[batches] = float(diff.max() * int(want["M"]))
            continue
        tensors = {k: torch.as_tensor(v).cpu() for k, v in want.items() if k not in ("M", "loo", "groups")}
        scale = _scale_of(key, tensors)[valid]
        errors[key] = float((diff / scale.clamp_min(torch.finfo(torch.float64).tiny)).max())
    return errors

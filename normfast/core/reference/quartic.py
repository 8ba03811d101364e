"""The float64 reference of the equilibrium quartic's solver.

An independent check of normfast.core._quartic: companion-matrix eigenvalues
(LAPACK through np.linalg.eigvals) instead of derivative-bracketed iteration.
Same contract: rows (a, b, c, d, e), largest positive real root (NaN where
none) and the number of distinct positive roots.
"""

from __future__ import annotations

import numpy as np

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
        raise ValueError(f"solve_quartic_reference: expected coeffs of shape [N, 5], got coeffs.shape={c.shape}")
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

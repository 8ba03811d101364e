"""The equilibrium law (DESIGN section 1): coefficients, limits, closed forms, validation."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import normfast
from normfast.core.equilibrium import equilibrium_coefficients, equilibrium_norm, solve_quartic

mpmath = pytest.importorskip("mpmath")
mp, mpf = mpmath.mp, mpmath.mpf

LR, WD = 0.05, 5e-4


@pytest.fixture
def stats(rng):
    n = 1000
    return {
        "D": rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 1, n),
        "Q": 10.0 ** rng.uniform(-3, 3, n),
        "kappa": rng.uniform(0.5, 4.0, n),
    }


def sgd_exact(D, Q, kappa, lr, wd):
    """R_eq from the pure-SGD closed form, at 50 digits (no cancellation question)."""
    out = []
    with mp.workdps(50):
        for d, q, k in zip(D, Q, kappa):
            d, q, k = mpf(float(d)), mpf(float(q)), mpf(float(k))
            r2 = (d + mpmath.sqrt(d * d + 2 * mpf(wd) * k * mpf(lr) * q)) / (2 * mpf(wd) * k)
            out.append(mpmath.sqrt(r2))
    return out


def max_rel(values, exact) -> float:
    return max(float(abs(mpf(float(v)) - e) / e) for v, e in zip(values, exact))


def test_coefficients_follow_the_law(rng):
    n = 7
    D, Q, kap, D_w, Q_w, C = (rng.standard_normal(n) for _ in range(6))
    Q, Q_w = np.abs(Q), np.abs(Q_w)
    coeffs = equilibrium_coefficients(D, Q, np.abs(kap), lr=LR, weight_decay=WD, D_w=D_w, Q_w=Q_w, C_uw=C)
    expected = np.stack([2 * WD * np.abs(kap), -2 * D_w, -(2 * D + LR * Q_w), -2 * LR * C, -LR * Q], axis=1)
    np.testing.assert_allclose(coeffs, expected, rtol=1e-15)
    assert coeffs.shape == (n, 5) and coeffs.dtype == np.float64


def test_sgd_closed_form(stats):
    r = equilibrium_norm(stats["D"], stats["Q"], stats["kappa"], lr=LR, weight_decay=WD)
    assert max_rel(r, sgd_exact(stats["D"], stats["Q"], stats["kappa"], LR, WD)) <= 1e-14


def test_heat_only_limit_is_the_classic_weight_norm_equilibrium(stats):
    # D = 0: R^4 = eta Q / (2 lambda kappa)
    r = equilibrium_norm(0.0, stats["Q"], stats["kappa"], lr=LR, weight_decay=WD)
    np.testing.assert_allclose(r, (LR * stats["Q"] / (2 * WD * stats["kappa"])) ** 0.25, rtol=1e-15)


def test_drift_only_limit(stats):
    # Q -> 0 with D > 0: R^2 = D / (lambda kappa)
    D = np.abs(stats["D"]) + 1e-3
    expected = np.sqrt(D / (WD * stats["kappa"]))
    np.testing.assert_allclose(equilibrium_norm(D, 0.0, stats["kappa"], lr=LR, weight_decay=WD), expected, rtol=1e-15)
    r = equilibrium_norm(D, 1e-6 * D, stats["kappa"], lr=LR, weight_decay=WD)
    np.testing.assert_allclose(r, expected, rtol=1e-7)
    assert np.all(r > expected)  # heat only ever pushes the norm out


def test_inward_drift_dominating_heat_needs_the_cancellation_free_form():
    # D < 0 with |D| >> V: R^2 = eta Q / (sqrt(D^2 + 2 lambda kappa eta Q) - D)
    D, Q, kappa = np.array([-1e6, -3e4, -1.0]), np.array([1e-6, 2e-5, 1e-9]), np.array([1.0, 2.0, 0.5])
    r = equilibrium_norm(D, Q, kappa, lr=LR, weight_decay=WD)
    stable = np.sqrt(LR * Q / (np.sqrt(D**2 + 2 * WD * kappa * LR * Q) - D))
    exact = sgd_exact(D, Q, kappa, LR, WD)
    assert max_rel(r, exact) <= 1e-14
    assert max_rel(stable, exact) <= 1e-14
    naive = np.sqrt((D + np.sqrt(D**2 + 2 * WD * kappa * LR * Q)) / (2 * WD * kappa))
    # the textbook form cancels: it loses (here: all) digits, so the test above can fail
    assert max_rel(naive, exact) > 1e-3


def test_pure_adamw_branch(rng):
    n = 200
    D_w, Q_w, kappa = rng.standard_normal(n), 10.0 ** rng.uniform(-3, 2, n), rng.uniform(0.5, 3, n)
    r, count = equilibrium_norm(None, None, kappa, lr=LR, weight_decay=WD, D_w=D_w, Q_w=Q_w, return_count=True)
    lam_k = WD * kappa
    with mp.workdps(50):
        exact = [
            (mpf(float(d)) + mpmath.sqrt(mpf(float(d)) ** 2 + 2 * mpf(float(lk)) * mpf(LR) * mpf(float(q))))
            / (2 * mpf(float(lk)))
            for d, q, lk in zip(D_w, Q_w, lam_k)
        ]
    assert max_rel(r, exact) <= 1e-13
    np.testing.assert_array_equal(count, 1)


def test_momentum_heuristic(stats):
    beta = 0.9
    coeffs = equilibrium_coefficients(
        stats["D"], stats["Q"], stats["kappa"], lr=LR, weight_decay=WD, Q_w=stats["Q"], C_uw=stats["D"], momentum=beta
    )
    plain = equilibrium_coefficients(
        stats["D"], stats["Q"], stats["kappa"], lr=LR / (1 - beta), weight_decay=WD, Q_w=stats["Q"], C_uw=stats["D"]
    )
    np.testing.assert_allclose(coeffs, plain, rtol=1e-15)
    base = equilibrium_coefficients(stats["D"], stats["Q"], stats["kappa"], lr=LR, weight_decay=WD)
    np.testing.assert_array_equal(coeffs[:, :2], base[:, :2])  # decay and drift carry no learning rate
    r_mom = equilibrium_norm(stats["D"], stats["Q"], stats["kappa"], lr=LR, weight_decay=WD, momentum=beta)
    r_plain = equilibrium_norm(stats["D"], stats["Q"], stats["kappa"], lr=LR / (1 - beta), weight_decay=WD)
    np.testing.assert_allclose(r_mom, r_plain, rtol=1e-15)
    # more effective heat, a larger norm
    assert np.all(r_mom > equilibrium_norm(stats["D"], stats["Q"], stats["kappa"], lr=LR, weight_decay=WD))


def test_bistable_mixed_branches():
    # choose three positive equilibria 1, 2, 3 and read off D_w, D, C_uw, Q for kappa = 1
    lam, eta = 0.5, 0.1
    a = 2 * lam
    _, b, c, d, e = a * np.poly([1.0, 2.0, 3.0, -4.0])
    D_w, D, C_uw, Q = -b / 2, -c / 2, -d / (2 * eta), -e / eta
    r, count = equilibrium_norm(D, Q, 1.0, lr=eta, weight_decay=lam, D_w=D_w, C_uw=C_uw, return_count=True)
    assert count[0] == 3
    assert abs(r[0] - 3.0) < 1e-13
    # stable from above: the polynomial (the outward pull minus the decay) is positive just above R_eq
    coeffs = equilibrium_coefficients(D, Q, 1.0, lr=eta, weight_decay=lam, D_w=D_w, C_uw=C_uw)[0]
    assert np.polyval(coeffs, 3.0 * (1 + 1e-6)) > 0 > np.polyval(coeffs, 3.0 * (1 - 1e-6))


def test_inputs_broadcast_and_accept_tensors(stats):
    r_np = equilibrium_norm(stats["D"], stats["Q"], stats["kappa"], lr=LR, weight_decay=WD)
    r_t = equilibrium_norm(
        torch.from_numpy(stats["D"]).float(),
        torch.from_numpy(stats["Q"]),
        torch.from_numpy(stats["kappa"]),
        lr=LR,
        weight_decay=WD,
    )
    np.testing.assert_allclose(r_t, r_np, rtol=1e-6)
    scalar_kappa = equilibrium_norm(stats["D"], stats["Q"], 2.0, lr=LR, weight_decay=WD)
    np.testing.assert_array_equal(
        scalar_kappa, equilibrium_norm(stats["D"], stats["Q"], np.full(len(stats["D"]), 2.0), lr=LR, weight_decay=WD)
    )
    one = equilibrium_norm(0.1, 2.0, 1.5, lr=LR, weight_decay=WD)
    assert one.shape == (1,) and np.isclose(one[0], float(sgd_exact([0.1], [2.0], [1.5], LR, WD)[0]), rtol=1e-14)
    assert equilibrium_norm(np.array([]), np.array([]), 1.0, lr=LR, weight_decay=WD).shape == (0,)


def test_non_finite_probe_rows_give_nan_not_an_error():
    r, count = equilibrium_norm(
        [0.1, np.nan, 0.1], [1.0, 1.0, 1.0], [1.0, 1.0, np.inf], lr=LR, weight_decay=WD, return_count=True
    )
    assert np.isfinite(r[0]) and np.isnan(r[1:]).all() and list(count) == [1, 0, 0]


def test_negative_heat_warns():
    with pytest.warns(RuntimeWarning, match="Q/Q_w are negative"):
        equilibrium_coefficients(0.0, [-1.0, 1.0], 1.0, lr=LR, weight_decay=WD)


def test_non_positive_kappa_warns_once_and_still_solves():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r, count = equilibrium_norm(
            [0.0, 0.0, 1.0], [1.0, 1.0, 1.0], [-1.0, -2.0, 1.0], lr=LR, weight_decay=WD, return_count=True
        )
    kappa_warnings = [w for w in caught if "kappa <= 0" in str(w.message)]
    assert len(kappa_warnings) == 1 and "2 probe(s)" in str(kappa_warnings[0].message)
    # -|a| R^4 - eta Q = 0 has no positive root: no equilibrium at all
    assert np.isnan(r[:2]).all() and list(count[:2]) == [0, 0] and np.isfinite(r[2])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=0.0), "lr > 0"),
        (dict(lr=-1e-3), "lr > 0"),
        (dict(lr=float("nan")), "lr to be finite"),
        (dict(weight_decay=0.0), "weight_decay > 0"),
        (dict(weight_decay=float("inf")), "weight_decay to be finite"),
        (dict(momentum=1.0), "momentum < 1"),
        (dict(momentum=-0.1), "momentum >= 0"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    law = dict(lr=LR, weight_decay=WD) | kwargs
    with pytest.raises(ValueError, match=match):
        equilibrium_norm([0.1], [1.0], [1.0], **law)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"do not broadcast: D.shape=\(3,\), Q.shape=\(4,\)"):
        equilibrium_coefficients(np.zeros(3), np.ones(4), 1.0, lr=LR, weight_decay=WD)
    with pytest.raises(ValueError, match=r"expected Q to be a scalar or 1-D per-probe array, got Q.shape=\(2, 2\)"):
        equilibrium_coefficients(0.0, np.ones((2, 2)), 1.0, lr=LR, weight_decay=WD)
    with pytest.raises(TypeError, match="D to be a real numeric array"):
        equilibrium_coefficients(["a", "b"], 1.0, 1.0, lr=LR, weight_decay=WD)
    with pytest.raises(TypeError, match="lr to be a real number"):
        equilibrium_coefficients(0.0, 1.0, 1.0, lr="fast", weight_decay=WD)
    with pytest.raises(ValueError, match="at least one of D, Q, D_w, Q_w"):
        equilibrium_coefficients(None, None, 1.0, lr=LR, weight_decay=WD)


def test_public_api():
    assert normfast.equilibrium_norm is equilibrium_norm
    assert normfast.equilibrium_coefficients is equilibrium_coefficients
    coeffs = equilibrium_coefficients(0.2, 3.0, 1.0, lr=LR, weight_decay=WD)
    r, _ = solve_quartic(coeffs)
    assert r[0] == equilibrium_norm(0.2, 3.0, 1.0, lr=LR, weight_decay=WD)[0]

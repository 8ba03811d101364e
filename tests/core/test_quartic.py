"""The batched quartic solver (normfast.core._quartic through normfast.solve_quartic).

Accuracy is measured against a 50-digit mpmath refinement of each known root
on the *rounded* float64 coefficients (so the test sees only the solver's
error, not the rounding of the polynomial), certified by a sign change.
"""

from __future__ import annotations

import threading
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import normfast
from normfast.core import _quartic
from normfast.core.equilibrium import TOUCH_FACTOR, solve_quartic
from normfast.core.reference import solve_quartic_reference

mpmath = pytest.importorskip("mpmath")
mp, mpf = mpmath.mp, mpmath.mpf

N_RANDOM = 10_000
RTOL_SIMPLE = 1e-12
RTOL_DOUBLE = 1e-7


# ---------------------------------------------------------------- helpers


def poly_from_roots(lead: float, real_roots, complex_roots) -> np.ndarray:
    """Descending float64 coefficients of lead * prod (R - r) * prod |R - z|^2 (degree <= 4, padded to 5)."""
    p = np.array([lead])
    for r in real_roots:
        p = np.convolve(p, [1.0, -r])
    for z in complex_roots:
        p = np.convolve(p, [1.0, -2.0 * z.real, abs(z) ** 2])
    return np.concatenate([np.zeros(5 - len(p)), p])


def random_quartic(rng: np.random.Generator, scale: float | None = None):
    """A quartic with 1-4 positive roots (pairwise ratio >= 1.3), the rest negative
    roots or complex pairs at least 17 degrees off the real axis."""
    n_pos = int(rng.integers(1, 5))
    n_pairs = int(rng.integers(0, (4 - n_pos) // 2 + 1))
    n_neg = 4 - n_pos - 2 * n_pairs
    if scale is None:
        scale = 10.0 ** rng.uniform(-4, 4)
    log_pos = rng.uniform(-2, 0) + np.cumsum(rng.uniform(np.log10(1.3), 1.2, n_pos))
    pos = scale * 10.0**log_pos
    neg = -scale * 10.0 ** rng.uniform(-2, 2, n_neg)
    pairs = [scale * 10.0 ** rng.uniform(-2, 2) * np.exp(1j * rng.uniform(0.3, np.pi - 0.3)) for _ in range(n_pairs)]
    lead = rng.choice([-1.0, 1.0]) * 10.0 ** rng.uniform(-3, 3)
    return poly_from_roots(lead, list(pos) + list(neg), pairs), pos


def mp_refine(row: np.ndarray, x0: float, dps: int = 50) -> "mpmath.mpf":
    """The root of the float64 polynomial `row` next to x0, to `dps` digits, certified by a sign change."""
    with mp.workdps(dps):
        c = [mpf(float(v)) for v in row]  # exact: every float64 is an mpf

        def p(x):
            f, df = mpf(0), mpf(0)
            for ci in c:
                df = df * x + f
                f = f * x + ci
            return f, df

        x = mpf(float(x0))
        for _ in range(8):
            f, df = p(x)
            step = f / df
            x -= step
            if abs(step) <= abs(x) * mpf(10) ** (-dps + 5):
                break
        width = abs(x) * mpf(10) ** (-dps + 10)
        (f_lo, _), (f_hi, _) = p(x - width), p(x + width)
        assert f_lo * f_hi < 0, "mpmath refinement did not bracket a root"
        return x


def rel_err(value: float, exact) -> float:
    return float(abs(mpf(float(value)) - exact) / abs(exact))


def exact_residual(row: np.ndarray, x: float) -> tuple[Fraction, Fraction]:
    """|p(x)| and sum |a_i x^i| in exact rational arithmetic."""
    xf = Fraction(x)
    terms = [Fraction(float(a)) * xf ** (4 - i) for i, a in enumerate(row)]
    return abs(sum(terms)), sum(abs(t) for t in terms)


# ---------------------------------------------------------------- accuracy


def test_random_quartics_match_mpmath_and_reference():
    rng = np.random.default_rng(20240601)
    rows, largest, n_pos = [], [], []
    for _ in range(N_RANDOM):
        row, pos = random_quartic(rng)
        rows.append(row)
        largest.append(pos.max())
        n_pos.append(len(pos))
    coeffs = np.array(rows)
    roots, counts = solve_quartic(coeffs)

    np.testing.assert_array_equal(counts, n_pos)
    errors = np.array([rel_err(r, mp_refine(row, x0)) for row, r, x0 in zip(coeffs, roots, largest)])
    assert errors.max() <= RTOL_SIMPLE, f"max rel err {errors.max():.3g} at row {errors.argmax()}"

    # the independent numpy reference agrees on every row
    ref_roots, ref_counts = solve_quartic_reference(coeffs)
    np.testing.assert_array_equal(ref_counts, counts)
    np.testing.assert_allclose(roots, ref_roots, rtol=1e-9)


@pytest.mark.parametrize("scale_exp, lead_exp", [(100, -200), (-100, 200), (50, -100), (-50, 100)])
def test_coefficients_spanning_1e_minus200_to_1e200(scale_exp, lead_exp):
    # roots scaled by 10^scale_exp, leading coefficient 10^lead_exp: the coefficient
    # of R^(4-i) is about 10^(lead_exp + i scale_exp), from 1e-200 to 1e200
    rng = np.random.default_rng(7)
    rows, largest = [], []
    for _ in range(50):
        row, pos = random_quartic(rng, scale=1.0)
        exps = lead_exp + scale_exp * np.arange(5)
        rows.append(row / abs(row[0]) * 10.0**exps)
        largest.append(pos.max() * 10.0**scale_exp)
    coeffs = np.array(rows)
    assert np.isfinite(coeffs).all()
    magnitudes = np.abs(coeffs[coeffs != 0])
    assert magnitudes.min() < 1e-95 and magnitudes.max() > 1e95
    roots, counts = solve_quartic(coeffs)
    assert np.all(counts >= 1)
    for row, r, x0 in zip(coeffs, roots, largest):
        assert rel_err(r, mp_refine(row, x0)) <= RTOL_SIMPLE


def test_root_clusters_too_far_apart_for_one_scaling():
    # 1e200 R^4 + 1e200 R^2 - 1e-200: R^2 ~ 1e-400 (R = 1e-200) and R = +-i
    roots, counts = solve_quartic([[1e200, 0.0, 1e200, 0.0, -1e-200]])
    assert counts[0] == 1 and abs(roots[0] / 1e-200 - 1) < 1e-15
    # only a and e: R = (1e200 / 1e-200)^(1/4) = 1e100
    roots, counts = solve_quartic([[1e-200, 0.0, 0.0, 0.0, -1e200]])
    assert counts[0] == 1 and abs(roots[0] / 1e100 - 1) < 1e-15
    # positive roots 1e-120 and 1e120, negative roots -1 and -2 (no scaling holds both)
    row = poly_from_roots(1.0, [1e120, 1e-120, -1.0, -2.0], [])
    roots, counts = solve_quartic(row[None])
    assert counts[0] == 2
    assert rel_err(roots[0], mp_refine(row, 1e120, dps=300)) <= RTOL_SIMPLE
    # the smaller cluster is solved too: drop the largest root's factor and check the small one
    small = poly_from_roots(1.0, [1e-120, -1.0, -2.0], [])
    roots, counts = solve_quartic(small[None])
    assert counts[0] == 1 and rel_err(roots[0], mp_refine(small, 1e-120, dps=300)) <= RTOL_SIMPLE


def test_double_roots_count_once_and_are_accurate():
    rng = np.random.default_rng(11)
    for _ in range(300):
        scale = 10.0 ** rng.uniform(-3, 3)
        r = scale * 10.0 ** rng.uniform(-0.5, 0.5)
        others = {
            "largest": [r * rng.uniform(0.1, 0.7), -scale * rng.uniform(0.1, 10)],
            "inner": [r * rng.uniform(1.5, 5), -scale * rng.uniform(0.1, 10)],
            "alone": [-scale * rng.uniform(0.1, 10), -scale * rng.uniform(0.1, 10)],
        }
        for case, extra in others.items():
            row = poly_from_roots(rng.choice([-1.0, 1.0]), [r, r, *extra], [])
            roots, counts = solve_quartic(row[None])
            n_distinct_pos = 1 + sum(x > 0 for x in extra)
            assert counts[0] == n_distinct_pos, (case, row)
            target = max([r, *extra])
            tol = RTOL_DOUBLE if target == r else RTOL_SIMPLE * 100
            assert abs(roots[0] - target) <= tol * target, (case, row, roots[0], target)


@pytest.mark.parametrize("sep, expected_count", [(1e-9, 1), (1e-4, 2)])
def test_near_double_roots(sep, expected_count):
    # separation 1e-9 is below what float64 coefficients resolve: one touching root;
    # 1e-4 is well above it: two roots
    rng = np.random.default_rng(3)
    for _ in range(100):
        r = 10.0 ** rng.uniform(-2, 2)
        row = poly_from_roots(1.0, [r, r * (1 + sep), -r * rng.uniform(0.5, 2), -r * rng.uniform(3, 9)], [])
        roots, counts = solve_quartic(row[None])
        assert counts[0] == expected_count
        assert abs(roots[0] / (r * (1 + sep)) - 1) <= RTOL_DOUBLE


def test_close_pair_at_a_sample_point_converges():
    # -R^4 + R^3 + R^2 - R + 1e-8 = -R (R - 1)^2 (R + 1) + 1e-8: roots 1 +- 7.07e-5 and 1e-8.
    # The pair's extremum sits on a sample point; the iteration first creeps in linearly
    row = np.array([-1.0, 1.0, 1.0, -1.0, 1e-8])
    roots, counts = solve_quartic(row[None])
    assert counts[0] == 3
    assert rel_err(roots[0], mp_refine(row, 1.0 + 7.07e-5)) <= 1e-12


def test_complex_pair_grazing_the_real_axis_counts_as_one_touching_root():
    # (R - 1)^2 + 1e-20, times (R + 2)(R + 3): no real root in exact arithmetic,
    # but the pair is 1e-10 from the axis, far inside float64 resolution
    row = poly_from_roots(1.0, [-2.0, -3.0], [1.0 + 1e-10j])
    roots, counts = solve_quartic(row[None])
    assert counts[0] == 1 and abs(roots[0] - 1.0) <= 1e-7
    # a pair clearly off the axis has no real root
    row = poly_from_roots(1.0, [-2.0, -3.0], [1.0 + 1e-3j])
    roots, counts = solve_quartic(row[None])
    assert counts[0] == 0 and np.isnan(roots[0])


def test_wiggles_before_the_root_do_not_trap_the_iteration():
    # one positive root r with a complex pair just off the axis inside (0, r): p is far
    # from monotone on the bracket, with extrema where p stays away from zero
    rng = np.random.default_rng(17)
    rows, largest = [], []
    while len(rows) < 300:
        r = 10.0 ** rng.uniform(-2, 2)
        z = r * rng.uniform(0.05, 0.9) * (1 + 1j * rng.uniform(0.05, 0.4))
        row = poly_from_roots(rng.choice([-1.0, 1.0]), [r, -r * 10.0 ** rng.uniform(-1, 1)], [z])
        extrema = np.roots(np.polyder(row))
        if np.any((extrema.real > 0) & (extrema.real < r) & (abs(extrema.imag) < 1e-9 * r)):
            rows.append(row)
            largest.append(r)
    coeffs = np.array(rows)
    roots, counts = solve_quartic(coeffs)
    np.testing.assert_array_equal(counts, 1)
    for row, got, r in zip(coeffs, roots, largest):
        assert rel_err(got, mp_refine(row, r)) <= RTOL_SIMPLE
    # found by the random test: the local minimum between the two positive roots lies in
    # the same sample cell as the larger root, and Halley steps alone converge to it
    row = np.array([-2.24562425e-03, 3.67393781e02, 2.26698948e07, 5.22819239e10, -6.45101231e15])
    roots, counts = solve_quartic(row[None])
    assert counts[0] == 2 and rel_err(roots[0], mp_refine(row, 211542.64391855)) <= RTOL_SIMPLE


def test_quadruple_root():
    roots, counts = solve_quartic([[1.0, -4.0, 6.0, -4.0, 1.0]])
    assert counts[0] == 1 and abs(roots[0] - 1.0) <= 1e-3


def test_biquadratic_rows_are_exact_where_the_naive_formula_cancels():
    # a x^2 + c x + e in x = R^2 with c > 0 large: x = 2e / (-c - sqrt(c^2 - 4ae)) does not cancel
    a, c, e = 2e-4, 2e6, -1e-6
    roots, counts = solve_quartic([[a, 0.0, c, 0.0, e]])
    with mp.workdps(60):
        x = (-mpf(c) + mpmath.sqrt(mpf(c) ** 2 - 4 * mpf(a) * mpf(e))) / (2 * mpf(a))
        exact = mpmath.sqrt(x)
    assert counts[0] == 1 and rel_err(roots[0], exact) <= 1e-15
    naive = np.sqrt((-c + np.sqrt(c * c - 4 * a * e)) / (2 * a))
    assert not abs(naive - roots[0]) <= 1e-6 * roots[0]  # the naive form is useless here


def test_positive_root_far_below_the_largest_root():
    # the positive root 1 and a negative root -2^g: for large g the two cannot share one
    # scaling (at the positive root p and its derivatives underflow), so the rows are split
    # along their Newton polygon; before, such rows came back with a value that was no root
    for g in range(2, 240, 2):
        big = 2.0**g
        cubic = np.convolve([1.0, big], [1.0, 0.0, 0.0, -1.0])  # -big, and R^3 = 1
        square = np.convolve(np.convolve([1.0, big], [1.0, 3.0 * big]), [1.0, 0.0, -1.0])
        roots, counts = solve_quartic(np.array([cubic, square]))
        np.testing.assert_array_equal(counts, [1, 1])
        np.testing.assert_allclose(roots, 1.0, rtol=1e-14, err_msg=f"g={g}")
    # three gaps of 2^60 (no single one wide enough to split): the positive root 2^-180
    row = np.poly([-1.0, -(2.0**-60), -(2.0**-120), 2.0**-180])
    roots, counts = solve_quartic(row[None])
    assert counts[0] == 1 and rel_err(roots[0], mp_refine(row, 2.0**-180)) <= RTOL_SIMPLE


def exact_positive_roots(row: np.ndarray):
    """Largest positive root and number of distinct positive roots of the float64 polynomial
    `row`: exact real-root isolation (sympy), then bisection in the isolating interval."""
    sp = pytest.importorskip("sympy")
    x = sp.Symbol("x")
    poly = sp.Poly([sp.Rational(Fraction(float(v))) for v in row], x)
    while poly.degree() > 0 and poly.eval(0) == 0:
        poly = sp.Poly(sp.quo(poly.as_expr(), x), x)
    if poly.degree() <= 0:
        return None, 0
    square_free = poly.sqf_part()
    positive = [(lo, hi) for (lo, hi), _ in square_free.intervals(inf=0) if hi > 0]
    if not positive:
        return None, 0
    lo, hi = max(positive, key=lambda interval: interval[1])
    if lo == hi:
        return mpf(lo.p) / lo.q, len(positive)
    coeffs = [mpf(c.p) / c.q for c in square_free.all_coeffs()]
    lo, hi = mpf(lo.p) / lo.q, mpf(hi.p) / hi.q
    sign_lo = mpmath.sign(mpmath.polyval(coeffs, lo))
    while hi - lo > hi * mpf(10) ** -40:  # one root in (lo, hi), where the sign changes
        mid = (lo + hi) / 2
        if mpmath.sign(mpmath.polyval(coeffs, mid)) == sign_lo:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2, len(positive)


def test_coefficients_of_independent_random_exponents_match_exact_isolation():
    # every coefficient with its own exponent in [-300, 300]: root clusters far apart are
    # common (a few percent of such rows came back wrong before they were split)
    rng = np.random.default_rng(47)
    rows = np.ldexp(rng.standard_normal((100, 5)), rng.integers(-300, 300, (100, 5)))
    roots, counts = solve_quartic(rows)
    with mp.workdps(60):
        for row, root, count in zip(rows, roots, counts):
            largest, n_positive = exact_positive_roots(row)
            assert count == n_positive, row
            if n_positive:
                assert rel_err(root, largest) <= RTOL_SIMPLE, (row, root, largest)
            else:
                assert np.isnan(root)


# ---------------------------------------------------------------- degenerate rows


def test_degenerate_rows():
    rows = np.array(
        [
            poly_from_roots(2.0, [3.0, -1.0, 0.5], []),  # cubic: a = 0
            poly_from_roots(-1.5, [0.25, 4.0], []),  # quadratic: a = b = 0
            [0.0, 0.0, 0.0, 2.0, -1.0],  # linear: R = 1/2
            [0.0, 0.0, 0.0, 2.0, 1.0],  # linear, negative root
            [0.0, 0.0, 0.0, 0.0, 3.0],  # constant: no root
            [0.0, 0.0, 0.0, 0.0, 0.0],  # all zero: every R, so none reported
            [1.0, -3.0, 2.0, 0.0, 0.0],  # R^2 (R - 1)(R - 2): R = 0 is not positive
            [1.0, 0.0, -4.0, 0.0, 0.0],  # R^2 (R^2 - 4)
            [0.0, 1.0, 0.0, 0.0, 0.0],  # R^3 = 0
            [1.0, 0.0, 1.0, 0.0, 1.0],  # no real root at all
        ]
    )
    roots, counts = solve_quartic(rows)
    np.testing.assert_allclose(roots[:3], [3.0, 4.0, 0.5], rtol=1e-15)
    np.testing.assert_array_equal(counts, [2, 2, 1, 0, 0, 0, 2, 1, 0, 0])
    assert np.isnan(roots[3:6]).all() and np.isnan(roots[8:]).all()
    np.testing.assert_allclose(roots[6:8], [2.0, 2.0], rtol=1e-15)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("col", range(5))
def test_non_finite_rows(bad, col):
    rows = np.tile([1.0, -10.0, 35.0, -50.0, 24.0], (3, 1))
    rows[1, col] = bad
    roots, counts = solve_quartic(rows)
    np.testing.assert_allclose(roots[[0, 2]], 4.0, rtol=1e-15)
    assert np.isnan(roots[1]) and counts[1] == 0 and list(counts[[0, 2]]) == [4, 4]


def test_empty_input():
    roots, counts = solve_quartic(np.empty((0, 5)))
    assert roots.shape == (0,) and counts.shape == (0,)
    assert roots.dtype == np.float64 and counts.dtype == np.int8


@pytest.fixture
def sample_rows():
    rng = np.random.default_rng(5)
    return np.array([random_quartic(rng)[0] for _ in range(257)])


def test_input_kinds_agree(sample_rows):
    expected_roots, expected_counts = solve_quartic(sample_rows)
    as_f32 = sample_rows.astype(np.float32)
    wide = np.zeros((len(sample_rows), 9))
    wide[:, 2:7] = sample_rows

    class DLPackOnly:  # any array library that speaks DLPack
        def __init__(self, a):
            self._a = a

        def __dlpack__(self, **kwargs):
            return self._a.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self._a.__dlpack_device__()

    t = torch.tensor(sample_rows, requires_grad=True)
    for value in (
        wide[:, 2:7],
        np.asfortranarray(sample_rows),
        sample_rows.tolist(),
        t,
        DLPackOnly(sample_rows),
        torch.tensor(sample_rows).T.contiguous().T,
    ):
        roots, counts = solve_quartic(value)
        np.testing.assert_array_equal(roots, expected_roots)
        np.testing.assert_array_equal(counts, expected_counts)
    # float32 input: the same answer as for its exact float64 widening
    for value in (as_f32, torch.from_numpy(as_f32)):
        roots, counts = solve_quartic(value)
        ref_roots, ref_counts = solve_quartic(as_f32.astype(np.float64))
        np.testing.assert_array_equal(roots, ref_roots)
        np.testing.assert_array_equal(counts, ref_counts)
    # integer rows are fine too
    roots, counts = solve_quartic([[1, -10, 35, -50, 24]])
    assert roots[0] == 4.0 and counts[0] == 4


def test_float64_contiguous_input_is_not_copied(sample_rows):
    from normfast.core.equilibrium import _as_rows

    assert _as_rows("t", sample_rows) is sample_rows
    assert np.shares_memory(_as_rows("t", torch.from_numpy(sample_rows)), sample_rows)
    assert not np.shares_memory(_as_rows("t", sample_rows[::2]), sample_rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensor_input(sample_rows):
    roots, counts = solve_quartic(torch.tensor(sample_rows, device="cuda"))
    np.testing.assert_array_equal(roots, solve_quartic(sample_rows)[0])


def test_bad_shapes_and_types():
    with pytest.raises(
        ValueError, match=r"solve_quartic: expected coeffs of shape \[N, 5\], got coeffs.shape=\(3, 4\)"
    ):
        solve_quartic(np.zeros((3, 4)))
    for shape in [(5,), (2, 5, 1), ()]:
        with pytest.raises(ValueError, match=r"coeffs.shape="):
            solve_quartic(np.zeros(shape))
    with pytest.raises(ValueError, match="coeffs"):
        solve_quartic([[1, 2, 3, 4, 5], [1, 2]])
    for bad in (np.array([["a"] * 5]), np.zeros((2, 5), complex), np.zeros((2, 5), bool), object()):
        with pytest.raises(TypeError, match="solve_quartic"):
            solve_quartic(bad)
    for threads in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match="threads"):
            solve_quartic(np.zeros((1, 5)), threads=threads)
    with pytest.raises(ValueError, match=r"got coeffs.shape=\(2, 3\)"):
        _quartic.solve(np.zeros((2, 3)))


def test_results_do_not_depend_on_batching():
    # the batch path works on blocks of rows, in vector lanes, and refines in lanes that take
    # the next row as soon as theirs has converged: a row must come out as if it were alone
    rng = np.random.default_rng(41)
    n = 700  # several blocks
    rows = rng.standard_normal((n, 5))
    kind = rng.integers(0, 6, n)
    rows[kind == 1] = rng.integers(-3, 4, (np.sum(kind == 1), 5))  # multiple roots, zeros
    rows[np.ix_(kind == 2, [1, 3])] = 0.0  # biquadratics
    powers = np.arange(4, -1, -1)
    rows[kind == 3] *= 2.0 ** (powers * rng.integers(-150, 150, (np.sum(kind == 3), 1)))  # R -> 2^s R
    rows[kind == 4] = np.ldexp(rows[kind == 4], rng.integers(-300, 300, (np.sum(kind == 4), 5)))
    rows[kind == 5, rng.integers(0, 5, np.sum(kind == 5))] = rng.choice([np.nan, np.inf, 0.0], np.sum(kind == 5))
    roots, counts = solve_quartic(rows)
    alone = [solve_quartic(row[None]) for row in rows]
    np.testing.assert_array_equal(roots, [r[0] for r, _ in alone])
    np.testing.assert_array_equal(counts, [c[0] for _, c in alone])
    order = rng.permutation(n)
    shuffled_roots, shuffled_counts = solve_quartic(rows[order])
    np.testing.assert_array_equal(shuffled_roots, roots[order])
    np.testing.assert_array_equal(shuffled_counts, counts[order])


def test_one_row_path_matches_the_lane_path():
    # subnormal coefficients send a row down the one-row path; 2^1040 times the same
    # polynomial (exactly: small integers) takes the lanes. Same roots, so the same bits
    rng = np.random.default_rng(43)
    rows = rng.integers(-7, 8, (600, 5)).astype(float)
    rows[::8, [1, 3]] = 0.0  # biquadratics among them
    rows = rows[(rows[:, 0] != 0) & (rows[:, 4] != 0)]
    tiny = np.ldexp(rows, -1040)
    assert np.array_equal(np.ldexp(tiny, 1040), rows)
    lane_roots, lane_counts = solve_quartic(rows)
    one_roots, one_counts = solve_quartic(tiny)
    np.testing.assert_array_equal(one_counts, lane_counts)
    np.testing.assert_array_equal(one_roots, lane_roots)
    assert np.sum(lane_counts > 0) > len(rows) // 2


def test_threads_and_concurrent_calls_agree():
    rng = np.random.default_rng(9)
    rows = rng.standard_normal((20_000, 5))
    serial = solve_quartic(rows, threads=1)
    for result in (solve_quartic(rows, threads=2), solve_quartic(rows)):
        np.testing.assert_array_equal(result[0], serial[0])
        np.testing.assert_array_equal(result[1], serial[1])
    results = [None, None]

    def work(i):
        results[i] = solve_quartic(rows[i::2], threads=1)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        np.testing.assert_array_equal(results[i][0], serial[0][i::2])


def test_public_api():
    assert normfast.solve_quartic is solve_quartic
    assert _quartic.touch_factor == TOUCH_FACTOR
    assert _quartic.default_threads() >= 1


# ---------------------------------------------------------------- properties

coefficient = st.one_of(st.just(0.0), st.floats(1e-3, 1e3), st.floats(-1e3, -1e-3))
rows_strategy = st.lists(coefficient, min_size=5, max_size=5)
# small integers make multiple and clustered roots likely; wide floats, roots of very different sizes
awkward = st.one_of(
    st.integers(-3, 3).map(float),
    st.floats(1e-8, 1e8),
    st.floats(-1e8, -1e-8),
    st.sampled_from([1e-8, -1e-8, 0.5, -0.5]),
)


@settings(max_examples=150, deadline=None)
@given(row=rows_strategy, shift=st.integers(-200, 200), factor=st.integers(-100, 100))
def test_power_of_two_substitution_is_exact(row, shift, factor):
    # R -> 2^shift R and p -> 2^factor p change the root by exactly 2^shift
    # (the solver's own scaling is by powers of two, so results match bit for bit)
    base = np.array([row])
    powers = np.arange(4, -1, -1)
    moved = np.ldexp(base, -shift * powers + factor)
    roots, counts = solve_quartic(np.vstack([base, moved, -base]))
    assert counts[0] == counts[1] == counts[2]
    np.testing.assert_array_equal(roots[1], np.ldexp(roots[0], shift))
    np.testing.assert_array_equal(roots[2], roots[0])


@settings(max_examples=300, deadline=None)
@given(row=st.one_of(rows_strategy, st.lists(awkward, min_size=5, max_size=5)))
def test_reported_roots_have_tiny_residuals(row):
    coeffs = np.array([row])
    roots, counts = solve_quartic(coeffs)
    assert (counts[0] > 0) == np.isfinite(roots[0])
    if counts[0]:
        assert roots[0] > 0
        residual, magnitude = exact_residual(coeffs[0], float(roots[0]))
        assert residual <= Fraction(TOUCH_FACTOR * 2.0**-52) * magnitude
    ref_roots, ref_counts = solve_quartic_reference(coeffs)
    if ref_counts[0] and not counts[0]:
        # a root the reference finds must be one the solver calls absent only
        # for a grazing pair: its residual is then at rounding level
        residual, magnitude = exact_residual(coeffs[0], float(ref_roots[0]))
        assert residual <= Fraction(1e-6) * magnitude

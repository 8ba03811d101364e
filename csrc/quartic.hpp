// Batched real-root solver for the equilibrium quartic
//
//     a R^4 + b R^3 + c R^2 + d R + e = 0
//
// Per row it returns the largest positive real root (NaN where there is none)
// and the number of distinct positive real roots. Pure C++17, no Python: the
// bindings in bindings.cpp only convert arrays.
//
// Method (see quartic.cpp for the details):
//   * exact power-of-two rescaling R = 2^k y, chosen from the coefficient
//     exponents, so that the scaled coefficients are at most 1 in magnitude
//     and every root satisfies |y| < 2;
//   * Descartes' rule of signs, then, for quartics with several sign
//     variations, a Sturm chain with certified signs for the count and sign
//     changes at sample points to isolate the largest root;
//   * where that does not settle a row (near-multiple roots, roots close
//     together), the positive extrema of the polynomial (positive roots of
//     its derivative, found the same way one degree down) cut (0, 2) into
//     monotone pieces; a piece whose ends differ in sign holds exactly one
//     root, and an extremum where |p| is below the rounding-error bound of
//     evaluating p there is a double (touching) root and counts once;
//   * safeguarded Halley iteration inside the bracket, then polishing on the
//     (exactly rescaled) original polynomial: Newton steps whose residual is
//     evaluated by compensated Horner, each kept only if it lowers that
//     residual;
//   * closed forms for linear, quadratic and biquadratic (b = d = 0) rows;
//   * rows whose coefficients span more than the double exponent range
//     allows in one scaling are split along their Newton polygon into root
//     clusters that are solved separately.
#pragma once

#include <cstddef>
#include <cstdint>

namespace normfast {

// A local extremum y_c of p is treated as a double root when
//     |p(y_c)| <= kTouchFactor * eps * sum_i |p_i| |y_c|^i,
// i.e. when p(y_c) cannot be told from zero given the rounding of the float64
// coefficients and of evaluating p. Two real roots whose relative separation
// is below roughly sqrt(8 * kTouchFactor * eps) ~ 1.7e-7 (for a well-scaled
// pair) therefore count as one, as does a complex pair that close to the real
// axis; the reported root is then the extremum itself.
inline constexpr double kTouchFactor = 16.0;

struct QuarticSolution {
    double root;              // largest positive real root, NaN if none
    std::int8_t n_positive;   // number of distinct positive real roots
};

// One row, coefficients in descending order (a, b, c, d, e).
//   * any NaN/inf coefficient            -> {NaN, 0}
//   * all coefficients zero              -> {NaN, 0} (every R solves it; no
//                                           single root to report)
//   * only e != 0                        -> {NaN, 0}
//   * leading zeros lower the degree (cubic, quadratic, linear); R = 0 is
//     never counted as a positive root.
//   * a positive root beyond the double range comes back as +inf.
QuarticSolution solve_quartic_row(const double* coeffs) noexcept;

// rows: n_rows x 5, C-contiguous. roots: n_rows, n_positive: n_rows.
// threads <= 0 uses the OpenMP default; rows are split statically.
void solve_quartic_batch(const double* rows, std::size_t n_rows, double* roots,
                         std::int8_t* n_positive, int threads) noexcept;

// OpenMP's default team size (1 when built without OpenMP).
int default_threads() noexcept;

}  // namespace normfast

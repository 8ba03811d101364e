// Batched real-root solver for a R^4 + b R^3 + c R^2 + d R + e = 0.
// See quartic.hpp for the contract; this file holds the method.
//
// Per row:
//   1. Non-finite rows, leading zeros (lower degree) and trailing zeros (roots
//      at R = 0, never positive) are dealt with; the rest is rescaled exactly
//      (powers of two) so that every root has |y| < 2 (rescale).
//   2. Closed forms for degree 1, 2 and for biquadratics (quadratic_positive;
//      biquadratic roots are accurate to a few ulps and not polished further).
//   3. Descartes' rule of signs: no sign variation, no positive root; one,
//      exactly one simple root, bracketed by (0, 2).
//   4. Quartics with more variations: a Sturm chain whose signs are certified
//      by an a-priori rounding-error bound gives the number of distinct
//      positive roots; when the signs of p at the sample points y = 2^(1-j)
//      change as often as that, every root sits alone in one sample cell and
//      the largest is bracketed (isolated_positive_roots).
//   5. Otherwise (near-multiple roots, roots sharing a cell, cubics): the
//      positive extrema of p, found the same way one degree down, cut (0, 2)
//      into monotone pieces; a piece whose ends differ in sign holds one root,
//      and an extremum where |p| is within its rounding-error bound of zero is
//      a double (touching) root (scan_pieces).
//   6. The bracketed root is found by safeguarded Halley iteration and
//      polished by Newton steps on the rescaled original polynomial with a
//      compensated residual, each step kept only if it lowers the residual.
//
// Build note: compile with -ffp-contract=off. The compensated evaluation
// relies on every product and sum being rounded separately; fused
// multiply-adds are used only where written out (madd, two_prod).
//
// Everything below is templated on the polynomial degree (so Horner loops
// unroll) and on whether fused multiply-add is used. On x86-64 the solver is
// compiled twice, for the baseline ISA and for FMA-capable CPUs, and the
// batch loop picks one at run time; results of the two agree to rounding.
#include "quartic.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__GNUC__) || defined(__clang__)
#define NORMFAST_FLATTEN __attribute__((flatten))
#else
#define NORMFAST_FLATTEN
#endif

#if defined(__FMA__) || defined(__FP_FAST_FMA) || defined(__aarch64__)
#define NORMFAST_NATIVE_FMA 1
#else
#define NORMFAST_NATIVE_FMA 0
#endif

#if !NORMFAST_NATIVE_FMA && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define NORMFAST_FMA_DISPATCH 1
#else
#define NORMFAST_FMA_DISPATCH 0
#endif

namespace normfast {
namespace {

constexpr double kEps = std::numeric_limits<double>::epsilon();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// After rescaling, |c_i / c_n| < 1 for every coefficient, so Fujiwara's bound
// puts every root (and, by Gauss-Lucas, every root of every derivative) at
// |y| < 2, and each of these polynomials is positive for y >= 2.
constexpr double kBound = 2.0;

// A nonzero scaled coefficient below this has lost, or is about to lose,
// precision to underflow: the row's roots span more than one scaling can hold.
constexpr double kTiny = 0x1p-960;

// Root clusters whose magnitudes differ by more than 2^kClusterGap are solved
// separately: at one cluster's scale the other's terms are below 2^-128
// relative, far under double rounding.
constexpr double kClusterGap = 128.0;

// Halley iteration stops after a relative step below kStopStep: the error
// left is then of order kStopStep^3 (times the root's conditioning). The
// reported root is polished afterwards and an extremum is sharpened further
// whenever the sign of p there is not yet beyond doubt (kSharpen).
constexpr double kStopStep = 1e-3;
// An extremum y_c located to relative error delta moves p(y_c) by about
// delta^2 * magnitude(p, y_c). Where |p(y_c)| is below kSharpen * magnitude the
// extremum is first located to full precision (and the touching test made).
constexpr double kSharpen = 1e-10;
constexpr int kMaxIterations = 100;
// A polishing step below this (relative) leaves an error far below rounding.
constexpr double kPolishDone = 1e-8;
// At most this many polishing steps (one or two unless two roots are close).
constexpr int kPolishSteps = 8;

// Sample points y_j = 2^(1 - j) on (0, kBound]: their signs narrow each
// bracket to a factor-2 cell before iterating (and isolate the roots in step
// 4). The evaluations are independent, so they overlap in the pipeline.
constexpr int kGrid = 8;
constexpr double kGridPoint[kGrid] = {2.0, 1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625};

// ------------------------------------------------------------- arithmetic

template <bool Fma>
inline double madd(double a, double b, double c) {
    if constexpr (Fma) {
        return std::fma(a, b, c);
    } else {
        return a * b + c;
    }
}

// Error-free product: a * b == p + err exactly.
template <bool Fma>
inline double two_prod(double a, double b, double& err) {
    const double p = a * b;
    if constexpr (Fma) {
        err = std::fma(a, b, -p);
    } else {
        // Veltkamp splitting into 26-bit halves (Dekker's product)
        constexpr double kSplit = 134217729.0;  // 2^27 + 1
        const double ta = kSplit * a, a_hi = ta - (ta - a), a_lo = a - a_hi;
        const double tb = kSplit * b, b_hi = tb - (tb - b), b_lo = b - b_hi;
        err = ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo;
    }
    return p;
}

// Error-free sum: a + b == s + err exactly.
inline double two_sum(double a, double b, double& err) {
    const double s = a + b;
    const double bv = s - a;
    err = (a - (s - bv)) + (b - bv);
    return s;
}

// floor(log2 |x|) for finite nonzero x.
inline int exponent_of(double x) {
    std::uint64_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const int biased = static_cast<int>((bits >> 52) & 0x7ff);
    return biased != 0 ? biased - 1023 : std::ilogb(x);
}

// x * 2^e, exactly unless the result leaves the normal range (as ldexp).
inline double times_pow2(double x, int e) {
    if (e < -1022 || e > 1023) return std::ldexp(x, e);
    const std::uint64_t bits = static_cast<std::uint64_t>(e + 1023) << 52;
    double scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return x * scale;
}

// ceil(num / den) for den in 1..4, without a hardware division.
inline int ceil_div(int num, int den) {
    constexpr int kOffset = 1 << 20;  // makes the dividend positive: exponents are far smaller
    switch (den) {
        case 1: return num;
        case 2: return (num + 1) >> 1;
        case 3: return (num + 2 + 3 * kOffset) / 3 - kOffset;
        default: return (num + 3) >> 2;
    }
}

// ------------------------------------------------------------- polynomials

// sum_{i<=N} c[i] y^i, ascending coefficients, c[N] > 0.
template <int N>
struct Poly {
    double c[N + 1];
};

template <bool Fma, int N>
inline double eval(const Poly<N>& p, double y) {
    double f = p.c[N];
    for (int i = N - 1; i >= 0; --i) f = madd<Fma>(f, y, p.c[i]);
    return f;
}

// p, p' and p''/2 in one pass.
template <bool Fma, int N>
inline void eval_dd(const Poly<N>& p, double y, double& f, double& df, double& half_d2f) {
    f = p.c[N];
    df = 0.0;
    half_d2f = 0.0;
    for (int i = N - 1; i >= 0; --i) {
        half_d2f = madd<Fma>(half_d2f, y, df);
        df = madd<Fma>(df, y, f);
        f = madd<Fma>(f, y, p.c[i]);
    }
}

template <bool Fma, int N>
inline double eval_derivative(const Poly<N>& p, double y) {
    double df = N * p.c[N];
    for (int i = N - 1; i >= 1; --i) df = madd<Fma>(df, y, i * p.c[i]);
    return df;
}

// p''(y) / 2, the curvature term of the Taylor expansion.
template <bool Fma, int N>
inline double half_second_derivative(const Poly<N>& p, double y) {
    if constexpr (N < 2) {
        return 0.0;
    } else {
        double f = 0.5 * N * (N - 1) * p.c[N];
        for (int i = N - 1; i >= 2; --i) f = madd<Fma>(f, y, 0.5 * i * (i - 1) * p.c[i]);
        return f;
    }
}

// sum |c_i| |y|^i: the scale of the rounding error of evaluating p at y.
template <bool Fma, int N>
inline double magnitude(const Poly<N>& p, double y) {
    const double ay = std::fabs(y);
    double f = std::fabs(p.c[N]);
    for (int i = N - 1; i >= 0; --i) f = madd<Fma>(f, ay, std::fabs(p.c[i]));
    return f;
}

// Compensated Horner (Graillat, Langlois, Louvet): p(y) as accurate as if
// evaluated in twice the working precision, then rounded. The residual of
// the polishing steps comes from here, so the polished root is accurate even
// where plain Horner cancels.
template <bool Fma, int N>
inline double eval_compensated(const Poly<N>& p, double y) {
    double s = p.c[N];
    double correction = 0.0;
    for (int i = N - 1; i >= 0; --i) {
        double prod_err, sum_err;
        const double prod = two_prod<Fma>(s, y, prod_err);
        s = two_sum(prod, p.c[i], sum_err);
        correction = madd<Fma>(correction, y, prod_err + sum_err);
    }
    return s + correction;
}

template <int N>
inline Poly<N - 1> derivative(const Poly<N>& p) {
    Poly<N - 1> d;
    for (int i = 0; i < N; ++i) d.c[i] = (i + 1) * p.c[i + 1];
    return d;
}

template <int N>
inline Poly<N - 1> divide_by_y(const Poly<N>& p) {
    Poly<N - 1> d;
    for (int i = 0; i < N; ++i) d.c[i] = p.c[i + 1];
    return d;
}

// Descartes: an upper bound on the number of positive roots, exact when 0 or 1.
template <int N>
inline int sign_variations(const Poly<N>& p) {
    int v = 0;
    bool negative = false;  // c[N] > 0
    for (int i = N - 1; i >= 0; --i) {
        const bool nonzero = p.c[i] != 0.0;
        const bool neg = p.c[i] < 0.0;
        v += nonzero & (neg != negative);
        negative = nonzero ? neg : negative;
    }
    return v;
}

// ------------------------------------------------------------- root finding

// Distinct positive roots of c2 y^2 + c1 y + c0 (c2 > 0), ascending. A double
// root (discriminant within its rounding error of zero: the touching test
// of quartic.hpp at the vertex) comes back once with *touching set.
template <bool Fma>
int quadratic_positive(double c2, double c1, double c0, double* out, bool* touching) {
    *touching = false;
    double w_err, sq_err;
    const double w = two_prod<Fma>(4.0 * c2, c0, w_err);
    const double sq = two_prod<Fma>(c1, c1, sq_err);
    const double disc = (sq - w) + (sq_err - w_err);
    const double tol = kTouchFactor * kEps * (3.0 * sq + std::fabs(w));
    if (disc < -tol) return 0;
    if (disc <= tol) {
        const double y = -c1 / (2.0 * c2);
        if (!(y > 0.0)) return 0;
        out[0] = y;
        *touching = true;
        return 1;
    }
    // the two roots from the two formulas that do not cancel
    const double q = -0.5 * (c1 + std::copysign(std::sqrt(disc), c1));
    double y1 = q / c2, y2 = c0 / q;
    if (y1 > y2) std::swap(y1, y2);
    int m = 0;
    if (y1 > 0.0) out[m++] = y1;
    if (y2 > 0.0) out[m++] = y2;
    return m;
}

// Values of p at the sample points, computed only when first needed.
template <bool Fma, int N>
struct Samples {
    const Poly<N>& p;
    double f[kGrid];
    bool ready = false;

    explicit Samples(const Poly<N>& poly) : p(poly) {}

    const double* values() {
        if (!ready) {
            // Horner on all points at once: independent chains, no dependency stalls
            for (int j = 0; j < kGrid; ++j) f[j] = p.c[N];
            for (int i = N - 1; i >= 0; --i) {
                for (int j = 0; j < kGrid; ++j) f[j] = madd<Fma>(f[j], kGridPoint[j], p.c[i]);
            }
            ready = true;
        }
        return f;
    }
};

// A piece (lo, hi) of p with f(lo), f(hi) of opposite signs; an end that is
// an extremum of p carries its flag.
struct Piece {
    double lo, f_lo, hi, f_hi;
    bool lo_extremum, hi_extremum;
};

// Shrinks a monotone piece to the sample points that still bracket the root.
// The samples inside the piece are consecutive, and (p being monotone there)
// those on the hi side of the root come first (they are in descending y), so
// the new ends follow from two counts: no data-dependent branches.
inline void narrow(Piece& s, const double* f) {
    const bool lo_negative = s.f_lo < 0.0;
    int first_inside = 0, n_inside = 0, n_hi_side = 0;
    for (int j = 0; j < kGrid; ++j) {
        const double y = kGridPoint[j];
        const bool inside = (y > s.lo) & (y < s.hi);
        // a sample that is exactly zero goes to the hi side: the root stays in [lo, hi]
        const bool lo_side = lo_negative ? f[j] < 0.0 : f[j] > 0.0;
        first_inside += y >= s.hi;
        n_inside += inside;
        n_hi_side += inside & !lo_side;
    }
    if (n_hi_side > 0) {
        const int j = first_inside + n_hi_side - 1;
        s.hi = kGridPoint[j], s.f_hi = f[j], s.hi_extremum = false;
    }
    if (n_hi_side < n_inside) {
        const int j = first_inside + n_hi_side;
        s.lo = kGridPoint[j], s.f_lo = f[j], s.lo_extremum = false;
    }
}

// A starting point inside the piece. Next to an extremum p is close to its
// Taylor parabola, whose crossing is a good guess; otherwise the secant point.
template <bool Fma, int N>
double initial_guess(const Poly<N>& p, const Piece& s) {
    const bool from_lo = s.lo_extremum && (!s.hi_extremum || std::fabs(s.f_lo) <= std::fabs(s.f_hi));
    if (from_lo || s.hi_extremum) {
        const double y_c = from_lo ? s.lo : s.hi;
        const double f_c = from_lo ? s.f_lo : s.f_hi;
        const double curvature = half_second_derivative<Fma>(p, y_c);
        if (f_c * curvature < 0.0) {
            const double h = std::sqrt(-f_c / curvature);
            const double y = from_lo ? y_c + h : y_c - h;
            if (y > s.lo && y < s.hi) return y;
        }
    }
    const double y = s.lo + (s.hi - s.lo) * (s.f_lo / (s.f_lo - s.f_hi));
    return (y > s.lo && y < s.hi) ? y : 0.5 * (s.lo + s.hi);
}

// The root of p inside the piece (where p(lo), p(hi) differ in sign; p need
// not be monotone there). Halley steps (cubic convergence) close to the root;
// away from it, where Halley's correction to the Newton step is large (and
// Halley would be drawn to an extremum of p), plain Newton steps; bisection
// whenever a step leaves the bracket or fails to halve the step before last.
// Stops once a Halley step is below kStopStep relative and a tenth of the
// step before.
template <bool Fma, int N>
double refine(const Poly<N>& p, Piece s) {
    const bool rising = s.f_lo < 0.0;
    double lo = s.lo, hi = s.hi;
    double y = initial_guess<Fma>(p, s);
    double step_before_last = hi - lo;
    double last_step = step_before_last;
    for (int it = 0; it < kMaxIterations; ++it) {
        double f, df, half_d2f;
        eval_dd<Fma>(p, y, f, df, half_d2f);
        if (f == 0.0) return y;
        const bool left_of_root = (f < 0.0) == rising;
        lo = left_of_root ? y : lo;
        hi = left_of_root ? hi : y;
        // Halley: y - f f' / (f'^2 - f f''/2), Newton: y - f / f'; Halley where its
        // correction to Newton, f f''/(2 f'^2), is at most 1/2. One division.
        const double df2 = df * df, f_curv = f * half_d2f;
        const bool halley = std::fabs(f_curv) <= 0.5 * df2;  // false for NaN
        const double candidate = y - (halley ? f * df : f) / (halley ? df2 - f_curv : df);
        double next;
        if (candidate >= lo && candidate <= hi) {  // false for NaN/inf
            const double step = std::fabs(candidate - y);
            // converged: a small step that is also much smaller than the one
            // before (near a close pair of roots Halley first creeps linearly)
            if (halley && step <= kStopStep * std::fabs(candidate) && step <= 0.1 * last_step) {
                return candidate;
            }
            next = step <= 0.5 * step_before_last ? candidate : 0.5 * (lo + hi);
        } else {
            next = 0.5 * (lo + hi);
        }
        if (hi - lo <= 4.0 * kEps * hi) return next;
        step_before_last = last_step;
        last_step = std::fabs(next - y);
        y = next;
    }
    return y;
}

// Newton steps on q from a close approximation of a simple root, to full
// precision. Used on p' to pin down an extremum of p.
template <bool Fma, int N>
double sharpen(const Poly<N>& q, double y) {
    for (int it = 0; it < 4; ++it) {
        double f, df, unused;
        eval_dd<Fma>(q, y, f, df, unused);
        const double next = y - f / df;
        if (!std::isfinite(next)) break;
        const bool done = std::fabs(next - y) <= 4.0 * kEps * std::fabs(next);
        y = next;
        if (done) break;
    }
    return y;
}

// ----------------------------------------------------- certified counting

// The Sturm chain below is built from the coefficients by products and
// differences only (pseudo-remainders, no division). For such a program the
// rounding error of every computed value is at most gamma_k * m, where m is
// the same program run on the absolute values of the inputs with every
// difference turned into a sum, and k the program's depth (< 64 here):
// the classic a-priori bound, certified without interval arithmetic.
struct Tracked {
    double v, m;  // value, and its magnitude as above
};

// gamma_64 with a factor 2 of headroom for the rounding of m itself
constexpr double kChainError = 2.0 * 64.0 * (kEps / 2.0);

inline Tracked exact(double v) { return {v, std::fabs(v)}; }

// x1 y1 - x2 y2
template <bool Fma>
inline Tracked cross(Tracked x1, Tracked y1, Tracked x2, Tracked y2) {
    return {madd<Fma>(x1.v, y1.v, -(x2.v * y2.v)), madd<Fma>(x1.m, y1.m, x2.m * y2.m)};
}

// The sign of a tracked value: +1/-1 when certain, 0 for an exact zero, and
// `kUnsure` when the value is within its error bound of zero.
constexpr int kUnsure = 2;
inline int sign_of(Tracked t) {
    if (t.m == 0.0) return 0;
    if (std::fabs(t.v) <= kChainError * t.m) return kUnsure;
    return t.v > 0.0 ? 1 : -1;
}

// -prem(A, B) for deg A = M, deg B = M - 1 (descending coefficients): the
// remainder of A / B times lead(B)^2 > 0, negated, as Sturm's chain needs.
template <bool Fma, int M>
inline void negated_pseudo_remainder(const Tracked* a, const Tracked* b, Tracked* out) {
    const Tracked zero{0.0, 0.0};
    Tracked step[M];  // lead(B) A - lead(A) y B, degree M - 1
    for (int i = 0; i < M; ++i) step[i] = cross<Fma>(b[0], a[i + 1], a[0], i + 1 < M ? b[i + 1] : zero);
    for (int i = 0; i + 1 < M; ++i) {
        const Tracked next = cross<Fma>(b[0], step[i + 1], step[0], b[i + 1]);
        out[i] = {-next.v, next.m};
    }
}

inline int sign_changes(const int* signs, int n) {
    int v = 0, last = 0;
    for (int i = 0; i < n; ++i) {
        if (signs[i] == 0) continue;
        v += last != 0 && signs[i] != last;
        last = signs[i];
    }
    return v;
}

// Number of distinct positive roots of a quartic by Sturm's theorem, with
// every sign in the chain certified by ball arithmetic; -1 when a sign is
// not certain (near-multiple roots, degenerate chains) or the coefficients
// are too small for the chain's products.
template <bool Fma>
int sturm_positive_count(const Poly<4>& p, int variations) {
    constexpr double kSmallest = 0x1p-60;
    for (int i = 0; i <= 4; ++i) {
        if (p.c[i] != 0.0 && std::fabs(p.c[i]) < kSmallest) return -1;
    }
    const Tracked s0[5] = {exact(p.c[4]), exact(p.c[3]), exact(p.c[2]), exact(p.c[1]), exact(p.c[0])};
    const Tracked s1[4] = {exact(4.0 * p.c[4]), exact(3.0 * p.c[3]), exact(2.0 * p.c[2]), exact(p.c[1])};
    Tracked s2[3], s3[2], s4[1];
    negated_pseudo_remainder<Fma, 4>(s0, s1, s2);
    negated_pseudo_remainder<Fma, 3>(s1, s2, s3);
    negated_pseudo_remainder<Fma, 2>(s2, s3, s4);
    const int at_zero[5] = {p.c[0] > 0 ? 1 : -1, sign_of(s1[3]), sign_of(s2[2]), sign_of(s3[1]), sign_of(s4[0])};
    const int at_inf[5] = {1, 1, sign_of(s2[0]), sign_of(s3[0]), sign_of(s4[0])};
    for (int i = 0; i < 5; ++i) {
        if (at_zero[i] == kUnsure || at_inf[i] == kUnsure || (i >= 2 && at_inf[i] == 0)) return -1;
    }
    const int count = sign_changes(at_zero, 5) - sign_changes(at_inf, 5);
    // Descartes: count <= variations and of the same parity (all roots simple here)
    if (count < 0 || count > variations || (variations - count) % 2 != 0) return -1;
    return count;
}

// Quartic fast path for two or more sign variations: the Sturm count, then
// the sample points. When the samples show as many sign changes as there are
// roots, each such cell holds exactly one root and the largest is refined in
// the last one. Returns -1 when this does not settle the row.
template <bool Fma>
int isolated_positive_roots(const Poly<4>& p, int variations, double* largest) {
    const int count = sturm_positive_count<Fma>(p, variations);
    if (count <= 0) return count;
    Samples<Fma, 4> samples(p);
    const double* f = samples.values();
    // cells between 0, y_7, ..., y_0 = kBound in ascending order
    int changes = 0;
    double f_lo = p.c[0], lo = 0.0;
    Piece last{};
    for (int j = kGrid - 1; j >= 0; --j) {
        if (f[j] == 0.0) return -1;
        if ((f[j] < 0.0) != (f_lo < 0.0)) {
            ++changes;
            last = Piece{lo, f_lo, kGridPoint[j], f[j], false, false};
        }
        lo = kGridPoint[j], f_lo = f[j];
    }
    if (changes != count) return -1;
    *largest = refine<Fma>(p, last);
    return count;
}

// Distinct positive roots of p, all refined, ascending into `out`; `touching`
// flags double roots. p: c[N] > 0, rescaled so that its roots lie in
// |y| < kBound. Used for derivatives (the extrema of the level above).
template <bool Fma, int N>
int all_positive_roots(const Poly<N>& p, double* out, bool* touching);

// Largest positive root of p into *largest and the number of distinct positive
// roots; *largest_touching when that root is a double root.
template <bool Fma, int N>
int largest_positive_root(const Poly<N>& p, double* largest, bool* largest_touching);

// Walks the monotone pieces of p on (0, kBound), cut at its positive extrema.
// With `out` every root is refined and stored; otherwise only the largest.
template <bool Fma, int N>
int scan_pieces(const Poly<N>& p, double* out, bool* out_touching, double* largest,
                bool* largest_touching) {
    double extrema[N - 1];
    bool extremum_touching[N - 1];
    const Poly<N - 1> dp = derivative(p);
    const int m = all_positive_roots<Fma>(dp, extrema, extremum_touching);
    Samples<Fma, N> samples(p);

    int count = 0;
    *largest = kNaN;
    *largest_touching = false;
    double lo = 0.0, f_lo = p.c[0];
    bool lo_extremum = false, lo_touching = false;
    bool pending = false;  // the largest root so far lies in `last` (refined at the end)
    Piece last{};

    for (int j = 0; j <= m; ++j) {
        const bool hi_extremum = j < m;
        double hi = hi_extremum ? extrema[j] : kBound;
        double f_hi = eval<Fma>(p, hi);
        bool hi_touching = false;
        if (hi_extremum) {
            double mag = magnitude<Fma>(p, hi);
            if (std::fabs(f_hi) <= kSharpen * mag) {
                hi = sharpen<Fma>(dp, hi);
                f_hi = eval<Fma>(p, hi);
                mag = magnitude<Fma>(p, hi);
            }
            hi_touching = std::fabs(f_hi) <= kTouchFactor * kEps * mag;
        }
        if (hi_touching) {
            if (out) out[count] = hi, out_touching[count] = true;
            ++count;
            *largest = hi;
            *largest_touching = true;
            pending = false;
        } else if (!lo_touching && (f_lo < 0.0) != (f_hi < 0.0)) {
            Piece piece{lo, f_lo, hi, f_hi, lo_extremum, hi_extremum};
            narrow(piece, samples.values());
            if (out) {
                out[count] = refine<Fma>(p, piece);
                out_touching[count] = false;
                *largest = out[count];
                *largest_touching = false;
            } else {
                pending = true;
                last = piece;
            }
            ++count;
        }
        lo = hi, f_lo = f_hi, lo_extremum = hi_extremum, lo_touching = hi_touching;
    }
    if (pending) {
        *largest = refine<Fma>(p, last);
        *largest_touching = false;
    }
    return count;
}

// The one positive root when Descartes allows exactly one: p(0) < 0 < p(kBound).
template <bool Fma, int N>
double single_positive_root(const Poly<N>& p) {
    Samples<Fma, N> samples(p);
    Piece piece{0.0, p.c[0], kBound, eval<Fma>(p, kBound), false, false};
    narrow(piece, samples.values());
    return refine<Fma>(p, piece);
}

template <bool Fma, int N>
int all_positive_roots(const Poly<N>& p, double* out, bool* touching) {
    if constexpr (N == 0) {
        return 0;
    } else {
        if (p.c[0] == 0.0) return all_positive_roots<Fma>(divide_by_y(p), out, touching);
        if constexpr (N == 1) {
            const double y = -p.c[0] / p.c[1];
            if (!(y > 0.0)) return 0;
            out[0] = y;
            touching[0] = false;
            return 1;
        } else if constexpr (N == 2) {
            bool t;
            const int m = quadratic_positive<Fma>(p.c[2], p.c[1], p.c[0], out, &t);
            touching[0] = touching[1] = t;
            return m;
        } else {
            const int v = sign_variations(p);
            if (v == 0) return 0;
            if (v == 1) {
                out[0] = single_positive_root<Fma>(p);
                touching[0] = false;
                return 1;
            }
            double unused;
            bool unused_touching;
            return scan_pieces<Fma>(p, out, touching, &unused, &unused_touching);
        }
    }
}

template <bool Fma, int N>
int largest_positive_root(const Poly<N>& p, double* largest, bool* largest_touching) {
    *largest = kNaN;
    *largest_touching = false;
    if constexpr (N <= 2) {
        double roots[2];
        bool touching[2];
        const int m = all_positive_roots<Fma>(p, roots, touching);
        if (m > 0) *largest = roots[m - 1], *largest_touching = touching[m - 1];
        return m;
    } else {
        const int v = sign_variations(p);
        if (v == 0) return 0;
        if (v == 1) {
            *largest = single_positive_root<Fma>(p);
            return 1;
        }
        if constexpr (N == 4) {
            const int count = isolated_positive_roots<Fma>(p, v, largest);
            if (count >= 0) return count;
        }
        return scan_pieces<Fma>(p, nullptr, nullptr, largest, largest_touching);
    }
}

// Polishing on the (exactly rescaled) original polynomial: Newton steps whose
// residual p(y) comes from compensated Horner, so the root is accurate even
// where plain Horner cancels; a step is kept only if it lowers that residual,
// so polishing never makes a root worse.
template <bool Fma, int N>
double polish(const Poly<N>& p, double y) {
    double f = eval_compensated<Fma>(p, y);
    for (int it = 0; it < kPolishSteps && f != 0.0; ++it) {
        const double next = y - f / eval_derivative<Fma>(p, y);
        if (!(next > 0.0) || next == y || !std::isfinite(next)) break;
        const double f_next = eval_compensated<Fma>(p, next);
        if (!(std::fabs(f_next) < std::fabs(f))) break;
        // Newton converges quadratically: after a step this small the error
        // left is below rounding
        const bool converged = std::fabs(next - y) <= kPolishDone * next;
        y = next;
        f = f_next;
        if (converged) break;
    }
    return y;
}

// ----------------------------------------------------------------- one row

// Rescales sum_{i=lo..n} a[i] R^i (ascending, a[lo] != 0, a[n] != 0, lo < n)
// to sum c[i - lo] y^(i - lo) with R = 2^k y, exactly (powers of two only),
// the leading coefficient in [1, 2) and every other |c_i| < 1. Returns false
// when a nonzero coefficient lands below kTiny.
inline bool rescale(const double* a, int lo, int n, double* c, int& k) {
    const int e_lead = exponent_of(a[n]);
    int scale = INT_MIN;
    for (int i = lo; i < n; ++i) {
        if (a[i] == 0.0) continue;
        // smallest k with 2^((n - i) k) >= 2^(e_i - e_lead + 1) > |a_i / a_n|
        scale = std::max(scale, ceil_div(exponent_of(a[i]) - e_lead + 1, n - i));
    }
    const double sign = a[n] > 0.0 ? 1.0 : -1.0;
    bool representable = true;
    for (int i = lo; i <= n; ++i) {
        const double v = sign * times_pow2(a[i], -e_lead - (n - i) * scale);
        representable &= a[i] == 0.0 || std::fabs(v) >= kTiny;
        c[i - lo] = v;
    }
    k = scale;
    return representable;
}

// rescale() for the common case of a full quartic (a[0] != 0, a[4] != 0),
// unrolled. Returns false (and leaves the row to rescale()) when a shift
// leaves the normal exponent range or a coefficient lands below kTiny.
inline bool rescale_quartic(const double* a, Poly<4>& p, int& k) {
    const int e_lead = exponent_of(a[4]);
    // smallest k with 2^((4 - i) k) >= 2^(e_i - e_lead + 1) > |a_i / a_4|
    int scale = (exponent_of(a[0]) - e_lead + 4) >> 2;  // ceil((e_0 - e_lead + 1) / 4)
    if (a[1] != 0.0) scale = std::max(scale, ceil_div(exponent_of(a[1]) - e_lead + 1, 3));
    if (a[2] != 0.0) scale = std::max(scale, (exponent_of(a[2]) - e_lead + 2) >> 1);
    if (a[3] != 0.0) scale = std::max(scale, exponent_of(a[3]) - e_lead + 1);
    const int shift_lead = -e_lead, shift_const = -e_lead - 4 * scale;
    if (std::min(shift_lead, shift_const) < -1022 || std::max(shift_lead, shift_const) > 1023) return false;
    const double sign = a[4] > 0.0 ? 1.0 : -1.0;
    double smallest = 2.0;
    for (int i = 0; i <= 4; ++i) {
        p.c[i] = sign * times_pow2(a[i], -e_lead - (4 - i) * scale);
        smallest = std::min(smallest, a[i] == 0.0 ? 2.0 : std::fabs(p.c[i]));
    }
    k = scale;
    return smallest >= kTiny;
}

template <bool Fma, int N>
QuarticSolution finish(const Poly<N>& p, int k) {
    double y;
    bool touching;
    int count;
    if constexpr (N == 4) {
        if (p.c[1] == 0.0 && p.c[3] == 0.0) {
            // biquadratic: a quadratic in x = y^2 with the cancellation-free pair
            // of root formulas, then back to y
            double x[2];
            count = quadratic_positive<Fma>(p.c[4], p.c[2], p.c[0], x, &touching);
            if (count == 0) return {kNaN, 0};
            // the closed form is accurate to a few ulps: nothing to polish
            return {times_pow2(std::sqrt(x[count - 1]), k), static_cast<std::int8_t>(count)};
        } else {
            count = largest_positive_root<Fma>(p, &y, &touching);
        }
    } else {
        count = largest_positive_root<Fma>(p, &y, &touching);
    }
    if (count == 0) return {kNaN, 0};
    if constexpr (N >= 2) {
        if (!touching) y = polish<Fma>(p, y);
    }
    return {times_pow2(y, k), static_cast<std::int8_t>(count)};
}

// sum_{i=lo..n} a[i] R^(i - lo) with a[lo] != 0, a[n] != 0, lo < n, in one
// scaling (coefficients that underflow are dropped).
template <bool Fma>
QuarticSolution solve_scaled(const double* c, int m, int k) {
    int lo = 0;
    while (lo < m && c[lo] == 0.0) ++lo;  // underflowed to zero: a negligible root
    switch (m - lo) {
        case 1: {
            const double y = -c[lo] / c[m];
            if (!(y > 0.0)) return {kNaN, 0};
            return {times_pow2(y, k), 1};
        }
        case 2: return finish<Fma>(Poly<2>{{c[lo], c[lo + 1], c[lo + 2]}}, k);
        case 3: return finish<Fma>(Poly<3>{{c[lo], c[lo + 1], c[lo + 2], c[lo + 3]}}, k);
        case 4: return finish<Fma>(Poly<4>{{c[0], c[1], c[2], c[3], c[4]}}, k);
        default: return {kNaN, 0};
    }
}

template <bool Fma>
QuarticSolution solve_cluster(const double* a, int lo, int n) {
    double c[5] = {};
    int k;
    rescale(a, lo, n, c, k);
    return solve_scaled<Fma>(c, n - lo, k);
}

// Rows whose roots fall into clusters too far apart for one scaling: split the
// Newton polygon (upper hull of (i, log2|a_i|)) where the root magnitude of
// consecutive edges jumps by more than kClusterGap, and solve each cluster's
// terms alone.
template <bool Fma>
QuarticSolution solve_clusters(const double* a, int lo, int n) {
    int hull[5];
    double lg[5];
    int h = 0;
    for (int i = lo; i <= n; ++i) {
        if (a[i] == 0.0) continue;
        lg[i] = std::log2(std::fabs(a[i]));
        while (h >= 2) {
            const int i0 = hull[h - 2], i1 = hull[h - 1];
            const double cross = (i1 - i0) * (lg[i] - lg[i0]) - (lg[i1] - lg[i0]) * (i - i0);
            if (cross < 0.0) break;
            --h;
        }
        hull[h++] = i;
    }
    int cuts[5];
    int n_cuts = 0;
    cuts[n_cuts++] = hull[0];
    for (int j = 1; j + 1 < h; ++j) {
        const double mag_below = (lg[hull[j - 1]] - lg[hull[j]]) / (hull[j] - hull[j - 1]);
        const double mag_above = (lg[hull[j]] - lg[hull[j + 1]]) / (hull[j + 1] - hull[j]);
        if (mag_above - mag_below > kClusterGap) cuts[n_cuts++] = hull[j];
    }
    cuts[n_cuts++] = hull[h - 1];

    QuarticSolution total{kNaN, 0};
    for (int j = 0; j + 1 < n_cuts; ++j) {
        const QuarticSolution part = solve_cluster<Fma>(a, cuts[j], cuts[j + 1]);
        total.n_positive = static_cast<std::int8_t>(total.n_positive + part.n_positive);
        if (part.root > 0.0) total.root = part.root;  // clusters come in ascending magnitude
    }
    return total;
}

template <bool Fma>
QuarticSolution solve_row_impl(const double* coeffs) {
    // ascending: a[i] multiplies R^i
    const double a[5] = {coeffs[4], coeffs[3], coeffs[2], coeffs[1], coeffs[0]};
    for (double v : a) {
        if (!std::isfinite(v)) return {kNaN, 0};
    }
    if (a[4] != 0.0 && a[0] != 0.0) {  // the common case: a full quartic
        if (a[1] == 0.0 && a[3] == 0.0) {
            // biquadratic with moderate exponents: no rescaling needed, since
            // products of two coefficients and x = R^2 stay in the normal range
            const int e4 = exponent_of(a[4]), e2 = a[2] != 0.0 ? exponent_of(a[2]) : 0, e0 = exponent_of(a[0]);
            if (std::max({std::abs(e4), std::abs(e2), std::abs(e0)}) <= 400) {
                const double sign = a[4] > 0.0 ? 1.0 : -1.0;
                double x[2];
                bool touching;
                const int count = quadratic_positive<Fma>(sign * a[4], sign * a[2], sign * a[0], x, &touching);
                if (count == 0) return {kNaN, 0};
                return {std::sqrt(x[count - 1]), static_cast<std::int8_t>(count)};
            }
        }
        Poly<4> p;
        int k;
        if (rescale_quartic(a, p, k)) return finish<Fma>(p, k);
    }
    int n = 4;
    while (n >= 0 && a[n] == 0.0) --n;
    if (n <= 0) return {kNaN, 0};  // all zero (every R solves it) or a nonzero constant
    int lo = 0;
    while (a[lo] == 0.0) ++lo;  // factors of R: R = 0 is not a positive root
    if (lo == n) return {kNaN, 0};
    double c[5] = {};
    int k;
    if (!rescale(a, lo, n, c, k)) return solve_clusters<Fma>(a, lo, n);
    return solve_scaled<Fma>(c, n - lo, k);
}

using RowSolver = QuarticSolution (*)(const double*);

NORMFAST_FLATTEN QuarticSolution solve_row_native(const double* coeffs) {
    return solve_row_impl<NORMFAST_NATIVE_FMA != 0>(coeffs);
}

#if NORMFAST_FMA_DISPATCH
__attribute__((target("fma"))) NORMFAST_FLATTEN QuarticSolution solve_row_fma(const double* coeffs) {
    return solve_row_impl<true>(coeffs);
}
#endif

RowSolver pick_row_solver() {
#if NORMFAST_FMA_DISPATCH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("fma")) return solve_row_fma;
#endif
    return solve_row_native;
}

}  // namespace

QuarticSolution solve_quartic_row(const double* coeffs) noexcept {
    static const RowSolver solver = pick_row_solver();
    return solver(coeffs);
}

void solve_quartic_batch(const double* rows, std::size_t n_rows, double* roots,
                         std::int8_t* n_positive, int threads) noexcept {
    static const RowSolver solver = pick_row_solver();
    const std::ptrdiff_t n = static_cast<std::ptrdiff_t>(n_rows);
#ifdef _OPENMP
    const int team = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(team) if (n >= 4096)
#else
    (void)threads;
#endif
    for (std::ptrdiff_t i = 0; i < n; ++i) {
        const QuarticSolution s = solver(rows + 5 * i);
        roots[i] = s.root;
        n_positive[i] = s.n_positive;
    }
}

int default_threads() noexcept {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

}  // namespace normfast

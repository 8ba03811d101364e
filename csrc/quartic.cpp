// Batched real-root solver for a R^4 + b R^3 + c R^2 + d R + e = 0.
// See quartic.hpp for the contract; this file holds the method.
//
// Per row:
//   1. Non-finite rows, leading zeros (lower degree) and trailing zeros (roots
//      at R = 0, never positive) are dealt with; the rest is rescaled exactly
//      (powers of two) so that every root has |y| < 2 (rescale). Rows whose
//      root clusters lie too far apart for one scaling are split along their
//      Newton polygon and each cluster is solved alone (solve_clusters).
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
//      compensated residual (polish).
//
// Many rows: the batch path runs steps 1-6 for a block of rows stage by
// stage, the arithmetic of four rows at a time as vector operations, and
// refines the bracketed roots in lanes that each take the next row as soon
// as theirs has converged (solve_rows_in_lanes). Rows off the common path
// (full quartics with moderate exponents, or biquadratics) take the one-row
// path. The lane code and the one-row code are the same templates, so a row
// gets the same result, bit for bit, whichever path it takes.
//
// Build note: compile with -ffp-contract=off. The compensated evaluation
// relies on every product and sum being rounded separately; fused
// multiply-adds are used only where written out (madd, two_prod).
//
// Everything below is templated on the polynomial degree (so Horner loops
// unroll) and on whether fused multiply-add is used. On x86-64 the solver is
// compiled for the baseline ISA and for FMA-capable CPUs (the batch path also
// for AVX2), and picks one at run time; results with and without FMA agree to
// rounding.
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

// Vector extensions for the batch path; elsewhere it runs one row at a time.
#if defined(__GNUC__) || defined(__clang__)
#define NORMFAST_VECTORS 1
#else
#define NORMFAST_VECTORS 0
#endif

#if defined(__GNUC__) && !defined(__clang__)
// vector arguments of internal, always inlined helpers: no ABI is involved
#pragma GCC diagnostic ignored "-Wpsabi"
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
// separately: at one cluster's scale the other's terms are below 2^-64
// relative, under double rounding. In one scaling, roots far below the
// largest make p and its derivatives tiny there, and the products of the
// iteration underflow; with no gap above 2^64 (at most three gaps between
// four roots) they stay clear of that. A row whose roots may lie more than
// 2^-kDeepRoots below its scale (by exponents: see roots_far_below) has its
// Newton polygon checked for such gaps.
constexpr double kClusterGap = 64.0;
constexpr int kDeepRoots = 60;

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

// ------------------------------------------------------------- lanes

// The arithmetic of the common path is written once for a value type V:
// double (one row) or, with GCC/Clang vector extensions, Vec (kWidth rows,
// one per lane). Every scalar operation becomes one IEEE operation per lane,
// so a row gets bit for bit the same result whichever way it is solved.
// Comparisons give bool for double and an all-ones/all-zeros lane mask for
// Vec; select() and the bitwise operators work on both.
inline double select(bool m, double a, double b) { return m ? a : b; }
inline bool same(bool a, bool b) { return a == b; }
inline bool negation(bool m) { return !m; }
inline double abs_of(double x) { return std::fabs(x); }

template <class V>
struct LaneTypes {
    using Mask = bool;
    using Count = int;
};

template <class V>
using MaskOf = typename LaneTypes<V>::Mask;
template <class V>
using CountOf = typename LaneTypes<V>::Count;

template <class V>
inline V splat(double x) {
    return x;
}

// counts: one_if(mask) is 1 where the mask holds, 0 elsewhere
inline int one_if(bool m) { return m; }
inline int select(bool m, int a, int b) { return m ? a : b; }
template <class C>
inline C constant(int x) {
    return x;
}

#if NORMFAST_VECTORS
constexpr int kWidth = 4;
typedef double Vec __attribute__((vector_size(kWidth * sizeof(double))));
typedef std::int64_t VecMask __attribute__((vector_size(kWidth * sizeof(double))));

template <>
struct LaneTypes<Vec> {
    using Mask = VecMask;
    using Count = VecMask;
};

inline Vec select(VecMask m, Vec a, Vec b) {
    return reinterpret_cast<Vec>((reinterpret_cast<VecMask>(a) & m) | (reinterpret_cast<VecMask>(b) & ~m));
}
inline VecMask same(VecMask a, VecMask b) { return ~(a ^ b); }
inline VecMask negation(VecMask m) { return ~m; }
inline Vec abs_of(Vec x) {
    return reinterpret_cast<Vec>(reinterpret_cast<VecMask>(x) & std::numeric_limits<std::int64_t>::max());
}
template <>
inline Vec splat<Vec>(double x) {
    Vec r;
    for (int l = 0; l < kWidth; ++l) r[l] = x;
    return r;
}

inline VecMask one_if(VecMask m) { return -m; }
inline VecMask select(VecMask m, VecMask a, VecMask b) { return (a & m) | (b & ~m); }
template <>
inline VecMask constant<VecMask>(int x) {
    return VecMask{} + x;
}
#endif

// ------------------------------------------------------------- arithmetic

template <bool Fma>
inline double madd(double a, double b, double c) {
    if constexpr (Fma) {
        return std::fma(a, b, c);
    } else {
        return a * b + c;
    }
}

#if NORMFAST_VECTORS
template <bool Fma>
inline Vec madd(Vec a, Vec b, Vec c) {
    if constexpr (Fma) {
        Vec r;  // compilers turn this into one vector fused multiply-add
        for (int l = 0; l < kWidth; ++l) r[l] = std::fma(a[l], b[l], c[l]);
        return r;
    } else {
        return a * b + c;
    }
}
#endif

// Error-free product: a * b == p + err exactly.
template <bool Fma, class V>
inline V two_prod(V a, V b, V& err) {
    const V p = a * b;
    if constexpr (Fma) {
        err = madd<Fma>(a, b, -p);
    } else {
        // Veltkamp splitting into 26-bit halves (Dekker's product)
        constexpr double kSplit = 134217729.0;  // 2^27 + 1
        const V ta = kSplit * a, a_hi = ta - (ta - a), a_lo = a - a_hi;
        const V tb = kSplit * b, b_hi = tb - (tb - b), b_lo = b - b_hi;
        err = ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo;
    }
    return p;
}

// Error-free sum: a + b == s + err exactly.
template <class V>
inline V two_sum(V a, V b, V& err) {
    const V s = a + b;
    const V bv = s - a;
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

// sum_{i<=N} c[i] y^i, ascending coefficients, c[N] > 0 (in every lane).
template <int N, class V = double>
struct Poly {
    V c[N + 1];
};

template <bool Fma, int N, class V>
inline V eval(const Poly<N, V>& p, V y) {
    V f = p.c[N];
    for (int i = N - 1; i >= 0; --i) f = madd<Fma>(f, y, p.c[i]);
    return f;
}

// p, p' and p''/2 in one pass.
template <bool Fma, int N, class V>
inline void eval_dd(const Poly<N, V>& p, V y, V& f, V& df, V& half_d2f) {
    f = p.c[N];
    df = V{};
    half_d2f = V{};
    for (int i = N - 1; i >= 0; --i) {
        half_d2f = madd<Fma>(half_d2f, y, df);
        df = madd<Fma>(df, y, f);
        f = madd<Fma>(f, y, p.c[i]);
    }
}

template <bool Fma, int N, class V>
inline V eval_derivative(const Poly<N, V>& p, V y) {
    V df = static_cast<double>(N) * p.c[N];
    for (int i = N - 1; i >= 1; --i) df = madd<Fma>(df, y, static_cast<double>(i) * p.c[i]);
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
template <bool Fma, int N, class V>
inline V eval_compensated(const Poly<N, V>& p, V y) {
    V s = p.c[N];
    V correction{};
    for (int i = N - 1; i >= 0; --i) {
        V prod_err, sum_err;
        const V prod = two_prod<Fma>(s, y, prod_err);
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
template <int N, class V>
inline CountOf<V> sign_variations(const Poly<N, V>& p) {
    using Mask = MaskOf<V>;
    CountOf<V> v = constant<CountOf<V>>(0);
    Mask negative{};  // c[N] > 0
    for (int i = N - 1; i >= 0; --i) {
        const Mask nonzero = p.c[i] != 0.0;
        const Mask neg = p.c[i] < 0.0;
        v += one_if(nonzero & (neg != negative));
        negative = select(nonzero, neg, negative);
    }
    return v;
}

// ------------------------------------------------------------- root finding

// The real roots of c2 y^2 + c1 y + c0 (c2 > 0), ascending: none (`real`
// false), a double root (`touching`: the discriminant within its rounding
// error of zero, the touching test of quartic.hpp at the vertex; lo = hi =
// the vertex), or two.
template <class V>
struct QuadraticRoots {
    V lo, hi;
    MaskOf<V> real, touching;
};

inline double sqrt_of(double x) { return std::sqrt(x); }
inline double copysign_of(double x, double s) { return std::copysign(x, s); }
#if NORMFAST_VECTORS
inline Vec sqrt_of(Vec x) {
    Vec r;  // compilers turn this into one vector square root
    for (int l = 0; l < kWidth; ++l) r[l] = std::sqrt(x[l]);
    return r;
}
inline Vec copysign_of(Vec x, Vec s) {
    const VecMask sign_bit = VecMask{} + std::numeric_limits<std::int64_t>::min();
    return reinterpret_cast<Vec>((reinterpret_cast<VecMask>(x) & ~sign_bit) | (reinterpret_cast<VecMask>(s) & sign_bit));
}
#endif

template <bool Fma, class V>
inline QuadraticRoots<V> quadratic_roots(V c2, V c1, V c0) {
    V w_err, sq_err;
    const V w = two_prod<Fma>(4.0 * c2, c0, w_err);
    const V sq = two_prod<Fma>(c1, c1, sq_err);
    const V disc = (sq - w) + (sq_err - w_err);
    const V tol = kTouchFactor * kEps * (3.0 * sq + abs_of(w));
    const MaskOf<V> no_real = disc < -tol;
    const MaskOf<V> touching = (disc <= tol) & negation(no_real);
    const V vertex = -c1 / (2.0 * c2);
    // two roots from the two formulas that do not cancel (where disc > tol;
    // elsewhere the square root of 0 keeps std::sqrt off its error path)
    const V q = -0.5 * (c1 + copysign_of(sqrt_of(select(disc > tol, disc, V{})), c1));
    const V y1 = q / c2, y2 = c0 / q;
    const MaskOf<V> swap = y1 > y2;
    return {select(touching, vertex, select(swap, y2, y1)), select(touching, vertex, select(swap, y1, y2)),
            negation(no_real), touching};
}

// Distinct positive roots of c2 y^2 + c1 y + c0 (c2 > 0), ascending. A double
// root comes back once with *touching set.
template <bool Fma>
int quadratic_positive(double c2, double c1, double c0, double* out, bool* touching) {
    const QuadraticRoots<double> r = quadratic_roots<Fma>(c2, c1, c0);
    *touching = false;
    if (!r.real) return 0;
    if (r.touching) {
        if (!(r.lo > 0.0)) return 0;
        out[0] = r.lo;
        *touching = true;
        return 1;
    }
    int m = 0;
    if (r.lo > 0.0) out[m++] = r.lo;
    if (r.hi > 0.0) out[m++] = r.hi;
    return m;
}

// p at the sample points (f[0] = p(kBound)). Horner on all points at once:
// independent chains, no dependency stalls.
template <bool Fma, int N, class V>
inline void sample_values(const Poly<N, V>& p, V* f) {
    for (int j = 0; j < kGrid; ++j) f[j] = p.c[N];
    for (int i = N - 1; i >= 0; --i) {
        for (int j = 0; j < kGrid; ++j) f[j] = madd<Fma>(f[j], splat<V>(kGridPoint[j]), p.c[i]);
    }
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
            sample_values<Fma>(p, f);
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

// The iteration inside a piece: the current point, the bracket (lo, hi) and
// the last two step lengths (the safeguard's memory).
template <class V>
struct RefineState {
    V y, lo, hi, last_step, step_before_last;
    typename LaneTypes<V>::Mask rising;  // p(lo) < 0
    typename LaneTypes<V>::Count iterations;
};

template <bool Fma, int N>
inline RefineState<double> refine_start(const Poly<N>& p, const Piece& s) {
    const double width = s.hi - s.lo;
    return {initial_guess<Fma>(p, s), s.lo, s.hi, width, width, s.f_lo < 0.0, 0};
}

// One step of the root iteration inside a piece (where p(lo), p(hi) differ in
// sign; p need not be monotone there). Halley steps (cubic convergence) close
// to the root; away from it, where Halley's correction to the Newton step is
// large (and Halley would be drawn to an extremum of p), plain Newton steps;
// bisection whenever a step leaves the bracket or fails to halve the step
// before last. Stops once a Halley step is below kStopStep relative and a
// tenth of the step before. Returns true when the iteration is over, the root
// then in *root. Written with selects rather than branches, so that several
// iterations on different rows can run interleaved (refine_rows).
template <bool Fma, int N, class V>
inline typename LaneTypes<V>::Mask refine_step(const Poly<N, V>& p, RefineState<V>& s, V* root) {
    const V y = s.y;
    V f, df, half_d2f;
    eval_dd<Fma>(p, y, f, df, half_d2f);
    const auto left_of_root = same(f < 0.0, s.rising);
    const V lo = select(left_of_root, y, s.lo);
    const V hi = select(left_of_root, s.hi, y);
    // Halley: y - f f' / (f'^2 - f f''/2), Newton: y - f / f'; Halley where its
    // correction to Newton, f f''/(2 f'^2), is at most 1/2. One division.
    const V df2 = df * df, f_curv = f * half_d2f;
    const auto halley = abs_of(f_curv) <= 0.5 * df2;  // false for NaN
    const V candidate = y - select(halley, f * df, f) / select(halley, df2 - f_curv, df);
    const auto inside = (candidate >= lo) & (candidate <= hi);  // false for NaN/inf
    const V step = abs_of(candidate - y);
    // converged: a small step that is also much smaller than the one before
    // (near a close pair of roots Halley first creeps linearly)
    const auto converged =
        inside & halley & (step <= kStopStep * abs_of(candidate)) & (step <= 0.1 * s.last_step);
    const V next = select(inside & (step <= 0.5 * s.step_before_last), candidate, 0.5 * (lo + hi));
    const auto collapsed = hi - lo <= 4.0 * kEps * hi;
    const auto exact_zero = f == 0.0;
    *root = select(exact_zero, y, select(converged, candidate, next));
    s.lo = lo, s.hi = hi;
    s.step_before_last = s.last_step;
    s.last_step = abs_of(next - y);
    s.y = next;
    s.iterations += 1;
    return exact_zero | converged | collapsed | (s.iterations >= kMaxIterations);
}

// The root of p inside the piece, by refine_step from initial_guess.
template <bool Fma, int N>
double refine(const Poly<N>& p, const Piece& piece) {
    RefineState<double> s = refine_start<Fma>(p, piece);
    double root;
    while (!refine_step<Fma>(p, s, &root)) {
    }
    return root;
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
template <class V = double>
struct Tracked {
    V v, m;  // value, and its magnitude as above
};

// gamma_64 with a factor 2 of headroom for the rounding of m itself
constexpr double kChainError = 2.0 * 64.0 * (kEps / 2.0);

template <class V>
inline Tracked<V> exact(V v) {
    return {v, abs_of(v)};
}

// x1 y1 - x2 y2
template <bool Fma, class V>
inline Tracked<V> cross(Tracked<V> x1, Tracked<V> y1, Tracked<V> x2, Tracked<V> y2) {
    return {madd<Fma>(x1.v, y1.v, -(x2.v * y2.v)), madd<Fma>(x1.m, y1.m, x2.m * y2.m)};
}

// The sign of a tracked value: +1/-1 when certain, 0 for an exact zero, and
// `kUnsure` when the value is within its error bound of zero.
constexpr int kUnsure = 2;
template <class V>
inline CountOf<V> sign_of(const Tracked<V>& t) {
    using Count = CountOf<V>;
    return select(t.m == 0.0, constant<Count>(0),
                  select(abs_of(t.v) <= kChainError * t.m, constant<Count>(kUnsure),
                         select(t.v > 0.0, constant<Count>(1), constant<Count>(-1))));
}

// -prem(A, B) for deg A = M, deg B = M - 1 (descending coefficients): the
// remainder of A / B times lead(B)^2 > 0, negated, as Sturm's chain needs.
template <bool Fma, int M, class V>
inline void negated_pseudo_remainder(const Tracked<V>* a, const Tracked<V>* b, Tracked<V>* out) {
    const Tracked<V> zero{V{}, V{}};
    Tracked<V> step[M];  // lead(B) A - lead(A) y B, degree M - 1
    for (int i = 0; i < M; ++i) step[i] = cross<Fma>(b[0], a[i + 1], a[0], i + 1 < M ? b[i + 1] : zero);
    for (int i = 0; i + 1 < M; ++i) {
        const Tracked<V> next = cross<Fma>(b[0], step[i + 1], step[0], b[i + 1]);
        out[i] = {-next.v, next.m};
    }
}

// The entries of a quartic's Sturm chain p, p', s2, s3, s4 that are not
// read off p directly: the leading and constant coefficients of s2 and s3,
// and the constant s4.
template <class V = double>
struct SturmEnds {
    Tracked<V> s2_lead, s2_const, s3_lead, s3_const, s4;
};

template <bool Fma, class V>
inline SturmEnds<V> sturm_chain(const Poly<4, V>& p) {
    const Tracked<V> s0[5] = {exact(p.c[4]), exact(p.c[3]), exact(p.c[2]), exact(p.c[1]), exact(p.c[0])};
    const Tracked<V> s1[4] = {exact(4.0 * p.c[4]), exact(3.0 * p.c[3]), exact(2.0 * p.c[2]), exact(p.c[1])};
    Tracked<V> s2[3], s3[2], s4[1];
    negated_pseudo_remainder<Fma, 4>(s0, s1, s2);
    negated_pseudo_remainder<Fma, 3>(s1, s2, s3);
    negated_pseudo_remainder<Fma, 2>(s2, s3, s4);
    return {s2[0], s2[2], s3[0], s3[1], s4[0]};
}

// Sign changes in a sequence of signs, zeros skipped.
template <class Count>
inline Count sign_changes(const Count* signs, int n) {
    Count v = constant<Count>(0), last = constant<Count>(0);
    for (int i = 0; i < n; ++i) {
        const auto nonzero = signs[i] != 0;
        v += one_if(nonzero & (last != 0) & (signs[i] != last));
        last = select(nonzero, signs[i], last);
    }
    return v;
}

// Number of distinct positive roots of a quartic by Sturm's theorem, with
// every sign in the chain certified by ball arithmetic; -1 when a sign is
// not certain (near-multiple roots, degenerate chains) or the coefficients
// are too small for the chain's products.
template <class V>
inline CountOf<V> sturm_positive_count(const Poly<4, V>& p, const SturmEnds<V>& chain, CountOf<V> variations) {
    using Count = CountOf<V>;
    using Mask = MaskOf<V>;
    constexpr double kSmallest = 0x1p-60;
    Mask uncertain{};
    for (int i = 0; i <= 4; ++i) uncertain = uncertain | ((p.c[i] != 0.0) & (abs_of(p.c[i]) < kSmallest));
    const Count at_zero[5] = {select(p.c[0] > 0.0, constant<Count>(1), constant<Count>(-1)),
                              sign_of(exact(p.c[1])), sign_of(chain.s2_const), sign_of(chain.s3_const),
                              sign_of(chain.s4)};
    const Count at_inf[5] = {constant<Count>(1), constant<Count>(1), sign_of(chain.s2_lead),
                             sign_of(chain.s3_lead), sign_of(chain.s4)};
    for (int i = 0; i < 5; ++i) {
        uncertain = uncertain | (at_zero[i] == kUnsure) | (at_inf[i] == kUnsure);
        if (i >= 2) uncertain = uncertain | (at_inf[i] == 0);
    }
    const Count count = sign_changes(at_zero, 5) - sign_changes(at_inf, 5);
    // Descartes: count <= variations and of the same parity (all roots simple here)
    uncertain = uncertain | (count < 0) | (count > variations) | (((variations - count) & 1) != 0);
    return select(uncertain, constant<Count>(-1), count);
}

// The outcome of bracketing a full quartic: the number of distinct positive
// roots (-1: not settled here), and the sample cell (y_{cell+1}, y_cell) that
// holds the largest one, with y_kGrid = 0.
template <class V>
struct SampleBracket {
    CountOf<V> count, cell;
};

// Bracketing from the sample values f and the Sturm chain. No sign variation:
// no positive root. One: one root, and (p(0) < 0 < p(kBound)) the samples on
// its right come first in descending y, so their number is the cell (narrow()
// on the piece (0, kBound)). More: the certified Sturm count, and when the
// samples change sign as often, each root sits alone in a cell and the highest
// such cell holds the largest; otherwise (or on a sample that is exactly a
// root) -1.
template <class V>
inline SampleBracket<V> bracket_cells(const Poly<4, V>& p, const V* f, const SturmEnds<V>& chain) {
    using Count = CountOf<V>;
    using Mask = MaskOf<V>;
    const Count variations = sign_variations(p);
    Count n_right = constant<Count>(0);
    for (int j = 1; j < kGrid; ++j) n_right += one_if(f[j] >= 0.0);
    Count changes = constant<Count>(0), highest = constant<Count>(0);
    Mask on_root{};
    Mask below_negative = p.c[0] < 0.0;  // the sign at the sample below: 0, y_7, ..., y_0 ascending
    for (int j = kGrid - 1; j >= 0; --j) {
        const Mask negative = f[j] < 0.0;
        const Mask change = negative != below_negative;
        changes += one_if(change);
        highest = select(change, constant<Count>(j), highest);
        on_root = on_root | (f[j] == 0.0);
        below_negative = negative;
    }
    const Count sturm = sturm_positive_count(p, chain, variations);
    const Count isolated =
        select(sturm <= 0, sturm, select(on_root | (changes != sturm), constant<Count>(-1), sturm));
    return {select(variations == 0, constant<Count>(0), select(variations == 1, constant<Count>(1), isolated)),
            select(variations == 1, n_right, highest)};
}

// The piece of sample cell `cell` (a SampleBracket's), f the sample values.
inline Piece sample_cell(const Poly<4>& p, const double* f, int cell) {
    const bool from_zero = cell + 1 == kGrid;
    return {from_zero ? 0.0 : kGridPoint[cell + 1], from_zero ? p.c[0] : f[cell + 1], kGridPoint[cell], f[cell],
            false, false};
}

// Distinct positive roots of p, all refined, ascending into `out`; `touching`
// flags double roots. p: c[N] > 0, rescaled so that its roots lie in
// |y| < kBound. Used for derivatives (the extrema of the level above).
template <bool Fma, int N>
int all_positive_roots(const Poly<N>& p, double* out, bool* touching);

// Largest positive root of p into *largest and the number of distinct positive
// roots; *largest_touching when that root is a double root. For degree <= 3
// (full quartics go through bracket_largest first).
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

// The bracket of the one positive root when Descartes allows exactly one:
// p(0) < 0 < p(kBound), narrowed to a sample cell.
template <bool Fma, int N>
Piece single_root_bracket(const Poly<N>& p) {
    Samples<Fma, N> samples(p);
    Piece piece{0.0, p.c[0], kBound, eval<Fma>(p, kBound), false, false};
    narrow(piece, samples.values());
    return piece;
}

// For a full quartic: the number of distinct positive roots, and the largest
// one's bracket (a piece without extrema at its ends) in *largest; -1 when
// only scan_pieces settles the row.
template <bool Fma>
int bracket_largest(const Poly<4>& p, Piece* largest) {
    const int variations = sign_variations(p);
    if (variations == 0) return 0;
    double f[kGrid];
    sample_values<Fma>(p, f);
    // (bracket_cells reads the chain only for two or more variations)
    const SturmEnds<> chain = variations >= 2 ? sturm_chain<Fma>(p) : SturmEnds<>{};
    const SampleBracket<double> b = bracket_cells(p, f, chain);
    if (b.count > 0) *largest = sample_cell(p, f, b.cell);
    return b.count;
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
                out[0] = refine<Fma>(p, single_root_bracket<Fma>(p));
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
            *largest = refine<Fma>(p, single_root_bracket<Fma>(p));
            return 1;
        }
        return scan_pieces<Fma>(p, nullptr, nullptr, largest, largest_touching);
    }
}

// Polishing on the (exactly rescaled) original polynomial: Newton steps whose
// residual p(y) comes from compensated Horner, so the root is accurate even
// where plain Horner cancels; a step is kept only if it lowers that residual,
// so polishing never makes a root worse.
//
// The first step needs no such check when it is below kPolishDone: y was then
// already within about that distance of the root, so the step's own error is
// of order kPolishDone^2 (times the root's conditioning), below rounding. As
// the first Newton step is all that a root from refine() usually needs, this
// saves the second compensated evaluation (polish_first_step).
template <bool Fma, int N, class V>
inline typename LaneTypes<V>::Mask polish_first_step(const Poly<N, V>& p, V y, V* polished) {
    const V next = y - eval_compensated<Fma>(p, y) / eval_derivative<Fma>(p, y);
    *polished = next;
    return (next > 0.0) & (abs_of(next - y) <= kPolishDone * next);
}

template <bool Fma, int N>
double polish(const Poly<N>& p, double y) {
    double first;
    if (polish_first_step<Fma>(p, y, &first)) return first;
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

// Whether the roots of sum a[i] R^i (i = lo..n, a[lo] != 0, rescaled by 2^k)
// may lie below 2^-kDeepRoots after the scaling: Fujiwara's lower bound on
// their moduli, 1/2 min |c_lo / c_i|^(1 / (i - lo)) over the scaled c_i, from
// the exponents (a criterion start_rows evaluates the same way in lanes).
inline bool roots_far_below(const double* a, int lo, int n, int k) {
    bool deep = false;
    for (int i = lo + 1; i <= n; ++i) {
        deep |= a[i] != 0.0 && exponent_of(a[lo]) - exponent_of(a[i]) - (i - lo) * k < -kDeepRoots * (i - lo);
    }
    return deep;
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

// A rescaled full quartic (not biquadratic) on its way through the common
// path: rescaled, then bracketed, then refined and polished. The batch path
// does each stage for many rows at a time (solve_rows).
struct Deferred {
    Poly<4> p;
    int k;  // R = 2^k y
    Piece bracket;
    std::int8_t count;
};

template <bool Fma, int N>
QuarticSolution root_found(const Poly<N>& p, int count, double y, bool touching, int k) {
    if (count == 0) return {kNaN, 0};
    if constexpr (N >= 2) {
        if (!touching) y = polish<Fma>(p, y);
    }
    return {times_pow2(y, k), static_cast<std::int8_t>(count)};
}

// Biquadratic (c1 = c3 = 0): a quadratic in x = y^2 with the cancellation-free
// pair of root formulas, then back to y. The closed form is accurate to a few
// ulps: nothing to polish.
template <bool Fma>
QuarticSolution solve_biquadratic(const Poly<4>& p, int k) {
    double x[2];
    bool touching;
    const int count = quadratic_positive<Fma>(p.c[4], p.c[2], p.c[0], x, &touching);
    if (count == 0) return {kNaN, 0};
    return {times_pow2(std::sqrt(x[count - 1]), k), static_cast<std::int8_t>(count)};
}

// After bracketing (count from bracket_from): returns true with the solution
// in *done, or false when the job's bracket is left to refine and polish.
template <bool Fma>
bool settle(Deferred& job, int count, QuarticSolution* done) {
    if (count > 0) {
        job.count = static_cast<std::int8_t>(count);
        return false;
    }
    if (count == 0) {
        *done = {kNaN, 0};
        return true;
    }
    double y;
    bool touching;
    const int m = scan_pieces<Fma>(job.p, nullptr, nullptr, &y, &touching);
    *done = root_found<Fma>(job.p, m, y, touching, job.k);
    return true;
}

template <bool Fma>
QuarticSolution finish_quartic(Deferred& job) {
    QuarticSolution done;
    if (settle<Fma>(job, bracket_largest<Fma>(job.p, &job.bracket), &done)) return done;
    const double y = polish<Fma>(job.p, refine<Fma>(job.p, job.bracket));
    return {times_pow2(y, job.k), job.count};
}

template <bool Fma, int N>
QuarticSolution finish(const Poly<N>& p, int k) {
    if constexpr (N == 4) {
        if (p.c[1] == 0.0 && p.c[3] == 0.0) return solve_biquadratic<Fma>(p, k);
        Deferred job{p, k, {}, 0};
        return finish_quartic<Fma>(job);
    } else {
        double y;
        bool touching;
        const int count = largest_positive_root<Fma>(p, &y, &touching);
        return root_found<Fma>(p, count, y, touching, k);
    }
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
// The cuts (indices into a) between root clusters of sum a[i] R^i, i = lo..n:
// returns their number, the two ends included (2: a single cluster).
inline int cluster_cuts(const double* a, int lo, int n, int* cuts) {
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
    int n_cuts = 0;
    cuts[n_cuts++] = hull[0];
    for (int j = 1; j + 1 < h; ++j) {
        const double mag_below = (lg[hull[j - 1]] - lg[hull[j]]) / (hull[j] - hull[j - 1]);
        const double mag_above = (lg[hull[j]] - lg[hull[j + 1]]) / (hull[j + 1] - hull[j]);
        if (mag_above - mag_below > kClusterGap) cuts[n_cuts++] = hull[j];
    }
    cuts[n_cuts++] = hull[h - 1];
    return n_cuts;
}

template <bool Fma>
QuarticSolution solve_clusters(const double* a, int lo, int n) {
    int cuts[5];
    const int n_cuts = cluster_cuts(a, lo, n, cuts);
    QuarticSolution total{kNaN, 0};
    for (int j = 0; j + 1 < n_cuts; ++j) {
        const QuarticSolution part = solve_cluster<Fma>(a, cuts[j], cuts[j + 1]);
        total.n_positive = static_cast<std::int8_t>(total.n_positive + part.n_positive);
        if (part.root > 0.0) total.root = part.root;  // clusters come in ascending magnitude
    }
    return total;
}

// Marks a row left in a Deferred job (no row ever has a negative count).
constexpr QuarticSolution kDeferred{0.0, -1};

// One row, up to the rescaling: the solution, or kDeferred for a full quartic
// (its scaled polynomial in *job) that takes the common path.
template <bool Fma>
QuarticSolution solve_or_defer(const double* coeffs, Deferred* job) {
    // ascending: a[i] multiplies R^i
    const double a[5] = {coeffs[4], coeffs[3], coeffs[2], coeffs[1], coeffs[0]};
    {
        bool none_negative = true, none_positive = true;
        for (double v : a) none_negative &= v >= 0.0, none_positive &= v <= 0.0;
        if (none_negative | none_positive) return {kNaN, 0};
    }
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
        if (rescale_quartic(a, p, k)) {
            if (p.c[1] == 0.0 && p.c[3] == 0.0) return solve_biquadratic<Fma>(p, k);
            if (roots_far_below(a, 0, 4, k)) {
                int cuts[5];
                if (cluster_cuts(a, 0, 4, cuts) > 2) return solve_clusters<Fma>(a, 0, 4);
            }
            job->p = p;
            job->k = k;
            return kDeferred;
        }
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
    if (roots_far_below(a, lo, n, k)) {
        int cuts[5];
        if (cluster_cuts(a, lo, n, cuts) > 2) return solve_clusters<Fma>(a, lo, n);
    }
    return solve_scaled<Fma>(c, n - lo, k);
}

template <bool Fma>
QuarticSolution solve_row_impl(const double* coeffs) {
    Deferred job;
    const QuarticSolution s = solve_or_defer<Fma>(coeffs, &job);
    return s.n_positive >= 0 ? s : finish_quartic<Fma>(job);
}

// ----------------------------------------------------------- many rows

// The batch path: the same stages as solve_row_impl, but each stage for a
// block of rows before the next, so that the arithmetic of kWidth rows runs
// as one vector operation. Rows are loaded, checked, rescaled and bracketed
// kWidth at a time (start_rows); those with a root to find are refined in
// lanes that take the next row as soon as theirs has converged, since rows
// need different numbers of steps (refine_rows); then polished (polish_rows).
// Biquadratics with moderate exponents get their closed form in lanes too.
// Rows off the common path (lower degree, zero or non-finite coefficients,
// extreme exponents, distant root clusters, roots not isolated by the
// samples) are solved one at a time by solve_row_impl or its scan_pieces
// branch. Each row goes through exactly the operations of solve_row_impl, so
// it gets the same result either way.
constexpr int kBlock = 256;

#if NORMFAST_VECTORS

// Rows in flight in refine_rows: kGroups independent vectors, so that one's
// division overlaps another's evaluation.
constexpr int kGroups = 2;

// The rows of a block left to refine and polish, one array per quantity.
struct Jobs {
    int n = 0;
    alignas(32) double c[5][kBlock];  // scaled polynomial
    alignas(32) double y[kBlock];     // refine()'s starting point, then the root
    alignas(32) double lo[kBlock], hi[kBlock];
    bool rising[kBlock];  // p(lo) < 0
    int k[kBlock];        // R = 2^k y
    std::int8_t count[kBlock];
    std::ptrdiff_t row[kBlock];
};

// ceil(n / 3) for |n| <= 2200 (exponent differences), as ceil_div(n, 3): the
// division by multiplication, exact on this range.
inline VecMask ceil_third(VecMask n) {
    constexpr int kOffset = 1024;
    return (((n + (2 + 3 * kOffset)) * 21846) >> 16) - kOffset;
}

// 2^e for -1022 <= e <= 1023, exactly (as times_pow2).
inline Vec pow2(VecMask e) { return reinterpret_cast<Vec>((e + 1023) << 52); }

// Rows first .. first + n_rows - 1 (n_rows <= kWidth) up to refinement: those
// on the common path are rescaled (as rescale_quartic) and bracketed (as
// bracket_largest) in lanes; their solution is written, or they join `jobs`.
template <bool Fma>
void start_rows(const double* rows, std::ptrdiff_t first, int n_rows, double* roots, std::int8_t* n_positive,
                Jobs& jobs) {
    Vec a[5];  // a[i]: coefficient of R^i; lanes past n_rows repeat the last row
    for (int l = 0; l < kWidth; ++l) {
        const double* row = rows + 5 * (first + std::min(l, n_rows - 1));
        for (int i = 0; i <= 4; ++i) a[i][l] = row[4 - i];
    }

    // the exponents of the normal, nonzero coefficients
    VecMask e[5], not_normal{};
    for (int i = 0; i <= 4; ++i) {
        const VecMask biased = (reinterpret_cast<VecMask>(a[i]) >> 52) & 0x7ff;
        not_normal |= (biased == 0x7ff) | ((biased == 0) & (a[i] != 0.0));
        e[i] = biased - 1023;
    }
    const VecMask full = (a[4] != 0.0) & (a[0] != 0.0) & ~not_normal;

    // biquadratics with moderate exponents: solve_or_defer's closed form
    const VecMask biquadratic = full & (a[1] == 0.0) & (a[3] == 0.0);
    const VecMask closed = biquadratic & (e[4] >= -400) & (e[4] <= 400) & (e[0] >= -400) & (e[0] <= 400) &
                           ((a[2] == 0.0) | ((e[2] >= -400) & (e[2] <= 400)));
    const Vec sign = select(a[4] > 0.0, splat<Vec>(1.0), splat<Vec>(-1.0));
    bool any_closed = false;
    for (int l = 0; l < kWidth; ++l) any_closed |= closed[l] != 0;
    VecMask x_count{};
    Vec x_root{};
    if (any_closed) {
        const QuadraticRoots<Vec> x = quadratic_roots<Fma>(sign * a[4], sign * a[2], sign * a[0]);
        x_count = select(x.real, select(x.touching, one_if(x.lo > 0.0), one_if(x.lo > 0.0) + one_if(x.hi > 0.0)),
                         constant<VecMask>(0));
        x_root = sqrt_of(select(x_count > 0, select(x.touching, x.lo, x.hi), Vec{}));
    }

    // the common path: rescale_quartic
    VecMask other = ~full | (biquadratic & ~closed);  // solve_row_impl, one row at a time
    const VecMask e_lead = e[4];
    VecMask scale = (e[0] - e_lead + 4) >> 2;
    const VecMask t1 = ceil_third(e[1] - e_lead + 1), t2 = (e[2] - e_lead + 2) >> 1, t3 = e[3] - e_lead + 1;
    scale = select((a[1] != 0.0) & (t1 > scale), t1, scale);
    scale = select((a[2] != 0.0) & (t2 > scale), t2, scale);
    scale = select((a[3] != 0.0) & (t3 > scale), t3, scale);
    const VecMask shift_lead = -e_lead, shift_const = -e_lead - 4 * scale;
    other |= (shift_lead < -1022) | (shift_lead > 1023) | (shift_const < -1022) | (shift_const > 1023);
    // roots_far_below(): the Newton polygon is checked one row at a time
    for (int i = 1; i <= 4; ++i) other |= (a[i] != 0.0) & (e[0] - e[i] - i * scale < -kDeepRoots * i);
    Poly<4, Vec> p;
    for (int i = 0; i <= 4; ++i) {
        p.c[i] = sign * (a[i] * pow2(-e_lead - (4 - i) * scale));
        other |= (a[i] != 0.0) & (abs_of(p.c[i]) < kTiny);
    }
    other &= ~closed;
    const VecMask common = ~(other | closed);
    // lanes off the common path go on with a harmless polynomial (no subnormal
    // or non-finite values to slow the vector unit down)
    for (int i = 0; i <= 4; ++i) p.c[i] = select(common, p.c[i], splat<Vec>(i == 4 ? 1.0 : -0.5));

    bool any_common = false;
    for (int l = 0; l < n_rows; ++l) {
        const std::ptrdiff_t i = first + l;
        roots[i] = closed[l] && x_count[l] > 0 ? x_root[l] : kNaN;
        n_positive[i] = static_cast<std::int8_t>(closed[l] ? x_count[l] : 0);
        if (other[l] != 0) {
            const QuarticSolution s = solve_row_impl<Fma>(rows + 5 * i);
            roots[i] = s.root;
            n_positive[i] = s.n_positive;
        }
        any_common |= common[l] != 0;
    }
    if (!any_common) return;

    Vec f[kGrid];
    sample_values<Fma>(p, f);
    const SampleBracket<Vec> bracket = bracket_cells(p, f, sturm_chain<Fma>(p));
    // sample_cell(), and refine()'s starting point (initial_guess() for a
    // piece without extrema: the secant point)
    Vec lo{}, f_lo = p.c[0], hi{}, f_hi{};
    for (int j = 0; j < kGrid; ++j) {
        const VecMask top = bracket.cell == j, bottom = bracket.cell + 1 == j;
        hi = select(top, splat<Vec>(kGridPoint[j]), hi);
        f_hi = select(top, f[j], f_hi);
        lo = select(bottom, splat<Vec>(kGridPoint[j]), lo);
        f_lo = select(bottom, f[j], f_lo);
    }
    const Vec secant = lo + (hi - lo) * (f_lo / (f_lo - f_hi));
    const Vec guess = select((secant > lo) & (secant < hi), secant, 0.5 * (lo + hi));
    const VecMask refined = common & (bracket.count > 0);

    for (int l = 0; l < n_rows; ++l) {
        const std::ptrdiff_t i = first + l;
        // appended unconditionally, kept where the lane has a root to refine
        const int n = jobs.n;
        for (int d = 0; d <= 4; ++d) jobs.c[d][n] = p.c[d][l];
        jobs.y[n] = guess[l], jobs.lo[n] = lo[l], jobs.hi[n] = hi[l];
        jobs.rising[n] = f_lo[l] < 0.0;
        jobs.k[n] = static_cast<int>(scale[l]);
        jobs.count[n] = static_cast<std::int8_t>(bracket.count[l]);
        jobs.row[n] = i;
        jobs.n = n + (refined[l] != 0);
        if (common[l] != 0 && bracket.count[l] < 0) {
            Deferred job{{{p.c[0][l], p.c[1][l], p.c[2][l], p.c[3][l], p.c[4][l]}},
                         static_cast<int>(scale[l]), {}, 0};
            QuarticSolution s;
            settle<Fma>(job, -1, &s);
            roots[i] = s.root;
            n_positive[i] = s.n_positive;
        }
    }
}

// refine() of every job, from its starting point, into jobs.y.
template <bool Fma>
void refine_rows(Jobs& jobs) {
    const int n = jobs.n;
    if (n == 0) return;
    Poly<4, Vec> p[kGroups];
    RefineState<Vec> state[kGroups];
    int job_of[kGroups][kWidth];
    int next = 0, busy = 0;
    const auto load = [&](int g, int l, int j) {  // as refine_start()
        for (int i = 0; i <= 4; ++i) p[g].c[i][l] = jobs.c[i][j];
        const double width = jobs.hi[j] - jobs.lo[j];
        state[g].y[l] = jobs.y[j], state[g].lo[l] = jobs.lo[j], state[g].hi[l] = jobs.hi[j];
        state[g].last_step[l] = width, state[g].step_before_last[l] = width;
        state[g].rising[l] = jobs.rising[j] ? -1 : 0;
        state[g].iterations[l] = 0;
    };
    for (int g = 0; g < kGroups; ++g) {
        for (int l = 0; l < kWidth; ++l) {
            // a lane without a row iterates on a copy of one (result unused)
            load(g, l, next < n ? next : 0);
            job_of[g][l] = next < n ? next++ : -1;
            busy += job_of[g][l] >= 0;
        }
    }
    while (busy > 0) {
        VecMask done[kGroups];
        Vec root[kGroups];
        for (int g = 0; g < kGroups; ++g) done[g] = refine_step<Fma>(p[g], state[g], &root[g]);
        for (int g = 0; g < kGroups; ++g) {
            for (int l = 0; l < kWidth; ++l) {
                if (!done[g][l] || job_of[g][l] < 0) continue;
                jobs.y[job_of[g][l]] = root[g][l];
                if (next < n) {
                    load(g, l, next);
                    job_of[g][l] = next++;
                } else {
                    job_of[g][l] = -1;
                    --busy;
                }
            }
        }
    }
}

// polish() of every job's root in jobs.y.
template <bool Fma>
void polish_rows(Jobs& jobs) {
    const int n = jobs.n;
    // pad to whole vectors with copies of the last job
    for (int j = n; j < kBlock && j % kWidth != 0; ++j) {
        for (int i = 0; i <= 4; ++i) jobs.c[i][j] = jobs.c[i][n - 1];
        jobs.y[j] = jobs.y[n - 1];
    }
    for (int j = 0; j < n; j += kWidth) {
        Poly<4, Vec> p;
        for (int i = 0; i <= 4; ++i) std::memcpy(&p.c[i], &jobs.c[i][j], sizeof(Vec));
        Vec y, polished;
        std::memcpy(&y, &jobs.y[j], sizeof(Vec));
        const VecMask first_step_enough = polish_first_step<Fma>(p, y, &polished);
        for (int l = 0; l < kWidth && j + l < n; ++l) {
            // as polish(): the first step, or (rarely) the checked steps from the start
            jobs.y[j + l] = first_step_enough[l]
                                ? polished[l]
                                : polish<Fma>(Poly<4>{{p.c[0][l], p.c[1][l], p.c[2][l], p.c[3][l], p.c[4][l]}}, y[l]);
        }
    }
}

template <bool Fma>
void solve_rows_in_lanes(const double* rows, std::ptrdiff_t begin, std::ptrdiff_t end, double* roots,
                         std::int8_t* n_positive) {
    Jobs jobs;
    for (std::ptrdiff_t block = begin; block < end; block += kBlock) {
        const std::ptrdiff_t block_end = std::min<std::ptrdiff_t>(end, block + kBlock);
        jobs.n = 0;
        for (std::ptrdiff_t i = block; i < block_end; i += kWidth) {
            start_rows<Fma>(rows, i, static_cast<int>(std::min<std::ptrdiff_t>(kWidth, block_end - i)), roots,
                            n_positive, jobs);
        }
        refine_rows<Fma>(jobs);
        polish_rows<Fma>(jobs);
        for (int j = 0; j < jobs.n; ++j) {
            roots[jobs.row[j]] = times_pow2(jobs.y[j], jobs.k[j]);
            n_positive[jobs.row[j]] = jobs.count[j];
        }
    }
}

#endif

// Lanes pay off where the vector unit has fused multiply-add (and with it
// 4-lane double vectors and 64-bit lane compares); with plain SSE2 (the
// baseline x86-64 build on a CPU without FMA) the mask arithmetic is slower
// than one row at a time.
template <bool Fma, bool Lanes>
void solve_rows(const double* rows, std::ptrdiff_t begin, std::ptrdiff_t end, double* roots,
                std::int8_t* n_positive) {
#if NORMFAST_VECTORS
    if constexpr (Lanes) {
        solve_rows_in_lanes<Fma>(rows, begin, end, roots, n_positive);
        return;
    }
#endif
    for (std::ptrdiff_t i = begin; i < end; ++i) {
        const QuarticSolution s = solve_row_impl<Fma>(rows + 5 * i);
        roots[i] = s.root;
        n_positive[i] = s.n_positive;
    }
}

using RowSolver = QuarticSolution (*)(const double*);
using RangeSolver = void (*)(const double*, std::ptrdiff_t, std::ptrdiff_t, double*, std::int8_t*);

NORMFAST_FLATTEN QuarticSolution solve_row_native(const double* coeffs) {
    return solve_row_impl<NORMFAST_NATIVE_FMA != 0>(coeffs);
}

NORMFAST_FLATTEN void solve_rows_native(const double* rows, std::ptrdiff_t begin, std::ptrdiff_t end,
                                        double* roots, std::int8_t* n_positive) {
    solve_rows<NORMFAST_NATIVE_FMA != 0, NORMFAST_NATIVE_FMA != 0>(rows, begin, end, roots, n_positive);
}

#if NORMFAST_FMA_DISPATCH
__attribute__((target("fma"))) NORMFAST_FLATTEN QuarticSolution solve_row_fma(const double* coeffs) {
    return solve_row_impl<true>(coeffs);
}

__attribute__((target("fma"))) NORMFAST_FLATTEN void solve_rows_fma(
    const double* rows, std::ptrdiff_t begin, std::ptrdiff_t end, double* roots, std::int8_t* n_positive) {
    solve_rows<true, true>(rows, begin, end, roots, n_positive);
}

// AVX2 adds the 4-lane integer operations that the lane masks and counts use
// (with AVX alone they run as two halves); the results are the same.
__attribute__((target("avx2,fma"))) NORMFAST_FLATTEN void solve_rows_avx2(
    const double* rows, std::ptrdiff_t begin, std::ptrdiff_t end, double* roots, std::int8_t* n_positive) {
    solve_rows<true, true>(rows, begin, end, roots, n_positive);
}

bool cpu_has_fma() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("fma");
}

bool cpu_has_avx2() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}
#endif

RowSolver pick_row_solver() {
#if NORMFAST_FMA_DISPATCH
    if (cpu_has_fma()) return solve_row_fma;
#endif
    return solve_row_native;
}

RangeSolver pick_range_solver() {
#if NORMFAST_FMA_DISPATCH
    if (cpu_has_fma() && cpu_has_avx2()) return solve_rows_avx2;
    if (cpu_has_fma()) return solve_rows_fma;
#endif
    return solve_rows_native;
}

}  // namespace

QuarticSolution solve_quartic_row(const double* coeffs) noexcept {
    static const RowSolver solver = pick_row_solver();
    return solver(coeffs);
}

void solve_quartic_batch(const double* rows, std::size_t n_rows, double* roots,
                         std::int8_t* n_positive, int threads) noexcept {
    static const RangeSolver solver = pick_range_solver();
    const std::ptrdiff_t n = static_cast<std::ptrdiff_t>(n_rows);
    const std::ptrdiff_t n_blocks = (n + kBlock - 1) / kBlock;
#ifdef _OPENMP
    const int team = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(team) if (n >= 4096)
#else
    (void)threads;
#endif
    for (std::ptrdiff_t b = 0; b < n_blocks; ++b) {
        solver(rows, b * kBlock, std::min(n, (b + 1) * kBlock), roots, n_positive);
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

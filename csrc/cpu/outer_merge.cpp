// lc_outer_merge (fused SGD/Nesterov outer step + delay-compensated merge, in place, one pass)
// and lc_taylor_norms (the read-only reduction behind lam_mode="normalized"). x is stored as X (the
// parameters' dtype); g, u, x_sent and the arithmetic are X's compute dtype T (Master<X>).
#include <vector>

#include "cpu_common.h"

namespace lowcomm {
namespace cpu {
namespace {

// In place: plain stores. Every output line was just read, so it is already owned; streaming
// stores would evict it and measured slower (docs/design.md).
template <class T, class X, class A, bool kMom, bool kNest, bool kFull>
void merge_loop(T* __restrict g, T* __restrict u, const A* __restrict d, X* __restrict x,
                const T* __restrict xs, int64_t n, const MergeCoef<T> c) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    T ui = kMom ? u[i] : T(0);
    const T gn = sgd_step<T, kMom, kNest>(g[i], ui, cast<T>(d[i]), c.lr, c.mu);
    g[i] = gn;
    if (kMom) u[i] = ui;
    x[i] = cast<X>(merge_x<T, kFull>(gn, cast<T>(x[i]), kFull ? xs[i] : T(0), c.beta, c.lam, c.alpha,
                                     c.one_minus_alpha));
  }
}

template <class T, class X, class A, bool kMom, bool kNest>
void merge_full_dispatch(T* g, T* u, const A* d, X* x, const T* xs, int64_t n, const MergeCoef<T>& c) {
  if (c.full) merge_loop<T, X, A, kMom, kNest, true>(g, u, d, x, xs, n, c);
  else merge_loop<T, X, A, kMom, kNest, false>(g, u, d, x, xs, n, c);
}

// Fixed-order partial sums of one block: 8 lanes accumulate elements i = 8q + lane, then the lanes
// are added in order. The order is set by this code alone (not by the vectoriser or the buffer's
// alignment), so a block's partial is bit-identical whatever thread computes it.
template <class T, class X, class A, bool kMom, bool kNest>
void taylor_block(const T* g, const T* u, const A* d, const X* x, const T* xs, int64_t lo, int64_t hi,
                  const MergeCoef<T>& c, double& out_v2, double& out_c2) {
  double av[8] = {0, 0, 0, 0, 0, 0, 0, 0}, ac[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    for (int l = 0; l < 8; ++l) {
      T ui = kMom ? u[i + l] : T(0);
      const T gn = sgd_step<T, kMom, kNest>(g[i + l], ui, cast<T>(d[i + l]), c.lr, c.mu);
      double v2, c2;
      taylor_terms<T>(gn, cast<T>(x[i + l]), xs[i + l], v2, c2);
      av[l] += v2;
      ac[l] += c2;
    }
  }
  for (int l = 0; i < hi; ++i, ++l) {
    T ui = kMom ? u[i] : T(0);
    const T gn = sgd_step<T, kMom, kNest>(g[i], ui, cast<T>(d[i]), c.lr, c.mu);
    double v2, c2;
    taylor_terms<T>(gn, cast<T>(x[i]), xs[i], v2, c2);
    av[l] += v2;
    ac[l] += c2;
  }
  double sv = 0, sc = 0;
  for (int l = 0; l < 8; ++l) {
    sv += av[l];
    sc += ac[l];
  }
  out_v2 = sv;
  out_c2 = sc;
}

template <class T, class X, class A, bool kMom, bool kNest>
void taylor_all(const T* g, const T* u, const A* d, const X* x, const T* xs, int64_t n, const MergeCoef<T>& c,
                double* out2) {
  const int64_t nb = (n + kReduceBlock - 1) / kReduceBlock;
  std::vector<double> pv(static_cast<size_t>(nb)), pc(static_cast<size_t>(nb));
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * kReduceBlock, hi = lo + kReduceBlock < n ? lo + kReduceBlock : n;
    taylor_block<T, X, A, kMom, kNest>(g, u, d, x, xs, lo, hi, c, pv[b], pc[b]);
  }
  double sv = 0, sc = 0;
  for (int64_t b = 0; b < nb; ++b) {
    sv += pv[b];
    sc += pc[b];
  }
  out2[0] = sv;
  out2[1] = sc;
}

}  // namespace
}  // namespace cpu
}  // namespace lowcomm

using namespace lowcomm;
using namespace lowcomm::cpu;

LOWCOMM_EXPORT int lc_outer_merge(int dtype, int avg_dtype, void* g, void* u, const void* delta_avg, void* x,
                                  const void* x_sent, int64_t n, double lr, double momentum, int nesterov,
                                  double alpha, double beta, double lam, const double* lam_sums) {
  static const char* const op = "lc_outer_merge";
  if (int rc = args::merge(op, g, u, delta_avg, x, x_sent, n, momentum, beta != 0.0 || lam != 0.0)) return rc;
  // The normalized lambda, from the sums in host memory, before anything else reads it.
  const double lam_eff = lam_sums ? lam_effective(lam, lam_sums[0], lam_sums[1]) : lam;
  return dispatch_data_storage(op, dtype, "avg_dtype", avg_dtype, [&](auto xt, auto a) {
    using X = decltype(xt);
    using T = typename Master<X>::type;
    using A = decltype(a);
    const MergeCoef<T> c = make_merge_coef<T>(lr, momentum, nesterov, alpha, beta, lam_eff);
    T* gp = static_cast<T*>(g);
    T* up = static_cast<T*>(u);
    const A* dp = static_cast<const A*>(delta_avg);
    X* xp = static_cast<X*>(x);
    const T* sp = static_cast<const T*>(x_sent);
    if (!c.momentum) merge_full_dispatch<T, X, A, false, false>(gp, up, dp, xp, sp, n, c);
    else if (c.nesterov) merge_full_dispatch<T, X, A, true, true>(gp, up, dp, xp, sp, n, c);
    else merge_full_dispatch<T, X, A, true, false>(gp, up, dp, xp, sp, n, c);
  });
}

LOWCOMM_EXPORT int lc_taylor_norms(int dtype, int avg_dtype, const void* g, const void* u, const void* delta_avg,
                                   const void* x, const void* x_sent, int64_t n, double lr, double momentum,
                                   int nesterov, double* out2) {
  static const char* const op = "lc_taylor_norms";
  if (!out2) return fail(LC_EARG, op, "out2 is NULL");
  if (int rc = args::merge(op, g, u, delta_avg, x, x_sent, n, momentum, true)) return rc;
  return dispatch_data_storage(op, dtype, "avg_dtype", avg_dtype, [&](auto xt, auto a) {
    using X = decltype(xt);
    using T = typename Master<X>::type;
    using A = decltype(a);
    const MergeCoef<T> c = make_merge_coef<T>(lr, momentum, nesterov, 0.0, 0.0, 0.0);
    const T* gp = static_cast<const T*>(g);
    const T* up = static_cast<const T*>(u);
    const A* dp = static_cast<const A*>(delta_avg);
    const X* xp = static_cast<const X*>(x);
    const T* sp = static_cast<const T*>(x_sent);
    if (!c.momentum) taylor_all<T, X, A, false, false>(gp, up, dp, xp, sp, n, c, out2);
    else if (c.nesterov) taylor_all<T, X, A, true, true>(gp, up, dp, xp, sp, n, c, out2);
    else taylor_all<T, X, A, true, false>(gp, up, dp, xp, sp, n, c, out2);
  });
}

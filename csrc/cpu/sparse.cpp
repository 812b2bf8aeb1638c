// lc_sparse_gather (y = x[idx]) and lc_sparse_scatter_merge (x[idx] = avg + beta*(x[idx] - sent)):
// LOSCAR's send and receive on a coordinate subset; only k-sized buffers are touched. The merge
// computes in x's compute dtype T (Master<X>: float for bf16 / fp16 x), the dtype of sent.
#include "cpu_common.h"

using namespace lowcomm;
using namespace lowcomm::cpu;

LOWCOMM_EXPORT int lc_sparse_gather(int dtype, const void* x, const int64_t* idx, int64_t k, void* out) {
  static const char* const op = "lc_sparse_gather";
  if (int rc = args::sparse_gather(op, x, idx, k, out)) return rc;
  return dispatch_data(op, dtype, [&](auto t) {
    using T = decltype(t);
    const T* __restrict xp = static_cast<const T*>(x);
    T* __restrict op = static_cast<T*>(out);
#pragma omp parallel for simd schedule(static) if (k >= kParallelMin)
    for (int64_t j = 0; j < k; ++j) op[j] = xp[idx[j]];
  });
}

LOWCOMM_EXPORT int lc_sparse_scatter_merge(int dtype, int avg_dtype, void* x, const int64_t* idx, int64_t k,
                                           const void* avg, const void* sent, double beta) {
  static const char* const op = "lc_sparse_scatter_merge";
  if (int rc = args::sparse_scatter_merge(op, x, idx, k, avg, sent)) return rc;
  return dispatch_data_storage(op, dtype, "avg_dtype", avg_dtype, [&](auto xt, auto a) {
    using X = decltype(xt);
    using T = typename Master<X>::type;
    using A = decltype(a);
    X* xp = static_cast<X*>(x);
    const A* __restrict ap = static_cast<const A*>(avg);
    const T* __restrict sp = static_cast<const T*>(sent);
    const T b = static_cast<T>(beta);
    // idx has no duplicates (the op checks it is strictly increasing), so iterations are independent.
#pragma omp parallel for simd schedule(static) if (k >= kParallelMin)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t i = idx[j];
      xp[i] = cast<X>(scatter_merge<T>(cast<T>(xp[i]), cast<T>(ap[j]), sp[j], b));
    }
  });
}

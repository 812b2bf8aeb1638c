// lc_pack: delta = g - x in the wire dtype, snapshot = x, count of non-finite deltas; one pass.
// x is the parameters' dtype X; g, the snapshot and the arithmetic are X's compute dtype T.

#include <type_traits>

#include "cpu_common.h"
#include "pack_stream_avx2.h"

namespace lowcomm {
namespace cpu {
namespace {

// Stores a bf16 through its 16-bit payload: gcc does not vectorise a loop that copies the struct.
template <class W>
inline void store(W* p, int64_t i, W v) { p[i] = v; }
inline void store(bf16* p, int64_t i, bf16 v) { reinterpret_cast<uint16_t*>(p)[i] = v.bits; }
inline void store(f16* p, int64_t i, f16 v) { reinterpret_cast<uint16_t*>(p)[i] = v.bits; }

// Plain stores: the compiler vectorises this loop (bf16 rounding and the finite test are
// branch-free integer code).
template <class T, class X, class W, bool kSnap>
int64_t pack_span(const T* __restrict g, const X* __restrict x, W* __restrict delta, T* __restrict snap,
                  int64_t lo, int64_t hi) {
  int64_t bad = 0;
  for (int64_t i = lo; i < hi; ++i) {
    const T xi = cast<T>(x[i]);
    const W d = pack_delta<T, W>(g[i], xi);
    store(delta, i, d);
    if (kSnap) snap[i] = xi;
    bad += is_finite(d) ? 0 : 1;
  }
  return bad;
}

// Elements from which the fp32 path switches to streaming stores (pack_stream_avx2.h). Measured on
// the 2-vCPU EPYC, 16M fp32, best of 15, in one run: plain stores 15.3 ms, streaming 9.5 ms with
// one thread; 16.3 vs 13.1 ms with two (64M: 70.1 vs 45.5 ms). Below the threshold the outputs
// (<= 16 MB each) may still sit in the last-level cache when the all-reduce reads delta, which is
// worth more than the read-for-ownership saved.
constexpr int64_t kStreamMin = int64_t(1) << 22;

// The streaming path is written for fp32 x (T = X = float); other x dtypes take plain stores.
template <class T, class X, class W, bool kSnap>
int64_t pack_all(const T* g, const X* x, W* delta, T* snap, int64_t n) {
  constexpr bool kStreamable = std::is_same<T, float>::value && std::is_same<X, float>::value;
  if (n < kParallelMin) return pack_span<T, X, W, kSnap>(g, x, delta, snap, 0, n);
  int64_t head = -1;
  if constexpr (kStreamable)
    if (n >= kStreamMin) head = stream_head<W>(delta, kSnap ? snap : nullptr);
  int64_t bad = 0;
  if (head < 0) {
#pragma omp parallel reduction(+ : bad)
    {
      int64_t lo, hi;
      thread_range(n, omp_get_thread_num(), omp_get_num_threads(), 64, lo, hi);
      bad += pack_span<T, X, W, kSnap>(g, x, delta, snap, lo, hi);
    }
    return bad;
  }
  if constexpr (kStreamable) {
    bad = pack_span<T, X, W, kSnap>(g, x, delta, snap, 0, head);
    // Threads split [head, n) on multiples of 16 elements, so each starts on an aligned step.
#pragma omp parallel reduction(+ : bad)
    {
      int64_t lo, hi;
      thread_range(n - head, omp_get_thread_num(), omp_get_num_threads(), 16, lo, hi);
      bad += pack_stream_body<W, kSnap>(g, x, delta, snap, head + lo, head + hi);
      _mm_sfence();  // make this thread's streaming stores visible before the region's barrier
    }
  }
  return bad;
}

}  // namespace
}  // namespace cpu
}  // namespace lowcomm

using namespace lowcomm;
using namespace lowcomm::cpu;

LOWCOMM_EXPORT int lc_pack(int dtype, int wire_dtype, const void* g, const void* x, void* delta,
                           void* snapshot, int64_t n, int64_t* nonfinite) {
  static const char* const op = "lc_pack";
  if (int rc = args::pack(op, g, x, delta, n, nonfinite)) return rc;
  return dispatch_data_storage(op, dtype, "wire_dtype", wire_dtype, [&](auto xt, auto w) {
    using X = decltype(xt);
    using T = typename Master<X>::type;
    using W = decltype(w);
    const T* gp = static_cast<const T*>(g);
    const X* xp = static_cast<const X*>(x);
    W* dp = static_cast<W*>(delta);
    T* sp = static_cast<T*>(snapshot);
    *nonfinite = sp ? pack_all<T, X, W, true>(gp, xp, dp, sp, n) : pack_all<T, X, W, false>(gp, xp, dp, sp, n);
  });
}

// lc_pack: delta = g - x in the wire dtype, snapshot = x, count of non-finite deltas; one pass.

#include "cpu_common.h"

// Which store path large packs take (see the measurements in pack_all's comment).
#ifndef LOWCOMM_PACK_NT
#define LOWCOMM_PACK_NT 0
#endif

namespace lowcomm {
namespace cpu {
namespace {

// Stores a bf16 through its 16-bit payload: gcc does not vectorise a loop that copies the struct.
template <class W>
inline void store(W* p, int64_t i, W v) { p[i] = v; }
inline void store(bf16* p, int64_t i, bf16 v) { reinterpret_cast<uint16_t*>(p)[i] = v.bits; }

// Plain stores: the compiler vectorises this loop (bf16 rounding and the finite test are
// branch-free integer code).
template <class T, class W, bool kSnap>
int64_t pack_span(const T* __restrict g, const T* __restrict x, W* __restrict delta, T* __restrict snap,
                  int64_t lo, int64_t hi) {
  int64_t bad = 0;
  for (int64_t i = lo; i < hi; ++i) {
    const W d = pack_delta<T, W>(g[i], x[i]);
    store(delta, i, d);
    if (kSnap) snap[i] = x[i];
    bad += is_finite(d) ? 0 : 1;
  }
  return bad;
}

// Streaming stores: delta is formed tile by tile in an L1-resident buffer and both outputs are
// written with non-temporal stores, so their lines are never read for ownership (pack's outputs
// are fresh buffers nobody reads before the all-reduce).
constexpr int64_t kTile = 2048;

template <class T, class W, bool kSnap>
int64_t pack_span_nt(const T* g, const T* x, W* delta, T* snap, int64_t lo, int64_t hi) {
  alignas(64) W tile[kTile];
  int64_t bad = 0;
  for (int64_t t0 = lo; t0 < hi; t0 += kTile) {
    const int64_t m = hi - t0 < kTile ? hi - t0 : kTile;
    const T* __restrict gt = g + t0;
    const T* __restrict xt = x + t0;
    for (int64_t i = 0; i < m; ++i) {
      const W d = pack_delta<T, W>(gt[i], xt[i]);
      store(tile, i, d);
      bad += is_finite(d) ? 0 : 1;
    }
    nt_copy(delta + t0, tile, static_cast<size_t>(m) * sizeof(W));
    if (kSnap) nt_copy(snap + t0, xt, static_cast<size_t>(m) * sizeof(T));
  }
  nt_fence();
  return bad;
}

template <class T, class W, bool kSnap>
int64_t pack_all(const T* g, const T* x, W* delta, T* snap, int64_t n, bool nt) {
  if (n < kParallelMin) return pack_span<T, W, kSnap>(g, x, delta, snap, 0, n);
  int64_t bad = 0;
#pragma omp parallel reduction(+ : bad)
  {
    int64_t lo, hi;
    thread_range(n, omp_get_thread_num(), omp_get_num_threads(), 64, lo, hi);
    bad += nt ? pack_span_nt<T, W, kSnap>(g, x, delta, snap, lo, hi)
              : pack_span<T, W, kSnap>(g, x, delta, snap, lo, hi);
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
  if (n < 0 || nonfinite == nullptr) return LC_EARG;
  const bool nt = LOWCOMM_PACK_NT != 0;
  return dispatch_data_storage(dtype, wire_dtype, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    const T* gp = static_cast<const T*>(g);
    const T* xp = static_cast<const T*>(x);
    W* dp = static_cast<W*>(delta);
    T* sp = static_cast<T*>(snapshot);
    *nonfinite = sp ? pack_all<T, W, true>(gp, xp, dp, sp, n, nt) : pack_all<T, W, false>(gp, xp, dp, sp, n, nt);
  });
}

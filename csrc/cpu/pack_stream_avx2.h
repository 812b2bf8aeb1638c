// pack for fp32 data with AVX2 streaming stores, written out by hand because gcc does not emit
// non-temporal stores from plain loops. Why: pack's outputs (delta, snapshot) are fresh buffers
// that nobody reads before the all-reduce; with ordinary stores every output line is first read
// for ownership, so 16 counted bytes per element cost 24 bytes of memory traffic and pack cannot
// exceed ~67% of a streaming copy. Streaming stores write the lines without reading them.
//
// Lanes: 16 elements per step (two 8-float vectors): snapshot 2 x 32 B, delta 2 x 32 B (fp32) or
// 1 x 32 B (bf16). The step needs delta and snapshot 32-byte aligned at the same element index;
// a scalar head reaches that index, and pack_stream returns false (caller falls back to plain
// stores) when no such index exists (buffers misaligned relative to each other).
#ifndef LOWCOMM_CPU_PACK_STREAM_AVX2_H_
#define LOWCOMM_CPU_PACK_STREAM_AVX2_H_

#include <immintrin.h>

#include "cpu_common.h"

namespace lowcomm {
namespace cpu {

// Number of non-finite lanes among 8 fp32 values (exponent all ones).
inline int nonfinite8_f32(__m256 v) {
  const __m256i e = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7F800000));
  return __builtin_popcount(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_set1_epi32(0x7F800000)))));
}

// 8 fp32 -> 8 bf16 in the low 16 bits of each 32-bit lane: bf16_from_f32 of kernels.h, vectorised.
// Also adds the number of non-finite results to `bad`.
inline __m256i bf16x8_in_i32(__m256 v, int& bad) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(LC_BF16_NAN_CPU), _mm256_castps_si256(nan));
  const __m256i e = _mm256_and_si256(r, _mm256_set1_epi32(0x7F80));
  bad += __builtin_popcount(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_set1_epi32(0x7F80)))));
  return r;
}

// Elements to process with scalar code before delta and snapshot are both 32-byte aligned, or -1.
template <class W>
inline int64_t stream_head(const W* delta, const float* snap) {
  for (int64_t p = 0; p < 32; ++p) {
    const bool d_ok = (reinterpret_cast<uintptr_t>(delta + p) & 31) == 0;
    const bool s_ok = snap == nullptr || (reinterpret_cast<uintptr_t>(snap + p) & 31) == 0;
    if (d_ok && s_ok) return p;
  }
  return -1;
}

// Streams elements [lo, hi); requires (delta + lo, snap + lo) 32-byte aligned. Returns the count of
// non-finite deltas. Issues no fence (the caller does, once per thread).
template <class W, bool kSnap>
int64_t pack_stream_body(const float* g, const float* x, W* delta, float* snap, int64_t lo, int64_t hi) {
  int64_t bad = 0;
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    const __m256 d0 = _mm256_sub_ps(_mm256_loadu_ps(g + i), x0);
    const __m256 d1 = _mm256_sub_ps(_mm256_loadu_ps(g + i + 8), x1);
    int b = 0;
    if constexpr (sizeof(W) == 4) {
      _mm256_stream_ps(reinterpret_cast<float*>(delta) + i, d0);
      _mm256_stream_ps(reinterpret_cast<float*>(delta) + i + 8, d1);
      b = nonfinite8_f32(d0) + nonfinite8_f32(d1);
    } else {
      const __m256i r0 = bf16x8_in_i32(d0, b), r1 = bf16x8_in_i32(d1, b);
      // packus works per 128-bit half: [r0 lo4, r1 lo4, r0 hi4, r1 hi4] -> reorder the 64-bit quarters.
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xD8);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(delta) + i), packed);
    }
    if (kSnap) {
      _mm256_stream_ps(snap + i, x0);
      _mm256_stream_ps(snap + i + 8, x1);
    }
    bad += b;
  }
  for (; i < hi; ++i) {  // < 16 leftover elements
    const W d = pack_delta<float, W>(g[i], x[i]);
    if constexpr (sizeof(W) == 4) delta[i] = d; else reinterpret_cast<uint16_t*>(delta)[i] = d.bits;
    if (kSnap) snap[i] = x[i];
    bad += is_finite(d) ? 0 : 1;
  }
  return bad;
}

}  // namespace cpu
}  // namespace lowcomm

#endif  // LOWCOMM_CPU_PACK_STREAM_AVX2_H_

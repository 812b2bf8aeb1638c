// The quantized pack's common case written out in AVX2: fp32 g, x (and residual), any format rounded
// to nearest even (the float ones: qstream_fcode8), blocks of a multiple of 64 elements. Why by hand:
// the pack must move 21 bytes per element (read g, x, residual; write residual, snapshot, codes) and is only
// at the memory roofline if
//   * the snapshot and the codes, fresh buffers nobody reads before the all-reduce, are written with
//     non-temporal stores: plain stores read every output line for ownership first, 5 more bytes per
//     element (26 instead of 21, at most 81% of a streaming copy), and gcc does not emit them;
//   * the encode costs well under a core's share of the memory time (2 cores: < ~0.7 ns per
//     element). gcc's vectorisation of the scalar loop narrows int32 -> int8 lane by lane and keeps
//     the residual's and the snapshot's stores in separate passes.
//
// The maths is quant.h's, operation for operation, so the codes, scales and residual are bit-identical
// to the scalar path and to the reference (ops/quantize.py): e = (g - x) + r in fp32; per block
// amax = the largest |e| bit pattern (integer max, exact in any order); s = q_scale; for a block with
// q_scale_ok(s): q = e / s (correctly rounded vector division; finite, |q| <= qmax (1 + 2^-23)), then
// the scalar's v = q < 0 ? 0 - c : c with c = round-half-even(min(|q|, qmax)) is computed as the
// integer conversion of clamp(q, -qmax, qmax) under round-to-nearest-even: the same value, since
// rounding half to even is odd-symmetric, and, converted back to fp32, the same zero, +0; residual
// r = e - v * s (no contraction: separate multiply and subtract). A float format's code and value are
// qstream_fcode8's (the division and residual as above). Blocks that are not ok (zero, or
// holding inf / NaN) get codes 0 and keep their residual, as in the scalar path; a last partial block
// goes to the scalar path.
#ifndef LOWCOMM_CPU_QUANTIZE_STREAM_AVX2_H_
#define LOWCOMM_CPU_QUANTIZE_STREAM_AVX2_H_

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"
#include "lowcomm/quant.h"

namespace lowcomm {
namespace cpu {

// Elements per step of the encode: 64 fill one 32-byte store of int4 codes and two of int8 codes.
constexpr int64_t kQStreamStep = 64;
// How far ahead (elements) the encode pass prefetches g, x and the residual: the two-pass structure
// reads memory only in its first pass, so without it the memory stream pauses while a block encodes.
// About one core's bandwidth-delay product (~35 GB/s x ~100 ns = 3.5 KB over the three streams):
// 1 KB per stream. Farther is worse, not safer: on a Zen 4 (32 KB L1d) 1024 elements (12 KB in
// flight) left the 64M pack at 65-80% of the nt memcpy, 256 at 87-103%, no prefetch in between
// (interleaved in one process, int8 and int4).
constexpr int64_t kQStreamPrefetch = 256;
// The largest block whose e pass 1 keeps for pass 2 (4 KiB on the stack).
constexpr int64_t kQStreamEBuf = 1024;

// True when the streaming path can take blocks of `block` elements with these buffers: whole steps
// per block, and the codes and the snapshot 32-byte aligned at every block start.
inline bool qstream_ok(int64_t block, const void* codes, const void* snap) {
  return block % kQStreamStep == 0 && (reinterpret_cast<uintptr_t>(codes) & 31) == 0 &&
         (reinterpret_cast<uintptr_t>(snap) & 31) == 0;
}

template <bool kRes>
inline __m256 qstream_e(const float* g, const float* x, const float* r, int64_t i) {
  __m256 e = _mm256_sub_ps(_mm256_loadu_ps(g + i), _mm256_loadu_ps(x + i));
  if constexpr (kRes) e = _mm256_add_ps(e, _mm256_loadu_ps(r + i));
  return e;
}

// The signed integer code of 8 elements of one ok block (as exact fp32 integers) from their e, and
// the residual e - v * s stored to r + i when kRes.
template <bool kRes>
inline __m256i qstream_code8(__m256 e, float* r, int64_t i, __m256 s, __m256 qmax) {
  const __m256 q = _mm256_div_ps(e, s);
  // round-half-even is odd-symmetric, so rounding q clamped to [-qmax, qmax] equals the scalar's
  // sign(q) * rint(min(|q|, qmax)). The conversion rounds under MXCSR's rounding control, which
  // qstream_blocks sets to nearest-even; converted back, a code of 0 is the scalar's +0 (a -0 would
  // change the residual's sign of zero for e = -0).
  const __m256 w = _mm256_max_ps(_mm256_min_ps(q, qmax), _mm256_sub_ps(_mm256_setzero_ps(), qmax));
  const __m256i c = _mm256_cvtps_epi32(w);
  if constexpr (kRes) {
    const __m256 v = _mm256_cvtepi32_ps(c);
    _mm256_storeu_ps(r + i, _mm256_sub_ps(e, _mm256_mul_ps(v, s)));
  }
  return c;
}

// A float format's constants as vectors, for qstream_fcode8.
struct QStreamFloat {
  __m256i emin_b;     // emin + 127: the biased exponent of the smallest normal value
  __m256i magic_off;  // 23 - M: the magic number's biased exponent is that of h plus 23
  __m128i man_bits;   // M, as a shift count
  __m128i sign_shift; // 32 - bits: moves the sign bit to the code's top bit
  explicit QStreamFloat(const QFmt& f)
      : emin_b(_mm256_set1_epi32(f.emin + 127)),
        magic_off(_mm256_set1_epi32(23 - f.man_bits)),
        man_bits(_mm_cvtsi32_si128(f.man_bits)),
        sign_shift(_mm_cvtsi32_si128(32 - f.bits)) {}
};

// qstream_code8 for a float format: QFloatRne::encode (quantize.cpp, whose comment says why each
// step is exact) on 8 lanes, so bit-identical to q_encode<false>. The magic-number addition rounds
// under MXCSR's rounding control, which qstream_blocks sets to nearest-even.
template <bool kRes>
inline __m256i qstream_fcode8(__m256 e, float* r, int64_t i, __m256 s, __m256 qmax, const QStreamFloat& k) {
  const __m256 q = _mm256_div_ps(e, s);
  const __m256i qb = _mm256_castps_si256(q);
  const __m256i sign = _mm256_and_si256(qb, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256 m = _mm256_min_ps(_mm256_castsi256_ps(_mm256_xor_si256(qb, sign)), qmax);  // |q| < qmax ? |q| : qmax
  const __m256i eb = _mm256_max_epi32(_mm256_srli_epi32(_mm256_castps_si256(m), 23), k.emin_b);
  const __m256i cb = _mm256_slli_epi32(_mm256_add_epi32(eb, k.magic_off), 23);
  const __m256 a = _mm256_add_ps(m, _mm256_castsi256_ps(cb));
  const __m256 val = _mm256_sub_ps(a, _mm256_castsi256_ps(cb));
  const __m256i mag = _mm256_add_epi32(_mm256_sll_epi32(_mm256_sub_epi32(eb, k.emin_b), k.man_bits),
                                       _mm256_sub_epi32(_mm256_castps_si256(a), cb));
  const __m256i c = _mm256_or_si256(mag, _mm256_srl_epi32(sign, k.sign_shift));
  if constexpr (kRes) {
    const __m256 v = _mm256_or_ps(val, _mm256_castsi256_ps(sign));
    _mm256_storeu_ps(r + i, _mm256_sub_ps(e, _mm256_mul_ps(v, s)));
  }
  return c;
}

// 32 8-bit codes of elements i .. i + 31, in element order.
// e: the e values of those 32 elements. kFloat: codes of a float format (0 .. 255), else int8 codes.
template <bool kRes, bool kFloat>
inline __m256i qstream_code32(const float* e, float* r, int64_t i, __m256 s, __m256 qmax, const QStreamFloat* k) {
  __m256i v0, v1, v2, v3;
  if constexpr (kFloat) {
    v0 = qstream_fcode8<kRes>(_mm256_load_ps(e), r, i, s, qmax, *k);
    v1 = qstream_fcode8<kRes>(_mm256_load_ps(e + 8), r, i + 8, s, qmax, *k);
    v2 = qstream_fcode8<kRes>(_mm256_load_ps(e + 16), r, i + 16, s, qmax, *k);
    v3 = qstream_fcode8<kRes>(_mm256_load_ps(e + 24), r, i + 24, s, qmax, *k);
  } else {
    v0 = qstream_code8<kRes>(_mm256_load_ps(e), r, i, s, qmax);
    v1 = qstream_code8<kRes>(_mm256_load_ps(e + 8), r, i + 8, s, qmax);
    v2 = qstream_code8<kRes>(_mm256_load_ps(e + 16), r, i + 16, s, qmax);
    v3 = qstream_code8<kRes>(_mm256_load_ps(e + 24), r, i + 24, s, qmax);
  }
  // packs work per 128-bit lane: bytes come out as [v0 lo, v1 lo, v2 lo, v3 lo | v0 hi, ...] in
  // groups of 4; the dword permutation puts them back in element order. No saturation: int codes
  // have |v| <= 127 (signed packs), float codes are 0 .. 255 (unsigned packs for the bytes).
  const __m256i w01 = _mm256_packs_epi32(v0, v1), w23 = _mm256_packs_epi32(v2, v3);
  const __m256i b = kFloat ? _mm256_packus_epi16(w01, w23) : _mm256_packs_epi16(w01, w23);
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Blocks [b0, b1) of n elements, all whole (hi - lo = block, a multiple of kQStreamStep); codes and
// snap as qstream_ok requires. Per block: pass 1 reads g, x (, r) from memory, streams the snapshot,
// takes the absmax and keeps e (blocks up to kQStreamEBuf); pass 2 encodes e from L1 (or recomputes
// it from L1 / L2 for larger blocks), prefetches the blocks ahead and streams the codes. Issues no fence
// (the caller does, once per thread). Returns the count of non-finite e.
template <bool kRes, bool kSnap, int kBits, bool kFloat>
int64_t qstream_blocks(const QFmt& f, const float* g, const float* x, float* snap, float* r, int64_t block,
                       uint8_t* codes, float* scales, int64_t b0, int64_t b1) {
  const __m256 qmax = _mm256_set1_ps(f.qmax);
  const QStreamFloat fk(f);
  const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF);
  // Pass 1 keeps the block's e here when it fits (L1-resident), so pass 2 reads one stream instead
  // of recomputing e from three; larger blocks recompute e 64 elements at a time into its start.
  alignas(32) float ebuf[kQStreamEBuf];
  const bool keep = block <= kQStreamEBuf;
  int64_t bad = 0;
  // qstream_code8 converts to integers (qstream_fcode8 adds) under MXCSR's rounding control: nearest
  // here, whatever the caller's (bits 13-14 cleared), restored on return
  const unsigned int csr = _mm_getcsr();
  _mm_setcsr(csr & ~0x6000u);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * block, hi = lo + block;
    __m256i am0 = _mm256_setzero_si256(), am1 = _mm256_setzero_si256();
    for (int64_t i = lo; i < hi; i += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
      __m256 e0 = _mm256_sub_ps(_mm256_loadu_ps(g + i), x0);
      __m256 e1 = _mm256_sub_ps(_mm256_loadu_ps(g + i + 8), x1);
      if constexpr (kRes) {
        e0 = _mm256_add_ps(e0, _mm256_loadu_ps(r + i));
        e1 = _mm256_add_ps(e1, _mm256_loadu_ps(r + i + 8));
      }
      if (keep) {
        _mm256_store_ps(ebuf + (i - lo), e0);
        _mm256_store_ps(ebuf + (i - lo) + 8, e1);
      }
      am0 = _mm256_max_epu32(am0, _mm256_and_si256(_mm256_castps_si256(e0), absmask));
      am1 = _mm256_max_epu32(am1, _mm256_and_si256(_mm256_castps_si256(e1), absmask));
      if constexpr (kSnap) {
        _mm256_stream_ps(snap + i, x0);
        _mm256_stream_ps(snap + i + 8, x1);
      }
    }
    __m256i am = _mm256_max_epu32(am0, am1);
    __m128i a4 = _mm_max_epu32(_mm256_castsi256_si128(am), _mm256_extracti128_si256(am, 1));
    a4 = _mm_max_epu32(a4, _mm_shuffle_epi32(a4, 0x4E));
    a4 = _mm_max_epu32(a4, _mm_shuffle_epi32(a4, 0xB1));
    const uint32_t amax = static_cast<uint32_t>(_mm_cvtsi128_si32(a4));
    const float sf = q_scale(f, amax);
    scales[b] = sf;
    if (!q_scale_ok(sf)) {  // rare: codes 0, residual kept
      if (amax >= 0x7F800000u) {
        for (int64_t i = lo; i < hi; ++i) {
          const float e = kRes ? (g[i] - x[i]) + r[i] : g[i] - x[i];
          bad += (f32_bits(e) & 0x7FFFFFFFu) >= 0x7F800000u ? 1 : 0;
        }
      }
      memset(codes + (kBits == 8 ? lo : lo / 2), 0, static_cast<size_t>(kBits == 8 ? block : block / 2));
      continue;
    }
    const __m256 s = _mm256_set1_ps(sf);
    for (int64_t i = lo; i < hi; i += kQStreamStep) {
      // the lines kQStreamPrefetch elements ahead: memory keeps streaming while this block encodes
      // (prefetches never fault, so running past the end of the buffers is harmless)
      for (int64_t l = 0; l < kQStreamStep; l += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(g + i + kQStreamPrefetch + l), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(x + i + kQStreamPrefetch + l), _MM_HINT_T0);
        if constexpr (kRes) _mm_prefetch(reinterpret_cast<const char*>(r + i + kQStreamPrefetch + l), _MM_HINT_T0);
      }
      const float* e = ebuf + (i - lo);
      if (!keep) {
        for (int64_t j = 0; j < kQStreamStep; j += 8) _mm256_store_ps(ebuf + j, qstream_e<kRes>(g, x, r, i + j));
        e = ebuf;
      }
      const __m256i c0 = qstream_code32<kRes, kFloat>(e, r, i, s, qmax, &fk);
      const __m256i c1 = qstream_code32<kRes, kFloat>(e + 32, r, i + 32, s, qmax, &fk);
      if constexpr (kBits == 8) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(codes + i), c0);
        _mm256_stream_si256(reinterpret_cast<__m256i*>(codes + i + 32), c1);
      } else {
        // byte pairs (2j, 2j + 1) -> (low nibble of 2j) | (low nibble of 2j + 1) << 4, in 16-bit lanes
        const __m256i lo4 = _mm256_set1_epi16(0x000F), hi4 = _mm256_set1_epi16(0x00F0);
        const __m256i w0 = _mm256_or_si256(_mm256_and_si256(c0, lo4), _mm256_and_si256(_mm256_srli_epi16(c0, 4), hi4));
        const __m256i w1 = _mm256_or_si256(_mm256_and_si256(c1, lo4), _mm256_and_si256(_mm256_srli_epi16(c1, 4), hi4));
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(w0, w1), 0xD8);
        _mm256_stream_si256(reinterpret_cast<__m256i*>(codes + i / 2), p);
      }
    }
  }
  _mm_setcsr(csr);
  return bad;
}

}  // namespace cpu
}  // namespace lowcomm

#endif  // LOWCOMM_CPU_QUANTIZE_STREAM_AVX2_H_

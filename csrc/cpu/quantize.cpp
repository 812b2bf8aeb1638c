// The quantized wire formats on the CPU (lowcomm_kernels/ops/quantize.py is the specification;
// the per-element maths is csrc/include/lowcomm/quant.h):
//   lc_pack_quantized              e = g - x (+ residual) or e = v, quantized per block; snapshot,
//                                  non-finite count and the error-feedback residual in the same pass
//   lc_dequantize                  codes, scales -> values
//   lc_reduce_quantized            sum of M quantized chunks in fp32, scaled, requantized
//   lc_outer_merge_quantized       outer_merge with the averaged delta dequantized on the fly
//   lc_sparse_scatter_merge_quantized
//
// Work is split into whole blocks (so a 4-bit byte never straddles two threads). A block is read
// twice: once for its absmax, once to quantize it; for blocks of <= 16K elements the second read
// comes from the cache, so memory sees one pass. The merges dequantize int8 inside their own loop,
// the other formats kChunk elements at a time into a buffer on the stack that the dense kernel
// reads: Δ̄ never exists in memory as a whole. (The buffer's round trip cost the int8 merge 5-10 % of
// the memcpy's bandwidth.)

#include <string.h>

#include <type_traits>

#include "cpu_common.h"
#include "lowcomm/quant.h"
#include "quantize_stream_avx2.h"

namespace lowcomm {
namespace cpu {
namespace {

// e_i of the quantized pack: g - x (+ r) in T, or the input itself (quantize: X = T = v's dtype).
template <class T, class X, bool kPack, bool kRes>
LC_HD T element(const T* g, const X* x, const T* r, int64_t i) {
  if constexpr (kPack) {
    T e = g[i] - cast<T>(x[i]);
    if constexpr (kRes) e = e + r[i];
    return e;
  } else {
    return cast<T>(x[i]);
  }
}

template <class T, class X, bool kPack, bool kRes>
struct Source {
  const T* g;
  const X* x;
  const T* r;
  LC_HD T at(int64_t i) const { return element<T, X, kPack, kRes>(g, x, r, i); }
};

template <class X>
LC_HD float to_f32(X v) { return cast<float>(v); }

// The integer formats rounded to nearest even, elements [lo, hi) of one block of scale s (q_scale_ok):
// q_encode<false> and q_value written for them alone (no exponent, value = the signed code), as one
// loop the compiler vectorises: the division stays a correctly rounded (vector) fp32 division, rintf
// rounds half to even, and the clamp is the same min. 4-bit codes go through a stack buffer of
// kEncodeSpan nibbles, packed two per byte afterwards.
constexpr int64_t kEncodeSpan = 4096;

// The operands are local restrict pointers: `out` is a char type, which may alias anything, so with
// src's fields read through the reference every store would force them to be reloaded. In error
// feedback the residual is read and written through `res` (src.r is the same buffer).
template <class T, class X, bool kPack, bool kRes>
inline void encode_int_span(float qmax, const Source<T, X, kPack, kRes>& src, T* res, int64_t lo, int64_t hi,
                            float s, int8_t* __restrict out) {
  const T* __restrict g = src.g;
  const X* __restrict x = src.x;
  T* __restrict r = res;
  for (int64_t i = lo; i < hi; ++i) {
    const T e = element<T, X, kPack, kRes>(g, x, r, i);
    const float q = to_f32(e) / s;
    float m = fabsf(q);
    m = m < qmax ? m : qmax;
    const int c = static_cast<int>(rintf(m));
    const int v = q < 0.0f ? -c : c;
    out[i - lo] = static_cast<int8_t>(v);
    if constexpr (kRes) r[i] = e - static_cast<T>(static_cast<float>(v) * s);
  }
}

// The float formats rounded to nearest even: q_encode<false> (quant.h) rewritten so that it
// vectorises, bit-identical. With m = min(|q|, qmax) and E = max(exponent field of m, emin + 127)
// (a zero or subnormal m has field 0: q_encode's exponent -127 clamped to emin), the grid spacing
// is h = 2^(E - 127 - M). The magic number C = 2^(E - 127 - M + 23) has ulp h and m < C, so the one
// fp32 addition a = m + C rounds m to a multiple of h, half to even: rint(m / h) · h, exactly as
// q_encode's rint (both round to nearest even under the default rounding mode), in every binade and
// in the subnormal range at once. Then
//   val = a - C                       the grid value, exact (a and C are within a factor 2);
//   bits(a) - bits(C) = rint(m / h)   an integer in [0, 2^(M+1)];
//   ef << M | mant = ((E - emin - 127) << M) + rint(m / h)
// (a normal rint(m / h) carries its implicit 2^M into the exponent field, and a carry to
// 2^(M+1) moves it one binade up; below 2^emin the first term is 0 and a round up to 2^M is the
// code of 2^emin), and the sign goes to the top bit. value(code) = ±val, -0 for a negative zero
// code, as q_value decodes it. Replaces a scalar q_encode per element (10-20 ns each on one core).
struct QFloatRne {
  int32_t emin_b, magic_off, man, sign_shift;
  explicit QFloatRne(const QFmt& f)
      : emin_b(f.emin + 127), magic_off(23 - f.man_bits), man(f.man_bits), sign_shift(32 - f.bits) {}
  // the code of q (a finite quotient); val_signed: value(code), unscaled
  uint32_t encode(float q, float qmax, float& val_signed) const {
    const uint32_t sign = f32_bits(q) & 0x80000000u;
    float m = f32_from_bits(f32_bits(q) ^ sign);
    m = m < qmax ? m : qmax;
    const int32_t fe = static_cast<int32_t>(f32_bits(m) >> 23);
    const int32_t eb = fe > emin_b ? fe : emin_b;
    const uint32_t cb = static_cast<uint32_t>(eb + magic_off) << 23;
    const float a = m + f32_from_bits(cb);
    val_signed = f32_from_bits(f32_bits(a - f32_from_bits(cb)) | sign);
    return ((static_cast<uint32_t>(eb - emin_b) << man) + (f32_bits(a) - cb)) | (sign >> sign_shift);
  }
};

// encode_int_span for a float format (QFloatRne).
template <class T, class X, bool kPack, bool kRes>
inline void encode_float_span(const QFmt& f, const Source<T, X, kPack, kRes>& src, T* res, int64_t lo,
                              int64_t hi, float s, int8_t* __restrict out) {
  const T* __restrict g = src.g;
  const X* __restrict x = src.x;
  T* __restrict r = res;
  const QFloatRne k(f);
  const float qmax = f.qmax;
  for (int64_t i = lo; i < hi; ++i) {
    const T e = element<T, X, kPack, kRes>(g, x, r, i);
    float v;
    out[i - lo] = static_cast<int8_t>(k.encode(to_f32(e) / s, qmax, v));
    if constexpr (kRes) r[i] = e - static_cast<T>(v * s);
  }
}

// Codes of elements [lo, hi) of one ok block, rounded to nearest even: 8-bit codes straight into
// `codes`, 4-bit codes through a stack buffer of kEncodeSpan, packed two per byte afterwards.
template <bool kFloat, class T, class X, bool kPack, bool kRes, int kBits>
inline void encode_blocks(const QFmt& f, const Source<T, X, kPack, kRes>& src, T* res, int64_t lo, int64_t hi,
                          float s, uint8_t* codes) {
  auto span = [&](int64_t a, int64_t z, int8_t* out) {
    if constexpr (kFloat) encode_float_span<T, X, kPack, kRes>(f, src, res, a, z, s, out);
    else encode_int_span<T, X, kPack, kRes>(f.qmax, src, res, a, z, s, out);
  };
  if constexpr (kBits == 8) {
    span(lo, hi, reinterpret_cast<int8_t*>(codes + lo));
  } else {
    alignas(64) int8_t tmp[kEncodeSpan + 1];
    for (int64_t a = lo; a < hi; a += kEncodeSpan) {  // lo and kEncodeSpan are even
      const int64_t z = a + kEncodeSpan < hi ? a + kEncodeSpan : hi;
      span(a, z, tmp);
      tmp[z - a] = 0;  // pads an odd n's last byte
      const int64_t nbytes = (z - a + 1) / 2;
      uint8_t* o = codes + a / 2;
      for (int64_t j = 0; j < nbytes; ++j)
        o[j] = static_cast<uint8_t>((static_cast<uint8_t>(tmp[2 * j]) & 0xFu) |
                                    (static_cast<uint8_t>(tmp[2 * j + 1]) << 4));
    }
  }
}

// Quantizes blocks [b0, b1) of the n elements: scales, codes, snapshot (kSnap), residual (kRes,
// left alone in non-finite blocks); returns the non-finite count.
template <class T, class X, bool kPack, bool kRes, bool kSnap, bool kSR, int kBits>
int64_t quantize_blocks(const QFmt& f, const Source<T, X, kPack, kRes>& src, const X* x, T* snap, T* res,
                        int64_t n, int64_t block, uint64_t key, uint8_t* codes, float* scales, int64_t b0,
                        int64_t b1) {
  int64_t bad = 0;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
    uint32_t amax = 0;
    for (int64_t i = lo; i < hi; ++i) {
      const float w = to_f32(src.at(i));
      const uint32_t a = f32_bits(w) & 0x7FFFFFFFu;
      amax = a > amax ? a : amax;
      if constexpr (kSnap) snap[i] = cast<T>(x[i]);
    }
    if (amax >= 0x7F800000u) {  // a non-finite block (rare): count its inf / NaN values
      for (int64_t i = lo; i < hi; ++i) bad += (f32_bits(to_f32(src.at(i))) & 0x7FFFFFFFu) >= 0x7F800000u ? 1 : 0;
    }
    const float s = q_scale(f, amax);
    scales[b] = s;
    const bool ok = q_scale_ok(s);
    if (!kSR && ok) {
      if (f.is_float) encode_blocks<true, T, X, kPack, kRes, kBits>(f, src, res, lo, hi, s, codes);
      else encode_blocks<false, T, X, kPack, kRes, kBits>(f, src, res, lo, hi, s, codes);
      continue;
    }
    if constexpr (kBits == 8) {
      if (!ok) {
        memset(codes + lo, 0, static_cast<size_t>(hi - lo));
      } else {
        for (int64_t i = lo; i < hi; ++i) {
          const T e = src.at(i);
          const float u = kSR ? q_uniform(key, static_cast<uint64_t>(i)) : 0.0f;
          const uint32_t c = q_encode<kSR>(f, to_f32(e), s, u);
          codes[i] = static_cast<uint8_t>(c);
          if constexpr (kRes) res[i] = e - static_cast<T>(q_value(f, c) * s);
        }
      }
    } else {
      // block is even, so lo is; an odd n ends in one half-filled byte.
      if (!ok) {
        memset(codes + lo / 2, 0, static_cast<size_t>((hi - lo + 1) / 2));
      } else {
        for (int64_t i = lo; i < hi; i += 2) {
          uint32_t pair = 0;
          for (int j = 0; j < 2 && i + j < hi; ++j) {
            const T e = src.at(i + j);
            const float u = kSR ? q_uniform(key, static_cast<uint64_t>(i + j)) : 0.0f;
            const uint32_t c = q_encode<kSR>(f, to_f32(e), s, u);
            pair |= c << (4 * j);
            if constexpr (kRes) res[i + j] = e - static_cast<T>(q_value(f, c) * s);
          }
          codes[i / 2] = static_cast<uint8_t>(pair);
        }
      }
    }
  }
  return bad;
}

template <class T, class X, bool kPack, bool kRes, bool kSnap, bool kSR, int kBits>
int64_t quantize_all(const QFmt& f, const T* g, const X* x, T* snap, T* res, int64_t n, int64_t block,
                     uint64_t key, uint8_t* codes, float* scales) {
  const Source<T, X, kPack, kRes> src{g, x, res};
  const int64_t nb = q_num_scales(n, block);
  auto scalar = [&](int64_t b0, int64_t b1) {
    return quantize_blocks<T, X, kPack, kRes, kSnap, kSR, kBits>(f, src, x, snap, res, n, block, key, codes,
                                                                  scales, b0, b1);
  };
  // fp32 pack rounded to nearest even: the AVX2 streaming path (quantize_stream_avx2.h) for the
  // whole blocks, when the buffers allow it.
  constexpr bool kStreamable = std::is_same<T, float>::value && std::is_same<X, float>::value && kPack && !kSR;
  const bool stream = kStreamable && qstream_ok(block, codes, kSnap ? snap : nullptr);
  const int64_t whole = n / block;  // blocks [whole, nb) (at most one, partial) take the scalar path
  auto run = [&](int64_t b0, int64_t b1) -> int64_t {
    if constexpr (kStreamable) {
      if (stream) {
        const int64_t mid = b1 < whole ? b1 : whole > b0 ? whole : b0;
        auto blocks = [&](auto float_c) {
          return qstream_blocks<kRes, kSnap, kBits, decltype(float_c)::value>(f, g, x, snap, res, block, codes,
                                                                              scales, b0, mid);
        };
        int64_t bad = f.is_float ? blocks(std::true_type{}) : blocks(std::false_type{});
        _mm_sfence();  // this thread's streaming stores are visible before the region's barrier / return
        return bad + scalar(mid, b1);
      }
    }
    return scalar(b0, b1);
  };
  if (n < kParallelMin) return run(0, nb);
  int64_t bad = 0;
#pragma omp parallel reduction(+ : bad)
  {
    int64_t b0, b1;
    thread_range(nb, omp_get_thread_num(), omp_get_num_threads(), 1, b0, b1);
    bad += run(b0, b1);
  }
  return bad;
}

// Runtime flags -> template arguments.
template <class T, class X, bool kPack>
int64_t quantize_dispatch(const QFmt& f, const T* g, const X* x, T* snap, T* res, int64_t n, int64_t block,
                          int sr, uint64_t key, uint8_t* codes, float* scales) {
  auto by_bits = [&](auto res_c, auto snap_c, auto sr_c) -> int64_t {
    constexpr bool kRes = decltype(res_c)::value, kSnap = decltype(snap_c)::value, kSR = decltype(sr_c)::value;
    if (f.bits == 8)
      return quantize_all<T, X, kPack, kRes, kSnap, kSR, 8>(f, g, x, snap, res, n, block, key, codes, scales);
    return quantize_all<T, X, kPack, kRes, kSnap, kSR, 4>(f, g, x, snap, res, n, block, key, codes, scales);
  };
  using Y = std::true_type;
  using N = std::false_type;
  auto by_sr = [&](auto res_c, auto snap_c) -> int64_t {
    return sr ? by_bits(res_c, snap_c, Y{}) : by_bits(res_c, snap_c, N{});
  };
  if constexpr (!kPack) return by_sr(N{}, N{});
  if (res && snap) return by_sr(Y{}, Y{});
  if (res) return by_sr(Y{}, N{});
  if (snap) return by_sr(N{}, Y{});
  return by_sr(N{}, N{});
}

// value(code) * s for 2 * pairs codes of a 4-bit float format (fp4_e2m1, fp4_e3m0: no NaN codes,
// code 8 + c is -value(c)), element 2j from the low nibble of c[j]: a table lookup done as a
// register permutation of the 8 magnitudes plus the sign bit, 16 elements a step. gcc's loop
// gathers from the table in memory, ~3x the int4 decode's time per element. The same table values
// times the same s: bit-identical.
inline void dequantize_fp4_pairs(const float* __restrict table, const uint8_t* __restrict c, int64_t pairs,
                                 float s, float* __restrict o) {
  const __m256 mags = _mm256_loadu_ps(table);  // codes 0..7
  const __m256 sv = _mm256_set1_ps(s), sign = _mm256_set1_ps(-0.0f);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  int64_t j = 0;
  for (; j + 8 <= pairs; j += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + j));
    // 16 codes in element order: lo0 hi0 lo1 hi1 ...
    const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(b, low4), _mm_and_si128(_mm_srli_epi16(b, 4), low4));
    const __m256i i0 = _mm256_cvtepu8_epi32(codes), i1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(codes, codes));
    // permutevar8x32 reads the low 3 bits of each index; bit 3 (the sign) moves to bit 31
    const __m256 s0 = _mm256_and_ps(_mm256_castsi256_ps(_mm256_slli_epi32(i0, 28)), sign);
    const __m256 s1 = _mm256_and_ps(_mm256_castsi256_ps(_mm256_slli_epi32(i1, 28)), sign);
    const __m256 v0 = _mm256_or_ps(_mm256_permutevar8x32_ps(mags, i0), s0);
    const __m256 v1 = _mm256_or_ps(_mm256_permutevar8x32_ps(mags, i1), s1);
    _mm256_storeu_ps(o + 2 * j, _mm256_mul_ps(v0, sv));
    _mm256_storeu_ps(o + 2 * j + 8, _mm256_mul_ps(v1, sv));
  }
  for (; j < pairs; ++j) {
    o[2 * j] = table[c[j] & 0xF] * s;
    o[2 * j + 1] = table[c[j] >> 4] * s;
  }
}

// Decodes the codes of elements [lo, hi) (lo even) into out (out[0] is element lo), in fp32: block by
// block, so each scale is read once and no element divides its index. Integer codes are converted
// directly (the table holds exactly those values), float codes go through the table (4-bit ones held
// in a register: dequantize_fp4_pairs).
inline void dequantize_span(const QFmt& f, const float* __restrict table, const uint8_t* __restrict codes,
                            const float* __restrict scales, int64_t block, int64_t lo, int64_t hi,
                            float* __restrict out) {
  for (int64_t a = lo; a < hi;) {
    const int64_t b = a / block, z = (b + 1) * block < hi ? (b + 1) * block : hi;
    const float s = scales[b];
    float* __restrict o = out + (a - lo);
    const int64_t len = z - a;
    if (f.bits == 8) {
      const uint8_t* __restrict c = codes + a;
      if (!f.is_float) {
        for (int64_t i = 0; i < len; ++i) o[i] = static_cast<float>(static_cast<int8_t>(c[i])) * s;
      } else {
        for (int64_t i = 0; i < len; ++i) o[i] = table[c[i]] * s;
      }
    } else {  // a is even (lo is, and so is every block boundary)
      const uint8_t* __restrict c = codes + a / 2;
      const int64_t pairs = len / 2;
      if (!f.is_float) {
        for (int64_t j = 0; j < pairs; ++j) {
          const int8_t byte = static_cast<int8_t>(c[j]);
          o[2 * j] = static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(c[j] << 4)) >> 4) * s;
          o[2 * j + 1] = static_cast<float>(byte >> 4) * s;
        }
      } else {
        dequantize_fp4_pairs(table, c, pairs, s, o);
      }
      if (len & 1) o[len - 1] = table[c[pairs] & 0xF] * s;
    }
    a = z;
  }
}

inline void fill_table(const QFmt& f, float* table) {
  for (uint32_t c = 0; c < (1u << f.bits); ++c) table[c] = q_value(f, c);
}

// Elements per dequantized chunk of the merges and the reduction: 32 KB of fp32 on the stack,
// which stays in L1/L2 between being written and read.
constexpr int64_t kChunk = 8192;

// Runs body(lo, hi) over [0, n) in chunks of kChunk, split across threads when n is large.
template <class F>
void for_chunks(int64_t n, F&& body) {
  const int64_t nc = (n + kChunk - 1) / kChunk;
  auto run = [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) body(c * kChunk, (c + 1) * kChunk < n ? (c + 1) * kChunk : n);
  };
  if (n < kParallelMin) {
    run(0, nc);
    return;
  }
#pragma omp parallel
  {
    int64_t c0, c1;
    thread_range(nc, omp_get_thread_num(), omp_get_num_threads(), 1, c0, c1);
    run(c0, c1);
  }
}

// lc_outer_merge's element step (csrc/cpu/outer_merge.cpp merge_loop, the same kernels.h maths) over
// one dequantized chunk: called per chunk inside the chunks' parallel region, with no call, dispatch
// or nested parallel region per chunk.
template <class T, class X, bool kMom, bool kNest, bool kFull>
inline void merge_span(T* __restrict g, T* __restrict u, const T* __restrict d, X* __restrict x,
                       const T* __restrict xs, int64_t n, const MergeCoef<T>& c) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    T ui = kMom ? u[i] : T(0);
    const T gn = sgd_step<T, kMom, kNest>(g[i], ui, d[i], c.lr, c.mu);
    g[i] = gn;
    if (kMom) u[i] = ui;
    x[i] = cast<X>(merge_x<T, kFull>(gn, cast<T>(x[i]), kFull ? xs[i] : T(0), c.beta, c.lam, c.alpha,
                                     c.one_minus_alpha));
  }
}

// merge_span with the average read straight from int8 codes of one block (scale s): d = code * s in
// fp32, widened to T, as dequantize_span forms it, with no buffer between the two.
template <class T, class X, bool kMom, bool kNest, bool kFull>
inline void merge_span_int8(T* __restrict g, T* __restrict u, const int8_t* __restrict q, float s,
                            X* __restrict x, const T* __restrict xs, int64_t n, const MergeCoef<T>& c) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const T d = static_cast<T>(static_cast<float>(q[i]) * s);
    T ui = kMom ? u[i] : T(0);
    const T gn = sgd_step<T, kMom, kNest>(g[i], ui, d, c.lr, c.mu);
    g[i] = gn;
    if (kMom) u[i] = ui;
    x[i] = cast<X>(merge_x<T, kFull>(gn, cast<T>(x[i]), kFull ? xs[i] : T(0), c.beta, c.lam, c.alpha,
                                     c.one_minus_alpha));
  }
}

}  // namespace
}  // namespace cpu
}  // namespace lowcomm

using namespace lowcomm;
using namespace lowcomm::cpu;

LOWCOMM_EXPORT int lc_pack_quantized(int dtype, int fmt, const void* g, const void* x, void* residual,
                                     void* snapshot, int64_t n, int64_t block, int sr, int64_t key,
                                     void* codes, void* scales, int64_t* nonfinite) {
  static const char* const op = "lc_pack_quantized";
  QFmt f;
  if (int rc = args::pack_quantized(op, fmt, block, f, g, x, residual, snapshot, n, codes, scales)) return rc;
  const uint64_t k = static_cast<uint64_t>(key);
  auto* cp = static_cast<uint8_t*>(codes);
  auto* sp = static_cast<float*>(scales);
  int64_t bad = 0;
  const int rc = dispatch_data(op, dtype, [&](auto xt) {
    using X = decltype(xt);
    using T = typename Master<X>::type;
    if (x) {
      bad = quantize_dispatch<T, X, true>(f, static_cast<const T*>(g), static_cast<const X*>(x),
                                          static_cast<T*>(snapshot), static_cast<T*>(residual), n, block, sr, k,
                                          cp, sp);
    } else {  // quantize v = g of dtype X
      bad = quantize_dispatch<T, X, false>(f, nullptr, static_cast<const X*>(g), nullptr, nullptr, n, block, sr,
                                           k, cp, sp);
    }
  });
  if (rc == LC_OK && nonfinite) *nonfinite = bad;
  return rc;
}

LOWCOMM_EXPORT int lc_dequantize(int fmt, const void* codes, const void* scales, int64_t n, int64_t block,
                                 int out_dtype, void* out) {
  static const char* const op = "lc_dequantize";
  QFmt f;
  if (int rc = args::dequantize(op, fmt, block, f, codes, scales, n, out)) return rc;
  float table[256];
  fill_table(f, table);
  const auto* cp = static_cast<const uint8_t*>(codes);
  const auto* sp = static_cast<const float*>(scales);
  return dispatch_data(op, out_dtype, [&](auto ot) {
    using O = decltype(ot);
    O* op_ = static_cast<O*>(out);
    for_chunks(n, [&](int64_t lo, int64_t hi) {
      if constexpr (std::is_same<O, float>::value) {
        dequantize_span(f, table, cp, sp, block, lo, hi, op_ + lo);
      } else {
        float buf[kChunk];
        dequantize_span(f, table, cp, sp, block, lo, hi, buf);
        for (int64_t i = lo; i < hi; ++i) op_[i] = cast<O>(buf[i - lo]);
      }
    });
  });
}

LOWCOMM_EXPORT int lc_reduce_quantized(int fmt, const void* codes, const void* scales, int64_t m, int64_t n,
                                       int64_t block, double scale, void* out_codes, void* out_scales) {
  static const char* const op = "lc_reduce_quantized";
  QFmt f;
  if (int rc = args::reduce_quantized(op, fmt, block, f, codes, scales, m, n, out_codes, out_scales)) return rc;
  float table[256];
  fill_table(f, table);
  const auto* cp = static_cast<const uint8_t*>(codes);
  const auto* sp = static_cast<const float*>(scales);
  const int64_t pstride = q_payload_bytes(f, n), sstride = q_num_scales(n, block);
  const float sc = static_cast<float>(scale);
  // Chunks of whole blocks (at least kChunk elements): each is summed, scaled and requantized alone.
  const int64_t span = block > kChunk ? block : kChunk;
  const int64_t nspan = (n + span - 1) / span;
  auto run = [&](int64_t c0, int64_t c1) {
    float* acc = new float[span];
    float* tmp = new float[span];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t lo = c * span, hi = lo + span < n ? lo + span : n;
      for (int64_t i = 0; i < hi - lo; ++i) acc[i] = 0.0f;
      for (int64_t j = 0; j < m; ++j) {
        dequantize_span(f, table, cp + j * pstride, sp + j * sstride, block, lo, hi, tmp);
        for (int64_t i = 0; i < hi - lo; ++i) acc[i] = acc[i] + tmp[i];
      }
      for (int64_t i = 0; i < hi - lo; ++i) acc[i] = acc[i] * sc;
      // quantize acc as elements [lo, hi): the blocks are whole (lo is a multiple of block)
      const Source<float, float, false, false> src{nullptr, acc - lo, nullptr};
      auto* oc = static_cast<uint8_t*>(out_codes);
      auto* os = static_cast<float*>(out_scales);
      const int64_t b0 = lo / block, b1 = q_num_scales(hi, block);
      if (f.bits == 8)
        quantize_blocks<float, float, false, false, false, false, 8>(f, src, nullptr, nullptr, nullptr, hi, block, 0,
                                                                    oc, os, b0, b1);
      else
        quantize_blocks<float, float, false, false, false, false, 4>(f, src, nullptr, nullptr, nullptr, hi, block, 0,
                                                                    oc, os, b0, b1);
    }
    delete[] acc;
    delete[] tmp;
  };
  if (n * m < kParallelMin) {
    run(0, nspan);
  } else {
#pragma omp parallel
    {
      int64_t c0, c1;
      thread_range(nspan, omp_get_thread_num(), omp_get_num_threads(), 1, c0, c1);
      run(c0, c1);
    }
  }
  return LC_OK;
}

LOWCOMM_EXPORT int lc_outer_merge_quantized(int dtype, int fmt, void* g, void* u, const void* codes,
                                            const void* scales, int64_t block, void* x, const void* x_sent,
                                            int64_t n, double lr, double momentum, int nesterov, double alpha,
                                            double beta, double lam, const double* lam_sums) {
  static const char* const op = "lc_outer_merge_quantized";
  QFmt f;
  const bool needs_sent = beta != 0.0 || lam != 0.0;
  if (int rc = args::merge_quantized(op, fmt, block, f, g, u, codes, scales, x, x_sent, n, momentum, needs_sent))
    return rc;
  if (n == 0) return LC_OK;
  float table[256];
  fill_table(f, table);
  const auto* cp = static_cast<const uint8_t*>(codes);
  const auto* sp = static_cast<const float*>(scales);
  // The normalized lambda from the sums in host memory, as lc_outer_merge forms it.
  const double lam_eff = lam_sums ? lam_effective(lam, lam_sums[0], lam_sums[1]) : lam;
  return dispatch_data(op, dtype, [&](auto xt) {
    using X = decltype(xt);
    using T = typename Master<X>::type;
    const MergeCoef<T> c = make_merge_coef<T>(lr, momentum, nesterov, alpha, beta, lam_eff);
    T* gp = static_cast<T*>(g);
    T* up = static_cast<T*>(u);
    X* xp = static_cast<X*>(x);
    const T* xs = static_cast<const T*>(x_sent);
    auto run = [&](auto mom_c, auto nest_c, auto full_c) {
      constexpr bool kMom = decltype(mom_c)::value, kNest = decltype(nest_c)::value,
                     kFull = decltype(full_c)::value;
      for_chunks(n, [&](int64_t lo, int64_t hi) {
        if (f.bits == 8 && !f.is_float) {  // the common wire: dequantized inside the merge's own loop
          const auto* q = reinterpret_cast<const int8_t*>(cp);
          for (int64_t a = lo; a < hi;) {
            const int64_t b = a / block, z = (b + 1) * block < hi ? (b + 1) * block : hi;
            merge_span_int8<T, X, kMom, kNest, kFull>(gp + a, kMom ? up + a : nullptr, q + a, sp[b], xp + a,
                                                      kFull ? xs + a : nullptr, z - a, c);
            a = z;
          }
          return;
        }
        float buf[kChunk];
        T wide[std::is_same<T, float>::value ? 1 : kChunk];
        dequantize_span(f, table, cp, sp, block, lo, hi, buf);
        const T* avg = reinterpret_cast<const T*>(buf);
        if constexpr (!std::is_same<T, float>::value) {
          for (int64_t i = 0; i < hi - lo; ++i) wide[i] = buf[i];
          avg = wide;
        }
        merge_span<T, X, kMom, kNest, kFull>(gp + lo, kMom ? up + lo : nullptr, avg, xp + lo,
                                             kFull ? xs + lo : nullptr, hi - lo, c);
      });
    };
    using Y = std::true_type;
    using N = std::false_type;
    auto by_full = [&](auto mom_c, auto nest_c) {
      if (c.full) run(mom_c, nest_c, Y{});
      else run(mom_c, nest_c, N{});
    };
    if (!c.momentum) by_full(N{}, N{});
    else if (c.nesterov) by_full(Y{}, Y{});
    else by_full(Y{}, N{});
  });
}

LOWCOMM_EXPORT int lc_sparse_scatter_merge_quantized(int dtype, int fmt, void* x, const int64_t* idx, int64_t k,
                                                     const void* codes, const void* scales, int64_t block,
                                                     const void* sent, double beta) {
  static const char* const op = "lc_sparse_scatter_merge_quantized";
  QFmt f;
  if (int rc = args::sparse_scatter_merge_quantized(op, fmt, block, f, x, idx, k, codes, scales, sent)) return rc;
  float table[256];
  fill_table(f, table);
  const auto* cp = static_cast<const uint8_t*>(codes);
  const auto* sp = static_cast<const float*>(scales);
  int status = LC_OK;
  const int rc = dispatch_data(op, dtype, [&](auto xt) {
    using X = decltype(xt);
    using T = typename Master<X>::type;
    const int avg_dtype = sizeof(T) == 8 ? LC_F64 : LC_F32;
    for_chunks(k, [&](int64_t lo, int64_t hi) {
      float buf[kChunk];
      T wide[std::is_same<T, float>::value ? 1 : kChunk];
      dequantize_span(f, table, cp, sp, block, lo, hi, buf);
      const void* avg = buf;
      if constexpr (!std::is_same<T, float>::value) {
        for (int64_t i = 0; i < hi - lo; ++i) wide[i] = buf[i];
        avg = wide;
      }
      const int r = lc_sparse_scatter_merge(dtype, avg_dtype, x, idx + lo, hi - lo, avg,
                                            static_cast<const T*>(sent) + lo, beta);
      if (r != LC_OK) {
#pragma omp atomic write
        status = r;
      }
    });
  });
  return rc != LC_OK ? rc : status;
}

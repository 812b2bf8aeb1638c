// Per-element maths of the quantized wire formats (lowcomm_kernels/ops/quantize.py is the
// specification), compiled by g++ (csrc/cpu/quantize.cpp) and nvcc (csrc/cuda/quantize.cu).
//
// Every step is an exactly specified fp32 operation (division, min, rint / floor, multiplication by
// a power of two) or integer code, so the backends agree bit for bit with the torch reference:
// built without contraction (-ffp-contract=off, --fmad=false), and rintf rounds half to even.
#ifndef LOWCOMM_QUANT_H_
#define LOWCOMM_QUANT_H_

#include "lowcomm/kernels.h"

namespace lowcomm {

// A format code of abi.h (LC_Q_*), unpacked.
struct QFmt {
  int bits;       // 8 or 4
  int is_float;   // 0: two's complement integer codes; 1: sign | exponent | mantissa
  float qmax;     // largest magnitude of the grid
  int man_bits;   // float formats: mantissa bits M
  int exp_bits;   // float formats: exponent bits
  int emin;       // float formats: exponent of the smallest normal value (1 - bias)
};

// false for an unknown code.
LC_HD bool qfmt_of(int code, QFmt& f) {
  switch (code) {
    case LC_Q_INT8: f = QFmt{8, 0, 127.0f, 0, 0, 0}; return true;
    case LC_Q_INT4: f = QFmt{4, 0, 7.0f, 0, 0, 0}; return true;
    case LC_Q_FP8_E4M3: f = QFmt{8, 1, 448.0f, 3, 4, -6}; return true;
    case LC_Q_FP8_E5M2: f = QFmt{8, 1, 57344.0f, 2, 5, -14}; return true;
    case LC_Q_FP4_E2M1: f = QFmt{4, 1, 6.0f, 1, 2, 0}; return true;
    case LC_Q_FP4_E3M0: f = QFmt{4, 1, 16.0f, 0, 3, -2}; return true;  // M = 0: no subnormals but 0
    default: return false;
  }
}

LC_HD int64_t q_payload_bytes(const QFmt& f, int64_t n) { return f.bits == 8 ? n : (n + 1) / 2; }
LC_HD int64_t q_num_scales(int64_t n, int64_t block) { return (n + block - 1) / block; }

// 2^e as a float, for e in the normal range.
LC_HD float q_pow2(int e) { return f32_from_bits(static_cast<uint32_t>(e + 127) << 23); }

// The block scale from the largest |w| bit pattern of the block (sign cleared; >= 0x7F800000 when
// the block holds an inf or a NaN): max|w| / qmax, or NaN for a non-finite block.
LC_HD float q_scale(const QFmt& f, uint32_t amax_bits) {
  if (amax_bits >= 0x7F800000u) return f32_from_bits(0x7FC00000u);
  return f32_from_bits(amax_bits) / f.qmax;
}

// Codes are written only for a positive finite scale; other blocks get code 0.
LC_HD bool q_scale_ok(float s) { return s > 0.0f && is_finite(s); }

// splitmix64's output for counter z (after its increment): the stochastic-rounding hash.
LC_HD uint64_t q_mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// u_i in [0, 1) of element i of the stream `key` (ops/quantize.py sr_uniform_ref).
LC_HD float q_uniform(uint64_t key, uint64_t i) {
  const uint64_t z = key + (i + 1) * 0x9E3779B97F4A7C15ull;
  return static_cast<float>(static_cast<uint32_t>(q_mix64(z) >> 40)) * 5.9604644775390625e-8f;  // 2^-24
}

// The code (low `bits` bits) of w in a block of scale s (q_scale_ok(s)); kSR: stochastic rounding
// with u, else to nearest even.
template <bool kSR>
LC_HD uint32_t q_encode(const QFmt& f, float w, float s, float u) {
  const float q = w / s;
  const uint32_t neg = f32_bits(q) >> 31;
  float m = fabsf(q);
  m = m < f.qmax ? m : f.qmax;
  int e = 0;  // the exponent of the grid spacing h
  if (f.is_float) {
    const int ew = static_cast<int>((f32_bits(m) >> 23) & 0xFF) - 127;  // floor(log2 m); -127 for 0 / subnormal
    e = (ew > f.emin ? ew : f.emin) - f.man_bits;
  }
  const float t = f.is_float ? m * q_pow2(-e) : m;  // exact
  float r;
  if (kSR) {
    const float lo = floorf(t);
    r = lo + ((u < t - lo) ? 1.0f : 0.0f);
  } else {
    r = rintf(t);
  }
  if (!f.is_float) {
    const int c = static_cast<int>(r);
    return static_cast<uint32_t>(neg ? -c : c) & ((1u << f.bits) - 1u);
  }
  const float val = r * q_pow2(e);  // the grid value, exact
  const uint32_t vb = f32_bits(val);
  const int ev = static_cast<int>((vb >> 23) & 0xFF) - 127;
  uint32_t ef, mant;
  if (ev >= f.emin && val != 0.0f) {
    ef = static_cast<uint32_t>(ev - f.emin + 1);
    mant = (vb >> (23 - f.man_bits)) & ((1u << f.man_bits) - 1u);
  } else {
    ef = 0;
    mant = static_cast<uint32_t>(val * q_pow2(f.man_bits - f.emin));
  }
  return (neg << (f.bits - 1)) | (ef << f.man_bits) | mant;
}

// value(code) in fp32: the decoding table of ops/quantize.py code_values (NaN / inf encodings of
// fp8 included, though quantize never writes them).
LC_HD float q_value(const QFmt& f, uint32_t c) {
  if (!f.is_float) {
    const int v = static_cast<int>(c) - ((c >> (f.bits - 1)) ? (1 << f.bits) : 0);
    return static_cast<float>(v);
  }
  const uint32_t neg = c >> (f.bits - 1);
  const uint32_t ef = (c >> f.man_bits) & ((1u << f.exp_bits) - 1u);
  const uint32_t mant = c & ((1u << f.man_bits) - 1u);
  if (f.bits == 8 && f.exp_bits == 4 && ef == 15 && mant == 7) return f32_from_bits(0x7FC00000u);  // e4m3fn NaN
  if (f.bits == 8 && f.exp_bits == 5 && ef == 31) {
    return mant ? f32_from_bits(0x7FC00000u) : f32_from_bits((neg << 31) | 0x7F800000u);
  }
  const float frac = static_cast<float>(mant) * q_pow2(-f.man_bits);
  const float mag = ef ? (1.0f + frac) * q_pow2(static_cast<int>(ef) - 1 + f.emin) : frac * q_pow2(f.emin);
  return neg ? -mag : mag;
}

}  // namespace lowcomm

#endif  // LOWCOMM_QUANT_H_

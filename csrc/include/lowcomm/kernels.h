// Torch-free per-element maths of every op, written once and compiled by both g++ (csrc/cpu) and
// nvcc (csrc/cuda). The loops, threading and memory access patterns live in the backends; what an
// element computes lives here, so the two backends cannot drift apart.
//
// Arithmetic is done in the compute dtype T (float or double) in the same order as the `*_ref`
// specification in lowcomm_kernels/ops (torch computes in T too); only reductions accumulate in
// double. bf16 and fp16 appear only as storage types (the wire / averaged delta; low-precision
// parameters x, whose outer state is float: see abi.h) and are converted exactly as torch
// converts them: widened exactly to float on read, rounded to nearest even once on write.
#ifndef LOWCOMM_KERNELS_H_
#define LOWCOMM_KERNELS_H_

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "lowcomm/abi.h"
#include "lowcomm/status.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#if defined(__CUDACC__)
#define LC_HD __host__ __device__ __forceinline__
#define LC_UNROLL _Pragma("unroll")
#else
#define LC_HD inline __attribute__((always_inline))
#define LC_UNROLL _Pragma("GCC unroll 4")
#endif

namespace lowcomm {

// bfloat16 as storage: the upper 16 bits of an IEEE binary32.
struct bf16 {
  uint16_t bits;
};

// IEEE binary16 (torch.float16) as storage.
struct f16 {
  uint16_t bits;
};

LC_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

LC_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

LC_HD uint64_t f64_bits(double d) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(d));
#else
  uint64_t u;
  memcpy(&u, &d, sizeof u);
  return u;
#endif
}

// float -> bf16 exactly as torch converts on each device; the bits of NaN differ by device:
//   * CUDA (device code, sm_80+): the hardware conversion, __float2bfloat16_rn (cvt.rn.bf16.f32),
//     as torch's c10::BFloat16 does on sm_80+: round to nearest even, every NaN -> 0x7FFF.
//   * CPU: round to nearest even on the bits (add 0x7FFF plus the lowest kept bit, keep the upper
//     half), every NaN -> 0xFFFF: the bits of torch's vectorised CPU conversion (at::vec
//     cvtfp32_bf16, AVX2 and AVX-512), which is what torch writes for every element of a float32
//     tensor. For a float64 tensor torch's CPU copy converts 16-element vectors the same way but
//     the < 16 elements left over at the end of each thread's range through the scalar c10 path,
//     which writes 0x7FC0, so its NaN bits there depend on torch's thread split; these kernels
//     write 0xFFFF for every NaN (tests/ops/test_csrc_bf16_bits.py pins all of this).
// Branch-free so loops vectorise.
#define LC_BF16_NAN_CPU 0xFFFFu
LC_HD bf16 bf16_from_f32(float f) {
#if defined(__CUDA_ARCH__)
  return bf16{__bfloat16_as_ushort(__float2bfloat16_rn(f))};
#else
  const uint32_t u = f32_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return bf16{static_cast<uint16_t>(nan ? LC_BF16_NAN_CPU : rounded)};
#endif
}

// float -> fp16, round to nearest even (subnormal results rounded at their own precision,
// |f| >= 65520 -> inf), as torch converts (F16C's vcvtps2ph on the CPU, __float2half_rn on CUDA).
// The CPU form is c10's fp16_ieee_from_fp32_value: the rounding is done by the float adder (the
// scaled value is added to a power of two whose ulp is the fp16 ulp of the result), so it is
// exactly the IEEE rounding; every NaN -> 0x7E00 with f's sign (torch's NaN bits differ by path:
// only NaN-ness is specified).
LC_HD f16 f16_from_f32(float f) {
#if defined(__CUDA_ARCH__)
  return f16{__half_as_ushort(__float2half_rn(f))};
#else
  const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
  const uint32_t w = f32_bits(f);
  float base = (f32_from_bits(w & 0x7FFFFFFFu) * scale_to_inf) * scale_to_zero;
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return f16{static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign))};
#endif
}

// fp16 -> float, exact (c10's fp16_ieee_to_fp32_value on the CPU: normals by an exponent
// re-bias, subnormals by a float subtraction that is exact).
LC_HD float f32_from_f16(f16 h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h.bits));
#else
  const uint32_t w = static_cast<uint32_t>(h.bits) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float exp_scale = 0x1.0p-112f;
  const float normalized_value = f32_from_bits((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = 126u << 23;
  const float magic_bias = 0.5f;
  const float denormalized_value = f32_from_bits((two_w >> 17) | magic_mask) - magic_bias;
  const uint32_t denormalized_cutoff = 1u << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? f32_bits(denormalized_value) : f32_bits(normalized_value));
  return f32_from_bits(result);
#endif
}

// Conversions between the storage types and the compute type. double -> bf16 goes through float,
// as torch's static_cast<BFloat16>(double) does (two roundings, matched bit for bit).
template <class To>
struct Cast;
template <>
struct Cast<float> {
  LC_HD static float from(float v) { return v; }
  LC_HD static float from(double v) { return static_cast<float>(v); }
  LC_HD static float from(bf16 v) { return f32_from_bits(static_cast<uint32_t>(v.bits) << 16); }
  LC_HD static float from(f16 v) { return f32_from_f16(v); }
};
template <>
struct Cast<double> {
  LC_HD static double from(float v) { return v; }
  LC_HD static double from(double v) { return v; }
  LC_HD static double from(bf16 v) { return Cast<float>::from(v); }
  LC_HD static double from(f16 v) { return Cast<float>::from(v); }
};
template <>
struct Cast<bf16> {
  LC_HD static bf16 from(float v) { return bf16_from_f32(v); }
  LC_HD static bf16 from(double v) { return bf16_from_f32(static_cast<float>(v)); }
  LC_HD static bf16 from(bf16 v) { return v; }
};
// Low-precision parameters have a float master (abi.h): fp16 is written from float only.
template <>
struct Cast<f16> {
  LC_HD static f16 from(float v) { return f16_from_f32(v); }
  LC_HD static f16 from(f16 v) { return v; }
};
template <class To, class From>
LC_HD To cast(From v) {
  return Cast<To>::from(v);
}

// Finite test on the bits (exponent not all ones): integer-only, so it vectorises without
// -ffast-math and cannot be optimised away by it.
LC_HD bool is_finite(float v) { return (f32_bits(v) & 0x7F800000u) != 0x7F800000u; }
LC_HD bool is_finite(double v) {
  return (f64_bits(v) & 0x7FF0000000000000ull) != 0x7FF0000000000000ull;
}
LC_HD bool is_finite(bf16 v) { return (v.bits & 0x7F80u) != 0x7F80u; }
LC_HD bool is_finite(f16 v) { return (v.bits & 0x7C00u) != 0x7C00u; }

// The compute (outer state) type of parameters stored as X: X itself for float / double, float
// for bf16 / fp16 (abi.h: the fp32 master of low-precision parameters).
template <class X>
struct Master {
  using type = X;
};
template <>
struct Master<bf16> {
  using type = float;
};
template <>
struct Master<f16> {
  using type = float;
};

// ---- pack ------------------------------------------------------------------------------------
// delta = (g - x) computed in T (x widened exactly from its storage type), then stored in the
// wire type W.
template <class T, class W>
LC_HD W pack_delta(T g, T x) {
  return cast<W>(g - x);
}

// ---- outer_merge -----------------------------------------------------------------------------
// Scalars of the fused outer step + merge, converted once to the compute type T (torch converts a
// Python-float multiplier to the tensor's dtype the same way).
template <class T>
struct MergeCoef {
  T lr, mu, alpha, one_minus_alpha, beta, lam;
  bool momentum, nesterov, full;  // full: the beta/lam terms are present (x_sent is read)
  bool beta_nonzero;
};

// lam_mode="normalized": lambda_eff = lam * sqrt(sv) / sqrt(sc) from the two sums of
// lc_taylor_norms (sv = sum v^2, sc = sum (v*v*D)^2), 0 when sc == 0 or lam == 0. Evaluated in
// double left to right, each step rounded once (correctly rounded sqrt and division, no
// contraction), exactly as lam_effective in ops/outer_merge.py evaluates it on Python floats.
LC_HD double lam_effective(double lam, double sv, double sc) {
  return (sc == 0.0 || lam == 0.0) ? 0.0 : lam * sqrt(sv) / sqrt(sc);
}

// The coefficients with lambda set to `lam` (double), rounded to T once as torch rounds a
// Python-float multiplier; the merge is "full" when beta or this lambda is non-zero, as the ref
// decides it on the lambda it multiplies with.
template <class T>
LC_HD MergeCoef<T> with_lam(MergeCoef<T> c, double lam) {
  c.lam = static_cast<T>(lam);
  c.full = c.beta_nonzero || lam != 0.0;
  return c;
}

template <class T>
inline MergeCoef<T> make_merge_coef(double lr, double mu, int nesterov, double alpha, double beta,
                                    double lam) {
  MergeCoef<T> c;
  c.lr = static_cast<T>(lr);
  c.mu = static_cast<T>(mu);
  c.alpha = static_cast<T>(alpha);
  c.one_minus_alpha = static_cast<T>(1.0 - alpha);  // formed in double, like the ref's (1.0 - alpha)
  c.beta = static_cast<T>(beta);
  c.momentum = mu != 0.0;
  c.nesterov = nesterov != 0;
  c.beta_nonzero = beta != 0.0;
  return with_lam(c, lam);
}

// Fused multiply-add a*b + c, rounded once. Used exactly where torch rounds once: its
// `add(other, alpha=s)` is vec::fmadd on the CPU and a contracted a + s*b on CUDA. Everywhere else
// the kernels are built without contraction, so a separate torch mul/add rounds the same here.
LC_HD float fma_t(float a, float b, float c) { return fmaf(a, b, c); }
LC_HD double fma_t(double a, double b, double c) { return fma(a, b, c); }

// torch.optim.SGD (dampening 0), op for op as _single_tensor_sgd does it:
//   u.mul_(mu).add_(d)              u = mu*u + d        (two roundings)
//   d.add(u, alpha=mu) / u          step = fma(mu, u, d) (nesterov) or u
//   g.add_(step, alpha=-lr)         g = fma(-lr, step, g)
// Without momentum u is neither read nor written and step = d.
template <class T, bool kMomentum, bool kNesterov>
LC_HD T sgd_step(T g, T& u, T d, T lr, T mu) {
  T step = d;
  if (kMomentum) {
    u = mu * u + d;
    step = kNesterov ? fma_t(mu, u, d) : u;
  }
  return fma_t(-lr, step, g);
}

// x <- (1-alpha)*(g_new + beta*v - lam*v*v*D) + alpha*x, v = x - x_sent, D = g_new - x_sent.
template <class T, bool kFull>
LC_HD T merge_x(T g_new, T x, T x_sent, T beta, T lam, T alpha, T one_minus_alpha) {
  T target = g_new;
  if (kFull) {
    const T v = x - x_sent;
    const T D = g_new - x_sent;
    target = g_new + beta * v - lam * v * v * D;
  }
  return one_minus_alpha * target + alpha * x;
}

// Terms of taylor_norms: v^2 and (v*v*D)^2 in double, v and D formed in T as the ref does.
template <class T>
LC_HD void taylor_terms(T g_new, T x, T x_sent, double& v2, double& c2) {
  const double v = static_cast<double>(x - x_sent);
  const double corr = v * v * static_cast<double>(g_new - x_sent);
  v2 = v * v;
  c2 = corr * corr;
}

// ---- sparse ----------------------------------------------------------------------------------
template <class T>
LC_HD T scatter_merge(T x, T avg, T sent, T beta) {
  return avg + beta * (x - sent);
}

// ---- mask_indices ----------------------------------------------------------------------------
// One application of the bijection P of [0, bitmask+1): four rounds of
// x = (x + a) & m; x = (x * c) & m; x ^= x >> shift   (uint64 arithmetic, wrapping like int64).
struct MaskKeys {
  uint64_t add[4], mul[4], bitmask;
  int shift;
};

LC_HD uint64_t mask_permute_once(uint64_t x, const MaskKeys& k) {
LC_UNROLL
  for (int r = 0; r < 4; ++r) {
    x = (x + k.add[r]) & k.bitmask;
    x = (x * k.mul[r]) & k.bitmask;
    x ^= x >> k.shift;
  }
  return x;
}

// pi(i): apply P until the value falls in [0, n) (cycle walking keeps it a bijection of [0, n)).
LC_HD uint64_t mask_index(uint64_t i, uint64_t n, const MaskKeys& k) {
  uint64_t x = mask_permute_once(i, k);
  while (x >= n) x = mask_permute_once(x, k);
  return x;
}

// The arguments of lc_mask_perm / lc_cuda_mask_perm (op names the entry point in the message).
// Cycle walking terminates only if [0, n) fits in the permuted domain [0, bitmask + 1).
inline int check_mask_args(const char* op, int64_t n, int64_t k, const int64_t* adds, const int64_t* muls,
                           int shift, int64_t bitmask, const int64_t* out) {
  if (n < 0) return fail(LC_EARG, op, "n = %lld is negative", static_cast<long long>(n));
  if (k < 0 || k > n)
    return fail(LC_EARG, op, "k = %lld is not in [0, n = %lld]", static_cast<long long>(k),
                static_cast<long long>(n));
  if (shift < 0 || shift > 63) return fail(LC_EARG, op, "shift = %d is not in [0, 63]", shift);
  if (bitmask < 0) return fail(LC_EARG, op, "bitmask = %lld is negative", static_cast<long long>(bitmask));
  if (k > 0 && (!adds || !muls || !out))
    return fail(LC_EARG, op, "%s is NULL", !adds ? "adds" : !muls ? "muls" : "out");
  if (k > 0 && static_cast<uint64_t>(n - 1) > static_cast<uint64_t>(bitmask))
    return fail(LC_EARG, op, "n - 1 = %lld exceeds bitmask = %lld (the domain must cover [0, n))",
                static_cast<long long>(n - 1), static_cast<long long>(bitmask));
  return LC_OK;
}

// ---- fragment_norms --------------------------------------------------------------------------
template <class T>
LC_HD double norm_term(T v, int ord) {
  const double d = cast<double>(v);
  return ord == 1 ? (d < 0 ? -d : d) : d * d;
}

}  // namespace lowcomm

#endif  // LOWCOMM_KERNELS_H_

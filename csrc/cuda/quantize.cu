// The quantized wire formats on the GPU (lowcomm_kernels/ops/quantize.py is the specification; the
// per-element maths is csrc/include/lowcomm/quant.h, shared with the CPU kernels, so every code,
// scale, residual and merged value is bit-identical to the reference by construction):
//   lc_cuda_pack_quantized      one thread block per quantization block (grid-stride over blocks):
//                               pass 1 reads the block for its absmax (an integer max of the |w| bit
//                               patterns, exact in any order), counts non-finite values and writes
//                               the snapshot; pass 2 re-reads it (from L2) and writes codes and the
//                               residual. The count is an integer atomicAdd per block (exact).
//   lc_cuda_dequantize          grid-stride over elements (4-bit: over bytes, two codes per thread)
//   lc_cuda_reduce_quantized    one thread block per quantization block: the M rows summed in fp32 in
//                               row order per element, scaled, then quantized as pack does
//   lc_cuda_outer_merge_quantized, lc_cuda_sparse_scatter_merge_quantized
//                               the dense merges with Δ̄ dequantized per element in registers
// A 4-bit byte holds two consecutive elements of one block (block is even), so a thread owns whole
// bytes and no two threads write the same byte. Indices are int64 throughout; sizes need no alignment.
#include "cuda_common.cuh"
#include "lowcomm/quant.h"

namespace lowcomm {
namespace cuda {
namespace {

// log2 of a power of two.
inline int log2_of(int64_t p) {
  int s = 0;
  while ((int64_t(1) << s) < p) ++s;
  return s;
}

// e_i in the compute dtype T: g - x (+ r) (pack), or the input g of dtype X (quantize, x NULL).
template <class T, class X, bool kPack, bool kRes>
__device__ __forceinline__ T source_at(const T* __restrict__ g, const X* __restrict__ x, const T* __restrict__ r,
                                       const X* __restrict__ v, int64_t i) {
  if constexpr (kPack) {
    T e = g[i] - cast<T>(x[i]);
    if constexpr (kRes) e = e + r[i];
    return e;
  } else {
    return cast<T>(v[i]);
  }
}

// Threads of one quantization block's thread block: one per element (8-bit) or per byte (4-bit),
// at least a warp, at most kThreads.
inline int block_threads(int64_t units) {
  return units >= kThreads ? kThreads : (units <= 32 ? 32 : static_cast<int>((units + 31) / 32 * 32));
}

// Pack / quantize: scales, codes, snapshot (kSnap), residual (kRes, in blocks with a usable scale).
template <class T, class X, bool kPack, bool kRes, bool kSnap, bool kSR, int kBits>
__global__ void quantize_kernel(QFmt f, const T* __restrict__ g, const X* __restrict__ x, T* __restrict__ snap,
                                T* res, const X* __restrict__ v, int64_t n, int64_t block, int64_t nb, uint64_t key,
                                uint8_t* __restrict__ codes, float* __restrict__ scales,
                                unsigned long long* __restrict__ nonfinite) {
  __shared__ unsigned int s_amax;
  __shared__ unsigned long long s_bad;
  for (int64_t b = blockIdx.x; b < nb; b += gridDim.x) {
    const int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
    if (threadIdx.x == 0) {
      s_amax = 0;
      s_bad = 0;
    }
    __syncthreads();
    unsigned int amax = 0;
    unsigned long long bad = 0;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
      const float w = cast<float>(source_at<T, X, kPack, kRes>(g, x, res, v, i));
      const uint32_t a = f32_bits(w) & 0x7FFFFFFFu;
      amax = a > amax ? a : amax;
      bad += a >= 0x7F800000u ? 1 : 0;
      if constexpr (kSnap) snap[i] = cast<T>(x[i]);
    }
    atomicMax(&s_amax, amax);
    if (bad) atomicAdd(&s_bad, bad);
    __syncthreads();
    const float s = q_scale(f, s_amax);
    if (threadIdx.x == 0) {
      scales[b] = s;
      if (s_bad) atomicAdd(nonfinite, s_bad);
    }
    const bool ok = q_scale_ok(s);
    if constexpr (kBits == 8) {
      for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        uint32_t c = 0;
        if (ok) {
          const T e = source_at<T, X, kPack, kRes>(g, x, res, v, i);
          const float u = kSR ? q_uniform(key, static_cast<uint64_t>(i)) : 0.0f;
          c = q_encode<kSR>(f, cast<float>(e), s, u);
          if constexpr (kRes) res[i] = e - static_cast<T>(q_value(f, c) * s);
        }
        codes[i] = static_cast<uint8_t>(c);
      }
    } else {
      for (int64_t i = lo + 2 * threadIdx.x; i < hi; i += 2 * blockDim.x) {
        uint32_t pair = 0;
        if (ok) {
          for (int j = 0; j < 2 && i + j < hi; ++j) {
            const T e = source_at<T, X, kPack, kRes>(g, x, res, v, i + j);
            const float u = kSR ? q_uniform(key, static_cast<uint64_t>(i + j)) : 0.0f;
            const uint32_t c = q_encode<kSR>(f, cast<float>(e), s, u);
            pair |= c << (4 * j);
            if constexpr (kRes) res[i + j] = e - static_cast<T>(q_value(f, c) * s);
          }
        }
        codes[i >> 1] = static_cast<uint8_t>(pair);
      }
    }
    __syncthreads();  // s_amax / s_bad are reset for the next block
  }
}

// Decoded code of element i (4-bit: the nibble of its byte).
template <int kBits>
__device__ __forceinline__ uint32_t code_at(const uint8_t* __restrict__ codes, int64_t i) {
  if constexpr (kBits == 8) return codes[i];
  return (codes[i >> 1] >> (4 * (i & 1))) & 0xFu;
}

template <class O, int kBits>
__global__ void dequantize_kernel(QFmt f, const uint8_t* __restrict__ codes, const float* __restrict__ scales,
                                  int64_t n, int shift, O* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = cast<O>(q_value(f, code_at<kBits>(codes, i)) * scales[i >> shift]);
}

// acc_i = (sum over rows, in row order, of value * scale) * sc, in fp32.
template <int kBits>
__device__ __forceinline__ float reduce_at(const QFmt& f, const uint8_t* __restrict__ codes,
                                           const float* __restrict__ scales, int64_t m, int64_t pstride,
                                           int64_t sstride, int shift, float sc, int64_t i) {
  float acc = 0.0f;
  for (int64_t j = 0; j < m; ++j)
    acc = acc + q_value(f, code_at<kBits>(codes + j * pstride, i)) * scales[j * sstride + (i >> shift)];
  return acc * sc;
}

template <int kBits>
__global__ void reduce_kernel(QFmt f, const uint8_t* __restrict__ codes, const float* __restrict__ scales,
                              int64_t m, int64_t n, int64_t block, int shift, int64_t nb, float sc,
                              uint8_t* __restrict__ out_codes, float* __restrict__ out_scales) {
  __shared__ unsigned int s_amax;
  const int64_t pstride = q_payload_bytes(f, n), sstride = nb;
  for (int64_t b = blockIdx.x; b < nb; b += gridDim.x) {
    const int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
    if (threadIdx.x == 0) s_amax = 0;
    __syncthreads();
    unsigned int amax = 0;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
      const uint32_t a = f32_bits(reduce_at<kBits>(f, codes, scales, m, pstride, sstride, shift, sc, i)) & 0x7FFFFFFFu;
      amax = a > amax ? a : amax;
    }
    atomicMax(&s_amax, amax);
    __syncthreads();
    const float s = q_scale(f, s_amax);
    if (threadIdx.x == 0) out_scales[b] = s;
    const bool ok = q_scale_ok(s);
    if constexpr (kBits == 8) {
      for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const uint32_t c =
            ok ? q_encode<false>(f, reduce_at<kBits>(f, codes, scales, m, pstride, sstride, shift, sc, i), s, 0.0f) : 0u;
        out_codes[i] = static_cast<uint8_t>(c);
      }
    } else {
      for (int64_t i = lo + 2 * threadIdx.x; i < hi; i += 2 * blockDim.x) {
        uint32_t pair = 0;
        if (ok) {
          for (int j = 0; j < 2 && i + j < hi; ++j) {
            const float a = reduce_at<kBits>(f, codes, scales, m, pstride, sstride, shift, sc, i + j);
            pair |= q_encode<false>(f, a, s, 0.0f) << (4 * j);
          }
        }
        out_codes[i >> 1] = static_cast<uint8_t>(pair);
      }
    }
    __syncthreads();
  }
}

template <class T>
__device__ __forceinline__ T step_elem(T g, T& u, T d, const MergeCoef<T>& c) {
  if (!c.momentum) return sgd_step<T, false, false>(g, u, d, c.lr, c.mu);
  return c.nesterov ? sgd_step<T, true, true>(g, u, d, c.lr, c.mu) : sgd_step<T, true, false>(g, u, d, c.lr, c.mu);
}

template <class T>
__device__ __forceinline__ T merge_elem(T gn, T x, T xs, const MergeCoef<T>& c) {
  return c.full ? merge_x<T, true>(gn, x, xs, c.beta, c.lam, c.alpha, c.one_minus_alpha)
                : merge_x<T, false>(gn, x, xs, c.beta, c.lam, c.alpha, c.one_minus_alpha);
}

// lc_cuda_outer_merge's element step with d_i = value(code_i) * scale (fp32), widened to T.
template <class T, class X, int kBits>
__global__ void merge_quantized_kernel(QFmt f, T* __restrict__ g, T* __restrict__ u,
                                       const uint8_t* __restrict__ codes, const float* __restrict__ scales,
                                       int shift, X* __restrict__ x, const T* __restrict__ xs, int64_t n,
                                       MergeCoef<T> c, const double* __restrict__ lam_sums, double lam) {
  if (lam_sums != nullptr) c = with_lam(c, lam_effective(lam, lam_sums[0], lam_sums[1]));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T d = static_cast<T>(q_value(f, code_at<kBits>(codes, i)) * scales[i >> shift]);
    T ui = c.momentum ? u[i] : T(0);
    const T gn = step_elem<T>(g[i], ui, d, c);
    g[i] = gn;
    if (c.momentum) u[i] = ui;
    x[i] = cast<X>(merge_elem<T>(gn, cast<T>(x[i]), c.full ? xs[i] : T(0), c));
  }
}

template <class T, class X, int kBits>
__global__ void scatter_merge_quantized_kernel(QFmt f, X* __restrict__ x, const int64_t* __restrict__ idx, int64_t k,
                                               const uint8_t* __restrict__ codes, const float* __restrict__ scales,
                                               int shift, const T* __restrict__ sent, T beta) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < k; j += stride) {
    const T avg = static_cast<T>(q_value(f, code_at<kBits>(codes, j)) * scales[j >> shift]);
    const int64_t i = idx[j];
    x[i] = cast<X>(scatter_merge<T>(cast<T>(x[i]), avg, sent[j], beta));
  }
}

// Grid of the per-quantization-block kernels: one thread block per block, capped like grid_for.
inline int blocks_grid(int64_t nb, int threads) {
  const int cap = grid_for(int64_t(1) << 40, threads);
  return static_cast<int>(nb < cap ? nb : cap);
}

template <class T, class X, bool kPack, bool kRes, bool kSnap, bool kSR>
void launch_quantize(const QFmt& f, const T* g, const X* x, T* snap, T* res, const X* v, int64_t n, int64_t block,
                     uint64_t key, uint8_t* codes, float* scales, unsigned long long* nf, cudaStream_t s) {
  const int64_t nb = q_num_scales(n, block);
  const int threads = block_threads(f.bits == 8 ? block : block / 2);
  const int grid = blocks_grid(nb, threads);
  if (f.bits == 8)
    quantize_kernel<T, X, kPack, kRes, kSnap, kSR, 8>
        <<<grid, threads, 0, s>>>(f, g, x, snap, res, v, n, block, nb, key, codes, scales, nf);
  else
    quantize_kernel<T, X, kPack, kRes, kSnap, kSR, 4>
        <<<grid, threads, 0, s>>>(f, g, x, snap, res, v, n, block, nb, key, codes, scales, nf);
}

// Runtime flags -> template arguments (as csrc/cpu/quantize.cpp quantize_dispatch).
template <class T, class X, bool kPack>
void quantize_dispatch(const QFmt& f, const T* g, const X* x, T* snap, T* res, const X* v, int64_t n,
                       int64_t block, int sr, uint64_t key, uint8_t* codes, float* scales, unsigned long long* nf,
                       cudaStream_t s) {
  auto go = [&](auto res_c, auto snap_c) {
    constexpr bool kRes = decltype(res_c)::value, kSnap = decltype(snap_c)::value;
    if (sr)
      launch_quantize<T, X, kPack, kRes, kSnap, true>(f, g, x, snap, res, v, n, block, key, codes, scales, nf, s);
    else
      launch_quantize<T, X, kPack, kRes, kSnap, false>(f, g, x, snap, res, v, n, block, key, codes, scales, nf, s);
  };
  using Y = std::true_type;
  using N = std::false_type;
  if constexpr (!kPack) {
    go(N{}, N{});
  } else {
    if (res && snap) go(Y{}, Y{});
    else if (res) go(Y{}, N{});
    else if (snap) go(N{}, Y{});
    else go(N{}, N{});
  }
}

}  // namespace
}  // namespace cuda
}  // namespace lowcomm

using namespace lowcomm;
using namespace lowcomm::cuda;

LOWCOMM_EXPORT int lc_cuda_pack_quantized(int dtype, int fmt, const void* g, const void* x, void* residual,
                                          void* snapshot, int64_t n, int64_t block, int sr, int64_t key,
                                          void* codes, void* scales, int64_t* nonfinite, void* stream) {
  static const char* const op = "lc_cuda_pack_quantized";
  QFmt f;
  if (int rc = args::pack_quantized(op, fmt, block, f, g, x, residual, snapshot, n, codes, scales)) return rc;
  if (!nonfinite) return fail(LC_EARG, op, "nonfinite is NULL");
  DeviceGuard guard(nonfinite);
  cudaStream_t s = as_stream(stream);
  const cudaError_t e = cudaMemsetAsync(nonfinite, 0, sizeof(int64_t), s);
  if (e != cudaSuccess) return cuda_fail(op, "cudaMemsetAsync(nonfinite)", e);
  auto* nf = reinterpret_cast<unsigned long long*>(nonfinite);
  const uint64_t k = static_cast<uint64_t>(key);
  auto* cp = static_cast<uint8_t*>(codes);
  auto* sp = static_cast<float*>(scales);
  return dispatch_data(op, dtype, [&](auto xt) {
    using X = decltype(xt);
    using T = typename Master<X>::type;
    if (n == 0) return LC_OK;
    if (x) {
      quantize_dispatch<T, X, true>(f, static_cast<const T*>(g), static_cast<const X*>(x),
                                    static_cast<T*>(snapshot), static_cast<T*>(residual), nullptr, n, block, sr, k,
                                    cp, sp, nf, s);
    } else {
      quantize_dispatch<T, X, false>(f, nullptr, nullptr, nullptr, nullptr, static_cast<const X*>(g), n, block, sr,
                                     k, cp, sp, nf, s);
    }
    return launch_status(op);
  });
}

LOWCOMM_EXPORT int lc_cuda_dequantize(int fmt, const void* codes, const void* scales, int64_t n, int64_t block,
                                      int out_dtype, void* out, void* stream) {
  static const char* const op = "lc_cuda_dequantize";
  QFmt f;
  if (int rc = args::dequantize(op, fmt, block, f, codes, scales, n, out)) return rc;
  DeviceGuard guard(out);
  const int shift = log2_of(block);
  return dispatch_data(op, out_dtype, [&](auto ot) {
    using O = decltype(ot);
    if (n == 0) return LC_OK;
    const auto* cp = static_cast<const uint8_t*>(codes);
    const auto* sp = static_cast<const float*>(scales);
    O* outp = static_cast<O*>(out);
    cudaStream_t s = as_stream(stream);
    if (f.bits == 8)
      dequantize_kernel<O, 8><<<grid_for(n), kThreads, 0, s>>>(f, cp, sp, n, shift, outp);
    else
      dequantize_kernel<O, 4><<<grid_for(n), kThreads, 0, s>>>(f, cp, sp, n, shift, outp);
    return launch_status(op);
  });
}

LOWCOMM_EXPORT int lc_cuda_reduce_quantized(int fmt, const void* codes, const void* scales, int64_t m, int64_t n,
                                            int64_t block, double scale, void* out_codes, void* out_scales,
                                            void* stream) {
  static const char* const op = "lc_cuda_reduce_quantized";
  QFmt f;
  if (int rc = args::reduce_quantized(op, fmt, block, f, codes, scales, m, n, out_codes, out_scales)) return rc;
  if (n == 0) return LC_OK;
  DeviceGuard guard(out_codes);
  const int64_t nb = q_num_scales(n, block);
  const int threads = block_threads(f.bits == 8 ? block : block / 2);
  const int grid = blocks_grid(nb, threads);
  const int shift = log2_of(block);
  const auto* cp = static_cast<const uint8_t*>(codes);
  const auto* sp = static_cast<const float*>(scales);
  auto* oc = static_cast<uint8_t*>(out_codes);
  auto* os = static_cast<float*>(out_scales);
  const float sc = static_cast<float>(scale);
  cudaStream_t s = as_stream(stream);
  if (f.bits == 8)
    reduce_kernel<8><<<grid, threads, 0, s>>>(f, cp, sp, m, n, block, shift, nb, sc, oc, os);
  else
    reduce_kernel<4><<<grid, threads, 0, s>>>(f, cp, sp, m, n, block, shift, nb, sc, oc, os);
  return launch_status(op);
}

LOWCOMM_EXPORT int lc_cuda_outer_merge_quantized(int dtype, int fmt, void* g, void* u, const void* codes,
                                                 const void* scales, int64_t block, void* x, const void* x_sent,
                                                 int64_t n, double lr, double momentum, int nesterov,
                                                 double alpha, double beta, double lam, const double* lam_sums,
                                                 void* stream) {
  static const char* const op = "lc_cuda_outer_merge_quantized";
  QFmt f;
  const bool needs_sent = beta != 0.0 || lam != 0.0;
  if (int rc = args::merge_quantized(op, fmt, block, f, g, u, codes, scales, x, x_sent, n, momentum, needs_sent))
    return rc;
  if (n == 0) return LC_OK;
  DeviceGuard guard(g);
  const int shift = log2_of(block);
  return dispatch_data(op, dtype, [&](auto xt) {
    using X = decltype(xt);
    using T = typename Master<X>::type;
    const MergeCoef<T> c = make_merge_coef<T>(lr, momentum, nesterov, alpha, beta, lam);
    T* gp = static_cast<T*>(g);
    T* up = c.momentum ? static_cast<T*>(u) : nullptr;
    const T* xs = needs_sent ? static_cast<const T*>(x_sent) : nullptr;
    const auto* cp = static_cast<const uint8_t*>(codes);
    const auto* sp = static_cast<const float*>(scales);
    X* xp = static_cast<X*>(x);
    cudaStream_t s = as_stream(stream);
    if (f.bits == 8)
      merge_quantized_kernel<T, X, 8>
          <<<grid_for(n), kThreads, 0, s>>>(f, gp, up, cp, sp, shift, xp, xs, n, c, lam_sums, lam);
    else
      merge_quantized_kernel<T, X, 4>
          <<<grid_for(n), kThreads, 0, s>>>(f, gp, up, cp, sp, shift, xp, xs, n, c, lam_sums, lam);
    return launch_status(op);
  });
}

LOWCOMM_EXPORT int lc_cuda_sparse_scatter_merge_quantized(int dtype, int fmt, void* x, const int64_t* idx,
                                                          int64_t k, const void* codes, const void* scales,
                                                          int64_t block, const void* sent, double beta,
                                                          void* stream) {
  static const char* const op = "lc_cuda_sparse_scatter_merge_quantized";
  QFmt f;
  if (int rc = args::sparse_scatter_merge_quantized(op, fmt, block, f, x, idx, k, codes, scales, sent)) return rc;
  if (k == 0) return LC_OK;
  DeviceGuard guard(x);
  const int shift = log2_of(block);
  return dispatch_data(op, dtype, [&](auto xt) {
    using X = decltype(xt);
    using T = typename Master<X>::type;
    const auto* cp = static_cast<const uint8_t*>(codes);
    const auto* sp = static_cast<const float*>(scales);
    cudaStream_t s = as_stream(stream);
    if (f.bits == 8)
      scatter_merge_quantized_kernel<T, X, 8><<<grid_for(k), kThreads, 0, s>>>(
          f, static_cast<X*>(x), idx, k, cp, sp, shift, static_cast<const T*>(sent), static_cast<T>(beta));
    else
      scatter_merge_quantized_kernel<T, X, 4><<<grid_for(k), kThreads, 0, s>>>(
          f, static_cast<X*>(x), idx, k, cp, sp, shift, static_cast<const T*>(sent), static_cast<T>(beta));
    return launch_status(op);
  });
}

// The C ABI of liblowcomm_cpu and liblowcomm_cuda: the contract with lowcomm_kernels/_native.py
// (SIGNATURES there must match these declarations argument for argument).
//
// Conventions
//   * dtype codes: LC_F32 = 0, LC_F64 = 1, LC_BF16 = 2 (bf16 = the upper 16 bits of an IEEE float,
//     round-to-nearest-even on conversion as torch does; NaN stays NaN (see kernels.h for which NaN)),
//     LC_F16 = 3 (IEEE binary16, round-to-nearest-even, overflow to inf).
//   * `dtype` is the dtype of the parameters x. The outer state that goes with them (g, u,
//     x_sent, pack's snapshot, the scatter's sent) is in the compute dtype: dtype itself for f32
//     and f64, f32 for bf16 and f16 (the fp32 master copy of low-precision parameters). Every
//     element is computed in the compute dtype; a bf16 / f16 x is widened exactly on read and
//     rounded to nearest even once on write. Wire buffers (delta, delta_avg, avg) are the compute
//     dtype or bf16.
//   * Buffers are flat, contiguous, and hold `n` (or `k`) elements; no alignment is required.
//   * Every entry point returns LC_OK (0) on success and LC_EBADTYPE for an unsupported dtype
//     combination, LC_EARG for a bad argument (negative length, NULL where one is required),
//     LC_ECUDA for a failed CUDA call (a kernel launch, a stream-ordered allocation or memset).
//     After a non-zero return, lc_last_error() (lc_cuda_last_error() for the CUDA library) gives
//     one line naming the entry point and the argument at fault, or the CUDA call and its error
//     (csrc/include/lowcomm/status.h).
//   * CUDA variants are named lc_cuda_<name>, take the same arguments plus a trailing cudaStream_t
//     (as void*), read and write device memory only (scalar outputs are device pointers), and are
//     asynchronous on that stream.
#ifndef LOWCOMM_ABI_H_
#define LOWCOMM_ABI_H_

#include <stdint.h>

#define LOWCOMM_EXPORT extern "C" __attribute__((visibility("default")))

#define LC_F32 0
#define LC_F64 1
#define LC_BF16 2
#define LC_F16 3

#define LC_OK 0
#define LC_EBADTYPE 1
#define LC_EARG 2
#define LC_ECUDA 3

// Quantized wire formats (lowcomm_kernels/ops/quantize.py FORMATS, in that order): codes of
// `bits` each (4-bit codes two per byte, low nibble first) and one fp32 scale per `block` elements.
#define LC_Q_INT8 0
#define LC_Q_INT4 1
#define LC_Q_FP8_E4M3 2
#define LC_Q_FP8_E5M2 3
#define LC_Q_FP4_E2M1 4
#define LC_Q_FP4_E3M0 5

// delta = g - x in wire_dtype (the compute dtype, or bf16); snapshot (may be NULL, compute dtype) = x;
// *nonfinite = number of non-finite values written to delta. Reads g, x; writes delta, snapshot.
LOWCOMM_EXPORT int lc_pack(int dtype, int wire_dtype, const void* g, const void* x, void* delta,
                           void* snapshot, int64_t n, int64_t* nonfinite);

// torch.optim.SGD(lr, momentum, nesterov, dampening=0) on g with gradient delta_avg (dtype or bf16)
// and momentum buffer u, then x = (1-alpha)*(g + beta*v - lam_eff*v*v*D) + alpha*x with
// v = x - x_sent, D = g - x_sent (g after the step). lam_sums NULL: lam_eff = lam (absolute).
// Otherwise lam_sums points to the two float64 sums of lc_taylor_norms (device memory for the CUDA
// variant) and lam_eff = lam * sqrt(lam_sums[0]) / sqrt(lam_sums[1]), 0 when lam_sums[1] == 0 or
// lam == 0, computed in double by the kernel (kernels.h lam_effective): the normalized mode
// without a host read. x_sent may be NULL iff beta == lam == 0. In place on g, u (untouched when
// momentum == 0) and x.
LOWCOMM_EXPORT int lc_outer_merge(int dtype, int avg_dtype, void* g, void* u, const void* delta_avg,
                                  void* x, const void* x_sent, int64_t n, double lr, double momentum,
                                  int nesterov, double alpha, double beta, double lam,
                                  const double* lam_sums);

// out2[0] = sum v^2, out2[1] = sum (v*v*D)^2 (float64 accumulation, fixed order: bit-identical
// from call to call) for the g that lc_outer_merge's step would produce. Writes out2 only.
LOWCOMM_EXPORT int lc_taylor_norms(int dtype, int avg_dtype, const void* g, const void* u,
                                   const void* delta_avg, const void* x, const void* x_sent, int64_t n,
                                   double lr, double momentum, int nesterov, double* out2);

// out[i] = pi(i) for i < k: the keyed bijection of ops/mask_indices.py (4 rounds of add, multiply,
// xor-shift mod bitmask+1, cycle-walked into [0, n)). adds/muls: int64[4].
LOWCOMM_EXPORT int lc_mask_perm(int64_t n, int64_t k, const int64_t* adds, const int64_t* muls, int shift,
                                int64_t bitmask, int64_t* out);

// out[j] = x[idx[j]], j < k; x and out both of dtype (any of the four codes).
LOWCOMM_EXPORT int lc_sparse_gather(int dtype, const void* x, const int64_t* idx, int64_t k, void* out);

// x[idx[j]] = avg[j] + beta*(x[idx[j]] - sent[j]) in the compute dtype; sent is the compute dtype,
// avg the compute dtype or bf16; idx without duplicates.
LOWCOMM_EXPORT int lc_sparse_scatter_merge(int dtype, int avg_dtype, void* x, const int64_t* idx, int64_t k,
                                           const void* avg, const void* sent, double beta);

// out[s] = ||buf[offsets[s]:offsets[s+1]]||_ord (ord 1 or 2), buf of any of the four dtypes,
// float64 accumulation in a fixed order
// (bit-identical from call to call, whatever the thread count).
LOWCOMM_EXPORT int lc_fragment_norms(int dtype, const void* buf, const int64_t* offsets, int64_t nseg, int ord,
                                     double* out);

// memcpy with non-temporal stores: the honest roofline row of the benchmarks.
LOWCOMM_EXPORT int lc_copy_nt(void* dst, const void* src, int64_t nbytes);

// ---- quantized wire formats (fmt: LC_Q_*; block: a power of two >= 2; ops/quantize.py is the spec)
// x non-NULL (pack): e = g - x (+ residual if non-NULL) in dtype's compute type, g / residual /
// snapshot in the compute type, x of dtype; snapshot (may be NULL) = x; residual <- e - dequant in
// blocks with a finite scale. x NULL (quantize): e = g, of dtype. Writes codes (payload bytes),
// scales (ceil(n / block) fp32) and, if non-NULL, *nonfinite = #{i : fp32(e_i) not finite}.
// sr != 0: stochastic rounding with the stream `key` (the bits of ops/quantize.py sr_key).
LOWCOMM_EXPORT int lc_pack_quantized(int dtype, int fmt, const void* g, const void* x, void* residual,
                                     void* snapshot, int64_t n, int64_t block, int sr, int64_t key, void* codes,
                                     void* scales, int64_t* nonfinite);

// out (n elements of out_dtype) = value(code) * scale in fp32, rounded to out_dtype.
LOWCOMM_EXPORT int lc_dequantize(int fmt, const void* codes, const void* scales, int64_t n, int64_t block,
                                 int out_dtype, void* out);

// codes (m rows of payload bytes), scales (m rows of ceil(n / block)): acc = sum over rows 0..m-1
// of the dequantized rows in fp32, in that order; acc * (float)scale; requantized (to nearest
// even) into out_codes / out_scales.
LOWCOMM_EXPORT int lc_reduce_quantized(int fmt, const void* codes, const void* scales, int64_t m, int64_t n,
                                       int64_t block, double scale, void* out_codes, void* out_scales);

// lc_outer_merge with delta_avg given as codes / scales (dequantized to the compute dtype on the
// fly, never stored whole).
LOWCOMM_EXPORT int lc_outer_merge_quantized(int dtype, int fmt, void* g, void* u, const void* codes,
                                            const void* scales, int64_t block, void* x, const void* x_sent,
                                            int64_t n, double lr, double momentum, int nesterov, double alpha,
                                            double beta, double lam, const double* lam_sums);

// lc_sparse_scatter_merge with avg (k values) given as codes / scales.
LOWCOMM_EXPORT int lc_sparse_scatter_merge_quantized(int dtype, int fmt, void* x, const int64_t* idx, int64_t k,
                                                     const void* codes, const void* scales, int64_t block,
                                                     const void* sent, double beta);

// Top-k sparse wire format with error feedback (lowcomm_kernels/ops/topk.py is the spec): per chunk
// of `chunk` values (2 .. 2^30) the k (1 .. chunk) largest |e| after e = e*beta + delta, `bits`
// (1, 2, 4) per value and one fp32 scale; e (dtype f32 / f64, as delta) loses what was sent.
// Writes payload (the format's bytes) and *nonfinite.
LOWCOMM_EXPORT int lc_topk_encode(int dtype, const void* delta, void* e, int64_t n, int64_t k, int64_t chunk,
                                  int bits, double beta, void* payload, int64_t* nonfinite);

// out (n values of dtype f32 / f64) += the payload's values at their positions; a payload index
// past its chunk is LC_EARG before anything is written.
LOWCOMM_EXPORT int lc_topk_decode_add(int dtype, const void* payload, int64_t n, int64_t k, int64_t chunk, int bits,
                                      void* out);

// Library identity string.
LOWCOMM_EXPORT const char* lc_version(void);

// The calling thread's message of its last failed call (see Conventions).
LOWCOMM_EXPORT const char* lc_last_error(void);

// ---- liblowcomm_cuda: the same operations on device memory, asynchronous on `stream` ----------
// Scalar inputs and outputs (lam_sums, nonfinite, out2, out) are device pointers; nonfinite is
// zeroed on the stream first (the kernel adds into it). adds/muls of lc_cuda_mask_perm are device
// int64[4]. lc_cuda_taylor_norms and lc_cuda_fragment_norms reduce in a fixed order (per-block
// partials in a stream-ordered scratch buffer, then a second pass over them in order), so their
// bits repeat from call to call and do not depend on the grid or the device (the order is in
// csrc/cuda/fragment_norms.cu and outer_merge.cu); they are not the CPU's order.
LOWCOMM_EXPORT int lc_cuda_pack(int dtype, int wire_dtype, const void* g, const void* x, void* delta,
                                void* snapshot, int64_t n, int64_t* nonfinite, void* stream);
LOWCOMM_EXPORT int lc_cuda_outer_merge(int dtype, int avg_dtype, void* g, void* u, const void* delta_avg,
                                       void* x, const void* x_sent, int64_t n, double lr, double momentum,
                                       int nesterov, double alpha, double beta, double lam,
                                       const double* lam_sums, void* stream);
LOWCOMM_EXPORT int lc_cuda_taylor_norms(int dtype, int avg_dtype, const void* g, const void* u,
                                        const void* delta_avg, const void* x, const void* x_sent, int64_t n,
                                        double lr, double momentum, int nesterov, double* out2, void* stream);
LOWCOMM_EXPORT int lc_cuda_mask_perm(int64_t n, int64_t k, const int64_t* adds, const int64_t* muls, int shift,
                                     int64_t bitmask, int64_t* out, void* stream);
LOWCOMM_EXPORT int lc_cuda_sparse_gather(int dtype, const void* x, const int64_t* idx, int64_t k, void* out,
                                         void* stream);
LOWCOMM_EXPORT int lc_cuda_sparse_scatter_merge(int dtype, int avg_dtype, void* x, const int64_t* idx,
                                                int64_t k, const void* avg, const void* sent, double beta,
                                                void* stream);
LOWCOMM_EXPORT int lc_cuda_fragment_norms(int dtype, const void* buf, const int64_t* offsets, int64_t nseg,
                                          int ord, double* out, void* stream);
LOWCOMM_EXPORT int lc_cuda_copy_nt(void* dst, const void* src, int64_t nbytes, void* stream);
LOWCOMM_EXPORT int lc_cuda_pack_quantized(int dtype, int fmt, const void* g, const void* x, void* residual,
                                          void* snapshot, int64_t n, int64_t block, int sr, int64_t key,
                                          void* codes, void* scales, int64_t* nonfinite, void* stream);
LOWCOMM_EXPORT int lc_cuda_dequantize(int fmt, const void* codes, const void* scales, int64_t n, int64_t block,
                                      int out_dtype, void* out, void* stream);
LOWCOMM_EXPORT int lc_cuda_reduce_quantized(int fmt, const void* codes, const void* scales, int64_t m, int64_t n,
                                            int64_t block, double scale, void* out_codes, void* out_scales,
                                            void* stream);
LOWCOMM_EXPORT int lc_cuda_outer_merge_quantized(int dtype, int fmt, void* g, void* u, const void* codes,
                                                 const void* scales, int64_t block, void* x, const void* x_sent,
                                                 int64_t n, double lr, double momentum, int nesterov,
                                                 double alpha, double beta, double lam, const double* lam_sums,
                                                 void* stream);
LOWCOMM_EXPORT int lc_cuda_sparse_scatter_merge_quantized(int dtype, int fmt, void* x, const int64_t* idx,
                                                          int64_t k, const void* codes, const void* scales,
                                                          int64_t block, const void* sent, double beta,
                                                          void* stream);
// The top-k format on CUDA: fp32 data (decode: f32 / f64 out) and chunks of at most 4096 values (a
// block sorts a chunk in shared memory); a decode skips an index past its chunk (no host read).
LOWCOMM_EXPORT int lc_cuda_topk_encode(int dtype, const void* delta, void* e, int64_t n, int64_t k, int64_t chunk,
                                       int bits, double beta, void* payload, int64_t* nonfinite, void* stream);
LOWCOMM_EXPORT int lc_cuda_topk_decode_add(int dtype, const void* payload, int64_t n, int64_t k, int64_t chunk,
                                           int bits, void* out, void* stream);
LOWCOMM_EXPORT const char* lc_cuda_version(void);
LOWCOMM_EXPORT const char* lc_cuda_last_error(void);

#endif  // LOWCOMM_ABI_H_

// The argument checks of the C ABI, written once for liblowcomm_cpu (g++) and liblowcomm_cuda
// (nvcc): each returns LC_OK, or the failure's LC_E* code after writing the message that names the
// entry point `op` and the argument at fault (status.h). An entry point runs them before it reads
// or writes anything; what only one backend needs (a device guard, a NULL nonfinite that the CUDA
// kernels add into) stays in that backend's source.
#ifndef LOWCOMM_ARGS_H_
#define LOWCOMM_ARGS_H_

#include <stdint.h>

#include "lowcomm/abi.h"
#include "lowcomm/quant.h"
#include "lowcomm/status.h"

namespace lowcomm {
namespace args {

inline int negative(const char* op, const char* name, int64_t v) {
  return fail(LC_EARG, op, "%s = %lld is negative", name, static_cast<long long>(v));
}

// lc_pack: n >= 0, nonfinite always, g / x / delta when there is data.
inline int pack(const char* op, const void* g, const void* x, const void* delta, int64_t n,
                const int64_t* nonfinite) {
  if (n < 0) return negative(op, "n", n);
  if (!nonfinite) return fail(LC_EARG, op, "nonfinite is NULL");
  if (n > 0 && (!g || !x || !delta)) return fail(LC_EARG, op, "%s is NULL", !g ? "g" : !x ? "x" : "delta");
  return LC_OK;
}

// lc_outer_merge and lc_taylor_norms (and the quantized merge's dense part): u may be NULL only
// when momentum is 0, x_sent only when it is not read.
inline int merge(const char* op, const void* g, const void* u, const void* delta_avg, const void* x,
                 const void* x_sent, int64_t n, double momentum, bool needs_sent) {
  if (n < 0) return negative(op, "n", n);
  if (n == 0) return LC_OK;
  if (!g) return fail(LC_EARG, op, "g is NULL");
  if (!delta_avg) return fail(LC_EARG, op, "delta_avg is NULL");
  if (!x) return fail(LC_EARG, op, "x is NULL");
  if (!u && momentum != 0.0) return fail(LC_EARG, op, "u is NULL while momentum = %g is non-zero", momentum);
  if (!x_sent && needs_sent) return fail(LC_EARG, op, "x_sent is NULL while it is read (beta or lam non-zero)");
  return LC_OK;
}

// lc_sparse_gather.
inline int sparse_gather(const char* op, const void* x, const int64_t* idx, int64_t k, const void* out) {
  if (k < 0) return negative(op, "k", k);
  if (k > 0 && (!x || !idx || !out)) return fail(LC_EARG, op, "%s is NULL", !x ? "x" : !idx ? "idx" : "out");
  return LC_OK;
}

// lc_sparse_scatter_merge.
inline int sparse_scatter_merge(const char* op, const void* x, const int64_t* idx, int64_t k, const void* avg,
                                const void* sent) {
  if (k < 0) return negative(op, "k", k);
  if (k > 0 && (!x || !idx || !avg || !sent))
    return fail(LC_EARG, op, "%s is NULL", !x ? "x" : !idx ? "idx" : !avg ? "avg" : "sent");
  return LC_OK;
}

// A quantized format's code (LC_Q_*, into f) and block (a power of two >= 2).
inline int fmt_block(const char* op, int fmt, int64_t block, QFmt& f) {
  if (!qfmt_of(fmt, f)) return fail(LC_EARG, op, "fmt = %d is not a format code (LC_Q_*)", fmt);
  if (block < 2 || (block & (block - 1)) != 0)
    return fail(LC_EARG, op, "block = %lld is not a power of two >= 2", static_cast<long long>(block));
  return LC_OK;
}

// lc_pack_quantized: fmt / block, n, g / codes / scales when there is data; residual and snapshot
// only with x (a pack; without x it quantizes g).
inline int pack_quantized(const char* op, int fmt, int64_t block, QFmt& f, const void* g, const void* x,
                          const void* residual, const void* snapshot, int64_t n, const void* codes,
                          const void* scales) {
  if (int rc = fmt_block(op, fmt, block, f)) return rc;
  if (n < 0) return negative(op, "n", n);
  if (n > 0 && (!g || !codes || !scales))
    return fail(LC_EARG, op, "%s is NULL", !g ? "g" : !codes ? "codes" : "scales");
  if (!x && (residual || snapshot)) return fail(LC_EARG, op, "residual / snapshot given without x");
  return LC_OK;
}

// lc_dequantize.
inline int dequantize(const char* op, int fmt, int64_t block, QFmt& f, const void* codes, const void* scales,
                      int64_t n, const void* out) {
  if (int rc = fmt_block(op, fmt, block, f)) return rc;
  if (n < 0) return negative(op, "n", n);
  if (n > 0 && (!codes || !scales || !out))
    return fail(LC_EARG, op, "%s is NULL", !codes ? "codes" : !scales ? "scales" : "out");
  return LC_OK;
}

// lc_reduce_quantized: m >= 1 rows.
inline int reduce_quantized(const char* op, int fmt, int64_t block, QFmt& f, const void* codes,
                            const void* scales, int64_t m, int64_t n, const void* out_codes,
                            const void* out_scales) {
  if (int rc = fmt_block(op, fmt, block, f)) return rc;
  if (n < 0 || m < 1)
    return fail(LC_EARG, op, "%s = %lld is out of range", n < 0 ? "n" : "m", static_cast<long long>(n < 0 ? n : m));
  if (n > 0 && (!codes || !scales || !out_codes || !out_scales)) return fail(LC_EARG, op, "a buffer is NULL");
  return LC_OK;
}

// lc_outer_merge_quantized: fmt / block, then the dense merge's checks with (codes, scales) as
// delta_avg.
inline int merge_quantized(const char* op, int fmt, int64_t block, QFmt& f, const void* g, const void* u,
                           const void* codes, const void* scales, const void* x, const void* x_sent, int64_t n,
                           double momentum, bool needs_sent) {
  if (int rc = fmt_block(op, fmt, block, f)) return rc;
  if (n < 0) return negative(op, "n", n);
  if (n == 0) return LC_OK;
  if (!codes || !scales) return fail(LC_EARG, op, "%s is NULL", !codes ? "codes" : "scales");
  if (!g) return fail(LC_EARG, op, "g is NULL");
  if (!x) return fail(LC_EARG, op, "x is NULL");
  if (!u && momentum != 0.0) return fail(LC_EARG, op, "u is NULL while momentum = %g is non-zero", momentum);
  if (!x_sent && needs_sent) return fail(LC_EARG, op, "x_sent is NULL while it is read (beta or lam non-zero)");
  return LC_OK;
}

// lc_sparse_scatter_merge_quantized: fmt / block, then the dense scatter-merge's checks with
// (codes, scales) as avg.
inline int sparse_scatter_merge_quantized(const char* op, int fmt, int64_t block, QFmt& f, const void* x,
                                          const int64_t* idx, int64_t k, const void* codes, const void* scales,
                                          const void* sent) {
  if (int rc = fmt_block(op, fmt, block, f)) return rc;
  if (k < 0) return negative(op, "k", k);
  if (k > 0 && (!x || !idx || !codes || !scales || !sent))
    return fail(LC_EARG, op, "%s is NULL", !x ? "x" : !idx ? "idx" : !codes ? "codes" : !scales ? "scales" : "sent");
  return LC_OK;
}

// lc_fragment_norms: nseg, ord, offsets / out; the offsets' values are read on the host by the CPU
// library only (the CUDA one cannot read device memory here).
inline int fragment_norms(const char* op, const int64_t* offsets, int64_t nseg, int ord, const void* out) {
  if (nseg < 0) return negative(op, "nseg", nseg);
  if (ord != 1 && ord != 2) return fail(LC_EARG, op, "ord = %d is not 1 or 2", ord);
  if (nseg > 0 && (!offsets || !out)) return fail(LC_EARG, op, "%s is NULL", !offsets ? "offsets" : "out");
  return LC_OK;
}

}  // namespace args
}  // namespace lowcomm

#endif  // LOWCOMM_ARGS_H_

// lc_cuda_fragment_norms: one norm per segment, in one launch, bit-identical from call to call.
//
// Determinism without scratch memory: one block of kNormThreads threads per segment. Thread t sums
// elements start + t, start + t + kNormThreads, ... in that order (float64), then the block adds the
// thread partials in a fixed tree (block_sum). Nothing depends on scheduling, so the bits repeat.
// The price: a segment is read by one SM. With K >= #SMs segments the whole device streams; with a
// few huge segments bandwidth is limited to K SMs' worth (acceptable: fragment_norms runs once per
// sync on K fragment-sized buffers, off the critical path). The alternative (per-chunk partials +
// a fixed-order second pass) needs a scratch buffer the ABI does not provide.
#include "cuda_common.cuh"

namespace lowcomm {
namespace cuda {
namespace {

constexpr int kNormThreads = 1024;

template <class T>
__global__ void __launch_bounds__(kNormThreads) norms_kernel(const T* __restrict__ buf, const int64_t* __restrict__ offsets,
                                                             int ord, double* __restrict__ out) {
  const int64_t s = blockIdx.x;
  const int64_t start = offsets[s], end = offsets[s + 1];
  double acc = 0;
  if (ord == 1) {
    for (int64_t i = start + threadIdx.x; i < end; i += kNormThreads) acc += fabs(static_cast<double>(buf[i]));
  } else {
    for (int64_t i = start + threadIdx.x; i < end; i += kNormThreads) {
      const double v = static_cast<double>(buf[i]);
      acc += v * v;
    }
  }
  acc = block_sum<double>(acc);
  if (threadIdx.x == 0) out[s] = ord == 2 ? sqrt(acc) : acc;
}

}  // namespace
}  // namespace cuda
}  // namespace lowcomm

using namespace lowcomm;
using namespace lowcomm::cuda;

LOWCOMM_EXPORT int lc_cuda_fragment_norms(int dtype, const void* buf, const int64_t* offsets, int64_t nseg, int ord,
                                          double* out, void* stream) {
  static const char* const op = "lc_cuda_fragment_norms";
  if (nseg < 0) return fail(LC_EARG, op, "nseg = %lld is negative", static_cast<long long>(nseg));
  if (nseg > 0x7FFFFFFF) return fail(LC_EARG, op, "nseg = %lld exceeds 2^31 - 1", static_cast<long long>(nseg));
  if (ord != 1 && ord != 2) return fail(LC_EARG, op, "ord = %d is not 1 or 2", ord);
  if (nseg > 0 && (!offsets || !out)) return fail(LC_EARG, op, "%s is NULL", !offsets ? "offsets" : "out");
  DeviceGuard guard(out);
  return dispatch_data(op, dtype, [&](auto t) {
    using T = decltype(t);
    if (nseg == 0) return LC_OK;
    norms_kernel<T><<<static_cast<unsigned>(nseg), kNormThreads, 0, as_stream(stream)>>>(
        static_cast<const T*>(buf), offsets, ord, out);
    return launch_status(op);
  });
}

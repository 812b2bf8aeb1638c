// lc_cuda_sparse_gather / lc_cuda_sparse_scatter_merge: grid-stride over the k selected coordinates.
// Accesses to x are scattered by nature; idx, avg, sent and out are read/written coalesced, one
// element per thread (no vector path: the scattered x accesses dominate, and a 16-byte load of
// idx would buy nothing for them).
#include "cuda_common.cuh"

namespace lowcomm {
namespace cuda {
namespace {

template <class T>
__global__ void gather_kernel(const T* __restrict__ x, const int64_t* __restrict__ idx, int64_t k, T* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < k; j += stride)
    out[j] = x[idx[j]];
}

// x stored as X, computed in its compute dtype T (Master<X>), the dtype of sent.
template <class T, class X, class A>
__global__ void scatter_merge_kernel(X* __restrict__ x, const int64_t* __restrict__ idx, int64_t k,
                                     const A* __restrict__ avg, const T* __restrict__ sent, T beta) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < k; j += stride) {
    const int64_t i = idx[j];
    x[i] = cast<X>(scatter_merge<T>(cast<T>(x[i]), cast<T>(avg[j]), sent[j], beta));
  }
}

}  // namespace
}  // namespace cuda
}  // namespace lowcomm

using namespace lowcomm;
using namespace lowcomm::cuda;

LOWCOMM_EXPORT int lc_cuda_sparse_gather(int dtype, const void* x, const int64_t* idx, int64_t k, void* out,
                                         void* stream) {
  static const char* const op = "lc_cuda_sparse_gather";
  if (int rc = args::sparse_gather(op, x, idx, k, out)) return rc;
  DeviceGuard guard(out);
  return dispatch_data(op, dtype, [&](auto t) {
    using T = decltype(t);
    if (k == 0) return LC_OK;
    gather_kernel<T><<<grid_for(k), kThreads, 0, as_stream(stream)>>>(static_cast<const T*>(x), idx, k,
                                                                       static_cast<T*>(out));
    return launch_status(op);
  });
}

LOWCOMM_EXPORT int lc_cuda_sparse_scatter_merge(int dtype, int avg_dtype, void* x, const int64_t* idx, int64_t k,
                                                const void* avg, const void* sent, double beta, void* stream) {
  static const char* const op = "lc_cuda_sparse_scatter_merge";
  if (int rc = args::sparse_scatter_merge(op, x, idx, k, avg, sent)) return rc;
  DeviceGuard guard(x);
  return dispatch_data_storage(op, dtype, "avg_dtype", avg_dtype, [&](auto xt, auto a) {
    using X = decltype(xt);
    using T = typename Master<X>::type;
    using A = decltype(a);
    if (k == 0) return LC_OK;
    scatter_merge_kernel<T, X, A><<<grid_for(k), kThreads, 0, as_stream(stream)>>>(
        static_cast<X*>(x), idx, k, static_cast<const A*>(avg), static_cast<const T*>(sent), static_cast<T>(beta));
    return launch_status(op);
  });
}

// lc_cuda_pack: delta = g - x in the wire dtype, snapshot = x, non-finite count; one pass.
// x is the parameters' dtype X; g, the snapshot and the arithmetic are X's compute dtype T.
// Vector path (16-byte loads of g and x) after a scalar head when every pointer shares one
// misalignment (AlignedHead), scalar otherwise; the count is reduced per block and added with one
// integer atomicAdd per block (exact, so the count does not depend on the order).
#include "cuda_common.cuh"

namespace lowcomm {
namespace cuda {
namespace {

template <class T, class X, class W>
__device__ __forceinline__ unsigned long long pack_one(const T* __restrict__ g, const X* __restrict__ x,
                                                       W* __restrict__ delta, T* __restrict__ snap, int64_t i) {
  const T xi = cast<T>(x[i]);
  const W d = pack_delta<T, W>(g[i], xi);
  delta[i] = d;
  if (snap) snap[i] = xi;
  return is_finite(d) ? 0 : 1;
}

// Elements [0, head) and the tail scalar, the body between them in aligned V-vectors (V = 1: all
// scalar, head = 0).
template <class T, class X, class W, int V>
__global__ void pack_kernel(const T* __restrict__ g, const X* __restrict__ x, W* __restrict__ delta,
                            T* __restrict__ snap, int64_t n, int64_t head, unsigned long long* nonfinite) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned long long bad = 0;
  for (int64_t i = tid; i < head; i += stride) bad += pack_one<T, X, W>(g, x, delta, snap, i);
  const T* gb = g + head;
  const X* xb = x + head;
  W* db = delta + head;
  T* sb = offset(snap, head);
  const int64_t nv = (n - head) / V;
  for (int64_t j = tid; j < nv; j += stride) {
    const Vec<T, V> gv = load_vec<T, V>(gb, j);
    const Vec<X, V> xs = load_vec<X, V>(xb, j);
    Vec<T, V> xv;
    Vec<W, V> dv;
#pragma unroll
    for (int l = 0; l < V; ++l) {
      xv.v[l] = cast<T>(xs.v[l]);
      dv.v[l] = pack_delta<T, W>(gv.v[l], xv.v[l]);
      bad += is_finite(dv.v[l]) ? 0 : 1;
    }
    store_vec<W, V>(db, j, dv);
    if (sb) store_vec<T, V>(sb, j, xv);
  }
  for (int64_t i = head + nv * V + tid; i < n; i += stride) bad += pack_one<T, X, W>(g, x, delta, snap, i);
  bad = block_sum<unsigned long long>(bad);
  if (threadIdx.x == 0 && bad) atomicAdd(nonfinite, bad);
}

template <class T, class X, class W>
int launch(const char* op, const T* g, const X* x, W* delta, T* snap, int64_t n, int64_t* nonfinite,
           cudaStream_t s) {
  const cudaError_t e = cudaMemsetAsync(nonfinite, 0, sizeof(int64_t), s);
  if (e != cudaSuccess) return cuda_fail(op, "cudaMemsetAsync(nonfinite)", e);
  if (n == 0) return LC_OK;
  auto* nf = reinterpret_cast<unsigned long long*>(nonfinite);
  constexpr int V = 16 / sizeof(T);
  const int64_t head = AlignedHead<V>()(g)(x)(snap)(delta).head();
  if (head >= 0 && head < n)
    pack_kernel<T, X, W, V><<<grid_for(n / V + 1), kThreads, 0, s>>>(g, x, delta, snap, n, head, nf);
  else
    pack_kernel<T, X, W, 1><<<grid_for(n), kThreads, 0, s>>>(g, x, delta, snap, n, 0, nf);
  return launch_status(op);
}

}  // namespace
}  // namespace cuda
}  // namespace lowcomm

using namespace lowcomm;
using namespace lowcomm::cuda;

LOWCOMM_EXPORT int lc_cuda_pack(int dtype, int wire_dtype, const void* g, const void* x, void* delta,
                                void* snapshot, int64_t n, int64_t* nonfinite, void* stream) {
  static const char* const op = "lc_cuda_pack";
  if (int rc = args::pack(op, g, x, delta, n, nonfinite)) return rc;
  DeviceGuard guard(nonfinite);
  return dispatch_data_storage(op, dtype, "wire_dtype", wire_dtype, [&](auto xt, auto w) {
    using X = decltype(xt);
    using T = typename Master<X>::type;
    using W = decltype(w);
    return launch<T, X, W>(op, static_cast<const T*>(g), static_cast<const X*>(x), static_cast<W*>(delta),
                        static_cast<T*>(snapshot), n, nonfinite, as_stream(stream));
  });
}

LOWCOMM_EXPORT int lc_cuda_copy_nt(void* dst, const void* src, int64_t nbytes, void* stream) {
  // On a GPU the copy engine / cudaMemcpy kernel is the roofline row already.
  static const char* const op = "lc_cuda_copy_nt";
  if (nbytes < 0) return fail(LC_EARG, op, "nbytes = %lld is negative", static_cast<long long>(nbytes));
  if (nbytes == 0) return LC_OK;
  if (!dst || !src) return fail(LC_EARG, op, "%s is NULL", !dst ? "dst" : "src");
  DeviceGuard guard(dst);
  const cudaError_t e =
      cudaMemcpyAsync(dst, src, static_cast<size_t>(nbytes), cudaMemcpyDeviceToDevice, as_stream(stream));
  return e == cudaSuccess ? LC_OK : cuda_fail(op, "cudaMemcpyAsync", e);
}

LOWCOMM_EXPORT const char* lc_cuda_version(void) { return "lowcomm_cuda 0.1.0"; }

LOWCOMM_EXPORT const char* lc_cuda_last_error(void) { return lowcomm::last_error_buffer(); }

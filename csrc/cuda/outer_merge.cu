// lc_cuda_outer_merge (fused SGD/Nesterov outer step + delay-compensated merge, in place, one
// pass) and lc_cuda_taylor_norms (the read-only reduction behind lam_mode="normalized").
// The momentum / nesterov / merge-kind switches are uniform across the grid, so they stay runtime
// branches (no divergence) instead of multiplying the template instantiations. With lam_sums the
// merge kernel forms lambda_eff from the two sums on the device (kernels.h lam_effective): every
// thread reads the same two doubles, so the normalized mode needs no host read. x is stored as X
// (the parameters' dtype); g, u, x_sent and the arithmetic are X's compute dtype T (Master<X>), and
// the vector path moves V = 16 / sizeof(T) elements of every operand (8 bytes of a bf16 / fp16 x).
#include "cuda_common.cuh"

namespace lowcomm {
namespace cuda {
namespace {

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

template <class T, class X, class A>
__device__ __forceinline__ void merge_one(T* __restrict__ g, T* __restrict__ u, const A* __restrict__ d,
                                          X* __restrict__ x, const T* __restrict__ xs, int64_t i,
                                          const MergeCoef<T>& c) {
  T ui = c.momentum ? u[i] : T(0);
  const T gn = step_elem<T>(g[i], ui, cast<T>(d[i]), c);
  g[i] = gn;
  if (c.momentum) u[i] = ui;
  x[i] = cast<X>(merge_elem<T>(gn, cast<T>(x[i]), c.full ? xs[i] : T(0), c));
}

// Elements [0, head) and the tail scalar, the body between them in aligned V-vectors (V = 1: all
// scalar, head = 0). lam_sums (device, may be NULL): the normalized lambda's two sums.
template <class T, class X, class A, int V>
__global__ void merge_kernel(T* __restrict__ g, T* __restrict__ u, const A* __restrict__ d, X* __restrict__ x,
                             const T* __restrict__ xs, int64_t n, int64_t head, MergeCoef<T> c,
                             const double* __restrict__ lam_sums, double lam) {
  if (lam_sums != nullptr) c = with_lam(c, lam_effective(lam, lam_sums[0], lam_sums[1]));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = tid; i < head; i += stride) merge_one<T, X, A>(g, u, d, x, xs, i, c);
  T* gb = g + head;
  T* ub = offset(u, head);
  const A* db = d + head;
  X* xb = x + head;
  const T* sb = offset(xs, head);
  const int64_t nv = (n - head) / V;
  for (int64_t j = tid; j < nv; j += stride) {
    Vec<T, V> gv = load_vec<T, V>(gb, j), uv, sv;
    Vec<X, V> xv = load_vec<X, V>(xb, j);
    const Vec<A, V> dv = load_vec<A, V>(db, j);
    if (c.momentum) uv = load_vec<T, V>(ub, j);
    if (c.full) sv = load_vec<T, V>(sb, j);
#pragma unroll
    for (int l = 0; l < V; ++l) {
      T ul = c.momentum ? uv.v[l] : T(0);
      gv.v[l] = step_elem<T>(gv.v[l], ul, cast<T>(dv.v[l]), c);
      uv.v[l] = ul;
      xv.v[l] = cast<X>(merge_elem<T>(gv.v[l], cast<T>(xv.v[l]), c.full ? sv.v[l] : T(0), c));
    }
    store_vec<T, V>(gb, j, gv);
    if (c.momentum) store_vec<T, V>(ub, j, uv);
    store_vec<X, V>(xb, j, xv);
  }
  for (int64_t i = head + nv * V + tid; i < n; i += stride) merge_one<T, X, A>(g, u, d, x, xs, i, c);
}

// taylor_norms in a fixed order, in two passes (no float atomics):
//   pass 1: the n elements are cut into chunks of kTaylorChunk from element 0; chunk q belongs to
//     slot q % P, P = min(kTaylorSlots, #chunks) (a function of n alone). One block computes one
//     slot: thread t adds, chunk by chunk in increasing q, the elements at t, t + kThreads, ...
//     of the chunk into its two float64 accumulators; then block_sum (a fixed shuffle tree) gives
//     the slot's two partials, written to scratch[2p], scratch[2p + 1]. Blocks take slots in a
//     grid-stride loop, but a slot is always summed whole by one block in this order, so neither
//     the grid size nor the scheduling changes a bit.
//   pass 2: one warp; lane l adds the partials of slots l, l + 32, ... in order, then a fixed
//     shuffle tree; out2 = the two sums.
// Bit-identical from call to call and on any device; not the CPU kernel's order.
constexpr int kTaylorChunk = kThreads * 8;
constexpr int64_t kTaylorSlots = 1024;

template <class T, class X, class A>
__device__ __forceinline__ void taylor_one(const T* __restrict__ g, const T* __restrict__ u,
                                           const A* __restrict__ d, const X* __restrict__ x,
                                           const T* __restrict__ xs, int64_t i, const MergeCoef<T>& c, double& sv,
                                           double& sc) {
  T ui = c.momentum ? u[i] : T(0);
  const T gn = step_elem<T>(g[i], ui, cast<T>(d[i]), c);
  double v2, c2;
  taylor_terms<T>(gn, cast<T>(x[i]), xs[i], v2, c2);
  sv += v2;
  sc += c2;
}

template <class T, class X, class A>
__global__ void __launch_bounds__(kThreads)
    taylor_partial_kernel(const T* __restrict__ g, const T* __restrict__ u, const A* __restrict__ d,
                          const X* __restrict__ x, const T* __restrict__ xs, int64_t n, int64_t slots,
                          const MergeCoef<T> c, double* __restrict__ partial) {
  for (int64_t p = blockIdx.x; p < slots; p += gridDim.x) {
    double sv = 0, sc = 0;
    for (int64_t c0 = p * kTaylorChunk; c0 < n; c0 += slots * kTaylorChunk) {
      if (c0 + kTaylorChunk <= n) {
#pragma unroll
        for (int k = 0; k < kTaylorChunk / kThreads; ++k)
          taylor_one<T, X, A>(g, u, d, x, xs, c0 + k * kThreads + threadIdx.x, c, sv, sc);
      } else {
        for (int64_t i = c0 + threadIdx.x; i < n; i += kThreads) taylor_one<T, X, A>(g, u, d, x, xs, i, c, sv, sc);
      }
    }
    sv = block_sum<double>(sv);
    sc = block_sum<double>(sc);
    if (threadIdx.x == 0) {
      partial[2 * p] = sv;
      partial[2 * p + 1] = sc;
    }
  }
}

__global__ void taylor_finish_kernel(const double* __restrict__ partial, int64_t slots, double* __restrict__ out2) {
  double sv = 0, sc = 0;
  for (int64_t p = threadIdx.x; p < slots; p += 32) {
    sv += partial[2 * p];
    sc += partial[2 * p + 1];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    sv += __shfl_down_sync(0xffffffffu, sv, o);
    sc += __shfl_down_sync(0xffffffffu, sc, o);
  }
  if (threadIdx.x == 0) {
    out2[0] = sv;
    out2[1] = sc;
  }
}

}  // namespace
}  // namespace cuda
}  // namespace lowcomm

using namespace lowcomm;
using namespace lowcomm::cuda;

LOWCOMM_EXPORT int lc_cuda_outer_merge(int dtype, int avg_dtype, void* g, void* u, const void* delta_avg, void* x,
                                       const void* x_sent, int64_t n, double lr, double momentum, int nesterov,
                                       double alpha, double beta, double lam, const double* lam_sums,
                                       void* stream) {
  static const char* const op = "lc_cuda_outer_merge";
  if (int rc = args::merge(op, g, u, delta_avg, x, x_sent, n, momentum, beta != 0.0 || lam != 0.0)) return rc;
  if (n == 0) return LC_OK;
  DeviceGuard guard(g);
  return dispatch_data_storage(op, dtype, "avg_dtype", avg_dtype, [&](auto xt, auto a) {
    using X = decltype(xt);
    using T = typename Master<X>::type;
    using A = decltype(a);
    // With lam_sums the kernel replaces lam (and the merge kind) by the normalized lambda.
    const MergeCoef<T> c = make_merge_coef<T>(lr, momentum, nesterov, alpha, beta, lam);
    T* gp = static_cast<T*>(g);
    T* up = c.momentum ? static_cast<T*>(u) : nullptr;
    const A* dp = static_cast<const A*>(delta_avg);
    X* xp = static_cast<X*>(x);
    const T* sp = (beta != 0.0 || lam != 0.0) ? static_cast<const T*>(x_sent) : nullptr;
    constexpr int V = 16 / sizeof(T);
    const int64_t head = AlignedHead<V>()(gp)(up)(dp)(xp)(sp).head();
    cudaStream_t s = as_stream(stream);
    if (head >= 0 && head < n)
      merge_kernel<T, X, A, V><<<grid_for(n / V + 1), kThreads, 0, s>>>(gp, up, dp, xp, sp, n, head, c, lam_sums, lam);
    else
      merge_kernel<T, X, A, 1><<<grid_for(n), kThreads, 0, s>>>(gp, up, dp, xp, sp, n, 0, c, lam_sums, lam);
    return launch_status(op);
  });
}

LOWCOMM_EXPORT int lc_cuda_taylor_norms(int dtype, int avg_dtype, const void* g, const void* u,
                                        const void* delta_avg, const void* x, const void* x_sent, int64_t n,
                                        double lr, double momentum, int nesterov, double* out2, void* stream) {
  static const char* const op = "lc_cuda_taylor_norms";
  if (!out2) return fail(LC_EARG, op, "out2 is NULL");
  if (int rc = args::merge(op, g, u, delta_avg, x, x_sent, n, momentum, true)) return rc;
  DeviceGuard guard(out2);
  return dispatch_data_storage(op, dtype, "avg_dtype", avg_dtype, [&](auto xt, auto a) {
    using X = decltype(xt);
    using T = typename Master<X>::type;
    using A = decltype(a);
    cudaStream_t s = as_stream(stream);
    if (n == 0) {
      const cudaError_t e = cudaMemsetAsync(out2, 0, 2 * sizeof(double), s);
      return e == cudaSuccess ? LC_OK : cuda_fail(op, "cudaMemsetAsync(out2)", e);
    }
    const MergeCoef<T> c = make_merge_coef<T>(lr, momentum, nesterov, 0.0, 0.0, 0.0);
    const int64_t chunks = (n + kTaylorChunk - 1) / kTaylorChunk;
    const int64_t slots = chunks < kTaylorSlots ? chunks : kTaylorSlots;
    Scratch partial(op, static_cast<size_t>(2 * slots) * sizeof(double), s);
    if (partial.status() != LC_OK) return partial.status();
    taylor_partial_kernel<T, X, A><<<grid_for(slots * kThreads), kThreads, 0, s>>>(
        static_cast<const T*>(g), c.momentum ? static_cast<const T*>(u) : nullptr,
        static_cast<const A*>(delta_avg), static_cast<const X*>(x), static_cast<const T*>(x_sent), n, slots, c,
        partial.get<double>());
    if (int rc = launch_status(op)) return rc;
    taylor_finish_kernel<<<1, 32, 0, s>>>(partial.get<double>(), slots, out2);
    return launch_status(op);
  });
}

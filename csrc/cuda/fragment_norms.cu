// lc_cuda_fragment_norms: one norm per segment, in two launches, bit-identical from call to call
// and independent of the grid (so of the device's SM count), with many blocks per segment.
//
// The fixed order (P = slots per segment, a function of nseg alone: the largest power of two with
// P <= kMaxSlots and nseg * P <= kSlotBudget; 1024 for the one-segment calls of CoCoDC):
//   pass 1: segment s is cut into chunks of kChunk elements from offsets[s]; chunk q belongs to
//     slot q % P. One block of kThreads threads computes one (segment, slot) item: thread t adds,
//     chunk by chunk in increasing q, the terms of the elements at t, t + kThreads, ... of the
//     chunk into one float64 accumulator; block_sum (a fixed shuffle tree) then gives the item's
//     partial, written to scratch[s * P + slot] (a slot without chunks writes 0). Blocks take
//     items in a grid-stride loop, but an item is always summed whole, in this order, by one
//     block, so neither the grid size nor the scheduling changes a bit.
//   pass 2: one warp per segment; lane l adds the partials of slots l, l + 32, ... in order, then
//     a fixed shuffle tree; out[s] = the sum (ord 1) or its square root (ord 2).
// Loads are scalar and coalesced (a warp reads 32 consecutive elements per step, 16 independent
// steps per thread per chunk in flight), so the order does not depend on the buffer's alignment.
// The order depends on nseg through P (the same segment can round differently in a call with
// more segments), never on anything else; it is not the CPU kernel's order.
#include "cuda_common.cuh"

namespace lowcomm {
namespace cuda {
namespace {

constexpr int kChunk = kThreads * 16;
constexpr int64_t kMaxSlots = 1024;
constexpr int64_t kSlotBudget = 8192;

inline int64_t slots_per_segment(int64_t nseg) {
  int64_t p = 1;
  while (p * 2 <= kMaxSlots && nseg * p * 2 <= kSlotBudget) p *= 2;
  return p;
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    norms_partial_kernel(const T* __restrict__ buf, const int64_t* __restrict__ offsets, int64_t nseg, int64_t slots,
                         int ord, double* __restrict__ partial) {
  const int64_t items = nseg * slots;
  for (int64_t it = blockIdx.x; it < items; it += gridDim.x) {
    const int64_t s = it / slots, p = it % slots;
    const int64_t start = offsets[s], len = offsets[s + 1] - start;
    const T* seg = buf + start;
    double acc = 0;
    for (int64_t c0 = p * kChunk; c0 < len; c0 += slots * kChunk) {
      if (c0 + kChunk <= len) {
#pragma unroll
        for (int k = 0; k < kChunk / kThreads; ++k) acc += norm_term(seg[c0 + k * kThreads + threadIdx.x], ord);
      } else {
        for (int64_t i = c0 + threadIdx.x; i < len; i += kThreads) acc += norm_term(seg[i], ord);
      }
    }
    acc = block_sum<double>(acc);
    if (threadIdx.x == 0) partial[it] = acc;
  }
}

constexpr int kFinishWarps = kThreads / 32;

__global__ void __launch_bounds__(kThreads)
    norms_finish_kernel(const double* __restrict__ partial, int64_t nseg, int64_t slots, int ord,
                        double* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kFinishWarps;
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * kFinishWarps + (threadIdx.x >> 5); s < nseg; s += warps) {
    double acc = 0;
    for (int64_t p = lane; p < slots; p += 32) acc += partial[s * slots + p];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if (lane == 0) out[s] = ord == 2 ? sqrt(acc) : acc;
  }
}

}  // namespace
}  // namespace cuda
}  // namespace lowcomm

using namespace lowcomm;
using namespace lowcomm::cuda;

LOWCOMM_EXPORT int lc_cuda_fragment_norms(int dtype, const void* buf, const int64_t* offsets, int64_t nseg, int ord,
                                          double* out, void* stream) {
  static const char* const op = "lc_cuda_fragment_norms";
  if (int rc = args::fragment_norms(op, offsets, nseg, ord, out)) return rc;
  DeviceGuard guard(out);
  return dispatch_data(op, dtype, [&](auto t) {
    using T = decltype(t);
    if (nseg == 0) return LC_OK;
    cudaStream_t s = as_stream(stream);
    const int64_t slots = slots_per_segment(nseg);
    Scratch partial(op, static_cast<size_t>(nseg * slots) * sizeof(double), s);
    if (partial.status() != LC_OK) return partial.status();
    norms_partial_kernel<T><<<grid_for(nseg * slots * kThreads), kThreads, 0, s>>>(
        static_cast<const T*>(buf), offsets, nseg, slots, ord, partial.get<double>());
    if (int rc = launch_status(op)) return rc;
    norms_finish_kernel<<<grid_for(nseg * 32), kThreads, 0, s>>>(partial.get<double>(), nseg, slots, ord, out);
    return launch_status(op);
  });
}

// lc_cuda_mask_perm: one thread per index i < k computes pi(i) (lowcomm/kernels.h, bit-identical to
// the CPU and the ref: pure uint64 integer arithmetic).
#include "cuda_common.cuh"

namespace lowcomm {
namespace cuda {
namespace {

__global__ void mask_kernel(uint64_t n, int64_t k, const int64_t* __restrict__ adds,
                            const int64_t* __restrict__ muls, int shift, uint64_t bitmask, int64_t* __restrict__ out) {
  MaskKeys keys;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    keys.add[r] = static_cast<uint64_t>(adds[r]);
    keys.mul[r] = static_cast<uint64_t>(muls[r]);
  }
  keys.bitmask = bitmask;
  keys.shift = shift;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < k; i += stride)
    out[i] = static_cast<int64_t>(mask_index(static_cast<uint64_t>(i), n, keys));
}

}  // namespace
}  // namespace cuda
}  // namespace lowcomm

using namespace lowcomm;
using namespace lowcomm::cuda;

LOWCOMM_EXPORT int lc_cuda_mask_perm(int64_t n, int64_t k, const int64_t* adds, const int64_t* muls, int shift,
                                     int64_t bitmask, int64_t* out, void* stream) {
  static const char* const op = "lc_cuda_mask_perm";
  if (int rc = check_mask_args(op, n, k, adds, muls, shift, bitmask, out)) return rc;
  if (k == 0) return LC_OK;
  DeviceGuard guard(out);
  mask_kernel<<<grid_for(k), kThreads, 0, as_stream(stream)>>>(static_cast<uint64_t>(n), k, adds, muls, shift,
                                                                static_cast<uint64_t>(bitmask), out);
  return launch_status(op);
}

// lc_mask_perm: the first k images of LOSCAR's keyed bijection of [0, n), each computed
// independently (no RNG state), bit-identical to ops/mask_indices.py's mask_perm_ref.
#include "cpu_common.h"

using namespace lowcomm;
using namespace lowcomm::cpu;

LOWCOMM_EXPORT int lc_mask_perm(int64_t n, int64_t k, const int64_t* adds, const int64_t* muls, int shift,
                                int64_t bitmask, int64_t* out) {
  if (int rc = check_mask_args("lc_mask_perm", n, k, adds, muls, shift, bitmask, out)) return rc;
  MaskKeys keys;
  for (int r = 0; r < 4; ++r) {
    keys.add[r] = static_cast<uint64_t>(adds[r]);
    keys.mul[r] = static_cast<uint64_t>(muls[r]);
  }
  keys.bitmask = static_cast<uint64_t>(bitmask);
  keys.shift = shift;
  const uint64_t un = static_cast<uint64_t>(n);
  // Walk lengths vary (geometric, mean < 2), so a dynamic schedule in coarse chunks balances them.
#pragma omp parallel for schedule(dynamic, 16384) if (k >= kParallelMin / 4)
  for (int64_t i = 0; i < k; ++i) out[i] = static_cast<int64_t>(mask_index(static_cast<uint64_t>(i), un, keys));
  return LC_OK;
}

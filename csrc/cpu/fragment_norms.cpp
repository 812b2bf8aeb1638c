// lc_fragment_norms: ||buf[offsets[s]:offsets[s+1]]||_1 or _2 for every segment in one parallel
// pass. Determinism: each segment is cut into fixed blocks of kReduceBlock elements (from the
// segment's start); a block's partial is summed in a fixed lane order; a segment's partials are
// added in block order. Blocks of all segments are spread over the threads together, so a few
// large segments and many small ones both keep every core busy, and the bits do not depend on
// the thread count.
#include <math.h>

#include <vector>

#include "cpu_common.h"

namespace lowcomm {
namespace cpu {
namespace {

template <class T>
double block_sum(const T* p, int64_t m, int ord) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  if (ord == 1) {
    for (; i + 8 <= m; i += 8)
      for (int l = 0; l < 8; ++l) acc[l] += fabs(cast<double>(p[i + l]));
    for (int l = 0; i < m; ++i, ++l) acc[l] += fabs(cast<double>(p[i]));
  } else {
    for (; i + 8 <= m; i += 8)
      for (int l = 0; l < 8; ++l) {
        const double v = cast<double>(p[i + l]);
        acc[l] += v * v;
      }
    for (int l = 0; i < m; ++i, ++l) {
      const double v = cast<double>(p[i]);
      acc[l] += v * v;
    }
  }
  double s = 0;
  for (int l = 0; l < 8; ++l) s += acc[l];
  return s;
}

template <class T>
void norms(const T* buf, const int64_t* offsets, int64_t nseg, int ord, double* out) {
  // first_block[s]: index of segment s's first block in the flat list of all blocks.
  std::vector<int64_t> first_block(static_cast<size_t>(nseg) + 1);
  first_block[0] = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t len = offsets[s + 1] - offsets[s];
    first_block[s + 1] = first_block[s] + (len + kReduceBlock - 1) / kReduceBlock;
  }
  const int64_t nb = first_block[nseg];
  std::vector<double> partial(static_cast<size_t>(nb));
#pragma omp parallel if (nb * kReduceBlock >= kParallelMin)
  {
    int64_t b0, b1;
    thread_range(nb, omp_get_thread_num(), omp_get_num_threads(), 1, b0, b1);
    if (b0 < b1) {
      // Find the segment holding block b0, then walk blocks and segments together.
      int64_t s = 0, lo = 0, hi = nseg;
      while (lo < hi) {  // last s with first_block[s] <= b0 (skipping empty segments)
        const int64_t mid = (lo + hi + 1) / 2;
        if (first_block[mid] <= b0) lo = mid; else hi = mid - 1;
      }
      s = lo;
      for (int64_t b = b0; b < b1; ++b) {
        while (first_block[s + 1] <= b) ++s;
        const int64_t start = offsets[s] + (b - first_block[s]) * kReduceBlock;
        const int64_t end = start + kReduceBlock < offsets[s + 1] ? start + kReduceBlock : offsets[s + 1];
        partial[b] = block_sum<T>(buf + start, end - start, ord);
      }
    }
  }
  for (int64_t s = 0; s < nseg; ++s) {
    double acc = 0;
    for (int64_t b = first_block[s]; b < first_block[s + 1]; ++b) acc += partial[b];
    out[s] = ord == 2 ? sqrt(acc) : acc;
  }
}

}  // namespace
}  // namespace cpu
}  // namespace lowcomm

using namespace lowcomm;
using namespace lowcomm::cpu;

LOWCOMM_EXPORT int lc_fragment_norms(int dtype, const void* buf, const int64_t* offsets, int64_t nseg, int ord,
                                     double* out) {
  static const char* const op = "lc_fragment_norms";
  if (int rc = args::fragment_norms(op, offsets, nseg, ord, out)) return rc;
  if (nseg > 0 && offsets[0] < 0)
    return fail(LC_EARG, op, "offsets[0] = %lld is negative", static_cast<long long>(offsets[0]));
  for (int64_t s = 0; s < nseg; ++s)
    if (offsets[s + 1] < offsets[s])
      return fail(LC_EARG, op, "offsets[%lld] = %lld < offsets[%lld] = %lld (offsets must be non-decreasing)",
                  static_cast<long long>(s + 1), static_cast<long long>(offsets[s + 1]),
                  static_cast<long long>(s), static_cast<long long>(offsets[s]));
  if (nseg > 0 && offsets[nseg] > offsets[0] && !buf) return fail(LC_EARG, op, "buf is NULL");
  return dispatch_data(op, dtype, [&](auto t) {
    using T = decltype(t);
    norms<T>(static_cast<const T*>(buf), offsets, nseg, ord, out);
  });
}

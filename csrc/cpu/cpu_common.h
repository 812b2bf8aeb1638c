// CPU-only plumbing shared by csrc/cpu/*.cpp: dtype dispatch, thread partitioning, the
// non-temporal copy, and the fixed-order (thread-count independent) float64 block sum.
#ifndef LOWCOMM_CPU_COMMON_H_
#define LOWCOMM_CPU_COMMON_H_

#include <omp.h>
#include <stddef.h>
#include <stdint.h>

#include "lowcomm/abi.h"
#include "lowcomm/kernels.h"
#include "lowcomm/args.h"
#include "lowcomm/status.h"

namespace lowcomm {
namespace cpu {

// Below this many elements one thread does the work. Measured (pack, fp32, best of 200): 64K
// elements 28 us on one thread vs 24 us on two, 256K 68 vs 45 us, 1M 201 vs 107 us. The small gain
// at 64K is not worth a fork/join, whose cost on a busy VM is a scheduler slice when the second
// thread is descheduled (median 12 ms at 64K with two threads on the shared 2-vCPU machine).
constexpr int64_t kParallelMin = 1 << 18;

// Reductions sum fixed blocks of this many elements; partials are then summed in block order, so
// the result does not depend on how blocks are spread over threads.
constexpr int64_t kReduceBlock = 8192;

// Calls f(X{}) for a data dtype (f32 / f64 / bf16 / f16). Anything else: LC_EBADTYPE, with op's
// message.
template <class F>
int dispatch_data(const char* op, int dtype, F&& f) {
  switch (dtype) {
    case LC_F32: f(float{}); return LC_OK;
    case LC_F64: f(double{}); return LC_OK;
    case LC_BF16: f(bf16{}); return LC_OK;
    case LC_F16: f(f16{}); return LC_OK;
    default: return bad_dtype(op, dtype);
  }
}

// Calls f(X{}, S{}) for a parameter dtype X (f32 / f64 / bf16 / f16) and a storage dtype S that is
// X's compute dtype (Master<X>::type: X itself, or float for bf16 / f16) or bf16 (the wire /
// averaged-delta dtypes the ops accept); `storage_name` names S's argument in the message.
template <class F>
int dispatch_data_storage(const char* op, int dtype, const char* storage_name, int storage, F&& f) {
  if (dtype == LC_F32 && storage == LC_F32) { f(float{}, float{}); return LC_OK; }
  if (dtype == LC_F32 && storage == LC_BF16) { f(float{}, bf16{}); return LC_OK; }
  if (dtype == LC_F64 && storage == LC_F64) { f(double{}, double{}); return LC_OK; }
  if (dtype == LC_F64 && storage == LC_BF16) { f(double{}, bf16{}); return LC_OK; }
  if (dtype == LC_BF16 && storage == LC_F32) { f(bf16{}, float{}); return LC_OK; }
  if (dtype == LC_BF16 && storage == LC_BF16) { f(bf16{}, bf16{}); return LC_OK; }
  if (dtype == LC_F16 && storage == LC_F32) { f(f16{}, float{}); return LC_OK; }
  if (dtype == LC_F16 && storage == LC_BF16) { f(f16{}, bf16{}); return LC_OK; }
  return bad_dtypes(op, dtype, storage_name, storage);
}

// The [lo, hi) share of thread `tid` of `nthreads` over n elements, split on multiples of `grain`
// elements so that only the ends of the whole range are unaligned.
inline void thread_range(int64_t n, int tid, int nthreads, int64_t grain, int64_t& lo, int64_t& hi) {
  const int64_t units = (n + grain - 1) / grain;
  const int64_t per = units / nthreads, extra = units % nthreads;
  const int64_t u0 = tid * per + (tid < extra ? tid : extra);
  const int64_t u1 = u0 + per + (tid < extra ? 1 : 0);
  lo = u0 * grain < n ? u0 * grain : n;
  hi = u1 * grain < n ? u1 * grain : n;
}

// Single-threaded copy with non-temporal (streaming) stores for the 32-byte-aligned body of dst:
// the destination lines are not read for ownership, so a copy moves 2 bytes of traffic per byte
// instead of 3. Ends with no fence; callers issue one (nt_fence) before the data is consumed.
void nt_copy(void* dst, const void* src, size_t nbytes);
void nt_fence();

}  // namespace cpu
}  // namespace lowcomm

#endif  // LOWCOMM_CPU_COMMON_H_

// lc_copy_nt: memcpy with non-temporal stores, the benchmarks' roofline row. torch's copy_ pays a
// read-for-ownership of every destination line and shows ~64-73% of what the memory system moves
// (bench/RESULTS.md, docs/design.md); this copy shows the real limit of a 1-read / 1-write stream.
#include <immintrin.h>
#include <string.h>

#include "cpu_common.h"

namespace lowcomm {
namespace cpu {

void nt_copy(void* dst, const void* src, size_t nbytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const size_t head = (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31;
  if (nbytes < head + 128) {  // too short for a streaming body to pay
    memcpy(d, s, nbytes);
    return;
  }
  memcpy(d, s, head);
  d += head;
  s += head;
  nbytes -= head;
  size_t i = 0;
  for (; i + 128 <= nbytes; i += 128) {  // 4 x 32 B: two cache lines per iteration
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
  for (; i + 32 <= nbytes; i += 32)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
  memcpy(d + i, s + i, nbytes - i);
}

void nt_fence() { _mm_sfence(); }

}  // namespace cpu
}  // namespace lowcomm

using namespace lowcomm;
using namespace lowcomm::cpu;

LOWCOMM_EXPORT int lc_copy_nt(void* dst, const void* src, int64_t nbytes) {
  static const char* const op = "lc_copy_nt";
  if (nbytes < 0) return fail(LC_EARG, op, "nbytes = %lld is negative", static_cast<long long>(nbytes));
  if (nbytes > 0 && (!dst || !src)) return fail(LC_EARG, op, "%s is NULL", !dst ? "dst" : "src");
  if (nbytes < kParallelMin * 4) {
    nt_copy(dst, src, static_cast<size_t>(nbytes));
    nt_fence();
    return LC_OK;
  }
#pragma omp parallel
  {
    int64_t lo, hi;
    thread_range(nbytes, omp_get_thread_num(), omp_get_num_threads(), 4096, lo, hi);
    nt_copy(static_cast<char*>(dst) + lo, static_cast<const char*>(src) + lo, static_cast<size_t>(hi - lo));
    nt_fence();
  }
  return LC_OK;
}

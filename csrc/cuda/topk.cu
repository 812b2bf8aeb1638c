// lc_cuda_topk_encode / lc_cuda_topk_decode_add: the top-k sparse wire format (ops/topk.py is the
// specification) for fp32 data and chunks of at most 4096 values, one thread block per chunk.
//
// Encode: the block updates its chunk of e, keys every entry as (|e| bits << 32 | ~index) in
// shared memory (a larger key is a larger |e| or, at equal |e|, a lower index: every key is
// distinct), bitonic-sorts the keys in descending order, sorts the first k indices ascending, and
// then quantizes, subtracts and packs as the CPU does. The scale is an order-free maximum (2 and 4
// bits) or thread 0's fp64 sum in index order (1 bit), so the bits are the reference's.
// Decode: thread t of a chunk's block adds entry t; an index past its chunk is skipped (the host
// is not read to refuse it: the CPU kernel checks payloads it cannot trust).
#include "cuda_common.cuh"

namespace lowcomm {
namespace cuda {
namespace {

constexpr int kMaxChunk = 4096;
constexpr int kTopkThreads = 512;

__device__ __forceinline__ int64_t nbytes(int64_t count, int width) { return (count * width + 7) / 8; }

struct Layout {
  int64_t n, chunk, nc, kf, kl, ibf, vbf, idx0, val0;
  int bits, ib;
};

Layout make_layout(int64_t n, int64_t k, int64_t chunk, int bits) {
  Layout L;
  L.n = n;
  L.chunk = chunk;
  L.bits = bits;
  int ib = 0;
  while ((int64_t(1) << ib) < chunk) ++ib;
  L.ib = ib;
  L.nc = (n + chunk - 1) / chunk;
  L.kf = k < chunk ? k : chunk;
  const int64_t last = n - (L.nc - 1) * chunk;
  L.kl = L.nc ? (k < last ? k : last) : 0;
  L.ibf = (L.kf * ib + 7) / 8;
  L.vbf = (L.kf * bits + 7) / 8;
  L.idx0 = 4 * L.nc;
  L.val0 = L.nc ? L.idx0 + (L.nc - 1) * L.ibf + (L.kl * ib + 7) / 8 : L.idx0;
  return L;
}

// Bitonic sort of p (a power of two) keys in shared memory, descending (or ascending), by the block.
__device__ void bitonic(uint64_t* keys, int p, bool descending) {
  for (int size = 2; size <= p; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < p; i += blockDim.x) {
        const int j = i ^ stride;
        if (j > i) {
          const bool up = ((i & size) == 0) != descending;  // this pair's direction
          const uint64_t a = keys[i], b = keys[j];
          if ((a > b) == up) {
            keys[i] = b;
            keys[j] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

// One byte of a packed section: bits [8j, 8j + 8) of entries of `width` bits each (LSB first).
template <class V>
__device__ __forceinline__ uint8_t pack_byte(const V* vals, int64_t count, int width, int64_t j) {
  uint32_t byte = 0;
  for (int bit = 0; bit < 8; ++bit) {
    const int64_t p = 8 * j + bit;
    if (p >= count * width) break;
    byte |= ((vals[p / width] >> (p % width)) & 1u) << bit;
  }
  return static_cast<uint8_t>(byte);
}

__device__ __forceinline__ uint32_t read_bits(const uint8_t* base, int64_t pos, int width) {
  uint32_t v = 0;
  for (int b = 0; b < width; ++b) {
    const int64_t p = pos + b;
    v |= uint32_t((base[p >> 3] >> (p & 7)) & 1) << b;
  }
  return v;
}

__global__ void encode_kernel(Layout L, const float* __restrict__ d, float* __restrict__ e, float beta,
                              uint8_t* __restrict__ payload, unsigned long long* __restrict__ nonfinite) {
  __shared__ uint64_t keys[kMaxChunk];  // 32 KiB
  __shared__ uint16_t idx[kMaxChunk];   // indices within the chunk (< 4096)
  __shared__ uint8_t codes[kMaxChunk];
  __shared__ int bad;
  __shared__ float scale;
  const int64_t j = blockIdx.x;
  const int64_t off = j * L.chunk;
  const int64_t len = L.chunk < L.n - off ? L.chunk : L.n - off;
  const int64_t kk = j + 1 < L.nc ? L.kf : L.kl;
  float* ec = e + off;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  int my_bad = 0;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    const float v = ec[i] * beta;  // two roundings, as e.mul_(beta).add_(delta)
    ec[i] = v + d[off + i];
    my_bad += !isfinite(ec[i]);
  }
  if (my_bad) atomicAdd(&bad, my_bad);
  __syncthreads();
  const int lq = (1 << L.bits) - 1;
  const float lqf = static_cast<float>(lq);
  uint8_t* idx_out = payload + L.idx0 + j * L.ibf;
  uint8_t* val_out = payload + L.val0 + j * L.vbf;
  const int64_t ib_bytes = nbytes(kk, L.ib), vb_bytes = nbytes(kk, L.bits);
  if (bad == 0) {
    int p = 1;
    while (p < len) p <<= 1;
    for (int i = threadIdx.x; i < p; i += blockDim.x) {
      uint32_t ab = 0;
      if (i < len) ab = __float_as_uint(ec[i]) & 0x7FFFFFFFu;
      keys[i] = i < len ? (uint64_t(ab) << 32) | uint64_t(0xFFFFFFFFu - uint32_t(i)) : 0;
    }
    __syncthreads();
    bitonic(keys, p, true);
    int q = 1;
    while (q < kk) q <<= 1;
    // the selected indices, ascending: a second sort of q keys (padding sorts last)
    for (int t = threadIdx.x; t < kk; t += blockDim.x) idx[t] = uint16_t(0xFFFFFFFFu - uint32_t(keys[t] & 0xFFFFFFFFu));
    __syncthreads();
    for (int t = threadIdx.x; t < q; t += blockDim.x) keys[t] = t < kk ? uint64_t(idx[t]) : ~uint64_t(0);
    __syncthreads();
    bitonic(keys, q, false);
    for (int t = threadIdx.x; t < kk; t += blockDim.x) idx[t] = uint16_t(keys[t]);
    __syncthreads();
    if (threadIdx.x == 0) {
      float s;
      if (L.bits == 1) {  // mean |value|: fp64 sum in ascending index order
        double sum = 0.0;
        for (int64_t t = 0; t < kk; ++t) sum += static_cast<double>(fabsf(ec[idx[t]]));
        s = static_cast<float>(sum / static_cast<double>(kk));
      } else {
        float mx = 0.0f;
        for (int64_t t = 0; t < kk; ++t) mx = fmaxf(mx, fabsf(ec[idx[t]]));
        s = mx;
      }
      scale = s;
    }
    __syncthreads();
    const float s = scale;  // finite: fp32 values that are finite have a finite max and fp64 mean
    {
      for (int64_t t = threadIdx.x; t < kk; t += blockDim.x) {
        const uint32_t i = idx[t];
        const float w = ec[i];
        const float m = s > 0.0f ? __fdiv_rn(w, s) : 0.0f;
        float qv = rintf(__fmul_rn(__fadd_rn(__fmul_rn(m, lqf), lqf), 0.5f));
        qv = qv < 0.0f ? 0.0f : (qv > lqf ? lqf : qv);
        const int c = static_cast<int>(qv);
        const float sent = __fdiv_rn(__fmul_rn(static_cast<float>(2 * c - lq), s), lqf);
        ec[i] = __fsub_rn(w, sent);
        codes[t] = uint8_t(c);
      }
    }
    __syncthreads();
  } else {  // not encoded: indices 0..kk-1, codes 0, scale NaN, e kept
    if (threadIdx.x == 0) {
      atomicAdd(nonfinite, static_cast<unsigned long long>(bad));
      scale = __int_as_float(0x7FC00000);
    }
    for (int64_t t = threadIdx.x; t < kk; t += blockDim.x) {
      idx[t] = uint16_t(t);
      codes[t] = 0;
    }
    __syncthreads();
  }
  for (int64_t b = threadIdx.x; b < ib_bytes; b += blockDim.x) idx_out[b] = pack_byte(idx, kk, L.ib, b);
  for (int64_t b = threadIdx.x; b < vb_bytes; b += blockDim.x) val_out[b] = pack_byte(codes, kk, L.bits, b);
  if (threadIdx.x == 0) {
    const float s = scale;
    memcpy(payload + 4 * j, &s, 4);
  }
}

template <class T>
__global__ void decode_kernel(Layout L, const uint8_t* __restrict__ payload, T* __restrict__ out) {
  const int64_t j = blockIdx.x;
  const int64_t off = j * L.chunk;
  const int64_t len = L.chunk < L.n - off ? L.chunk : L.n - off;
  const int64_t kk = j + 1 < L.nc ? L.kf : L.kl;
  float s;
  memcpy(&s, payload + 4 * j, 4);
  const int lq = (1 << L.bits) - 1;
  const float lqf = static_cast<float>(lq);
  const uint8_t* ip = payload + L.idx0 + j * L.ibf;
  const uint8_t* vp = payload + L.val0 + j * L.vbf;
  for (int64_t t = threadIdx.x; t < kk; t += blockDim.x) {
    const uint32_t i = read_bits(ip, t * L.ib, L.ib);
    const int c = static_cast<int>(read_bits(vp, t * L.bits, L.bits));
    if (i >= len) continue;  // a corrupt payload: never written outside the chunk
    const float v = __fdiv_rn(__fmul_rn(static_cast<float>(2 * c - lq), s), lqf);
    out[off + i] = out[off + i] + static_cast<T>(v);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace lowcomm

using namespace lowcomm;
using namespace lowcomm::cuda;

namespace {

int check_topk(const char* op, int64_t n, int64_t k, int64_t chunk, int bits) {
  if (n < 0) return fail(LC_EARG, op, "n = %lld is negative", static_cast<long long>(n));
  if (chunk < 2 || chunk > kMaxChunk)
    return fail(LC_EARG, op, "chunk = %lld is outside [2, %d] (the CUDA kernels sort a chunk in shared memory)",
                static_cast<long long>(chunk), kMaxChunk);
  if (k < 1 || k > chunk)
    return fail(LC_EARG, op, "k = %lld is outside [1, chunk = %lld]", static_cast<long long>(k),
                static_cast<long long>(chunk));
  if (bits != 1 && bits != 2 && bits != 4) return fail(LC_EARG, op, "bits = %d is not 1, 2 or 4", bits);
  return LC_OK;
}

}  // namespace

LOWCOMM_EXPORT int lc_cuda_topk_encode(int dtype, const void* delta, void* e, int64_t n, int64_t k, int64_t chunk,
                                       int bits, double beta, void* payload, int64_t* nonfinite, void* stream) {
  static const char* const op = "lc_cuda_topk_encode";
  if (int rc = check_topk(op, n, k, chunk, bits)) return rc;
  if (!(beta >= 0.0 && beta <= 1.0)) return fail(LC_EARG, op, "beta = %g is outside [0, 1]", beta);
  if (dtype != LC_F32)
    return fail(LC_EBADTYPE, op, "dtype = %d (%s) is not supported (f32 = %d only on CUDA)", dtype,
                dtype_name(dtype), LC_F32);
  if (!nonfinite) return fail(LC_EARG, op, "nonfinite is NULL");
  if (n > 0 && (!delta || !e || !payload))
    return fail(LC_EARG, op, "%s is NULL", !delta ? "delta" : !e ? "e" : "payload");
  DeviceGuard guard(e);
  cudaStream_t s = as_stream(stream);
  const cudaError_t err = cudaMemsetAsync(nonfinite, 0, sizeof(int64_t), s);
  if (err != cudaSuccess) return cuda_fail(op, "cudaMemsetAsync(nonfinite)", err);
  if (n == 0) return LC_OK;
  const Layout L = make_layout(n, k, chunk, bits);
  encode_kernel<<<static_cast<unsigned>(L.nc), kTopkThreads, 0, s>>>(
      L, static_cast<const float*>(delta), static_cast<float*>(e), static_cast<float>(beta),
      static_cast<uint8_t*>(payload), reinterpret_cast<unsigned long long*>(nonfinite));
  return launch_status(op);
}

LOWCOMM_EXPORT int lc_cuda_topk_decode_add(int dtype, const void* payload, int64_t n, int64_t k, int64_t chunk,
                                           int bits, void* out, void* stream) {
  static const char* const op = "lc_cuda_topk_decode_add";
  if (int rc = check_topk(op, n, k, chunk, bits)) return rc;
  if (n > 0 && (!payload || !out)) return fail(LC_EARG, op, "%s is NULL", !payload ? "payload" : "out");
  if (n == 0) return LC_OK;
  DeviceGuard guard(out);
  const Layout L = make_layout(n, k, chunk, bits);
  const unsigned grid = static_cast<unsigned>(L.nc);
  if (dtype == LC_F32) {
    decode_kernel<float><<<grid, 128, 0, as_stream(stream)>>>(L, static_cast<const uint8_t*>(payload),
                                                               static_cast<float*>(out));
  } else if (dtype == LC_F64) {
    decode_kernel<double><<<grid, 128, 0, as_stream(stream)>>>(L, static_cast<const uint8_t*>(payload),
                                                                static_cast<double*>(out));
  } else {
    return fail(LC_EBADTYPE, op, "dtype = %d (%s) is not supported (f32 = %d or f64 = %d)", dtype,
                dtype_name(dtype), LC_F32, LC_F64);
  }
  return launch_status(op);
}

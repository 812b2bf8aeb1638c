// CUDA-only plumbing shared by csrc/cuda/*.cu: dtype dispatch, launch geometry, error messages,
// stream-ordered scratch memory, aligned vector access with a peeled head, and block reductions.
// The per-element maths comes from lowcomm/kernels.h.
#ifndef LOWCOMM_CUDA_COMMON_CUH_
#define LOWCOMM_CUDA_COMMON_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

#include <mutex>

#include "lowcomm/abi.h"
#include "lowcomm/kernels.h"
#include "lowcomm/args.h"
#include "lowcomm/status.h"

namespace lowcomm {
namespace cuda {

constexpr int kThreads = 256;

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// Grid for a grid-stride loop over `work` items: enough blocks to fill the device a few times
// over, never more than the work needs.
inline int grid_for(int64_t work, int threads = kThreads) {
  static thread_local int cached_device = -1, cached_sms = 0;
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev != cached_device) {
    cudaDeviceGetAttribute(&cached_sms, cudaDevAttrMultiProcessorCount, dev);
    cached_device = dev;
  }
  const int64_t need = (work + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(cached_sms > 0 ? cached_sms : 80) * 8;
  return static_cast<int>(need < 1 ? 1 : (need < cap ? need : cap));
}

// Makes the device that owns `p` current for the scope (restoring the caller's afterwards): the
// caller passes a stream of the tensors' device, which need not be the current device, and a
// launch on the wrong device fails. ~1 us; a no-op when `p` is NULL or already on the current device.
class DeviceGuard {
 public:
  explicit DeviceGuard(const void* p) {
    cudaPointerAttributes attr;
    if (p == nullptr || cudaGetDevice(&prev_) != cudaSuccess) return;
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
      cudaGetLastError();  // clear this (non-sticky) error so launch_status() does not report it
      return;
    }
    if (attr.type == cudaMemoryTypeDevice && attr.device != prev_ && cudaSetDevice(attr.device) == cudaSuccess)
      switched_ = true;
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool switched_ = false;
};

// LC_ECUDA with "<op>: <what>: <error name>: <error string>" as the last error. The runtime's
// per-thread error state is cleared, so a non-sticky error is reported once, here, and not again
// by the next unrelated launch check (torch's).
inline int cuda_fail(const char* op, const char* what, cudaError_t e) {
  cudaGetLastError();
  return fail(LC_ECUDA, op, "%s: %s: %s", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

// LC_OK, or LC_ECUDA naming the CUDA error of the launch just made (cudaGetLastError also reports
// a sticky error of an earlier kernel on this context, which then surfaces here).
inline int launch_status(const char* op) {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? LC_OK : cuda_fail(op, "kernel launch", e);
}

template <class F>
int dispatch_data(const char* op, int dtype, F&& f) {
  switch (dtype) {
    case LC_F32: return f(float{});
    case LC_F64: return f(double{});
    case LC_BF16: return f(bf16{});
    case LC_F16: return f(f16{});
    default: return bad_dtype(op, dtype);
  }
}

// f(X{}, S{}): parameter dtype X, storage S = X's compute dtype (Master<X>::type) or bf16, as on
// the CPU (csrc/cpu/cpu_common.h).
template <class F>
int dispatch_data_storage(const char* op, int dtype, const char* storage_name, int storage, F&& f) {
  if (dtype == LC_F32 && storage == LC_F32) return f(float{}, float{});
  if (dtype == LC_F32 && storage == LC_BF16) return f(float{}, bf16{});
  if (dtype == LC_F64 && storage == LC_F64) return f(double{}, double{});
  if (dtype == LC_F64 && storage == LC_BF16) return f(double{}, bf16{});
  if (dtype == LC_BF16 && storage == LC_F32) return f(bf16{}, float{});
  if (dtype == LC_BF16 && storage == LC_BF16) return f(bf16{}, bf16{});
  if (dtype == LC_F16 && storage == LC_F32) return f(f16{}, float{});
  if (dtype == LC_F16 && storage == LC_BF16) return f(f16{}, bf16{});
  return bad_dtypes(op, dtype, storage_name, storage);
}

// Stream-ordered scratch memory for the two-pass reductions: allocated on `stream` from a memory
// pool this library owns on the current device (created on first use; it keeps up to
// kScratchKeep bytes between calls, so steady-state calls map no memory) and freed on the same
// stream after the kernels that use it, so nothing waits on the host. Devices without memory
// pools fall back to cudaMalloc, and the free then synchronizes the stream.
constexpr uint64_t kScratchKeep = uint64_t(64) << 20;

class Scratch {
 public:
  Scratch(const char* op, size_t bytes, cudaStream_t s) : stream_(s) {
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    cudaMemPool_t pool = e == cudaSuccess ? pool_of(dev) : nullptr;
    if (pool != nullptr) {
      e = cudaMallocFromPoolAsync(&p_, bytes, pool, s);
    } else if (e == cudaSuccess) {
      e = cudaMalloc(&p_, bytes);
      synchronous_ = true;
    }
    if (e != cudaSuccess) {
      p_ = nullptr;
      status_ = cuda_fail(op, "scratch allocation", e);
    }
  }
  ~Scratch() {
    if (p_ == nullptr) return;
    if (synchronous_) {
      cudaStreamSynchronize(stream_);
      cudaFree(p_);
    } else {
      cudaFreeAsync(p_, stream_);
    }
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  int status() const { return status_; }  // LC_OK, or LC_ECUDA with the message set
  template <class T>
  T* get() const {
    return static_cast<T*>(p_);
  }

 private:
  // The library's pool of `dev`, or nullptr where the device has no memory pools.
  static cudaMemPool_t pool_of(int dev) {
    constexpr int kMaxDevices = 64;
    static std::mutex mu;
    static cudaMemPool_t pools[kMaxDevices] = {};
    static bool tried[kMaxDevices] = {};
    if (dev < 0 || dev >= kMaxDevices) return nullptr;
    std::lock_guard<std::mutex> lock(mu);
    if (!tried[dev]) {
      tried[dev] = true;
      int supported = 0;
      if (cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, dev) == cudaSuccess && supported) {
        cudaMemPoolProps props = {};
        props.allocType = cudaMemAllocationTypePinned;
        props.location.type = cudaMemLocationTypeDevice;
        props.location.id = dev;
        cudaMemPool_t pool = nullptr;
        if (cudaMemPoolCreate(&pool, &props) == cudaSuccess) {
          uint64_t keep = kScratchKeep;
          cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
          pools[dev] = pool;
        }
      }
      cudaGetLastError();  // a failed probe leaves no error for launch_status() to report
    }
    return pools[dev];
  }

  cudaStream_t stream_;
  void* p_ = nullptr;
  bool synchronous_ = false;
  int status_ = LC_OK;
};

// V consecutive elements moved as one aligned access (16 bytes for V*sizeof(T) == 16).
template <class T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <class T, int V>
__device__ __forceinline__ Vec<T, V> load_vec(const T* p, int64_t j) {
  return reinterpret_cast<const Vec<T, V>*>(p)[j];
}
template <class T, int V>
__device__ __forceinline__ void store_vec(T* p, int64_t j, const Vec<T, V>& v) {
  reinterpret_cast<Vec<T, V>*>(p)[j] = v;
}

// The vector path of an elementwise kernel moves V consecutive elements of every operand as one
// aligned access (16 bytes for the data dtype). Operands of a launch usually share one
// misalignment: fragments of the runtime's flat buffers start at the same element offset in
// buffers laid out alike. AlignedHead finds the head h < V after which every operand is aligned
// for its vector access: elements [0, h) then run scalar, [h, h + V*floor((n-h)/V)) vectorised,
// and the rest scalar. head() is -1 when no such h exists (operands misaligned differently, or a
// pointer not aligned to its own element), and the launch runs the scalar kernel.
template <int V>
class AlignedHead {
 public:
  template <class E>
  AlignedHead& operator()(const E* p) {
    if (p == nullptr || !ok_) return *this;
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    if (a % sizeof(E) != 0) {
      ok_ = false;
      return *this;
    }
    const int k = static_cast<int>((a / sizeof(E)) % V);  // elements past the last vector boundary
    if (k_ < 0) k_ = k;
    else if (k_ != k) ok_ = false;
    return *this;
  }
  int64_t head() const { return !ok_ ? -1 : (k_ <= 0 ? 0 : V - k_); }

 private:
  int k_ = -1;
  bool ok_ = true;
};

// p + off, keeping NULL as NULL (optional operands).
template <class E>
__device__ __forceinline__ E* offset(E* p, int64_t off) {
  return p == nullptr ? nullptr : p + off;
}

// Sum over the block in a fixed tree (warp shuffles, then warp 0 over the warp partials): the
// same inputs in the same threads give the same bits. Result valid in thread 0.
template <class T>
__device__ T block_sum(T v) {
  __shared__ T warp_part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  __syncthreads();  // warp_part may still be read by a previous call
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();
  const int nwarps = (blockDim.x + 31) >> 5;
  v = threadIdx.x < nwarps ? warp_part[threadIdx.x] : T(0);
  if (warp == 0) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  }
  return v;
}

}  // namespace cuda
}  // namespace lowcomm

#endif  // LOWCOMM_CUDA_COMMON_CUH_

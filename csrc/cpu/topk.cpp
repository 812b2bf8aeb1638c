// lc_topk_encode / lc_topk_decode_add: the top-k sparse wire format with error feedback
// (lowcomm_kernels/ops/topk.py is the specification, its module docstring the format). Chunks are
// independent and start on byte boundaries of every section, so threads split the chunks (static
// schedule); nothing depends on the thread count.
#include <string.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_common.h"

using namespace lowcomm;
using namespace lowcomm::cpu;

namespace {

constexpr int64_t kMaxChunk = int64_t(1) << 30;

// Below these sizes one thread does the work. A parallel region has to wake the second OpenMP
// thread, and on a busy 2-vCPU VM that costs a scheduler slice whenever the other vCPU is taken:
// the median two-thread call measured 10-15 ms where one thread takes 0.25-3 ms (decode of
// 256K-4M values, an idle gap before each call as between syncs, 1 and 2 threads interleaved in
// one process). So a region must have a single-thread cost of that order to be worth it.
//   encode: about 4 ns per value (the selection); measured, two threads lose below 2^21 values
//     (1M: 12.2 vs 3.6 ms median) and win from there (2M: 5.7 vs 10.2 ms, 4M: 15.3 vs 21.1 ms).
//   decode: about 40 ns per entry (a scatter of cache misses). Two threads halve it when they are
//     both awake, but on the loaded VM they lost at every size measured (up to 2^20 entries: 52-64 vs
//     41-45 ms median); from 2^19 entries one thread takes 16-24 ms, so the half a second thread
//     can save is at least the 10-15 ms it costs to wake.
constexpr int64_t kEncodeParallelValues = int64_t(1) << 21;
constexpr int64_t kDecodeParallelEntries = int64_t(1) << 19;

int64_t nbytes(int64_t count, int width) { return (count * width + 7) / 8; }

int index_bits(int64_t chunk) {
  int b = 0;
  while ((int64_t(1) << b) < chunk) ++b;
  return b;
}

// Where each chunk's pieces lie in a payload of n values.
struct Layout {
  int64_t n, chunk, nc, kf, kl, ibf, vbf, idx0, val0, total;
  int bits, ib;
  Layout(int64_t n_, int64_t k, int64_t chunk_, int bits_) : n(n_), chunk(chunk_), bits(bits_) {
    ib = index_bits(chunk);
    nc = (n + chunk - 1) / chunk;
    kf = std::min(k, chunk);
    kl = nc ? std::min(k, n - (nc - 1) * chunk) : 0;
    ibf = nbytes(kf, ib);
    vbf = nbytes(kf, bits);
    idx0 = 4 * nc;
    val0 = nc ? idx0 + (nc - 1) * ibf + nbytes(kl, ib) : idx0;
    total = nc ? val0 + (nc - 1) * vbf + nbytes(kl, bits) : 0;
  }
  int64_t length(int64_t j) const { return std::min(chunk, n - j * chunk); }
  int64_t entries(int64_t j) const { return j + 1 < nc ? kf : kl; }
  int64_t all_entries() const { return nc ? (nc - 1) * kf + kl : 0; }
};

// LSB-first bit stream over one chunk's section: every byte of it is written, padding bits zero.
struct BitWriter {
  uint8_t* p;
  uint64_t acc = 0;
  int nb = 0;
  explicit BitWriter(uint8_t* out) : p(out) {}
  void put(uint64_t v, int w) {  // w <= 30 and nb < 8: acc never overflows
    acc |= v << nb;
    nb += w;
    while (nb >= 8) {
      *p++ = static_cast<uint8_t>(acc);
      acc >>= 8;
      nb -= 8;
    }
  }
  void flush() {
    if (nb > 0) *p++ = static_cast<uint8_t>(acc);
    acc = 0;
    nb = 0;
  }
};

struct BitReader {
  const uint8_t* p;
  uint64_t acc = 0;
  int nb = 0;
  explicit BitReader(const uint8_t* in) : p(in) {}
  uint32_t get(int w) {  // reads only the bytes the entries occupy
    while (nb < w) {
      acc |= uint64_t(*p++) << nb;
      nb += 8;
    }
    const uint32_t v = static_cast<uint32_t>(acc & ((uint64_t(1) << w) - 1));
    acc >>= w;
    nb -= w;
    return v;
  }
};

template <class T>
struct AbsBits;  // |x|'s bit pattern: for non-negative floats, integer order is value order
template <>
struct AbsBits<float> {
  static uint32_t of(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u & 0x7FFFFFFFu;
  }
};
template <>
struct AbsBits<double> {
  static uint64_t of(double x) {
    uint64_t u;
    memcpy(&u, &x, 8);
    return u & 0x7FFFFFFFFFFFFFFFull;
  }
};

// The kk indices of the largest |e_i| of a chunk (ties to the lower index), ascending, into idx.
// fp32: one 64-bit key per entry, |e| bits above the complemented index, so a larger key is a
// larger |e| or, at equal |e|, a lower index; fp64 compares (bits, index) pairs the same way.
// fp32 first narrows the field with a histogram of the top 11 bits of |e| (8 exponent and 3
// mantissa bits): every entry in a bin above the k-th largest's is selected, every entry below
// it is not, so only that bin's and the higher bins' entries (about k plus one bin's share) are
// keyed and partially sorted. The selection is the same set, in the same order, as a full sort.
constexpr int kBinShift = 20;
constexpr int kBins = 1 << (31 - kBinShift);

void select_top(const float* e, int64_t len, int64_t kk, std::vector<uint64_t>& keys, std::vector<uint32_t>& idx,
                std::vector<uint32_t>& ab, std::vector<uint32_t>& hist) {
  ab.resize(len);
  hist.assign(kBins, 0);
  for (int64_t i = 0; i < len; ++i) {
    ab[i] = AbsBits<float>::of(e[i]);
    ++hist[ab[i] >> kBinShift];
  }
  int64_t above = 0;
  int bin = kBins - 1;
  while (above + hist[bin] < kk) above += hist[bin--];
  const uint32_t lo = uint32_t(bin) << kBinShift;
  keys.clear();
  for (int64_t i = 0; i < len; ++i)
    if (ab[i] >= lo) keys.push_back((uint64_t(ab[i]) << 32) | uint64_t(0xFFFFFFFFu - uint32_t(i)));
  if (int64_t(keys.size()) > kk)
    std::nth_element(keys.begin(), keys.begin() + (kk - 1), keys.end(), std::greater<uint64_t>());
  for (int64_t t = 0; t < kk; ++t) idx[t] = 0xFFFFFFFFu - uint32_t(keys[t] & 0xFFFFFFFFu);
  std::sort(idx.begin(), idx.begin() + kk);
}

void select_top(const double* e, int64_t len, int64_t kk, std::vector<std::pair<uint64_t, uint32_t>>& keys,
                std::vector<uint32_t>& idx, std::vector<uint32_t>&, std::vector<uint32_t>&) {
  keys.resize(len);
  for (int64_t i = 0; i < len; ++i) keys[i] = {AbsBits<double>::of(e[i]), uint32_t(i)};
  auto before = [](const std::pair<uint64_t, uint32_t>& a, const std::pair<uint64_t, uint32_t>& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  std::nth_element(keys.begin(), keys.begin() + (kk - 1), keys.end(), before);
  for (int64_t t = 0; t < kk; ++t) idx[t] = keys[t].second;
  std::sort(idx.begin(), idx.begin() + kk);
}

template <class T>
using KeyVec = typename std::conditional<std::is_same<T, float>::value, std::vector<uint64_t>,
                                         std::vector<std::pair<uint64_t, uint32_t>>>::type;

// One chunk: update e, select, scale, codes, subtract; returns its share of the non-finite count.
template <class T>
int64_t encode_chunk(const T* d, T* e, int64_t len, int64_t kk, T beta, int bits, int ib, uint8_t* scale_out,
                     uint8_t* idx_out, uint8_t* val_out, KeyVec<T>& keys, std::vector<uint32_t>& idx,
                     std::vector<uint32_t>& ab, std::vector<uint32_t>& hist) {
  int64_t bad_values = 0;
  for (int64_t i = 0; i < len; ++i) {
    const T v = e[i] * beta;  // two roundings, as e.mul_(beta).add_(delta)
    e[i] = v + d[i];
    bad_values += !std::isfinite(e[i]);
  }
  const int lq = (1 << bits) - 1;
  const float lqf = static_cast<float>(lq);
  float s = NAN;
  if (bad_values == 0) {
    if (kk == len) {
      for (int64_t t = 0; t < kk; ++t) idx[t] = uint32_t(t);
    } else {
      select_top(e, len, kk, keys, idx, ab, hist);
    }
    if (bits == 1) {  // mean |value|: fp64 sum in ascending index order
      double sum = 0.0;
      for (int64_t t = 0; t < kk; ++t) sum += static_cast<double>(std::fabs(e[idx[t]]));
      s = static_cast<float>(sum / static_cast<double>(kk));
    } else {
      T mx = 0;
      for (int64_t t = 0; t < kk; ++t) mx = std::max(mx, static_cast<T>(std::fabs(e[idx[t]])));
      s = static_cast<float>(mx);
    }
  }
  const bool ok = bad_values == 0 && std::isfinite(s);
  BitWriter wi(idx_out), wv(val_out);
  if (!ok) {  // not encoded: indices 0..kk-1, codes 0, scale NaN, e kept
    s = NAN;
    for (int64_t t = 0; t < kk; ++t) wi.put(uint64_t(t), ib);
    for (int64_t t = 0; t < kk; ++t) wv.put(0, bits);
  } else {
    for (int64_t t = 0; t < kk; ++t) {
      const uint32_t i = idx[t];
      const float w = static_cast<float>(e[i]);
      const float m = s > 0.0f ? w / s : 0.0f;
      float q = std::rint((m * lqf + lqf) * 0.5f);
      q = q < 0.0f ? 0.0f : (q > lqf ? lqf : q);
      const int c = static_cast<int>(q);
      const float sent = (static_cast<float>(2 * c - lq) * s) / lqf;
      e[i] = e[i] - static_cast<T>(sent);
      wi.put(i, ib);
      wv.put(uint64_t(c), bits);
    }
  }
  wi.flush();
  wv.flush();
  memcpy(scale_out, &s, 4);
  return bad_values + (bad_values == 0 && !ok ? 1 : 0);
}

template <class T>
int64_t encode_all(const Layout& L, const T* d, T* e, double beta, uint8_t* payload) {
  const T b = static_cast<T>(beta);
  int64_t nonfinite = 0;
#pragma omp parallel if (L.n >= kEncodeParallelValues) reduction(+ : nonfinite)
  {
    KeyVec<T> keys;
    // sized by what a chunk of this buffer can hold, not by the chunk knob (a chunk of 2^30 over a
    // buffer of 337 values must not allocate gigabytes)
    keys.reserve(static_cast<size_t>(std::min(L.chunk, L.n)));
    std::vector<uint32_t> idx(static_cast<size_t>(std::min(L.kf, L.n)));
    std::vector<uint32_t> ab, hist;  // fp32's |e| bits and bin counts (select_top), per thread
#pragma omp for schedule(static)
    for (int64_t j = 0; j < L.nc; ++j) {
      const int64_t off = j * L.chunk;
      nonfinite += encode_chunk<T>(d + off, e + off, L.length(j), L.entries(j), b, L.bits, L.ib, payload + 4 * j,
                                   payload + L.idx0 + j * L.ibf, payload + L.val0 + j * L.vbf, keys, idx, ab, hist);
    }
  }
  return nonfinite;
}

template <class T>
void decode_all(const Layout& L, const uint8_t* payload, T* out) {
  const int lq = (1 << L.bits) - 1;
  const float lqf = static_cast<float>(lq);
#pragma omp parallel for schedule(static) if (L.all_entries() >= kDecodeParallelEntries)
  for (int64_t j = 0; j < L.nc; ++j) {
    float s;
    memcpy(&s, payload + 4 * j, 4);
    BitReader ri(payload + L.idx0 + j * L.ibf), rv(payload + L.val0 + j * L.vbf);
    T* o = out + j * L.chunk;
    const int64_t kk = L.entries(j);
    for (int64_t t = 0; t < kk; ++t) {
      const uint32_t i = ri.get(L.ib);
      const int c = static_cast<int>(rv.get(L.bits));
      const float v = (static_cast<float>(2 * c - lq) * s) / lqf;
      o[i] = o[i] + static_cast<T>(v);
    }
  }
}

// The first chunk holding an index past its length, or -1 (checked before anything is written).
int64_t first_bad_chunk(const Layout& L, const uint8_t* payload) {
  int64_t bad = L.nc;
#pragma omp parallel for schedule(static) reduction(min : bad) if (L.all_entries() >= kDecodeParallelEntries)
  for (int64_t j = 0; j < L.nc; ++j) {
    BitReader ri(payload + L.idx0 + j * L.ibf);
    const int64_t len = L.length(j), kk = L.entries(j);
    for (int64_t t = 0; t < kk; ++t)
      if (ri.get(L.ib) >= len) {
        bad = std::min(bad, j);
        break;
      }
  }
  return bad == L.nc ? -1 : bad;
}

int check_format(const char* op, int64_t n, int64_t k, int64_t chunk, int bits) {
  if (n < 0) return fail(LC_EARG, op, "n = %lld is negative", static_cast<long long>(n));
  if (chunk < 2 || chunk > kMaxChunk)
    return fail(LC_EARG, op, "chunk = %lld is outside [2, 2^30]", static_cast<long long>(chunk));
  if (k < 1 || k > chunk)
    return fail(LC_EARG, op, "k = %lld is outside [1, chunk = %lld]", static_cast<long long>(k),
                static_cast<long long>(chunk));
  if (bits != 1 && bits != 2 && bits != 4) return fail(LC_EARG, op, "bits = %d is not 1, 2 or 4", bits);
  return LC_OK;
}

}  // namespace

LOWCOMM_EXPORT int lc_topk_encode(int dtype, const void* delta, void* e, int64_t n, int64_t k, int64_t chunk,
                                  int bits, double beta, void* payload, int64_t* nonfinite) {
  static const char* const op = "lc_topk_encode";
  if (int rc = check_format(op, n, k, chunk, bits)) return rc;
  if (!(beta >= 0.0 && beta <= 1.0)) return fail(LC_EARG, op, "beta = %g is outside [0, 1]", beta);
  if (n > 0 && (!delta || !e || !payload || !nonfinite))
    return fail(LC_EARG, op, "%s is NULL", !delta ? "delta" : !e ? "e" : !payload ? "payload" : "nonfinite");
  const Layout L(n, k, chunk, bits);
  auto* p = static_cast<uint8_t*>(payload);
  if (dtype == LC_F32) {
    *nonfinite = encode_all<float>(L, static_cast<const float*>(delta), static_cast<float*>(e), beta, p);
  } else if (dtype == LC_F64) {
    *nonfinite = encode_all<double>(L, static_cast<const double*>(delta), static_cast<double*>(e), beta, p);
  } else {
    return fail(LC_EBADTYPE, op, "dtype = %d (%s) is not supported (f32 = %d or f64 = %d)", dtype,
                dtype_name(dtype), LC_F32, LC_F64);
  }
  return LC_OK;
}

LOWCOMM_EXPORT int lc_topk_decode_add(int dtype, const void* payload, int64_t n, int64_t k, int64_t chunk, int bits,
                                      void* out) {
  static const char* const op = "lc_topk_decode_add";
  if (int rc = check_format(op, n, k, chunk, bits)) return rc;
  if (n > 0 && (!payload || !out)) return fail(LC_EARG, op, "%s is NULL", !payload ? "payload" : "out");
  if (dtype != LC_F32 && dtype != LC_F64)
    return fail(LC_EBADTYPE, op, "dtype = %d (%s) is not supported (f32 = %d or f64 = %d)", dtype,
                dtype_name(dtype), LC_F32, LC_F64);
  const Layout L(n, k, chunk, bits);
  const auto* p = static_cast<const uint8_t*>(payload);
  const int64_t bad = first_bad_chunk(L, p);
  if (bad >= 0)
    return fail(LC_EARG, op, "payload holds an index past the end of chunk %lld (%lld values)",
                static_cast<long long>(bad), static_cast<long long>(L.length(bad)));
  if (dtype == LC_F32)
    decode_all<float>(L, p, static_cast<float*>(out));
  else
    decode_all<double>(L, p, static_cast<double*>(out));
  return LC_OK;
}

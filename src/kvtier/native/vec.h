// Vector helpers shared by kvtier's CPU operators (cpu_ops.cpp, attend_prefill.cpp):
// 16-lane GCC vector types (AVX-512 here; any ISA compiles), loads/stores, and a
// vectorised exp with its scalar twin. Header-only; everything is inline.
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvtier_vec {

// exp(x), ~1 ulp (Cephes' expf polynomial), for x <= 88 (larger x: exp(88)); below -87.3
// it returns exp(-87.3) ~ 1e-38 instead of a denormal or 0. In 16-lane GCC vectors (any
// ISA; AVX-512 here) with a scalar twin for the remainder: the same arithmetic per lane.
typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

template <typename F>
inline F exp_poly(F x, F n) {  // exp(r) for r = x - n ln2 (the caller scales by 2^n)
  const F r = x - n * 0.693359375f + n * 2.12194440e-4f;
  F y = r * 0.f + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  return y * (r * r) + r + 1.f;
}

// n = x log2(e) rounded to the nearest integer (ties to even), then exp(r) 2^n. With AVX-512
// the rounding is one instruction and the scaling vscalefps (what made the prefill kernel's
// softmax 15 % faster); elsewhere the integer bits are built by hand. Both give the same
// value per lane as exp_scalar.
inline vfloat exp_vec(vfloat x) {
  x = x < -87.3f ? vfloat{} - 87.3f : x;
  x = x > 88.f ? vfloat{} + 88.f : x;
  const vfloat t = x * 1.44269504088896341f;
#ifdef __AVX512F__
  const __m512 n = _mm512_roundscale_ps(reinterpret_cast<const __m512&>(t),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vfloat y = exp_poly(x, reinterpret_cast<const vfloat&>(n));
  const __m512 e = _mm512_scalef_ps(reinterpret_cast<const __m512&>(y), n);
  return reinterpret_cast<const vfloat&>(e);
#else
  vfloat n;
  for (int64_t l = 0; l < kLanes; ++l) n[l] = std::nearbyint(t[l]);
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  return exp_poly(x, n) * reinterpret_cast<const vfloat&>(bits);
#endif
}

inline float exp_scalar(float x) {
  x = std::min(std::max(x, -87.3f), 88.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return exp_poly(x, n) * scale;
}

// x in every lane: one broadcast (from memory where x was loaded). Not `vfloat{} + x`: that
// is a scalar add of 0.f first (it turns -0.f into +0.f, so the compiler keeps it) and a
// register broadcast on Intel's FMA port; x - 0.f is x exactly, so it folds away.
inline vfloat splat(float x) { return x - vfloat{}; }

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

// 16 bytes at p (int8_t or uint8_t) widened to float32, exactly.
template <typename T>
inline vfloat load_bytes(const T* p) {
  static_assert(sizeof(T) == 1, "load_bytes widens bytes");
#ifdef __AVX512F__
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i i = std::is_signed_v<T> ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  const __m512 v = _mm512_cvtepi32_ps(i);
  return reinterpret_cast<const vfloat&>(v);
#else
  vfloat v;
  for (int64_t l = 0; l < kLanes; ++l) v[l] = static_cast<float>(p[l]);
  return v;
#endif
}

// An IEEE half's bits widened to float32, exactly (the scalar twin of load_f16).
inline float half_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float v;
  if (exp == 0x1F) {  // inf or NaN
    const uint32_t bits = sign | 0x7F800000u | (man << 13);
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
  v = exp == 0 ? std::ldexp(static_cast<float>(man), -24)  // subnormal (or zero)
               : std::ldexp(static_cast<float>(man | 0x400), static_cast<int>(exp) - 25);
  return sign != 0 ? -v : v;
}

// 16 IEEE halves (at p) widened to float32, exactly.
inline vfloat load_f16(const uint16_t* p) {
#ifdef __AVX512F__
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<const vfloat&>(v);
#else
  vfloat v;
  for (int64_t l = 0; l < kLanes; ++l) v[l] = half_float(p[l]);
  return v;
#endif
}

// 16 bytes (at p) of two 4-bit codes each, widened to float32 exactly: lo the low nibbles,
// hi the high ones.
inline void load_nibbles(const uint8_t* p, vfloat& lo, vfloat& hi) {
#ifdef __AVX512F__
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 l = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
  const __m512 h = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  lo = reinterpret_cast<const vfloat&>(l);
  hi = reinterpret_cast<const vfloat&>(h);
#else
  for (int64_t l = 0; l < kLanes; ++l) {
    lo[l] = static_cast<float>(p[l] & 15);
    hi[l] = static_cast<float>(p[l] >> 4);
  }
#endif
}

// Lane by lane the larger of a and b.
inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

// Asks for the cache line at p ahead of its use (to every cache level); p may lie past the
// end of its array (a prefetch never faults).
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// Asks for the cache line at p into L2 (prefetcht1), not L1. Far ahead of a stream that a
// compute loop reads, this keeps the reads in flight without holding L1's few miss buffers:
// on the 2-core AMD EPYC (Zen 4; standalone replica of the bf16 4-bit code tile, one row, 64
// MiB, two threads, best of 5, three rounds each) prefetcht0 8 blocks (7.5 KiB) ahead read
// 22-35 GB/s, prefetcht1 or prefetcht2 16-64 KiB ahead 37-54, and a loop of bare loads
// over the same bytes 35-52: the loop then runs at about the memory's rate instead of the
// sum of its compute time (70 GB/s from L2) and its memory time. prefetchnta: 21-22.
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// Reads the whole 64-byte lines of a[0, bytes) and b[0, bytes), one of each in turn, in a
// loop that does nothing else, so that a compute loop over them right after finds them in
// L2 (both runs together must fit it; nothing is written). A loop of bare loads keeps more
// lines in flight than a compute loop with prefetches in it: on the 2-core AMD EPYC (Zen
// 4) the decode attention over 16 rows x 512 keys x 30 layers (from memory) took 0.58
// instead of 0.68 ms a layer in float32, 0.36 instead of 0.40 in bf16, against 0.49 and
// 0.26 for this loop alone over the same bytes; prefetcht0 or prefetcht2 in the same
// loop instead of loads was no faster than no staging.
inline void stage(const void* a, const void* b, int64_t bytes) {
  const char* x = static_cast<const char*>(a);
  const char* y = static_cast<const char*>(b);
  vint seen{};
  for (int64_t i = 0; i + 64 <= bytes; i += 64) {
    vint u, w;
    std::memcpy(&u, x + i, sizeof u);
    std::memcpy(&w, y + i, sizeof w);
    seen |= u | w;
  }
  int32_t any = 0;
  for (int64_t l = 0; l < kLanes; ++l) any |= seen[l];
  __asm__ volatile("" : : "r"(any));  // the loads are the point: keep them
}

// bfloat16 pairs (the projections' bf16 panels): a 32-bit word holds two bf16 patterns, the
// lower half the even k. fma_pairs (two FMAs, any ISA) and dot_pairs (one vdpbf16ps, where
// the CPU has AVX-512 BF16; it also flushes denormals to zero) add to each lane l: x_odd *
// w_odd[l], then x_even * w_even[l] (each product of two bf16 values exact in float32, each
// sum rounded once).
typedef uint32_t vuint __attribute__((vector_size(64)));

inline vuint load_pairs(const uint32_t* p) {
  vuint v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float bits_float(uint32_t bits) {
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// The pair in both halves' float32 values (for FMAs), or as it is (for vdpbf16ps).
struct XPair {
  vfloat odd, even;
};
inline XPair splat_pair(uint32_t x) {
  return XPair{splat(bits_float(x & 0xFFFF0000u)), splat(bits_float(x << 16))};
}
inline vfloat fma_pairs(vfloat acc, vuint w, const XPair& x) {
  const vuint odd = w & 0xFFFF0000u, even = w << 16;
  acc += x.odd * reinterpret_cast<const vfloat&>(odd);
  return acc + x.even * reinterpret_cast<const vfloat&>(even);
}

#ifdef __AVX512BF16__
inline __m512bh splat_pair_bits(uint32_t x) {
  const __m512i v = _mm512_set1_epi32(static_cast<int>(x));
  return reinterpret_cast<const __m512bh&>(v);
}
inline vfloat dot_pairs(vfloat acc, vuint w, __m512bh x) {
  const __m512 r = _mm512_dpbf16_ps(reinterpret_cast<const __m512&>(acc),
                                    reinterpret_cast<const __m512bh&>(w), x);
  return reinterpret_cast<const vfloat&>(r);
}
#endif

// out[j] = x[j] rounded to bfloat16 (to nearest, ties to even; a NaN stays a NaN), j < n.
inline void round_bf16(const float* x, int64_t n, uint16_t* out) {
  int64_t j = 0;
#ifdef __AVX512BF16__
  for (; j + 2 * kLanes <= n; j += 2 * kLanes) {
    const __m512bh r =
        _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + j + kLanes), _mm512_loadu_ps(x + j));
    _mm512_storeu_si512(out + j, reinterpret_cast<const __m512i&>(r));
  }
#endif
  for (; j < n; ++j) {
    uint32_t bits;
    std::memcpy(&bits, x + j, sizeof bits);
    const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    out[j] = static_cast<uint16_t>(nan ? (bits >> 16) | 0x40u : rounded);
  }
}

// out[j] = x[j] widened to float32 (exact: a bf16 value is the top half of its float32).
inline void widen_bf16(const uint16_t* x, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = bits_float(static_cast<uint32_t>(x[j]) << 16);
}

// KV elements as the attention kernels read them: float32, or bfloat16 bit patterns
// (uint16_t; kvtier's bf16 mode), widened to float32 on load (exact; vpmovzxwd and a
// shift with AVX-512) and rounded to nearest even on store.
typedef uint16_t vhalf __attribute__((vector_size(32)));

inline vfloat load_kv(const float* p) { return load(p); }
inline vfloat load_kv(const uint16_t* p) {
  vhalf h;
  std::memcpy(&h, p, sizeof h);
  const vuint bits = __builtin_convertvector(h, vuint) << 16;
  return reinterpret_cast<const vfloat&>(bits);
}

inline void store_kv(const float* x, int64_t n, float* out) { std::memcpy(out, x, n * 4); }
inline void store_kv(const float* x, int64_t n, uint16_t* out) { round_bf16(x, n, out); }

// rows x [rows, dim] (row stride `stride` elements, dim a multiple of 16) into out
// [rows, dim] float32 (contiguous).
template <typename T>
inline void widen_rows(const T* x, int64_t stride, int64_t rows, int64_t dim, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < dim; d += kLanes) store(out + r * dim + d, load_kv(x + r * stride + d));
  }
}

// s[j] = exp(s[j] - shift) for j < n; returns their sum.
inline float exp_shifted(float* s, int64_t n, float shift) {
  vfloat acc{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const vfloat e = exp_vec(load(s + j) - shift);
    store(s + j, e);
    acc += e;
  }
  float sum = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) sum += acc[l];
  for (; j < n; ++j) {
    s[j] = exp_scalar(s[j] - shift);
    sum += s[j];
  }
  return sum;
}

inline float lane_sum(vfloat a) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512&>(a));
#else
  float sum = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) sum += a[l];
  return sum;
#endif
}

inline float lane_max(vfloat a) {
#ifdef __AVX512F__
  return _mm512_reduce_max_ps(reinterpret_cast<__m512&>(a));
#else
  float best = a[0];
  for (int64_t l = 1; l < kLanes; ++l) best = a[l] > best ? a[l] : best;
  return best;
#endif
}

// The largest of s[0 .. n-1] (n >= 1), 16 lanes at a time: std::max_element's scalar
// chain (one vmaxss after another, 4 cycles each) took 18 % of the decode attention's
// block in an L2-resident profile on the Intel Xeon.
inline float max_of(const float* s, int64_t n) {
  float best = s[0];
  int64_t j = 0;
  if (n >= kLanes) {
    vfloat acc = load(s);
    for (j = kLanes; j + kLanes <= n; j += kLanes) acc = vmax(acc, load(s + j));
    best = lane_max(acc);
  }
  for (; j < n; ++j) best = s[j] > best ? s[j] : best;
  return best;
}

// r[j] = the sum of a[j]'s 16 lanes, for j < 16: 16 horizontal sums in 31 two-input
// shuffles and 15 adds (one lane_sum is 4 of each): halves of pairs, then quarters of
// pairs of pairs, then within 128-bit quarters. Each sum is the tree of lane_sum's AVX-512
// reduction (lane l + lane l+8, then +4, +2, +1), so bit for bit lane_sum's there. The
// last step leaves the sum of input s in lane 4 (s % 4) + s / 4, so the inputs are taken
// in that order. GCC vector shuffles, so any ISA compiles it.
inline vfloat lane_sums16(const vfloat* a) {
  vfloat b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {  // input slot s holds a[4 (s % 4) + s / 4]
    const int s0 = 2 * i, s1 = 2 * i + 1;
    const vfloat& x = a[4 * (s0 % 4) + s0 / 4];
    const vfloat& y = a[4 * (s1 % 4) + s1 / 4];
    b[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
  }
  for (int i = 0; i < 4; ++i) {
    const vfloat& x = b[2 * i];
    const vfloat& y = b[2 * i + 1];
    c[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    const vfloat& x = c[2 * i];
    const vfloat& y = c[2 * i + 1];
    d[i] = __builtin_shufflevector(x, y, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
           __builtin_shufflevector(x, y, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  }
  return __builtin_shufflevector(d[0], d[1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28,
                                 29) +
         __builtin_shufflevector(d[0], d[1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                                 31);
}

}  // namespace kvtier_vec

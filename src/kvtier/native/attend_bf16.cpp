// attend_prefill_bf16: attend_prefill's contract (attend_prefill.cpp) for bf16 K/V, with
// both matmuls on the CPU's bf16 dot products (float32 accumulation): AMX tiles
// (tdpbf16ps) where the CPU has AMX and Linux grants it, else AVX-512 BF16's vdpbf16ps
// (AMD Zen 4, for one). kvtier's bf16 mode.
//
// A work item is (KV head, 16 positions): the positions are a tile's 16 columns and, as in
// attend_prefill, the 16 lanes of every softmax vector (no horizontal reductions). Per item
// and block of 128 keys, for each of the G query heads of the KV head:
//
//   scores  S^T [keys][16 positions] = K Q^T: A = 16 keys x 32 d of K, read in place
//           (row stride of the tensor); B = the item's queries, scaled, rounded to bf16
//           and packed once as pairs of d ([D/32][16 pairs][16 positions][2])
//   softmax per lane: running max and sum, masked keys weigh 0 (the diagonal block only);
//           the probabilities rounded to bf16 and packed as pairs of keys (B of P·V)
//   O^T [D][16 positions] += V^T P^T: A = 16 d x 32 keys of V^T, packed once per call
//           for every item ([Hkv][D][keys]); the accumulators live in the item's scratch
//           and are rescaled there by the block's alpha
//
// The queries are rounded to bf16 (the scale and log2(e) applied first: the softmax runs in
// base 2), as torch's bf16 flash attention rounds them; scores, softmax and sums are
// float32. AMX tiles: every one 16 rows of 64 bytes; 0-3 accumulators, 4 the B operand, 5
// and 6 the A operand (alternating). Each thread loads its tile configuration and releases
// the tiles when its items are done.
//
// Without AMX the same packed operands feed vdpbf16ps: the B side (queries, probabilities)
// as vectors of 16 positions, one pair of d (of keys) in each lane, and the A side (K rows,
// V^T rows) one pair broadcast at a time. Scores in tiles of up to 3 heads x 8 keys (24
// accumulators; per pair of d: 3 query loads, 8 broadcasts, 24 dot products), O^T in
// tiles of up to 3 heads x 8 d (per pair of keys: 3 probability loads, 8 broadcasts).
//
// Measured against attend_prefill on the same bf16 KV and torch's bf16 flash kernel:
// runtime/dispatch.py (BF16_MIN_PAIRS).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "amx.h"
#include "ops.h"
#include "vec.h"

namespace kvtier_ops {

#ifdef __AVX512BF16__
namespace {

using namespace kvtier_vec;

constexpr int64_t kPos = kLanes;  // positions per item: the tile's columns, the lanes
constexpr int64_t kBlock = 128;   // keys per online-softmax block (a multiple of 32)
constexpr int64_t kTileKeys = 16;  // keys per score tile (its rows)
constexpr int64_t kChunk = 32;    // bf16 values of k per tdpbf16ps (64 bytes)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kNoMax = -1e30f;  // the running max before any key: finite, so 2^(m - m') is 0
constexpr float kLog2e = 1.44269504088896341f;  // scores in base 2: the queries carry it

// 16 lanes rounded to bf16 (to nearest, ties to even; finite values), in the low halves.
inline vuint round_lanes(vfloat x) {
  const vuint b = reinterpret_cast<const vuint&>(x);
  return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
}

// 2^t for a finite t <= 0 (relative error about 2.4e-6: the degree-5 Taylor polynomial
// of 2^f on |f| <= 1/2), scaled by vscalefps (huge negative t: 0). Probabilities are
// rounded to bf16 (2^-9) anyway; 6 instructions against exp_vec's 13.
inline vfloat exp2_low(vfloat t) {
  const __m512 n = _mm512_roundscale_ps(reinterpret_cast<const __m512&>(t),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vfloat f = t - reinterpret_cast<const vfloat&>(n);
  vfloat p = f * 1.3333558e-3f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.f;
  const __m512 r = _mm512_scalef_ps(reinterpret_cast<const __m512&>(p), n);
  return reinterpret_cast<const vfloat&>(r);
}

// dst[p] = bf16(even[p]) | bf16(odd[p]) << 16 for the 16 lanes (to nearest even): one
// vcvtne2ps2bf16 and one word permute.
inline void store_pairs(vfloat even, vfloat odd, uint32_t* dst) {
  alignas(64) static constexpr uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512bh both = _mm512_cvtne2ps_pbh(reinterpret_cast<const __m512&>(odd),
                                            reinterpret_cast<const __m512&>(even));
  const __m512i words = _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave),
                                                 reinterpret_cast<const __m512i&>(both));
  _mm512_storeu_si512(dst, words);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// A into tile 5 + t % 2 (alternating, so a load need not wait for the product before it
// to release its tile), then C tile t (0-3) += that A x B tile 4.
inline void load_a_dp(int t, const void* a, int64_t stride) {
  switch (t) {
    case 0: _tile_loadd(5, a, stride); _tile_dpbf16ps(0, 5, 4); break;
    case 1: _tile_loadd(6, a, stride); _tile_dpbf16ps(1, 6, 4); break;
    case 2: _tile_loadd(5, a, stride); _tile_dpbf16ps(2, 5, 4); break;
    default: _tile_loadd(6, a, stride); _tile_dpbf16ps(3, 6, 4); break;
  }
}

inline void load_c(int t, const float* p) {
  switch (t) {
    case 0: _tile_loadd(0, p, 64); break;
    case 1: _tile_loadd(1, p, 64); break;
    case 2: _tile_loadd(2, p, 64); break;
    default: _tile_loadd(3, p, 64); break;
  }
}

inline void store_c(int t, float* p) {
  switch (t) {
    case 0: _tile_stored(0, p, 64); break;
    case 1: _tile_stored(1, p, 64); break;
    case 2: _tile_stored(2, p, 64); break;
    default: _tile_stored(3, p, 64); break;
  }
}

inline void zero_c(int t) {
  switch (t) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    default: _tile_zero(3); break;
  }
}

#endif

// Whether the AMX path runs here: built for AMX (amx.h), and Linux grants the tile state.
inline bool amx_runs() { return kvtier_amx::kBuilt && kvtier_amx::granted(); }

// vdpbf16ps tiles (no AMX). Scores of RG heads x 8 keys: qp the first head's packed
// queries ([RG][dpairs][16], pairs of d per lane), k 8 key rows (stride ks), into
// s[g * kBlock + n][16].
template <int RG>
inline void dp_score_tile(const uint32_t* qp, int64_t dpairs, const uint16_t* k, int64_t ks,
                          float* s) {
  constexpr int NK = 8;
  vfloat acc[RG][NK] = {};
  for (int64_t e = 0; e < dpairs; ++e) {
    vuint q[RG];
    for (int g = 0; g < RG; ++g) q[g] = load_pairs(qp + (g * dpairs + e) * kPos);
    for (int n = 0; n < NK; ++n) {
      uint32_t word;
      std::memcpy(&word, k + n * ks + 2 * e, sizeof word);
      const __m512bh kb = splat_pair_bits(word);
      for (int g = 0; g < RG; ++g) acc[g][n] = dot_pairs(acc[g][n], q[g], kb);
    }
  }
  for (int g = 0; g < RG; ++g) {
    for (int n = 0; n < NK; ++n) store(s + (g * kBlock + n) * kPos, acc[g][n]);
  }
}

// O^T of RG heads x 8 d += V^T P^T over `pairs` pairs of keys: pp the first head's
// probabilities ([RG][kBlock / 2][16]), vt the 8 rows of V^T (stride lpad; the block's
// first key first), ot the first head's accumulators ([RG][dim][16], rows d).
template <int RG>
inline void dp_pv_tile(const uint32_t* pp, int64_t pairs, const uint16_t* vt, int64_t lpad,
                       float* ot, int64_t dim) {
  constexpr int ND = 8;
  vfloat acc[RG][ND];
  for (int g = 0; g < RG; ++g) {
    for (int d = 0; d < ND; ++d) acc[g][d] = load(ot + (g * dim + d) * kPos);
  }
  for (int64_t q = 0; q < pairs; ++q) {
    vuint p[RG];
    for (int g = 0; g < RG; ++g) p[g] = load_pairs(pp + (g * (kBlock / 2) + q) * kPos);
    for (int d = 0; d < ND; ++d) {
      uint32_t word;
      std::memcpy(&word, vt + d * lpad + 2 * q, sizeof word);
      const __m512bh vb = splat_pair_bits(word);
      for (int g = 0; g < RG; ++g) acc[g][d] = dot_pairs(acc[g][d], p[g], vb);
    }
  }
  for (int g = 0; g < RG; ++g) {
    for (int d = 0; d < ND; ++d) store(ot + (g * dim + d) * kPos, acc[g][d]);
  }
}

constexpr int64_t kDpKeys = 8;  // keys per vdpbf16ps score tile
constexpr int64_t kDpDims = 8;  // d per vdpbf16ps P.V tile
constexpr int kDpHeads = 3;     // heads per vdpbf16ps tile

// One run of keys an item attends: rows k[0 .. len) (row stride ks), their values in the
// packed V^T (vt[d * lpad + j]); own: the pass's own keys (key j visible to lane i iff
// j <= p0 + i), else all visible.
struct Run {
  const uint16_t* k;
  int64_t ks;
  const uint16_t* vt;
  int64_t lpad;
  int64_t len;
  bool own;
};

// An item's scratch (64-byte aligned, reused by the thread's later items).
struct Scratch {
  uint32_t* qp;     // [G][D/32][16 pairs][16]: the scaled, rounded queries as B
  float* s;         // [G][kBlock][16]: scores, lanes = positions
  uint32_t* pp;     // [G][kBlock/2][16]: probabilities as pairs of keys (B of P.V)
  float* ot;        // [G][D][16]: O^T accumulators
  vfloat* m;        // [G] running max
  vfloat* l;        // [G] running sum
  uint16_t* kpad;   // [16][D]: a run's last, partial tile of keys, zero-padded
};

// S^T of the block's nk keys (kb, row stride ks; the partial last tile from sc.kpad) for
// every head: sc.s. On AMX tiles of 16 keys, else vdpbf16ps tiles of 8.
template <bool kAmx>
void block_scores(const Scratch& sc, int64_t groups, int64_t dim, const uint16_t* kb,
                  int64_t ks, int64_t nk) {
  if constexpr (kAmx) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    const int64_t tiles = (nk + kTileKeys - 1) / kTileKeys, chunks = dim / kChunk;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t t0 = 0; t0 < tiles; t0 += 4) {
        const int cnt = static_cast<int>(std::min<int64_t>(4, tiles - t0));
        for (int t = 0; t < cnt; ++t) zero_c(t);
        for (int64_t c = 0; c < chunks; ++c) {
          _tile_loadd(4, sc.qp + (g * chunks + c) * kTileKeys * kPos, 64);
          for (int t = 0; t < cnt; ++t) {
            const int64_t row = (t0 + t) * kTileKeys;
            if (row + kTileKeys <= nk) {
              load_a_dp(t, kb + row * ks + c * kChunk, ks * sizeof(uint16_t));
            } else {
              load_a_dp(t, sc.kpad + c * kChunk, dim * sizeof(uint16_t));
            }
          }
        }
        for (int t = 0; t < cnt; ++t) {
          store_c(t, sc.s + (g * kBlock + (t0 + t) * kTileKeys) * kPos);
        }
      }
    }
#endif
  } else {
    const int64_t dpairs = dim / 2, full = nk - nk % kDpKeys;
    for (int64_t j = 0; j < nk; j += kDpKeys) {
      const uint16_t* kj = j < full ? kb + j * ks : sc.kpad;
      const int64_t stride = j < full ? ks : dim;
      for (int64_t g = 0; g < groups; g += kDpHeads) {
        const uint32_t* qp = sc.qp + g * dpairs * kPos;
        float* s = sc.s + (g * kBlock + j) * kPos;
        switch (std::min<int64_t>(kDpHeads, groups - g)) {
          case 3: dp_score_tile<3>(qp, dpairs, kj, stride, s); break;
          case 2: dp_score_tile<2>(qp, dpairs, kj, stride, s); break;
          default: dp_score_tile<1>(qp, dpairs, kj, stride, s); break;
        }
      }
    }
  }
}

// O^T += V^T P^T over the block's `pairs` pairs of keys (vb: V^T at the block's first key,
// row stride lpad), every head.
template <bool kAmx>
void block_pv(const Scratch& sc, int64_t groups, int64_t dim, const uint16_t* vb, int64_t lpad,
              int64_t pairs) {
  if constexpr (kAmx) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    const int64_t dtiles = dim / kTileKeys, kchunks = pairs / (kChunk / 2);
    for (int64_t g = 0; g < groups; ++g) {
      float* ot = sc.ot + g * dim * kPos;
      const uint32_t* pp = sc.pp + g * (kBlock / 2) * kPos;
      for (int64_t t0 = 0; t0 < dtiles; t0 += 4) {
        const int cnt = static_cast<int>(std::min<int64_t>(4, dtiles - t0));
        for (int t = 0; t < cnt; ++t) load_c(t, ot + (t0 + t) * kTileKeys * kPos);
        for (int64_t kc = 0; kc < kchunks; ++kc) {
          _tile_loadd(4, pp + kc * (kChunk / 2) * kPos, 64);
          for (int t = 0; t < cnt; ++t) {
            load_a_dp(t, vb + (t0 + t) * kTileKeys * lpad + kc * kChunk, lpad * sizeof(uint16_t));
          }
        }
        for (int t = 0; t < cnt; ++t) store_c(t, ot + (t0 + t) * kTileKeys * kPos);
      }
    }
#endif
  } else {
    for (int64_t g = 0; g < groups; g += kDpHeads) {
      const uint32_t* pp = sc.pp + g * (kBlock / 2) * kPos;
      for (int64_t d = 0; d < dim; d += kDpDims) {
        float* ot = sc.ot + (g * dim + d) * kPos;
        const uint16_t* vt = vb + d * lpad;
        switch (std::min<int64_t>(kDpHeads, groups - g)) {
          case 3: dp_pv_tile<3>(pp, pairs, vt, lpad, ot, dim); break;
          case 2: dp_pv_tile<2>(pp, pairs, vt, lpad, ot, dim); break;
          default: dp_pv_tile<1>(pp, pairs, vt, lpad, ot, dim); break;
        }
      }
    }
  }
}

template <bool kAmx>
void attend_block(const Scratch& sc, int64_t groups, int64_t dim, const Run& run, int64_t j0,
                  int64_t p0) {
  const int64_t nk = std::min(kBlock, run.len - j0);
  const int64_t tile_keys = kAmx ? kTileKeys : kDpKeys;
  const uint16_t* kb = run.k + j0 * run.ks;
  if (nk % tile_keys != 0) {  // the last tile's rows past the run: zeros, not the next keys
    const int64_t full = nk - nk % tile_keys;
    std::memset(sc.kpad, 0, tile_keys * dim * sizeof(uint16_t));
    for (int64_t j = full; j < nk; ++j) {
      std::memcpy(sc.kpad + (j - full) * dim, kb + j * run.ks, dim * sizeof(uint16_t));
    }
  }
  // 1. scores, every query head of the group
  block_scores<kAmx>(sc, groups, dim, kb, run.ks, nk);
  // 2. online softmax per lane; probabilities as pairs of keys, zero past the block
  const int64_t pairs = (nk + kChunk - 1) / kChunk * (kChunk / 2);
  const bool masked = run.own && j0 + nk - 1 > p0;
  const vfloat lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t g = 0; g < groups; ++g) {
    float* s = sc.s + g * kBlock * kPos;
    vfloat top[4] = {splat(kNegInf), splat(kNegInf), splat(kNegInf), splat(kNegInf)};
    for (int64_t j = 0; j < nk; ++j) {  // 4 chains: one vmaxps waits 4 cycles for the last
      vfloat x = load(s + j * kPos);
      if (masked) {
        x = lane >= static_cast<float>(j0 + j - p0) ? x : splat(kNegInf);
        store(s + j * kPos, x);
      }
      top[j % 4] = vmax(top[j % 4], x);
    }
    const vfloat bmax = vmax(vmax(top[0], top[1]), vmax(top[2], top[3]));
    const vfloat m_new = vmax(sc.m[g], bmax);  // finite: a run's key 0 is seen by every lane
    const vfloat alpha = exp2_low(sc.m[g] - m_new);
    vfloat sum{};
    uint32_t* pp = sc.pp + g * (kBlock / 2) * kPos;
    for (int64_t q = 0; q < pairs; ++q) {
      vfloat p[2];
      for (int i = 0; i < 2; ++i) {
        const int64_t j = 2 * q + i;
        if (j < nk) {
          const vfloat x = load(s + j * kPos);
          p[i] = exp2_low(x - m_new);  // masked keys (x = -inf: NaN here) weigh 0 below
          if (masked) p[i] = x == kNegInf ? vfloat{} : p[i];
        } else {
          p[i] = vfloat{};
        }
      }
      sum += p[0] + p[1];
      store_pairs(p[0], p[1], pp + q * kPos);
    }
    sc.l[g] = sc.l[g] * alpha + sum;
    sc.m[g] = m_new;
    float* ot = sc.ot + g * dim * kPos;
    for (int64_t d = 0; d < dim; ++d) store(ot + d * kPos, load(ot + d * kPos) * alpha);
  }
  // 3. O^T += V^T P^T
  block_pv<kAmx>(sc, groups, dim, run.vt + j0, run.lpad, pairs);
}

// vt [Hkv][D][lpad] = V^T of v [Hkv, len, D] (bf16 bits; zeros past len).
void pack_vt(const at::Tensor& v, int64_t lpad, uint16_t* vt) {
  const int64_t heads = v.size(0), len = v.size(1), dim = v.size(2);
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  at::parallel_for(0, heads * (dim / kTileKeys), 1, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) {
      const int64_t h = x / (dim / kTileKeys), d0 = x % (dim / kTileKeys) * kTileKeys;
      const uint16_t* src = vp + h * v.stride(0);
      uint16_t* dst = vt + (h * dim + d0) * lpad;
      for (int64_t j = 0; j < len; ++j) {
        const uint16_t* row = src + j * v.stride(1) + d0;
        for (int64_t d = 0; d < kTileKeys; ++d) dst[d * lpad + j] = row[d];
      }
      for (int64_t d = 0; d < kTileKeys; ++d) std::fill(dst + d * lpad + len, dst + (d + 1) * lpad, 0);
    }
  });
}

template <bool kAmx>
void attend_items(const at::Tensor& query, const at::Tensor& k_old, const at::Tensor& v_old,
                  const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& out,
                  double scale) {
  const int64_t dim = query.size(2);
  const int64_t hq = query.size(0), len = query.size(1), hkv = k_new.size(0);
  const int64_t groups = hq / hkv, old_len = k_old.size(1), pre = k_new.size(1) - len;
  const int64_t lpad_old = (old_len + kChunk - 1) / kChunk * kChunk + kChunk;
  const int64_t lpad_new = (pre + len + kChunk - 1) / kChunk * kChunk + kChunk;
  // V^T buffers, uninitialised: pack_vt writes every element, the pads included
  const at::Tensor vt_old_buf = at::empty({old_len > 0 ? hkv * dim * lpad_old : 0},
                                          v_old.options());
  const at::Tensor vt_new_buf = at::empty({hkv * dim * lpad_new}, v_new.options());
  auto* vt_old = reinterpret_cast<uint16_t*>(vt_old_buf.data_ptr<at::BFloat16>());
  auto* vt_new = reinterpret_cast<uint16_t*>(vt_new_buf.data_ptr<at::BFloat16>());
  if (old_len > 0) pack_vt(v_old, lpad_old, vt_old);
  pack_vt(v_new, lpad_new, vt_new);
  const auto* kop = reinterpret_cast<const uint16_t*>(k_old.data_ptr<at::BFloat16>());
  const auto* knp = reinterpret_cast<const uint16_t*>(k_new.data_ptr<at::BFloat16>());
  const float* qp = query.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale) * kLog2e;
  const int64_t blocks = (len + kPos - 1) / kPos, items = blocks * hkv;
  const int64_t chunks = dim / kChunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    thread_local std::vector<float> buffer;
    const size_t floats = groups * (chunks * kTileKeys * kPos + kBlock * kPos +
                                    kBlock / 2 * kPos + dim * kPos + 2 * kPos) +
                          kTileKeys * dim / 2 + 2 * kLanes;
    if (buffer.size() < floats) buffer.resize(floats);
    float* base = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
    Scratch scr{};
    scr.qp = reinterpret_cast<uint32_t*>(base);
    scr.s = base + groups * chunks * kTileKeys * kPos;
    scr.pp = reinterpret_cast<uint32_t*>(scr.s + groups * kBlock * kPos);
    scr.ot = reinterpret_cast<float*>(scr.pp + groups * kBlock / 2 * kPos);
    scr.m = reinterpret_cast<vfloat*>(scr.ot + groups * dim * kPos);
    scr.l = scr.m + groups;
    scr.kpad = reinterpret_cast<uint16_t*>(scr.l + groups);
    bool configured = false;
    for (int64_t item = next++; item < items; item = next++) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (kAmx && !configured) {
        kvtier_amx::configure_full();
        configured = true;
      }
#endif
      const int64_t block = blocks - 1 - item / hkv, h = item % hkv;  // longest first
      const int64_t p0 = block * kPos, np = std::min(kPos, len - p0);
      // queries: qp[g][c][k2][p] = the pair (2 k2, 2 k2 + 1) of chunk c of position p
      for (int64_t g = 0; g < groups; ++g) {
        const float* src = qp + (h * groups + g) * query.stride(0) + p0 * query.stride(1);
        uint32_t* dst = scr.qp + g * chunks * kTileKeys * kPos;
        for (int64_t c = 0; c < chunks; ++c) {
          // rows[p][k2]: position p's 32 values of chunk c as 16 pairs, then transposed
          alignas(64) uint16_t rows[kPos][kChunk] = {};
          for (int64_t p = 0; p < np; ++p) {
            const float* row = src + p * query.stride(1) + c * kChunk;
            for (int64_t half = 0; half < 2; ++half) {
              const vhalf bits = __builtin_convertvector(
                  round_lanes(load(row + half * kLanes) * sc), vhalf);
              std::memcpy(rows[p] + half * kLanes, &bits, sizeof bits);
            }
          }
          for (int64_t k2 = 0; k2 < kTileKeys; ++k2) {
            for (int64_t p = 0; p < kPos; ++p) {
              uint32_t word;
              std::memcpy(&word, rows[p] + 2 * k2, sizeof word);
              dst[(c * kTileKeys + k2) * kPos + p] = word;
            }
          }
        }
        scr.m[g] = splat(kNoMax);
        scr.l[g] = vfloat{};
      }
      std::fill_n(scr.ot, groups * dim * kPos, 0.f);
      const Run runs[3] = {
          {kop + h * k_old.stride(0), k_old.stride(1), vt_old + h * dim * lpad_old,
           lpad_old, old_len, false},
          {knp + h * k_new.stride(0), k_new.stride(1), vt_new + h * dim * lpad_new,
           lpad_new, pre, false},
          {knp + h * k_new.stride(0) + pre * k_new.stride(1), k_new.stride(1),
           vt_new + h * dim * lpad_new + pre, lpad_new, p0 + np, true},
      };
      for (const Run& run : runs) {
        for (int64_t j0 = 0; j0 < run.len; j0 += kBlock) {
          attend_block<kAmx>(scr, groups, dim, run, j0, p0);
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        const float* ot = scr.ot + g * dim * kPos;
        const vfloat inv = 1.f / scr.l[g];
        for (int64_t p = 0; p < np; ++p) {
          float* dst = op + (p0 + p) * out.stride(0) + (h * groups + g) * out.stride(1);
          for (int64_t d = 0; d < dim; ++d) dst[d] = ot[d * kPos + p] * inv[p];
        }
      }
    }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (configured) _tile_release();
#endif
  });
}

}  // namespace

const char* bf16_prefill_units() { return amx_runs() ? "amx" : "avx512_bf16"; }

bool attend_prefill_bf16(const at::Tensor& query, const at::Tensor& k_old,
                         const at::Tensor& v_old, const at::Tensor& k_new,
                         const at::Tensor& v_new, const at::Tensor& out, double scale) {
  if (query.size(2) % kChunk != 0) return false;
  if (amx_runs()) {
    attend_items<true>(query, k_old, v_old, k_new, v_new, out, scale);
  } else {
    attend_items<false>(query, k_old, v_old, k_new, v_new, out, scale);
  }
  return true;
}
#else
const char* bf16_prefill_units() { return ""; }

bool attend_prefill_bf16(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const at::Tensor&, const at::Tensor&, double) {
  return false;
}
#endif

}  // namespace kvtier_ops

namespace {

// The op: attend_prefill's checks, then the kernel; whether it ran.
bool attend_prefill_bf16_op(const at::Tensor& query, const at::Tensor& k_old,
                           const at::Tensor& v_old, const at::Tensor& k_new,
                           const at::Tensor& v_new, const at::Tensor& out, double scale) {
  kvtier_ops::check_prefill(query, k_old, v_old, k_new, v_new, out);
  TORCH_CHECK(k_new.scalar_type() == at::kBFloat16, "attend_prefill_bf16: K/V must be bfloat16");
  if (query.size(1) == 0) return true;
  return kvtier_ops::attend_prefill_bf16(query, k_old, v_old, k_new, v_new, out, scale);
}

// What attend_prefill_bf16 multiplies on here: "amx", "avx512_bf16", or "" (it does not run).
std::string bf16_prefill() { return kvtier_ops::bf16_prefill_units(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtier_cpu, m) {
  m.def(
      "attend_prefill_bf16(Tensor query, Tensor k_old, Tensor v_old, Tensor k_new, "
      "Tensor v_new, Tensor(a!) out, float scale) -> bool");
  m.def("bf16_prefill() -> str", &bf16_prefill);
}

TORCH_LIBRARY_IMPL(kvtier_cpu, CPU, m) { m.impl("attend_prefill_bf16", &attend_prefill_bf16_op); }

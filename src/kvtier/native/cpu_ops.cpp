// kvtier's hand-written CPU operators (float32 arithmetic; the attention kernels also read
// bfloat16 KV, on bf16 dot products where the CPU has them), registered as
// torch.ops.kvtier_cpu.*.
//
// Built once per machine by kvtier.native (torch.utils.cpp_extension, cached on disk).
// Every operator checks its inputs and raises a c10::Error (a Python RuntimeError) on a
// mismatch; the Python side only calls them on float32 CPU tensors of the shapes below.
// Threads: kvtier_pool (pool.h): a decode step's few rows on kvtier's helpers, more on torch's pool.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "pool.h"
#include "vec.h"

namespace {

using namespace kvtier_vec;

constexpr int64_t kBlockTokens = 256;  // keys per work item of the decode attention
constexpr int64_t kSerialKeys = 4096;  // fewer keys in a call: one thread

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// dst[j] = silu(gate[j]) * up[j] = gate[j] / (1 + exp(-gate[j])) * up[j].
void silu_mul_row(const float* gate, const float* up, float* dst, int64_t n) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const vfloat g = load(gate + j);
    store(dst + j, g / (1.f + exp_vec(-g)) * load(up + j));
  }
  for (; j < n; ++j) dst[j] = gate[j] / (1.f + exp_scalar(-gate[j])) * up[j];
}

// One work item: G queries q [G, D] over len keys k, v [len, D] (contiguous rows).
// res [G, D + 2]: per query the max score, the sum of exp(score - max) and the weighted
// values; scores [G, kBlockTokens] is scratch.
void attend_block_any(int64_t groups, int64_t dim, const float* q, const float* k,
                      const float* v, int64_t len, float scale, float* scores, float* res) {
  const int64_t part = dim + 2;
  for (int64_t j = 0; j < len; ++j) {
    for (int64_t g = 0; g < groups; ++g) {
      scores[g * kBlockTokens + j] = dot(q + g * dim, k + j * dim, dim) * scale;
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    float* s = scores + g * kBlockTokens;
    const float m = max_of(s, len);
    res[g * part] = m;
    res[g * part + 1] = exp_shifted(s, len, m);
    std::fill_n(res + g * part + 2, dim, 0.f);
  }
  for (int64_t j = 0; j < len; ++j) {
    for (int64_t g = 0; g < groups; ++g) {
      float* acc = res + g * part + 2;
      const float p = scores[g * kBlockTokens + j];
      const float* vj = v + j * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) acc[d] += p * vj[d];
    }
  }
}


// attend_block_any for a head dim and group count known at compile time: the queries and
// the G x D/16 output accumulators live in vector registers; K and V are read once.
// T: the KV elements, float or bf16 bit patterns (uint16_t), widened as they are loaded.
template <int D, int G, typename T>
void attend_block_fixed(const float* q, const T* k, const T* v, int64_t len,
                        float scale, float* scores, float* res) {
  constexpr int C = D / kLanes;
  vfloat qv[G][C];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) qv[g][c] = load(q + g * D + c * kLanes) * scale;
  }
  int64_t j = 0;
  for (; j + kLanes <= len; j += kLanes) {  // 16 keys: their scores summed together
    const float* keys = nullptr;  // the 16 keys as float32
    alignas(64) float wide[std::is_same_v<T, float> ? 1 : kLanes * D];
    if constexpr (std::is_same_v<T, float>) {
      keys = k + j * D;
    } else {  // widened once into L1, not once per query of the group (2.5x the loads' uops)
      for (int64_t x = 0; x < kLanes * D; x += kLanes) store(wide + x, load_kv(k + j * D + x));
      keys = wide;
    }
    for (int g = 0; g < G; ++g) {
      vfloat acc[kLanes];
      for (int64_t t = 0; t < kLanes; ++t) {
        const float* kt = keys + t * D;
        acc[t] = qv[g][0] * load(kt);
        for (int c = 1; c < C; ++c) acc[t] += qv[g][c] * load(kt + c * kLanes);
      }
      store(scores + g * kBlockTokens + j, lane_sums16(acc));
    }
  }
  for (; j < len; ++j) {
    vfloat kr[C];
    for (int c = 0; c < C; ++c) kr[c] = load_kv(k + j * D + c * kLanes);
    for (int g = 0; g < G; ++g) {
      vfloat acc = qv[g][0] * kr[0];
      for (int c = 1; c < C; ++c) acc += qv[g][c] * kr[c];
      scores[g * kBlockTokens + j] = lane_sum(acc);
    }
  }
  float m[G];
  for (int g = 0; g < G; ++g) {
    float* s = scores + g * kBlockTokens;
    m[g] = max_of(s, len);
    res[g * (D + 2)] = m[g];
    res[g * (D + 2) + 1] = exp_shifted(s, len, m[g]);
  }
  vfloat o[G][C] = {};
  for (int64_t j = 0; j < len; ++j) {
    vfloat vr[C];
    for (int c = 0; c < C; ++c) vr[c] = load_kv(v + j * D + c * kLanes);
    for (int g = 0; g < G; ++g) {
      const float p = scores[g * kBlockTokens + j];
      for (int c = 0; c < C; ++c) o[g][c] += p * vr[c];
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) store(res + g * (D + 2) + 2 + c * kLanes, o[g][c]);
  }
}

#ifdef __AVX512BF16__
inline __m512bh load_bh(const uint16_t* p) {  // 32 bf16 patterns, unaligned
  const __m512i x = _mm512_loadu_si512(p);
  return reinterpret_cast<const __m512bh&>(x);
}

// attend_block_fixed's contract for bf16 K/V on AVX-512 BF16's vdpbf16ps (kvtier's bf16
// mode, as attend_prefill_bf16): the queries, times the scale, and the probabilities are
// rounded to bf16; scores, softmax and sums are float32 (the sum of the unrounded
// probabilities). Scores: per key and query, D/32 dot products of its row with the query
// (lane l sums the pair of d 2l, 2l + 1), then 16 keys' lanes summed together. P.V: per
// pair of keys, their value rows interleaved (vpunpck{l,h}wd: each 32-bit lane a pair of
// keys at one d) against the pair of probabilities broadcast, so V is read as stored;
// each accumulator holds 16 d in the unpacks' order, put back in order (vpermt2ps) at the
// end. Half the instructions of the widening kernel: a layer of 16 rows x 544 keys in
// cache took 0.12-0.15 ms against 0.24 (2-core AMD EPYC).
template <int D, int G>
void attend_block_dots(const float* q, const uint16_t* k, const uint16_t* v, int64_t len,
                       float scale, float* scores, float* res) {
  constexpr int C = D / 32;  // vectors of 32 bf16 in a row
  __m512bh qv[G][C];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) {
      const vfloat lo = load(q + g * D + c * 32) * scale;
      const vfloat hi = load(q + g * D + c * 32 + kLanes) * scale;
      qv[g][c] = _mm512_cvtne2ps_pbh(reinterpret_cast<const __m512&>(hi),
                                     reinterpret_cast<const __m512&>(lo));
    }
  }
  auto score = [&](int g, const uint16_t* row) {  // 16 lanes summing to row . q[g]
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), load_bh(row), qv[g][0]);
    for (int c = 1; c < C; ++c) a = _mm512_dpbf16_ps(a, load_bh(row + c * 32), qv[g][c]);
    return a;
  };
  int64_t j = 0;
  for (; j + kLanes <= len; j += kLanes) {
    for (int g = 0; g < G; ++g) {
      vfloat acc[kLanes];
      for (int64_t t = 0; t < kLanes; ++t) {
        const __m512 a = score(g, k + (j + t) * D);
        acc[t] = reinterpret_cast<const vfloat&>(a);
      }
      store(scores + g * kBlockTokens + j, lane_sums16(acc));
    }
  }
  for (; j < len; ++j) {
    for (int g = 0; g < G; ++g) scores[g * kBlockTokens + j] = _mm512_reduce_add_ps(score(g, k + j * D));
  }
  alignas(64) uint16_t probs[G][kBlockTokens + 2];  // bf16; an odd last key's partner 0
  for (int g = 0; g < G; ++g) {
    float* s = scores + g * kBlockTokens;
    const float m = max_of(s, len);
    res[g * (D + 2)] = m;
    res[g * (D + 2) + 1] = exp_shifted(s, len, m);
    round_bf16(s, len, probs[g]);
    probs[g][len] = 0;
  }
  __m512 o[G][2 * C];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < 2 * C; ++c) o[g][c] = _mm512_setzero_ps();
  }
  for (j = 0; j < len; j += 2) {
    __m512i lo[C], hi[C];
    for (int c = 0; c < C; ++c) {
      const __m512i a = _mm512_loadu_si512(v + j * D + c * 32);
      const __m512i b =
          j + 1 < len ? _mm512_loadu_si512(v + (j + 1) * D + c * 32) : _mm512_setzero_si512();
      lo[c] = _mm512_unpacklo_epi16(a, b);
      hi[c] = _mm512_unpackhi_epi16(a, b);
    }
    for (int g = 0; g < G; ++g) {
      uint32_t word;  // probabilities j (low half) and j + 1
      std::memcpy(&word, probs[g] + j, sizeof word);
      const __m512bh p = splat_pair_bits(word);
      for (int c = 0; c < C; ++c) {
        o[g][2 * c] = _mm512_dpbf16_ps(o[g][2 * c], reinterpret_cast<const __m512bh&>(lo[c]), p);
        o[g][2 * c + 1] =
            _mm512_dpbf16_ps(o[g][2 * c + 1], reinterpret_cast<const __m512bh&>(hi[c]), p);
      }
    }
  }
  // lane 4 L + i of a low unpack holds d = 8 L + i of its 32, of a high one 8 L + 4 + i
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int g = 0; g < G; ++g) {
    float* dst = res + g * (D + 2) + 2;
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(dst + c * 32, _mm512_permutex2var_ps(o[g][2 * c], first, o[g][2 * c + 1]));
      _mm512_storeu_ps(dst + c * 32 + kLanes,
                       _mm512_permutex2var_ps(o[g][2 * c], second, o[g][2 * c + 1]));
    }
  }
}
#endif

// attend_block_fixed (float32 K/V; bf16 K/V without AVX-512 BF16) or attend_block_dots
// (bf16 K/V with it) for G queries a KV head.
template <int D, int G, typename T>
void attend_block_g(const float* q, const T* k, const T* v, int64_t len, float scale,
                    float* scores, float* res) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, uint16_t>) {
    attend_block_dots<D, G>(q, k, v, len, scale, scores, res);
    return;
  }
#endif
  attend_block_fixed<D, G, T>(q, k, v, len, scale, scores, res);
}

template <int D, typename T>
bool attend_block_dim(int64_t groups, const float* q, const T* k, const T* v,
                      int64_t len, float scale, float* scores, float* res) {
  switch (groups) {
    case 1: attend_block_g<D, 1, T>(q, k, v, len, scale, scores, res); return true;
    case 2: attend_block_g<D, 2, T>(q, k, v, len, scale, scores, res); return true;
    case 3: attend_block_g<D, 3, T>(q, k, v, len, scale, scores, res); return true;
    case 4: attend_block_g<D, 4, T>(q, k, v, len, scale, scores, res); return true;
    case 5: attend_block_g<D, 5, T>(q, k, v, len, scale, scores, res); return true;
    case 6: attend_block_g<D, 6, T>(q, k, v, len, scale, scores, res); return true;
    case 7: attend_block_g<D, 7, T>(q, k, v, len, scale, scores, res); return true;
    case 8: attend_block_g<D, 8, T>(q, k, v, len, scale, scores, res); return true;
    default: return false;
  }
}

// One work item (attend_block_any's contract) over float32 or bf16 (uint16_t) keys and
// values. bf16 with head dim 64 or 128 and at most 8 queries a KV head, on a CPU with
// AVX-512 BF16: attend_block_dots (queries and probabilities rounded to bf16); any other
// bf16 case widens the rows into scratch (float32 arithmetic). The item's K and V rows are
// first staged into L2 (vec.h's stage; at most 2 x 256 rows of D, 128 KiB with D = 64 in
// float32), and the kernels read them with no prefetches of their own. Per-step
// alternation in one engine (2-core AMD EPYC, 16 rows of 512 + 64 tokens, against the
// kernels' earlier prefetches 16 keys ahead): float32 steps 45.7 / 48.1 / 45.3 -> 43.5 /
// 44.4 / 43.1 ms, bf16 27.0 / 29.5 / 25.7 -> 26.4 / 28.6 / 24.9; one row of 4,000 + 64
// tokens: float32 30.0 / 24.0 / 26.2 -> 28.4 / 22.3 / 24.3, bf16 15.2 / 17.4 / 17.4 ->
// 14.8 / 16.5 / 16.2.
template <typename T>
void attend_block(int64_t groups, int64_t dim, const float* q, const T* k, const T* v,
                  int64_t len, float scale, float* scores, float* res) {
  stage(k, v, len * dim * static_cast<int64_t>(sizeof(T)));  // K and V into L2 first
  const bool fixed =
      (dim == 64 && attend_block_dim<64>(groups, q, k, v, len, scale, scores, res)) ||
      (dim == 128 && attend_block_dim<128>(groups, q, k, v, len, scale, scores, res));
  if (fixed) return;
  if constexpr (std::is_same_v<T, float>) {
    attend_block_any(groups, dim, q, k, v, len, scale, scores, res);
  } else {
    thread_local std::vector<float> wide;
    wide.resize(2 * len * dim);
    widen_bf16(k, len * dim, wide.data());
    widen_bf16(v, len * dim, wide.data() + len * dim);
    attend_block_any(groups, dim, q, wide.data(), wide.data() + len * dim, len, scale, scores,
                     res);
  }
}

struct Item {  // one decode row, one KV head, one run of at most kBlockTokens keys
  int64_t row, head, start, len;
};

// Merges, per row r and query head, the partial results (max, sum, weighted values [D]
// per query of the group) of the row's items first[r] .. first[r+1]-1 whose KV head is
// head_of(i); writes out[out_row[r], head] (normalised) and, when lse is given,
// lse[out_row[r] * q_heads + head] = max + log(sum).
template <typename HeadOf>
void merge_rows(int64_t num_rows, const std::vector<int64_t>& first, HeadOf head_of,
                const std::vector<float>& partial, int64_t groups, int64_t dim,
                int64_t q_heads, const int64_t* out_row, const at::Tensor& out, float* lse,
                bool threads) {
  const int64_t part = dim + 2;
  float* op = out.data_ptr<float>();
  const int64_t merges = num_rows * q_heads;
  kvtier_pool::parallel_for(0, merges, threads ? 1 : std::max<int64_t>(merges, 1),
                   [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) {
      const int64_t r = x / q_heads, hq = x % q_heads, h = hq / groups, g = hq % groups;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t i = first[r]; i < first[r + 1]; ++i) {
        if (head_of(i) == h) m = std::max(m, partial[(i * groups + g) * part]);
      }
      float* dst = op + out_row[r] * out.stride(0) + hq * out.stride(1);
      std::fill_n(dst, dim, 0.f);
      float total = 0.f;
      for (int64_t i = first[r]; i < first[r + 1]; ++i) {
        if (head_of(i) != h) continue;
        const float* res = partial.data() + (i * groups + g) * part;
        const float w = exp_scalar(res[0] - m);
        total += w * res[1];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) dst[d] += w * res[2 + d];
      }
      const float inv = 1.f / total;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) dst[d] *= inv;
      if (lse != nullptr) lse[out_row[r] * q_heads + hq] = m + std::log(total);
    }
  });
}

}  // namespace

namespace kvtier_ops {

using namespace kvtier_vec;

// decode_attend's work on a checked slab of T (float, or bf16 bit patterns: the new K/V
// rounded to nearest even as they are stored, every key widened as it is read).
template <typename T>
void decode_attend_slab(T* base, const at::Tensor& slab, int64_t layer, const int64_t* seat_p,
                        const int64_t* tail_p, const int64_t* lo_p, const int64_t* hi_p,
                        const int64_t* row_p, int64_t num_rows, const at::Tensor& query,
                        const at::Tensor& new_k, const at::Tensor& new_v, const at::Tensor& out,
                        const std::optional<at::Tensor>& lse, double scale) {
  const int64_t num_layers = slab.size(1), kv_heads = slab.size(3);
  const int64_t keys = slab.size(4) * slab.size(5), dim = slab.size(6);
  const int64_t q_heads = query.size(0), groups = q_heads / kv_heads;
  // K of (seat, head): base + kv_offset(seat, 0, head); V: kv_offset(seat, 1, head).
  auto kv_offset = [&](int64_t seat, int64_t kv, int64_t head) {
    return (((seat * num_layers + layer) * 2 + kv) * kv_heads + head) * keys * dim;
  };
  // 1. the new tokens into their tails.
  const float* nk = new_k.data_ptr<float>();
  const float* nv = new_v.data_ptr<float>();
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t src_k = h * new_k.stride(0) + row_p[r] * new_k.stride(1);
      const int64_t src_v = h * new_v.stride(0) + row_p[r] * new_v.stride(1);
      store_kv(nk + src_k, dim, base + kv_offset(seat_p[r], 0, h) + tail_p[r] * dim);
      store_kv(nv + src_v, dim, base + kv_offset(seat_p[r], 1, h) + tail_p[r] * dim);
    }
  }
  // 2. work items: each row's visible keys in runs of at most kBlockTokens, per head.
  std::vector<Item> items;
  std::vector<int64_t> first(num_rows + 1);  // items of row r: first[r] .. first[r+1]-1
  for (int64_t r = 0; r < num_rows; ++r) {
    first[r] = static_cast<int64_t>(items.size());
    const int64_t ranges[2][2] = {{0, tail_p[r] + 1}, {lo_p[r], hi_p[r]}};
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (const auto& range : ranges) {
        for (int64_t s = range[0]; s < range[1]; s += kBlockTokens) {
          items.push_back({r, h, s, std::min(kBlockTokens, range[1] - s)});
        }
      }
    }
  }
  first[num_rows] = static_cast<int64_t>(items.size());
  const int64_t num_items = first[num_rows];
  const int64_t part = dim + 2;  // per item and query: max, sum, weighted values [D]
  std::vector<float> partial(num_items * groups * part);
  const float* qp = query.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // Threads only pay off past a few thousand keys (waking them costs tens of microseconds).
  int64_t total_keys = 0;
  for (const Item& it : items) total_keys += it.len;
  const int64_t grain = total_keys < kSerialKeys ? std::max<int64_t>(num_items, 1) : 1;
  kvtier_pool::parallel_for(0, num_items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> q(groups * dim), scores(groups * kBlockTokens);
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      for (int64_t g = 0; g < groups; ++g) {
        const float* src =
            qp + (it.head * groups + g) * query.stride(0) + row_p[it.row] * query.stride(1);
        std::copy_n(src, dim, q.data() + g * dim);
      }
      const T* k = base + kv_offset(seat_p[it.row], 0, it.head) + it.start * dim;
      const T* v = base + kv_offset(seat_p[it.row], 1, it.head) + it.start * dim;
      float* res = partial.data() + i * groups * part;
      attend_block(groups, dim, q.data(), k, v, it.len, fscale, scores.data(), res);
    }
  });
  // 3. merge each row's items per query head and write the output row.
  float* lse_p = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  merge_rows(num_rows, first, [&](int64_t i) { return items[i].head; }, partial, groups, dim,
             q_heads, row_p, out, lse_p, grain == 1);
}

// decode_attend: the one-token attention of every decoding seat of one layer.
//
// slab [seats, L, 2, H, 1 + S, T, D] (contiguous; float32, or bfloat16: the new K/V are
// rounded to it, to nearest even; where the CPU has AVX-512 BF16 the queries and the
// probabilities are rounded too and both products run on vdpbf16ps, as in
// attend_prefill_bf16, else keys are widened exactly as they are read and the arithmetic
// is float32; see attend_block): slot 0 of a seat's row is its tail, slots 1..S its pool. For decode row r (seat seats[r], step row rows[r]) the new key and
// value (new_k/new_v[h, rows[r]]) are first stored at tail position tail_pos[r]; the row
// then attends to tail tokens 0..tail_pos[r] and to the pool range [lo[r], hi[r]) of the
// same [(1 + S) T] key axis. query [Hq, N, D] and out [N, Hq, D] may be strided (the last
// dim contiguous); out[rows[r]] is written, nothing else. Softmax in float32: each
// block's max, sum and weighted values, merged per row with the max of the maxima. With
// lse [N, Hq] (contiguous), lse[rows[r]] gets each row's log-sum-exp too, so the output
// merges exactly with attention over keys elsewhere (the host pool).
void decode_attend(const at::Tensor& slab, int64_t layer, const at::Tensor& seats,
                   const at::Tensor& tail_pos, const at::Tensor& lo, const at::Tensor& hi,
                   const at::Tensor& rows, const at::Tensor& query, const at::Tensor& new_k,
                   const at::Tensor& new_v, const at::Tensor& out,
                   const std::optional<at::Tensor>& lse, double scale) {
  TORCH_CHECK(slab.dim() == 7 && slab.is_contiguous() &&
                  (slab.scalar_type() == at::kFloat || slab.scalar_type() == at::kBFloat16),
              "decode_attend: slab must be a contiguous float32 or bfloat16 "
              "[seats, L, 2, H, 1+S, T, D]");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && new_k.dim() == 3 && new_v.dim() == 3,
              "decode_attend: query [Hq, N, D], out [N, Hq, D], new_k/new_v [Hkv, N, D]");
  for (const at::Tensor* t : {&query, &out, &new_k, &new_v}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->stride(2) == 1,
                "decode_attend: float32 tensors with a contiguous last dim");
  }
  for (const at::Tensor* t : {&seats, &tail_pos, &lo, &hi, &rows}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1 &&
                    t->size(0) == seats.size(0),
                "decode_attend: seats, tail_pos, lo, hi, rows: contiguous int64 [R]");
  }
  const int64_t num_layers = slab.size(1), kv_heads = slab.size(3);
  const int64_t keys = slab.size(4) * slab.size(5), dim = slab.size(6);
  const int64_t q_heads = query.size(0), groups = q_heads / kv_heads;
  TORCH_CHECK(layer >= 0 && layer < num_layers, "decode_attend: layer out of range");
  TORCH_CHECK(q_heads == groups * kv_heads && query.size(2) == dim && out.size(2) == dim &&
                  out.size(1) == q_heads && new_k.size(0) == kv_heads &&
                  new_v.size(0) == kv_heads && new_k.size(2) == dim && new_v.size(2) == dim,
              "decode_attend: head counts or head dim do not match the slab");
  if (lse.has_value()) {
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->is_contiguous() && lse->dim() == 2 &&
                    lse->size(0) == out.size(0) && lse->size(1) == q_heads,
                "decode_attend: lse must be a contiguous float32 [N, Hq]");
  }
  const int64_t num_rows = seats.size(0);
  const int64_t* seat_p = seats.data_ptr<int64_t>();
  const int64_t* tail_p = tail_pos.data_ptr<int64_t>();
  const int64_t* lo_p = lo.data_ptr<int64_t>();
  const int64_t* hi_p = hi.data_ptr<int64_t>();
  const int64_t* row_p = rows.data_ptr<int64_t>();
  const int64_t tokens = slab.size(5);
  for (int64_t r = 0; r < num_rows; ++r) {
    TORCH_CHECK(seat_p[r] >= 0 && seat_p[r] < slab.size(0), "decode_attend: seat out of range");
    TORCH_CHECK(tail_p[r] >= 0 && tail_p[r] < tokens, "decode_attend: tail position out of range");
    TORCH_CHECK(lo_p[r] >= tokens && lo_p[r] <= hi_p[r] && hi_p[r] <= keys,
                "decode_attend: pool range out of the seat's slots");
    TORCH_CHECK(row_p[r] >= 0 && row_p[r] < query.size(1) && row_p[r] < out.size(0) &&
                    row_p[r] < new_k.size(1),
                "decode_attend: row out of range");
  }
  if (slab.scalar_type() == at::kBFloat16) {
    decode_attend_slab(reinterpret_cast<uint16_t*>(slab.data_ptr<at::BFloat16>()), slab, layer,
                       seat_p, tail_p, lo_p, hi_p, row_p, num_rows, query, new_k, new_v, out,
                       lse, scale);
  } else {
    decode_attend_slab(slab.data_ptr<float>(), slab, layer, seat_p, tail_p, lo_p, hi_p, row_p,
                       num_rows, query, new_k, new_v, out, lse, scale);
  }
}



// attend_slots: queries of one sequence over whole chunks in a slot-major pool, where
// they lie (no gather). pool [slots, L, 2, H, T, D] (contiguous; float32 or bfloat16, as
// decode_attend reads its slab), slots [n] int64: the
// chunks; query [Hq, N, D], out [N, Hq, D] (last dims contiguous), lse [N, Hq]
// (contiguous) written: out = softmax(q k^T scale) v over every key of the chunks (no
// mask: the chunks precede the queries), lse its log-sum-exp, to merge with other
// segments. Work items (query, KV head, run of at most kBlockTokens keys of one chunk).
void attend_slots(const at::Tensor& pool, int64_t layer, const at::Tensor& slots,
                  const at::Tensor& query, const at::Tensor& out, const at::Tensor& lse,
                  double scale) {
  TORCH_CHECK(pool.dim() == 6 && pool.is_contiguous() &&
                  (pool.scalar_type() == at::kFloat || pool.scalar_type() == at::kBFloat16),
              "attend_slots: pool must be a contiguous float32 or bfloat16 [slots, L, 2, H, T, D]");
  TORCH_CHECK(slots.dim() == 1 && slots.is_contiguous() && slots.scalar_type() == at::kLong,
              "attend_slots: slots must be a contiguous int64 [n]");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && query.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat && query.stride(2) == 1 && out.stride(2) == 1,
              "attend_slots: query [Hq, N, D] and out [N, Hq, D], float32, last dim contiguous");
  const int64_t num_layers = pool.size(1), kv_heads = pool.size(3), tokens = pool.size(4);
  const int64_t dim = pool.size(5), q_heads = query.size(0), num_rows = query.size(1);
  const int64_t groups = q_heads / kv_heads;
  TORCH_CHECK(layer >= 0 && layer < num_layers, "attend_slots: layer out of range");
  TORCH_CHECK(q_heads == groups * kv_heads && query.size(2) == dim && out.size(0) == num_rows &&
                  out.size(1) == q_heads && out.size(2) == dim,
              "attend_slots: head counts or head dim do not match the pool");
  TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == at::kFloat &&
                  lse.numel() == num_rows * q_heads,
              "attend_slots: lse must be a contiguous float32 [N, Hq]");
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  const int64_t n = slots.size(0);
  TORCH_CHECK(n > 0, "attend_slots: no slots");
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(slot_p[j] >= 0 && slot_p[j] < pool.size(0), "attend_slots: slot out of range");
  }
  struct SlotItem {
    int64_t row, head, slot, start, len;
  };
  std::vector<SlotItem> items;
  std::vector<int64_t> first(num_rows + 1), out_rows(num_rows);
  for (int64_t r = 0; r < num_rows; ++r) {
    first[r] = static_cast<int64_t>(items.size());
    out_rows[r] = r;
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t s = 0; s < tokens; s += kBlockTokens) {
          items.push_back({r, h, slot_p[j], s, std::min(kBlockTokens, tokens - s)});
        }
      }
    }
  }
  first[num_rows] = static_cast<int64_t>(items.size());
  const int64_t num_items = first[num_rows], part = dim + 2;
  std::vector<float> partial(num_items * groups * part);
  const bool low = pool.scalar_type() == at::kBFloat16;  // else float32
  const float* base = low ? nullptr : pool.data_ptr<float>();
  const uint16_t* low_base =
      low ? reinterpret_cast<const uint16_t*>(pool.data_ptr<at::BFloat16>()) : nullptr;
  const float* qp = query.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const bool threads = num_rows * n * tokens >= kSerialKeys;
  kvtier_pool::parallel_for(0, num_items, threads ? 1 : std::max<int64_t>(num_items, 1),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> q(groups * dim), scores(groups * kBlockTokens);
    for (int64_t i = begin; i < end; ++i) {
      const SlotItem& it = items[i];
      for (int64_t g = 0; g < groups; ++g) {
        const float* src = qp + (it.head * groups + g) * query.stride(0) + it.row * query.stride(1);
        std::copy_n(src, dim, q.data() + g * dim);
      }
      const int64_t k_at = (((it.slot * num_layers + layer) * 2) * kv_heads + it.head) * tokens;
      const int64_t v_at = (((it.slot * num_layers + layer) * 2 + 1) * kv_heads + it.head) * tokens;
      float* res = partial.data() + i * groups * part;
      if (low) {
        attend_block(groups, dim, q.data(), low_base + (k_at + it.start) * dim,
                     low_base + (v_at + it.start) * dim, it.len, fscale, scores.data(), res);
      } else {
        attend_block(groups, dim, q.data(), base + (k_at + it.start) * dim,
                     base + (v_at + it.start) * dim, it.len, fscale, scores.data(), res);
      }
    }
  });
  merge_rows(num_rows, first, [&](int64_t i) { return items[i].head; }, partial, groups, dim,
             q_heads, out_rows.data(), out, lse.data_ptr<float>(), threads);
}

// rms_norm: weight * (x * rsqrt(mean(x^2) + eps)) over the last dim of x [..., H]
// (contiguous float32); a new tensor, float32 or, with bf16_out, rounded to bfloat16 (to
// nearest even: what a bf16 matmul would round it to). With residual (float32 or bfloat16,
// shaped like x): x += residual first (x is mutated), then the norm of the sum.
at::Tensor rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps,
                         const at::Tensor* residual, bool bf16_out) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat && x.dim() >= 1,
              "rms_norm: x must be a contiguous float32 tensor");
  const int64_t width = x.size(-1);
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat &&
                  weight.numel() == width,
              "rms_norm: weight must be a contiguous float32 [", width, "]");
  const bool low_residual = residual != nullptr && residual->scalar_type() == at::kBFloat16;
  if (residual != nullptr) {
    TORCH_CHECK(residual->is_contiguous() &&
                    (residual->scalar_type() == at::kFloat || low_residual) &&
                    residual->sizes() == x.sizes(),
                "add_rms_norm: residual must be a contiguous float32 or bfloat16 tensor "
                "shaped like x");
  }
  at::Tensor y = at::empty_like(x, bf16_out ? x.options().dtype(at::kBFloat16) : x.options());
  const int64_t n = x.numel() / width;
  float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const void* rp = residual != nullptr ? residual->data_ptr() : nullptr;
  void* yp = y.data_ptr();
  const float feps = static_cast<float>(eps);
  kvtier_pool::parallel_for_rows(n, 0, n, 16, [&](int64_t begin, int64_t end) {
    // rows widened from or rounded to bf16 pass through here
    std::vector<float> scratch(low_residual || bf16_out ? width : 0);
    for (int64_t i = begin; i < end; ++i) {
      float* row = xp + i * width;
      if (rp != nullptr) {
        const float* add = static_cast<const float*>(rp) + i * width;
        if (low_residual) {
          widen_bf16(static_cast<const uint16_t*>(rp) + i * width, width, scratch.data());
          add = scratch.data();
        }
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) row[j] += add[j];
      }
      const float inv = 1.f / std::sqrt(dot(row, row, width) / width + feps);
      float* dst = bf16_out ? scratch.data() : static_cast<float*>(yp) + i * width;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) dst[j] = wp[j] * (row[j] * inv);
      if (bf16_out) round_bf16(dst, width, static_cast<uint16_t*>(yp) + i * width);
    }
  });
  return y;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool bf16_out) {
  return rms_norm_impl(x, weight, eps, nullptr, bf16_out);
}

at::Tensor add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                        const at::Tensor& weight, double eps, bool bf16_out) {
  return rms_norm_impl(x, weight, eps, &residual, bf16_out);
}

// rope_: rotates x [N, heads, D] in place (float32, last dim contiguous, any other
// strides) by cos/sin [N, D] (contiguous): x * cos + rotate_half(x) * sin, where
// rotate_half(x) = cat(-x[D/2:], x[:D/2]), transformers' convention.
void rope_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1,
              "rope_: x must be float32 [N, heads, D] with a contiguous last dim");
  const int64_t n = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat && t->dim() == 2 &&
                    t->size(0) == n && t->size(1) == dim,
                "rope_: cos/sin must be contiguous float32 [N, D]");
  }
  TORCH_CHECK(dim % 2 == 0, "rope_: the head dim must be even");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  kvtier_pool::parallel_for_rows(n, 0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* c = cp + i * dim;
      const float* s = sp + i * dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xp + i * s0 + h * s1;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float a = v[d], b = v[d + half];
          v[d] = a * c[d] + (-b) * s[d];
          v[d + half] = b * c[d + half] + a * s[d + half];
        }
      }
    }
  });
}

// silu_mul: silu(gate) * up of gate_up [N, 2I] (contiguous float32 or bfloat16: gate, then
// up); a new [N, I] tensor of the same dtype (bf16: computed in float32, rounded to nearest
// even). silu(x) = x / (1 + exp(-x)).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  const bool low = gate_up.scalar_type() == at::kBFloat16;
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() &&
                  (gate_up.scalar_type() == at::kFloat || low) && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be a contiguous float32 or bfloat16 [N, 2I]");
  const int64_t n = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor y = at::empty({n, width}, gate_up.options());
  if (!low) {
    const float* gp = gate_up.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    kvtier_pool::parallel_for_rows(n, 0, n, 4, [=](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        silu_mul_row(gp + i * 2 * width, gp + i * 2 * width + width, yp + i * width, width);
      }
    });
    return y;
  }
  const auto* gp = reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  kvtier_pool::parallel_for_rows(n, 0, n, 4, [=](int64_t begin, int64_t end) {
    constexpr int64_t kStep = 2 * kLanes;  // round_bf16's vector width
    std::vector<float> row(3 * kStep);      // a row's last partial step: gate, up, out
    for (int64_t i = begin; i < end; ++i) {
      const uint16_t* gate = gp + i * 2 * width;
      const uint16_t* up = gate + width;
      uint16_t* dst = yp + i * width;
      int64_t j = 0;
      for (; j + kStep <= width; j += kStep) {  // widened in registers, 32 at a time
        alignas(64) float out[kStep];
        for (int64_t h = 0; h < kStep; h += kLanes) {
          const vfloat g = load_kv(gate + j + h);
          store(out + h, g / (1.f + exp_vec(-g)) * load_kv(up + j + h));
        }
        round_bf16(out, kStep, dst + j);
      }
      const int64_t rest = width - j;
      if (rest > 0) {
        widen_bf16(gate + j, rest, row.data());
        widen_bf16(up + j, rest, row.data() + kStep);
        silu_mul_row(row.data(), row.data() + kStep, row.data() + 2 * kStep, rest);
        round_bf16(row.data() + 2 * kStep, rest, dst + j);
      }
    }
  });
  return y;
}

}  // namespace kvtier_ops

TORCH_LIBRARY(kvtier_cpu, m) {
  m.def(
      "decode_attend(Tensor(a!) slab, int layer, Tensor seats, Tensor tail_pos, Tensor lo, "
      "Tensor hi, Tensor rows, Tensor query, Tensor new_k, Tensor new_v, Tensor(b!) out, "
      "Tensor(c!)? lse, float scale) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool bf16_out=False) -> Tensor");
  m.def(
      "add_rms_norm(Tensor(a!) x, Tensor residual, Tensor weight, float eps, "
      "bool bf16_out=False) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def(
      "attend_slots(Tensor pool, int layer, Tensor slots, Tensor query, Tensor(a!) out, "
      "Tensor(b!) lse, float scale) -> ()");
  m.def(  // implemented in attend_prefill.cpp
      "attend_prefill(Tensor query, Tensor k_old, Tensor v_old, Tensor k_new, Tensor v_new, "
      "Tensor(a!) out, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(kvtier_cpu, CPU, m) {
  m.impl("decode_attend", &kvtier_ops::decode_attend);
  m.impl("rms_norm", &kvtier_ops::rms_norm);
  m.impl("add_rms_norm", &kvtier_ops::add_rms_norm);
  m.impl("rope_", &kvtier_ops::rope_);
  m.impl("silu_mul", &kvtier_ops::silu_mul);
  m.impl("attend_slots", &kvtier_ops::attend_slots);
}

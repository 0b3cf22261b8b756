// attend_prefill: one sequence's new queries, causally, over its earlier keys and its own
// new keys, in one pass (no mask tensor, no log-sum-exp merge), float32 arithmetic.
//
//   query  [Hq, S, D]   the pass's queries (any strides, the last one 1)
//   k_old, v_old [Hkv, R, D]   the keys before the pass, all visible (R may be 0)
//   k_new, v_new [Hkv, P + S, D]   P more keys before the pass, all visible, then the
//                  pass's own: query i sees k_new[:, 0..P + i] (P = 0: the pass's own only;
//                  P > 0: the tail of a sequence whose earlier chunks are k_old)
//   out    [S, Hq, D]   written (any strides, the last one 1)
//
// query and out are float32; the four K/V tensors float32, or all bfloat16 (kvtier's bf16
// mode): each block of 128 keys and values is then widened into the item's scratch first
// (exact), which costs about 1/G of a score tile's loads.
//
// Query head h reads KV head h / (Hq / Hkv). A work item is (KV head, 16 positions): its
// G = Hq / Hkv heads give G vectors of 16 query rows, one row per lane, the queries
// transposed and scaled into scratch (qt [G][D][16]). The item walks its keys (the earlier
// ones, then the new ones up to its last position) straight from the caller's tensors, in
// blocks of 128, FlashAttention-2 style:
//
//   scores  s [key][row]  tiles of 3 row vectors x 8 keys in 24 registers, each key's
//                         element broadcast against 16 queries (no transposed K, no
//                         horizontal sums); keys past a row's position masked on the
//                         diagonal only
//   softmax per lane      running max m, sum l and the block's alpha as vectors of 16 rows
//   o += p . v            4 rows x D (2 for D 128) in registers, one V load per vector
//
// Items go to torch's threads from a shared counter, the longest (last) positions first,
// since causal items differ in length.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

using namespace kvtier_vec;

constexpr int64_t kKeys = 128;         // keys per online-softmax block
constexpr int64_t kPositions = kLanes;  // query positions per work item, one per lane
constexpr int kTileKeys = 8;           // keys per score tile
constexpr int kTileVectors = 3;        // row vectors per score tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A tile of scores: RV row vectors (qt [RV][D][16]) against NK keys (rows k, k + ks, ...),
// stored to s[key][row] (rows_total floats per key); bmax[v] takes the tile's max. from:
// per key, the first lane that sees it (nullptr: every lane does).
template <int D, int RV, int NK>
inline void score_tile(const float* qt, const float* k, int64_t ks, float* s, int64_t rows_total,
                       vfloat* bmax, const float* from) {
  vfloat acc[RV][NK];
  for (int v = 0; v < RV; ++v) {
    for (int n = 0; n < NK; ++n) acc[v][n] = vfloat{};
  }
  for (int d = 0; d < D; ++d) {
    vfloat q[RV];
    for (int v = 0; v < RV; ++v) q[v] = load(qt + (v * D + d) * kLanes);
    for (int n = 0; n < NK; ++n) {
      const float kd = k[n * ks + d];
      for (int v = 0; v < RV; ++v) acc[v][n] += q[v] * kd;
    }
  }
  const vfloat lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int n = 0; n < NK; ++n) {
    for (int v = 0; v < RV; ++v) {
      vfloat x = acc[v][n];
      if (from) x = lane >= from[n] ? x : vfloat{} + kNegInf;
      bmax[v] = vmax(bmax[v], x);
      store(s + n * rows_total + v * kLanes, x);
    }
  }
}

template <int D, int RV>
inline void score_tile_n(int nk, const float* qt, const float* k, int64_t ks, float* s,
                         int64_t rows_total, vfloat* bmax, const float* from) {
  switch (nk) {  // a tile's keys: 8, fewer at a block's end
    case 8: return score_tile<D, RV, 8>(qt, k, ks, s, rows_total, bmax, from);
    case 7: return score_tile<D, RV, 7>(qt, k, ks, s, rows_total, bmax, from);
    case 6: return score_tile<D, RV, 6>(qt, k, ks, s, rows_total, bmax, from);
    case 5: return score_tile<D, RV, 5>(qt, k, ks, s, rows_total, bmax, from);
    case 4: return score_tile<D, RV, 4>(qt, k, ks, s, rows_total, bmax, from);
    case 3: return score_tile<D, RV, 3>(qt, k, ks, s, rows_total, bmax, from);
    case 2: return score_tile<D, RV, 2>(qt, k, ks, s, rows_total, bmax, from);
    default: return score_tile<D, RV, 1>(qt, k, ks, s, rows_total, bmax, from);
  }
}

// o[g] = o[g] * alpha[g] + sum_j p[j][g] v[j] for RG rows (p [key][row], rows_total floats
// per key; v rows with stride vs; o [RG, D]).
template <int D, int RG>
inline void pv_tile(const float* p, int64_t rows_total, int64_t nk, const float* v,
                    int64_t vs, const float* alpha, float* o) {
  constexpr int C = D / kLanes;
  vfloat acc[RG][C];
  for (int g = 0; g < RG; ++g) {
    for (int c = 0; c < C; ++c) acc[g][c] = load(o + g * D + c * kLanes) * alpha[g];
  }
  for (int64_t j = 0; j < nk; ++j) {
    vfloat vj[C];
    for (int c = 0; c < C; ++c) {
      vj[c] = load(v + j * vs + c * kLanes);
      // Held in a register: GCC would otherwise fold the load into each row's FMA, RG
      // 64-byte loads per vector where the core issues one a cycle (15 % slower). Only
      // with AVX-512: elsewhere a 16-lane vector is not one register.
#ifdef __AVX512F__
      asm("" : "+v"(vj[c]));
#endif
    }
    for (int g = 0; g < RG; ++g) {
      const float pj = p[j * rows_total + g];
      for (int c = 0; c < C; ++c) acc[g][c] += pj * vj[c];
    }
  }
  for (int g = 0; g < RG; ++g) {
    for (int c = 0; c < C; ++c) store(o + g * D + c * kLanes, acc[g][c]);
  }
}

// One item's scratch: nv = G vectors of 16 rows (row r = vector r / 16, lane r % 16).
struct Item {
  int64_t nv;
  const float* qt;  // [nv][D][16] scaled queries
  float* o;         // [nv * 16][D] unnormalised output
  float* s;         // [kKeys][nv * 16] scores, then probabilities
  vfloat* m;        // [nv] running max
  vfloat* l;        // [nv] running sum
  vfloat* bmax;     // [nv] the block's max
  float* alpha;     // [nv * 16] the block's rescale of o
  float* from;      // [kKeys] first lane that sees each key of the block
  float* kw;        // [kKeys][D] a bf16 block's keys widened (unused for float32 KV)
  float* vw;        // [kKeys][D] its values widened
};

// The item's next block: nk <= kKeys keys (rows k, v with strides ks, vs). diag >= 0: the
// block holds new keys past p0, the item's first position; diag is its first key's index
// among the new keys, and lane i sees new key j iff j <= p0 + i.
template <int D>
void attend_block(const Item& it, const uint16_t* k, int64_t ks, const uint16_t* v, int64_t vs,
                  int64_t nk, int64_t diag, int64_t p0);

template <int D>
void attend_block(const Item& it, const float* k, int64_t ks, const float* v, int64_t vs,
                  int64_t nk, int64_t diag, int64_t p0) {
  const int64_t nv = it.nv, rows_total = nv * kLanes;
  for (int64_t i = 0; i < nv; ++i) it.bmax[i] = vfloat{} + kNegInf;
  if (diag >= 0) {
    for (int64_t j = 0; j < nk; ++j) it.from[j] = static_cast<float>(diag + j - p0);
  }
  for (int64_t j = 0; j < nk; j += kTileKeys) {
    const int n = static_cast<int>(std::min<int64_t>(kTileKeys, nk - j));
    const float* from = diag >= 0 && diag + j + n - 1 > p0 ? it.from + j : nullptr;
    const float* kj = k + j * ks;
    float* sj = it.s + j * rows_total;
    int64_t i = 0;
    for (; i + kTileVectors <= nv; i += kTileVectors) {
      score_tile_n<D, kTileVectors>(n, it.qt + i * D * kLanes, kj, ks, sj + i * kLanes,
                                    rows_total, it.bmax + i, from);
    }
    if (nv - i == 2) {
      score_tile_n<D, 2>(n, it.qt + i * D * kLanes, kj, ks, sj + i * kLanes, rows_total,
                         it.bmax + i, from);
    } else if (nv - i == 1) {
      score_tile_n<D, 1>(n, it.qt + i * D * kLanes, kj, ks, sj + i * kLanes, rows_total,
                         it.bmax + i, from);
    }
  }
  const bool masked = diag >= 0 && diag + nk - 1 > p0;
  for (int64_t i = 0; i < nv; ++i) {  // online softmax, 16 rows a vector
    const vfloat m_new = vmax(it.m[i], it.bmax[i]);  // finite: key 0 comes first
    const vfloat alpha = exp_vec(it.m[i] - m_new);
    vfloat sum{};
    for (int64_t j = 0; j < nk; ++j) {
      float* sp = it.s + j * rows_total + i * kLanes;
      const vfloat x = load(sp);
      vfloat p = exp_vec(x - m_new);
      if (masked) p = x == kNegInf ? vfloat{} : p;  // masked keys weigh 0
      store(sp, p);
      sum += p;
    }
    it.l[i] = it.l[i] * alpha + sum;
    it.m[i] = m_new;
    store(it.alpha + i * kLanes, alpha);
  }
  constexpr int RG = D == 64 ? 4 : 2;  // output rows in registers: RG x D / 16 = 16
  for (int64_t r = 0; r < rows_total; r += RG) {
    pv_tile<D, RG>(it.s + r, rows_total, nk, v, vs, it.alpha + r, it.o + r * D);
  }
}

// A block of bf16 keys and values: widened into the item's scratch, then as float32.
template <int D>
void attend_block(const Item& it, const uint16_t* k, int64_t ks, const uint16_t* v, int64_t vs,
                  int64_t nk, int64_t diag, int64_t p0) {
  widen_rows(k, ks, nk, D, it.kw);
  widen_rows(v, vs, nk, D, it.vw);
  attend_block<D>(it, static_cast<const float*>(it.kw), D, static_cast<const float*>(it.vw), D,
                  nk, diag, p0);
}

// A buffer of at least n floats from 64-byte-aligned storage, owned by the calling thread
// and reused by its later calls (growing to the largest), so a call neither zero-fills nor
// page-faults fresh memory.
float* scratch(std::vector<float>& buffer, size_t n) {
  if (buffer.size() < n + kLanes) buffer.resize(n + kLanes);
  const uintptr_t at = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<float*>((at + 63) & ~uintptr_t{63});
}

// T: the K/V elements, float or bf16 bit patterns (uint16_t).
template <int D, typename T>
void attend_prefill_impl(const at::Tensor& query, const at::Tensor& k_old,
                         const at::Tensor& v_old, const at::Tensor& k_new,
                         const at::Tensor& v_new, const at::Tensor& out, double scale) {
  const int64_t hq = query.size(0), len = query.size(1), hkv = k_new.size(0);
  const int64_t groups = hq / hkv, old_len = k_old.size(1), pre = k_new.size(1) - len;
  const int64_t nv = groups, rows = nv * kLanes;  // one vector of 16 positions per head
  const int64_t blocks = (len + kPositions - 1) / kPositions;
  const int64_t items = blocks * hkv;
  std::atomic<int64_t> next{0};
  const float* qp = query.data_ptr<float>();
  const T* kop = static_cast<const T*>(k_old.data_ptr());
  const T* vop = static_cast<const T*>(v_old.data_ptr());
  const T* knp = static_cast<const T*>(k_new.data_ptr());
  const T* vnp = static_cast<const T*>(v_new.data_ptr());
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    thread_local std::vector<float> buffer;
    float* qt = scratch(buffer, rows * (2 * D + kKeys + 4) + kKeys + 2 * kKeys * D);
    Item it{nv, qt, qt + rows * D, qt + 2 * rows * D};
    it.m = reinterpret_cast<vfloat*>(it.s + kKeys * rows);  // each row offset a multiple
    it.l = it.m + nv;                                       // of 16 floats: aligned
    it.bmax = it.l + nv;
    it.alpha = reinterpret_cast<float*>(it.bmax + nv);
    it.from = it.alpha + rows;
    it.kw = it.from + kKeys;  // 16-float aligned: kKeys is a multiple of 16
    it.vw = it.kw + kKeys * D;
    for (int64_t item = next++; item < items; item = next++) {
      const int64_t block = blocks - 1 - item / hkv, h = item % hkv;  // longest first
      const int64_t p0 = block * kPositions, np = std::min(kPositions, len - p0);
      for (int64_t g = 0; g < groups; ++g) {  // qt[g][d][p] = q[h G + g][p0 + p][d] * scale
        const float* src = qp + (h * groups + g) * query.stride(0) + p0 * query.stride(1);
        float* dst = qt + g * D * kLanes;
        for (int64_t p = 0; p < kPositions; ++p) {
          if (p < np) {
            const float* sp = src + p * query.stride(1);
            for (int d = 0; d < D; ++d) dst[d * kLanes + p] = sp[d] * sc;
          } else {  // lanes past the last position: zero queries over real keys, never written
            for (int d = 0; d < D; ++d) dst[d * kLanes + p] = 0.f;
          }
        }
      }
      std::fill_n(it.o, rows * D, 0.f);
      for (int64_t i = 0; i < nv; ++i) {
        it.m[i] = vfloat{} + kNegInf;
        it.l[i] = vfloat{};
      }
      const T* ko = kop + h * k_old.stride(0);
      const T* vo = vop + h * v_old.stride(0);
      for (int64_t j = 0; j < old_len; j += kKeys) {
        const int64_t nk = std::min(kKeys, old_len - j);
        attend_block<D>(it, ko + j * k_old.stride(1), k_old.stride(1), vo + j * v_old.stride(1),
                        v_old.stride(1), nk, -1, p0);
      }
      const T* kn = knp + h * k_new.stride(0);
      const T* vn = vnp + h * v_new.stride(0);
      for (int64_t j = 0; j < pre; j += kKeys) {  // the visible keys before the pass's own
        const int64_t nk = std::min(kKeys, pre - j);
        attend_block<D>(it, kn + j * k_new.stride(1), k_new.stride(1), vn + j * v_new.stride(1),
                        v_new.stride(1), nk, -1, p0);
      }
      kn += pre * k_new.stride(1);
      vn += pre * v_new.stride(1);
      for (int64_t j = 0, end = p0 + np; j < end; j += kKeys) {
        const int64_t nk = std::min(kKeys, end - j);
        attend_block<D>(it, kn + j * k_new.stride(1), k_new.stride(1), vn + j * v_new.stride(1),
                        v_new.stride(1), nk, j + nk - 1 > p0 ? j : -1, p0);
      }
      const float* l = reinterpret_cast<const float*>(it.l);
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t p = 0; p < np; ++p) {
          const int64_t r = g * kLanes + p;
          float* dst = op + (p0 + p) * out.stride(0) + (h * groups + g) * out.stride(1);
          const float inv = 1.f / l[r];
          for (int d = 0; d < D; ++d) dst[d] = it.o[r * D + d] * inv;
        }
      }
    }
  });
}

void check_3d(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == dtype && t.device().is_cpu() &&
                  (t.size(2) <= 1 || t.stride(2) == 1),
              "attend_prefill: ", name, " must be a ", c10::toString(dtype),
              " CPU [H, L, D] with stride 1 in D");
}

}  // namespace

namespace kvtier_ops {

void check_prefill(const at::Tensor& query, const at::Tensor& k_old, const at::Tensor& v_old,
                   const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& out) {
  const at::ScalarType kv = k_new.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
  check_3d(query, "query", at::kFloat);
  check_3d(k_old, "k_old", kv);
  check_3d(v_old, "v_old", kv);
  check_3d(k_new, "k_new", kv);
  check_3d(v_new, "v_new", kv);
  check_3d(out, "out", at::kFloat);
  const int64_t hq = query.size(0), len = query.size(1), dim = query.size(2);
  const int64_t hkv = k_new.size(0);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "attend_prefill: query heads ", hq,
              " are not a multiple of KV heads ", hkv);
  TORCH_CHECK(k_new.sizes() == v_new.sizes() && k_new.size(1) >= len && k_new.size(2) == dim,
              "attend_prefill: k_new/v_new must be [Hkv, P + S, D] for the query's S and D");
  TORCH_CHECK(k_old.sizes() == v_old.sizes() && k_old.size(0) == hkv && k_old.size(2) == dim,
              "attend_prefill: k_old/v_old must be [Hkv, R, D]");
  TORCH_CHECK(out.size(0) == len && out.size(1) == hq && out.size(2) == dim,
              "attend_prefill: out must be [S, Hq, D]");
}

}  // namespace kvtier_ops

namespace {

void attend_prefill(const at::Tensor& query, const at::Tensor& k_old, const at::Tensor& v_old,
                    const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& out,
                    double scale) {
  kvtier_ops::check_prefill(query, k_old, v_old, k_new, v_new, out);
  const int64_t len = query.size(1), dim = query.size(2);
  if (len == 0) return;
  const bool low = k_new.scalar_type() == at::kBFloat16;
  if (dim == 64) {
    (low ? attend_prefill_impl<64, uint16_t> : attend_prefill_impl<64, float>)(
        query, k_old, v_old, k_new, v_new, out, scale);
  } else if (dim == 128) {
    (low ? attend_prefill_impl<128, uint16_t> : attend_prefill_impl<128, float>)(
        query, k_old, v_old, k_new, v_new, out, scale);
  } else {
    TORCH_CHECK(false, "attend_prefill: head dim ", dim, " is not 64 or 128");
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(kvtier_cpu, CPU, m) { m.impl("attend_prefill", &attend_prefill); }

// attend_prefill: one sequence's new queries, causally, over its earlier keys and its own
// new keys, in one pass (no mask tensor, no log-sum-exp merge), float32.
//
//   query  [Hq, S, D]   the pass's queries (any strides, the last one 1)
//   k_old, v_old [Hkv, R, D]   the keys before the pass, all visible (R may be 0)
//   k_new, v_new [Hkv, S, D]   the pass's own keys: query i sees k_new[:, 0..i]
//   out    [S, Hq, D]   written (any strides, the last one 1)
//
// Query head h reads KV head h / (Hq / Hkv). The keys of each KV head are first copied
// once into scratch, K transposed per 64-key block ([L / 64, D, 64]) and V as rows ([L, D]), L = R + S rounded up
// to a 64-key block. Work items are (KV head, block of 16 positions): the block's
// G x 16 query rows stay in L1 with their running max, sum and output while the item walks
// the key blocks its last position can see, an online softmax (FlashAttention's) per
// row. Scores are computed 4 rows x 64 keys at a time in vector registers, and so is
// P.V. Items go to torch's threads from a shared counter, the longest (last) blocks
// first, since causal items differ in length.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

using namespace kvtier_vec;

constexpr int64_t kKeys = 64;       // keys per block: 4 vectors of scores per row
constexpr int64_t kPositions = 16;  // query positions per work item
constexpr int64_t kRowGroup = 4;    // query rows computed together

// Scratch copies of KV head h's keys [j0, j1) (whole 64-key blocks): kt [L / 64, D, 64]
// (each block of 64 keys transposed and contiguous) and vr [L, D]; keys past the end are 0.
void stage_keys(const at::Tensor& k_old, const at::Tensor& v_old, const at::Tensor& k_new,
                const at::Tensor& v_new, int64_t h, int64_t j0, int64_t j1, float* kt,
                float* vr) {
  const int64_t dim = k_new.size(2), old_len = k_old.size(1), new_len = k_new.size(1);
  const float* ko = k_old.data_ptr<float>();
  const float* vo = v_old.data_ptr<float>();
  const float* kn = k_new.data_ptr<float>();
  const float* vn = v_new.data_ptr<float>();
  for (int64_t j = j0; j < j1; ++j) {
    const float* kj = nullptr;
    const float* vj = nullptr;
    if (j < old_len) {
      kj = ko + h * k_old.stride(0) + j * k_old.stride(1);
      vj = vo + h * v_old.stride(0) + j * v_old.stride(1);
    } else if (j < old_len + new_len) {
      kj = kn + h * k_new.stride(0) + (j - old_len) * k_new.stride(1);
      vj = vn + h * v_new.stride(0) + (j - old_len) * v_new.stride(1);
    }
    float* kblock = kt + j / kKeys * dim * kKeys + j % kKeys;
    for (int64_t d = 0; d < dim; ++d) kblock[d * kKeys] = kj ? kj[d] : 0.f;
    if (vj) {
      std::memcpy(vr + j * dim, vj, dim * sizeof(float));
    } else {
      std::fill_n(vr + j * dim, dim, 0.f);
    }
  }
}

// A buffer of at least n floats, owned by the calling thread and reused by its later calls
// (growing to the largest), so a call neither zero-fills nor page-faults fresh memory.
float* scratch(std::vector<float>& buffer, size_t n) {
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// One item: rows [rows, D] of pre-scaled queries; row r sees keys 0..limit[r] (inclusive).
// o [rows, D], m and l [rows], s [rows, kKeys] are the item's scratch (rows % 4 == 0).
template <int D>
void attend_item(const float* q, const int64_t* limit, int64_t rows, const float* kt,
                 const float* vr, float* o, float* m, float* l, float* s) {
  constexpr int C = D / kLanes;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  int64_t last = 0;
  for (int64_t r = 0; r < rows; ++r) last = std::max(last, limit[r]);
  std::fill_n(o, rows * D, 0.f);
  std::fill_n(m, rows, kNegInf);
  std::fill_n(l, rows, 0.f);
  for (int64_t k0 = 0; k0 <= last; k0 += kKeys) {
    const float* kb = kt + k0 * D;  // this block's [D, 64]
    for (int64_t r = 0; r < rows; r += kRowGroup) {  // scores, 4 rows x 64 keys
      vfloat acc[kRowGroup][4] = {};
      for (int d = 0; d < D; ++d) {
        const float* kd = kb + d * kKeys;
        const vfloat k_0 = load(kd), k_1 = load(kd + 16), k_2 = load(kd + 32),
                     k_3 = load(kd + 48);
        for (int i = 0; i < kRowGroup; ++i) {
          const float qd = q[(r + i) * D + d];
          acc[i][0] += qd * k_0;
          acc[i][1] += qd * k_1;
          acc[i][2] += qd * k_2;
          acc[i][3] += qd * k_3;
        }
      }
      for (int i = 0; i < kRowGroup; ++i) {
        for (int c = 0; c < 4; ++c) store(s + (r + i) * kKeys + c * kLanes, acc[i][c]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {  // online softmax, per row
      float* sr = s + r * kKeys;
      const int64_t valid = std::min<int64_t>(kKeys, limit[r] - k0 + 1);
      if (valid <= 0) {
        std::fill_n(sr, kKeys, 0.f);
        continue;
      }
      if (valid < kKeys) std::fill(sr + valid, sr + kKeys, kNegInf);
      vfloat vmax = load(sr);
      for (int c = 1; c < 4; ++c) vmax = vmax > load(sr + c * kLanes) ? vmax : load(sr + c * kLanes);
      const float new_max = std::max(m[r], lane_max(vmax));
      const float alpha = m[r] == kNegInf ? 0.f : exp_scalar(m[r] - new_max);
      vfloat vsum{};
      for (int c = 0; c < 4; ++c) {
        vfloat e = exp_vec(load(sr + c * kLanes) - new_max);
        const vfloat lane = vfloat{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} +
                            static_cast<float>(c * kLanes);
        e = lane < static_cast<float>(valid) ? e : vfloat{};  // masked keys weigh 0
        store(sr + c * kLanes, e);
        vsum += e;
      }
      const float sum = lane_sum(vsum);
      l[r] = l[r] * alpha + sum;
      m[r] = new_max;
      if (alpha != 1.f) {
        for (int c = 0; c < C; ++c) store(o + r * D + c * kLanes, load(o + r * D + c * kLanes) * alpha);
      }
    }
    const float* vb = vr + k0 * D;
    constexpr int G = C > 4 ? 2 : kRowGroup;  // output rows kept in registers
    for (int64_t r = 0; r < rows; r += G) {  // o += p . v
      vfloat acc[G][C];
      for (int i = 0; i < G; ++i) {
        for (int c = 0; c < C; ++c) acc[i][c] = load(o + (r + i) * D + c * kLanes);
      }
      for (int64_t j = 0; j < kKeys; ++j) {
        vfloat v[C];
        for (int c = 0; c < C; ++c) v[c] = load(vb + j * D + c * kLanes);
        for (int i = 0; i < G; ++i) {
          const float p = s[(r + i) * kKeys + j];
          for (int c = 0; c < C; ++c) acc[i][c] += p * v[c];
        }
      }
      for (int i = 0; i < G; ++i) {
        for (int c = 0; c < C; ++c) store(o + (r + i) * D + c * kLanes, acc[i][c]);
      }
    }
  }
}

template <int D>
void attend_prefill_impl(const at::Tensor& query, const at::Tensor& k_old,
                         const at::Tensor& v_old, const at::Tensor& k_new,
                         const at::Tensor& v_new, const at::Tensor& out, double scale) {
  const int64_t hq = query.size(0), len = query.size(1), hkv = k_new.size(0);
  const int64_t groups = hq / hkv, old_len = k_old.size(1);
  const int64_t padded = (old_len + len + kKeys - 1) / kKeys * kKeys;
  thread_local std::vector<float> keys_buffer;
  float* kt = scratch(keys_buffer, 2 * hkv * D * padded);
  float* vr = kt + hkv * D * padded;
  const int64_t key_blocks = padded / kKeys;
  at::parallel_for(0, hkv * key_blocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / key_blocks, j0 = i % key_blocks * kKeys;
      stage_keys(k_old, v_old, k_new, v_new, h, j0, j0 + kKeys, kt + h * D * padded,
                 vr + h * padded * D);
    }
  });
  const int64_t blocks = (len + kPositions - 1) / kPositions;
  const int64_t items = blocks * hkv;
  const int64_t max_rows = (kPositions * groups + kRowGroup - 1) / kRowGroup * kRowGroup;
  std::atomic<int64_t> next{0};
  const float* qp = query.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    thread_local std::vector<float> item_buffer;
    float* q = scratch(item_buffer, max_rows * (2 * D + 2 + kKeys));
    float* o = q + max_rows * D;
    float* m = o + max_rows * D;
    float* l = m + max_rows;
    float* s = l + max_rows;
    thread_local std::vector<int64_t> limit;
    if (limit.size() < static_cast<size_t>(max_rows)) limit.resize(max_rows);
    for (int64_t item = next++; item < items; item = next++) {
      const int64_t block = blocks - 1 - item / hkv, h = item % hkv;  // longest first
      const int64_t p0 = block * kPositions, np = std::min(kPositions, len - p0);
      const int64_t rows = (np * groups + kRowGroup - 1) / kRowGroup * kRowGroup;
      for (int64_t r = 0; r < rows; ++r) {  // row r = position p0 + r / G, head h G + r % G
        const int64_t p = r / groups, g = r % groups;
        float* qr = q + r * D;
        if (p < np) {
          const float* src = qp + (h * groups + g) * query.stride(0) + (p0 + p) * query.stride(1);
          for (int d = 0; d < D; ++d) qr[d] = src[d] * sc;
          limit[r] = old_len + p0 + p;
        } else {  // padding rows: computed over key 0 only, never written
          std::fill_n(qr, D, 0.f);
          limit[r] = 0;
        }
      }
      attend_item<D>(q, limit.data(), rows, kt + h * D * padded, vr + h * padded * D, o, m, l,
                     s);
      for (int64_t r = 0; r < np * groups; ++r) {
        const int64_t p = r / groups, g = r % groups;
        float* dst = op + (p0 + p) * out.stride(0) + (h * groups + g) * out.stride(1);
        const float inv = 1.f / l[r];
        for (int d = 0; d < D; ++d) dst[d] = o[r * D + d] * inv;
      }
    }
  });
}

void check_3d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == at::kFloat && t.device().is_cpu() &&
                  (t.size(2) <= 1 || t.stride(2) == 1),
              "attend_prefill: ", name, " must be a float32 CPU [H, L, D] with stride 1 in D");
}

void attend_prefill(const at::Tensor& query, const at::Tensor& k_old, const at::Tensor& v_old,
                    const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& out,
                    double scale) {
  check_3d(query, "query");
  check_3d(k_old, "k_old");
  check_3d(v_old, "v_old");
  check_3d(k_new, "k_new");
  check_3d(v_new, "v_new");
  check_3d(out, "out");
  const int64_t hq = query.size(0), len = query.size(1), dim = query.size(2);
  const int64_t hkv = k_new.size(0);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "attend_prefill: query heads ", hq,
              " are not a multiple of KV heads ", hkv);
  TORCH_CHECK(k_new.sizes() == v_new.sizes() && k_new.size(1) == len && k_new.size(2) == dim,
              "attend_prefill: k_new/v_new must be [Hkv, S, D] like the query's S and D");
  TORCH_CHECK(k_old.sizes() == v_old.sizes() && k_old.size(0) == hkv && k_old.size(2) == dim,
              "attend_prefill: k_old/v_old must be [Hkv, R, D]");
  TORCH_CHECK(out.size(0) == len && out.size(1) == hq && out.size(2) == dim,
              "attend_prefill: out must be [S, Hq, D]");
  if (len == 0) return;
  if (dim == 64) {
    attend_prefill_impl<64>(query, k_old, v_old, k_new, v_new, out, scale);
  } else if (dim == 128) {
    attend_prefill_impl<128>(query, k_old, v_old, k_new, v_new, out, scale);
  } else {
    TORCH_CHECK(false, "attend_prefill: head dim ", dim, " is not 64 or 128");
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(kvtier_cpu, CPU, m) { m.impl("attend_prefill", &attend_prefill); }

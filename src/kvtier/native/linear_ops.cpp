// kvtier's projection kernel for few rows (a decode batch): y [M, O] = x [M, I] W^T (+ b),
// on the weight re-laid once as panels of 16 output features, registered as
// torch.ops.kvtier_cpu.pack_panels / linear_panels.
//
// Layout: panels [P, I, 16], P = ceil(O / 16), panels[p, i, l] = W[16 p + l, i] (zero past
// O): one panel is a contiguous run of I * 16 values. Each work item is a block of 3 panels,
// read from memory once per call and multiplied with every row of x from registers: a tile
// of 8 rows x 48 outputs keeps 24 vector accumulators, and each k adds x[r, k] (broadcast)
// times the 3 panel vectors at k. No horizontal sums; the inner loop is 3 vector loads and
// 8 broadcasts for 24 FMAs. With more than 8 rows, the 8-row groups take turns every
// kBlockK values of k (their accumulators parked in L1 between turns), so the later groups
// find the block's panels in L1 instead of a second pass over it. Each k also prefetches
// the panels kPrefetchK values ahead: the hardware streamer stops at every 4 KiB page (a
// panel of 576 values spans 9), and a tile busy with FMAs otherwise waits on memory (on
// Intel; on AMD a lone group asks L2 for its lines further ahead, see lone_group_to_l2). Taking
// turns, each group instead prefetches its share of the next block while it computes (the
// later groups' turns had left memory idle): 16 rows, one process against the build before,
// best (median) of 6 in three sittings: 33.3 (33.6) -> 32.2 (32.5), 26.7 (27.2) -> 22.4
// (23.0), 36.1 (39.0) -> 33.8 (35.9) ms; 12 rows 29.5 -> 28.2; 32 rows 57.4 -> 61.3 and
// 54.9 -> 46.9 (mixed).
//
// Measured on the 2-core Intel Xeon with AMX (KVM), every projection of SmolLM2-135M once
// (121 calls, 538 MB of weights), interleaved in one process with the kernel before the
// turns and the prefetch (best of 6; the machine is noisy): 1 row 18.4 -> 17.0 ms, 8 rows
// 27.7 -> 24.4, 16 rows 39.9 -> 29.6 and 31.6 -> 27.3 in two sittings, 32 rows 50.1 ->
// 44.9; bfloat16 weights 16 rows 27.0 -> 25.7. A tile of 16 rows x 1 panel (16 FMAs with
// broadcast operands per panel load) ran slower: 53.8 ms at 16 rows. Earlier, on the 2-core
// AMD EPYC (Zen 4), against torch's oneDNN on its packed weights: 1 row 15.0 ms against
// 27.1, 16 rows 30.7 against 35.6, 64 rows 90.8 against 102.6.
//
// bfloat16 weights are packed in pairs of k, panels [P, ceil(I / 2), 16, 2] (a line: 16
// outputs x 2 k, 64 bytes, as a float32 line), and x is rounded to bf16 once per call (as
// oneDNN's bf16 matmul rounds it). On a CPU with AMX (and I / 2 a multiple of 16) the
// product runs on AMX tiles, whose B operand this layout is (linear_amx below); elsewhere
// the same tiles of 8 rows x 3 panels run with AVX-512 BF16's vdpbf16ps, or without it two
// FMAs per pair. Measured on the 2-core Intel Xeon with AMX, every projection of SmolLM2-135M
// in bf16 once (121 calls, 270 MB), best of 6, two processes each alternating with the
// widening kernel before (bf16 [P, I, 16] panels widened to float32 as read, x float32):
// 1 row 8.5-8.7 against 11.1-11.4 ms, 8 rows 8.2-8.6 against 11.9-12.5, 16 rows 8.6-8.8
// against 16.3, 32 rows 11.0-11.2 against 32.1, 64 rows 16.4-17.0 against 61.3-61.8. There
// vdpbf16ps itself ran at a quarter of the FMAs' rate (a loop of independent ones: 1.47
// against 5.9 G instructions/s), so without AMX it lost to widening from 8 rows up (16
// rows 25 against 16.3 ms); on AMD Zen 4 it issues at the FMAs' rate, unmeasured here.
//
// int8 panels [P, I, 16] (a line: 16 outputs' int8 weights at one k, 16 bytes) with a
// float32 scale per output: the same tiles, each line widened to float32 as read (exact),
// and each output's sum times its scale (kvtier.engine.greedy_head's screen of the LM
// head: a quarter of the float32 head's bytes). Packed by the caller.
//
// x, bias and y float32 (a bf16 bias is widened); sums in float32. Threads:
// kvtier_pool::parallel_for_rows over panel blocks (pool.h). Inputs are checked.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "amx.h"
#include "ops.h"
#include "pool.h"
#include "vec.h"

namespace {

using namespace kvtier_vec;

constexpr int64_t kPanel = kLanes;  // output features per panel
constexpr int kTileRows = 8;
constexpr int kTilePanels = 3;
constexpr int64_t kBlockK = 64;    // k values per turn when 8-row groups share a block
constexpr int64_t kParkRows = 64;  // rows whose accumulators one block parks at a time
constexpr int64_t kPrefetchK = 16;  // how far ahead (in k) each tile prefetches its panels
constexpr int64_t kPrefetchL2K = 64;  // how far ahead a lone group on AMD asks L2 for them

// How a lone group of at most 8 rows (no turns) prefetches its panels: on the Intel Xeon
// each line kPrefetchK values of k ahead (into L1), which paid there (1 row 18.4 -> 17.0 ms
// with the turns, above). On AMD (Zen 4) that did worse than the hardware streamer alone
// (per-step alternation in one engine on the 2-core AMD EPYC, without against with, 1 row
// float32 16.0 / 16.6 / 21.0 against 16.9 / 17.8 / 21.7 ms, bf16 9.6 / 9.4 / 11.5 against
// 10.1 / 9.9 / 12.0, 8 rows float32 22.4 / 21.9 against 23.0 / 22.5, bf16 14.0 / 13.8
// against 14.9 / 14.4), but asking L2 for each line kPrefetchL2K values ahead (4 KiB a
// panel; prefetch_l2) beats both: the 121 bf16 projections of SmolLM2-135M (one process,
// alternating, median of 10 and 12) at 8 rows 13.86 and 15.56 ms without prefetching
// against 11.62 and 13.28, at 5 rows 12.50 and 12.52 against 10.89 and 11.43, 6 rows
// 12.64 against 11.33, 2 rows 13.58 against 12.50, one row 10.90 against 10.49 (32 or 96
// values ahead: within those); float32 at 1, 4 and 8 rows within the noise (21.7 / 17.8 /
// 18.9 against 20.2 / 18.5 / 18.6). Taking turns (9 rows and more) the prefetches pay on
// AMD too: without any, 47.5 / 46.6 / 49.3 against 45.0 / 42.1 / 45.9 ms, so there they
// stay, into L1 (into L2 instead: 16 rows bf16 17.52 against 17.44 ms, float32 25.84
// against 26.11, 12 rows bf16 15.38 against 14.40, within the noise).
bool lone_group_to_l2() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd");
  }();
  return yes;
#else
  return false;
#endif
}

at::Tensor pack_panels(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16 ||
                                w.scalar_type() == at::kChar),
              "pack_panels: w must be [O, I], float32, bfloat16 or int8");
  const int64_t out_n = w.size(0), in = w.size(1);
  const int64_t panels = (out_n + kPanel - 1) / kPanel;
  if (w.scalar_type() != at::kBFloat16) {  // float32 or int8: [P, I, 16]
    at::Tensor padded = at::zeros({panels * kPanel, in}, w.options());
    padded.narrow(0, 0, out_n).copy_(w);
    // [P, 16, I] -> [P, I, 16]
    return padded.view({panels, kPanel, in}).transpose(1, 2).contiguous();
  }
  const int64_t lines = (in + 1) / 2;  // pairs of k; an odd I gets a zero k
  at::Tensor padded = at::zeros({panels * kPanel, 2 * lines}, w.options());
  padded.narrow(0, 0, out_n).narrow(1, 0, in).copy_(w);
  // [P, 16, I/2, 2] -> [P, I/2, 16, 2]
  return padded.view({panels, kPanel, lines, 2}).permute({0, 2, 1, 3}).contiguous();
}

// One line of a panel, the 16 outputs' weights at one k (float32) or at one pair of k
// (bfloat16 pairs), and how a tile multiplies it with one row's x there.
struct Float32Lines {
  using W = float;
  using X = float;
  static vfloat load_w(const float* p) { return load(p); }
  static vfloat splat_x(float x) { return splat(x); }  // vec.h: one broadcast load
  static vfloat madd(vfloat acc, vfloat w, vfloat x) { return acc + x * w; }
};

struct Int8Lines {  // a line: 16 outputs' int8 weights at one k (16 bytes)
  using W = int8_t;
  using X = float;
  static vfloat load_w(const int8_t* p) { return load_bytes(p); }
  static vfloat splat_x(float x) { return splat(x); }
  static vfloat madd(vfloat acc, vfloat w, vfloat x) { return acc + x * w; }
};

struct Bf16PairLines {
  using W = uint32_t;  // two bf16 patterns, the lower the even k
  using X = uint32_t;
  static vuint load_w(const uint32_t* p) { return load_pairs(p); }
  static XPair splat_x(uint32_t x) { return splat_pair(x); }
  static vfloat madd(vfloat acc, vuint w, const XPair& x) { return fma_pairs(acc, w, x); }
};

#ifdef __AVX512BF16__
struct Bf16DotLines {
  using W = uint32_t;
  using X = uint32_t;
  static vuint load_w(const uint32_t* p) { return load_pairs(p); }
  static __m512bh splat_x(uint32_t x) { return splat_pair_bits(x); }
  static vfloat madd(vfloat acc, vuint w, __m512bh x) { return dot_pairs(acc, w, x); }
};
#endif

// Rows r < R of one 8-row group times C panels, over lines k in [k0, k1) (a line: one k, or
// one pair of k for bf16 pairs; `in` counts lines, in x's rows too): the R x C accumulators
// start at zero (fresh) or from `park` ([R][C] vectors) and are parked there again.
// How a tile reads its own panels ahead: not at all, each line kPrefetchK values of k ahead
// into L1, or kPrefetchL2K values ahead into L2.
enum class Ahead : uint8_t { kNone, kL1, kL2 };

// Prefetches while a tile runs: `ahead`, its own panels' lines (above); and, spread evenly
// over the tile's k, lines [first, first + count) of the panels at `w` (another block of k,
// or the next block of panels).
template <typename W>
struct Prefetch {
  Ahead ahead;
  const W* w;
  int64_t first, count;
};

template <int R, int C, typename L, typename W = typename L::W>
inline void tile(const typename L::X* x, int64_t in, int64_t k0, int64_t k1, bool fresh,
                 const W* w, vfloat* park, const Prefetch<W>& pf) {
  vfloat acc[R][C] = {};
  if (!fresh) {
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) acc[r][c] = park[r * C + c];
    }
  }
  const int64_t stride = in * kPanel;  // one panel
  for (int64_t k = k0; k < k1; ++k) {
    decltype(L::load_w(w)) wv[C];
    for (int c = 0; c < C; ++c) wv[c] = L::load_w(w + c * stride + k * kPanel);
    if (pf.ahead == Ahead::kL2) {
      for (int c = 0; c < C; ++c) prefetch_l2(w + c * stride + (k + kPrefetchL2K) * kPanel);
    } else if (pf.ahead == Ahead::kL1) {
      for (int c = 0; c < C; ++c) prefetch(w + c * stride + (k + kPrefetchK) * kPanel);
    }
    if (pf.count > 0) {
      const int64_t line = pf.first + (k - k0) * pf.count / (k1 - k0);
      for (int c = 0; c < C; ++c) prefetch(pf.w + c * stride + line * kPanel);
    }
    for (int r = 0; r < R; ++r) {
      const auto xb = L::splat_x(x[r * in + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = L::madd(acc[r][c], wv[c], xb);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) park[r * C + c] = acc[r][c];
  }
}

template <int C, typename L, typename W = typename L::W>
inline void rows_tile(int64_t rows, const typename L::X* x, int64_t in, int64_t k0, int64_t k1,
                      bool fresh, const W* w, vfloat* park, const Prefetch<W>& pf) {
  switch (rows) {
    case 1: tile<1, C, L>(x, in, k0, k1, fresh, w, park, pf); break;
    case 2: tile<2, C, L>(x, in, k0, k1, fresh, w, park, pf); break;
    case 3: tile<3, C, L>(x, in, k0, k1, fresh, w, park, pf); break;
    case 4: tile<4, C, L>(x, in, k0, k1, fresh, w, park, pf); break;
    case 5: tile<5, C, L>(x, in, k0, k1, fresh, w, park, pf); break;
    case 6: tile<6, C, L>(x, in, k0, k1, fresh, w, park, pf); break;
    case 7: tile<7, C, L>(x, in, k0, k1, fresh, w, park, pf); break;
    default: tile<kTileRows, C, L>(x, in, k0, k1, fresh, w, park, pf); break;
  }
}

// y[r, col + 16 c + l] = park[r * stride + c][l] (times scale, int8 panels' per-output
// scale) + bias, for the `lanes` outputs each of the `count` panels holds.
inline void store_block(const vfloat* park, int64_t stride, int64_t rows, int64_t count,
                        float* y, int64_t out_n, int64_t col, const float* bias,
                        const float* scale) {
  for (int64_t c = 0; c < count; ++c) {
    const int64_t first = col + c * kPanel;
    const int64_t lanes = std::min<int64_t>(kPanel, out_n - first);
    vfloat b{}, s = splat(1.f);
    if (bias != nullptr) {
      for (int64_t l = 0; l < lanes; ++l) b[l] = bias[first + l];
    }
    if (scale != nullptr) {
      for (int64_t l = 0; l < lanes; ++l) s[l] = scale[first + l];
    }
    for (int64_t r = 0; r < rows; ++r) {
      const vfloat v = (scale != nullptr ? park[r * stride + c] * s : park[r * stride + c]) + b;
      float* dst = y + r * out_n + first;
      if (lanes == kPanel) {
        store(dst, v);
      } else {
        for (int64_t l = 0; l < lanes; ++l) dst[l] = v[l];
      }
    }
  }
}

template <typename L, typename W = typename L::W>
void linear_panels_of(const typename L::X* x, const W* w, const float* bias, float* y,
                      int64_t rows, int64_t in, int64_t out_n, int64_t panels,
                      const float* scale = nullptr) {
  const int64_t blocks = (panels + kTilePanels - 1) / kTilePanels;
  const Ahead alone = lone_group_to_l2() ? Ahead::kL2 : Ahead::kL1;
  kvtier_pool::parallel_for_rows(rows, 0, blocks, 1, [=](int64_t begin, int64_t end) {
    vfloat park[kParkRows * kTilePanels];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t p = b * kTilePanels;
      const int64_t count = std::min<int64_t>(kTilePanels, panels - p);
      const W* wb = w + p * in * kPanel;
      for (int64_t r0 = 0; r0 < rows; r0 += kParkRows) {
        const int64_t chunk = std::min<int64_t>(kParkRows, rows - r0);
        // One 8-row group: all of k in one go. More: the groups take turns every kBlockK
        // values of k, so the block's panels come from memory once and from L1 after.
        // Prefetching: one group reads ahead (lone_group_to_l2 says how). Taking turns, the
        // later groups find the block in L1 and would leave memory idle for their turns, so
        // every group asks for its share of the next block (the next block of panels
        // after the last) while it computes; the first turn also reads ahead.
        const bool turns = chunk > kTileRows;
        const int64_t step = turns ? kBlockK : in;
        const int64_t groups = (chunk + kTileRows - 1) / kTileRows;
        const W* next_panels = p + kTilePanels < panels ? wb + kTilePanels * in * kPanel : nullptr;
        for (int64_t k0 = 0; k0 < in; k0 += step) {
          const int64_t k1 = std::min(in, k0 + step);
          const W* next_w = k1 < in ? wb : next_panels;
          const int64_t next_first = k1 < in ? k1 : 0;
          const int64_t next_lines = next_w == nullptr ? 0 : std::min(kBlockK, in - next_first);
          for (int64_t r = 0; r < chunk; r += kTileRows) {
            const int64_t n = std::min<int64_t>(kTileRows, chunk - r);
            const int64_t g = r / kTileRows;
            const bool first_turn = k0 == 0 && g == 0;
            Prefetch<W> pf{!turns ? alone : first_turn ? Ahead::kL1 : Ahead::kNone, next_w, 0, 0};
            if (turns && next_w != nullptr) {
              pf.first = next_first + g * next_lines / groups;
              pf.count = next_first + (g + 1) * next_lines / groups - pf.first;
            }
            const auto* xr = x + (r0 + r) * in;
            vfloat* pr = park + r * count;
            if (count == 3) {
              rows_tile<3, L>(n, xr, in, k0, k1, k0 == 0, wb, pr, pf);
            } else if (count == 2) {
              rows_tile<2, L>(n, xr, in, k0, k1, k0 == 0, wb, pr, pf);
            } else {
              rows_tile<1, L>(n, xr, in, k0, k1, k0 == 0, wb, pr, pf);
            }
          }
        }
        store_block(park, count, chunk, count, y + r0 * out_n, out_n, p * kPanel, bias, scale);
      }
    }
  });
}

// Code panels: a weight held as exact low-bit codes (kvtier.engine.weight_codes finds and
// packs them). Per output and block of 32 values of k, w = d * u + m with u an unsigned 4-
// or 8-bit code, where d * u is exact in float32 (the packer checked every weight), so the
// widened weight is the float32 weight itself, bit for bit, and so is every product and
// sum: the tiles below add x * w per k in the same order as the float32 panels' tiles.
// What changes is the bytes read: 5 bits a weight with 4-bit codes (6.4x fewer than
// float32), 9 with 8-bit ones.
//
// Layout, uint8 [G, B, 3, 64 + 64 * bits]: G = ceil(P / 3) groups of 3 panels (a tile's
// work item; zero panels pad the last), B = ceil(I / 32) blocks of k, and per panel and
// block d[16] then m[16] (float16, as GGUF stores them; a lane per output) then the codes: 4 bits, 16 pairs of k
// of 16 bytes (one per output: the even k in the low nibble); 8 bits, 32 lines of 16 bytes.
// A group's blocks follow each other: one stream per work item.
constexpr int64_t kCodeK = 32;
// How far ahead (bytes) a group prefetches its stream into L2 (prefetch_l2). The 121
// projections of SmolLM2-135M at one row (2-core AMD EPYC, in one process alternating,
// median of 12 and 16): 7.41 and 6.72 ms with prefetcht0 4 blocks (3.75 KiB) ahead against
// 6.66 and 6.25 with prefetcht1 8 KiB ahead; at four rows 21.6 and 21.7 against 10.7 and
// 10.7. (Earlier, against no prefetching: 0.42 of the float32 panels' time without, 0.36
// two blocks ahead, 0.34 four, all prefetcht0.)
constexpr int64_t kCodeAheadBytes = 8 * 1024;
constexpr int64_t kCodeHeader = 2 * kPanel * static_cast<int64_t>(sizeof(uint16_t));

template <int Bits>
struct CodeLayout {
  static constexpr int64_t kPanelBytes = kCodeHeader + Bits * kCodeK * kPanel / 8;
  static constexpr int64_t kGroupBytes = kTilePanels * kPanelBytes;
};

// A panel's d and m at one block.
template <int Bits>
inline void code_scales(const uint8_t* blk, int c, vfloat& d, vfloat& m) {
  const auto* f = reinterpret_cast<const uint16_t*>(blk + c * CodeLayout<Bits>::kPanelBytes);
  d = load_f16(f);
  m = load_f16(f + kPanel);
}

// Rows r < R (at most 8) of x times one group's 3 panels over all of k, the weights widened
// in registers: the R x 3 accumulators go to park.
template <int R, int Bits>
inline void code_tile(const float* x, int64_t in, const uint8_t* group, vfloat* park) {
  using Lay = CodeLayout<Bits>;
  vfloat acc[R][kTilePanels] = {};
  const int64_t blocks = (in + kCodeK - 1) / kCodeK;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = group + b * Lay::kGroupBytes;
    const int64_t k0 = b * kCodeK, n = std::min(kCodeK, in - k0);
    for (int64_t l = 0; l < Lay::kGroupBytes; l += 64) {
      prefetch_l2(blk + kCodeAheadBytes + l);
    }
    vfloat d[kTilePanels], m[kTilePanels];
    for (int c = 0; c < kTilePanels; ++c) code_scales<Bits>(blk, c, d[c], m[c]);
    const float* xk = x + k0;
    auto line = [&](int64_t j, const vfloat* w) {
      for (int r = 0; r < R; ++r) {
        const vfloat xb = splat(xk[r * in + j]);
        for (int c = 0; c < kTilePanels; ++c) acc[r][c] = acc[r][c] + xb * w[c];
      }
    };
    const uint8_t* codes = blk + kCodeHeader;
    if constexpr (Bits == 4) {
      for (int64_t j = 0; j < n; j += 2) {
        vfloat lo[kTilePanels], hi[kTilePanels];
        for (int c = 0; c < kTilePanels; ++c) {
          load_nibbles(codes + c * Lay::kPanelBytes + j * (kPanel / 2), lo[c], hi[c]);
          lo[c] = d[c] * lo[c] + m[c];
          hi[c] = d[c] * hi[c] + m[c];
        }
        line(j, lo);
        if (j + 1 < n) line(j + 1, hi);
      }
    } else {
      for (int64_t j = 0; j < n; ++j) {
        vfloat w[kTilePanels];
        for (int c = 0; c < kTilePanels; ++c) {
          w[c] = d[c] * load_bytes(codes + c * Lay::kPanelBytes + j * kPanel) + m[c];
        }
        line(j, w);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < kTilePanels; ++c) park[r * kTilePanels + c] = acc[r][c];
  }
}

template <int Bits>
inline void rows_code_tile(int64_t rows, const float* x, int64_t in, const uint8_t* group,
                           vfloat* park) {
  switch (rows) {
    case 1: code_tile<1, Bits>(x, in, group, park); break;
    case 2: code_tile<2, Bits>(x, in, group, park); break;
    case 3: code_tile<3, Bits>(x, in, group, park); break;
    case 4: code_tile<4, Bits>(x, in, group, park); break;
    case 5: code_tile<5, Bits>(x, in, group, park); break;
    case 6: code_tile<6, Bits>(x, in, group, park); break;
    case 7: code_tile<7, Bits>(x, in, group, park); break;
    default: code_tile<kTileRows, Bits>(x, in, group, park); break;
  }
}

// The loop both code-panel products share: each group of 3 panels (a work item of
// kvtier_pool), for each TileRows rows of x in turn, `tile(group, first row, rows, park)`
// leaves the rows' totals for the 3 panels in park ([rows][3] vectors), which go to y plus
// bias.
template <int TileRows, typename Tile>
void code_groups(int64_t rows, int64_t panels, int64_t out_n, const float* bias, float* y,
                 const Tile& tile) {
  const int64_t groups = (panels + kTilePanels - 1) / kTilePanels;
  kvtier_pool::parallel_for_rows(rows, 0, groups, 1, [=](int64_t begin, int64_t end) {
    vfloat park[TileRows * kTilePanels];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p = g * kTilePanels;
      const int64_t count = std::min<int64_t>(kTilePanels, panels - p);
      for (int64_t r0 = 0; r0 < rows; r0 += TileRows) {
        const int64_t chunk = std::min<int64_t>(TileRows, rows - r0);
        tile(g, r0, chunk, park);
        store_block(park, kTilePanels, chunk, count, y + r0 * out_n, out_n, p * kPanel, bias,
                    nullptr);
      }
    }
  });
}

// y = x W^T + b on code panels: every 8 rows widen the weights in registers (one pass over
// the codes each). The runner gives them at most 8 rows (Linear): past that the float32
// panels' tiles, which take turns over one read of the weights, measured faster.
template <int Bits>
void linear_codes_of(const float* x, const uint8_t* w, const float* bias, float* y, int64_t rows,
                     int64_t in, int64_t out_n, int64_t panels) {
  const int64_t group_bytes = (in + kCodeK - 1) / kCodeK * CodeLayout<Bits>::kGroupBytes;
  code_groups<kTileRows>(rows, panels, out_n, bias, y,
                         [=](int64_t g, int64_t r0, int64_t n, vfloat* park) {
                           rows_code_tile<Bits>(n, x + r0 * in, in, w + g * group_bytes, park);
                         });
}

// bf16 code panels: kvtier's bf16 mode (x rounded to bf16) on the same codes, the weight
// kept exact. vdpbf16ps multiplies bf16 pairs, and a 4-bit code u goes in as the bf16 value
// 128 + u: its nibble unpacked beside a 0x43 byte is that bit pattern (no conversion). An
// 8-bit code goes in as its two nibbles, the low one as 128 + lo and the high one, unpacked
// beside 0x45, as 2048 + 16 hi: the two add up to 2176 + u in one sum. Per block, acc =
// sum_k x_k (o + u_k) with o that offset (128 or 2176), and the output adds d * acc + (m - o
// d) * S, S the block's sum of x (rounded x, summed in float32 once per call): d * u + m per
// weight, with float32 rounding of the sums (the offset's cancellation costs up to 5 of
// float32's 24 bits here, far below the bf16 input's 9).
//
// Layout, uint8 [G, B, 3, L, 64]: as the float32 code panels (d[16], m[16] first), then
// lines of 64 bytes, each holding 8 values of k for 16 outputs in the order two unpacks
// want: of byte 16 q + s (q < 4, s < 16) of line t, the low nibble is the code of output
// 4 q + (s % 8) / 2 at k = 8 t + 2 (s >= 8) + s % 2, the high nibble the same output's at
// k + 4. So the low nibbles unpacked (low halves of each 128-bit lane, then high) are pairs
// (k, k + 1) for k = 8 t and 8 t + 2, the high ones for 8 t + 4 and 8 t + 6: four lines of
// pairs, lane i output i, the even k in the low half, as vdpbf16ps and fma_pairs take them.
// 4 bits: L = 5, 4 code lines. 8 bits: L = 9, the low nibbles' 4 lines, then the high
// nibbles' 4 lines in the same order.
constexpr int kCodeRowsBf16 = 4;  // rows per tile: 2 x 12 accumulators (block and total)
// How far ahead (bytes) a tile prefetches its stream into L2 (prefetch_l2; its codes go
// about 3x as fast as the float32 code tiles' in cache, so the reads, not the widening, set
// its pace). The 121 projections of SmolLM2-135M (2-core AMD EPYC, one process, the
// variants alternating, median of 16, two rounds): one row 6.25 and 6.84 ms with
// prefetcht0 8 blocks (7.5 KiB) ahead, 5.42 and 5.71 with prefetcht1 16 KiB ahead, 5.72 and
// 5.87 at 30 KiB, 5.59 and 5.61 with prefetcht2 at 30 KiB; two rows 6.34 against 5.62; four
// rows 7.46 against 7.32. (Earlier, prefetcht0 as a ratio to the float32 code panels: none
// 1.05, 2 blocks 0.94, 4 blocks 0.93, 8 blocks 0.88, 16 blocks 0.94.)
constexpr int64_t kCodeAheadBytesBf16 = 16 * 1024;

// The 4 pair lines of one code line (64 bytes at p), each word the bf16 pattern `top` << 8
// | nibble: 128 + u with top 0x43, 2048 + 16 u with 0x45.
template <uint8_t Top>
inline void code_pairs4(const uint8_t* p, vuint out[4]) {
#if defined(__AVX512BW__)
  const __m512i v = _mm512_loadu_si512(p);
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(static_cast<char>(Top));
  const __m512i a = _mm512_and_si512(v, low);
  const __m512i b = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  // (stores, not casts: a vuint read of an __m512i array is an aliasing violation GCC
  // compiles to zeros)
  _mm512_storeu_si512(&out[0], _mm512_unpacklo_epi8(a, top));
  _mm512_storeu_si512(&out[1], _mm512_unpackhi_epi8(a, top));
  _mm512_storeu_si512(&out[2], _mm512_unpacklo_epi8(b, top));
  _mm512_storeu_si512(&out[3], _mm512_unpackhi_epi8(b, top));
#else
  for (int j = 0; j < 4; ++j) {
    for (int64_t i = 0; i < kLanes; ++i) {  // lane i: byte 16 q + 8 (j % 2) + 2 (i % 4)
      const uint8_t* q = p + 16 * (i / 4) + 8 * (j % 2) + 2 * (i % 4);
      const uint32_t even = j < 2 ? q[0] & 15 : q[0] >> 4, odd = j < 2 ? q[1] & 15 : q[1] >> 4;
      out[j][i] = (Top * 0x01000100u) | even | (odd << 16);
    }
  }
#endif
}

#ifdef __AVX512BF16__
using CodePairLines = Bf16DotLines;
#else
using CodePairLines = Bf16PairLines;
#endif

// Rows r < R (at most 4) of x (bf16 pairs, 16 words a block) times one group's 3 panels
// over all B blocks; sums [R, B] each block's sum of x. The R x 3 totals go to park.
template <int R, int Bits>
inline void code_tile_bf16(const uint32_t* x, const float* sums, int64_t blocks,
                           const uint8_t* group, vfloat* park) {
  using L = CodePairLines;
  using Lay = CodeLayout<Bits>;
  constexpr float kOffset = Bits == 4 ? 128.f : 2176.f;
  const int64_t words = blocks * kCodeK / 2;  // one row of x
  vfloat total[R][kTilePanels] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = group + b * Lay::kGroupBytes;
    for (int64_t l = 0; l < Lay::kGroupBytes; l += 64) {
      prefetch_l2(blk + kCodeAheadBytesBf16 + l);
    }
    vfloat acc[R][kTilePanels] = {};
    const uint32_t* xb = x + b * kCodeK / 2;
    auto pair = [&](int c, int64_t j, vuint w) {  // pair j of the block, panel c
      for (int r = 0; r < R; ++r) acc[r][c] = L::madd(acc[r][c], w, L::splat_x(xb[r * words + j]));
    };
    const uint8_t* codes = blk + kCodeHeader;
    auto lines = [&](const uint8_t* first, auto top) {  // 4 code lines: the block's 32 k
      for (int64_t t = 0; t < kCodeK / 8; ++t) {
        for (int c = 0; c < kTilePanels; ++c) {
          vuint w[4];
          code_pairs4<decltype(top)::value>(first + c * Lay::kPanelBytes + t * 64, w);
          for (int j = 0; j < 4; ++j) pair(c, 4 * t + j, w[j]);
        }
      }
    };
    lines(codes, std::integral_constant<uint8_t, 0x43>{});
    if constexpr (Bits == 8) lines(codes + 4 * 64, std::integral_constant<uint8_t, 0x45>{});
    for (int c = 0; c < kTilePanels; ++c) {
      vfloat d, m;
      code_scales<Bits>(blk, c, d, m);
      m = m - kOffset * d;
      for (int r = 0; r < R; ++r) {
        total[r][c] = total[r][c] + d * acc[r][c] + m * splat(sums[r * blocks + b]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < kTilePanels; ++c) park[r * kTilePanels + c] = total[r][c];
  }
}

template <int Bits>
inline void rows_code_tile_bf16(int64_t rows, const uint32_t* x, const float* sums,
                                int64_t blocks, const uint8_t* group, vfloat* park) {
  switch (rows) {
    case 1: code_tile_bf16<1, Bits>(x, sums, blocks, group, park); break;
    case 2: code_tile_bf16<2, Bits>(x, sums, blocks, group, park); break;
    case 3: code_tile_bf16<3, Bits>(x, sums, blocks, group, park); break;
    default: code_tile_bf16<kCodeRowsBf16, Bits>(x, sums, blocks, group, park); break;
  }
}

// y = x W^T + b on bf16 code panels: x [rows, B * 16] bf16 pairs (zero past I), sums [rows,
// B]; every 4 rows widen the codes in registers (one pass over them each).
template <int Bits>
void linear_codes_bf16_of(const uint32_t* x, const float* sums, const uint8_t* w,
                          const float* bias, float* y, int64_t rows, int64_t blocks,
                          int64_t out_n, int64_t panels) {
  const int64_t group_bytes = blocks * CodeLayout<Bits>::kGroupBytes;
  const int64_t words = blocks * kCodeK / 2;
  code_groups<kCodeRowsBf16>(
      rows, panels, out_n, bias, y, [=](int64_t g, int64_t r0, int64_t n, vfloat* park) {
        rows_code_tile_bf16<Bits>(n, x + r0 * words, sums + r0 * blocks, blocks,
                                  w + g * group_bytes, park);
      });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX: C[m x 16] += A[m x 32 bf16] B[16 pairs x 16 outputs] per tdpbf16ps, where B is 16
// lines of one bf16 panel (1 KiB, contiguous: the pairs layout is AMX's B layout) and A 16
// lines of m rows of x. Tiles: 0-3 the accumulators of up to 4 panels, 4 the rows of x, 5
// and 6 the panels' lines (alternating). The tile configuration is per thread: each task
// loads its own and releases the tiles when done (torch's and oneDNN's AMX kernels load
// theirs before use).
constexpr int64_t kAmxPanels = 4;
constexpr int64_t kAmxLines = 16;  // lines (pairs of k) per step
constexpr int64_t kAmxRows = 16;
constexpr int64_t kAmxAhead = 2 * kAmxLines;  // how far ahead (lines) a step prefetches

inline void configure_tiles(int64_t m) {
  kvtier_amx::TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 5; ++t) {  // C0-C3 and A: m rows of 64 bytes
    cfg.rows[t] = static_cast<uint8_t>(m);
    cfg.colsb[t] = 64;
  }
  for (int t = 5; t < 7; ++t) {  // B: 16 lines of 64 bytes
    cfg.rows[t] = kAmxLines;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// y = x W^T + b on AMX: x [rows, 2 lines] bf16 patterns, w the pairs panels [P, lines, 16,
// 2], lines a multiple of kAmxLines.
void linear_amx(const uint16_t* x, const uint32_t* w, const float* bias, float* y, int64_t rows,
                int64_t lines, int64_t out_n, int64_t panels) {
  const int64_t blocks = (panels + kAmxPanels - 1) / kAmxPanels;
  const int64_t panel_words = lines * kPanel;  // one panel, in pairs
  kvtier_pool::parallel_for_rows(rows, 0, blocks, 1, [=](int64_t begin, int64_t end) {
    alignas(64) float part[kAmxRows * kPanel];
    int64_t configured = 0;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t p = b * kAmxPanels;
      const int64_t count = std::min<int64_t>(kAmxPanels, panels - p);
      const uint32_t* wb = w + p * panel_words;
      for (int64_t r0 = 0; r0 < rows; r0 += kAmxRows) {
        const int64_t m = std::min<int64_t>(kAmxRows, rows - r0);
        if (m != configured) {
          configure_tiles(m);
          configured = m;
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint16_t* xa = x + r0 * 2 * lines;
        for (int64_t k = 0; k < lines; k += kAmxLines) {
          const uint32_t* wk = wb + k * kPanel;
          if (k + kAmxAhead < lines) {
            for (int64_t c = 0; c < count; ++c) {
              const uint32_t* ahead = wk + c * panel_words + kAmxAhead * kPanel;
              for (int64_t l = 0; l < kAmxLines; ++l) prefetch(ahead + l * kPanel);
            }
          }
          _tile_loadd(4, xa + 2 * k, 4 * lines);
          _tile_loadd(5, wk, 64);
          _tile_dpbf16ps(0, 4, 5);
          if (count > 1) {
            _tile_loadd(6, wk + panel_words, 64);
            _tile_dpbf16ps(1, 4, 6);
          }
          if (count > 2) {
            _tile_loadd(5, wk + 2 * panel_words, 64);
            _tile_dpbf16ps(2, 4, 5);
          }
          if (count > 3) {
            _tile_loadd(6, wk + 3 * panel_words, 64);
            _tile_dpbf16ps(3, 4, 6);
          }
        }
        for (int64_t c = 0; c < count; ++c) {
          switch (c) {
            case 0: _tile_stored(0, part, 64); break;
            case 1: _tile_stored(1, part, 64); break;
            case 2: _tile_stored(2, part, 64); break;
            default: _tile_stored(3, part, 64); break;
          }
          // (not store_block: its 64-byte loads right after the tile store measured 64 rows
          // at 22-24 ms against 18-19 for the whole 121 projections)
          const int64_t first = (p + c) * kPanel;
          const int64_t lanes = std::min<int64_t>(kPanel, out_n - first);
          for (int64_t r = 0; r < m; ++r) {
            float* dst = y + (r0 + r) * out_n + first;
            for (int64_t l = 0; l < lanes; ++l) {
              dst[l] = part[r * kPanel + l] + (bias != nullptr ? bias[first + l] : 0.f);
            }
          }
        }
      }
    }
    if (configured != 0) _tile_release();
  });
}
#endif

}  // namespace

namespace kvtier_ops {

namespace {

// y = x W^T + b on code panels (above); their bits from the panels' last dim.
at::Tensor linear_codes(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& b32,
                        int64_t out_n) {
  const int64_t rows = x.size(0), in = x.size(1);
  const int64_t count = (out_n + kPanel - 1) / kPanel;
  const int64_t width = panels.dim() == 4 ? panels.size(3) : 0;
  const int bits = width == CodeLayout<4>::kPanelBytes ? 4
                   : width == CodeLayout<8>::kPanelBytes ? 8
                                                          : 0;
  TORCH_CHECK(bits != 0 && panels.is_contiguous() && panels.size(2) == kTilePanels,
              "linear_panels: code panels must be weight_codes' contiguous uint8 [G, B, 3, ",
              CodeLayout<4>::kPanelBytes, " or ", CodeLayout<8>::kPanelBytes, "]");
  TORCH_CHECK(out_n > 0 && panels.size(0) == (count + kTilePanels - 1) / kTilePanels &&
                  panels.size(1) == (in + kCodeK - 1) / kCodeK,
              "linear_panels: code panels must match x's I and hold out_features");
  at::Tensor y = at::empty({rows, out_n}, x.options());
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  const auto* wp = panels.data_ptr<uint8_t>();
  if (bits == 4) {
    linear_codes_of<4>(x.data_ptr<float>(), wp, bp, y.data_ptr<float>(), rows, in, out_n, count);
  } else {
    linear_codes_of<8>(x.data_ptr<float>(), wp, bp, y.data_ptr<float>(), rows, in, out_n, count);
  }
  return y;
}

// x [M, I] (contiguous float32) rounded to bf16 once, each row padded with zeros to
// `width` values (at least I): the rows the bf16 products read.
at::Tensor rounded_rows(const at::Tensor& x, int64_t width) {
  const int64_t rows = x.size(0), in = x.size(1);
  at::Tensor xb = at::empty({rows, width}, x.options().dtype(at::kBFloat16));
  auto* xr = reinterpret_cast<uint16_t*>(xb.data_ptr<at::BFloat16>());
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    round_bf16(xp + r * in, in, xr + r * width);
    std::fill(xr + r * width + in, xr + (r + 1) * width, uint16_t{0});
  }
  return xb;
}

// y = x W^T + b on bf16 code panels (above): x rounded to bf16 once, each row padded to
// whole blocks (zero), and each block's sum of the rounded x.
at::Tensor linear_codes_bf16(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& b32,
                             int64_t out_n) {
  const int64_t rows = x.size(0), in = x.size(1);
  const int64_t count = (out_n + kPanel - 1) / kPanel;
  const int64_t lines = panels.size(3);
  const int bits = lines * 64 == CodeLayout<4>::kPanelBytes ? 4
                   : lines * 64 == CodeLayout<8>::kPanelBytes ? 8
                                                               : 0;
  TORCH_CHECK(bits != 0 && panels.is_contiguous() && panels.size(2) == kTilePanels &&
                  panels.size(4) == 64,
              "linear_panels: bf16 code panels must be weight_codes' contiguous uint8 [G, B, 3, ",
              CodeLayout<4>::kPanelBytes / 64, " or ", CodeLayout<8>::kPanelBytes / 64, ", 64]");
  const int64_t blocks = (in + kCodeK - 1) / kCodeK;
  TORCH_CHECK(out_n > 0 && panels.size(0) == (count + kTilePanels - 1) / kTilePanels &&
                  panels.size(1) == blocks,
              "linear_panels: code panels must match x's I and hold out_features");
  const at::Tensor xb = rounded_rows(x, blocks * kCodeK);
  const auto* xr = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  at::Tensor sums = at::empty({rows, blocks}, x.options());
  float* sp = sums.data_ptr<float>();
  for (int64_t i = 0; i < rows * blocks; ++i) {  // row r's block b is i = r * blocks + b
    float sum = 0.f;
    for (int64_t k = i * kCodeK; k < (i + 1) * kCodeK; ++k) {
      sum += bits_float(static_cast<uint32_t>(xr[k]) << 16);
    }
    sp[i] = sum;
  }
  at::Tensor y = at::empty({rows, out_n}, x.options());
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  const auto* wp = panels.data_ptr<uint8_t>();
  const auto* xw = reinterpret_cast<const uint32_t*>(xr);
  if (bits == 4) {
    linear_codes_bf16_of<4>(xw, sp, wp, bp, y.data_ptr<float>(), rows, blocks, out_n, count);
  } else {
    linear_codes_bf16_of<8>(xw, sp, wp, bp, y.data_ptr<float>(), rows, blocks, out_n, count);
  }
  return y;
}

}  // namespace

at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels,
                         const c10::optional<at::Tensor>& bias, int64_t out_n,
                         const c10::optional<at::Tensor>& scales) {
  const auto wtype = panels.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "linear_panels: x must be a contiguous float32 [M, I]");
  at::Tensor b32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == out_n,
                "linear_panels: bias must be [out_features]");
    b32 = bias->to(at::kFloat).contiguous();
  }
  const bool scaled = scales.has_value() && scales->defined();
  if (wtype == at::kByte) {
    TORCH_CHECK(!scaled, "linear_panels: int8 panels take scales, and only they");
    return panels.dim() == 5 ? linear_codes_bf16(x, panels, b32, out_n)
                             : linear_codes(x, panels, b32, out_n);
  }
  const bool pairs = wtype == at::kBFloat16, quads = wtype == at::kChar;
  const int64_t rows = x.size(0), in = x.size(1), count = panels.size(0);
  const int64_t lines = pairs ? (in + 1) / 2 : in;
  TORCH_CHECK(panels.is_contiguous() && panels.size(0) > 0 &&
                  (wtype == at::kFloat || pairs || quads) &&
                  panels.dim() == (pairs ? 4 : 3) && panels.size(2) == kPanel &&
                  (!pairs || panels.size(3) == 2),
              "linear_panels: panels must be pack_panels' contiguous [P, I, 16] (float32 or "
              "int8) or [P, ceil(I / 2), 16, 2] (bfloat16)");
  TORCH_CHECK(panels.size(1) == lines && out_n > 0 && (out_n + kPanel - 1) / kPanel == count,
              "linear_panels: panels must match x's I and hold out_features");
  TORCH_CHECK(scaled == quads, "linear_panels: int8 panels take scales, and only they");
  if (quads) {
    TORCH_CHECK(scales->dim() == 1 && scales->numel() == out_n && scales->is_contiguous() &&
                    scales->scalar_type() == at::kFloat,
                "linear_panels: scales must be a contiguous float32 [out_features]");
  }
  at::Tensor y = at::empty({rows, out_n}, x.options());
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  if (pairs) {
    // x rounded to bf16 once, each row padded to the panels' even width (zero past I)
    const at::Tensor xb = rounded_rows(x, 2 * lines);
    const auto* xr = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
    const auto* wp = reinterpret_cast<const uint32_t*>(panels.data_ptr<at::BFloat16>());
    const auto* xw = reinterpret_cast<const uint32_t*>(xr);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (lines % kAmxLines == 0 && kvtier_amx::granted()) {
      linear_amx(xr, wp, bp, y.data_ptr<float>(), rows, lines, out_n, count);
      return y;
    }
#endif
#ifdef __AVX512BF16__
    linear_panels_of<Bf16DotLines>(xw, wp, bp, y.data_ptr<float>(), rows, lines, out_n, count);
#else
    linear_panels_of<Bf16PairLines>(xw, wp, bp, y.data_ptr<float>(), rows, lines, out_n, count);
#endif
  } else if (quads) {
    linear_panels_of<Int8Lines>(xp, panels.data_ptr<int8_t>(), bp, y.data_ptr<float>(), rows,
                                in, out_n, count, scales->data_ptr<float>());
  } else {
    linear_panels_of<Float32Lines>(xp, panels.data_ptr<float>(), bp, y.data_ptr<float>(), rows,
                                   in, out_n, count);
  }
  return y;
}

}  // namespace kvtier_ops

TORCH_LIBRARY_FRAGMENT(kvtier_cpu, m) {
  m.def("pack_panels(Tensor w) -> Tensor");
  m.def(
      "linear_panels(Tensor x, Tensor panels, Tensor? bias, int out_features, "
      "Tensor? scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvtier_cpu, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("linear_panels", &kvtier_ops::linear_panels);
}

// The chunk codecs' kernels (kvtier.codec), registered as torch.ops.kvtier_cpu.*:
//
//   kivi_encode(chunk, k_min, v_min, k_step, v_step, codes, bits)   int8 / int4, KIVI
//   kivi_decode(k_min, v_min, k_step, v_step, codes, bits, out)
//   fp8_encode(chunk, scale, codes)                                  e4m3, one scale a block
//   fp8_decode(scale, codes, out)
//
//   chunk, out   float32 [L, 2, H, T, D] (any strides, the last one 1)
//   k_min fp32 [L, H, 1, D], v_min fp32 [L, H, T, 1], k_step fp16 [L, H, 1, D],
//   v_step fp16 [L, H, T, 1], codes uint8 (8 bits: [L, 2, H, T, D]; 4 bits: two codes a
//   byte, low nibble first); scale fp32 [L, 2, H, 1, 1], codes float8_e4m3fn [L, 2, H, T, D]
//   (the sections of the codecs' flat buffers, contiguous).
//
// Bit-identical to the codecs' torch path, by doing the same float operations in the same
// order, each rounded once (no FMA contraction in this file): encode's offsets are the
// group's min clamped to fp16's range, plus 0 (a zero min is stored as +0 whichever zero a
// min picked), its steps (max - min) / levels clamped to [1e-6,
// 65504] and rounded to fp16, its codes round-half-even(clamp((x - min) / step, 0, levels))
// (clamping first changes nothing: the bounds are integers); fp8's scale is max|x| / 448
// (at least 1e-12), its codes x / scale clamped to +-448 and rounded to e4m3 as c10's
// fp8e4m3fn_from_fp32_value does. Decode writes min + code * step, or code * scale, straight
// into `out`, with no temporaries.
//
// Threads: none. Each call runs on its caller's thread: a link's worker or a tier's writer,
// one per hop, while the compute thread owns torch's OpenMP pool and every core; a codec
// fanning out too would make both fight over 2 cores here (a decode is ~10 ms a chunk).

#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

#pragma GCC optimize("fp-contract=off")

namespace {

using namespace kvtier_vec;

typedef uint8_t vbyte __attribute__((vector_size(16)));
typedef uint32_t vuint __attribute__((vector_size(64)));

constexpr float kFp16Max = 65504.f;
constexpr float kMinStep = 1e-6f;
constexpr float kE4m3Max = 448.f;
constexpr float kMinScale = 1e-12f;
constexpr float kRound = 8388608.f;  // 2^23: (q + 2^23) - 2^23 rounds 0 <= q < 2^23 half-even

inline vfloat vmin(vfloat a, vfloat b) { return a < b ? a : b; }
inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

// Rows of a [L, 2, H, T, D] float32 tensor whose last stride is 1.
struct Rows {
  float* base;
  int64_t s0, s1, s2, s3;
  explicit Rows(const at::Tensor& t)
      : base(t.data_ptr<float>()), s0(t.stride(0)), s1(t.stride(1)), s2(t.stride(2)),
        s3(t.stride(3)) {}
  float* operator()(int64_t l, int64_t kv, int64_t h, int64_t t) const {
    return base + l * s0 + kv * s1 + h * s2 + t * s3;
  }
};

void check_chunk(const char* op, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 5 &&
                  t.size(1) == 2 && (t.stride(4) == 1 || t.size(4) == 1),
              op, ": the chunk must be float32 [L, 2, H, T, D] on the CPU, last stride 1");
}

void check_section(const char* op, const at::Tensor& t, at::ScalarType dtype, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype &&
                  t.numel() == numel,
              op, ": a section of the encoded buffer has the wrong dtype, size or layout");
}

// The group's offset and step from its min and max (stored), and the step as float.
inline float group_params(float lo, float hi, float levels, float* min_out, c10::Half* step_out) {
  lo = std::min(std::max(lo, -kFp16Max), kFp16Max) + 0.f;  // -0 -> +0, as torch's path
  float step = (hi - lo) / levels;
  step = std::min(std::max(step, kMinStep), kFp16Max);
  *min_out = lo;
  *step_out = c10::Half(step);
  return static_cast<float>(*step_out);
}

inline float code_of(float x, float lo, float step, float levels) {
  const float q = std::min(std::max((x - lo) / step, 0.f), levels);
  return (q + kRound) - kRound;
}

inline vfloat code_of(vfloat x, vfloat lo, vfloat step, float levels) {
  const vfloat q = vmin(vmax((x - lo) / step, vfloat{}), splat(levels));
  return (q + kRound) - kRound;
}

// One row's codes q[0, D): lo/step per element (keys: per channel) when `per_channel`,
// else lo[0]/step[0] for all (values: per token).
void quantize_row(const float* x, const float* lo, const float* step, bool per_channel,
                  int64_t dim, float levels, uint8_t* q) {
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    const vfloat l = per_channel ? load(lo + d) : splat(lo[0]);
    const vfloat s = per_channel ? load(step + d) : splat(step[0]);
    const vbyte c = __builtin_convertvector(
        __builtin_convertvector(code_of(load(x + d), l, s, levels), vint), vbyte);
    std::memcpy(q + d, &c, sizeof c);
  }
  for (; d < dim; ++d) {
    const int64_t i = per_channel ? d : 0;
    q[d] = static_cast<uint8_t>(code_of(x[d], lo[i], step[i], levels));
  }
}

// Write one row's codes: as they are (8 bits) or two a byte, low nibble first (4 bits).
inline void put_codes(const uint8_t* q, int64_t dim, int64_t bits, uint8_t* dst) {
  if (bits == 8) {
    std::memcpy(dst, q, dim);
    return;
  }
  for (int64_t j = 0; j < dim / 2; ++j) dst[j] = q[2 * j] | static_cast<uint8_t>(q[2 * j + 1] << 4);
}

// The checks both KIVI directions share: ``chunk`` (the fp32 side) and the encoded sections
// (offsets fp32, steps fp16, codes bytes) sized for it at ``bits``.
void check_kivi(const char* op, const at::Tensor& chunk, const at::Tensor& k_min,
                const at::Tensor& v_min, const at::Tensor& k_step, const at::Tensor& v_step,
                const at::Tensor& codes, int64_t bits) {
  check_chunk(op, chunk);
  TORCH_CHECK(bits == 8 || (bits == 4 && chunk.size(4) % 2 == 0), op,
              ": bits must be 8, or 4 with an even head dim");
  const int64_t L = chunk.size(0), H = chunk.size(2), T = chunk.size(3), D = chunk.size(4);
  check_section(op, k_min, at::kFloat, L * H * D);
  check_section(op, v_min, at::kFloat, L * H * T);
  check_section(op, k_step, at::kHalf, L * H * D);
  check_section(op, v_step, at::kHalf, L * H * T);
  check_section(op, codes, at::kByte, L * 2 * H * T * D * bits / 8);
}

void kivi_encode(const at::Tensor& chunk, at::Tensor& k_min, at::Tensor& v_min,
                 at::Tensor& k_step, at::Tensor& v_step, at::Tensor& codes, int64_t bits) {
  check_kivi("kivi_encode", chunk, k_min, v_min, k_step, v_step, codes, bits);
  const int64_t L = chunk.size(0), H = chunk.size(2), T = chunk.size(3), D = chunk.size(4);
  const Rows x(chunk);
  const float levels = static_cast<float>((1 << bits) - 1);
  float* kmin = k_min.data_ptr<float>();
  float* vmin_p = v_min.data_ptr<float>();
  c10::Half* kstep = k_step.data_ptr<c10::Half>();
  c10::Half* vstep = v_step.data_ptr<c10::Half>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  const int64_t row_bytes = D * bits / 8;
  std::vector<float> hi(D), stepf(D);
  std::vector<uint8_t> q(D);
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t h = 0; h < H; ++h) {
      // Keys [T, D]: per channel over the tokens.
      float* lo = kmin + (l * H + h) * D;
      std::copy_n(x(l, 0, h, 0), D, lo);
      std::copy_n(x(l, 0, h, 0), D, hi.data());
      for (int64_t t = 1; t < T; ++t) {
        const float* row = x(l, 0, h, t);
        int64_t d = 0;
        for (; d + kLanes <= D; d += kLanes) {
          store(lo + d, vmin(load(lo + d), load(row + d)));
          store(hi.data() + d, vmax(load(hi.data() + d), load(row + d)));
        }
        for (; d < D; ++d) {
          lo[d] = std::min(lo[d], row[d]);
          hi[d] = std::max(hi[d], row[d]);
        }
      }
      c10::Half* st = kstep + (l * H + h) * D;
      for (int64_t d = 0; d < D; ++d) stepf[d] = group_params(lo[d], hi[d], levels, lo + d, st + d);
      uint8_t* dst = out + ((l * 2) * H + h) * T * row_bytes;
      for (int64_t t = 0; t < T; ++t) {
        quantize_row(x(l, 0, h, t), lo, stepf.data(), true, D, levels, q.data());
        put_codes(q.data(), D, bits, dst + t * row_bytes);
      }
      // Values [T, D]: per token over the channels.
      dst = out + ((l * 2 + 1) * H + h) * T * row_bytes;
      for (int64_t t = 0; t < T; ++t) {
        const float* row = x(l, 1, h, t);
        float mn = row[0], mx = row[0];
        for (int64_t d = 1; d < D; ++d) {
          mn = std::min(mn, row[d]);
          mx = std::max(mx, row[d]);
        }
        const int64_t g = (l * H + h) * T + t;
        const float s = group_params(mn, mx, levels, vmin_p + g, vstep + g);
        quantize_row(row, vmin_p + g, &s, false, D, levels, q.data());
        put_codes(q.data(), D, bits, dst + t * row_bytes);
      }
    }
  }
}

// out[d] = lo + code * step for one row of 8-bit codes (per channel when `per_channel`).
void dequantize_row(const uint8_t* c, const float* lo, const float* step, bool per_channel,
                    int64_t dim, float* out) {
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    vbyte b;
    std::memcpy(&b, c + d, sizeof b);
    const vfloat l = per_channel ? load(lo + d) : splat(lo[0]);
    const vfloat s = per_channel ? load(step + d) : splat(step[0]);
    const vfloat prod = __builtin_convertvector(b, vfloat) * s;
    store(out + d, l + prod);
  }
  for (; d < dim; ++d) {
    const int64_t i = per_channel ? d : 0;
    const float prod = static_cast<float>(c[d]) * step[i];
    out[d] = lo[i] + prod;
  }
}

void kivi_decode(const at::Tensor& k_min, const at::Tensor& v_min, const at::Tensor& k_step,
                 const at::Tensor& v_step, const at::Tensor& codes, int64_t bits,
                 at::Tensor& out) {
  check_kivi("kivi_decode", out, k_min, v_min, k_step, v_step, codes, bits);
  const int64_t L = out.size(0), H = out.size(2), T = out.size(3), D = out.size(4);
  const Rows y(out);
  const float* kmin = k_min.data_ptr<float>();
  const float* vmin_p = v_min.data_ptr<float>();
  const c10::Half* kstep = k_step.data_ptr<c10::Half>();
  const c10::Half* vstep = v_step.data_ptr<c10::Half>();
  const uint8_t* in = codes.data_ptr<uint8_t>();
  const int64_t row_bytes = D * bits / 8;
  std::vector<float> stepf(D);
  std::vector<uint8_t> q(D);
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t kv = 0; kv < 2; ++kv) {
        const uint8_t* src = in + ((l * 2 + kv) * H + h) * T * row_bytes;
        if (kv == 0) {
          for (int64_t d = 0; d < D; ++d) stepf[d] = static_cast<float>(kstep[(l * H + h) * D + d]);
        }
        for (int64_t t = 0; t < T; ++t) {
          const uint8_t* c = src + t * row_bytes;
          if (bits == 4) {
            for (int64_t j = 0; j < D / 2; ++j) {
              q[2 * j] = c[j] & 15;
              q[2 * j + 1] = c[j] >> 4;
            }
            c = q.data();
          }
          if (kv == 0) {
            dequantize_row(c, kmin + (l * H + h) * D, stepf.data(), true, D, y(l, 0, h, t));
          } else {
            const int64_t g = (l * H + h) * T + t;
            const float s = static_cast<float>(vstep[g]);
            dequantize_row(c, vmin_p + g, &s, false, D, y(l, 1, h, t));
          }
        }
      }
    }
  }
}

// c10::detail::fp8e4m3fn_from_fp32_value on 16 lanes, for |f| <= 448 (no NaN).
inline vbyte e4m3_of(vfloat f) {
  vuint bits;
  std::memcpy(&bits, &f, sizeof bits);
  const vuint sign = bits & 0x80000000u;
  bits ^= sign;
  const vuint small = (vuint)(bits < (121u << 23));  // below e4m3's smallest normal, 2^-6
  constexpr uint32_t denorm_mask = 141u << 23;
  vfloat mag;
  std::memcpy(&mag, &bits, sizeof mag);
  float denorm_f;
  std::memcpy(&denorm_f, &denorm_mask, sizeof denorm_f);
  const vfloat shifted = mag + denorm_f;
  vuint denorm;
  std::memcpy(&denorm, &shifted, sizeof denorm);
  denorm -= denorm_mask;
  const vuint mant_odd = (bits >> 20) & 1u;
  const vuint normal = (bits + (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + mant_odd) >> 20;
  const vuint result = ((small & denorm) | (~small & normal) | (sign >> 24)) & 0xFFu;
  return __builtin_convertvector(result, vbyte);
}

void fp8_encode(const at::Tensor& chunk, at::Tensor& scale, at::Tensor& codes) {
  check_chunk("fp8_encode", chunk);
  const int64_t L = chunk.size(0), H = chunk.size(2), T = chunk.size(3), D = chunk.size(4);
  check_section("fp8_encode", scale, at::kFloat, L * 2 * H);
  check_section("fp8_encode", codes, at::kFloat8_e4m3fn, L * 2 * H * T * D);
  const Rows x(chunk);
  float* sc = scale.data_ptr<float>();
  uint8_t* out = static_cast<uint8_t*>(codes.data_ptr());
  for (int64_t b = 0; b < L * 2 * H; ++b) {
    const int64_t l = b / (2 * H), kv = b / H % 2, h = b % H;
    vfloat vbig{};
    float big = 0.f;
    for (int64_t t = 0; t < T; ++t) {
      const float* row = x(l, kv, h, t);
      int64_t d = 0;
      for (; d + kLanes <= D; d += kLanes) {
        const vfloat v = load(row + d);
        vbig = vmax(vbig, v < 0.f ? -v : v);
      }
      for (; d < D; ++d) big = std::max(big, std::abs(row[d]));
    }
    for (int64_t i = 0; i < kLanes; ++i) big = std::max(big, vbig[i]);
    const float s = std::max(big / kE4m3Max, kMinScale);
    sc[b] = s;
    uint8_t* dst = out + b * T * D;
    for (int64_t t = 0; t < T; ++t) {
      const float* row = x(l, kv, h, t);
      int64_t d = 0;
      for (; d + kLanes <= D; d += kLanes) {
        const vbyte c = e4m3_of(vmin(vmax(load(row + d) / s, splat(-kE4m3Max)), splat(kE4m3Max)));
        std::memcpy(dst + t * D + d, &c, sizeof c);
      }
      for (; d < D; ++d) {
        const float y = std::min(std::max(row[d] / s, -kE4m3Max), kE4m3Max);
        dst[t * D + d] = c10::detail::fp8e4m3fn_from_fp32_value(y);
      }
    }
  }
}

const std::array<float, 256>& e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = c10::detail::fp8e4m3fn_to_fp32_value(i);
    return t;
  }();
  return table;
}

void fp8_decode(const at::Tensor& scale, const at::Tensor& codes, at::Tensor& out) {
  check_chunk("fp8_decode", out);
  const int64_t L = out.size(0), H = out.size(2), T = out.size(3), D = out.size(4);
  check_section("fp8_decode", scale, at::kFloat, L * 2 * H);
  check_section("fp8_decode", codes, at::kFloat8_e4m3fn, L * 2 * H * T * D);
  const Rows y(out);
  const float* sc = scale.data_ptr<float>();
  const uint8_t* in = static_cast<const uint8_t*>(codes.data_ptr());
  const float* value = e4m3_values().data();
  for (int64_t b = 0; b < L * 2 * H; ++b) {
    const int64_t l = b / (2 * H), kv = b / H % 2, h = b % H;
    const float s = sc[b];
    const uint8_t* src = in + b * T * D;
    for (int64_t t = 0; t < T; ++t) {
      float* row = y(l, kv, h, t);
      const uint8_t* c = src + t * D;
      for (int64_t d = 0; d < D; ++d) row[d] = value[c[d]] * s;
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtier_cpu, m) {
  m.def(
      "kivi_encode(Tensor chunk, Tensor(a!) k_min, Tensor(b!) v_min, Tensor(c!) k_step, "
      "Tensor(d!) v_step, Tensor(e!) codes, int bits) -> ()");
  m.def(
      "kivi_decode(Tensor k_min, Tensor v_min, Tensor k_step, Tensor v_step, Tensor codes, "
      "int bits, Tensor(a!) out) -> ()");
  m.def("fp8_encode(Tensor chunk, Tensor(a!) scale, Tensor(b!) codes) -> ()");
  m.def("fp8_decode(Tensor scale, Tensor codes, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvtier_cpu, CPU, m) {
  m.impl("kivi_encode", &kivi_encode);
  m.impl("kivi_decode", &kivi_decode);
  m.impl("fp8_encode", &fp8_encode);
  m.impl("fp8_decode", &fp8_decode);
}

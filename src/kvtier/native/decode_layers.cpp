// decode_layers: every decoder layer of a Llama-family model over a decode batch's rows in
// one call, registered as torch.ops.kvtier_cpu.decode_layers.
//
// It runs the same operators, on the same tensors and in the same order, as
// LlamaModel._forward_native's layer loop when every row of the step is a decode row of one
// seat slab and every projection takes linear_panels: per layer linear_panels (q/k/v),
// rope_ on q and k, decode_attend (the new K/V into the rows' tails, then attention),
// linear_panels (o), add_rms_norm, linear_panels (gate/up), silu_mul, linear_panels
// (down), then add_rms_norm with the next layer's input norm (the last layer: h += down).
// So its result is bit for bit the loop's; what it saves is the loop itself: about 15
// calls a layer from Python through the dispatcher, with their views and checks (2-3 ms of
// a 23 ms batch-1 step of SmolLM2-135M on the 2-core AMD EPYC).
//
// h [N, H] (contiguous float32): the residual stream, the embedded tokens on entry and
// the last layer's output on return (mutated in place). cos/sin [N, D] as rope_ takes
// them. weights: per layer, in order, input_norm [H], qkv panels, o panels, post_norm [H],
// gate_up panels, down panels (any form linear_panels takes: pack_panels' float32 or
// bfloat16 pairs, or weight_codes' code panels); inner: the MLP's width; biases: per
// layer qkv, o, gate_up, down (each None or [out]). slab, seats, tail_pos, lo, hi, rows as
// decode_attend takes them (its layer index is the position in the lists; the slab is
// mutated: each layer's new K/V). Threads: each operator's own (kvtier_pool for up to 64
// rows). Inputs are checked here or by the operators.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "ops.h"

namespace {

constexpr int64_t kWeightsPerLayer = 6;
constexpr int64_t kBiasesPerLayer = 4;

void decode_layers(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                   at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                   const at::Tensor& slab, const at::Tensor& seats, const at::Tensor& tail_pos,
                   const at::Tensor& lo, const at::Tensor& hi, const at::Tensor& rows,
                   int64_t num_heads, int64_t num_kv_heads, int64_t inner, double scale,
                   double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kFloat,
              "decode_layers: h must be a contiguous float32 [N, H]");
  const int64_t layers = static_cast<int64_t>(weights.size()) / kWeightsPerLayer;
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer &&
                  static_cast<int64_t>(biases.size()) == layers * kBiasesPerLayer,
              "decode_layers: 6 weights and 4 biases per layer");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "decode_layers: num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(slab.dim() == 7 && slab.size(1) == layers,
              "decode_layers: the slab must hold one entry per layer");
  const int64_t n = h.size(0), hidden = h.size(1), dim = slab.size(6);
  const int64_t q_width = num_heads * dim, kv_width = num_kv_heads * dim;
  auto bias = [&](int64_t layer, int64_t which) -> std::optional<at::Tensor> {
    return biases.get(layer * kBiasesPerLayer + which);  // linear_panels takes None as none
  };
  auto weight = [&](int64_t layer, int64_t which) -> const at::Tensor& {
    return weights[layer * kWeightsPerLayer + which];
  };
  at::Tensor x = kvtier_ops::rms_norm(h, weight(0, 0), eps);
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor qkv =
        kvtier_ops::linear_panels(x, weight(layer, 1), bias(layer, 0), q_width + 2 * kv_width);
    const at::Tensor q = qkv.narrow(1, 0, q_width).view({n, num_heads, dim});
    const at::Tensor k = qkv.narrow(1, q_width, kv_width).view({n, num_kv_heads, dim});
    const at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width).view({n, num_kv_heads, dim});
    kvtier_ops::rope_(q, cos, sin);
    kvtier_ops::rope_(k, cos, sin);
    const at::Tensor out = at::empty({n, num_heads, dim}, h.options());
    kvtier_ops::decode_attend(slab, layer, seats, tail_pos, lo, hi, rows, q.transpose(0, 1),
                              k.transpose(0, 1), v.transpose(0, 1), out, std::nullopt, scale);
    const at::Tensor o = kvtier_ops::linear_panels(out.view({n, q_width}), weight(layer, 2),
                                                   bias(layer, 1), hidden);
    x = kvtier_ops::add_rms_norm(h, o, weight(layer, 3), eps);
    const at::Tensor gate_up =
        kvtier_ops::linear_panels(x, weight(layer, 4), bias(layer, 2), 2 * inner);
    const at::Tensor down = kvtier_ops::linear_panels(kvtier_ops::silu_mul(gate_up),
                                                      weight(layer, 5), bias(layer, 3), hidden);
    if (layer + 1 < layers) {
      x = kvtier_ops::add_rms_norm(h, down, weight(layer + 1, 0), eps);
    } else {
      h.add_(down);
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtier_cpu, m) {
  m.def(
      "decode_layers(Tensor(a!) h, Tensor cos, Tensor sin, Tensor[] weights, Tensor?[] biases, "
      "Tensor(b!) slab, Tensor seats, Tensor tail_pos, Tensor lo, Tensor hi, Tensor rows, "
      "int num_heads, int num_kv_heads, int inner, float scale, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(kvtier_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }

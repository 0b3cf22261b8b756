// kvtier's CPU operators as C++ functions (kvtier_ops), for operators that compose them
// (decode_layers.cpp) without a trip through Python or the dispatcher. Each is also
// registered as torch.ops.kvtier_cpu.<name>; its contract (shapes, what it mutates,
// threads) is the comment at its definition in cpu_ops.cpp or linear_ops.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace kvtier_ops {

void decode_attend(const at::Tensor& slab, int64_t layer, const at::Tensor& seats,
                   const at::Tensor& tail_pos, const at::Tensor& lo, const at::Tensor& hi,
                   const at::Tensor& rows, const at::Tensor& query, const at::Tensor& new_k,
                   const at::Tensor& new_v, const at::Tensor& out,
                   const std::optional<at::Tensor>& lse, double scale);

// attend_prefill's input checks (attend_prefill.cpp): a c10::Error naming the mismatch.
void check_prefill(const at::Tensor& query, const at::Tensor& k_old, const at::Tensor& v_old,
                   const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& out);

// attend_prefill's contract for bf16 K/V on bf16 dot products (attend_bf16.cpp): AMX tiles,
// else AVX-512 BF16; false (nothing written) where the build has neither, or the head dim
// is not a multiple of 32. bf16_prefill_units: "amx", "avx512_bf16" or "".
bool attend_prefill_bf16(const at::Tensor& query, const at::Tensor& k_old,
                         const at::Tensor& v_old, const at::Tensor& k_new,
                         const at::Tensor& v_new, const at::Tensor& out, double scale);
const char* bf16_prefill_units();

void attend_slots(const at::Tensor& pool, int64_t layer, const at::Tensor& slots,
                  const at::Tensor& query, const at::Tensor& out, const at::Tensor& lse,
                  double scale);

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    bool bf16_out = false);

at::Tensor add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                        const at::Tensor& weight, double eps, bool bf16_out = false);

void rope_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

at::Tensor silu_mul(const at::Tensor& gate_up);

at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels,
                         const std::optional<at::Tensor>& bias, int64_t out_n,
                         const std::optional<at::Tensor>& scales = std::nullopt);

}  // namespace kvtier_ops

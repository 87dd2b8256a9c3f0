// The argument checks and dtype dispatch every tensor-side file of the CPU kernels shares
// (bindings.cpp, gemm_bindings.cpp, decode_bindings.cpp, quant_bindings.h): internal to each
// file that includes it.
#pragma once

#include <torch/extension.h>

#include "kernels.h"

namespace {

// Rows of a [T, H, D] view whose heads are contiguous rows of D (a slice of a fused QKV row).
void check_head_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              name, " must be [T, H, D] with contiguous heads");
}

// float32 or bfloat16, the same for every tensor of a glue op.
bool glue_dtype(const torch::Tensor& x) {
  return x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16;
}

// Calls f with a value of x's element type (float or c10::BFloat16): one dispatch for every op.
template <typename F>
void by_dtype(const torch::Tensor& x, const char* op, F&& f) {
  if (x.scalar_type() == torch::kFloat32)
    f(float{});
  else if (x.scalar_type() == torch::kBFloat16)
    f(c10::BFloat16{});
  else
    TORCH_CHECK(false, op, ": float32 or bfloat16 only");
}

// Calls f(T, WT) for an RMSNorm of x by weight w [n] (contiguous): WT is x's dtype (HF's
// convention), or float32 on bf16 x (Gemma's 1 + w, applied in float32 before one rounding).
template <typename F>
void by_norm_dtype(const torch::Tensor& x, const torch::Tensor& w, int64_t n, const char* op,
                   F&& f) {
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == n, op, ": weight must be a ",
              "contiguous [", n, "]");
  if (w.scalar_type() == x.scalar_type()) {
    by_dtype(x, op, [&](auto tag) { f(tag, tag); });
    return;
  }
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kFloat32, op,
              ": weight in x's dtype, or float32 on bfloat16 x");
  f(c10::BFloat16{}, float{});
}

// A GEMM's optional bias [N] as a pointer (null for none), refused unless contiguous T.
template <typename T = c10::BFloat16>
const T* linear_bias(const c10::optional<torch::Tensor>& bias, int64_t n, const char* op) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == c10::CppTypeToScalarType<T>::value &&
                  bias->is_contiguous() && bias->numel() == n,
              op, ": bias must be contiguous [N] in x's dtype");
  return bias->data_ptr<T>();
}

// The checks every packed-weight GEMM makes of x and of the weight it packs.
void check_gemm_x(const torch::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, op,
              ": x must be bfloat16 [M, K] with contiguous rows");
}
torch::Tensor pack_input(const torch::Tensor& weight, const char* op) {
  TORCH_CHECK((weight.dim() == 2 || weight.dim() == 3) && weight.scalar_type() == at::kBFloat16,
              op, ": weight must be bfloat16 [N, K] (or a stack of experts' [E, N, K])");
  return weight.contiguous();
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The attention sinks' logits (float32 [hq], contiguous) or nullptr where there are none.
const float* sink_logits(const c10::optional<torch::Tensor>& sinks, int64_t hq) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->scalar_type() == torch::kFloat32 && sinks->is_contiguous() &&
                  sinks->dim() == 1 && sinks->size(0) == hq,
              "sinks must be a contiguous float32 [num_qo_heads]");
  return sinks->data_ptr<float>();
}

}  // namespace

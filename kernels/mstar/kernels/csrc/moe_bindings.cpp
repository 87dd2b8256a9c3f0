// The tensor side of the MoE expert kernel: the packed layout told by the stacked weights'
// rank, shape, dtype and index checks, the output. Compiled once (like bindings.cpp) and linked
// into every level beside that level's moe.cpp. Only ATen's core headers: a few seconds to
// compile, where torch/extension.h takes a minute.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "moe.h"
#include "moe_ops.h"

namespace {

using mstar_cpu::ExpertLayout;

int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// The layout of a stacked packed weight [E, ...] by its rank (fma 4, dpbf16 5, amx 6), checked
// against the projection's [n, k]; fills everything of `proj` but its pointers.
template <typename T>
ExpertLayout check_stack(const at::Tensor& w, int64_t experts, int64_t n, int64_t k,
                         const char* name, mstar_cpu::ExpertProj<T>& proj) {
  TORCH_CHECK(w.is_contiguous() && w.dim() >= 4 && w.dim() <= 6 && w.size(0) == experts,
              "moe_experts: ", name, " must be a contiguous stack of packed expert weights");
  proj.stride = w.stride(0);
  proj.n = n;
  proj.k = k;
  proj.panels = w.size(1);
  proj.steps = 0;
  if (w.dim() == 4) {
    TORCH_CHECK(w.size(1) == ceil_div(n, mstar_cpu::kFmaCols) && w.size(2) == k &&
                    w.size(3) == mstar_cpu::kFmaCols,
                "moe_experts: ", name, " is not an fma_pack_weight stack of [", n, ", ", k, "]");
    return ExpertLayout::kFma;
  }
  if (w.dim() == 5) {
    TORCH_CHECK(w.size(1) == ceil_div(n, mstar_cpu::kDotCols) && w.size(2) == (k + 1) / 2 &&
                    w.size(3) == mstar_cpu::kDotCols && w.size(4) == 2,
                "moe_experts: ", name, " is not a dpbf16_pack_weight stack of [", n, ", ", k, "]");
    return ExpertLayout::kDotBf16;
  }
  proj.steps = w.size(2);
  TORCH_CHECK(w.size(1) == ceil_div(n, mstar_cpu::kAmxPanelCols) &&
                  w.size(2) == ceil_div(k, mstar_cpu::kAmxTileK) && w.size(3) == 16 &&
                  w.size(4) == 2 && w.size(5) == 32,
              "moe_experts: ", name, " is not an amx_pack_weight stack of [", n, ", ", k, "]");
  return ExpertLayout::kAmx;
}

template <typename T>
const T* bias_of(const std::optional<at::Tensor>& bias, int64_t experts, int64_t n,
                 const char* name) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == c10::CppTypeToScalarType<T>::value &&
                  bias->is_contiguous() && bias->dim() == 2 && bias->size(0) == experts &&
                  bias->size(1) == n,
              "moe_experts: ", name, " must be contiguous [E, ", n, "] in x's dtype");
  return bias->data_ptr<T>();
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
         const at::Tensor& gate_up, const std::optional<at::Tensor>& gate_up_bias,
         const at::Tensor& down, const std::optional<at::Tensor>& down_bias, int64_t inter,
         int64_t activation, double alpha, double limit, at::Tensor& out) {
  const int64_t experts = gate_up.size(0), hidden = x.size(1);
  mstar_cpu::ExpertMlp<T> mlp{};
  mlp.layout = check_stack(gate_up, experts, 2 * inter, hidden, "gate_up", mlp.gate_up);
  TORCH_CHECK(check_stack(down, experts, hidden, inter, "down", mlp.down) == mlp.layout,
              "moe_experts: gate_up and down are packed in different layouts");
  TORCH_CHECK(gate_up.scalar_type() == x.scalar_type() && down.scalar_type() == x.scalar_type(),
              "moe_experts: the packed weights must be in x's dtype");
  if (std::is_same_v<T, float>)
    TORCH_CHECK(mlp.layout == ExpertLayout::kFma, "moe_experts: float32 runs the fma layout only");
  if (mlp.layout == ExpertLayout::kDotBf16)
    TORCH_CHECK(mstar_cpu::dpbf16_compiled(), "moe_experts: this level has no AVX512-BF16");
  if (mlp.layout == ExpertLayout::kAmx)
    TORCH_CHECK(mstar_cpu::amx_compiled() && mstar_cpu::request_amx(),
                "moe_experts: this CPU or build has no AMX bf16 tiles");
  TORCH_CHECK(activation == 0 || activation == 1, "moe_experts: activation is 0 or 1");
  mlp.gate_up.packed = gate_up.data_ptr<T>();
  mlp.gate_up.bias = bias_of<T>(gate_up_bias, experts, 2 * inter, "gate_up_bias");
  mlp.down.packed = down.data_ptr<T>();
  mlp.down.bias = bias_of<T>(down_bias, experts, hidden, "down_bias");
  mlp.act = static_cast<mstar_cpu::ExpertAct>(activation);
  mlp.alpha = static_cast<float>(alpha);
  mlp.limit = static_cast<float>(limit);
  mstar_cpu::moe_experts(x.data_ptr<T>(), x.stride(0), x.size(0), ids.data_ptr<int64_t>(),
                         weights.data_ptr<float>(), ids.size(1), experts, mlp, out.data_ptr<T>(),
                         out.stride(0));
}

}  // namespace

at::Tensor moe_experts(at::Tensor x, at::Tensor topk_ids, at::Tensor topk_weights,
                       at::Tensor gate_up, std::optional<at::Tensor> gate_up_bias,
                       at::Tensor down, std::optional<at::Tensor> down_bias, int64_t inter,
                       int64_t activation, double alpha, double limit) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "moe_experts: x must be float32 or bfloat16 [T, H] with contiguous rows");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) && topk_ids.is_contiguous() &&
                  topk_ids.scalar_type() == at::kLong,
              "moe_experts: topk_ids must be a contiguous int64 [T, k]");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.is_contiguous() &&
                  topk_weights.scalar_type() == at::kFloat,
              "moe_experts: topk_weights must be a contiguous float32 [T, k] like topk_ids");
  TORCH_CHECK(inter > 0 && gate_up.dim() >= 4, "moe_experts: bad inter or gate_up");
  const int64_t experts = gate_up.size(0);
  const auto* ids = topk_ids.data_ptr<int64_t>();
  for (int64_t f = 0; f < topk_ids.numel(); ++f)
    TORCH_CHECK(ids[f] >= 0 && ids[f] < experts, "moe_experts: expert id ", ids[f],
                " is outside [0, ", experts, ")");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.size(0) == 0) return out;
  if (x.scalar_type() == at::kFloat)
    run<float>(x, topk_ids, topk_weights, gate_up, gate_up_bias, down, down_bias, inter,
               activation, alpha, limit, out);
  else
    run<c10::BFloat16>(x, topk_ids, topk_weights, gate_up, gate_up_bias, down, down_bias, inter,
                       activation, alpha, limit, out);
  return out;
}

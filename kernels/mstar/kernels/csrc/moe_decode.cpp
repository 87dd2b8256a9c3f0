// An MoE block's router top-k and experts in C++ (moe_decode.h), for the layer path and the
// fused decode step alike: a decode step's MoE layers then run without a Python op between
// `decode_layers`' kernels (the layer path's routing was ~6 torch ops a layer). Compiled once,
// like the other tensor-side files; the routing is scalar float32 math over E logits a row.
#include "moe_decode.h"

#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <utility>

#include "glue_ops.h"  // small_linear (gemm_bindings.cpp)
#include "moe_ops.h"

namespace {

// Row t's logits [E] (float32 or bf16) -> its top_k expert ids and float32 weights, as
// transformers' routers compute them (softmax in float32; the top k by value, the lower index
// first on a tie; the renormalising sum over the choices in order).
template <typename T>
void route_row(const T* logits, int64_t experts, int64_t top_k, int64_t scoring,
               bool renormalize, bool round_weights, std::vector<float>& scores, int64_t* ids,
               float* weights) {
  scores.assign(logits, logits + experts);  // widened: exact
  if (scoring == 0) {  // softmax over every expert, then the top k
    float max = scores[0], sum = 0.f;
    for (const float s : scores) max = std::max(max, s);
    for (float& s : scores) sum += (s = std::exp(s - max));
    for (float& s : scores) s /= sum;
  }
  for (int64_t j = 0; j < top_k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < experts; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || ids[i] == e;
      if (!taken && (best < 0 || scores[e] > scores[best])) best = e;
    }
    ids[j] = best;
    weights[j] = scores[best];
  }
  float sum = 0.f;
  if (scoring == 1) {  // softmax over the k chosen logits, in the model's dtype
    const float max = weights[0];
    for (int64_t j = 0; j < top_k; ++j) sum += (weights[j] = std::exp(weights[j] - max));
    for (int64_t j = 0; j < top_k; ++j) weights[j] = static_cast<float>(T(weights[j] / sum));
  } else if (renormalize) {
    for (int64_t j = 0; j < top_k; ++j) sum += weights[j];
    for (int64_t j = 0; j < top_k; ++j) weights[j] /= sum;
  }
  if (round_weights)
    for (int64_t j = 0; j < top_k; ++j) weights[j] = static_cast<float>(T(weights[j]));
}

thread_local const MoeDecode* active_decode = nullptr;

}  // namespace

MoeLayer::MoeLayer(at::Tensor gate_up, std::optional<at::Tensor> gate_up_bias, at::Tensor down,
                   std::optional<at::Tensor> down_bias, int64_t inter, int64_t activation,
                   double alpha, double limit, int64_t top_k, int64_t scoring, bool renormalize,
                   bool round_weights)
    : gate_up_(std::move(gate_up)),
      down_(std::move(down)),
      gate_up_bias_(std::move(gate_up_bias)),
      down_bias_(std::move(down_bias)),
      inter_(inter),
      activation_(activation),
      top_k_(top_k),
      scoring_(scoring),
      alpha_(alpha),
      limit_(limit),
      renormalize_(renormalize),
      round_weights_(round_weights) {
  TORCH_CHECK(gate_up_.dim() >= 4, "MoeLayer: gate_up must be a stack of packed expert weights");
  TORCH_CHECK(top_k > 0 && top_k <= gate_up_.size(0), "MoeLayer: top_k must be in [1, ",
              gate_up_.size(0), "]");
  TORCH_CHECK(scoring == 0 || scoring == 1, "MoeLayer: scoring is 0 (softmax first) or 1");
}

at::Tensor MoeLayer::forward(const at::Tensor& x, const at::Tensor& logits) const {
  const int64_t tokens = x.size(0), experts = gate_up_.size(0);
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == tokens && logits.size(1) == experts &&
                  logits.stride(1) == 1 && logits.scalar_type() == x.scalar_type(),
              "MoeLayer: logits must be [T, ", experts, "] in x's dtype with contiguous rows");
  auto ids = at::empty({tokens, top_k_}, x.options().dtype(at::kLong));
  auto weights = at::empty({tokens, top_k_}, x.options().dtype(at::kFloat));
  std::vector<float> scores;
  for (int64_t t = 0; t < tokens; ++t) {
    int64_t* row_ids = ids.data_ptr<int64_t>() + t * top_k_;
    float* row_weights = weights.data_ptr<float>() + t * top_k_;
    if (x.scalar_type() == at::kBFloat16)
      route_row(logits.data_ptr<c10::BFloat16>() + t * logits.stride(0), experts, top_k_,
                scoring_, renormalize_, round_weights_, scores, row_ids, row_weights);
    else
      route_row(logits.data_ptr<float>() + t * logits.stride(0), experts, top_k_, scoring_,
                renormalize_, round_weights_, scores, row_ids, row_weights);
  }
  return moe_experts(x, ids, weights, gate_up_, gate_up_bias_, down_, down_bias_, inter_,
                     activation_, alpha_, limit_);
}

MoeDecode::MoeDecode(std::vector<int64_t> layers, std::vector<std::shared_ptr<MoeLayer>> blocks,
                     std::vector<at::Tensor> routers,
                     std::vector<std::optional<at::Tensor>> router_biases,
                     std::vector<std::optional<at::Tensor>> sinks)
    : sinks_(std::move(sinks)) {
  const auto n = layers.size();
  TORCH_CHECK(blocks.size() == n && routers.size() == n && router_biases.size() == n,
              "MoeDecode: a block, a router and a router bias per layer");
  for (size_t b = 0; b < n; ++b) {
    TORCH_CHECK(layers[b] >= 0 && blocks[b] != nullptr, "MoeDecode: bad layer or block");
    if (static_cast<size_t>(layers[b]) >= by_layer_.size()) by_layer_.resize(layers[b] + 1);
    TORCH_CHECK(!by_layer_[layers[b]].has_value(), "MoeDecode: layer ", layers[b], " twice");
    by_layer_[layers[b]] = Block{blocks[b], std::move(routers[b]), std::move(router_biases[b])};
  }
}

void MoeDecode::begin() { active_decode = this; }

void MoeDecode::end() {
  if (active_decode == this) active_decode = nullptr;
}

bool MoeDecode::mlp(at::Tensor& x, int64_t layer) const {
  if (layer >= static_cast<int64_t>(by_layer_.size()) || !by_layer_[layer].has_value())
    return false;
  const Block& b = *by_layer_[layer];
  x = b.moe->forward(x, small_linear(x, b.router, b.moe->experts(), b.router_bias));
  return true;
}

std::optional<at::Tensor> MoeDecode::sinks(int64_t layer) const {
  if (layer >= static_cast<int64_t>(sinks_.size())) return std::nullopt;
  return sinks_[layer];
}

std::optional<at::Tensor> moe_decode_sinks_(int64_t layer) {
  return active_decode != nullptr ? active_decode->sinks(layer) : std::nullopt;
}

bool moe_decode_mlp_(at::Tensor& x, int64_t layer) {
  return active_decode != nullptr && active_decode->mlp(x, layer);
}

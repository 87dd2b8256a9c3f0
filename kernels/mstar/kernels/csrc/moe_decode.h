// An MoE block as one C++ object (moe_decode.cpp): its router's top-k and the grouped expert
// kernel behind it, called by the layer path (`MoeLayer::forward` on the router's logits) and
// by a fused decode step (`MoeDecode`: the router too, inside `decode_layers`' layer loop), so
// both compute the same bits. Declared for bindings.cpp's module definition.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <vector>

// One block's experts (packed and stacked as `moe_experts` takes them) and routing:
// scoring 0 = softmax over every expert in float32, then the top k (Qwen-MoE, Mixtral);
// 1 = the top k of the logits, then softmax over those k (gpt-oss); renormalize: the top-k
// weights divided by their sum (after a softmax-first scoring); round_weights: the weights
// rounded to the model's dtype (Qwen, gpt-oss) before the experts use them as float32.
class MoeLayer {
 public:
  MoeLayer(at::Tensor gate_up, std::optional<at::Tensor> gate_up_bias, at::Tensor down,
           std::optional<at::Tensor> down_bias, int64_t inter, int64_t activation, double alpha,
           double limit, int64_t top_k, int64_t scoring, bool renormalize, bool round_weights);
  // x [T, H] (rows contiguous), logits [T, E] in x's dtype -> [T, H]: routed and summed.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& logits) const;
  int64_t experts() const { return gate_up_.size(0); }

 private:
  at::Tensor gate_up_, down_;
  std::optional<at::Tensor> gate_up_bias_, down_bias_;
  int64_t inter_, activation_, top_k_, scoring_;
  double alpha_, limit_;
  bool renormalize_, round_weights_;
};

// Every MoE layer of a model for `decode_layers`: layers[b] has block b and its router's
// small-batch packed weight (and bias); sinks[i]: layer i's attention sink logits (gpt-oss:
// float32 [Hq]) or None, for every layer (or empty: none). Between begin() and end() on one
// thread, that thread's `decode_layers` runs those layers' MLP as router, top-k and experts
// (`moe_decode_mlp_`) instead of the dense gate/up, act, down (the other layers keep the dense
// MLP), and hands each layer's sinks to its attention (`moe_decode_sinks_`).
class MoeDecode {
 public:
  MoeDecode(std::vector<int64_t> layers, std::vector<std::shared_ptr<MoeLayer>> blocks,
            std::vector<at::Tensor> routers, std::vector<std::optional<at::Tensor>> router_biases,
            std::vector<std::optional<at::Tensor>> sinks);
  void begin();
  void end();
  // x [T, H] -> layer's MoE output; false (x untouched) where the layer has no MoE block.
  bool mlp(at::Tensor& x, int64_t layer) const;
  std::optional<at::Tensor> sinks(int64_t layer) const;

 private:
  struct Block {
    std::shared_ptr<MoeLayer> moe;
    at::Tensor router;
    std::optional<at::Tensor> router_bias;
  };
  std::vector<std::optional<Block>> by_layer_;
  std::vector<std::optional<at::Tensor>> sinks_;
};

// decode_layers' MLP hook for layer `layer`: the `MoeDecode` begun on this thread replaces x
// by that layer's MoE output and returns true; false where there is none (the dense MLP runs).
bool moe_decode_mlp_(at::Tensor& x, int64_t layer);
// decode_layers' attention sinks for layer `layer` (None where no `MoeDecode` gives any).
std::optional<at::Tensor> moe_decode_sinks_(int64_t layer);

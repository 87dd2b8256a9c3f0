// The tensor side of the MoE expert kernel (moe_bindings.cpp), declared for bindings.cpp's
// module definition.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

// x [T, H] (rows contiguous, float32 or bf16), topk_ids int64 [T, k], topk_weights float32
// [T, k]; gate_up / down: every expert's projections packed by one small-batch GEMM's pack
// (fma / dpbf16 / amx _pack_weight of [2I, H] and [H, I]) and stacked over experts; biases
// [E, 2I] / [E, H] in x's dtype or None; activation 0 = SiLU(gate) * up, 1 = gpt-oss's clamped
// SwiGLU (alpha, limit). Returns [T, H] in x's dtype.
at::Tensor moe_experts(at::Tensor x, at::Tensor topk_ids, at::Tensor topk_weights,
                       at::Tensor gate_up, std::optional<at::Tensor> gate_up_bias,
                       at::Tensor down, std::optional<at::Tensor> down_bias, int64_t inter,
                       int64_t activation, double alpha, double limit);

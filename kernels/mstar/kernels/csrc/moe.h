// Mixture-of-experts expert MLPs on the CPU: the raw-pointer kernel (moe.cpp, compiled per ISA
// level) and what the tensor side (moe_bindings.cpp) hands it. Every expert's two projections
// are packed once, at load, in one of the small-batch GEMMs' layouts (kernels.h), stacked over
// experts; a step groups its (token, expert) rows by expert and multiplies each expert's rows
// by that expert's weights in one call of the GEMM, so each weight byte is read once a step.
#pragma once

#include "kernels.h"

namespace mstar_cpu {

// Which small-batch GEMM's packed layout the experts' weights are in (kernels.h).
enum class ExpertLayout : int { kFma = 0, kDotBf16 = 1, kAmx = 2 };

// The activation between the two projections, over the gate/up projection's output [gate | up]:
// kSiluMul: SiLU(gate) * up (Qwen-MoE, Mixtral); kClampedSwiglu: gpt-oss's
// (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit).
enum class ExpertAct : int { kSiluMul = 0, kClampedSwiglu = 1 };

// One projection of every expert: expert e's packed [n, k] weight at packed + e * stride, in
// `panels` panels (and `steps` K steps of 32 for AMX), its bias [n] at bias + e * n (or none).
template <typename T>
struct ExpertProj {
  const T* packed;
  int64_t stride;
  int64_t panels;
  int64_t steps;
  int64_t n;
  int64_t k;
  const T* bias;
};

template <typename T>
struct ExpertMlp {
  ExpertLayout layout;
  ExpertProj<T> gate_up;  // n = 2 * inter (gate columns first, then up), k = hidden
  ExpertProj<T> down;     // n = hidden, k = inter
  ExpertAct act;
  float alpha;
  float limit;
};

// out [tokens, hidden] (row stride ldo) = sum over j < top_k of weights[t, j] times expert
// ids[t, j]'s MLP of x's row t (row stride ldx); ids in [0, experts), weights float32.
template <typename T>
void moe_experts(const T* x, int64_t ldx, int64_t tokens, const int64_t* ids,
                 const float* weights, int64_t top_k, int64_t experts, const ExpertMlp<T>& mlp,
                 T* out, int64_t ldo);

}  // namespace mstar_cpu

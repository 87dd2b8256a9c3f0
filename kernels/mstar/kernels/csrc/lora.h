// Batched LoRA on the CPU (lora.cpp, compiled per ISA level), and what the tensor side
// (lora_bindings.cpp) hands it: a step's rows in segments of one adapter slot each, every
// slot's A [R, k] and B^T [R, n] in the model's dtype, the slot's rank and scale.
#pragma once

#include <cstdint>

namespace mstar_cpu {

template <typename T>
struct LoraWeights {
  const T* a;            // [slots, max_rank, k]
  const T* b;            // [slots, max_rank, n] (B transposed: one row per rank)
  const int64_t* ranks;  // [slots]: rows of A and B in use (0: this slot adds nothing)
  const float* scales;   // [slots]
  int64_t max_rank;
  int64_t k;
  int64_t n;
};

// y[t, :n] (row stride ldy) += scales[s] * (x[t] A[s]^T) B^T[s] for every row t of a segment
// with slot s >= 0; segments: rows seg_indptr[g] .. seg_indptr[g + 1] take slot seg_slot[g]
// (-1: the base model, left as is). Sums in float32; y rounds to T once per element.
template <typename T>
void lora_add(T* y, int64_t ldy, const T* x, int64_t ldx, const LoraWeights<T>& w,
              const int64_t* seg_indptr, const int64_t* seg_slot, int64_t segments);

}  // namespace mstar_cpu

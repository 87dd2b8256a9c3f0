// The tensor side of the batched LoRA kernel (lora_bindings.cpp), declared for bindings.cpp's
// module definition.
#pragma once

#include <ATen/core/Tensor.h>

// y [T, N] (rows contiguous) gets, in columns col_off .. col_off + n, each row's LoRA update:
// x [T, k]; a [S, R, k], b [S, R, n] in x's dtype (float32 or bf16), contiguous; ranks int64
// [S], scales float32 [S]; seg_indptr int64 [G + 1], seg_slot int64 [G] (-1: no adapter).
void lora_add_(at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor b, at::Tensor ranks,
               at::Tensor scales, at::Tensor seg_indptr, at::Tensor seg_slot, int64_t col_off);

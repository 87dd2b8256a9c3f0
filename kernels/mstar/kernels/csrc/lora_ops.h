// The tensor side of the batched LoRA kernel (lora_bindings.cpp), declared for bindings.cpp's
// module definition.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

// y [T, N] (rows contiguous) gets, in columns col_off .. col_off + n, each row's LoRA update:
// x [T, k]; a [S, R, k], b [S, R, n] in x's dtype (float32 or bf16), contiguous; ranks int64
// [S], scales float32 [S]; seg_indptr int64 [G + 1], seg_slot int64 [G] (-1: no adapter).
void lora_add_(at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor b, at::Tensor ranks,
               at::Tensor scales, at::Tensor seg_indptr, at::Tensor seg_slot, int64_t col_off);

// Every layer's LoRA weights for `decode_layers` (Python: `mstar.engine.lora.layer.LoraRows`):
// the tensors of each output part of each projection, in (layer, projection, part) order, as
// `lora_add_` takes them (held, not copied: a slot written in place is seen), and ``parts``
// [4 * layers], the parts of each layer's QKV, O, gate/up and down. Between begin() and end()
// on one thread, that thread's `decode_layers` adds the step's LoRA updates after each
// projection (`lora_decode_add_`), so a step with adapter rows keeps the fused decode.
class LoraDecode {
 public:
  LoraDecode(std::vector<at::Tensor> a, std::vector<at::Tensor> b, std::vector<at::Tensor> ranks,
             std::vector<at::Tensor> scales, std::vector<int64_t> col_offs,
             std::vector<int64_t> parts);
  // This step's rows in segments of one slot (as `lora_add_` takes them).
  void begin(at::Tensor seg_indptr, at::Tensor seg_slot);
  void end();
  // y += the updates of projection `proj` (0 QKV, 1 O, 2 gate/up, 3 down) of `layer`.
  void add(at::Tensor& y, const at::Tensor& x, int64_t layer, int64_t proj) const;

 private:
  std::vector<at::Tensor> a_, b_, ranks_, scales_;
  std::vector<int64_t> col_offs_;
  std::vector<int64_t> first_;  // [4 * layers + 1]: each projection's first part
  at::Tensor seg_indptr_, seg_slot_;
};

// After `decode_layers`' projection `proj` of `layer`: the `LoraDecode` begun on this thread
// adds its updates to y (nothing where none is).
void lora_decode_add_(at::Tensor& y, const at::Tensor& x, int64_t layer, int64_t proj);

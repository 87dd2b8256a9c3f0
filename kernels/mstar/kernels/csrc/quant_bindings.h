// The tensor side of the quantized GEMM (quant_gemm.cpp): checks and output allocation, for
// bindings.cpp only (it includes this once, after torch's headers, and defines the functions
// into the module).
#pragma once

#include "quant.h"

namespace {

// blocks: a uint8 tensor holding W [n, k] of `type`, rows of whole blocks back to back.
void check_quant_weight(const torch::Tensor& blocks, int64_t type, int64_t n, int64_t k,
                        const char* op) {
  const int64_t elems = mstar_cpu::quant_block_elems(type);
  TORCH_CHECK(elems > 0, op, ": quantization type ", type, " is not served (Q4_0, Q4_1, Q5_0, ",
              "Q5_1, Q8_0, Q4_K, Q5_K, Q6_K: 2, 3, 6, 7, 8, 12, 13, 14)");
  TORCH_CHECK(n > 0 && k > 0 && k % elems == 0, op, ": k must be a positive multiple of ", elems,
              " for type ", type, " (got n ", n, ", k ", k, ")");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous() &&
                  blocks.numel() == n * (k / elems) * mstar_cpu::quant_block_bytes(type),
              op, ": blocks must be contiguous uint8 holding ", n, " rows of ", k / elems,
              " blocks of ", mstar_cpu::quant_block_bytes(type), " bytes");
}

}  // namespace

// True where this library's quantized GEMM runs VPDPBUSD (AVX512-VNNI) on this CPU.
bool quant_vnni() { return mstar_cpu::quant_vnni(); }

// x [M, K] float32 or bf16 (rows contiguous) @ W.T (+ bias [N], x's dtype) -> [M, N] in x's
// dtype, W the GGUF blocks of `type` as stored (see quant_gemm.cpp).
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor blocks, int64_t type, int64_t n,
                           int64_t k, c10::optional<torch::Tensor> bias) {
  check_quant_weight(blocks, type, n, k, "quant_linear");
  TORCH_CHECK(x.dim() == 2 && glue_dtype(x) && x.stride(1) == 1 && x.size(1) == k,
              "quant_linear: x must be float32 or bfloat16 [M, ", k, "] with contiguous rows");
  auto out = torch::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
  by_dtype(x, "quant_linear", [&](auto tag) {
    using T = decltype(tag);
    mstar_cpu::quant_gemm<T>(type, blocks.data_ptr<uint8_t>(), n, k, x.data_ptr<T>(),
                             x.stride(0), x.size(0), linear_bias<T>(bias, n, "quant_linear"),
                             out.data_ptr<T>());
  });
  return out;
}

// W [n, k] of `type` -> out [n, k] (float32 or bf16, contiguous), ggml's dequantization.
void quant_dequantize_(torch::Tensor blocks, int64_t type, torch::Tensor out) {
  TORCH_CHECK(out.dim() == 2 && glue_dtype(out) && out.is_contiguous(),
              "quant_dequantize_: out must be a contiguous float32 or bfloat16 [N, K]");
  check_quant_weight(blocks, type, out.size(0), out.size(1), "quant_dequantize_");
  by_dtype(out, "quant_dequantize_", [&](auto tag) {
    using T = decltype(tag);
    mstar_cpu::quant_dequant<T>(type, blocks.data_ptr<uint8_t>(), out.size(0), out.size(1),
                                out.data_ptr<T>());
  });
}

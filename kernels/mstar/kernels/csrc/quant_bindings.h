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

// Every decoder layer of a decode step in one call, as `decode_layers` runs them
// (`run_decode_layers`: the same glue kernels in the same order), each projection's weight the GGUF blocks as stored: x's
// rows are quantized once per projection input and shared by its parts (Q, K, V; gate, up),
// which may differ in type; every output is `quant_linear`'s for its part, so the step gives
// the layer-by-layer path's bits. blocks / types: every part's uint8 [n, row bytes] and ggml
// type, in order (layer, then QKV, O, gate/up, down, then part); parts: how many parts each of
// the 4 * layers projections has; biases: each projection's (4 per layer, None where absent,
// x's dtype). The rest (cache, RoPE tables, KV groups, layout) as `decode_layers` takes it. Returns (the last layer's MLP output,
// residual).
std::vector<torch::Tensor> quant_decode_layers(
    torch::Tensor h, torch::Tensor residual, std::vector<torch::Tensor> norm_in,
    std::vector<torch::Tensor> norm_post, std::vector<torch::Tensor> blocks,
    std::vector<int64_t> types, std::vector<int64_t> parts,
    std::vector<c10::optional<torch::Tensor>> biases, torch::Tensor cache,
    std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin,
    std::vector<torch::Tensor> page_tables, std::vector<torch::Tensor> kv_lens,
    std::vector<torch::Tensor> slots, std::vector<c10::optional<torch::Tensor>> layout_norms,
    std::vector<int64_t> layout_ints, bool gelu, int64_t num_heads, int64_t num_kv_heads,
    int64_t inter, double scale, double eps) {
  const char* op = "quant_decode_layers";
  const auto layers = static_cast<int64_t>(norm_in.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(norm_post.size()) == layers &&
                  static_cast<int64_t>(parts.size()) == 4 * layers &&
                  static_cast<int64_t>(biases.size()) == 4 * layers &&
                  types.size() == blocks.size(),
              op, ": norms one per layer, parts and biases 4 per layer, a type per part");
  const DecodeLayout layout{std::move(layout_norms), std::move(layout_ints), std::move(cos),
                            std::move(sin), std::move(page_tables), std::move(kv_lens),
                            std::move(slots), gelu};
  layout.check(layers, cache, op);
  TORCH_CHECK(h.dim() == 2 && h.sizes() == residual.sizes() && glue_dtype(h), op,
              ": h / residual float32 or bfloat16 [T, H]");
  const int64_t t = h.size(0), hidden = h.size(1), dim = cache.size(5);
  const int64_t q_size = num_heads * dim, kv_size = num_kv_heads * dim;
  // per projection: inputs, outputs, its parts (checked before the residual is touched)
  const int64_t ks[4] = {hidden, q_size, hidden, inter};
  const int64_t ns[4] = {q_size + 2 * kv_size, hidden, 2 * inter, hidden};
  std::vector<mstar_cpu::QuantPart> all;
  std::vector<int64_t> first(4 * layers + 1, 0);
  for (int64_t p = 0; p < 4 * layers; ++p) {
    TORCH_CHECK(parts[p] > 0, op, ": projection ", p, " has no parts");
    int64_t rows = 0;
    for (int64_t j = 0; j < parts[p]; ++j) {
      const auto idx = all.size();
      TORCH_CHECK(idx < blocks.size(), op, ": fewer blocks than the parts count");
      const auto& b = blocks[idx];
      TORCH_CHECK(b.dim() == 2, op, ": blocks must be [n, row bytes]");
      check_quant_weight(b, types[idx], b.size(0), ks[p % 4], op);
      all.push_back({types[idx], b.data_ptr<uint8_t>(), b.size(0)});
      rows += b.size(0);
    }
    TORCH_CHECK(rows == ns[p % 4], op, ": projection ", p, "'s parts hold ", rows, " rows, not ",
                ns[p % 4]);
    first[p + 1] = static_cast<int64_t>(all.size());
  }
  TORCH_CHECK(all.size() == blocks.size(), op, ": more blocks than the parts count");
  const int64_t max_k = std::max({hidden, q_size, inter});
  auto q = torch::empty({t, max_k}, h.options().dtype(torch::kInt8));
  auto scales = torch::empty({t, mstar_cpu::quant_row_floats(max_k)}, h.options().dtype(torch::kFloat32));
  // x [t, k] (rows contiguous) @ projection p's parts -> [t, n]
  auto proj = [&](const torch::Tensor& x, int64_t p) {
    const int64_t k = x.size(1), n = ns[p % 4];
    TORCH_CHECK(x.stride(1) == 1 && x.scalar_type() == h.scalar_type(), op, ": bad activations");
    auto out = torch::empty({t, n}, x.options());
    by_dtype(x, op, [&](auto tag) {
      using T = decltype(tag);
      mstar_cpu::quant_rows<T>(x.data_ptr<T>(), x.stride(0), t, k, q.data_ptr<int8_t>(),
                               scales.data_ptr<float>());
      mstar_cpu::quant_gemm_parts<T>(all.data() + first[p], first[p + 1] - first[p], k,
                                     q.data_ptr<int8_t>(), scales.data_ptr<float>(), t,
                                     linear_bias<T>(biases[p], n, op), out.data_ptr<T>(), n);
    });
    return out;
  };
  return run_decode_layers(h, residual, norm_in, norm_post, cache, layout, num_heads,
                           num_kv_heads, scale, eps,
                           [&](const torch::Tensor& x, int64_t i, int64_t j) { return proj(x, 4 * i + j); });
}

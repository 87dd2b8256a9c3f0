// `decode_layers`: every decoder layer of a decode step over small-batch packed weights, in
// one call (decode_loop.h's loop with the packed GEMMs and the LoRA hook as its projection).
#include "binding_checks.h"
#include "decode_loop.h"
#include "glue_ops.h"
#include "lora_ops.h"

// dst [T, N] (contiguous) = the first N columns of src's rows, converted between float32 and
// bf16 as torch's `.to()` does (bf16: round to nearest even); returns dst. `run_decode_layers`'
// attention lines under `--kv-cache-dtype` (a bf16 cache beside float32 activations).
const torch::Tensor& convert_rows(const torch::Tensor& src, const torch::Tensor& dst) {
  const int64_t rows = dst.size(0), n = dst.size(1), stride = src.stride(0);
  TORCH_CHECK(src.stride(1) == 1 && src.size(1) >= n && dst.is_contiguous(),
              "decode_layers: KV cast rows");
  if (src.scalar_type() == torch::kFloat32 && dst.scalar_type() == torch::kBFloat16) {
    const float* s = src.data_ptr<float>();
    auto* d = dst.data_ptr<c10::BFloat16>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < n; ++j) d[r * n + j] = c10::BFloat16(s[r * stride + j]);
  } else if (src.scalar_type() == torch::kBFloat16 && dst.scalar_type() == torch::kFloat32) {
    const auto* s = src.data_ptr<c10::BFloat16>();
    float* d = dst.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < n; ++j) d[r * n + j] = static_cast<float>(s[r * stride + j]);
  } else {
    TORCH_CHECK(false, "decode_layers: the KV cache must be float32 or bfloat16");
  }
  return dst;
}

// Every decoder layer of a decode step (bf16, or float32 over the FMA GEMM) in one call
// (`run_decode_layers`; a batch-1 step 13.4-14.7 -> 12.0-12.5 ms against the layer path).
// h [T, H]: layer 0's normed input; residual [T, H] (updated in place); per layer (lists of
// num_layers): the norm weights, the four packed weights and their biases (4 per layer, None
// where absent); cache [slots, pages, 2, S, Hkv, D]; per RoPE table its cos / sin [T, 1, D/2];
// per KV group its page_table, kv_lens and slots as `paged_decode` and `write_kv` take them;
// layout_norms / layout_ints / gelu as `DecodeLayout` reads them. Returns (the last layer's
// MLP output, residual).
std::vector<torch::Tensor> decode_layers(
    torch::Tensor h, torch::Tensor residual, std::vector<torch::Tensor> norm_in,
    std::vector<torch::Tensor> norm_post, std::vector<torch::Tensor> qkv,
    std::vector<torch::Tensor> o, std::vector<torch::Tensor> gate_up,
    std::vector<torch::Tensor> down, std::vector<c10::optional<torch::Tensor>> biases,
    torch::Tensor cache, std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin,
    std::vector<torch::Tensor> page_tables, std::vector<torch::Tensor> kv_lens,
    std::vector<torch::Tensor> slots, std::vector<c10::optional<torch::Tensor>> layout_norms,
    std::vector<int64_t> layout_ints, bool gelu, int64_t num_heads, int64_t num_kv_heads,
    int64_t inter, double scale, double eps) {
  const auto layers = static_cast<int64_t>(qkv.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(norm_in.size()) == layers &&
                  static_cast<int64_t>(norm_post.size()) == layers &&
                  static_cast<int64_t>(o.size()) == layers &&
                  static_cast<int64_t>(gate_up.size()) == layers &&
                  static_cast<int64_t>(down.size()) == layers &&
                  static_cast<int64_t>(biases.size()) == 4 * layers,
              "decode_layers: every per-layer list needs one entry per layer (4 biases)");
  const DecodeLayout layout{std::move(layout_norms), std::move(layout_ints), std::move(cos),
                            std::move(sin), std::move(page_tables), std::move(kv_lens),
                            std::move(slots), gelu};
  layout.check(layers, cache, "decode_layers");
  TORCH_CHECK(h.dim() == 2 && h.sizes() == residual.sizes(), "decode_layers: h / residual [T, H]");
  const int64_t hidden = h.size(1), dim = cache.size(5);
  const int64_t ns[4] = {(num_heads + 2 * num_kv_heads) * dim, hidden, 2 * inter, hidden};
  const std::vector<torch::Tensor>* weights[4] = {&qkv, &o, &gate_up, &down};
  return run_decode_layers(h, residual, norm_in, norm_post, cache, layout, num_heads,
                           num_kv_heads, scale, eps,
                           [&](const torch::Tensor& x, int64_t i, int64_t j) {
                             auto y = small_linear(x, (*weights[j])[i], ns[j], biases[4 * i + j]);
                             lora_decode_add_(y, x, i, j);  // adapter rows, if any (lora_ops.h)
                             return y;
                           });
}

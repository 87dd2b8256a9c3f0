// The layer loop of the fused CPU decode (`run_decode_layers`) and the per-layer layout it
// reads, shared by the packed-weight `decode_layers` (decode_bindings.cpp) and the GGUF-block
// `quant_decode_layers` (quant_bindings.h): one loop, so both call the same kernels in the same
// order as the layer path.
#pragma once

#include <torch/extension.h>

#include <vector>

#include "glue_ops.h"
#include "moe_decode.h"

// Where a fused decode step's layers differ from the Llama block and where their attention
// reads, as `decode_layers` / `quant_decode_layers` take it (the Python side: `Decoder`'s
// `FusedLayout`). Per layer i: norms[4i .. 4i+3] the q norm and k norm (over each head, before
// RoPE), the post-attention and post-feed-forward norms (Gemma's sandwich: norm_post is then
// the pre-feed-forward norm), None where absent; ints[4i .. 4i+3] its RoPE table (cos / sin
// index: Gemma's local and global bases), its sliding window (0: none), its KV group (index of
// page_tables / kv_lens / slots: a hybrid model's sliding layers have pages of their own) and
// its slot in the cache's first dim. gelu: a GELU-tanh gate, else SiLU.
struct DecodeLayout {
  std::vector<c10::optional<torch::Tensor>> norms;
  std::vector<int64_t> ints;
  std::vector<torch::Tensor> cos, sin, page_tables, kv_lens, slots;
  bool gelu;

  void check(int64_t layers, const torch::Tensor& cache, const char* op) const {
    TORCH_CHECK(cache.dim() == 6 && cache.is_contiguous(), op,
                ": cache must be a contiguous [slots, pages, 2, S, Hkv, D]");
    TORCH_CHECK(static_cast<int64_t>(norms.size()) == 4 * layers &&
                    static_cast<int64_t>(ints.size()) == 4 * layers,
                op, ": 4 layout norms and 4 layout ints per layer");
    const auto tables = static_cast<int64_t>(cos.size());
    const auto groups = static_cast<int64_t>(page_tables.size());
    TORCH_CHECK(tables > 0 && static_cast<int64_t>(sin.size()) == tables && groups > 0 &&
                    static_cast<int64_t>(kv_lens.size()) == groups &&
                    static_cast<int64_t>(slots.size()) == groups,
                op, ": a cos and a sin per RoPE table, a page table, kv_lens and slots per group");
    for (int64_t i = 0; i < layers; ++i) {
      const int64_t* in = ints.data() + 4 * i;
      TORCH_CHECK(in[0] >= 0 && in[0] < tables && in[1] >= 0 && in[2] >= 0 && in[2] < groups &&
                      in[3] >= 0 && in[3] < cache.size(0),
                  op, ": layer ", i, "'s RoPE table, window, KV group or cache slot is out of range");
    }
  }
};

// The layer loop of a fused decode step: per layer add+RMSNorm, QKV, q/k norm, RoPE, the K/V
// write, paged decode attention, O, (post-attention norm,) add+RMSNorm, gate/up, act*up, down
// (, post-feed-forward norm): the same kernels in the same order as `DecoderLayer.forward`
// calls them one by one (so the same bits), without its ~25 Python dispatches per layer.
// proj(x, layer, j) runs the layer's projection j (QKV, O, gate/up, down) on x [T, K] ->
// [T, N]. x: layer 0's normed input; residual updated in place.
template <class Proj>
std::vector<torch::Tensor> run_decode_layers(
    torch::Tensor x, torch::Tensor residual, const std::vector<torch::Tensor>& norm_in,
    const std::vector<torch::Tensor>& norm_post, const torch::Tensor& cache,
    const DecodeLayout& layout, int64_t num_heads, int64_t num_kv_heads, double scale,
    double eps, Proj&& proj) {
  const int64_t t = x.size(0), dim = cache.size(5);
  const auto layers = static_cast<int64_t>(norm_in.size());
  const int64_t q_size = num_heads * dim, kv_size = num_kv_heads * dim;
  const int64_t qk_heads = num_heads + num_kv_heads;
  // `--kv-cache-dtype`: the attention lines cast as `PagedAttentionContext.attend` does, into
  // buffers every layer reuses (per-layer `.to()` calls cost ~9% of a batch-1 step)
  const bool cast_kv = cache.scalar_type() != x.scalar_type();
  torch::Tensor qkv_cast, attn_cast;
  if (cast_kv) {
    qkv_cast = torch::empty({t, q_size + 2 * kv_size}, cache.options());
    attn_cast = torch::empty({t, q_size}, x.options());
  }
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t* in = layout.ints.data() + 4 * i;
    const int64_t rope = in[0], window = in[1], group = in[2];
    const auto* norm = layout.norms.data() + 4 * i;
    if (i > 0) add_rms_norm_(x, residual, norm_in[i], eps);
    const auto fused = proj(x, i, 0);
    const auto qk = fused.narrow(1, 0, q_size + kv_size).view({t, qk_heads, dim});
    if (norm[0]) rms_norm_(qk.narrow(1, 0, num_heads), *norm[0], eps);
    if (norm[1]) rms_norm_(qk.narrow(1, num_heads, num_kv_heads), *norm[1], eps);
    rope_(qk, layout.cos[rope], layout.sin[rope]);
    const auto kv_layer = cache.select(0, in[3]);
    // a bf16 cache under float32 activations: q, k, v rounded to its dtype
    if (cast_kv) convert_rows(fused, qkv_cast);
    const auto& qkv = cast_kv ? qkv_cast : fused;
    const auto q = qkv.narrow(1, 0, q_size).view({t, num_heads, dim});
    const auto k = qkv.narrow(1, q_size, kv_size).view({t, num_kv_heads, dim});
    const auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads, dim});
    write_kv(kv_layer, k, v, layout.slots[group]);
    auto attn = paged_decode(q, kv_layer, layout.page_tables[group], layout.kv_lens[group],
                             scale, window, moe_decode_sinks_(i))  // gpt-oss's, if any
                    .view({t, q_size});
    if (cast_kv) attn = convert_rows(attn, attn_cast);
    x = proj(attn, i, 1);
    if (norm[2]) rms_norm_(x, *norm[2], eps);
    add_rms_norm_(x, residual, norm_post[i], eps);
    if (!moe_decode_mlp_(x, i)) {  // an MoE layer's router and experts instead (moe_decode.h)
      const auto act = act_mul(proj(x, i, 2), layout.gelu, "decode_layers");
      x = proj(act, i, 3);
    }
    if (norm[3]) rms_norm_(x, *norm[3], eps);
  }
  return {x, residual};
}

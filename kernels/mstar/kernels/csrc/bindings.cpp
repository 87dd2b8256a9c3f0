// The tensor side of the CPU kernels: shape, dtype and bounds checks, output allocation, and
// the Python bindings. Compiled once for the x86-64 baseline (torch's headers take a minute to
// compile) and linked into every ISA level's library beside that level's kernel objects, which
// it calls through kernels.h.
#include <torch/extension.h>

#include <cstring>

#include "kernels.h"
#include "lora_ops.h"
#include "moe_ops.h"

namespace {

// Rows of a [T, H, D] view whose heads are contiguous rows of D (a slice of a fused QKV row).
void check_head_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              name, " must be [T, H, D] with contiguous heads");
}

// float32 or bfloat16, the same for every tensor of a glue op.
bool glue_dtype(const torch::Tensor& x) {
  return x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16;
}

// Calls f with a value of x's element type (float or c10::BFloat16): one dispatch for every op.
template <typename F>
void by_dtype(const torch::Tensor& x, const char* op, F&& f) {
  if (x.scalar_type() == torch::kFloat32)
    f(float{});
  else if (x.scalar_type() == torch::kBFloat16)
    f(c10::BFloat16{});
  else
    TORCH_CHECK(false, op, ": float32 or bfloat16 only");
}

// Calls f(T, WT) for an RMSNorm of x by weight w [n] (contiguous): WT is x's dtype (HF's
// convention), or float32 on bf16 x (Gemma's 1 + w, applied in float32 before one rounding).
template <typename F>
void by_norm_dtype(const torch::Tensor& x, const torch::Tensor& w, int64_t n, const char* op,
                   F&& f) {
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == n, op, ": weight must be a ",
              "contiguous [", n, "]");
  if (w.scalar_type() == x.scalar_type()) {
    by_dtype(x, op, [&](auto tag) { f(tag, tag); });
    return;
  }
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kFloat32, op,
              ": weight in x's dtype, or float32 on bfloat16 x");
  f(c10::BFloat16{}, float{});
}

// A GEMM's optional bias [N] as a pointer (null for none), refused unless contiguous T.
template <typename T = c10::BFloat16>
const T* linear_bias(const c10::optional<torch::Tensor>& bias, int64_t n, const char* op) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == c10::CppTypeToScalarType<T>::value &&
                  bias->is_contiguous() && bias->numel() == n,
              op, ": bias must be contiguous [N] in x's dtype");
  return bias->data_ptr<T>();
}

// The checks every packed-weight GEMM makes of x and of the weight it packs.
void check_gemm_x(const torch::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, op,
              ": x must be bfloat16 [M, K] with contiguous rows");
}
torch::Tensor pack_input(const torch::Tensor& weight, const char* op) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, op,
              ": weight must be bfloat16 [N, K]");
  return weight.contiguous();
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The attention sinks' logits (float32 [hq], contiguous) or nullptr where there are none.
const float* sink_logits(const c10::optional<torch::Tensor>& sinks, int64_t hq) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->scalar_type() == torch::kFloat32 && sinks->is_contiguous() &&
                  sinks->dim() == 1 && sinks->size(0) == hq,
              "sinks must be a contiguous float32 [num_qo_heads]");
  return sinks->data_ptr<float>();
}

}  // namespace

std::string isa_level() { return mstar_cpu::isa_level(); }

// q [B, Hq, D] (heads contiguous, any batch stride); kv_layer [pages, 2, S, Hkv, D];
// page_table int64 [B, max_pages]; kv_lens int64 [B]; window > 0: each row attends its last
// `window` keys only (0: all); sinks (gpt-oss): float32 [Hq], each head's learned logit in the
// softmax's denominator. Returns [B, Hq, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor page_table,
                           torch::Tensor kv_lens, double scale, int64_t window,
                           c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(kv_layer.dim() == 5 && page_table.dim() == 2, "bad ranks");
  check_head_rows(q, "q");
  TORCH_CHECK(kv_layer.is_contiguous() && page_table.is_contiguous() && kv_lens.is_contiguous(),
              "kv_layer, page_table and kv_lens must be contiguous");
  TORCH_CHECK(q.scalar_type() == kv_layer.scalar_type(), "q and the cache differ in dtype");
  TORCH_CHECK(page_table.scalar_type() == torch::kInt64 && kv_lens.scalar_type() == torch::kInt64,
              "page_table and kv_lens must be int64");
  const int64_t batch = q.size(0), hq = q.size(1), dim = q.size(2);
  const int64_t page_size = kv_layer.size(2), hkv = kv_layer.size(3);
  TORCH_CHECK(kv_layer.size(1) == 2 && kv_layer.size(4) == dim && hq % hkv == 0, "bad shapes");
  TORCH_CHECK(page_table.size(0) == batch && kv_lens.size(0) == batch, "bad batch");
  auto out = torch::empty({batch, hq, dim}, q.options());
  const auto* table = page_table.data_ptr<int64_t>();
  const auto* lens = kv_lens.data_ptr<int64_t>();
  const float* sink = sink_logits(sinks, hq);
  by_dtype(q, "paged_decode", [&](auto tag) {
    using T = decltype(tag);
    mstar_cpu::decode_dim<T>(dim, q.data_ptr<T>(), q.stride(0), q.stride(1), kv_layer.data_ptr<T>(), table,
                  lens, out.data_ptr<T>(), batch, hq, hkv, page_size, page_table.size(1),
                  static_cast<float>(scale), window, sink);
  });
  return out;
}

// Causal attention of the several-query sequences of a step, writing their rows of out
// [T, Hq, D] (contiguous): q [T, Hq, D] (heads contiguous), kv_layer [pages, 2, S, Hkv, D],
// page_table int64 [B, max_pages], kv_lens / q_starts / q_lens int64 [B]; sinks as
// `paged_decode` takes them.
void paged_prefill(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor page_table,
                   torch::Tensor kv_lens, torch::Tensor q_starts, torch::Tensor q_lens,
                   double scale, torch::Tensor out, c10::optional<torch::Tensor> sinks) {
  check_head_rows(q, "q");
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(1) == 2 && kv_layer.is_contiguous(),
              "kv_layer must be a contiguous [pages, 2, S, H, D]");
  TORCH_CHECK(q.scalar_type() == kv_layer.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, out and the cache differ in dtype");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous like q");
  const int64_t batch = kv_lens.size(0), hq = q.size(1), hkv = kv_layer.size(3);
  for (const auto* t : {&page_table, &kv_lens, &q_starts, &q_lens})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == torch::kInt64,
                "page table and lengths must be contiguous int64");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == batch && q_starts.size(0) == batch &&
                  q_lens.size(0) == batch, "page table and lengths differ in batch");
  TORCH_CHECK(hq % hkv == 0 && q.size(2) == kv_layer.size(4), "head counts / dims do not match");
  const int64_t max_pages = page_table.size(1), page_size = kv_layer.size(2);
  const int64_t pages = kv_layer.size(0);
  const auto* lens = kv_lens.data_ptr<int64_t>();
  const auto* starts = q_starts.data_ptr<int64_t>();
  const auto* qlens = q_lens.data_ptr<int64_t>();
  const auto* table = page_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(qlens[b] >= 1 && qlens[b] <= lens[b] && starts[b] >= 0 &&
                    starts[b] + qlens[b] <= q.size(0) && lens[b] <= max_pages * page_size,
                "paged_prefill: sequence ", b, " has bad lengths");
    for (int64_t j = 0; j < (lens[b] + page_size - 1) / page_size; ++j)
      TORCH_CHECK(table[b * max_pages + j] >= 0 && table[b * max_pages + j] < pages,
                  "paged_prefill: page ", table[b * max_pages + j], " is outside the cache");
  }
  const float* sink = sink_logits(sinks, hq);
  by_dtype(q, "paged_prefill", [&](auto tag) {
    using T = decltype(tag);
    mstar_cpu::prefill_dim<T>(q.size(2), q.data_ptr<T>(), q.stride(0), q.stride(1), kv_layer.data_ptr<T>(),
                   table, max_pages, lens, starts, qlens, batch, out.data_ptr<T>(), hq, hkv,
                   page_size, static_cast<float>(scale), sink);
  });
}

// Copy k, v [T, Hkv, D] into kv_layer [pages, 2, S, Hkv, D] at flat slots (page * S + offset).
void write_kv(torch::Tensor kv_layer, torch::Tensor k, torch::Tensor v, torch::Tensor slots) {
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(1) == 2 && kv_layer.is_contiguous(),
              "kv_layer must be a contiguous [pages, 2, S, H, D]");
  check_head_rows(k, "k");
  check_head_rows(v, "v");
  TORCH_CHECK(k.scalar_type() == kv_layer.scalar_type() && v.scalar_type() == k.scalar_type(),
              "k, v and the cache differ in dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.is_contiguous() && slots.scalar_type() == torch::kInt64,
              "slots must be a contiguous int64 [T]");
  const int64_t tokens = slots.size(0), page_size = kv_layer.size(2);
  TORCH_CHECK(k.size(0) == tokens && v.size(0) == tokens, "k, v and slots differ in length");
  TORCH_CHECK(k.size(1) == kv_layer.size(3) && k.size(2) == kv_layer.size(4) &&
              v.sizes() == k.sizes(), "k / v shape does not match the cache");
  const int64_t capacity = kv_layer.size(0) * page_size;
  const int64_t row = k.size(1) * k.size(2);
  const int64_t bytes = row * static_cast<int64_t>(k.element_size());
  const auto* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "write_kv: slot ", slot[t],
                " is outside the cache's ", capacity, " slots");
  auto* base = static_cast<char*>(kv_layer.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size();
  const int64_t v_stride = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t page = slot[t] / page_size, offset = slot[t] % page_size;
    char* dst = base + ((page * 2 * page_size) + offset) * bytes;
    std::memcpy(dst, ks + t * k_stride, bytes);
    std::memcpy(dst + page_size * bytes, vs + t * v_stride, bytes);
  }
}

// x, residual [T, H] (float32 or bf16, one dtype) and weight [H] (`by_norm_dtype`): see
// `add_rms_norm_rows`.
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(glue_dtype(x) && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm_: x and residual both float32 or both bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() &&
                  residual.sizes() == x.sizes(),
              "add_rms_norm_: x and residual [T, H] contiguous");
  by_norm_dtype(x, weight, x.size(1), "add_rms_norm_", [&](auto tag, auto wtag) {
    using T = decltype(tag);
    using WT = decltype(wtag);
    mstar_cpu::add_rms_norm_rows<T, WT>(x.data_ptr<T>(), residual.data_ptr<T>(),
                                        weight.data_ptr<WT>(), x.size(0), x.size(1),
                                        static_cast<float>(eps));
  });
}

// RMSNorm in place over x's last dim: x [T, D] (rows contiguous) or [T, H, D] (heads
// contiguous: q/k norm over a slice of fused QKV rows); weight [D] (`by_norm_dtype`).
void rms_norm_(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(glue_dtype(x) && (x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1 &&
                  (x.dim() == 2 || x.stride(1) == x.size(2)),
              "rms_norm_: float32 or bfloat16 [T, D] or [T, H, D] with contiguous rows");
  const int64_t heads = x.dim() == 3 ? x.size(1) : 1, dim = x.size(-1);
  by_norm_dtype(x, weight, dim, "rms_norm_", [&](auto tag, auto wtag) {
    using T = decltype(tag);
    using WT = decltype(wtag);
    mstar_cpu::rms_norm_rows<T, WT>(x.data_ptr<T>(), x.size(0), heads, x.stride(0), dim,
                                    weight.data_ptr<WT>(), static_cast<float>(eps));
  });
}

// x [T, 2I] (gate | up, the fused projection's output), float32 or bf16 -> [T, I]:
// act(gate) * up, act SiLU or (gelu) GELU-tanh.
torch::Tensor act_mul(const torch::Tensor& x, bool gelu, const char* op) {
  TORCH_CHECK(glue_dtype(x) && x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, op,
              ": float32 or bfloat16 contiguous [T, 2I]");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  auto out = torch::empty({rows, inter}, x.options());
  by_dtype(x, op, [&](auto tag) {
    using T = decltype(tag);
    if (gelu)
      mstar_cpu::gelu_tanh_mul_rows(x.data_ptr<T>(), out.data_ptr<T>(), rows, inter);
    else
      mstar_cpu::silu_mul_rows(x.data_ptr<T>(), out.data_ptr<T>(), rows, inter);
  });
  return out;
}
torch::Tensor silu_mul(torch::Tensor x) { return act_mul(x, false, "silu_mul"); }
torch::Tensor gelu_tanh_mul(torch::Tensor x) { return act_mul(x, true, "gelu_tanh_mul"); }

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(glue_dtype(x) && x.dim() == 2 && x.stride(1) == 1,
              "argmax_rows: float32 or bfloat16 [n, V] with contiguous rows");
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 31), "argmax_rows: bad vocab size");
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  by_dtype(x, "argmax_rows", [&](auto tag) {
    using T = decltype(tag);
    mstar_cpu::argmax_rows_of(x.data_ptr<T>(), rows, vocab, x.stride(0), out.data_ptr<int64_t>());
  });
  return out;
}

// One draw per row of x [n, V] (float32, contiguous rows) from softmax(x), by inverse CDF: the
// first index whose running sum of exp(x - max) exceeds u[r] (float64 in [0, 1)) times the
// row's total. -inf entries (filtered tokens) and NaN have probability 0. Two passes over a row
// and one uniform per row, where Gumbel-max needs a uniform, two logs and an add per entry.
torch::Tensor sample_rows(torch::Tensor x, torch::Tensor u) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "sample_rows: float32 [n, V] with contiguous rows");
  TORCH_CHECK(u.scalar_type() == torch::kFloat64 && u.dim() == 1 && u.is_contiguous() &&
                  u.size(0) == x.size(0), "sample_rows: u must be float64 [n]");
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(vocab > 0, "sample_rows: empty rows");
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  mstar_cpu::sample_rows_of(x.data_ptr<float>(), rows, vocab, x.stride(0), u.data_ptr<double>(),
                            out.data_ptr<int64_t>());
  return out;
}

// RoPE in place on x [T, H, D] (rotate_half layout) with cos / sin [T, 1, D/2], all float32
// or all bf16.
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_head_rows(x, "x");
  TORCH_CHECK(glue_dtype(x) && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "rope_: x, cos and sin all float32 or all bfloat16");
  const int64_t half = x.size(2) / 2;
  TORCH_CHECK(x.size(2) % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == x.size(0) * half && sin.numel() == cos.numel(),
              "rope_: cos / sin must be contiguous [T, 1, D/2]");
  by_dtype(x, "rope_", [&](auto tag) {
    using T = decltype(tag);
    mstar_cpu::rotate_rows(x.data_ptr<T>(), x.size(0), x.size(1), x.stride(0), half, cos.data_ptr<T>(),
                sin.data_ptr<T>());
  });
}

// True where this level has AMX bf16 tiles and the kernel granted them: `amx_linear` runs.
bool amx_available() { return mstar_cpu::amx_compiled() && mstar_cpu::request_amx(); }

// Weight [N, K] bf16 -> [ceil(N/32), ceil(K/32), 16, 2, 32] B tiles for `amx_linear`: per
// panel of 32 columns and K step of 32, per k-pair the two tiles' rows (16 columns x 2 k each),
// zero-padded past N and K.
torch::Tensor amx_pack_weight(torch::Tensor weight) {
  const auto w = pack_input(weight, "amx_pack_weight");
  const int64_t n = w.size(0), k = w.size(1);
  auto packed = torch::zeros({round_up(n, mstar_cpu::kAmxPanelCols) / mstar_cpu::kAmxPanelCols,
                              round_up(k, mstar_cpu::kAmxTileK) / mstar_cpu::kAmxTileK, 16, 2, 32},
                             w.options());
  mstar_cpu::amx_pack(w.data_ptr<c10::BFloat16>(), n, k, packed.data_ptr<c10::BFloat16>());
  return packed;
}

// x [M, K] bf16 (rows contiguous) @ weight.T (+ bias) -> [M, N] bf16, float32 accumulation
// rounded once, over `amx_pack_weight`'s tiles (see gemm_amx.cpp).
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t n,
                         c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(amx_available(), "amx_linear: this CPU or build has no AMX bf16 tiles");
  check_gemm_x(x, "amx_linear");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "amx_linear: packed must come from amx_pack_weight");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), steps = packed.size(1);
  TORCH_CHECK(round_up(k, mstar_cpu::kAmxTileK) == steps * mstar_cpu::kAmxTileK && n > 0 &&
                  round_up(n, mstar_cpu::kAmxPanelCols) == panels * mstar_cpu::kAmxPanelCols,
              "amx_linear: x's K or N does not match the packed weight");
  const c10::BFloat16* bias_p = linear_bias(bias, n, "amx_linear");
  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
  // A tiles load 64 bytes of K per row straight from x; a K that is not a whole number of
  // steps goes through a zero-padded copy (no model here has one).
  torch::Tensor a = x;
  if (k != steps * mstar_cpu::kAmxTileK) {
    a = torch::zeros({m, steps * mstar_cpu::kAmxTileK}, x.options());
    a.narrow(1, 0, k).copy_(x);
  }
  mstar_cpu::amx_gemm(a.data_ptr<c10::BFloat16>(), a.stride(0), m, steps,
                      packed.data_ptr<c10::BFloat16>(), panels, n, bias_p,
                      out.data_ptr<c10::BFloat16>());
  return out;
}

// True where this level has VDPBF16PS (AVX512-BF16): `dpbf16_linear` runs.
bool dpbf16_available() { return mstar_cpu::dpbf16_compiled(); }

// Weight [N, K] bf16 -> [ceil(N/32), ceil(K/2), 32, 2] for `dpbf16_linear`: per panel of 32
// columns, one row of (column, k-pair) per pair of K, zero-padded past N and K.
torch::Tensor dpbf16_pack_weight(torch::Tensor weight) {
  const auto w = pack_input(weight, "dpbf16_pack_weight");
  const int64_t n = w.size(0), k = w.size(1);
  auto packed = torch::zeros(
      {round_up(n, mstar_cpu::kDotCols) / mstar_cpu::kDotCols, (k + 1) / 2, mstar_cpu::kDotCols, 2},
      w.options());
  mstar_cpu::dpbf16_pack(w.data_ptr<c10::BFloat16>(), n, k, packed.data_ptr<c10::BFloat16>());
  return packed;
}

// x [M, K] bf16 (rows contiguous) @ weight.T (+ bias) -> [M, N] bf16, float32 accumulation
// rounded once, over `dpbf16_pack_weight`'s panels (see gemm_dpbf16.cpp).
torch::Tensor dpbf16_linear(torch::Tensor x, torch::Tensor packed, int64_t n,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(dpbf16_available(), "dpbf16_linear: this CPU or build has no AVX512-BF16");
  check_gemm_x(x, "dpbf16_linear");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.size(2) == mstar_cpu::kDotCols &&
                  packed.size(3) == 2,
              "dpbf16_linear: packed must come from dpbf16_pack_weight");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK((k + 1) / 2 == pairs && n > 0 &&
                  round_up(n, mstar_cpu::kDotCols) == panels * mstar_cpu::kDotCols,
              "dpbf16_linear: x's K or N does not match the packed weight");
  const c10::BFloat16* bias_p = linear_bias(bias, n, "dpbf16_linear");
  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
  mstar_cpu::dpbf16_gemm(x.data_ptr<c10::BFloat16>(), x.stride(0), m, k,
                         packed.data_ptr<c10::BFloat16>(), panels, n, bias_p,
                         out.data_ptr<c10::BFloat16>());
  return out;
}

// True where this level has FMA (x86-64-v3 and up): `fma_linear` runs.
bool fma_available() { return mstar_cpu::fma_compiled(); }

// Weight [N, K] bf16 or float32 -> [ceil(N/16), K, 16] of the same dtype for `fma_linear`,
// zero-padded past N.
torch::Tensor fma_pack_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && glue_dtype(weight),
              "fma_pack_weight: weight must be bfloat16 or float32 [N, K]");
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  auto packed = torch::zeros(
      {round_up(n, mstar_cpu::kFmaCols) / mstar_cpu::kFmaCols, k, mstar_cpu::kFmaCols}, w.options());
  by_dtype(w, "fma_pack_weight", [&](auto tag) {
    using T = decltype(tag);
    mstar_cpu::fma_pack(w.data_ptr<T>(), n, k, packed.data_ptr<T>());
  });
  return packed;
}

// x [M, K] (rows contiguous) @ weight.T (+ bias) -> [M, N], all bf16 or all float32, float32
// accumulation rounded once, over `fma_pack_weight`'s panels (see gemm_fma.cpp).
torch::Tensor fma_linear(torch::Tensor x, torch::Tensor packed, int64_t n,
                         c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(fma_available(), "fma_linear: this CPU or build has no FMA");
  TORCH_CHECK(x.dim() == 2 && glue_dtype(x) && x.stride(1) == 1,
              "fma_linear: x must be bfloat16 or float32 [M, K] with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == x.scalar_type() &&
                  packed.is_contiguous() && packed.size(2) == mstar_cpu::kFmaCols,
              "fma_linear: packed must come from fma_pack_weight, in x's dtype");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k && n > 0 &&
                  round_up(n, mstar_cpu::kFmaCols) == panels * mstar_cpu::kFmaCols,
              "fma_linear: x's K or N does not match the packed weight");
  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
  by_dtype(x, "fma_linear", [&](auto tag) {
    using T = decltype(tag);
    mstar_cpu::fma_gemm(x.data_ptr<T>(), x.stride(0), m, k, packed.data_ptr<T>(), panels, n,
                        linear_bias<T>(bias, n, "fma_linear"), out.data_ptr<T>());
  });
  return out;
}

// One GEMM over a small-batch packed weight, the kernel told by its layout's rank (FMA 3,
// VDPBF16PS 4, AMX 5): what `PackedLinear` runs for decode-sized batches.
torch::Tensor small_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                           const c10::optional<torch::Tensor>& bias) {
  switch (packed.dim()) {
    case 3: return fma_linear(x, packed, n, bias);
    case 4: return dpbf16_linear(x, packed, n, bias);
    case 5: return amx_linear(x, packed, n, bias);
    default: TORCH_CHECK(false, "decode_layers: a weight is not in a small-batch packed layout");
  }
}

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

// dst [T, N] (contiguous) = the first N columns of src's rows, converted between float32 and
// bf16 as torch's `.to()` does (bf16: round to nearest even); returns dst.
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
                             scale, window, c10::nullopt)
                    .view({t, q_size});
    if (cast_kv) attn = convert_rows(attn, attn_cast);
    x = proj(attn, i, 1);
    if (norm[2]) rms_norm_(x, *norm[2], eps);
    add_rms_norm_(x, residual, norm_post[i], eps);
    const auto act = act_mul(proj(x, i, 2), layout.gelu, "decode_layers");
    x = proj(act, i, 3);
    if (norm[3]) rms_norm_(x, *norm[3], eps);
  }
  return {x, residual};
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

#include "quant_bindings.h"

namespace {

// Every function runs without the GIL (none touches a Python object once its arguments are
// converted), as torch's own ops do: the server's event loop streams and admits while a step's
// kernels run (`decode_layers` is a whole decode step's layers, ~9 ms at batch 1).
void define(pybind11::module_& m) {
#define MSTAR_DEF(name) m.def(#name, torch::wrap_pybind_function_no_gil(name), #name)
  MSTAR_DEF(isa_level);
  // sinks: optional, so callers without them pass the positional arguments they always did
  namespace py = pybind11;
  m.def("paged_decode", torch::wrap_pybind_function_no_gil(paged_decode), "paged_decode",
        py::arg("q"), py::arg("kv_layer"), py::arg("page_table"), py::arg("kv_lens"),
        py::arg("scale"), py::arg("window"), py::arg("sinks") = py::none());
  m.def("paged_prefill", torch::wrap_pybind_function_no_gil(paged_prefill), "paged_prefill",
        py::arg("q"), py::arg("kv_layer"), py::arg("page_table"), py::arg("kv_lens"),
        py::arg("q_starts"), py::arg("q_lens"), py::arg("scale"), py::arg("out"),
        py::arg("sinks") = py::none());
  MSTAR_DEF(write_kv);
  MSTAR_DEF(add_rms_norm_);
  MSTAR_DEF(rope_);
  MSTAR_DEF(argmax_rows);
  MSTAR_DEF(silu_mul);
  MSTAR_DEF(gelu_tanh_mul);
  MSTAR_DEF(rms_norm_);
  MSTAR_DEF(sample_rows);
  MSTAR_DEF(amx_available);
  MSTAR_DEF(amx_pack_weight);
  MSTAR_DEF(amx_linear);
  MSTAR_DEF(dpbf16_available);
  MSTAR_DEF(dpbf16_pack_weight);
  MSTAR_DEF(dpbf16_linear);
  MSTAR_DEF(fma_available);
  MSTAR_DEF(fma_pack_weight);
  MSTAR_DEF(fma_linear);
  MSTAR_DEF(decode_layers);
  MSTAR_DEF(quant_vnni);
  MSTAR_DEF(quant_linear);
  MSTAR_DEF(quant_dequantize_);
  MSTAR_DEF(quant_decode_layers);
  MSTAR_DEF(moe_experts);
  MSTAR_DEF(lora_add_);
#undef MSTAR_DEF
  using Tensors = std::vector<at::Tensor>;
  // module_local: every level's library registers it (a process may load several levels)
  py::class_<LoraDecode>(m, "LoraDecode", py::module_local())
      .def(py::init<Tensors, Tensors, Tensors, Tensors, std::vector<int64_t>,
                    std::vector<int64_t>>())
      .def("begin", &LoraDecode::begin)
      .def("end", &LoraDecode::end);
}

}  // namespace

// The module for one level's library, named by that library (level.cpp's PyInit): each level
// is its own module, so a process can load several (the tests compare them).
PyObject* mstar_cpu_module(const char* name) {
  auto* def = new PyModuleDef();  // a module's definition lives as long as the process
  try {
    auto m = pybind11::module_::create_extension_module(
        name, "mstar's CPU kernels for one ISA level (see mstar.kernels.cpu_kernels)", def);
    define(m);
    return m.release().ptr();
  } catch (pybind11::error_already_set& e) {
    e.restore();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ImportError, e.what());
  }
  return nullptr;
}

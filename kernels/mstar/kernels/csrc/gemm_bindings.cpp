// The tensor side of the small-batch packed GEMMs (gemm_amx.cpp, gemm_dpbf16.cpp, gemm_fma.cpp):
// availability, weight packing, shape checks and output allocation. Compiled once like
// bindings.cpp and linked into every level.
#include "binding_checks.h"
#include "glue_ops.h"
#include "huge_pages.h"

namespace {

// w [N, K] (or a stack of experts' [E, N, K], contiguous) packed matrix by matrix by
// pack(src, n, k, dst) into `dims` per matrix ([E, dims...] for a stack), in huge pages: a
// stack is packed in place, never through a per-expert copy.
template <typename T, typename Pack>
torch::Tensor pack_each(const torch::Tensor& w, std::vector<int64_t> dims, Pack pack) {
  const int64_t mats = w.dim() == 3 ? w.size(0) : 1, n = w.size(-2), k = w.size(-1);
  if (w.dim() == 3) dims.insert(dims.begin(), mats);
  auto packed = huge_zeros(dims, w.scalar_type());
  const int64_t per = packed.numel() / std::max<int64_t>(mats, 1);
  for (int64_t e = 0; e < mats; ++e)
    pack(w.data_ptr<T>() + e * n * k, n, k, packed.data_ptr<T>() + e * per);
  return packed;
}

}  // namespace

// True where this level has AMX bf16 tiles and the kernel granted them: `amx_linear` runs.
bool amx_available() { return mstar_cpu::amx_compiled() && mstar_cpu::request_amx(); }

// Weight [N, K] bf16 -> [ceil(N/32), ceil(K/32), 16, 2, 32] B tiles for `amx_linear`: per
// panel of 32 columns and K step of 32, per k-pair the two tiles' rows (16 columns x 2 k each),
// zero-padded past N and K.
torch::Tensor amx_pack_weight(torch::Tensor weight) {
  const auto w = pack_input(weight, "amx_pack_weight");
  const int64_t n = w.size(-2), k = w.size(-1);
  return pack_each<c10::BFloat16>(
      w,
      {round_up(n, mstar_cpu::kAmxPanelCols) / mstar_cpu::kAmxPanelCols,
       round_up(k, mstar_cpu::kAmxTileK) / mstar_cpu::kAmxTileK, 16, 2, 32},
      mstar_cpu::amx_pack);
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
  const int64_t n = w.size(-2), k = w.size(-1);
  return pack_each<c10::BFloat16>(
      w,
      {round_up(n, mstar_cpu::kDotCols) / mstar_cpu::kDotCols, (k + 1) / 2, mstar_cpu::kDotCols, 2},
      mstar_cpu::dpbf16_pack);
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
  TORCH_CHECK((weight.dim() == 2 || weight.dim() == 3) && glue_dtype(weight),
              "fma_pack_weight: weight must be bfloat16 or float32 [N, K] (or [E, N, K])");
  const auto w = weight.contiguous();
  const int64_t n = w.size(-2), k = w.size(-1);
  torch::Tensor packed;
  by_dtype(w, "fma_pack_weight", [&](auto tag) {
    using T = decltype(tag);
    packed = pack_each<T>(
        w, {round_up(n, mstar_cpu::kFmaCols) / mstar_cpu::kFmaCols, k, mstar_cpu::kFmaCols},
        mstar_cpu::fma_pack<T>);
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

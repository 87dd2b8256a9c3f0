// The raw-pointer entry points of the CPU kernels. Each ISA level compiles the kernel sources
// (attention.cpp, glue.cpp, sampling.cpp, gemm_*.cpp) with its own -march into its own shared
// library; bindings.cpp, compiled once for the x86-64 baseline, checks the tensors and calls
// these. Nothing here includes torch's tensor headers, so a level builds in seconds.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace mstar_cpu {

using bf16 = c10::BFloat16;

// The ISA level these objects were compiled for (MSTAR_ISA_LEVEL, set by build.py)
const char* isa_level();

// -- attention (attention.cpp) ----------------------------------------------------------------
// Decode: q [B, Hq, D] (strides qs0, qs1), kv [pages, 2, S, Hkv, D], table [B, max_pages];
// window > 0: each row sees only its last `window` keys (sliding-window attention).
template <typename T>
void decode_dim(int64_t dim, const T* q, int64_t qs0, int64_t qs1, const T* kv,
                const int64_t* table, const int64_t* lens, T* out, int64_t batch, int64_t hq,
                int64_t hkv, int64_t page_size, int64_t max_pages, float scale, int64_t window,
                const float* sinks);
// Causal prompt-chunk attention over the same pages; out [T, Hq, D] contiguous.
template <typename T>
void prefill_dim(int64_t dim, const T* q, int64_t qs0, int64_t qs1, const T* kv,
                 const int64_t* table, int64_t max_pages, const int64_t* kv_lens,
                 const int64_t* q_starts, const int64_t* q_lens, int64_t batch, T* out,
                 int64_t hq, int64_t hkv, int64_t page_size, float scale, const float* sinks);

// -- glue ops (glue.cpp) ----------------------------------------------------------------------
template <typename T>
void rotate_rows(T* x, int64_t rows, int64_t heads, int64_t row_stride, int64_t half,
                 const T* cos, const T* sin);
// WT: the weight's type, T's (HF's RMSNorm) or float on bf16 rows (Gemma's 1 + w in float32)
template <typename T, typename WT>
void add_rms_norm_rows(T* xs, T* rs, const WT* w, int64_t rows, int64_t hidden, float eps);
template <typename T, typename WT>
void rms_norm_rows(T* x, int64_t rows, int64_t heads, int64_t row_stride, int64_t dim,
                   const WT* w, float eps);
template <typename T>
void silu_mul_rows(const T* xs, T* o, int64_t rows, int64_t inter);
template <typename T>
void gelu_tanh_mul_rows(const T* xs, T* o, int64_t rows, int64_t inter);

// -- sampling (sampling.cpp) ------------------------------------------------------------------
template <typename T>
void argmax_rows_of(const T* xs, int64_t rows, int64_t vocab, int64_t stride, int64_t* o);
void sample_rows_of(const float* xs, int64_t rows, int64_t vocab, int64_t stride,
                    const double* us, int64_t* o);

// -- GEMMs for decode-sized batches (gemm_*.cpp) ---------------------------------------------
// Each packs a weight [N, K] once into its own panel layout and multiplies x [M, K] (row
// stride lda, in elements) by it with float32 accumulation, rounded to x's type once (+ bias).

// AMX tiles (gemm_amx.cpp): panels [ceil(N/32), ceil(K/32), 16, 2, 32]; x's K padded to the
// packed K (the caller copies x when it is not).
constexpr int64_t kAmxTileK = 32;
constexpr int64_t kAmxPanelCols = 32;
bool amx_compiled();
bool request_amx();
void amx_pack(const bf16* w, int64_t n, int64_t k, bf16* packed);
void amx_gemm(const bf16* x, int64_t lda, int64_t m, int64_t k_steps, const bf16* packed,
              int64_t panels, int64_t n, const bf16* bias, bf16* out);

// VDPBF16PS (gemm_dpbf16.cpp): panels [ceil(N/32), ceil(K/2), 32, 2].
constexpr int64_t kDotCols = 32;
bool dpbf16_compiled();
void dpbf16_pack(const bf16* w, int64_t n, int64_t k, bf16* packed);
void dpbf16_gemm(const bf16* x, int64_t lda, int64_t m, int64_t k, const bf16* packed,
                 int64_t panels, int64_t n, const bf16* bias, bf16* out);

// FMA (gemm_fma.cpp) over bf16 widened in registers, for CPUs without bf16 dot products, or
// over float32 (T: bf16 or float, the same for x, weight, bias and out): panels
// [ceil(N/16), K, 16].
constexpr int64_t kFmaCols = 16;
bool fma_compiled();
template <typename T>
void fma_pack(const T* w, int64_t n, int64_t k, T* packed);
template <typename T>
void fma_gemm(const T* x, int64_t lda, int64_t m, int64_t k, const T* packed, int64_t panels,
              int64_t n, const T* bias, T* out);

}  // namespace mstar_cpu

// GGUF block-quantized weights multiplied as stored (quant_gemm.cpp): the raw-pointer entry
// points bindings.cpp calls through quant_bindings.h. The type ids are ggml's
// (GGMLQuantizationType), so a tensor's type from a GGUF file passes straight through.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace mstar_cpu {

enum QuantType : int64_t {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14
};

// Elements and bytes of one block of `type` (32 or 256 elements); 0 for a type not served here.
int64_t quant_block_elems(int64_t type);
int64_t quant_block_bytes(int64_t type);

// True where this level's library runs the AVX512-VNNI dot products (VPDPBUSD) on this CPU.
bool quant_vnni();

// x [M, K] (row stride lda) @ W.T (+ bias) -> out [M, N] (row stride N), W [N, K] the GGUF
// blocks of `type` (each row K / block_elems whole blocks, rows back to back). x's rows are
// quantized to 8 bits per 32 values once per call; dots are integer, sums float32. T: float or
// bf16 (x, bias and out). `quant_rows` + `quant_gemm_parts` with one part.
template <typename T>
void quant_gemm(int64_t type, const uint8_t* w, int64_t n, int64_t k, const T* x, int64_t lda,
                int64_t m, const T* bias, T* out);

// Floats per activation row that `quant_rows` writes beside its bytes: each group's scale d,
// each half-group's d * sum(q), each group's d * sum(q) (4 per 32 values).
inline int64_t quant_row_floats(int64_t k) { return 4 * (k / 32); }

// x [M, K] (row stride lda, K a multiple of 32) -> q [M, K] int8 and scales [M,
// quant_row_floats(K)]: what the integer dot products read. Threads take rows.
template <typename T>
void quant_rows(const T* x, int64_t lda, int64_t m, int64_t k, int8_t* q, float* scales);

// One weight of a projection whose stored parts differ in type (Q4_K q/k beside Q6_K v):
// n rows of K inputs of `type` at w.
struct QuantPart {
  int64_t type;
  const uint8_t* w;
  int64_t n;
};

// `quant_rows`' activations [M, K] @ [parts stacked by rows].T (+ bias [sum n]) -> out [M, sum
// n] (row stride ldc). Every output is the one `quant_gemm` gives for its part alone (the same
// integer dots and sums in the same order), in one pass of threads over all parts' rows.
template <typename T>
void quant_gemm_parts(const QuantPart* parts, int64_t count, int64_t k, const int8_t* q,
                      const float* scales, int64_t m, const T* bias, T* out, int64_t ldc);

// W [N, K] of `type` -> out [N, K] (T: float or bf16), exactly ggml's dequantization (bf16:
// each float32 value rounded once).
template <typename T>
void quant_dequant(int64_t type, const uint8_t* w, int64_t n, int64_t k, T* out);

}  // namespace mstar_cpu

// bf16 GEMM for decode-sized batches on CPUs without bf16 dot products (AVX2 + FMA): the weight
// stays bf16 in memory, half the bytes of a float32 copy, and is widened to float32 in registers
// (a shift of each 16-bit value into the top of a 32-bit lane), then multiplied by FMA with
// float32 accumulation. A decode step's linears read every weight once for a few rows, so the
// bytes read are the time; oneDNN has no bf16 path at all on such CPUs.
//
// The weight is packed once into panels of 16 columns, each k row of a panel 32 contiguous
// bytes, so a panel is one sequential run over K. A pass takes up to kFmaRows rows of x (widened
// to float32 once per call) against one panel: 2 x kFmaRows ymm accumulators on AVX2, the
// widened weights and one broadcast x value; one thread per run of panels multiplies all rows,
// so each weight byte leaves DRAM once, and each pass prefetches its share of the next panel.
// Written with vector extensions, it compiles on every level (16 lanes: two ymm on AVX2, one
// zmm on AVX-512).
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace mstar_cpu {
namespace {

constexpr int kFmaRows = 6;  // rows per pass: 12 ymm accumulators of AVX2's 16 registers

// One output row of a panel, rounded to bf16: all 16 columns, or the first `cols` of the last
// panel (all 16 lanes rounded, the real columns kept).
inline void store_row(bf16* out, f16v v, int64_t cols) {
  if (cols == kFmaCols) {
    store(out, v);
    return;
  }
  bf16 tmp[kFmaCols];
  store(tmp, v);
  std::memcpy(out, tmp, cols * sizeof(bf16));
}

// Rows [0, R) of xf (float32, row stride K) times one packed panel b over all of K, plus bias,
// rounded to bf16 into out (row stride ldo), the first `cols` columns. ``next`` (or null): the
// start of this pass's share of the next panel, ``lines`` cache lines of it, spread over K.
template <int R>
void fma_pass(const float* xf, int64_t kdim, const bf16* b, const char* next, int64_t lines,
              f16v bias, int64_t cols, bf16* out, int64_t ldo) {
  f16v acc[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) acc[i] = f16v{};
  int64_t due = 0;  // lines owed, in units of 1 / kdim
  for (int64_t s = 0; s < kdim; ++s) {
    if (next != nullptr)
      for (due += lines; due >= kdim; due -= kdim, next += 64) __builtin_prefetch(next, 0, 2);
    const f16v w = load(b + s * kFmaCols);  // 16 bf16 widened to float32
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[i] += xf[i * kdim + s] * w;
  }
  for (int i = 0; i < R; ++i) store_row(out + i * ldo, acc[i] + bias, cols);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// AVX2 spells the pass in __m256 pairs: GCC keeps 64-byte vector-extension values in memory
// where no register holds them (moving them through general registers), which made the generic
// pass ~8x slower than this one.
inline __m256 widen8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }

template <int R>
void fma_pass_avx2(const float* xf, int64_t kdim, const bf16* b, const char* next, int64_t lines,
                   f16v bias, int64_t cols, bf16* out, int64_t ldo) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  int64_t due = 0;
  for (int64_t s = 0; s < kdim; ++s) {
    if (next != nullptr)
      for (due += lines; due >= kdim; due -= kdim, next += 64) __builtin_prefetch(next, 0, 2);
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + s * kFmaCols));
    const __m256 w0 = widen8(_mm256_castsi256_si128(w));
    const __m256 w1 = widen8(_mm256_extracti128_si256(w, 1));
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 xv = _mm256_broadcast_ss(xf + i * kdim + s);
      lo[i] = _mm256_fmadd_ps(xv, w0, lo[i]);
      hi[i] = _mm256_fmadd_ps(xv, w1, hi[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(32) float sums[kFmaCols];
    _mm256_store_ps(sums, lo[i]);
    _mm256_store_ps(sums + 8, hi[i]);
    store_row(out + i * ldo, load(sums) + bias, cols);
  }
}
#define MSTAR_FMA_PASS fma_pass_avx2
#else
#define MSTAR_FMA_PASS fma_pass
#endif

using FmaPass = void (*)(const float*, int64_t, const bf16*, const char*, int64_t, f16v, int64_t,
                         bf16*, int64_t);
constexpr FmaPass kFmaPasses[kFmaRows + 1] = {
    nullptr,           MSTAR_FMA_PASS<1>, MSTAR_FMA_PASS<2>, MSTAR_FMA_PASS<3>,
    MSTAR_FMA_PASS<4>, MSTAR_FMA_PASS<5>, MSTAR_FMA_PASS<6>};
#undef MSTAR_FMA_PASS

}  // namespace

bool fma_compiled() {
#if defined(__FMA__) || defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// Weight [N, K] -> [ceil(N/16), K, 16]; the caller zeroes the padding past N.
void fma_pack(const bf16* src, int64_t n, int64_t k, bf16* dst) {
  const int64_t panels = round_up(n, kFmaCols) / kFmaCols;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t col = 0; col < kFmaCols && p * kFmaCols + col < n; ++col) {
        const bf16* row = src + (p * kFmaCols + col) * k;
        bf16* d = dst + p * k * kFmaCols + col;
        for (int64_t j = 0; j < k; ++j) d[j * kFmaCols] = row[j];
      }
  });
}

// x [M, K] (row stride lda) @ the packed weight. The rows are split into passes of near-equal
// size, as `dpbf16_gemm` splits them.
void fma_gemm(const bf16* x, int64_t lda, int64_t m, int64_t k, const bf16* packed,
              int64_t panels, int64_t n, const bf16* bias, bf16* out) {
  std::vector<float> xf(m * k);  // x widened once, not once per panel
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < k; ++j) xf[r * k + j] = static_cast<float>(x[r * lda + j]);
  const int64_t panel_elems = k * kFmaCols;
  const int64_t passes = (m + kFmaRows - 1) / kFmaRows;
  const int64_t lines = (panel_elems * 2 / 64 + passes - 1) / passes;  // per pass
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const bf16* b = packed + p * panel_elems;
      const int64_t c0 = p * kFmaCols, cols = std::min(kFmaCols, n - c0);
      f16v bias_v = f16v{};
      if (bias != nullptr) {
        bf16 tmp[kFmaCols] = {};
        std::memcpy(tmp, bias + c0, cols * sizeof(bf16));
        bias_v = load(tmp);
      }
      for (int64_t pass = 0, r0 = 0; pass < passes; ++pass) {
        const char* next = nullptr;
        if (p + 1 < p1)
          next = reinterpret_cast<const char*>(b + panel_elems) + pass * lines * 64;
        const int64_t rows = m / passes + (pass < m % passes);
        kFmaPasses[rows](xf.data() + r0 * k, k, b, next, lines, bias_v, cols, out + r0 * n + c0,
                         n);
        r0 += rows;
      }
    }
  });
}

}  // namespace mstar_cpu

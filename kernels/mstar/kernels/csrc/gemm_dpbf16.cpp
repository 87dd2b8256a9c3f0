// bf16 GEMM on AVX512-BF16's VDPBF16PS for decode-sized batches: compiled into the levels that
// have the instruction (dpbf16_compiled() is false elsewhere and the entry points do nothing).
#include "kernels.h"
#include "vec.h"

namespace mstar_cpu {
namespace {

// -- bf16 GEMM on VDPBF16PS for decode-sized batches (AVX512-BF16 without AMX) -----------------
// Each instruction multiplies 16 columns by a pair of K: the weight is packed once into panels
// of 32 columns, each k-pair row of a panel 128 contiguous bytes, so a panel is one sequential
// run over K. A pass takes up to 12 rows of x against one panel: 24 float32 accumulators and
// two weight registers of the 32, every x pair broadcast from L1. One thread per run of panels
// multiplies all rows, so each weight byte leaves DRAM once, and each pass prefetches its share
// of the next panel. Measured on a 2-core Zen 5 over SmolLM2's 120 projections, weights cold:
// 5.6 / 5.0 / 9.6 / 18.2 / 34.0 ms against oneDNN's 8.7 / 8.1 / 14.0 / 23.4 / 38.4 at
// 1 / 8 / 32 / 64 / 128 rows (oneDNN's blocking streams the weights at half of DRAM speed
// for few rows and keeps a core's FMA units ~60% busy at 64).
constexpr int kDotRows = 12;      // rows per pass

#if defined(__AVX512BF16__)
// x's k-pair starting at k as one 32-bit lane (the second half zero past an odd K).
inline int32_t k_pair(const c10::BFloat16* row, int64_t k, int64_t kdim) {
  int32_t v = 0;
  std::memcpy(&v, row + k, k + 1 < kdim ? 4 : 2);
  return v;
}

// Rows [0, R) of a (row stride lda) times one packed panel b over all of K, plus bias, rounded
// to bf16 into out (row stride ldo), columns masked by k0 / k1. ``next`` (or null): where this
// pass's share of the next panel starts, ``lines`` cache lines of it, prefetched into L2 evenly
// over the k-pair steps (a whole number of lines per step overshot 3x at 64 rows: 17.0 ->
// 16.3 ms for SmolLM2's projections).
template <int R>
void dot_pass(const c10::BFloat16* a, int64_t lda, int64_t kdim, const c10::BFloat16* b,
              const char* next, int64_t lines, __m512 bias0, __m512 bias1, __mmask16 k0,
              __mmask16 k1, c10::BFloat16* out, int64_t ldo) {
  __m512 c0[R], c1[R];
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i) c0[i] = c1[i] = _mm512_setzero_ps();
  const int64_t whole = kdim / 2, pairs = (kdim + 1) / 2;
  int64_t due = 0;  // lines owed, in units of 1 / pairs
  for (int64_t s = 0; s < pairs; ++s) {
    if (next != nullptr)
      for (due += lines; due >= pairs; due -= pairs, next += 64) _mm_prefetch(next, _MM_HINT_T1);
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + s * 2 * kDotCols);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + s * 2 * kDotCols + 32);
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i) {
      int32_t v;
      if (s < whole)
        std::memcpy(&v, a + i * lda + 2 * s, 4);
      else
        v = k_pair(a + i * lda, 2 * s, kdim);
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(v);
      c0[i] = _mm512_dpbf16_ps(c0[i], ai, b0);
      c1[i] = _mm512_dpbf16_ps(c1[i], ai, b1);
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i) {
    c10::BFloat16* o = out + i * ldo;
    _mm256_mask_storeu_epi16(o, k0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c0[i], bias0)));
    if (k1)
      _mm256_mask_storeu_epi16(o + 16, k1,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c1[i], bias1)));
  }
}

using DotPass = void (*)(const c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*,
                         const char*, int64_t, __m512, __m512, __mmask16, __mmask16,
                         c10::BFloat16*, int64_t);
constexpr DotPass kDotPasses[kDotRows + 1] = {
    nullptr,     dot_pass<1>, dot_pass<2>, dot_pass<3>,  dot_pass<4>,  dot_pass<5>, dot_pass<6>,
    dot_pass<7>, dot_pass<8>, dot_pass<9>, dot_pass<10>, dot_pass<11>, dot_pass<12>};
#endif

}  // namespace

bool dpbf16_compiled() { return kHasDotBf16; }

// Weight [N, K] -> [ceil(N/32), ceil(K/2), 32, 2]: per panel of 32 columns, one row of
// (column, k-pair) per pair of K; the caller zeroes the padding past N and K.
void dpbf16_pack(const bf16* src, int64_t n, int64_t k, bf16* dst) {
  const int64_t panels = round_up(n, kDotCols) / kDotCols, pairs = (k + 1) / 2;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t col = 0; col < kDotCols && p * kDotCols + col < n; ++col) {
        const c10::BFloat16* row = src + (p * kDotCols + col) * k;
        c10::BFloat16* d = dst + p * pairs * kDotCols * 2 + col * 2;
        for (int64_t j = 0; j < k; ++j) d[(j / 2) * kDotCols * 2 + j % 2] = row[j];
      }
  });
}

// x [M, K] (row stride lda) @ the packed weight (see `dot_pass`). The rows are split into
// passes of near-equal size (64 rows: 11, 11, 11, 11, 10, 10, not five of 12 and one of 4).
// One row prefetches nothing: its pass is a pure stream the hardware prefetcher keeps up with,
// and the extra requests cost bandwidth (2-core Zen 4, one row over 386 MB of panels in huge
// pages: 35 GB/s without, 31 GB/s with).
void dpbf16_gemm(const bf16* x, int64_t lda, int64_t m, int64_t k, const bf16* packed,
                 int64_t panels, int64_t n, const bf16* bias_p, bf16* out) {
#if defined(__AVX512BF16__)
  const c10::BFloat16* a = x;
  const c10::BFloat16* b_p = packed;
  c10::BFloat16* o_p = out;
  const int64_t pairs = (k + 1) / 2, panel_elems = pairs * 2 * kDotCols;
  const int64_t passes = (m + kDotRows - 1) / kDotRows;
  const int64_t lines = (panel_elems * 2 / 64 + passes - 1) / passes;  // per pass
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const c10::BFloat16* b = b_p + p * panel_elems;
      const int64_t c0 = p * kDotCols;
      const __mmask16 k0 = lanes(n - c0), k1 = lanes(n - c0 - 16);
      const __m512 bias0 = bias_p ? widen_bf16(k0, bias_p + c0) : _mm512_setzero_ps();
      const __m512 bias1 = bias_p ? widen_bf16(k1, bias_p + c0 + 16) : _mm512_setzero_ps();
      for (int64_t pass = 0, r0 = 0; pass < passes; ++pass) {
        const char* next = nullptr;
        if (m > 1 && p + 1 < p1)
          next = reinterpret_cast<const char*>(b + panel_elems) + pass * lines * 64;
        const int64_t rows = m / passes + (pass < m % passes);
        kDotPasses[rows](a + r0 * lda, lda, k, b, next, lines, bias0, bias1, k0, k1,
                         o_p + r0 * n + c0, n);
        r0 += rows;
      }
    }
  });
#else
  (void)x, (void)lda, (void)m, (void)k, (void)packed, (void)panels, (void)n, (void)bias_p,
      (void)out;
#endif
}

}  // namespace mstar_cpu

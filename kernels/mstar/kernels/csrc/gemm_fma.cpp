// bf16 GEMM for decode-sized batches on CPUs without bf16 dot products (AVX2 + FMA): the weight
// stays bf16 in memory, half the bytes of a float32 copy, and is widened to float32 in registers
// (a shift of each 16-bit value into the top of a 32-bit lane), then multiplied by FMA with
// float32 accumulation. A decode step's linears read every weight once for a few rows, so the
// bytes read are the time; oneDNN has no bf16 path at all on such CPUs.
//
// The weight is packed once into panels of 16 columns, each k row of a panel 32 contiguous
// bytes, so a panel is one sequential run over K. A pass takes up to kFmaRows rows of x (widened
// to float32 once per call) against one panel: 16 / W vectors of accumulators per row (two ymm
// per row on AVX2, 12 of its 16 registers; one zmm on AVX-512), the widened weights and one
// broadcast x value; one thread per run of panels multiplies all rows, so each weight byte leaves
// DRAM once, and each pass prefetches its share of the next panel.
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace mstar_cpu {
namespace {

constexpr int kFmaRows = 6;  // rows per pass: 12 ymm accumulators of AVX2's 16 registers
constexpr int64_t kFmaBlockRows = 64;  // rows per block: 64 x 1536 float32 is 384 KB (L2)
constexpr int kFmaVecs = kFmaCols / W;  // vectors per panel row
static_assert(kFmaCols % W == 0);

// One output row of a panel, rounded to bf16: all 16 columns, or the first `cols` of the last
// panel (all 16 lanes rounded, the real columns kept).
inline void store_row(bf16* out, const vf* v, int64_t cols) {
  if (cols == kFmaCols) {
    for (int c = 0; c < kFmaVecs; ++c) store(out + c * W, v[c]);
    return;
  }
  bf16 tmp[kFmaCols];
  for (int c = 0; c < kFmaVecs; ++c) store(tmp + c * W, v[c]);
  std::memcpy(out, tmp, cols * sizeof(bf16));
}

// Rows [0, R) of xf (float32, row stride K) times one packed panel b over all of K, plus bias,
// rounded to bf16 into out (row stride ldo), the first `cols` columns. ``next`` (or null): the
// start of this pass's share of the next panel, ``lines`` cache lines of it, spread over K.
template <int R>
void fma_pass(const float* xf, int64_t kdim, const bf16* b, const char* next, int64_t lines,
              const vf* bias, int64_t cols, bf16* out, int64_t ldo) {
  vf acc[R][kFmaVecs];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < kFmaVecs; ++c) acc[i][c] = vf{};
  int64_t due = 0;  // lines owed, in units of 1 / kdim
  for (int64_t s = 0; s < kdim; ++s) {
    if (next != nullptr)
      for (due += lines; due >= kdim; due -= kdim, next += 64) __builtin_prefetch(next, 0, 2);
    vf w[kFmaVecs];  // 16 bf16 widened to float32
    for (int c = 0; c < kFmaVecs; ++c) w[c] = load(b + s * kFmaCols + c * W);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const float x = xf[i * kdim + s];
      for (int c = 0; c < kFmaVecs; ++c) acc[i][c] += x * w[c];
    }
  }
  for (int i = 0; i < R; ++i) {
    vf sum[kFmaVecs];
    for (int c = 0; c < kFmaVecs; ++c) sum[c] = acc[i][c] + bias[c];
    store_row(out + i * ldo, sum, cols);
  }
}

using FmaPass = void (*)(const float*, int64_t, const bf16*, const char*, int64_t, const vf*,
                         int64_t, bf16*, int64_t);
constexpr FmaPass kFmaPasses[kFmaRows + 1] = {nullptr,     fma_pass<1>, fma_pass<2>, fma_pass<3>,
                                              fma_pass<4>, fma_pass<5>, fma_pass<6>};

// Rows [0, m) of xf (float32, row stride k) @ the packed weight into out (row stride n): one
// thread per run of panels, each panel multiplied by every row in passes of near-equal size, as
// `dpbf16_gemm` splits them.
void fma_rows(const float* xf, int64_t m, int64_t k, const bf16* packed, int64_t panels,
              int64_t n, const bf16* bias, bf16* out) {
  const int64_t panel_elems = k * kFmaCols;
  const int64_t passes = (m + kFmaRows - 1) / kFmaRows;
  const int64_t lines = (panel_elems * 2 / 64 + passes - 1) / passes;  // per pass
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const bf16* b = packed + p * panel_elems;
      const int64_t c0 = p * kFmaCols, cols = std::min(kFmaCols, n - c0);
      vf bias_v[kFmaVecs] = {};
      if (bias != nullptr) {
        bf16 tmp[kFmaCols] = {};
        std::memcpy(tmp, bias + c0, cols * sizeof(bf16));
        for (int c = 0; c < kFmaVecs; ++c) bias_v[c] = load(tmp + c * W);
      }
      for (int64_t pass = 0, r0 = 0; pass < passes; ++pass) {
        const char* next = nullptr;
        if (p + 1 < p1)
          next = reinterpret_cast<const char*>(b + panel_elems) + pass * lines * 64;
        const int64_t rows = m / passes + (pass < m % passes);
        kFmaPasses[rows](xf + r0 * k, k, b, next, lines, bias_v, cols, out + r0 * n + c0, n);
        r0 += rows;
      }
    }
  });
}

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

// x [M, K] (row stride lda) @ the packed weight, x widened to float32 once (not once per panel),
// then in blocks of kFmaBlockRows rows: a block's float32 rows stay in L2 while every panel
// passes over them (a prompt chunk's whole x would come from DRAM again for every panel).
void fma_gemm(const bf16* x, int64_t lda, int64_t m, int64_t k, const bf16* packed,
              int64_t panels, int64_t n, const bf16* bias, bf16* out) {
  std::vector<float> xf(m * k);
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < k; ++j) xf[r * k + j] = static_cast<float>(x[r * lda + j]);
  });
  for (int64_t r0 = 0; r0 < m; r0 += kFmaBlockRows)
    fma_rows(xf.data() + r0 * k, std::min(kFmaBlockRows, m - r0), k, packed, panels, n, bias,
             out + r0 * n);
}

}  // namespace mstar_cpu

// GEMM for decode-sized batches by FMA with float32 accumulation, over bf16 or float32 weights.
// bf16: for CPUs without bf16 dot products (AVX2 + FMA), the weight stays bf16 in memory, half
// the bytes of a float32 copy, and is widened to float32 in registers (a shift of each 16-bit
// value into the top of a 32-bit lane); oneDNN has no bf16 path at all on such CPUs. float32:
// oneDNN's packed kernel streamed a one-row batch's weights at about half of DRAM bandwidth
// (a 2-core Zen 5), where this one streams them like the bf16 path. A decode step's linears
// read every weight once for a few rows, so the bytes read are the time.
//
// The weight is packed once into panels of 16 columns, each k row of a panel 16 contiguous
// elements (32 bytes of bf16, one 64-byte line of float32), so a panel is one sequential run
// over K. A pass takes up to kFmaRows rows of x (widened
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
// Independent accumulator chains per output vector, alternating over K: with one zmm per row
// (AVX-512), a one-row pass is a single chain of dependent FMAs, latency-bound (a one-row
// float32 step's linears took 18.7 ms at avx512-bf16 against 14.3 at x86-64-v3, whose two ymm
// per row already make two chains). Fixed per level, never per row count, so a row's sum over
// K is the same whatever batch it is in (`--deterministic` relies on it).
constexpr int kFmaChains = kFmaVecs == 1 ? 2 : 1;
static_assert(kFmaChains <= 2);

// One output row of a panel, rounded to T: all 16 columns, or the first `cols` of the last
// panel (all 16 lanes rounded, the real columns kept).
template <typename T>
inline void store_row(T* out, const vf* v, int64_t cols) {
  if (cols == kFmaCols) {
    for (int c = 0; c < kFmaVecs; ++c) store(out + c * W, v[c]);
    return;
  }
  T tmp[kFmaCols];
  for (int c = 0; c < kFmaVecs; ++c) store(tmp + c * W, v[c]);
  std::memcpy(out, tmp, cols * sizeof(T));
}

// Rows [0, R) of xf (float32, row stride K) times one packed panel b over all of K, plus bias,
// rounded to T into out (row stride ldo), the first `cols` columns. ``next`` (or null): the
// start of this pass's share of the next panel, ``lines`` cache lines of it, spread over K.
template <typename T, int R>
void fma_pass(const float* xf, int64_t kdim, const T* b, const char* next, int64_t lines,
              const vf* bias, int64_t cols, T* out, int64_t ldo) {
  vf acc[kFmaChains][R][kFmaVecs];
#pragma GCC unroll 8
  for (int h = 0; h < kFmaChains; ++h)
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < kFmaVecs; ++c) acc[h][i][c] = vf{};
  int64_t due = 0;  // lines owed, in units of 1 / kdim
  // k step s into chain h (a compile-time index, so the accumulators stay in registers)
  const auto step = [&](int64_t s, auto h) {
    if (next != nullptr)
      for (due += lines; due >= kdim; due -= kdim, next += 64) __builtin_prefetch(next, 0, 2);
    vf w[kFmaVecs];  // 16 weights (bf16 widened) as float32
    for (int c = 0; c < kFmaVecs; ++c) w[c] = load(b + s * kFmaCols + c * W);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const float x = xf[i * kdim + s];
      for (int c = 0; c < kFmaVecs; ++c) acc[decltype(h)::value][i][c] += x * w[c];
    }
  };
  int64_t s = 0;
  for (; s + kFmaChains <= kdim; s += kFmaChains) {
    step(s, std::integral_constant<int, 0>{});
    if constexpr (kFmaChains == 2) step(s + 1, std::integral_constant<int, 1>{});
  }
  if (s < kdim) step(s, std::integral_constant<int, 0>{});
  for (int i = 0; i < R; ++i) {
    vf sum[kFmaVecs];
    for (int c = 0; c < kFmaVecs; ++c) {
      sum[c] = acc[0][i][c];
      for (int h = 1; h < kFmaChains; ++h) sum[c] += acc[h][i][c];
      sum[c] += bias[c];
    }
    store_row(out + i * ldo, sum, cols);
  }
}

template <typename T>
using FmaPass = void (*)(const float*, int64_t, const T*, const char*, int64_t, const vf*,
                         int64_t, T*, int64_t);
template <typename T>
constexpr FmaPass<T> kFmaPasses[kFmaRows + 1] = {
    nullptr, fma_pass<T, 1>, fma_pass<T, 2>, fma_pass<T, 3>,
    fma_pass<T, 4>, fma_pass<T, 5>, fma_pass<T, 6>};

// Rows [0, m) of xf (float32, row stride k) @ the packed weight into out (row stride n): one
// thread per run of panels, each panel multiplied by every row in passes of near-equal size, as
// `dpbf16_gemm` splits them.
template <typename T>
void fma_rows(const float* xf, int64_t m, int64_t k, const T* packed, int64_t panels,
              int64_t n, const T* bias, T* out) {
  const int64_t panel_elems = k * kFmaCols;
  const int64_t passes = (m + kFmaRows - 1) / kFmaRows;
  const int64_t panel_lines = panel_elems * static_cast<int64_t>(sizeof(T)) / 64;
  const int64_t lines = (panel_lines + passes - 1) / passes;  // per pass
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const T* b = packed + p * panel_elems;
      const int64_t c0 = p * kFmaCols, cols = std::min(kFmaCols, n - c0);
      vf bias_v[kFmaVecs] = {};
      if (bias != nullptr) {
        T tmp[kFmaCols] = {};
        std::memcpy(tmp, bias + c0, cols * sizeof(T));
        for (int c = 0; c < kFmaVecs; ++c) bias_v[c] = load(tmp + c * W);
      }
      for (int64_t pass = 0, r0 = 0; pass < passes; ++pass) {
        const char* next = nullptr;
        if (p + 1 < p1)
          next = reinterpret_cast<const char*>(b + panel_elems) + pass * lines * 64;
        const int64_t rows = m / passes + (pass < m % passes);
        kFmaPasses<T>[rows](xf + r0 * k, k, b, next, lines, bias_v, cols, out + r0 * n + c0, n);
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
template <typename T>
void fma_pack(const T* src, int64_t n, int64_t k, T* dst) {
  const int64_t panels = round_up(n, kFmaCols) / kFmaCols;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t col = 0; col < kFmaCols && p * kFmaCols + col < n; ++col) {
        const T* row = src + (p * kFmaCols + col) * k;
        T* d = dst + p * k * kFmaCols + col;
        for (int64_t j = 0; j < k; ++j) d[j * kFmaCols] = row[j];
      }
  });
}

// x [M, K] (row stride lda) @ the packed weight in blocks of kFmaBlockRows rows: a block's
// float32 rows stay in L2 while every panel passes over them (a prompt chunk's whole x would
// come from DRAM again for every panel). bf16 x is widened to float32 once (not once per
// panel); float32 x with contiguous rows is read in place.
template <typename T>
void fma_gemm(const T* x, int64_t lda, int64_t m, int64_t k, const T* packed, int64_t panels,
              int64_t n, const T* bias, T* out) {
  std::vector<float> copy;
  const float* xf = nullptr;
  if constexpr (std::is_same_v<T, float>) xf = lda == k ? x : nullptr;
  if (xf == nullptr) {
    copy.resize(m * k);
    at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t j = 0; j < k; ++j) copy[r * k + j] = static_cast<float>(x[r * lda + j]);
    });
    xf = copy.data();
  }
  for (int64_t r0 = 0; r0 < m; r0 += kFmaBlockRows)
    fma_rows(xf + r0 * k, std::min(kFmaBlockRows, m - r0), k, packed, panels, n, bias,
             out + r0 * n);
}

template void fma_pack(const bf16*, int64_t, int64_t, bf16*);
template void fma_pack(const float*, int64_t, int64_t, float*);
template void fma_gemm(const bf16*, int64_t, int64_t, int64_t, const bf16*, int64_t, int64_t,
                       const bf16*, bf16*);
template void fma_gemm(const float*, int64_t, int64_t, int64_t, const float*, int64_t, int64_t,
                       const float*, float*);

}  // namespace mstar_cpu

// GEMM over GGUF block-quantized weights, read as stored (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
// Q5_K, Q6_K).
// A decode step's linears read each weight once for a few rows, so bytes read are the time: a
// Q4 weight is ~0.28x of bf16's bytes. As llama.cpp's ggml-cpu does, each call quantizes x's
// rows to 8 bits per group of 32 values (one float scale each, and the scaled sum of each half,
// for the types with offsets), then multiplies integer weights by integer activations: per
// group, 32 weights are unpacked in registers (nibbles, fifth / sixth bits) to bytes, dotted
// with the activations (VPMADDUBSW + VPMADDWD on AVX2, VPDPBUSD on AVX512-VNNI), and the 8
// int32 sums scaled into float32 accumulators; offsets are added once per group from the
// activation sums. Threads take runs of weight rows: each a sequential stream of the blocks.
// The x86-64 baseline runs the same arithmetic in plain C++ (no SSSE3 there).
// Batches of kTileMinRows rows or more (several decode rows, prompt chunks) take the tiles of
// quant_tile.h instead, as llama.cpp's repacked GEMMs do: a tile of weight rows is unpacked
// once per call, and a group's int32 sums are one vector per activation row across the tile's
// weight rows, so each conversion and FMA serves 8 or 16 outputs. SmolLM2's layers, one thread
// of a 2-core Zen 4, Q4_1 at 64 rows: 92 G multiply-adds/s against 31 for the 4-row kernel
// (VNNI); 53 against 25 (AVX2).
#include <ATen/Parallel.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "quant.h"
#include "quant_formats.h"

namespace mstar_cpu {
namespace {

// One activation row quantized: q [K], d [K / 32] (each group's scale), ds [K / 16] (each
// half-group's d * sum of q, what an offset multiplies), dsum [K / 32] (the same per group).
struct QuantAct {
  const int8_t* q;
  const float* d;
  const float* ds;
  const float* dsum;
};

constexpr int kQuantRows = 4;  // activation rows per pass over a weight row
constexpr int64_t kTileMinRows = 8;  // batches from here take the batched (tile) kernels
using RowsKernel = void (*)(const uint8_t*, int64_t, const QuantAct*, int, float*);

constexpr int kMaxTileRows = 8;  // the most activation rows of a batched micro-kernel call
// A tile of weight rows unpacked for the batched kernels (quant_simd.h): q [K / 4][cols][4]
// (each 4 values of K one dword per weight row), s [K / 16][cols] (half-group scales), m
// [K / 32][cols] (group offsets); rows past the weight are zero.
struct WeightTile {
  const uint8_t* q;
  const float* s;
  const float* m;
};
// A type's batched kernels at one level: unpack (weight row, blocks, its row of the tile's
// row-major bytes [cols][K], its column of the tile's s, m, cols) each row once, pack (those
// bytes, K, the tile's q), then kernels[rows - 1] (tile, groups, activation rows, their xsum,
// res [rows][cols]) over `cols` weight rows and up to `rows` activation rows.
struct TileFns {
  void (*unpack)(const uint8_t*, int64_t, uint8_t*, float*, float*, int64_t) = nullptr;
  void (*pack)(const uint8_t*, int64_t, uint8_t*) = nullptr;
  void (*kernels[kMaxTileRows])(const WeightTile&, int64_t, const QuantAct*, const int32_t*,
                                float*) = {};
  int cols = 0, rows = 0;
};

#if defined(__AVX2__)
namespace avx2 {
#define MSTAR_QUANT_VNNI 0
#include "quant_simd.h"
#include "quant_tile.h"
#undef MSTAR_QUANT_VNNI
}  // namespace avx2
#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512vnni")
namespace vnni {
#define MSTAR_QUANT_VNNI 1
#include "quant_simd.h"
#include "quant_tile.h"
#undef MSTAR_QUANT_VNNI
}  // namespace vnni
#pragma GCC pop_options
#endif
#endif

#if !defined(__AVX2__)
// The baseline: each block decoded to Groups, integer dots per half-group.
template <int64_t kType>
void scalar_rows(const uint8_t* w, int64_t blocks, const QuantAct* a, int rows, float* res) {
  const int64_t bytes = quant_block_bytes(kType);
  Group g[8];
  float acc[kQuantRows] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const int groups = decode_block(kType, w + b * bytes, g);
    for (int i = 0; i < groups; ++i) {
      const int64_t gi = b * groups + i;
      for (int r = 0; r < rows; ++r) {
        const int8_t* x = a[r].q + gi * kGroup;
        int32_t sum[2] = {0, 0};
        for (int h = 0; h < 2; ++h)
          for (int e = 16 * h; e < 16 * h + 16; ++e) sum[h] += g[i].q[e] * x[e];
        acc[r] += a[r].d[gi] * (g[i].s[0] * sum[0] + g[i].s[1] * sum[1]) +
                  g[i].m[0] * a[r].ds[2 * gi] + g[i].m[1] * a[r].ds[2 * gi + 1];
      }
    }
  }
  std::copy(acc, acc + rows, res);
}

RowsKernel scalar_kernel(int64_t type) {
  switch (type) {
    case kQ8_0: return scalar_rows<kQ8_0>;
    case kQ4_0: return scalar_rows<kQ4_0>;
    case kQ4_1: return scalar_rows<kQ4_1>;
    case kQ5_0: return scalar_rows<kQ5_0>;
    case kQ5_1: return scalar_rows<kQ5_1>;
    case kQ4_K: return scalar_rows<kQ4_K>;
    case kQ5_K: return scalar_rows<kQ5_K>;
    case kQ6_K: return scalar_rows<kQ6_K>;
    default: return nullptr;
  }
}
#endif

// The batched kernels for `type` at this level, or none (the x86-64 baseline: its 4-row kernel
// serves every batch).
TileFns tile_for(int64_t type) {
#if defined(__AVX2__) && defined(__AVX512F__)
  if (quant_vnni()) return vnni::tile_kernel(type);
#endif
#if defined(__AVX2__)
  return avx2::tile_kernel(type);
#else
  (void)type;
  return {};
#endif
}

// 128 times the sum of q of each group, then of each half-group, per activation row [m][3 * K / 32]
// (the AVX-512 kernels' correction for signed weights).
std::vector<int32_t> x_sums(const int8_t* q, int64_t m, int64_t k) {
  const int64_t groups = k / kGroup;
  std::vector<int32_t> out(m * 3 * groups, 0);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t h = 0; h < 2 * groups; ++h) {
      int32_t sum = 0;
      for (int e = 0; e < 16; ++e) sum += q[r * k + 16 * h + e];
      out[r * 3 * groups + h / 2] += 128 * sum;
      out[r * 3 * groups + groups + h] = 128 * sum;
    }
  return out;
}

RowsKernel kernel_for(int64_t type) {
#if defined(__AVX2__) && defined(__AVX512F__)
  if (quant_vnni()) return vnni::rows_kernel(type);
#endif
#if defined(__AVX2__)
  return avx2::rows_kernel(type);
#else
  return scalar_kernel(type);
#endif
}

// One row of x -> its QuantAct arrays: per group d = max|x| / 127, q = x * 127 / max|x|
// rounded to nearest even (all zero for an all-zero group); scales: d [K / 32], then ds
// [K / 16], then dsum [K / 32] (`quant_row_floats`).
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* q, float* scales) {
  const int64_t groups = k / kGroup;
  float* d = scales;
  float* ds = scales + groups;
  float* dsum = scales + 3 * groups;
  for (int64_t g = 0; g < groups; ++g) {
    float v[kGroup];
    float amax = 0.0f;
    for (int e = 0; e < kGroup; ++e) {
      v[e] = static_cast<float>(x[g * kGroup + e]);
      amax = std::max(amax, std::fabs(v[e]));
    }
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum[2] = {0, 0};
    for (int e = 0; e < kGroup; ++e) {
      const int32_t r = static_cast<int32_t>(__builtin_rintf(v[e] * id));
      q[g * kGroup + e] = static_cast<int8_t>(r);
      sum[e / 16] += r;
    }
    d[g] = amax / 127.0f;
    ds[2 * g] = d[g] * static_cast<float>(sum[0]);
    ds[2 * g + 1] = d[g] * static_cast<float>(sum[1]);
    dsum[g] = d[g] * static_cast<float>(sum[0] + sum[1]);
  }
}

}  // namespace

int64_t quant_block_elems(int64_t type) {
  switch (type) {
    case kQ8_0: case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: return 32;
    case kQ4_K: case kQ5_K: case kQ6_K: return 256;
    default: return 0;
  }
}

int64_t quant_block_bytes(int64_t type) {
  switch (type) {
    case kQ8_0: return 34;
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

bool quant_vnni() {
#if defined(__AVX2__) && defined(__AVX512F__)
  static const bool has = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  return has;
#else
  return false;
#endif
}

namespace {

struct Run {  // one part: its type and kernel, rows and first output column
  int64_t type;
  RowsKernel kernel;
  const uint8_t* w;
  int64_t blocks, row_bytes, col0, end;
};

// The parts' rows (`runs`) in tiles of the level's weight rows (a tile never spans two parts),
// each unpacked once, times the m activation rows, the level's micro-kernel rows at a time.
template <typename T>
void tile_parts(const std::vector<Run>& runs, int64_t k, const int8_t* q, const QuantAct* act,
                int64_t m, const T* bias, T* out, int64_t ldc) {
  const int64_t groups = k / kGroup;
  std::vector<TileFns> fns;
  for (const Run& run : runs) fns.push_back(tile_for(run.type));
  const int cols = fns[0].cols, rows = fns[0].rows;
  const std::vector<int32_t> xsum = x_sums(q, m, k);
  struct Tile {
    size_t run;
    int64_t col;
    int n;
  };
  std::vector<Tile> tiles;
  for (size_t p = 0; p < runs.size(); ++p)
    for (int64_t col = runs[p].col0; col < runs[p].end; col += cols)
      tiles.push_back({p, col, static_cast<int>(std::min<int64_t>(cols, runs[p].end - col))});
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> u(cols * k), tq(cols * k);
    std::vector<float> ts(cols * (k / 16)), tm(cols * groups), res(rows * cols);
    for (int64_t ti = t0; ti < t1; ++ti) {
      const Tile& tile = tiles[ti];
      const Run& run = runs[tile.run];
      const TileFns& f = fns[tile.run];
      if (tile.n < cols) {  // the rows past the weight dot to zero
        std::fill(u.begin(), u.end(), 0);
        std::fill(ts.begin(), ts.end(), 0.0f);
        std::fill(tm.begin(), tm.end(), 0.0f);
      }
      for (int w = 0; w < tile.n; ++w)
        f.unpack(run.w + (tile.col + w - run.col0) * run.row_bytes, run.blocks, u.data() + w * k,
                 ts.data() + w, tm.data() + w, cols);
      f.pack(u.data(), k, tq.data());
      const WeightTile wt{tq.data(), ts.data(), tm.data()};
      for (int64_t r0 = 0; r0 < m; r0 += rows) {
        const int nr = static_cast<int>(std::min<int64_t>(rows, m - r0));
        f.kernels[nr - 1](wt, groups, act + r0, xsum.data() + r0 * 3 * groups, res.data());
        for (int r = 0; r < nr; ++r)
          for (int w = 0; w < tile.n; ++w) {
            const int64_t col = tile.col + w;
            const float b = bias != nullptr ? static_cast<float>(bias[col]) : 0.0f;
            out[(r0 + r) * ldc + col] = static_cast<T>(res[r * cols + w] + b);
          }
      }
    }
  });
}

}  // namespace

template <typename T>
void quant_rows(const T* x, int64_t lda, int64_t m, int64_t k, int8_t* q, float* scales) {
  const int64_t floats = quant_row_floats(k);
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row(x + r * lda, k, q + r * k, scales + r * floats);
  });
}

template <typename T>
void quant_gemm_parts(const QuantPart* parts, int64_t count, int64_t k, const int8_t* q,
                      const float* scales, int64_t m, const T* bias, T* out, int64_t ldc) {
  const int64_t groups = k / kGroup, floats = quant_row_floats(k);
  std::vector<QuantAct> act(m);
  for (int64_t r = 0; r < m; ++r) {
    const float* s = scales + r * floats;
    act[r] = {q + r * k, s, s + groups, s + 3 * groups};
  }
  std::vector<Run> runs;
  int64_t total = 0;
  for (int64_t p = 0; p < count; ++p) {
    const int64_t blocks = k / quant_block_elems(parts[p].type);
    runs.push_back({parts[p].type, kernel_for(parts[p].type), parts[p].w, blocks,
                    blocks * quant_block_bytes(parts[p].type), total, total + parts[p].n});
    total += parts[p].n;
  }
  if (m >= kTileMinRows && tile_for(parts[0].type).cols > 0)
    return tile_parts(runs, k, q, act.data(), m, bias, out, ldc);
  at::parallel_for(0, total, 8, [&](int64_t c0, int64_t c1) {
    float res[kQuantRows];
    size_t p = 0;
    for (int64_t col = c0; col < c1; ++col) {
      while (col >= runs[p].end) ++p;
      const Run& run = runs[p];
      const uint8_t* w = run.w + (col - run.col0) * run.row_bytes;
      const float b = bias != nullptr ? static_cast<float>(bias[col]) : 0.0f;
      for (int64_t r0 = 0; r0 < m; r0 += kQuantRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kQuantRows, m - r0));
        run.kernel(w, run.blocks, act.data() + r0, rows, res);
        for (int r = 0; r < rows; ++r) out[(r0 + r) * ldc + col] = static_cast<T>(res[r] + b);
      }
    }
  });
}

template <typename T>
void quant_gemm(int64_t type, const uint8_t* w, int64_t n, int64_t k, const T* x, int64_t lda,
                int64_t m, const T* bias, T* out) {
  std::vector<int8_t> q(m * k);
  std::vector<float> scales(m * quant_row_floats(k));
  quant_rows(x, lda, m, k, q.data(), scales.data());
  const QuantPart part{type, w, n};
  quant_gemm_parts(&part, 1, k, q.data(), scales.data(), m, bias, out, n);
}

namespace {

#if !defined(__AVX2__)
// The baseline's quant_dequant for one type (a constant: decode_block's switch folds away).
template <int64_t kType, typename T>
void dequant_scalar(const uint8_t* w, int64_t k, float*, float*, T* out) {
  const int64_t elems = quant_block_elems(kType), bytes = quant_block_bytes(kType);
  Group g[8];
  for (int64_t b = 0; b < k / elems; ++b) {
    const int groups = decode_block(kType, w + b * bytes, g);
    for (int i = 0; i < groups; ++i)
      for (int e = 0; e < kGroup; ++e)
        out[b * elems + i * kGroup + e] =
            static_cast<T>(g[i].s[e / 16] * g[i].q[e] + g[i].m[e / 16]);
  }
}
#endif

template <typename T>
void (*dequant_for(int64_t type))(const uint8_t*, int64_t, float*, float*, T*) {
#if defined(__AVX2__)
  return avx2::dequant_kernel<T>(type);
#else
  switch (type) {
    case kQ8_0: return dequant_scalar<kQ8_0, T>;
    case kQ4_0: return dequant_scalar<kQ4_0, T>;
    case kQ4_1: return dequant_scalar<kQ4_1, T>;
    case kQ5_0: return dequant_scalar<kQ5_0, T>;
    case kQ5_1: return dequant_scalar<kQ5_1, T>;
    case kQ4_K: return dequant_scalar<kQ4_K, T>;
    case kQ5_K: return dequant_scalar<kQ5_K, T>;
    case kQ6_K: return dequant_scalar<kQ6_K, T>;
    default: return nullptr;
  }
#endif
}

}  // namespace

template <typename T>
void quant_dequant(int64_t type, const uint8_t* w, int64_t n, int64_t k, T* out) {
  const auto row_fn = dequant_for<T>(type);
  const int64_t row_bytes = k / quant_block_elems(type) * quant_block_bytes(type);
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> row(k), half_m(k / 16);
    for (int64_t r = n0; r < n1; ++r) row_fn(w + r * row_bytes, k, row.data(), half_m.data(), out + r * k);
  });
}

template void quant_gemm(int64_t, const uint8_t*, int64_t, int64_t, const float*, int64_t,
                         int64_t, const float*, float*);
template void quant_gemm(int64_t, const uint8_t*, int64_t, int64_t, const c10::BFloat16*,
                         int64_t, int64_t, const c10::BFloat16*, c10::BFloat16*);
template void quant_rows(const float*, int64_t, int64_t, int64_t, int8_t*, float*);
template void quant_rows(const c10::BFloat16*, int64_t, int64_t, int64_t, int8_t*, float*);
template void quant_gemm_parts(const QuantPart*, int64_t, int64_t, const int8_t*, const float*,
                               int64_t, const float*, float*, int64_t);
template void quant_gemm_parts(const QuantPart*, int64_t, int64_t, const int8_t*, const float*,
                               int64_t, const c10::BFloat16*, c10::BFloat16*, int64_t);
template void quant_dequant(int64_t, const uint8_t*, int64_t, int64_t, float*);
template void quant_dequant(int64_t, const uint8_t*, int64_t, int64_t, c10::BFloat16*);

}  // namespace mstar_cpu

// Batched LoRA (see lora.h), Punica's shrink-then-expand over blocks of rows that share a slot.
// The rows of each slot are gathered from every segment first (a decode step interleaves the
// adapters row by row), so each slot's A and B^T are read once per block of up to kRows rows,
// not once per row. Shrink: v[i][j] = scale * x_i . A_j, kShrinkRows rows by kShrinkRanks ranks
// at a time (each loaded A and x vector feeds several FMAs); expand: y_i += sum_j v[i][j] B^T_j
// over W-column chunks with the block's kRows accumulators in registers. bf16 on AVX512-BF16
// takes both in VDPBF16PS pairs. Sums in float32. Blocks run in parallel on torch's OpenMP team
// when the step has enough work to pay for the fork; each block writes its own rows of y, so no
// two threads touch one element.
#include "lora.h"

#include <type_traits>
#include <utility>
#include <vector>

#include "vec.h"

namespace mstar_cpu {
namespace {

// Rows per block: the expand's accumulators (half the register file).
constexpr int kRows = kAccVecs;
// The shrink's register tile: rows x ranks accumulators plus one vector per rank and per row.
constexpr int kShrinkRows = 4;
constexpr int kShrinkRanks = kRegVecs >= 32 ? 4 : (kRegVecs >= 16 ? 2 : 1);
// Below this many multiply-adds a step's LoRA runs on the calling thread.
constexpr int64_t kParallelWork = 1 << 16;

struct Block {
  int64_t slot;
  int rows;
  int64_t row[kRows];
};

// v[i * rank + j0 + j] = scale * x_{row[i]} . A_{j0 + j} for NR rows and NJ ranks.
template <int NR, int NJ, typename T>
void shrink_tile(const T* x, int64_t ldx, const int64_t* row, const T* a, int64_t k, int64_t j0,
                 int64_t rank, float scale, float* v) {
  const T* xr[NR];
  for (int i = 0; i < NR; ++i) xr[i] = x + row[i] * ldx;
  const T* aj[NJ];
  for (int j = 0; j < NJ; ++j) aj[j] = a + (j0 + j) * k;
  vf acc[NR][NJ] = {};
  int64_t done = 0;  // the columns the vector loop summed
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // bf16 pairs straight into VDPBF16PS (32 columns an instruction, no widening); the last
    // chunk's missing columns load as zeros
    for (int64_t c = 0; c < k; c += 32) {
      const auto keep = static_cast<__mmask32>(k - c >= 32 ? ~0u : (1u << (k - c)) - 1);
      __m512bh av[NJ];
      for (int j = 0; j < NJ; ++j) av[j] = (__m512bh)_mm512_maskz_loadu_epi16(keep, aj[j] + c);
      for (int i = 0; i < NR; ++i) {
        const auto xv = (__m512bh)_mm512_maskz_loadu_epi16(keep, xr[i] + c);
        for (int j = 0; j < NJ; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, av[j]);
      }
    }
    done = k;
  }
#endif
  if (done == 0) {
    done = k / W * W;
    for (int64_t c = 0; c < done; c += W) {
      vf av[NJ];
      for (int j = 0; j < NJ; ++j) av[j] = load(aj[j] + c);
      for (int i = 0; i < NR; ++i) {
        const vf xv = load(xr[i] + c);
        for (int j = 0; j < NJ; ++j) acc[i][j] += xv * av[j];
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NJ; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t c = done; c < k; ++c)
        s += static_cast<float>(xr[i][c]) * static_cast<float>(aj[j][c]);
      v[i * rank + j0 + j] = scale * s;
    }
}

template <int NR, typename T>
void shrink_rows(const T* x, int64_t ldx, const int64_t* row, const T* a, int64_t k,
                 int64_t rank, float scale, float* v) {
  int64_t j = 0;
  for (; j + kShrinkRanks <= rank; j += kShrinkRanks)
    shrink_tile<NR, kShrinkRanks>(x, ldx, row, a, k, j, rank, scale, v);
  for (; j < rank; ++j) shrink_tile<NR, 1>(x, ldx, row, a, k, j, rank, scale, v);
}

// y_{row[i]} += sum_j v[i][j] B^T_j for the block's NR rows, columns c0 .. n.
template <int NR, typename T>
void expand(T* const* yr, const T* b, int64_t n, int64_t rank, const float* v, int64_t c0) {
  int64_t c = c0;
  for (; c + W <= n; c += W) {
    vf acc[NR] = {};
    for (int64_t j = 0; j < rank; ++j) {
      const vf bj = load(b + j * n + c);
      for (int i = 0; i < NR; ++i) acc[i] += v[i * rank + j] * bj;
    }
    for (int i = 0; i < NR; ++i) store(yr[i] + c, load(yr[i] + c) + acc[i]);
  }
  for (; c < n; ++c)
    for (int i = 0; i < NR; ++i) {
      float acc = 0.f;
      for (int64_t j = 0; j < rank; ++j) acc += v[i * rank + j] * static_cast<float>(b[j * n + c]);
      yr[i][c] = static_cast<T>(static_cast<float>(yr[i][c]) + acc);
    }
}

#if defined(__AVX512BF16__)
// VDPBF16PS's pairs from rows j, j + 1 of B^T: lane 2t from the first row's column t, lane
// 2t + 1 from the second's (kPairLo: columns 0 .. 15 of a 32-column chunk, kPairHi: 16 .. 31).
alignas(64) constexpr int16_t kPairLo[32] = {
    0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) constexpr int16_t kPairHi[32] = {
    16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

// The bf16 expand of NG (<= 8) rows over whole 32-column chunks: two ranks an instruction, v
// rounded to bf16 (as a bf16 model's lora_A output is); an odd last rank in float32. Returns
// the columns done.
template <int NG>
int64_t expand_pairs(c10::BFloat16* const* yr, const c10::BFloat16* b, int64_t n, int64_t rank,
                     const float* v) {
  const int64_t pairs = rank / 2, cols = n / 32 * 32;
  std::vector<uint32_t> vp(static_cast<size_t>(NG * pairs));
  for (int i = 0; i < NG; ++i)
    for (int64_t p = 0; p < pairs; ++p)
      vp[i * pairs + p] = c10::BFloat16(v[i * rank + 2 * p]).x |
                          static_cast<uint32_t>(c10::BFloat16(v[i * rank + 2 * p + 1]).x) << 16;
  const __m512i lo_idx = _mm512_load_si512(kPairLo), hi_idx = _mm512_load_si512(kPairHi);
  for (int64_t c = 0; c < cols; c += 32) {
    vf acc[NG][2] = {};
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512i r0 = _mm512_loadu_si512(b + 2 * p * n + c);
      const __m512i r1 = _mm512_loadu_si512(b + (2 * p + 1) * n + c);
      const auto lo = (__m512bh)_mm512_permutex2var_epi16(r0, lo_idx, r1);
      const auto hi = (__m512bh)_mm512_permutex2var_epi16(r0, hi_idx, r1);
      for (int i = 0; i < NG; ++i) {
        const auto vb = (__m512bh)_mm512_set1_epi32(static_cast<int>(vp[i * pairs + p]));
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], vb, lo);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], vb, hi);
      }
    }
    if (rank % 2 == 1) {
      const c10::BFloat16* last = b + (rank - 1) * n + c;
      const vf b0 = load(last), b1 = load(last + 16);
      for (int i = 0; i < NG; ++i) {
        acc[i][0] += v[i * rank + rank - 1] * b0;
        acc[i][1] += v[i * rank + rank - 1] * b1;
      }
    }
    for (int i = 0; i < NG; ++i) {
      store(yr[i] + c, load(yr[i] + c) + acc[i][0]);
      store(yr[i] + c + 16, load(yr[i] + c + 16) + acc[i][1]);
    }
  }
  return cols;
}
#endif

// The block's expand: bf16 pairs where the level has VDPBF16PS (8 rows at a time, within the
// register file), the rest (and every other case) in float32.
template <int NR, typename T>
void expand_rows(T* const* yr, const T* b, int64_t n, int64_t rank, const float* v) {
  int64_t c0 = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if constexpr (NR > 8) {
      expand_pairs<8>(yr, b, n, rank, v);
      c0 = expand_pairs<NR - 8>(yr + 8, b, n, rank, v + 8 * rank);
    } else {
      c0 = expand_pairs<NR>(yr, b, n, rank, v);
    }
  }
#endif
  expand<NR>(yr, b, n, rank, v, c0);
}

template <int NR, typename T>
void run_block(T* y, int64_t ldy, const T* x, int64_t ldx, const LoraWeights<T>& w,
               const Block& blk) {
  const int64_t rank = w.ranks[blk.slot];
  const T* a = w.a + blk.slot * w.max_rank * w.k;
  const T* b = w.b + blk.slot * w.max_rank * w.n;
  // the expand's B^T rows from memory while the shrink computes (a decode step's slots are
  // cold: 8 adapters' weights do not stay in cache across layers)
  const auto* bytes = reinterpret_cast<const char*>(b);
  for (int64_t off = 0; off < rank * w.n * static_cast<int64_t>(sizeof(T)); off += 64)
    __builtin_prefetch(bytes + off, 0, 3);
  float v[kRows * 64];  // the block's shrunk rows (rank <= 64), else the heap
  std::vector<float> big;
  float* vp = v;
  if (rank > 64) {
    big.resize(static_cast<size_t>(NR * rank));
    vp = big.data();
  }
  int i = 0;
  for (; i + kShrinkRows <= NR; i += kShrinkRows)
    shrink_rows<kShrinkRows>(x, ldx, blk.row + i, a, w.k, rank, w.scales[blk.slot],
                             vp + i * rank);
  for (; i < NR; ++i)
    shrink_rows<1>(x, ldx, blk.row + i, a, w.k, rank, w.scales[blk.slot], vp + i * rank);
  T* yr[NR];
  for (int j = 0; j < NR; ++j) yr[j] = y + blk.row[j] * ldy;
  expand_rows<NR>(yr, b, w.n, rank, vp);
}

// run_block<blk.rows>: the row count fixed at compile time keeps the tiles in registers.
template <typename T, int... N>
void dispatch(T* y, int64_t ldy, const T* x, int64_t ldx, const LoraWeights<T>& w,
              const Block& blk, std::integer_sequence<int, N...>) {
  ((blk.rows == N + 1 ? run_block<N + 1>(y, ldy, x, ldx, w, blk) : void()), ...);
}

}  // namespace

template <typename T>
void lora_add(T* y, int64_t ldy, const T* x, int64_t ldx, const LoraWeights<T>& w,
              const int64_t* seg_indptr, const int64_t* seg_slot, int64_t segments) {
  // Each slot's rows, in order, from every segment that names it.
  std::vector<std::vector<int64_t>> rows_of;
  for (int64_t g = 0; g < segments; ++g) {
    const int64_t slot = seg_slot[g];
    if (slot < 0 || w.ranks[slot] <= 0) continue;
    if (static_cast<int64_t>(rows_of.size()) <= slot) rows_of.resize(slot + 1);
    for (int64_t r = seg_indptr[g]; r < seg_indptr[g + 1]; ++r) rows_of[slot].push_back(r);
  }
  std::vector<Block> blocks;
  int64_t work = 0;
  for (int64_t slot = 0; slot < static_cast<int64_t>(rows_of.size()); ++slot) {
    const auto& rows = rows_of[slot];
    const auto count = static_cast<int64_t>(rows.size());
    for (int64_t r = 0; r < count; r += kRows) {
      Block blk{slot, static_cast<int>(std::min<int64_t>(kRows, count - r)), {}};
      std::copy(rows.begin() + r, rows.begin() + r + blk.rows, blk.row);
      blocks.push_back(blk);
    }
    work += count * w.ranks[slot] * (w.k + w.n);
  }
  const auto count = static_cast<int64_t>(blocks.size());
  if (count == 0) return;
  const int64_t grain = work < kParallelWork ? count : 1;
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      dispatch(y, ldy, x, ldx, w, blocks[i], std::make_integer_sequence<int, kRows>{});
  });
}

template void lora_add<float>(float*, int64_t, const float*, int64_t, const LoraWeights<float>&,
                              const int64_t*, const int64_t*, int64_t);
template void lora_add<c10::BFloat16>(c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t,
                                      const LoraWeights<c10::BFloat16>&, const int64_t*,
                                      const int64_t*, int64_t);

}  // namespace mstar_cpu

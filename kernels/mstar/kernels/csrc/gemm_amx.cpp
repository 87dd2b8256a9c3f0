// bf16 GEMM on AMX tiles for decode-sized batches: compiled into the AMX level only (every other
// level's amx_compiled() is false and its entry points are never called).
#include <vector>

#include "amx.h"
#include "kernels.h"
#include "vec.h"
#if defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace mstar_cpu {
namespace {

// -- bf16 GEMM on AMX tiles for decode-sized batches ----------------------------------------------
// A decode step's linears read every weight once for a few dozen rows: the time is streaming
// weights from DRAM. oneDNN reached ~10 GB/s of this machine's ~19 GB/s there; these tiles
// reach 14-18. The weight is packed once into B tiles, 32 columns (two tiles) by 32 of K per
// 2 KB block, each 32-column panel contiguous over K, so a thread streams one sequential run
// per panel and prefetches the next while its first pass multiplies.
constexpr int64_t kTileK = kAmxTileK;  // bf16 of K per tile step: 64 bytes per A row
constexpr int64_t kTileRows = 16;  // rows per A / C tile
constexpr int64_t kPanelCols = kAmxPanelCols;  // columns per panel: two B tiles of 16
constexpr int64_t kBlockElems = 2 * 16 * 32;  // one K step of a panel (2 KB)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Tiles 0-3: C (rows 0-15 | 16-31) x (columns 0-15 | 16-31); 4-5: A; 6-7: B.

// One 32-column panel times one or two A tiles (16 rows each) over all of K, into c [32, 32]
// float32. ``next`` (or null): where this pass prefetches into L2, ``prefetch`` bytes per K
// step (a share of the following panel).
template <int kATiles>
inline void panel_product(const char* a0, const char* a1, int64_t lda, const c10::BFloat16* b,
                          int64_t k_steps, float* c, const char* next, int64_t prefetch) {
  _tile_zero(0);
  _tile_zero(1);
  if (kATiles == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < k_steps; ++s) {
    const c10::BFloat16* bs = b + s * kBlockElems;
    if (next != nullptr)
      for (int64_t i = s * prefetch; i < (s + 1) * prefetch; i += 64)
        _mm_prefetch(next + i, _MM_HINT_T1);
    _tile_loadd(6, bs, 128);
    _tile_loadd(7, bs + 32, 128);
    _tile_loadd(4, a0 + s * kTileK * 2, lda);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (kATiles == 2) {
      _tile_loadd(5, a1 + s * kTileK * 2, lda);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, kPanelCols * 4);
  _tile_stored(1, c + 16, kPanelCols * 4);
  if (kATiles == 2) {
    _tile_stored(2, c + 16 * kPanelCols, kPanelCols * 4);
    _tile_stored(3, c + 16 * kPanelCols + 16, kPanelCols * 4);
  }
}

// One row times one 32-column panel over all of K, into c [32] float32, by VDPBF16PS over the
// same B tiles: each 64-byte tile row holds one k-pair of 16 columns, that instruction's operand
// layout. A 1-row A tile would multiply 15 rows of nothing: a step's 211 SmolLM2 linears at
// 1 row took 10.9 ms on tiles, 9.4 this way (`dpbf16_linear`: 9.0-9.8), and batch-1 decode
// went from 11.4 to 10.4 ms per token (2-core Xeon with AMX). ``next`` (or null): the following
// panel, prefetched into L2 two lines per k-pair, as `dpbf16_linear` does.
inline void panel_row(const c10::BFloat16* x, int64_t k_steps, const c10::BFloat16* b,
                      const char* next, float* c) {
  __m512 c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps();
  for (int64_t s = 0; s < k_steps * 16; ++s) {  // k-pairs
    if (next != nullptr) {
      _mm_prefetch(next + s * 128, _MM_HINT_T1);
      _mm_prefetch(next + s * 128 + 64, _MM_HINT_T1);
    }
    int32_t v;
    std::memcpy(&v, x + 2 * s, sizeof v);
    const __m512bh a = (__m512bh)_mm512_set1_epi32(v);
    c0 = _mm512_dpbf16_ps(c0, a, (__m512bh)_mm512_loadu_si512(b + s * 64));
    c1 = _mm512_dpbf16_ps(c1, a, (__m512bh)_mm512_loadu_si512(b + s * 64 + 32));
  }
  _mm512_store_ps(c, c0);
  _mm512_store_ps(c + 16, c1);
}

// out rows [r0, r0 + rows) x panel columns [c0, c0 + cols): c (+ bias) rounded to bf16 once.
inline void store_panel(const float* c, int64_t rows, int64_t cols, const c10::BFloat16* bias,
                        c10::BFloat16* out, int64_t ldo) {
  const __mmask16 k0 = lanes(cols), k1 = lanes(cols - 16);
  const __m512 b0 = bias ? widen_bf16(k0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? widen_bf16(k1, bias + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    c10::BFloat16* o = out + r * ldo;
    const __m512 v0 = _mm512_add_ps(_mm512_load_ps(c + r * kPanelCols), b0);
    const __m512 v1 = _mm512_add_ps(_mm512_load_ps(c + r * kPanelCols + 16), b1);
    _mm256_mask_storeu_epi16(o, k0, (__m256i)_mm512_cvtneps_pbh(v0));
    if (k1) _mm256_mask_storeu_epi16(o + 16, k1, (__m256i)_mm512_cvtneps_pbh(v1));
  }
}

#endif

}  // namespace

bool amx_compiled() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Linux hands out AMX tile state only on request (ARCH_REQ_XCOMP_PERM for XTILEDATA), once
// per process; oneDNN asks too where it uses AMX.
bool request_amx() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}
#else
bool request_amx() { return false; }
#endif

// Weight [N, K] -> [ceil(N/32), ceil(K/32), 16, 2, 32]: per panel of 32 columns and K step of
// 32, two B tiles of 16 k-pairs x (16 columns x 2 k) with their rows interleaved (row stride
// 128 bytes), so each k-pair of the panel is one 128-byte run, as `panel_row` reads it; the
// caller zeroes the padding.
void amx_pack(const bf16* src, int64_t n, int64_t k, bf16* dst) {
  const int64_t panels = round_up(n, kPanelCols) / kPanelCols, steps = round_up(k, kTileK) / kTileK;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t col = 0; col < kPanelCols && p * kPanelCols + col < n; ++col) {
        const c10::BFloat16* row = src + (p * kPanelCols + col) * k;
        const int64_t tile = col / 16, lane = col % 16;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t s = j / kTileK, pair = (j % kTileK) / 2;
          dst[(((p * steps + s) * 16 + pair) * 2 + tile) * 32 + lane * 2 + j % 2] = row[j];
        }
      }
  });
}

// x [M, K padded to k_steps * 32] (row stride x_lda) @ the packed weight: one thread per run of
// panels; every thread multiplies all M rows, 32 at a time, so each weight byte leaves DRAM
// once. Each pass over a panel prefetches its share of the next panel, so DRAM keeps streaming
// while the later passes multiply from cache (at 128 rows a step's linears took 22.1 ms against
// 23.8 with the whole prefetch in the first pass).
void amx_gemm(const bf16* x, int64_t x_lda, int64_t m, int64_t steps, const bf16* packed,
              int64_t panels, int64_t n, const bf16* bias_p, bf16* out) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const c10::BFloat16* b_p = packed;
  c10::BFloat16* o_p = out;
  const int64_t panel_elems = steps * kBlockElems;
  if (m == 1) {  // one row: vector dot products over the tiles, no tile state
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      alignas(64) float c[kPanelCols];
      for (int64_t p = p0; p < p1; ++p) {
        const c10::BFloat16* b = b_p + p * panel_elems;
        const char* next = p + 1 < p1 ? reinterpret_cast<const char*>(b + panel_elems) : nullptr;
        const int64_t c0 = p * kPanelCols, cols = std::min(kPanelCols, n - c0);
        panel_row(x, steps, b, next, c);
        store_panel(c, 1, cols, bias_p ? bias_p + c0 : nullptr, o_p + c0, n);
      }
    });
    return;
  }
  const int64_t lda = x_lda * 2, full = m / kTileRows * kTileRows, tail = m - full;
  const char* a_p = reinterpret_cast<const char*>(x);
  const int64_t passes = (m + 2 * kTileRows - 1) / (2 * kTileRows);
  const int64_t prefetch = round_up(kBlockElems * 2 / passes, 64);  // bytes per K step
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    // The last, partial A tile (fewer than 16 rows) loads from a zero-padded copy.
    const int64_t tail_lda = steps * kTileK * 2;
    std::vector<c10::BFloat16> tail_rows(tail ? kTileRows * steps * kTileK : 0);
    for (int64_t r = 0; r < tail; ++r)
      std::memcpy(tail_rows.data() + r * steps * kTileK, a_p + (full + r) * lda, tail_lda);
    const char* tail_p = reinterpret_cast<const char*>(tail_rows.data());
    configure_tiles();
    alignas(64) float c[2 * kTileRows * kPanelCols];
    for (int64_t p = p0; p < p1; ++p) {
      const c10::BFloat16* b = b_p + p * panel_elems;
      const int64_t c0 = p * kPanelCols, cols = std::min(kPanelCols, n - c0);
      for (int64_t r0 = 0; r0 < m; r0 += 2 * kTileRows) {
        const int64_t pass = r0 / (2 * kTileRows);
        const char* next = nullptr;
        if (p + 1 < p1)
          next = reinterpret_cast<const char*>(b + panel_elems) + pass * steps * prefetch;
        const int64_t rows = std::min(2 * kTileRows, m - r0);
        const char* a0 = r0 < full ? a_p + r0 * lda : tail_p;
        const int64_t lda0 = r0 < full ? lda : tail_lda;
        if (rows > kTileRows) {
          const bool a1_full = r0 + kTileRows < full;
          const char* a1 = a1_full ? a0 + kTileRows * lda : tail_p;
          // A tiles share a stride: a full tile after a full one, else the tail copy
          // (only the second can be the tail when the first is full).
          if (a1_full || lda == tail_lda)
            panel_product<2>(a0, a1, lda0, b, steps, c, next, prefetch);
          else {
            panel_product<1>(a0, nullptr, lda0, b, steps, c, next, prefetch);
            float* c1 = c + kTileRows * kPanelCols;
            panel_product<1>(a1, nullptr, tail_lda, b, steps, c1, nullptr, 0);
          }
        } else {
          panel_product<1>(a0, nullptr, lda0, b, steps, c, next, prefetch);
        }
        store_panel(c, rows, cols, bias_p ? bias_p + c0 : nullptr, o_p + r0 * n + c0, n);
      }
    }
    _tile_release();
  });
#else
  (void)x, (void)x_lda, (void)m, (void)steps, (void)packed, (void)panels, (void)n, (void)bias_p,
      (void)out;
#endif
}

}  // namespace mstar_cpu

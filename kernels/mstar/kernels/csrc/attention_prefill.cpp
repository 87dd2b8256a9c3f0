// Paged attention for causal prompt chunks, reading K/V straight from the cache pages (decode:
// attention.cpp). See cpu_kernels.py for what each kernel replaced and why.
#include <c10/util/Exception.h>

#include <atomic>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "kernels.h"
#include "vec.h"

namespace mstar_cpu {
namespace {

// Causal attention for the several-query rows of a step (prompt chunks), keys read from the
// cache pages (K/V are written before attending). Sequence b's queries are rows
// q_start[b] .. + q_len[b] of q, the last q_len[b] of its kv_len[b] positions. One task per
// (sequence, KV head, block of PF_ROWS query rows), handed out dynamically since later rows see
// more keys: the task widens its keys once into float32 K^T [D, keys] and V [keys, D], then
// for 4 query rows of a head at a time takes 2W scores per pass over D (one K load feeds 4
// FMAs), a softmax in float32, and the value sum with 4 x PC accumulators in registers
// (as many passes over the keys as that takes to cover D).
// exp(scale * (x - max)) over a score row's keys [0, lim), in place, and 1 / their sum. The
// last vector's lanes past lim are masked, not its keys computed one scalar exp at a time (the
// row must hold finite values up to round_up(lim, W); they come back zero). scale 1 is exact.
// `sink` (gpt-oss): a head's learned logit, in scaled units, that joins the denominator only.
inline float masked_softmax(float* row, int64_t lim, float scale, vi lane,
                            float sink = -INFINITY) {
  const int64_t vec_end = round_up(lim, W);
  const vi tail = lane < static_cast<int32_t>(lim - (vec_end - W));
  vf m = vf{} - INFINITY;
  for (int64_t j = 0; j < vec_end; j += W) {
    const vf x = j + W < vec_end ? load(row + j) : (tail ? load(row + j) : m);
    m = x > m ? x : m;
  }
  float mx = m[0];
  for (int e = 1; e < W; ++e) mx = std::max(mx, m[e]);
  const bool has_sink = sink != -INFINITY;
  const float s = sink / scale;  // in the row's units
  if (has_sink) mx = std::max(mx, s);
  vf sum = vf{};
  for (int64_t j = 0; j < vec_end; j += W) {
    vf e = vexp((load(row + j) - mx) * scale);
    if (j + W == vec_end) e = tail ? e : vf{};
    store(row + j, e);
    sum += e;
  }
  return 1.f / (has_sink ? hsum(sum) + std::exp((s - mx) * scale) : hsum(sum));
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Indices interleaving 16 bf16 of x0 (from its element `first`) with x1's: x0[k], x1[k], ...
inline __m512i pair_index(int first) {
  alignas(64) uint16_t idx[32];
  for (int k = 0; k < 16; ++k) {
    idx[2 * k] = static_cast<uint16_t>(first + k);
    idx[2 * k + 1] = static_cast<uint16_t>(32 + first + k);
  }
  return _mm512_load_si512(idx);
}
#endif

constexpr int64_t PF_ROWS = 32;
constexpr int PF_R = 4;
constexpr int PF_S = 2;  // key vectors per float32 score pass: 8 FMA chains, FMA's latency hidden

template <typename T, int NV>
void prefill(const T* q, int64_t qs0, int64_t qs1, const T* kv, const int64_t* table,
             int64_t max_pages, const int64_t* kv_lens, const int64_t* q_starts,
             const int64_t* q_lens, int64_t batch, T* out, int64_t hq, int64_t hkv,
             int64_t page_size, float scale, const float* sinks) {
  constexpr int64_t D = NV * W;
  constexpr int PC = std::min(NV, std::max(1, kAccVecs / PF_R));  // value vectors per pass
  static_assert(NV % PC == 0);
  // bf16 scores by VDPBF16PS where the CPU has it, on a K^T of bf16 pairs.
  constexpr bool kDotBf16 = kHasDotBf16 && std::is_same_v<T, c10::BFloat16> && NV % 2 == 0;
  const int64_t group = hq / hkv, head_row = hkv * D;
  std::vector<int64_t> items;  // (b, hk, first row) triples
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t hk = 0; hk < hkv; ++hk)
      for (int64_t r0 = 0; r0 < q_lens[b]; r0 += PF_ROWS) items.insert(items.end(), {b, hk, r0});
  const int64_t n_items = static_cast<int64_t>(items.size()) / 3;
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t it = 0; it < n_items; ++it) {
    const int64_t b = items[3 * it], hk = items[3 * it + 1], r0 = items[3 * it + 2];
    const int64_t n = q_lens[b], first = kv_lens[b] - n, r1 = std::min(n, r0 + PF_ROWS);
    const vi lane = lane_index();
    const int64_t keys = first + r1, lp = round_up(keys, PF_S * W);
    const int64_t* pt = table + b * max_pages;
    auto key_row = [&](int64_t l, int64_t plane) {
      return kv + ((pt[l / page_size] * 2 + plane) * page_size + l % page_size) * head_row +
             hk * D;
    };
    // Per-thread, grow-only: a long prompt's K^T / V run to megabytes, fresh ones per task
    // would be mapped and faulted in every time. Only K^T's padding columns need zeros.
    thread_local std::vector<float> kt, vt, sc;
    thread_local std::vector<uint32_t> kt2;
    vt.resize(std::max<size_t>(vt.size(), keys * D));
    sc.resize(std::max<size_t>(sc.size(), PF_R * lp));
    if constexpr (kDotBf16) {  // K^T as bf16 pairs: kt2[p][l] = (k[l][2p], k[l][2p + 1])
      kt2.resize(std::max<size_t>(kt2.size(), D / 2 * lp));
      for (int64_t p = 0; p < D / 2; ++p)
        std::fill(kt2.begin() + p * lp + keys, kt2.begin() + (p + 1) * lp, 0u);
      uint32_t* const dst = kt2.data();
      for (int64_t l = 0; l < keys; ++l) {
        const uint32_t* k = reinterpret_cast<const uint32_t*>(key_row(l, 0));
        for (int64_t p = 0; p < D / 2; ++p) dst[p * lp + l] = k[p];
      }
    } else {
      kt.resize(std::max<size_t>(kt.size(), D * lp));
      for (int64_t d = 0; d < D; ++d)
        std::fill(kt.begin() + d * lp + keys, kt.begin() + (d + 1) * lp, 0.f);
      float* const dst = kt.data();
      for (int64_t l = 0; l < keys; ++l) {
        const T* k = key_row(l, 0);
        for (int64_t c = 0; c < NV; ++c) {
          const vf kc = load(k + c * W);
          for (int e = 0; e < W; ++e) dst[(c * W + e) * lp + l] = kc[e];
        }
      }
    }
    // Plain pointers to the thread_local storage, looked up once per task: inside the loops
    // each access to a thread_local of this shared library is a TLS lookup (the key loop of the
    // values ran 1.5x slower that way).
    float* const vfp = vt.data();
    float* const scp = sc.data();
    const uint32_t* const kt2p = kt2.data();
    const float* const ktp = kt.data();
    for (int64_t l = 0; l < keys; ++l) {
      const T* v = key_row(l, 1);
      for (int64_t c = 0; c < NV; ++c) store(vfp + l * D + c * W, load(v + c * W));
    }
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      for (int64_t i0 = r0; i0 < r1; i0 += PF_R) {
        const int nr = static_cast<int>(std::min<int64_t>(PF_R, r1 - i0));
        const T* qr[PF_R];
        for (int i = 0; i < PF_R; ++i)
          qr[i] = q + (q_starts[b] + i0 + std::min(i, nr - 1)) * qs0 + h * qs1;
        const int64_t hi = first + i0 + nr;  // keys the block's last row sees
#if defined(__AVX512BF16__)
        if constexpr (kDotBf16) {
          uint32_t qp[PF_R][D / 2];
          for (int i = 0; i < PF_R; ++i) std::memcpy(qp[i], qr[i], sizeof qp[i]);
          // Three blocks of 16 keys at a time: 12 independent accumulators keep both FMA
          // pipes busy through VDPBF16PS's latency (4 were latency-bound); then the rest.
          const int64_t hi_blocks = (hi + W - 1) / W * W;
          int64_t j = 0;
          for (; j + 3 * W <= hi_blocks; j += 3 * W) {
            __m512 acc[PF_R][3];
            for (int i = 0; i < PF_R; ++i)
              acc[i][0] = acc[i][1] = acc[i][2] = _mm512_setzero_ps();
#pragma GCC unroll 4
            for (int64_t p = 0; p < D / 2; ++p) {
              const uint32_t* kp = kt2p + p * lp + j;
              const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp);
              const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + W);
              const __m512bh k2 = (__m512bh)_mm512_loadu_si512(kp + 2 * W);
#pragma GCC unroll 4
              for (int i = 0; i < PF_R; ++i) {
                const __m512bh qb = (__m512bh)_mm512_set1_epi32(qp[i][p]);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], qb, k0);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], qb, k1);
                acc[i][2] = _mm512_dpbf16_ps(acc[i][2], qb, k2);
              }
            }
            for (int i = 0; i < PF_R; ++i)
              for (int c = 0; c < 3; ++c)
                store(scp + i * lp + j + c * W, (vf)acc[i][c] * scale);
          }
          for (; j < hi; j += W) {
            __m512 acc[PF_R];
            for (int i = 0; i < PF_R; ++i) acc[i] = _mm512_setzero_ps();
#pragma GCC unroll 8
            for (int64_t p = 0; p < D / 2; ++p) {
              const __m512bh kd = (__m512bh)_mm512_loadu_si512(kt2p + p * lp + j);
#pragma GCC unroll 4
              for (int i = 0; i < PF_R; ++i)
                acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(qp[i][p]), kd);
            }
            for (int i = 0; i < PF_R; ++i) store(scp + i * lp + j, (vf)acc[i] * scale);
          }
        }
#endif
        if constexpr (!kDotBf16) {
          float qv[PF_R][D];
          for (int i = 0; i < PF_R; ++i)
            for (int64_t d = 0; d < D; ++d) qv[i][d] = static_cast<float>(qr[i][d]);
          for (int64_t j = 0; j < hi; j += PF_S * W) {
            vf acc[PF_R][PF_S] = {};
#pragma GCC unroll 8
            for (int64_t d = 0; d < D; ++d) {
              vf kd[PF_S];
              for (int c = 0; c < PF_S; ++c) kd[c] = load(ktp + d * lp + j + c * W);
#pragma GCC unroll 4
              for (int i = 0; i < PF_R; ++i)
                for (int c = 0; c < PF_S; ++c) acc[i][c] += qv[i][d] * kd[c];
            }
            for (int i = 0; i < PF_R; ++i)
              for (int c = 0; c < PF_S; ++c) store(scp + i * lp + j + c * W, acc[i][c] * scale);
          }
        }
        float inv[PF_R];
        for (int i = 0; i < PF_R; ++i) {
          float* row = scp + i * lp;
          if (i >= nr) {  // a padding row (the block's last real row repeated): no keys
            std::fill(row, row + hi, 0.f);
            inv[i] = 0.f;
            continue;
          }
          // (the block computed finite scores past the row's keys, for its later rows)
          const int64_t lim = first + i0 + i + 1;
          inv[i] = masked_softmax(row, lim, 1.f, lane, sinks ? sinks[h] : -INFINITY);
          for (int64_t j = round_up(lim, W); j < hi; ++j) row[j] = 0.f;
        }
        for (int c = 0; c < NV; c += PC) {
          vf o[PF_R][PC] = {};
          for (int64_t j = 0; j < hi; ++j) {
            const float* vr = vfp + j * D + c * W;
            vf vv[PC];
#pragma GCC unroll 16
            for (int v = 0; v < PC; ++v) vv[v] = load(vr + v * W);
#pragma GCC unroll 4
            for (int i = 0; i < PF_R; ++i) {
              const float pj = scp[i * lp + j];
#pragma GCC unroll 16
              for (int v = 0; v < PC; ++v) o[i][v] += pj * vv[v];
            }
          }
          for (int i = 0; i < nr; ++i) {
            T* dst = out + ((q_starts[b] + i0 + i) * hq + h) * D + c * W;
            for (int v = 0; v < PC; ++v) store(dst + v * W, o[i][v] * inv[i]);
          }
        }
      }
    }
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// `prefill` for bf16 on AMX tiles (head dims that are multiples of 32): 16 query rows of a head
// at a time, Q.K^T as 16 x 16 score tiles over the same K^T pairs (16 k-pairs per B tile), a
// float32 softmax per row, then the probabilities rounded to bf16 (as FlashAttention does
// before P.V) times V staged as pairs of keys, 16 output columns per tile. A tile multiply is
// 16 x 16 x 32 products, where a VDPBF16PS is 16 x 2: the scores and value sums that took
// ~three quarters of the kernel's time become a small part of it.
// Tiles: 0-3 C (scores of 4 key blocks, or 4 output column blocks), 4 A, 6 B.
constexpr int64_t AMX_ROWS = 16;
constexpr int64_t AMX_KEYS = 4 * AMX_ROWS;  // keys per pass of Q.K^T: four C tiles
constexpr int64_t AMX_ITEM_ROWS = 64;

template <int NV>
void prefill_amx(const bf16* q, int64_t qs0, int64_t qs1, const bf16* kv, const int64_t* table,
                 int64_t max_pages, const int64_t* kv_lens, const int64_t* q_starts,
                 const int64_t* q_lens, int64_t batch, bf16* out, int64_t hq, int64_t hkv,
                 int64_t page_size, float scale, const float* sinks) {
  constexpr int64_t D = NV * W, PAIRS = D / 2, KSTEPS = D / 32, DTILES = D / 16;
  static_assert(D % 32 == 0);
  const int64_t group = hq / hkv, head_row = hkv * D;
  std::vector<int64_t> items;  // (b, hk, first row) triples
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t hk = 0; hk < hkv; ++hk)
      for (int64_t r0 = 0; r0 < q_lens[b]; r0 += AMX_ITEM_ROWS) items.insert(items.end(), {b, hk, r0});
  const int64_t n_items = static_cast<int64_t>(items.size()) / 3;
  const __m512i pair_lo = pair_index(0), pair_hi = pair_index(16);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    configure_tiles();
    thread_local std::vector<uint32_t> kt2, vt2;
    thread_local std::vector<float> sc;
    thread_local std::vector<uint16_t> pb;
    const vi lane = lane_index();
    alignas(64) uint16_t qa[AMX_ROWS * D];
    alignas(64) float ob[AMX_ROWS * D];
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const int64_t b = items[3 * it], hk = items[3 * it + 1], r0 = items[3 * it + 2];
      const int64_t n = q_lens[b], first = kv_lens[b] - n, r1 = std::min(n, r0 + AMX_ITEM_ROWS);
      const int64_t keys = first + r1, lp = round_up(keys, AMX_KEYS);
      const int64_t* pt = table + b * max_pages;
      auto key_row = [&](int64_t l, int64_t plane) {
        return kv + ((pt[l / page_size] * 2 + plane) * page_size + l % page_size) * head_row +
               hk * D;
      };
      kt2.resize(std::max<size_t>(kt2.size(), PAIRS * lp));
      vt2.resize(std::max<size_t>(vt2.size(), lp / 2 * D));
      sc.resize(std::max<size_t>(sc.size(), AMX_ROWS * lp));
      pb.resize(std::max<size_t>(pb.size(), AMX_ROWS * lp));
      uint32_t* const ktp = kt2.data();
      uint32_t* const vtp = vt2.data();
      float* const scp = sc.data();
      uint16_t* const pbp = pb.data();
      // K^T as bf16 pairs of D, ktp[p][l] = (k[l][2p], k[l][2p + 1]); padding keys zero.
      for (int64_t p = 0; p < PAIRS; ++p) std::fill(ktp + p * lp + keys, ktp + (p + 1) * lp, 0u);
      for (int64_t l = 0; l < keys; ++l) {
        const uint32_t* k = reinterpret_cast<const uint32_t*>(key_row(l, 0));
        for (int64_t p = 0; p < PAIRS; ++p) ktp[p * lp + l] = k[p];
      }
      // V as bf16 pairs of keys, vtp[l / 2][d] = (v[l][d], v[l + 1][d]); padding keys zero (a
      // zero probability times an uninitialised NaN would not be zero).
      for (int64_t l = 0; l < lp; l += 2) {
        uint32_t* row = vtp + l / 2 * D;
        if (l >= keys) {
          std::fill(row, row + D, 0u);
          continue;
        }
        const __m512i* v0 = reinterpret_cast<const __m512i*>(key_row(l, 1));
        const __m512i* v1 =
            l + 1 < keys ? reinterpret_cast<const __m512i*>(key_row(l + 1, 1)) : nullptr;
        for (int64_t c = 0; c < D / 32; ++c) {
          const __m512i x0 = _mm512_loadu_si512(v0 + c);
          const __m512i x1 = v1 ? _mm512_loadu_si512(v1 + c) : _mm512_setzero_si512();
          _mm512_storeu_si512(row + 32 * c, _mm512_permutex2var_epi16(x0, pair_lo, x1));
          _mm512_storeu_si512(row + 32 * c + 16, _mm512_permutex2var_epi16(x0, pair_hi, x1));
        }
      }
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        for (int64_t i0 = r0; i0 < r1; i0 += AMX_ROWS) {
          const int64_t nr = std::min(AMX_ROWS, r1 - i0);
          const int64_t hi = first + i0 + nr;  // keys the block's last row sees
          const int64_t h32 = round_up(hi, 32);
          for (int64_t i = 0; i < AMX_ROWS; ++i) {  // Q rows into a padded A tile
            uint16_t* dst = qa + i * D;
            if (i < nr)
              std::memcpy(dst, q + (q_starts[b] + i0 + i) * qs0 + h * qs1, D * sizeof(bf16));
            else
              std::memset(dst, 0, D * sizeof(bf16));
          }
          for (int64_t k0 = 0; k0 < hi; k0 += AMX_KEYS) {
            const int blocks = static_cast<int>(std::min<int64_t>(4, (hi - k0 + 15) / 16));
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t s = 0; s < KSTEPS; ++s) {
              _tile_loadd(4, qa + s * 32, D * 2);
              const uint32_t* kb = ktp + s * 16 * lp + k0;
              _tile_loadd(6, kb, lp * 4);
              _tile_dpbf16ps(0, 4, 6);
              if (blocks > 1) {
                _tile_loadd(6, kb + 16, lp * 4);
                _tile_dpbf16ps(1, 4, 6);
              }
              if (blocks > 2) {
                _tile_loadd(6, kb + 32, lp * 4);
                _tile_dpbf16ps(2, 4, 6);
              }
              if (blocks > 3) {
                _tile_loadd(6, kb + 48, lp * 4);
                _tile_dpbf16ps(3, 4, 6);
              }
            }
            _tile_stored(0, scp + k0, lp * 4);
            if (blocks > 1) _tile_stored(1, scp + k0 + 16, lp * 4);
            if (blocks > 2) _tile_stored(2, scp + k0 + 32, lp * 4);
            if (blocks > 3) _tile_stored(3, scp + k0 + 48, lp * 4);
          }
          float inv[AMX_ROWS];
          for (int64_t i = 0; i < AMX_ROWS; ++i) {
            float* row = scp + i * lp;
            uint16_t* prow = pbp + i * lp;
            if (i >= nr) {  // a padding row: zero probabilities
              std::memset(prow, 0, h32 * sizeof(uint16_t));
              continue;
            }
            // (the tiles computed finite scores past the row's keys, for other rows)
            const int64_t lim = first + i0 + i + 1;
            inv[i] = masked_softmax(row, lim, scale, lane, sinks ? sinks[h] : -INFINITY);
            for (int64_t j = round_up(lim, W); j < h32; ++j) row[j] = 0.f;
            for (int64_t j = 0; j < h32; j += 32)
              _mm512_storeu_si512(prow + j,
                                  (__m512i)_mm512_cvtne2ps_pbh(load(row + j + 16), load(row + j)));
          }
          for (int64_t d0 = 0; d0 < DTILES; d0 += 4) {
            const int cols = static_cast<int>(std::min<int64_t>(4, DTILES - d0));
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t j = 0; j < h32; j += 32) {
              _tile_loadd(4, pbp + j, lp * 2);
              const uint32_t* vb = vtp + j / 2 * D + d0 * 16;
              _tile_loadd(6, vb, D * 4);
              _tile_dpbf16ps(0, 4, 6);
              if (cols > 1) {
                _tile_loadd(6, vb + 16, D * 4);
                _tile_dpbf16ps(1, 4, 6);
              }
              if (cols > 2) {
                _tile_loadd(6, vb + 32, D * 4);
                _tile_dpbf16ps(2, 4, 6);
              }
              if (cols > 3) {
                _tile_loadd(6, vb + 48, D * 4);
                _tile_dpbf16ps(3, 4, 6);
              }
            }
            _tile_stored(0, ob + d0 * 16, D * 4);
            if (cols > 1) _tile_stored(1, ob + d0 * 16 + 16, D * 4);
            if (cols > 2) _tile_stored(2, ob + d0 * 16 + 32, D * 4);
            if (cols > 3) _tile_stored(3, ob + d0 * 16 + 48, D * 4);
          }
          for (int64_t i = 0; i < nr; ++i) {
            bf16* dst = out + ((q_starts[b] + i0 + i) * hq + h) * D;
            for (int64_t c = 0; c < NV; ++c)
              store(dst + c * W, load(ob + i * D + c * W) * inv[i]);
          }
        }
      }
    }
    _tile_release();
  }
}
#endif


}  // namespace

template <typename T>
void prefill_dim(int64_t dim, const T* q, int64_t qs0, int64_t qs1, const T* kv,
                 const int64_t* table, int64_t max_pages, const int64_t* kv_lens,
                 const int64_t* q_starts, const int64_t* q_lens, int64_t batch, T* out,
                 int64_t hq, int64_t hkv, int64_t page_size, float scale, const float* sinks) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    if (request_amx()) {
      switch (dim) {
        case 32: return prefill_amx<32 / W>(q, qs0, qs1, kv, table, max_pages, kv_lens, q_starts,
                                            q_lens, batch, out, hq, hkv, page_size, scale, sinks);
        case 64: return prefill_amx<64 / W>(q, qs0, qs1, kv, table, max_pages, kv_lens, q_starts,
                                            q_lens, batch, out, hq, hkv, page_size, scale, sinks);
        case 128: return prefill_amx<128 / W>(q, qs0, qs1, kv, table, max_pages, kv_lens,
                                              q_starts, q_lens, batch, out, hq, hkv, page_size,
                                              scale, sinks);
        case 256: return prefill_amx<256 / W>(q, qs0, qs1, kv, table, max_pages, kv_lens,
                                              q_starts, q_lens, batch, out, hq, hkv, page_size,
                                              scale, sinks);
        default: break;
      }
    }
  }
#endif
#define PREFILL(NV)                                                                          \
  prefill<T, NV>(q, qs0, qs1, kv, table, max_pages, kv_lens, q_starts, q_lens, batch, out, hq, \
                 hkv, page_size, scale, sinks)
  switch (dim) {
    case 16: return PREFILL(16 / W);
    case 32: return PREFILL(32 / W);
    case 64: return PREFILL(64 / W);
    case 128: return PREFILL(128 / W);
    case 256: return PREFILL(256 / W);
    default: TORCH_CHECK(false, "paged_prefill: head_dim must be 16, 32, 64, 128 or 256");
  }
#undef PREFILL
}

template void prefill_dim<float>(int64_t, const float*, int64_t, int64_t, const float*,
                                 const int64_t*, int64_t, const int64_t*, const int64_t*,
                                 const int64_t*, int64_t, float*, int64_t, int64_t, int64_t,
                                 float, const float*);
template void prefill_dim<bf16>(int64_t, const bf16*, int64_t, int64_t, const bf16*,
                                const int64_t*, int64_t, const int64_t*, const int64_t*,
                                const int64_t*, int64_t, bf16*, int64_t, int64_t, int64_t, float,
                                const float*);

}  // namespace mstar_cpu

// Paged attention reading K/V straight from the cache pages: decode, one query row per sequence
// (causal prompt chunks: attention_prefill.cpp). See cpu_kernels.py for what each kernel
// replaced and why.
#include <c10/util/Exception.h>

#include <atomic>
#include <vector>

#include "amx.h"
#include "kernels.h"
#include "vec.h"

namespace mstar_cpu {
namespace {

// Scores of one query head against a block of up to W keys (slots past ``n`` repeat key 0 and
// are overwritten with -inf by the caller).
template <typename T, int NV>
inline vf block_scores(const vf* qh, const T* const* kp) {
  vf acc[W];
#pragma GCC unroll 16
  for (int s = 0; s < W; ++s) {
    const T* k = kp[kBrev[s]];
    vf a = qh[0] * load(k);
#pragma GCC unroll 16
    for (int j = 1; j < NV; ++j) a += qh[j] * load(k + j * W);
    acc[s] = a;
  }
  return reduce_lanes(acc);
}

#if defined(__AVX512BF16__)
// Scores of one bf16 query head (NV/2 vectors of 32 bf16) against W = 16 bf16 key rows: VDPBF16PS
// multiplies pairs exactly and sums in float32, so the keys need no widening (bf16 decode at
// batch 64, SmolLM2's heads: 590 -> 486 us per layer).
template <int NV>
inline vf block_scores_bf16(const __m512bh* qh, const c10::BFloat16* const* kp) {
  vf acc[16];
#pragma GCC unroll 16
  for (int s = 0; s < 16; ++s) {
    const c10::BFloat16* k = kp[kBrev[s]];
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qh[0], (__m512bh)_mm512_loadu_si512(k));
#pragma GCC unroll 8
    for (int j = 1; j < NV / 2; ++j)
      a = _mm512_dpbf16_ps(a, qh[j], (__m512bh)_mm512_loadu_si512(k + 32 * j));
    acc[s] = (vf)a;
  }
  return reduce_lanes(acc);
}
#endif

// Reads every K and V row of a sequence's tokens once before attending to them. The rows come
// from DRAM (a step's cache is far larger than L3) and the attention loops, which compute as
// they load, keep only a few misses in flight; this loop of independent loads keeps many, then
// the loops read L2. bf16 at batch 64: 690 -> 522 us per layer; float32 1109 -> 790 (2-core
// Zen 4; software prefetches of the same lines gained at most a third of that). Only a
// thread's first sequence needs it: `RowPrefetcher` brings each later one in during the math
// of the one before (bf16 batch 64: 442-464 -> 395-427 us per layer; batch 32: 357 -> 271;
// float32 batch 64: 735 -> 684).
template <typename T>
inline void touch_rows(const T* kv, const int64_t* off, int64_t len, int64_t row,
                       int64_t plane) {
  vi acc = {};
  for (int64_t t = 0; t < len; ++t) {
    const char* k = reinterpret_cast<const char*>(kv + off[t]);
    const char* v = reinterpret_cast<const char*>(kv + off[t] + plane);
    for (int64_t o = 0; o < row * static_cast<int64_t>(sizeof(T)); o += 64) {  // one per line
      vi a, c;
      std::memcpy(&a, k + o, sizeof a);
      std::memcpy(&c, v + o, sizeof c);
      acc += a ^ c;
    }
  }
  keep_alive(acc);
}

// Brings the next sequence's K/V rows towards L2 while this one's math runs: a few cache-line
// prefetches per step of the value loop, so they overlap the arithmetic instead of stalling it
// the way `touch_rows`'s loads do for the first sequence a thread takes.
template <typename T>
struct RowPrefetcher {
  const char* kv;
  const int64_t* off;
  int64_t len, row_bytes, plane_bytes, per;
  int64_t t = 0, o = 0;
  inline void step() {
    for (int64_t i = 0; i < per && t < len; ++i) {
      const char* k = kv + off[t] * static_cast<int64_t>(sizeof(T)) + o;
      __builtin_prefetch(k, 0, 2);  // to L2: hints 3 (L1) and 0 (NTA) ran slower
      __builtin_prefetch(k + plane_bytes, 0, 2);
      o += 64;
      if (o >= row_bytes) o = 0, ++t;
    }
  }
  inline void step_n(int times) {
    for (int i = 0; i < times; ++i) step();
  }
  inline void finish() {
    while (t < len) step();
  }
};

// Probability-weighted sum of NV vectors of V rows for HT query heads of one KV head,
// accumulators in registers; head h's sums go to out[h * stride ..].
template <typename T, int NV, int HT>
inline void weigh_values(const T* v0, const int64_t* off, int64_t len, const float* const* p,
                         vf* out, int64_t stride, RowPrefetcher<T>& pf) {
  vf acc[HT][NV];
  for (int h = 0; h < HT; ++h)
    for (int j = 0; j < NV; ++j) acc[h][j] = vf{};
  for (int64_t l = 0; l < len; ++l) {
    pf.step();
    const T* v = v0 + off[l];
    vf vr[NV];
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) vr[j] = load(v + j * W);
#pragma GCC unroll 4
    for (int h = 0; h < HT; ++h) {
      const float w = p[h][l];
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) acc[h][j] += w * vr[j];
    }
  }
  for (int h = 0; h < HT; ++h)
    for (int j = 0; j < NV; ++j) out[h * stride + j] = acc[h][j];
}

// Vectors of a head's value sum that one pass keeps in registers (a head of more takes several
// passes over its V rows, which come from L1/L2 after the first), and query heads per pass.
template <int NV>
constexpr int kValueCols = NV < kAccVecs ? NV : kAccVecs;
template <int NV>
constexpr int kValueHeads = std::clamp(kAccVecs / NV, 1, 4);

// n (<= kValueHeads) query heads' value sums, kValueCols<NV> vectors per pass.
template <typename T, int NV>
void weigh_values_n(int n, const T* v0, const int64_t* off, int64_t len, const float* const* p,
                    vf* out, RowPrefetcher<T>& pf) {
  constexpr int C = kValueCols<NV>;
  for (int c = 0; c < NV; c += C) {
    const T* vc = v0 + c * W;
    vf* oc = out + c;
    switch (n) {
      case 1: weigh_values<T, C, 1>(vc, off, len, p, oc, NV, pf); break;
      case 2: weigh_values<T, C, 2>(vc, off, len, p, oc, NV, pf); break;
      case 3: weigh_values<T, C, 3>(vc, off, len, p, oc, NV, pf); break;
      default: weigh_values<T, C, 4>(vc, off, len, p, oc, NV, pf); break;
    }
  }
}

// One task per sequence on torch's OpenMP team. Its K/V rows are already on their way to L2
// (`touch_rows` for a thread's first, `RowPrefetcher` during the one before for the rest), then
// per KV head: scores for W keys at a time (every query head of the group against the same K
// rows, read from L1 after the first; bf16 rows go to VDPBF16PS where the CPU has it, else are
// widened to float32 once per block, not once per head), a vectorised softmax, then the values
// weighed with the group's accumulators in registers.
template <typename T, int NV>
void decode(const T* q, int64_t q_batch_stride, int64_t q_head_stride, const T* kv,
            const int64_t* table, const int64_t* all_lens, T* out, int64_t batch, int64_t hq,
            int64_t hkv, int64_t page_size, int64_t max_pages, float scale, int64_t window,
            const float* sinks) {
  constexpr int64_t dim = NV * W;
  constexpr int HT_MAX = kValueHeads<NV>;
  const int64_t group = hq / hkv;
  const int64_t row = hkv * dim;          // one token of one plane (K or V) of a page
  const int64_t plane = page_size * row;  // K or V of one page
  // bf16 scores by VDPBF16PS where the CPU has it (unscaled: scale is applied to the sums).
  constexpr bool kDotBf16 = kHasDotBf16 && std::is_same_v<T, c10::BFloat16> && NV % 2 == 0;
  // Sequences are handed out one at a time (their lengths differ, a static split idles a core),
  // each thread claiming its next one before attending to the current, whose rows it prefetches.
  std::atomic<int64_t> claimed{0};
  // The keys a row attends: its last `window` (a sliding-window layer) or all of them.
  std::vector<int64_t> lens(all_lens, all_lens + batch);
  if (window > 0)
    for (auto& n : lens) n = std::min(n, window);
  const auto offsets = [&](int64_t b, std::vector<int64_t>& off) {
    const int64_t* pages = table + b * max_pages;
    const int64_t first = all_lens[b] - lens[b];
    off.resize(lens[b]);
    for (int64_t l = 0, page = first / page_size, slot = first % page_size; l < lens[b]; ++l) {
      off[l] = pages[page] * 2 * plane + slot * row;
      if (++slot == page_size) slot = 0, ++page;
    }
  };
  const int64_t line_steps = (row * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  const int64_t value_passes = hkv * ((group + HT_MAX - 1) / HT_MAX) * (NV / kValueCols<NV>);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<int64_t> off, next_off;
    // The VDPBF16PS path reads keys in place and q as bf16: no widened block, no float q.
    std::vector<float> scores, kblock(kDotBf16 ? 0 : W * dim);
    std::vector<vf> qv(kDotBf16 ? 0 : hq * NV), acc(hq * NV);
#if defined(__AVX512BF16__)
    std::vector<__m512bh> qb(kDotBf16 ? hq * NV / 2 : 0);
#endif
    std::vector<float> inv(hq);
    const vi lane = lane_index();
    int64_t b = claimed.fetch_add(1);
    if (b < batch) {
      offsets(b, off);
      touch_rows(kv, off.data(), lens[b], row, plane);
    }
    while (b < batch) {
      const int64_t nb = claimed.fetch_add(1);
      const int64_t next_len = nb < batch ? lens[nb] : 0;
      if (nb < batch) offsets(nb, next_off);
      const int64_t len = lens[b];
      // One prefetch step per value row weighed, and W per block of scores (its W keys).
      const int64_t steps =
          std::max<int64_t>(1, value_passes * len + hkv * ((len + W - 1) / W) * W);
      RowPrefetcher<T> pf{reinterpret_cast<const char*>(kv), next_off.data(), next_len,
                          row * static_cast<int64_t>(sizeof(T)),
                          plane * static_cast<int64_t>(sizeof(T)),
                          (next_len * line_steps + steps - 1) / steps};
      const int64_t padded = (len + W - 1) / W * W;
      scores.resize(hq * padded);
      for (int64_t h = 0; h < hq; ++h) {
        const T* qh = q + b * q_batch_stride + h * q_head_stride;
#if defined(__AVX512BF16__)
        if constexpr (kDotBf16) {
          for (int64_t j = 0; j < NV / 2; ++j)
            qb[h * (NV / 2) + j] = (__m512bh)_mm512_loadu_si512(qh + j * 32);
          continue;
        }
#endif
        for (int64_t j = 0; j < NV; ++j) qv[h * NV + j] = load(qh + j * W) * scale;
      }
      for (int64_t hk = 0; hk < hkv; ++hk) {
        const T* kbase = kv + hk * dim;
        for (int64_t l0 = 0; l0 < len; l0 += W) {
          const int64_t n = std::min<int64_t>(W, len - l0);
#if defined(__AVX512BF16__)
          if constexpr (kDotBf16) {
            const c10::BFloat16* kb[W];
            for (int64_t t = 0; t < W; ++t) kb[t] = kbase + off[l0 + (t < n ? t : 0)];
            for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
              float* sh = scores.data() + h * padded + l0;
              store(sh, block_scores_bf16<NV>(qb.data() + h * (NV / 2), kb) * scale);
              for (int64_t t = n; t < W; ++t) sh[t] = -INFINITY;
            }
            pf.step_n(W);
            continue;
          }
#endif
          const float* kp[W];
          for (int64_t t = 0; t < W; ++t) {
            const T* k = kbase + off[l0 + (t < n ? t : 0)];
            if constexpr (std::is_same_v<T, float>) {
              kp[t] = k;
            } else {  // widen the block once for every query head of the group
              float* wide = kblock.data() + t * dim;
              for (int64_t j = 0; j < NV; ++j) store(wide + j * W, load(k + j * W));
              kp[t] = wide;
            }
          }
          for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
            float* sh = scores.data() + h * padded + l0;
            store(sh, block_scores<float, NV>(qv.data() + h * NV, kp));
            for (int64_t t = n; t < W; ++t) sh[t] = -INFINITY;
          }
          pf.step_n(W);
        }
      }
      const int64_t tail = len - (padded - W);  // real keys in the last block
      for (int64_t h = 0; h < hq; ++h) {
        float* sh = scores.data() + h * padded;
        vf m = load(sh);
        for (int64_t c = W; c < padded; c += W) {
          const vf v = load(sh + c);
          m = v > m ? v : m;
        }
        float mx = m[0];
        for (int e = 1; e < W; ++e) mx = std::max(mx, m[e]);
        if (sinks) mx = std::max(mx, sinks[h]);  // the sink's logit joins the softmax
        vf sum = vf{};
        for (int64_t c = 0; c < padded; c += W) {
          vf e = vexp(load(sh + c) - mx);
          if (c + W == padded) e = lane < static_cast<int32_t>(tail) ? e : vf{};
          store(sh + c, e);
          sum += e;
        }
        inv[h] = 1.f / (sinks ? hsum(sum) + std::exp(sinks[h] - mx) : hsum(sum));
      }
      for (int64_t hk = 0; hk < hkv; ++hk) {
        const T* v0 = kv + plane + hk * dim;
        for (int64_t h0 = hk * group; h0 < (hk + 1) * group; h0 += HT_MAX) {
          const int n = static_cast<int>(std::min<int64_t>(HT_MAX, (hk + 1) * group - h0));
          const float* p[4];
          for (int i = 0; i < n; ++i) p[i] = scores.data() + (h0 + i) * padded;
          weigh_values_n<T, NV>(n, v0, off.data(), len, p, acc.data() + h0 * NV, pf);
        }
      }
      T* o = out + b * hq * dim;
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t j = 0; j < NV; ++j) store(o + h * dim + j * W, acc[h * NV + j] * inv[h]);
      pf.finish();
      off.swap(next_off);
      b = nb;
    }
  }
}

}  // namespace

template <typename T>
void decode_dim(int64_t dim, const T* q, int64_t qs0, int64_t qs1, const T* kv,
                const int64_t* table, const int64_t* lens, T* out, int64_t batch, int64_t hq,
                int64_t hkv, int64_t page_size, int64_t max_pages, float scale, int64_t window,
                const float* sinks) {
#define DECODE(NV)                                                                         \
  decode<T, NV>(q, qs0, qs1, kv, table, lens, out, batch, hq, hkv, page_size, max_pages, scale, \
                window, sinks)
  switch (dim) {
    case 16: return DECODE(16 / W);
    case 32: return DECODE(32 / W);
    case 64: return DECODE(64 / W);
    case 128: return DECODE(128 / W);
    case 256: return DECODE(256 / W);
    default: TORCH_CHECK(false, "paged_decode: head_dim must be 16, 32, 64, 128 or 256");
  }
#undef DECODE
}

template void decode_dim<float>(int64_t, const float*, int64_t, int64_t, const float*,
                                const int64_t*, const int64_t*, float*, int64_t, int64_t,
                                int64_t, int64_t, int64_t, float, int64_t, const float*);
template void decode_dim<bf16>(int64_t, const bf16*, int64_t, int64_t, const bf16*,
                               const int64_t*, const int64_t*, bf16*, int64_t, int64_t, int64_t,
                               int64_t, int64_t, float, int64_t, const float*);

}  // namespace mstar_cpu

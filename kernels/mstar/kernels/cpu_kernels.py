"""CPU kernels in C++ for a step: paged attention and the fused glue around the GEMMs.

- ``paged_decode``: decode attention reading K/V straight from the cache pages. The torch path
  gathers every page of every decode row into a padded head-major copy in every layer. This
  kernel walks each row's page table in place, one task per sequence on torch's own OpenMP team
  (``at::parallel_for``): scores for 16 keys at a time against every query head of a KV group,
  one transpose-and-add reduction per block instead of a horizontal sum per key, a vectorised
  softmax, values weighed with the group's accumulators in registers. float32 and bfloat16
  caches; bf16 loads widen to float32 and the output rounds back once.
- ``paged_prefill``: causal attention for a step's prompt chunks over the same pages, fresh
  prompts and chunks after cached keys alike (torch's SDPA, run per sequence on a gathered
  copy, took 2x as long for a 140-token prompt with SmolLM2's heads).
- ``write_kv``: a step's new K/V rows into a layer's pages, one copy per token (the torch path
  computes slot rows and runs two ``index_copy_`` per layer).
- ``add_rms_norm_``: the residual add and HF's RMSNorm in one pass (float32 or bf16, rounded
  to bf16 where torch's ops round).
- ``rope_``: rotate_half RoPE on Q and K in place (float32 or bf16), bit-identical to the torch
  ops (bf16 denormals aside: where the CPU has AVX512-BF16, one VCVTNEPS2BF16 rounds to bf16,
  and it flushes them to zero).
- ``silu_mul``: SiLU(gate) * up from the fused gate/up output in one pass (float32 or bf16; its
  own vectorised exp, so within float32 rounding of torch's before any bf16 rounding).
- ``sample_rows``: one draw per row from softmax(logits) by inverse CDF with one uniform per
  row (the torch path draws Gumbel noise for every vocab entry: uniform, two logs, an add).
- ``argmax_rows``: the sampler's greedy argmax over a [rows, vocab] float32 or bf16 batch, one
  row per task (torch's CPU argmax took 1.6 ms for 32 x 49152).
- ``amx_linear`` (with ``amx_pack_weight``, ``amx_available``): bf16 x @ W.T on AMX tiles for
  decode-sized batches, where a step's time is streaming the weights from DRAM once (oneDNN
  reached about half of the bandwidth there); compiled only where the CPU has AMX.
- ``dpbf16_linear`` (with ``dpbf16_pack_weight``, ``dpbf16_available``): the same on
  AVX512-BF16's VDPBF16PS for CPUs without AMX (1.3-1.6x oneDNN's packed kernel at 1-64 rows on
  a 2-core Zen 5); compiled only where the CPU has AVX512-BF16.

These are per-layer ops on small tensors in a decode step, where dispatch and passes over memory
cost more than the arithmetic: SmolLM2 at batch 32 ran ~20 of them per layer around the GEMMs.

The source is compiled on first use with the machine's C++ compiler (``torch.utils.cpp_extension``,
cached under ``TORCH_EXTENSIONS_DIR``) and ``-march=native``. Where no compiler is available the
engine keeps the torch path (`load` returns None and logs why, once).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from typing import Any

import torch

log = logging.getLogger(__name__)

#: Set to 0 to keep the torch path even where the kernels build (A/B measurements).
ENV_SWITCH = "MSTAR_CPU_KERNELS"

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // AVX512-BF16 and AMX intrinsics, each used only where compiled for
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <type_traits>
#include <vector>

namespace {

// GCC/Clang vector extensions: 16 floats, lowered to whatever -march=native offers (one zmm
// with AVX-512, two ymm with AVX2).
typedef float f16v __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint16_t u16v __attribute__((vector_size(32)));
typedef uint32_t u32v __attribute__((vector_size(64)));
typedef float f8v __attribute__((vector_size(32)));
typedef float f4v __attribute__((vector_size(16)));
constexpr int64_t W = 16;
#if defined(__AVX512BF16__)
constexpr bool kHasDotBf16 = true;
#else
constexpr bool kHasDotBf16 = false;
#endif

inline f16v load(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f16v load(const c10::BFloat16* p) {
  u16v h;
  std::memcpy(&h, p, sizeof h);
  u32v w = __builtin_convertvector(h, u32v) << 16;
  f16v v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
inline void store(float* p, f16v v) { std::memcpy(p, &v, sizeof v); }

// Rounding float lanes to T's precision, as torch rounds each op's float result: identity for
// float, round-to-nearest-even to bf16 (NaN -> bf16 NaN) for BFloat16, as c10::BFloat16 does.
template <typename T>
inline f16v narrow(f16v v);
template <>
inline f16v narrow<float>(f16v v) {
  return v;
}
#if defined(__AVX512BF16__)
// VCVTNEPS2BF16 rounds to nearest even in one instruction; unlike c10::BFloat16 it flushes
// denormals to zero and keeps a NaN's sign and payload bits (still a NaN).
template <>
inline f16v narrow<c10::BFloat16>(f16v v) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh((__m512)v);
  return (f16v)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
}
inline void store(c10::BFloat16* p, f16v v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh((__m512)v));
}
#else
template <>
inline f16v narrow<c10::BFloat16>(f16v v) {
  u32v u;
  std::memcpy(&u, &v, sizeof u);
  u32v r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const u32v nan = reinterpret_cast<u32v>(v != v);
  r = (r & ~nan) | (nan & 0x7fc00000u);
  f16v out;
  std::memcpy(&out, &r, sizeof out);
  return out;
}
// Stores 16 lanes as bf16, rounding them first (a no-op on lanes `narrow` already rounded).
inline void store(c10::BFloat16* p, f16v v) {
  u32v u;
  const f16v r = narrow<c10::BFloat16>(v);
  std::memcpy(&u, &r, sizeof u);
  const u16v h = __builtin_convertvector(u >> 16, u16v);
  std::memcpy(p, &h, sizeof h);
}
#endif
template <typename T>
inline float narrow1(float v) {
  return static_cast<float>(static_cast<T>(v));
}

inline float hsum(f16v v) {
  f8v a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  f4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Lane sums of 16 vectors at once (a transpose-and-add tree: 15 adds and 30 shuffles, against
// 16 separate horizontal sums). Lane t of the result is the sum of a[kBrev[t]]'s lanes, so a
// caller that fills slot s with token kBrev[s] gets token t in lane t.
constexpr int kBrev[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
inline f16v pair1(f16v a, f16v b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                 31);
}
inline f16v pair2(f16v a, f16v b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}
inline f16v pair3(f16v a, f16v b) {
  return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
inline f16v pair4(f16v a, f16v b) {
  return __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
inline f16v reduce16(const f16v* a) {
  f16v x[8], y[4];
  for (int i = 0; i < 8; ++i) x[i] = pair1(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 4; ++i) y[i] = pair2(x[2 * i], x[2 * i + 1]);
  return pair4(pair3(y[0], y[1]), pair3(y[2], y[3]));
}

// exp of 16 floats: x = n ln2 + r with |r| <= ln2 / 2 (n rounded to nearest by the 1.5 * 2^23
// trick), a degree-7 Taylor polynomial for e^r (error < 1e-8 relative), 2^n from the exponent
// bits. x is clamped to [-87, 88] (results ~1e-38 .. ~1.6e38): the softmax zeroes its padded
// lanes itself.
inline f16v vexp(f16v x) {
  const f16v lo = f16v{} - 87.f, hi = f16v{} + 88.f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const f16v big = f16v{} + 12582912.f;
  const f16v nf = (x * 1.44269504088896341f + big) - big;
  const i16v n = __builtin_convertvector(nf, i16v);
  const f16v r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;
  f16v p = r * (1.f / 5040) + (1.f / 720);
  p = p * r + (1.f / 120);
  p = p * r + (1.f / 24);
  p = p * r + (1.f / 6);
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const i16v bits = (n + 127) << 23;
  f16v scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Scores of one query head against a block of up to 16 keys (slots past ``n`` repeat key 0 and
// are overwritten with -inf by the caller).
template <typename T, int NV>
inline f16v block_scores(const f16v* qh, const T* const* kp) {
  f16v acc[16];
#pragma GCC unroll 16
  for (int s = 0; s < 16; ++s) {
    const T* k = kp[kBrev[s]];
    f16v a = qh[0] * load(k);
#pragma GCC unroll 16
    for (int j = 1; j < NV; ++j) a += qh[j] * load(k + j * W);
    acc[s] = a;
  }
  return reduce16(acc);
}

#if defined(__AVX512BF16__)
// Scores of one bf16 query head (NV/2 vectors of 32 bf16) against 16 bf16 key rows: VDPBF16PS
// multiplies pairs exactly and sums in float32, so the keys need no widening (bf16 decode at
// batch 64, SmolLM2's heads: 590 -> 486 us per layer).
template <int NV>
inline f16v block_scores_bf16(const __m512bh* qh, const c10::BFloat16* const* kp) {
  f16v acc[16];
#pragma GCC unroll 16
  for (int s = 0; s < 16; ++s) {
    const c10::BFloat16* k = kp[kBrev[s]];
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qh[0], (__m512bh)_mm512_loadu_si512(k));
#pragma GCC unroll 8
    for (int j = 1; j < NV / 2; ++j)
      a = _mm512_dpbf16_ps(a, qh[j], (__m512bh)_mm512_loadu_si512(k + 32 * j));
    acc[s] = (f16v)a;
  }
  return reduce16(acc);
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
  i16v acc = {};
  for (int64_t t = 0; t < len; ++t) {
    const char* k = reinterpret_cast<const char*>(kv + off[t]);
    const char* v = reinterpret_cast<const char*>(kv + off[t] + plane);
    for (int64_t o = 0; o < row * static_cast<int64_t>(sizeof(T)); o += 64) {
      i16v a, c;
      std::memcpy(&a, k + o, 64);
      std::memcpy(&c, v + o, 64);
      acc += a ^ c;
    }
  }
  asm volatile("" : : "v"(acc));
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

// Probability-weighted sum of V rows for HT query heads of one KV head, accumulators in registers.
template <typename T, int NV, int HT>
inline void weigh_values(const T* v0, const int64_t* off, int64_t len, const float* const* p,
                         f16v* out, RowPrefetcher<T>& pf) {
  f16v acc[HT][NV];
  for (int h = 0; h < HT; ++h)
    for (int j = 0; j < NV; ++j) acc[h][j] = f16v{};
  for (int64_t l = 0; l < len; ++l) {
    pf.step();
    const T* v = v0 + off[l];
    f16v vr[NV];
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
    for (int j = 0; j < NV; ++j) out[h * NV + j] = acc[h][j];
}

template <typename T, int NV>
void weigh_values_n(int n, const T* v0, const int64_t* off, int64_t len, const float* const* p,
                    f16v* out, RowPrefetcher<T>& pf) {
  switch (n) {
    case 1: return weigh_values<T, NV, 1>(v0, off, len, p, out, pf);
    case 2: return weigh_values<T, NV, 2>(v0, off, len, p, out, pf);
    case 3: return weigh_values<T, NV, 3>(v0, off, len, p, out, pf);
    default: return weigh_values<T, NV, 4>(v0, off, len, p, out, pf);
  }
}

// One task per sequence on torch's OpenMP team. Its K/V rows are already on their way to L2
// (`touch_rows` for a thread's first, `RowPrefetcher` during the one before for the rest), then
// per KV head: scores for 16 keys at a time (every query head of the group against the same K
// rows, read from L1 after the first; bf16 rows go to VDPBF16PS where the CPU has it, else are
// widened to float32 once per block, not once per head), a vectorised softmax, then the values
// weighed with the group's accumulators in registers.
template <typename T, int NV>
void decode(const T* q, int64_t q_batch_stride, int64_t q_head_stride, const T* kv,
            const int64_t* table, const int64_t* lens, T* out, int64_t batch, int64_t hq,
            int64_t hkv, int64_t page_size, int64_t max_pages, float scale) {
  constexpr int64_t dim = NV * W;
  constexpr int HT_MAX = NV >= 16 ? 1 : (NV >= 8 ? 2 : 4);
  const int64_t group = hq / hkv;
  const int64_t row = hkv * dim;          // one token of one plane (K or V) of a page
  const int64_t plane = page_size * row;  // K or V of one page
  // bf16 scores by VDPBF16PS where the CPU has it (unscaled: scale is applied to the sums).
  constexpr bool kDotBf16 = kHasDotBf16 && std::is_same_v<T, c10::BFloat16> && NV % 2 == 0;
  // Sequences are handed out one at a time (their lengths differ, a static split idles a core),
  // each thread claiming its next one before attending to the current, whose rows it prefetches.
  std::atomic<int64_t> claimed{0};
  const auto offsets = [&](int64_t b, std::vector<int64_t>& off) {
    const int64_t* pages = table + b * max_pages;
    off.resize(lens[b]);
    for (int64_t l = 0, page = 0, slot = 0; l < lens[b]; ++l) {
      off[l] = pages[page] * 2 * plane + slot * row;
      if (++slot == page_size) slot = 0, ++page;
    }
  };
  const int64_t line_steps = (row * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  const int64_t value_passes = hkv * ((group + HT_MAX - 1) / HT_MAX);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<int64_t> off, next_off;
    // The VDPBF16PS path reads keys in place and q as bf16: no widened block, no float q.
    std::vector<float> scores, kblock(kDotBf16 ? 0 : 16 * dim);
    std::vector<f16v> qv(kDotBf16 ? 0 : hq * NV), acc(hq * NV);
#if defined(__AVX512BF16__)
    std::vector<__m512bh> qb(kDotBf16 ? hq * NV / 2 : 0);
#endif
    std::vector<float> inv(hq);
    const i16v lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
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
      // One prefetch step per value row weighed, and 16 per block of scores (its 16 keys).
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
            const c10::BFloat16* kb[16];
            for (int64_t t = 0; t < 16; ++t) kb[t] = kbase + off[l0 + (t < n ? t : 0)];
            for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
              float* sh = scores.data() + h * padded + l0;
              store(sh, block_scores_bf16<NV>(qb.data() + h * (NV / 2), kb) * scale);
              for (int64_t t = n; t < W; ++t) sh[t] = -INFINITY;
            }
            pf.step_n(W);
            continue;
          }
#endif
          const float* kp[16];
          for (int64_t t = 0; t < 16; ++t) {
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
        f16v m = load(sh);
        for (int64_t c = W; c < padded; c += W) {
          const f16v v = load(sh + c);
          m = v > m ? v : m;
        }
        float mx = m[0];
        for (int e = 1; e < W; ++e) mx = std::max(mx, m[e]);
        f16v sum = f16v{};
        for (int64_t c = 0; c < padded; c += W) {
          f16v e = vexp(load(sh + c) - mx);
          if (c + W == padded) e = lane < static_cast<int32_t>(tail) ? e : f16v{};
          store(sh + c, e);
          sum += e;
        }
        inv[h] = 1.f / hsum(sum);
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

template <typename T>
void decode_dim(int64_t dim, const T* q, int64_t qs0, int64_t qs1, const T* kv,
                const int64_t* table, const int64_t* lens, T* out, int64_t batch, int64_t hq,
                int64_t hkv, int64_t page_size, int64_t max_pages, float scale) {
#define DECODE(NV) \
  decode<T, NV>(q, qs0, qs1, kv, table, lens, out, batch, hq, hkv, page_size, max_pages, scale)
  switch (dim) {
    case 16: return DECODE(1);
    case 32: return DECODE(2);
    case 64: return DECODE(4);
    case 128: return DECODE(8);
    case 256: return DECODE(16);
    default: TORCH_CHECK(false, "paged_decode: head_dim must be 16, 32, 64, 128 or 256");
  }
#undef DECODE
}

// Causal attention for the several-query rows of a step (prompt chunks), keys read from the
// cache pages (K/V are written before attending). Sequence b's queries are rows
// q_start[b] .. + q_len[b] of q, the last q_len[b] of its kv_len[b] positions. One task per
// (sequence, KV head, block of PF_ROWS query rows), handed out dynamically since later rows see
// more keys: the task widens its keys once into float32 K^T [D, keys] and V [keys, D], then
// for 4 query rows of a head at a time takes 16 scores per pass over D (one K load feeds 4
// FMAs), a softmax in float32, and the value sum with 4 x D/16 accumulators in registers.
constexpr int64_t PF_ROWS = 32;
constexpr int PF_R = 4;

template <typename T, int NV>
void prefill(const T* q, int64_t qs0, int64_t qs1, const T* kv, const int64_t* table,
             int64_t max_pages, const int64_t* kv_lens, const int64_t* q_starts,
             const int64_t* q_lens, int64_t batch, T* out, int64_t hq, int64_t hkv,
             int64_t page_size, float scale) {
  constexpr int64_t D = NV * W;
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
    const int64_t keys = first + r1, lp = (keys + W - 1) / W * W;
    const int64_t* pt = table + b * max_pages;
    auto key_row = [&](int64_t l, int64_t plane) {
      return kv + ((pt[l / page_size] * 2 + plane) * page_size + l % page_size) * head_row +
             hk * D;
    };
    // Per-thread, grow-only: a long prompt's K^T / V run to megabytes, fresh ones per task
    // would be mapped and faulted in every time. Only K^T's padding columns need zeros.
    thread_local std::vector<float> kt, vf, sc;
    thread_local std::vector<uint32_t> kt2;
    vf.resize(std::max<size_t>(vf.size(), keys * D));
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
          const f16v kc = load(k + c * W);
          for (int e = 0; e < W; ++e) dst[(c * W + e) * lp + l] = kc[e];
        }
      }
    }
    // Plain pointers to the thread_local storage, looked up once per task: inside the loops
    // each access to a thread_local of this shared library is a TLS lookup (the key loop of the
    // values ran 1.5x slower that way).
    float* const vfp = vf.data();
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
                store(scp + i * lp + j + c * W, (f16v)acc[i][c] * scale);
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
            for (int i = 0; i < PF_R; ++i) store(scp + i * lp + j, (f16v)acc[i] * scale);
          }
        }
#endif
        if constexpr (!kDotBf16) {
          float qv[PF_R][D];
          for (int i = 0; i < PF_R; ++i)
            for (int64_t d = 0; d < D; ++d) qv[i][d] = static_cast<float>(qr[i][d]);
          for (int64_t j = 0; j < hi; j += W) {
            f16v acc[PF_R] = {};
#pragma GCC unroll 8
            for (int64_t d = 0; d < D; ++d) {
              const f16v kd = load(ktp + d * lp + j);
#pragma GCC unroll 4
              for (int i = 0; i < PF_R; ++i) acc[i] += qv[i][d] * kd;
            }
            for (int i = 0; i < PF_R; ++i) store(scp + i * lp + j, acc[i] * scale);
          }
        }
        float inv[PF_R];
        for (int i = 0; i < PF_R; ++i) {
          float* row = scp + i * lp;
          const int64_t lim = i < nr ? first + i0 + i + 1 : 0;  // keys row i sees
          float mx = -INFINITY;
          const int64_t vec_lim = lim / W * W;
          f16v m = f16v{} - INFINITY;
          for (int64_t j = 0; j < vec_lim; j += W) {
            const f16v x = load(row + j);
            m = x > m ? x : m;
          }
          for (int e = 0; e < W; ++e) mx = std::max(mx, m[e]);
          for (int64_t j = vec_lim; j < lim; ++j) mx = std::max(mx, row[j]);
          f16v sum = f16v{};
          for (int64_t j = 0; j < vec_lim; j += W) {
            const f16v e = vexp(load(row + j) - mx);
            store(row + j, e);
            sum += e;
          }
          float total = hsum(sum);
          for (int64_t j = vec_lim; j < lim; ++j) total += row[j] = std::exp(row[j] - mx);
          for (int64_t j = lim; j < hi; ++j) row[j] = 0.f;
          inv[i] = lim > 0 ? 1.f / total : 0.f;
        }
        f16v o[PF_R][NV] = {};
        for (int64_t j = 0; j < hi; ++j) {
          const float* vr = vfp + j * D;
          f16v vv[NV];
#pragma GCC unroll 16
          for (int v = 0; v < NV; ++v) vv[v] = load(vr + v * W);
#pragma GCC unroll 4
          for (int i = 0; i < PF_R; ++i) {
            const float pj = scp[i * lp + j];
#pragma GCC unroll 16
            for (int v = 0; v < NV; ++v) o[i][v] += pj * vv[v];
          }
        }
        for (int i = 0; i < nr; ++i) {
          T* dst = out + ((q_starts[b] + i0 + i) * hq + h) * D;
          for (int v = 0; v < NV; ++v) store(dst + v * W, o[i][v] * inv[i]);
        }
      }
    }
  }
}

template <typename T>
void prefill_dim(int64_t dim, const T* q, int64_t qs0, int64_t qs1, const T* kv,
                 const int64_t* table, int64_t max_pages, const int64_t* kv_lens,
                 const int64_t* q_starts, const int64_t* q_lens, int64_t batch, T* out,
                 int64_t hq, int64_t hkv, int64_t page_size, float scale) {
#define PREFILL(NV)                                                                          \
  prefill<T, NV>(q, qs0, qs1, kv, table, max_pages, kv_lens, q_starts, q_lens, batch, out, hq, \
                 hkv, page_size, scale)
  switch (dim) {
    case 16: return PREFILL(1);
    case 32: return PREFILL(2);
    case 64: return PREFILL(4);
    case 128: return PREFILL(8);
    case 256: return PREFILL(16);
    default: TORCH_CHECK(false, "paged_prefill: head_dim must be 16, 32, 64, 128 or 256");
  }
#undef PREFILL
}

// Rows of a [T, H, D] view whose heads are contiguous rows of D (a slice of a fused QKV row).
void check_head_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              name, " must be [T, H, D] with contiguous heads");
}

// Keeps a product in its own rounding: the compiler may not contract it into an FMA.
template <typename V>
inline V rounded(V v) {
  asm("" : "+v"(v));
  return v;
}

// x1 * c - x2 * s and x2 * c + x1 * s with every product and sum rounded on its own to T:
// bit-identical to the same expression in torch ops on T tensors (`store` rounds the sums).
template <typename T>
inline void rotate16(T* x1, T* x2, f16v cv, f16v sv) {
  const f16v a = load(x1), b = load(x2);
  store(x1, narrow<T>(rounded(a * cv)) - narrow<T>(rounded(b * sv)));
  store(x2, narrow<T>(rounded(b * cv)) + narrow<T>(rounded(a * sv)));
}
template <typename T>
inline void rotate1(T* x1, T* x2, const T* c, const T* s) {
  const float a = *x1, b = *x2, cv = *c, sv = *s;
  *x1 = static_cast<T>(narrow1<T>(rounded(a * cv)) - narrow1<T>(rounded(b * sv)));
  *x2 = static_cast<T>(narrow1<T>(rounded(b * cv)) + narrow1<T>(rounded(a * sv)));
}

// A row's cos / sin vectors are loaded once for all its heads; rows split over the threads.
template <typename T>
void rotate_rows(T* x, int64_t rows, int64_t heads, int64_t row_stride, int64_t half,
                 const T* cos, const T* sin) {
  const int64_t vec_end = half / W * W;
  at::parallel_for(0, rows, 32, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * half;
      const T* s = sin + t * half;
      T* xt = x + t * row_stride;
      for (int64_t i = 0; i < vec_end; i += W) {
        const f16v cv = load(c + i), sv = load(s + i);
        for (int64_t h = 0; h < heads; ++h) {
          T* x1 = xt + h * 2 * half + i;
          rotate16(x1, x1 + half, cv, sv);
        }
      }
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = vec_end; i < half; ++i) {
          T* x1 = xt + h * 2 * half + i;
          rotate1(x1, x1 + half, c + i, s + i);
        }
    }
  });
}

// residual += x, then x = weight * (residual * rsqrt(mean(residual^2) + eps)) in place, each
// step rounded to T where torch's ops round (HF's RMSNorm: sum of squares in float32).
template <typename T>
void add_rms_norm_rows(T* xs, T* rs, const T* w, int64_t rows, int64_t hidden, float eps) {
  const int64_t vec_end = hidden / W * W;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* xr = xs + t * hidden;
      T* rr = rs + t * hidden;
      f16v acc = f16v{};
      for (int64_t i = 0; i < vec_end; i += W) {
        const f16v r = narrow<T>(load(rr + i) + load(xr + i));
        store(rr + i, r);
        acc += r * r;
      }
      float ss = hsum(acc);
      for (int64_t i = vec_end; i < hidden; ++i) {
        const float r = narrow1<T>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
        rr[i] = static_cast<T>(r);
        ss += r * r;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
      for (int64_t i = 0; i < vec_end; i += W)
        store(xr + i, load(w + i) * narrow<T>(load(rr + i) * inv));
      for (int64_t i = vec_end; i < hidden; ++i)
        xr[i] = static_cast<T>(static_cast<float>(w[i]) *
                               narrow1<T>(static_cast<float>(rr[i]) * inv));
    }
  });
}

// silu(gate) * up for rows of [gate | up]: torch's silu, x / (1 + exp(-x)) with `vexp`, rounded
// to T before the product as F.silu(gate).mul_(up) rounds.
template <typename T>
void silu_mul_rows(const T* xs, T* o, int64_t rows, int64_t inter) {
  const int64_t vec_end = inter / W * W;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = xs + t * 2 * inter;
      const T* up = gate + inter;
      T* dst = o + t * inter;
      for (int64_t i = 0; i < vec_end; i += W) {
        const f16v g = load(gate + i);
        store(dst + i, narrow<T>(g / (1.f + vexp(-g))) * load(up + i));
      }
      for (int64_t i = vec_end; i < inter; ++i) {
        const float g = gate[i];
        dst[i] = static_cast<T>(narrow1<T>(g / (1.f + std::exp(-g))) * static_cast<float>(up[i]));
      }
    }
  });
}

// float32 or bfloat16, the same for every tensor of a glue op.
bool glue_dtype(const torch::Tensor& x) {
  return x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16;
}

// Calls f with a value of x's element type (float or c10::BFloat16): one dispatch for every op.
template <typename F>
void by_dtype(const torch::Tensor& x, const char* op, F&& f) {
  if (x.scalar_type() == torch::kFloat32)
    f(float{});
  else if (x.scalar_type() == torch::kBFloat16)
    f(c10::BFloat16{});
  else
    TORCH_CHECK(false, op, ": float32 or bfloat16 only");
}

// -- bf16 GEMM on AMX tiles for decode-sized batches ----------------------------------------------
// A decode step's linears read every weight once for a few dozen rows: the time is streaming
// weights from DRAM. oneDNN reached ~10 GB/s of this machine's ~19 GB/s there; these tiles
// reach 14-18. The weight is packed once into B tiles, 32 columns (two tiles) by 32 of K per
// 2 KB block, each 32-column panel contiguous over K, so a thread streams one sequential run
// per panel and prefetches the next while its first pass multiplies.
constexpr int64_t kTileK = 32;     // bf16 of K per tile step: 64 bytes per A row
constexpr int64_t kTileRows = 16;  // rows per A / C tile
constexpr int64_t kPanelCols = 32; // columns per panel: two B tiles of 16
constexpr int64_t kBlockElems = 2 * 16 * 32;  // one K step of a panel (2 KB)

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A GEMM's optional bias [N] as a pointer (null for none), refused unless contiguous bf16.
const c10::BFloat16* linear_bias(const c10::optional<torch::Tensor>& bias, int64_t n,
                                 const char* op) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == n,
              op, ": bias must be contiguous bfloat16 [N]");
  return bias->data_ptr<c10::BFloat16>();
}

#if defined(__AVX512BF16__)
// Lanes [0, n) of a 16-float vector, and bf16 values widened into them (zeros elsewhere).
inline __m512 widen_bf16(__mmask16 keep, const c10::BFloat16* p) {
  const __m256i h = _mm256_maskz_loadu_epi16(keep, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr bool kHasAmx = true;

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: C (rows 0-15 | 16-31) x (columns 0-15 | 16-31); 4-5: A; 6-7: B. All 16 x 64 B.
inline void configure_tiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

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
    _tile_loadd(6, bs, 64);
    _tile_loadd(7, bs + 16 * 32, 64);
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

// Linux hands out AMX tile state only on request (ARCH_REQ_XCOMP_PERM for XTILEDATA), once
// per process; oneDNN asks too where it uses AMX.
bool request_amx() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}
#else
constexpr bool kHasAmx = false;
bool request_amx() { return false; }
#endif

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
constexpr int64_t kDotCols = 32;  // columns per panel: two zmm of accumulators per row
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

// q [B, Hq, D] (heads contiguous, any batch stride); kv_layer [pages, 2, S, Hkv, D];
// page_table int64 [B, max_pages]; kv_lens int64 [B]. Returns [B, Hq, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor page_table,
                           torch::Tensor kv_lens, double scale) {
  TORCH_CHECK(kv_layer.dim() == 5 && page_table.dim() == 2, "bad ranks");
  check_head_rows(q, "q");
  TORCH_CHECK(kv_layer.is_contiguous() && page_table.is_contiguous() && kv_lens.is_contiguous(),
              "kv_layer, page_table and kv_lens must be contiguous");
  TORCH_CHECK(q.scalar_type() == kv_layer.scalar_type(), "q and the cache differ in dtype");
  TORCH_CHECK(page_table.scalar_type() == torch::kInt64 && kv_lens.scalar_type() == torch::kInt64,
              "page_table and kv_lens must be int64");
  const int64_t batch = q.size(0), hq = q.size(1), dim = q.size(2);
  const int64_t page_size = kv_layer.size(2), hkv = kv_layer.size(3);
  TORCH_CHECK(kv_layer.size(1) == 2 && kv_layer.size(4) == dim && hq % hkv == 0, "bad shapes");
  TORCH_CHECK(page_table.size(0) == batch && kv_lens.size(0) == batch, "bad batch");
  auto out = torch::empty({batch, hq, dim}, q.options());
  const auto* table = page_table.data_ptr<int64_t>();
  const auto* lens = kv_lens.data_ptr<int64_t>();
  by_dtype(q, "paged_decode", [&](auto tag) {
    using T = decltype(tag);
    decode_dim<T>(dim, q.data_ptr<T>(), q.stride(0), q.stride(1), kv_layer.data_ptr<T>(), table,
                  lens, out.data_ptr<T>(), batch, hq, hkv, page_size, page_table.size(1),
                  static_cast<float>(scale));
  });
  return out;
}

// Causal attention of the several-query sequences of a step, writing their rows of out
// [T, Hq, D] (contiguous): q [T, Hq, D] (heads contiguous), kv_layer [pages, 2, S, Hkv, D],
// page_table int64 [B, max_pages], kv_lens / q_starts / q_lens int64 [B].
void paged_prefill(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor page_table,
                   torch::Tensor kv_lens, torch::Tensor q_starts, torch::Tensor q_lens,
                   double scale, torch::Tensor out) {
  check_head_rows(q, "q");
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(1) == 2 && kv_layer.is_contiguous(),
              "kv_layer must be a contiguous [pages, 2, S, H, D]");
  TORCH_CHECK(q.scalar_type() == kv_layer.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, out and the cache differ in dtype");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous like q");
  const int64_t batch = kv_lens.size(0), hq = q.size(1), hkv = kv_layer.size(3);
  for (const auto* t : {&page_table, &kv_lens, &q_starts, &q_lens})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == torch::kInt64,
                "page table and lengths must be contiguous int64");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == batch && q_starts.size(0) == batch &&
                  q_lens.size(0) == batch, "page table and lengths differ in batch");
  TORCH_CHECK(hq % hkv == 0 && q.size(2) == kv_layer.size(4), "head counts / dims do not match");
  const int64_t max_pages = page_table.size(1), page_size = kv_layer.size(2);
  const int64_t pages = kv_layer.size(0);
  const auto* lens = kv_lens.data_ptr<int64_t>();
  const auto* starts = q_starts.data_ptr<int64_t>();
  const auto* qlens = q_lens.data_ptr<int64_t>();
  const auto* table = page_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(qlens[b] >= 1 && qlens[b] <= lens[b] && starts[b] >= 0 &&
                    starts[b] + qlens[b] <= q.size(0) && lens[b] <= max_pages * page_size,
                "paged_prefill: sequence ", b, " has bad lengths");
    for (int64_t j = 0; j < (lens[b] + page_size - 1) / page_size; ++j)
      TORCH_CHECK(table[b * max_pages + j] >= 0 && table[b * max_pages + j] < pages,
                  "paged_prefill: page ", table[b * max_pages + j], " is outside the cache");
  }
  by_dtype(q, "paged_prefill", [&](auto tag) {
    using T = decltype(tag);
    prefill_dim<T>(q.size(2), q.data_ptr<T>(), q.stride(0), q.stride(1), kv_layer.data_ptr<T>(),
                   table, max_pages, lens, starts, qlens, batch, out.data_ptr<T>(), hq, hkv,
                   page_size, static_cast<float>(scale));
  });
}

// Copy k, v [T, Hkv, D] into kv_layer [pages, 2, S, Hkv, D] at flat slots (page * S + offset).
void write_kv(torch::Tensor kv_layer, torch::Tensor k, torch::Tensor v, torch::Tensor slots) {
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(1) == 2 && kv_layer.is_contiguous(),
              "kv_layer must be a contiguous [pages, 2, S, H, D]");
  check_head_rows(k, "k");
  check_head_rows(v, "v");
  TORCH_CHECK(k.scalar_type() == kv_layer.scalar_type() && v.scalar_type() == k.scalar_type(),
              "k, v and the cache differ in dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.is_contiguous() && slots.scalar_type() == torch::kInt64,
              "slots must be a contiguous int64 [T]");
  const int64_t tokens = slots.size(0), page_size = kv_layer.size(2);
  TORCH_CHECK(k.size(0) == tokens && v.size(0) == tokens, "k, v and slots differ in length");
  TORCH_CHECK(k.size(1) == kv_layer.size(3) && k.size(2) == kv_layer.size(4) &&
              v.sizes() == k.sizes(), "k / v shape does not match the cache");
  const int64_t capacity = kv_layer.size(0) * page_size;
  const int64_t row = k.size(1) * k.size(2);
  const int64_t bytes = row * static_cast<int64_t>(k.element_size());
  const auto* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "write_kv: slot ", slot[t],
                " is outside the cache's ", capacity, " slots");
  auto* base = static_cast<char*>(kv_layer.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size();
  const int64_t v_stride = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t page = slot[t] / page_size, offset = slot[t] % page_size;
    char* dst = base + ((page * 2 * page_size) + offset) * bytes;
    std::memcpy(dst, ks + t * k_stride, bytes);
    std::memcpy(dst + page_size * bytes, vs + t * v_stride, bytes);
  }
}

// x, residual [T, H] and weight [H], all float32 or all bf16: see `add_rms_norm_rows`.
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(glue_dtype(x) && residual.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type(),
              "add_rms_norm_: x, residual and weight all float32 or all bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() &&
                  weight.is_contiguous() && residual.sizes() == x.sizes() &&
                  weight.dim() == 1 && weight.size(0) == x.size(1),
              "add_rms_norm_: x and residual [T, H] contiguous, weight [H]");
  by_dtype(x, "add_rms_norm_", [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm_rows(x.data_ptr<T>(), residual.data_ptr<T>(), weight.data_ptr<T>(), x.size(0),
                      x.size(1), static_cast<float>(eps));
  });
}

// x [T, 2I] (gate | up, the fused projection's output), float32 or bf16 -> [T, I].
torch::Tensor silu_mul(torch::Tensor x) {
  TORCH_CHECK(glue_dtype(x) && x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_mul: float32 or bfloat16 contiguous [T, 2I]");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  auto out = torch::empty({rows, inter}, x.options());
  by_dtype(x, "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_mul_rows(x.data_ptr<T>(), out.data_ptr<T>(), rows, inter);
  });
  return out;
}

// Argmax of each row of x [n, V] (float32 or bf16, row-contiguous): the first index of the row's
// maximum, or of its first NaN, as torch.argmax answers. bf16 widens exactly, so a bf16 row's
// answer is its float32 copy's: greedy sampling needs no float32 logits. One row per task, 16
// lanes per compare.
template <typename T>
void argmax_rows_of(const T* xs, int64_t rows, int64_t vocab, int64_t stride, int64_t* o) {
  const int64_t vec_end = vocab / W * W;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xs + r * stride;
      f16v best = f16v{} - INFINITY;
      i16v best_i = i16v{}, idx = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
      i16v nan = i16v{};
      for (int64_t i = 0; i < vec_end; i += W, idx += static_cast<int32_t>(W)) {
        const f16v v = load(row + i);
        const i16v up = v > best;
        best = up ? v : best;
        best_i = up ? idx : best_i;
        nan |= v != v;
      }
      float m = -INFINITY;
      int64_t at = vocab;
      bool any_nan = false;
      for (int e = 0; e < W && vec_end > 0; ++e) {
        any_nan |= nan[e] != 0;
        if (best[e] > m || (best[e] == m && best_i[e] < at)) m = best[e], at = best_i[e];
      }
      for (int64_t i = vec_end; i < vocab; ++i) {
        const float x = static_cast<float>(row[i]);
        any_nan |= x != x;
        if (x > m) m = x, at = i;
      }
      if (at == vocab) at = 0;  // every entry -inf (or NaN, found below)
      if (any_nan)
        for (int64_t i = 0; i < vocab; ++i)
          if (std::isnan(static_cast<float>(row[i]))) {
            at = i;
            break;
          }
      o[r] = at;
    }
  });
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(glue_dtype(x) && x.dim() == 2 && x.stride(1) == 1,
              "argmax_rows: float32 or bfloat16 [n, V] with contiguous rows");
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 31), "argmax_rows: bad vocab size");
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  by_dtype(x, "argmax_rows", [&](auto tag) {
    using T = decltype(tag);
    argmax_rows_of(x.data_ptr<T>(), rows, vocab, x.stride(0), out.data_ptr<int64_t>());
  });
  return out;
}

// One draw per row of x [n, V] (float32, contiguous rows) from softmax(x), by inverse CDF: the
// first index whose running sum of exp(x - max) exceeds u[r] (float64 in [0, 1)) times the
// row's total. -inf entries (filtered tokens) and NaN have probability 0. Two passes over a row
// and one uniform per row, where Gumbel-max needs a uniform, two logs and an add per entry.
torch::Tensor sample_rows(torch::Tensor x, torch::Tensor u) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "sample_rows: float32 [n, V] with contiguous rows");
  TORCH_CHECK(u.scalar_type() == torch::kFloat64 && u.dim() == 1 && u.is_contiguous() &&
                  u.size(0) == x.size(0), "sample_rows: u must be float64 [n]");
  const int64_t rows = x.size(0), vocab = x.size(1), vec_end = vocab / W * W;
  TORCH_CHECK(vocab > 0, "sample_rows: empty rows");
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  const float* xs = x.data_ptr<float>();
  const double* us = u.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e(vocab);
    std::vector<double> chunk((vocab + W - 1) / W);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xs + r * stride;
      f16v mv = f16v{} - INFINITY;
      for (int64_t i = 0; i < vec_end; i += W) {
        const f16v v = load(row + i);
        mv = v > mv ? v : mv;
      }
      float mx = -INFINITY;
      for (int l = 0; l < W && vec_end > 0; ++l) mx = std::max(mx, mv[l]);
      for (int64_t i = vec_end; i < vocab; ++i) mx = row[i] > mx ? row[i] : mx;
      if (!(mx > -INFINITY) || mx == INFINITY) {  // nothing finite to weigh: the first max
        int64_t at = 0;
        for (int64_t i = 0; i < vocab; ++i)
          if (row[i] == mx) {
            at = i;
            break;
          }
        o[r] = at;
        continue;
      }
      double total = 0;
      for (int64_t i = 0, c = 0; i < vec_end; i += W, ++c) {
        const f16v v = load(row + i);
        f16v p = vexp(v - mx);
        p = v > -INFINITY ? p : f16v{};  // -inf and NaN lanes weigh nothing
        store(e.data() + i, p);
        chunk[c] = hsum(p);
        total += chunk[c];
      }
      if (vec_end < vocab) {
        double tail = 0;
        for (int64_t i = vec_end; i < vocab; ++i) {
          e[i] = row[i] > -INFINITY ? std::exp(row[i] - mx) : 0.f;
          tail += e[i];
        }
        chunk[vec_end / W] = tail;
        total += tail;
      }
      const double target = us[r] * total;
      double cum = 0;
      int64_t at = -1;
      for (int64_t c = 0; c * W < vocab && at < 0; ++c) {
        if (cum + chunk[c] <= target) {
          cum += chunk[c];
          continue;
        }
        for (int64_t i = c * W; i < std::min(vocab, (c + 1) * W); ++i) {
          cum += e[i];
          if (e[i] > 0 && cum > target) {
            at = i;
            break;
          }
        }
      }
      // Rounding can leave the target past the sum: then the last token with weight.
      for (int64_t i = vocab - 1; at < 0 && i >= 0; --i)
        if (e[i] > 0) at = i;
      o[r] = at;
    }
  });
  return out;
}

// RoPE in place on x [T, H, D] (rotate_half layout) with cos / sin [T, 1, D/2], all float32
// or all bf16.
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_head_rows(x, "x");
  TORCH_CHECK(glue_dtype(x) && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "rope_: x, cos and sin all float32 or all bfloat16");
  const int64_t half = x.size(2) / 2;
  TORCH_CHECK(x.size(2) % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == x.size(0) * half && sin.numel() == cos.numel(),
              "rope_: cos / sin must be contiguous [T, 1, D/2]");
  by_dtype(x, "rope_", [&](auto tag) {
    using T = decltype(tag);
    rotate_rows(x.data_ptr<T>(), x.size(0), x.size(1), x.stride(0), half, cos.data_ptr<T>(),
                sin.data_ptr<T>());
  });
}

// True where this build has AMX bf16 tiles and the kernel granted them: `amx_linear` runs.
bool amx_available() { return kHasAmx && request_amx(); }

// Weight [N, K] bf16 -> [ceil(N/32), ceil(K/32), 2, 16, 32] B tiles for `amx_linear`: per
// panel of 32 columns and K step of 32, two tiles of 16 k-pairs x (16 columns x 2 k),
// zero-padded past N and K.
torch::Tensor amx_pack_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "amx_pack_weight: weight must be bfloat16 [N, K]");
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t panels = round_up(n, kPanelCols) / kPanelCols, steps = round_up(k, kTileK) / kTileK;
  auto packed = torch::zeros({panels, steps, 2, 16, 32}, w.options());
  const c10::BFloat16* src = w.data_ptr<c10::BFloat16>();
  c10::BFloat16* dst = packed.data_ptr<c10::BFloat16>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t col = 0; col < kPanelCols && p * kPanelCols + col < n; ++col) {
        const c10::BFloat16* row = src + (p * kPanelCols + col) * k;
        const int64_t tile = col / 16, lane = col % 16;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t s = j / kTileK, pair = (j % kTileK) / 2;
          dst[(((p * steps + s) * 2 + tile) * 16 + pair) * 32 + lane * 2 + j % 2] = row[j];
        }
      }
  });
  return packed;
}

// x [M, K] bf16 (rows contiguous) @ weight.T (+ bias) -> [M, N] bf16, float32 accumulation
// rounded once, over `amx_pack_weight`'s tiles. One thread per run of panels; every thread
// multiplies all M rows, 32 at a time, so each weight byte leaves DRAM once. Each pass over a
// panel prefetches its share of the next panel, so DRAM keeps streaming while the later
// passes multiply from cache (at 128 rows a step's linears took 22.1 ms against 23.8 with the
// whole prefetch in the first pass).
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t n,
                         c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(kHasAmx && request_amx(), "amx_linear: this CPU or build has no AMX bf16 tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "amx_linear: x must be bfloat16 [M, K] with contiguous rows");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "amx_linear: packed must come from amx_pack_weight");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), steps = packed.size(1);
  TORCH_CHECK(round_up(k, kTileK) == steps * kTileK && n > 0 &&
                  round_up(n, kPanelCols) == panels * kPanelCols,
              "amx_linear: x's K or N does not match the packed weight");
  const c10::BFloat16* bias_p = linear_bias(bias, n, "amx_linear");
  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  // A tiles load 64 bytes of K per row straight from x; a K that is not a whole number of
  // steps goes through a zero-padded copy (no model here has one).
  torch::Tensor a = x;
  if (k != steps * kTileK) {
    a = torch::zeros({m, steps * kTileK}, x.options());
    a.narrow(1, 0, k).copy_(x);
  }
  const int64_t lda = a.stride(0) * 2, full = m / kTileRows * kTileRows, tail = m - full;
  const char* a_p = reinterpret_cast<const char*>(a.data_ptr<c10::BFloat16>());
  const c10::BFloat16* b_p = packed.data_ptr<c10::BFloat16>();
  c10::BFloat16* o_p = out.data_ptr<c10::BFloat16>();
  const int64_t panel_elems = steps * kBlockElems;
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
#endif
  return out;
}

// True where this build has VDPBF16PS (AVX512-BF16): `dpbf16_linear` runs.
bool dpbf16_available() { return kHasDotBf16; }

// Weight [N, K] bf16 -> [ceil(N/32), ceil(K/2), 32, 2] for `dpbf16_linear`: per panel of 32
// columns, one row of (column, k-pair) per pair of K, zero-padded past N and K.
torch::Tensor dpbf16_pack_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "dpbf16_pack_weight: weight must be bfloat16 [N, K]");
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t panels = round_up(n, kDotCols) / kDotCols, pairs = (k + 1) / 2;
  auto packed = torch::zeros({panels, pairs, kDotCols, 2}, w.options());
  const c10::BFloat16* src = w.data_ptr<c10::BFloat16>();
  c10::BFloat16* dst = packed.data_ptr<c10::BFloat16>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t col = 0; col < kDotCols && p * kDotCols + col < n; ++col) {
        const c10::BFloat16* row = src + (p * kDotCols + col) * k;
        c10::BFloat16* d = dst + p * pairs * kDotCols * 2 + col * 2;
        for (int64_t j = 0; j < k; ++j) d[(j / 2) * kDotCols * 2 + j % 2] = row[j];
      }
  });
  return packed;
}

// x [M, K] bf16 (rows contiguous) @ weight.T (+ bias) -> [M, N] bf16, float32 accumulation
// rounded once, over `dpbf16_pack_weight`'s panels (see `dot_pass`). The rows are split into
// passes of near-equal size (64 rows: 11, 11, 11, 11, 10, 10, not five of 12 and one of 4).
torch::Tensor dpbf16_linear(torch::Tensor x, torch::Tensor packed, int64_t n,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(kHasDotBf16, "dpbf16_linear: this CPU or build has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "dpbf16_linear: x must be bfloat16 [M, K] with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.size(2) == kDotCols && packed.size(3) == 2,
              "dpbf16_linear: packed must come from dpbf16_pack_weight");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK((k + 1) / 2 == pairs && n > 0 && round_up(n, kDotCols) == panels * kDotCols,
              "dpbf16_linear: x's K or N does not match the packed weight");
  const c10::BFloat16* bias_p = linear_bias(bias, n, "dpbf16_linear");
  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
#if defined(__AVX512BF16__)
  const c10::BFloat16* a = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* b_p = packed.data_ptr<c10::BFloat16>();
  c10::BFloat16* o_p = out.data_ptr<c10::BFloat16>();
  const int64_t lda = x.stride(0), panel_elems = pairs * 2 * kDotCols;
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
        if (p + 1 < p1)
          next = reinterpret_cast<const char*>(b + panel_elems) + pass * lines * 64;
        const int64_t rows = m / passes + (pass < m % passes);
        kDotPasses[rows](a + r0 * lda, lda, k, b, next, lines, bias0, bias1, k0, k1,
                         o_p + r0 * n + c0, n);
        r0 += rows;
      }
    }
  });
#endif
  return out;
}
"""

#: what the extension exports
FUNCTIONS = (
    "paged_decode",
    "paged_prefill",
    "write_kv",
    "add_rms_norm_",
    "rope_",
    "argmax_rows",
    "silu_mul",
    "sample_rows",
    "amx_available",
    "amx_pack_weight",
    "amx_linear",
    "dpbf16_available",
    "dpbf16_pack_weight",
    "dpbf16_linear",
)

#: dtypes ``paged_decode``, ``write_kv``, the glue ops and ``argmax_rows`` handle
DTYPES = (torch.float32, torch.bfloat16)

#: head dims ``paged_decode`` is instantiated for (whole 16-float vectors, registers per row)
HEAD_DIMS = (16, 32, 64, 128, 256)


def supports_head_dim(head_dim: int) -> bool:
    """True for the head dims the decode kernel is compiled for (`HEAD_DIMS`)."""
    return head_dim in HEAD_DIMS


def heads_contiguous(x: torch.Tensor) -> bool:
    """[T, H, D] whose heads are back-to-back rows of D, the layout the kernels read (a slice
    of fused QKV rows qualifies)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _build_key() -> str:
    """Source and CPU flags: a cache shared between machines never runs another CPU's build."""
    digest = hashlib.sha256(_SOURCE.encode())
    try:
        with open("/proc/cpuinfo") as f:
            digest.update(next((ln for ln in f if ln.startswith("flags")), "").encode())
    except OSError:
        digest.update(os.uname().machine.encode())
    return digest.hexdigest()[:12]


@functools.cache
def load() -> Any | None:
    """The compiled extension, or None (no compiler, switched off, or the build failed)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        log.info("CPU kernels switched off (%s=0): torch path", ENV_SWITCH)
        return None
    try:
        from torch.utils import cpp_extension

        return cpp_extension.load_inline(
            name=f"mstar_cpu_kernels_{_build_key()}",
            cpp_sources=_SOURCE,
            functions=list(FUNCTIONS),
            extra_cflags=["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as exc:  # no compiler or ninja: the torch path still serves
        log.warning("CPU kernels unavailable (%s); using the torch path", exc)
        return None

// Vector helpers every CPU kernel shares: W-float vectors (GCC/Clang vector extensions), loads
// and stores of float32 and bf16, bf16 rounding, lane sums, exp. Compiled once per ISA level
// (see build.py): the same source becomes AVX-512, AVX2 or SSE code.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // AVX512-BF16 and AMX intrinsics, each used only where compiled for
#endif

namespace mstar_cpu {

// GCC/Clang vector extensions of W floats, W fixed per level: one register's worth where the
// level has wide registers (16 lanes in a zmm on AVX-512, 8 in a ymm on AVX2), 8 lanes (two
// xmm) on the x86-64 baseline. Vectors wider than the level's registers have nowhere to live:
// GCC moves them through memory (the 16-lane build ran AVX2's prompt attention 3-4x slower).
#if defined(__AVX512F__)
#define MSTAR_LANES 16
#else
#define MSTAR_LANES 8
#endif
constexpr int64_t W = MSTAR_LANES;
// How many W-float vectors the register file holds (32 zmm, 16 ymm, 16 xmm as 8 pairs): the
// kernels size their register-resident accumulators to half of it.
#if defined(__AVX512F__)
constexpr int kRegVecs = 32;
#elif defined(__AVX__)
constexpr int kRegVecs = 16;
#else
constexpr int kRegVecs = 8;
#endif
constexpr int kAccVecs = kRegVecs / 2;
typedef float vf __attribute__((vector_size(4 * MSTAR_LANES)));
typedef int32_t vi __attribute__((vector_size(4 * MSTAR_LANES)));
typedef uint16_t vh __attribute__((vector_size(2 * MSTAR_LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * MSTAR_LANES)));
typedef float f8v __attribute__((vector_size(32)));
typedef float f4v __attribute__((vector_size(16)));
#if defined(__AVX512BF16__)
constexpr bool kHasDotBf16 = true;
#else
constexpr bool kHasDotBf16 = false;
#endif

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
#if MSTAR_LANES == 8 && defined(__AVX2__)
// One VPMOVZXWD: GCC spells the generic widening below as two half conversions and an insert.
inline vf load(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
}
#else
inline vf load(const c10::BFloat16* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu w = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
#endif
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// Rounding float lanes to T's precision, as torch rounds each op's float result: identity for
// float, round-to-nearest-even to bf16 (NaN -> bf16 NaN) for BFloat16, as c10::BFloat16 does.
template <typename T>
inline vf narrow(vf v);
template <>
inline vf narrow<float>(vf v) {
  return v;
}
#if defined(__AVX512BF16__)
// VCVTNEPS2BF16 rounds to nearest even in one instruction; unlike c10::BFloat16 it flushes
// denormals to zero and keeps a NaN's sign and payload bits (still a NaN).
template <>
inline vf narrow<c10::BFloat16>(vf v) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh((__m512)v);
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
}
inline void store(c10::BFloat16* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh((__m512)v));
}
#else
template <>
inline vf narrow<c10::BFloat16>(vf v) {
  vu u;
  std::memcpy(&u, &v, sizeof u);
  vu r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const vu nan = reinterpret_cast<vu>(v != v);
  r = (r & ~nan) | (nan & 0x7fc00000u);
  vf out;
  std::memcpy(&out, &r, sizeof out);
  return out;
}
// Stores W lanes as bf16, rounding them first (a no-op on lanes `narrow` already rounded).
inline void store(c10::BFloat16* p, vf v) {
  vu u;
  const vf r = narrow<c10::BFloat16>(v);
  std::memcpy(&u, &r, sizeof u);
  const vh h = __builtin_convertvector(u >> 16, vh);
  std::memcpy(p, &h, sizeof h);
}
#endif
template <typename T>
inline float narrow1(float v) {
  return static_cast<float>(static_cast<T>(v));
}

inline float hsum(vf v) {
#if MSTAR_LANES == 16
  const f8v a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const f8v a = v;
#endif
  f4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Lane indices 0 .. W - 1 (masks of a vector's first lanes).
inline vi lane_index() {
#if MSTAR_LANES == 16
  return vi{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
  return vi{0, 1, 2, 3, 4, 5, 6, 7};
#endif
}

// Lane sums of W vectors at once (a transpose-and-add tree: W - 1 adds and 2(W - 1) shuffles,
// against W separate horizontal sums). Lane t of the result is the sum of a[kBrev[t]]'s lanes
// (kBrev: t's bits reversed), so a caller that fills slot s with token kBrev[s] gets token t in
// lane t. Each step adds a's and b's blocks of `B` lanes pairwise: the even blocks of both
// interleaved, plus the odd ones.
#if MSTAR_LANES == 16
constexpr int kBrev[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
inline vf pair8(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                 31);
}
inline vf pair4(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}
inline vf pair2(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
inline vf pair1(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
inline vf reduce_lanes(const vf* a) {
  vf x[8], y[4];
  for (int i = 0; i < 8; ++i) x[i] = pair8(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 4; ++i) y[i] = pair4(x[2 * i], x[2 * i + 1]);
  return pair1(pair2(y[0], y[1]), pair2(y[2], y[3]));
}
#else
constexpr int kBrev[8] = {0, 4, 2, 6, 1, 5, 3, 7};
inline vf pair4(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}
inline vf pair2(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) +
         __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
}
inline vf pair1(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) +
         __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
}
inline vf reduce_lanes(const vf* a) {
  vf x[4];
  for (int i = 0; i < 4; ++i) x[i] = pair4(a[2 * i], a[2 * i + 1]);
  return pair1(pair2(x[0], x[1]), pair2(x[2], x[3]));
}
#endif

// exp of W floats: x = n ln2 + r with |r| <= ln2 / 2 (n rounded to nearest by the 1.5 * 2^23
// trick), a degree-7 Taylor polynomial for e^r (error < 1e-8 relative), 2^n from the exponent
// bits. x is clamped to [-87, 88] (results ~1e-38 .. ~1.6e38): the softmax zeroes its padded
// lanes itself.
inline vf vexp(vf x) {
  const vf lo = vf{} - 87.f, hi = vf{} + 88.f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf big = vf{} + 12582912.f;
  const vf nf = (x * 1.44269504088896341f + big) - big;
  const vi n = __builtin_convertvector(nf, vi);
  const vf r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;
  vf p = r * (1.f / 5040) + (1.f / 720);
  p = p * r + (1.f / 120);
  p = p * r + (1.f / 24);
  p = p * r + (1.f / 6);
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Keeps a product in its own rounding: the compiler may not contract it into an FMA. On the
// baseline a vector spans two xmm registers, so the barrier takes it in halves.
template <typename V>
inline V rounded(V v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__AVX__) && defined(__x86_64__)
  static_assert(sizeof(V) <= 32);
  asm("" : "+x"(v));
#elif defined(__x86_64__)
  if constexpr (sizeof(V) > 16) {
    f4v q[sizeof(V) / 16];
    std::memcpy(q, &v, sizeof v);
    for (auto& part : q) asm("" : "+x"(part));
    std::memcpy(&v, q, sizeof v);
  } else {
    asm("" : "+x"(v));
  }
#else
  volatile V keep = v;  // elsewhere a memory round trip is the portable barrier
  v = keep;
#endif
  return v;
}

// Keeps a vector's loads alive (the compiler may not drop them as unused): `touch_rows`.
inline void keep_alive(const vi& v) {
#if defined(__x86_64__)
  asm volatile("" : : "m"(v));
#else
  volatile int32_t sink = v[0];
  (void)sink;
#endif
}


// The GEMMs' masked bf16 loads (AMX and VDPBF16PS stores, biases).
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

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace mstar_cpu

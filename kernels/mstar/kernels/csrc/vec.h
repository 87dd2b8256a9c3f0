// Vector helpers every CPU kernel shares: 16-float vectors (GCC/Clang vector extensions), loads
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

// GCC/Clang vector extensions: 16 floats, lowered to whatever the level's -march offers (one
// zmm with AVX-512, two ymm with AVX2, four xmm on the x86-64 baseline).
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

// Keeps a product in its own rounding: the compiler may not contract it into an FMA.
// Where no register holds a whole 64-byte vector (AVX2, SSE), the barrier takes it in halves
// or quarters: a register operand of the vector's full size has no register to live in there.
template <typename V>
inline V rounded(V v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__AVX__) && defined(__x86_64__)
  static_assert(sizeof(V) % 32 == 0 || sizeof(V) <= 32);
  if constexpr (sizeof(V) == 64) {
    f8v h[2];
    std::memcpy(h, &v, sizeof v);
    asm("" : "+x"(h[0]), "+x"(h[1]));
    std::memcpy(&v, h, sizeof v);
  } else {
    asm("" : "+x"(v));
  }
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
inline void keep_alive(const i16v& v) {
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

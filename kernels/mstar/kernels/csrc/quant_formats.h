// The GGUF block layouts (ggml's) decoded in plain C++: every level's dequantization and the
// x86-64 baseline's GEMM (no SSSE3 there), and the K-quants' packed 6-bit scales for the SIMD
// kernels too. A block decodes into groups of 32 values, each w[e] = s[e / 16] * q[e] +
// m[e / 16], q small integers (signed only for Q8_0): the form every kernel multiplies.
// Included by quant_gemm.cpp only.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "quant.h"

namespace mstar_cpu {
namespace {

constexpr int64_t kGroup = 32;  // values per group (one activation block)

// IEEE half at p (unaligned) as float.
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// The 8 six-bit scales and mins of a Q4_K / Q5_K super-block (12 bytes at s).
inline void k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

struct Group {
  int8_t q[kGroup];
  float s[2];  // scale of values 0-15, 16-31
  float m[2];  // offset of values 0-15, 16-31
};

inline void set_scale(Group& g, float s, float m) {
  g.s[0] = g.s[1] = s;
  g.m[0] = g.m[1] = m;
}

// One block of `type` at b -> its groups (1 for the 32-value types, 8 for the K-quants).
inline int decode_block(int64_t type, const uint8_t* b, Group* g) {
  switch (type) {
    case kQ8_0:
      std::memcpy(g->q, b + 2, kGroup);
      set_scale(*g, half_at(b), 0.0f);
      return 1;
    case kQ4_0:
    case kQ4_1: {
      const float d = half_at(b);
      const uint8_t* qs = b + (type == kQ4_0 ? 2 : 4);
      const int sub = type == kQ4_0 ? 8 : 0;
      for (int l = 0; l < 16; ++l) g->q[l] = static_cast<int8_t>((qs[l] & 0xF) - sub);
      for (int l = 0; l < 16; ++l) g->q[l + 16] = static_cast<int8_t>((qs[l] >> 4) - sub);
      set_scale(*g, d, type == kQ4_0 ? 0.0f : half_at(b + 2));
      return 1;
    }
    case kQ5_0:
    case kQ5_1: {  // d (, m), 32 fifth bits, nibbles
      const float d = half_at(b);
      const uint8_t* qh = b + (type == kQ5_0 ? 2 : 4);
      const uint8_t* qs = qh + 4;
      const int sub = type == kQ5_0 ? 16 : 0;
      for (int l = 0; l < 32; ++l) {
        const int nib = l < 16 ? qs[l] & 0xF : qs[l - 16] >> 4;
        g->q[l] = static_cast<int8_t>((nib | (((qh[l / 8] >> (l % 8)) & 1) << 4)) - sub);
      }
      set_scale(*g, d, type == kQ5_0 ? 0.0f : half_at(b + 2));
      return 1;
    }
    case kQ4_K:
    case kQ5_K: {
      const float d = half_at(b), dmin = half_at(b + 2);
      uint8_t sc[8], mn[8];
      k_scales(b + 4, sc, mn);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (type == kQ4_K ? 16 : 48);
      for (int i = 0; i < 8; ++i) {
        for (int l = 0; l < kGroup; ++l) {
          int q = (qs[32 * (i / 2) + l] >> (4 * (i % 2))) & 0xF;
          if (type == kQ5_K) q |= ((qh[l] >> i) & 1) << 4;
          g[i].q[l] = static_cast<int8_t>(q);
        }
        set_scale(g[i], d * sc[i], -dmin * mn[i]);
      }
      return 8;
    }
    case kQ6_K: {
      const float d = half_at(b + 208);
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 4; ++i) {
          Group& gi = g[4 * h + i];
          const uint8_t* ql = b + 64 * h + 32 * (i & 1);
          const uint8_t* qh = b + 128 + 32 * h;
          for (int l = 0; l < kGroup; ++l)
            gi.q[l] = static_cast<int8_t>(
                (((ql[l] >> (4 * (i >> 1))) & 0xF) | (((qh[l] >> (2 * i)) & 3) << 4)) - 32);
          for (int half = 0; half < 2; ++half) {
            gi.s[half] = d * sc[8 * h + 2 * i + half];
            gi.m[half] = 0.0f;
          }
        }
      return 8;
    }
    default:
      return 0;
  }
}

}  // namespace
}  // namespace mstar_cpu

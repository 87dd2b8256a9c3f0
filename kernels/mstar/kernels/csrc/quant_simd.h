// The AVX2 kernels of quant_gemm.cpp, included there twice: once as they are (x86-64-v3 and
// up), once under `#pragma GCC target("avx512vnni")` with MSTAR_QUANT_VNNI set (the AVX-512
// levels, run where the CPU has VNNI): the same code with each group's integer dot one
// VPDPBUSD instead of VPMADDUBSW + VPMADDWD. Each copy lives in its own namespace inside an
// anonymous one, so no function of one copy can stand in for the other's at link time.
// No include guard, no includes: quant_gemm.cpp includes what this needs first.

// 32 unsigned weights (0-63) . 32 signed activations -> 8 int32 sums of 4 neighbours each.
inline __m256i dot_u(__m256i q, __m256i x) {
#if MSTAR_QUANT_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
#endif
}
// The same for signed weights (Q8_0): |w| . x * sign(w), unsigned times signed again.
inline __m256i dot_s(__m256i q, __m256i x) {
  return dot_u(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q));
}

inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i high4(__m256i v) { return low4(_mm256_srli_epi16(v, 4)); }
// 16 bytes of nibble pairs -> 32 values: the low nibbles first, then the high ones.
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
  return _mm256_set_m128i(hi, lo);
}
// 16 where bit `bit` of each byte of qh is set, else 0 (Q5_K's fifth bit).
inline __m256i bit16(__m256i qh, int bit) {
  const __m256i m = _mm256_set1_epi8(static_cast<char>(1 << bit));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, m), m), _mm256_set1_epi8(16));
}

// Per type: the block's bytes, its groups, and `visit`, which calls f(group, q, s0, s1) for
// each group of 32 values w[e] = s[e / 16] * q[e] + m[e / 16] (the form of Group), and adds
// the offsets m times the activation sums by f.min1 (one group's m) or f.min8 (8 groups' or
// half-groups' m in one vector). The K-quants call fa for their even groups and fb for the odd
// ones (two accumulator chains: one alone waits an FMA's latency per group); the 32-value types
// call fa, and the caller alternates the two per block. kOffset: the offset that is a constant
// times the scale (Q4_0: -8 s, Q5_0: -16 s, Q6_K: -32 s), which dequantization subtracts from q instead, as
// ggml does (s * (q - 32) and s * q - 32 s round differently).
struct Q8_0 {
  static constexpr int64_t kBytes = 34, kGroups = 1, kOffset = 0;
  static constexpr bool kSigned = true, kTwo = false;
  template <class F>
  static void visit(const uint8_t* b, int64_t g, F& f, F&) {
    const float d = half_at(b);
    f(g, load32(b + 2), d, d);
  }
};
struct Q4_0 {
  static constexpr int64_t kBytes = 18, kGroups = 1, kOffset = 8;
  static constexpr bool kSigned = false, kTwo = false;
  template <class F>
  static void visit(const uint8_t* b, int64_t g, F& f, F&) {
    const float d = half_at(b);
    f(g, nibbles16(b + 2), d, d);
    f.min1(g, -8.0f * d);
  }
};
struct Q4_1 {
  static constexpr int64_t kBytes = 20, kGroups = 1, kOffset = 0;
  static constexpr bool kSigned = false, kTwo = false;
  template <class F>
  static void visit(const uint8_t* b, int64_t g, F& f, F&) {
    const float d = half_at(b), m = half_at(b + 2);
    f(g, nibbles16(b + 4), d, d);
    f.min1(g, m);
  }
};
// 16 where bit j of the 32 bits at p is set, else 0, for each byte j (Q5_0 / Q5_1's fifth bits).
inline __m256i bits32(const uint8_t* p) {
  uint32_t h;
  std::memcpy(&h, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(h)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                       3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                          _mm256_set1_epi8(16));
}
template <bool kOne>
struct Q5 {  // Q5_0: w = d (q - 16); Q5_1: w = d q + m
  static constexpr int64_t kBytes = kOne ? 24 : 22, kGroups = 1, kOffset = kOne ? 0 : 16;
  static constexpr bool kSigned = false, kTwo = false;
  template <class F>
  static void visit(const uint8_t* b, int64_t g, F& f, F&) {
    const float d = half_at(b);
    const uint8_t* qh = b + (kOne ? 4 : 2);
    f(g, _mm256_or_si256(nibbles16(qh + 4), bits32(qh)), d, d);
    f.min1(g, kOne ? half_at(b + 2) : -16.0f * d);
  }
};
template <bool kFive>
struct QK45 {  // Q4_K, and Q5_K with its fifth bits
  static constexpr int64_t kBytes = kFive ? 176 : 144, kGroups = 8, kOffset = 0;
  static constexpr bool kSigned = false, kTwo = false;
  template <class F>
  static void visit(const uint8_t* b, int64_t g, F& f, F& fb) {
    const float d = half_at(b), dmin = half_at(b + 2);
    uint8_t sc[8], mn[8];
    k_scales(b + 4, sc, mn);
    const __m128i mn8 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
    f.min8(&QuantAct::dsum, g, _mm256_mul_ps(_mm256_set1_ps(-dmin),
                                             _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(mn8))));
    const uint8_t* qs = b + (kFive ? 48 : 16);
    __m256i qh = _mm256_setzero_si256();
    if constexpr (kFive) qh = load32(b + 16);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i v = load32(qs + 32 * j);
      __m256i lo = low4(v), hi = high4(v);
      if constexpr (kFive) {
        lo = _mm256_or_si256(lo, bit16(qh, 2 * j));
        hi = _mm256_or_si256(hi, bit16(qh, 2 * j + 1));
      }
      const float s0 = d * sc[2 * j], s1 = d * sc[2 * j + 1];
      f(g + 2 * j, lo, s0, s0);
      fb(g + 2 * j + 1, hi, s1, s1);
    }
  }
};
struct Q6_K {
  static constexpr int64_t kBytes = 210, kGroups = 8, kOffset = 32;
  static constexpr bool kSigned = false, kTwo = true;
  template <class F>
  static void visit(const uint8_t* b, int64_t g, F& f, F& fb) {
    const float d = half_at(b + 208);
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
    const __m256i m3 = _mm256_set1_epi8(3), m30 = _mm256_set1_epi8(0x30);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8 * h));
      f.min8(&QuantAct::ds, 2 * g + 8 * h,
             _mm256_mul_ps(_mm256_set1_ps(-32.0f * d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8))));
      const __m256i ql0 = load32(b + 64 * h), ql1 = load32(b + 64 * h + 32);
      const __m256i qh = load32(b + 128 + 32 * h);
      const __m256i q[4] = {
          _mm256_or_si256(low4(ql0), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4)),
          _mm256_or_si256(low4(ql1), _mm256_slli_epi16(
                                         _mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4)),
          _mm256_or_si256(high4(ql0), _mm256_and_si256(qh, m30)),
          _mm256_or_si256(high4(ql1), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30))};
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const float s0 = d * sc[8 * h + 2 * i], s1 = d * sc[8 * h + 2 * i + 1];
        (i % 2 ? fb : f)(g + 4 * h + i, q[i], s0, s1);
      }
    }
  }
};

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Accumulates groups of one weight row times R activation rows: one of a kernel's two chains.
template <class Ty, int R>
struct Chain {
  const QuantAct* a;
  __m256 acc[R];
  __m256 macc8[R];  // offsets by min8
  float macc[R];  // offsets by min1

  explicit Chain(const QuantAct* rows) : a(rows) {
    for (int r = 0; r < R; ++r) {
      acc[r] = macc8[r] = _mm256_setzero_ps();
      macc[r] = 0.0f;
    }
  }
  void min1(int64_t g, float m) {
    for (int r = 0; r < R; ++r) macc[r] += m * a[r].dsum[g];
  }
  // m [8] times the activation rows' `sums` (dsum or ds) from index i
  void min8(const float* QuantAct::*sums, int64_t i, __m256 m) {
    for (int r = 0; r < R; ++r) macc8[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(a[r].*sums + i), macc8[r]);
  }
  void operator()(int64_t g, __m256i q, float s0, float s1) {
    const __m256 s = Ty::kTwo ? _mm256_setr_m128(_mm_set1_ps(s0), _mm_set1_ps(s1))
                              : _mm256_set1_ps(s0);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256i x = load32(reinterpret_cast<const uint8_t*>(a[r].q + g * kGroup));
      const __m256i p = Ty::kSigned ? dot_s(q, x) : dot_u(q, x);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(s, _mm256_set1_ps(a[r].d[g])),
                               acc[r]);
    }
  }
};

// R activation rows . one weight row of `blocks` blocks -> res[R] (float32).
template <class Ty, int R>
inline void dot_rows(const uint8_t* w, int64_t blocks, const QuantAct* a, float* res) {
  Chain<Ty, R> even(a), odd(a);
  int64_t b = 0;
  if constexpr (Ty::kGroups == 1) {
    for (; b + 2 <= blocks; b += 2) {
      Ty::visit(w + b * Ty::kBytes, b, even, odd);
      Ty::visit(w + (b + 1) * Ty::kBytes, b + 1, odd, even);
    }
  }
  for (; b < blocks; ++b) Ty::visit(w + b * Ty::kBytes, b * Ty::kGroups, even, odd);
  for (int r = 0; r < R; ++r)
    res[r] = hsum8(_mm256_add_ps(_mm256_add_ps(even.acc[r], odd.acc[r]), even.macc8[r])) +
             even.macc[r] + odd.macc[r];
}

template <class Ty>
void rows_of(const uint8_t* w, int64_t blocks, const QuantAct* a, int rows, float* res) {
  switch (rows) {
    case 1: return dot_rows<Ty, 1>(w, blocks, a, res);
    case 2: return dot_rows<Ty, 2>(w, blocks, a, res);
    case 3: return dot_rows<Ty, 3>(w, blocks, a, res);
    default: return dot_rows<Ty, 4>(w, blocks, a, res);
  }
}

// The kernel for `type`: (w row, blocks, activation rows, up to kQuantRows of them, res).
inline RowsKernel rows_kernel(int64_t type) {
  switch (type) {
    case kQ8_0: return rows_of<Q8_0>;
    case kQ4_0: return rows_of<Q4_0>;
    case kQ4_1: return rows_of<Q4_1>;
    case kQ5_0: return rows_of<Q5<false>>;
    case kQ5_1: return rows_of<Q5<true>>;
    case kQ4_K: return rows_of<QK45<false>>;
    case kQ5_K: return rows_of<QK45<true>>;
    case kQ6_K: return rows_of<Q6_K>;
    default: return nullptr;
  }
}

// Dequantization by the same unpacking: each group's s * (q - kOffset) into a float row, the
// other offsets (min1 / min8) per half-group, added in a second pass, so each value is ggml's
// two float operations (s * q, + m) and rounds as its dequantization does.
template <class Ty>
struct DequantSink {
  float* row;  // [K]
  float* half_m;  // [K / 16]
  bool offsets = false;

  void operator()(int64_t g, __m256i q, float s0, float s1) {
    if constexpr (Ty::kOffset != 0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(Ty::kOffset));
    const __m128i half[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    for (int i = 0; i < 4; ++i) {
      const __m128i part = i % 2 ? _mm_unpackhi_epi64(half[i / 2], half[i / 2]) : half[i / 2];
      const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part));
      _mm256_storeu_ps(row + g * kGroup + 8 * i, _mm256_mul_ps(v, _mm256_set1_ps(i < 2 ? s0 : s1)));
    }
  }
  void min1(int64_t g, float m) {
    if constexpr (Ty::kOffset != 0) return;
    half_m[2 * g] = half_m[2 * g + 1] = m;
    offsets = true;
  }
  void min8(const float* QuantAct::*sums, int64_t i, __m256 m) {
    if constexpr (Ty::kOffset != 0) return;
    float v[8];
    _mm256_storeu_ps(v, m);
    for (int j = 0; j < 8; ++j) {
      if (sums == &QuantAct::ds) {
        half_m[i + j] = v[j];
      } else {
        half_m[2 * (i + j)] = half_m[2 * (i + j) + 1] = v[j];
      }
    }
    offsets = true;
  }
};

template <class Ty, typename T>
void dequant_row(const uint8_t* w, int64_t k, float* row, float* half_m, T* out) {
  DequantSink<Ty> sink{row, half_m};
  for (int64_t b = 0; b < k / (kGroup * Ty::kGroups); ++b)
    Ty::visit(w + b * Ty::kBytes, b * Ty::kGroups, sink, sink);
  for (int64_t h = 0; h < k / 16; ++h) {
    const float m = sink.offsets ? half_m[h] : 0.0f;
    for (int64_t e = 16 * h; e < 16 * h + 16; ++e)
      out[e] = static_cast<T>(sink.offsets ? row[e] + m : row[e]);
  }
}

template <typename T>
using DequantRow = void (*)(const uint8_t*, int64_t, float*, float*, T*);

template <typename T>
DequantRow<T> dequant_kernel(int64_t type) {
  switch (type) {
    case kQ8_0: return dequant_row<Q8_0, T>;
    case kQ4_0: return dequant_row<Q4_0, T>;
    case kQ4_1: return dequant_row<Q4_1, T>;
    case kQ5_0: return dequant_row<Q5<false>, T>;
    case kQ5_1: return dequant_row<Q5<true>, T>;
    case kQ4_K: return dequant_row<QK45<false>, T>;
    case kQ5_K: return dequant_row<QK45<true>, T>;
    case kQ6_K: return dequant_row<Q6_K, T>;
    default: return nullptr;
  }
}

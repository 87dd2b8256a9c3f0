// The batched kernels of quant_gemm.cpp (8 or more activation rows), included there twice
// after quant_simd.h, as it is: once for AVX2 (ymm: 8 weight rows x 4 activation rows per
// call), once with MSTAR_QUANT_VNNI (zmm: 16 x 8, VPDPBUSD). No include guard, no includes.
//
// As llama.cpp's repacked GEMMs do: a tile of kTileCols weight rows is unpacked once per call
// (`unpack_row`, then `pack_tile`: each 4 values of K hold one dword per weight row, so a
// vector is the same 4 values of every row of the tile), and each activation row's 4 bytes,
// broadcast, dot it in one instruction (VPDPBUSD on a zmm of 16 weight rows; VPMADDUBSW +
// VPMADDWD on a ymm of 8). A group's 32 values sum in int32 lanes, one per weight row, then
// one conversion and one FMA serve the tile's rows: the 4-row kernel above pays those per
// weight row and activation row, and unpacks each block again for every 4 activation rows.
// Signed weights: AVX2 moves the sign onto x (VPSIGNB); AVX-512 has no VPSIGNB, so there
// w + 128 is dotted and 128 * sum(x) taken off in int32 (`xsum`, per group / half-group).
#if MSTAR_QUANT_VNNI
constexpr int kTileCols = 16, kTileRows = 8;
using TileInt = __m512i;
using TileFloat = __m512;
inline TileInt t_zero() { return _mm512_setzero_si512(); }
inline TileFloat t_zerof() { return _mm512_setzero_ps(); }
inline TileInt t_bcast(int32_t v) { return _mm512_set1_epi32(v); }
inline TileInt t_load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline TileInt t_dot(TileInt acc, TileInt w, TileInt x) { return _mm512_dpbusd_epi32(acc, w, x); }
inline TileInt t_sub(TileInt a, TileInt b) { return _mm512_sub_epi32(a, b); }
inline TileFloat t_loadf(const float* p) { return _mm512_loadu_ps(p); }
inline TileFloat t_set1(float v) { return _mm512_set1_ps(v); }
inline TileFloat t_cvt(TileInt v) { return _mm512_cvtepi32_ps(v); }
inline TileFloat t_mul(TileFloat a, TileFloat b) { return _mm512_mul_ps(a, b); }
inline TileFloat t_fma(TileFloat a, TileFloat b, TileFloat c) { return _mm512_fmadd_ps(a, b, c); }
inline void t_store(float* p, TileFloat v) { _mm512_storeu_ps(p, v); }
#else
constexpr int kTileCols = 8, kTileRows = 4;
using TileInt = __m256i;
using TileFloat = __m256;
inline TileInt t_zero() { return _mm256_setzero_si256(); }
inline TileFloat t_zerof() { return _mm256_setzero_ps(); }
inline TileInt t_bcast(int32_t v) { return _mm256_set1_epi32(v); }
inline TileInt t_load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline TileInt t_dot(TileInt acc, TileInt w, TileInt x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
inline TileInt t_sub(TileInt a, TileInt b) { return _mm256_sub_epi32(a, b); }
inline TileFloat t_loadf(const float* p) { return _mm256_loadu_ps(p); }
inline TileFloat t_set1(float v) { return _mm256_set1_ps(v); }
inline TileFloat t_cvt(TileInt v) { return _mm256_cvtepi32_ps(v); }
inline TileFloat t_mul(TileFloat a, TileFloat b) { return _mm256_mul_ps(a, b); }
inline TileFloat t_fma(TileFloat a, TileFloat b, TileFloat c) { return _mm256_fmadd_ps(a, b, c); }
inline void t_store(float* p, TileFloat v) { _mm256_storeu_ps(p, v); }
#endif

// A weight row's blocks -> u [K] (its unpacked bytes, row-major: `pack_tile` interleaves a
// tile's rows after) and its column of the tile's s and m (offset by the row, `cols` apart):
// signed where the type's offset is a constant times its scale (Q8_0; Q4_0,
// Q5_0, Q6_K with it subtracted, as dequantization does; + 128 on AVX-512), else unsigned with
// the group's offset m (Q4_1, Q5_1, Q4_K, Q5_K).
template <class Ty>
struct UnpackSink {
  static constexpr bool kSignedQ = Ty::kSigned || Ty::kOffset != 0;
  uint8_t* u;
  float* s;
  float* m;
  int64_t cols;

  void operator()(int64_t g, __m256i q, float s0, float s1) {
    if constexpr (Ty::kOffset != 0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(Ty::kOffset));
#if MSTAR_QUANT_VNNI
    if constexpr (kSignedQ) q = _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));
#endif
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(u + g * kGroup), q);
    s[2 * g * cols] = s0;
    s[(2 * g + 1) * cols] = s1;
  }
  void min1(int64_t g, float v) {
    if constexpr (!kSignedQ) m[g * cols] = v;
  }
  void min8(const float* QuantAct::*, int64_t i, __m256 v) {  // Q4_K / Q5_K only: per group
    if constexpr (!kSignedQ) {
      alignas(32) float f[8];
      _mm256_store_ps(f, v);
      for (int j = 0; j < 8; ++j) m[(i + j) * cols] = f[j];
    }
  }
};

template <class Ty>
void unpack_row(const uint8_t* w, int64_t blocks, uint8_t* u, float* s, float* m, int64_t cols) {
  UnpackSink<Ty> sink{u, s, m, cols};
  for (int64_t b = 0; b < blocks; ++b) Ty::visit(w + b * Ty::kBytes, b * Ty::kGroups, sink, sink);
}

// 8 rows of 8 dwords (a group's bytes of 8 weight rows, at rows[r]) -> 8 vectors of one dword
// per row, stored at out + c * stride (bytes): the 8 x 8 transpose of unpack / unpack / 128-bit
// permute steps.
inline void transpose8(const uint8_t* const* rows, uint8_t* out, int64_t stride) {
  __m256i a[8], t[8], u[8];
  for (int r = 0; r < 8; ++r) a[r] = load32(rows[r]);
  for (int r = 0; r < 8; r += 2) {
    t[r] = _mm256_unpacklo_epi32(a[r], a[r + 1]);  // c0 c1 | c4 c5 of rows r, r + 1
    t[r + 1] = _mm256_unpackhi_epi32(a[r], a[r + 1]);  // c2 c3 | c6 c7
  }
  for (int h = 0; h < 2; ++h)  // rows 4h .. 4h + 3
    for (int j = 0; j < 2; ++j) {
      u[4 * h + 2 * j] = _mm256_unpacklo_epi64(t[4 * h + j], t[4 * h + 2 + j]);  // c 2j | 2j + 4
      u[4 * h + 2 * j + 1] = _mm256_unpackhi_epi64(t[4 * h + j], t[4 * h + 2 + j]);  // 2j+1 | 2j+5
    }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c * stride),
                        _mm256_permute2x128_si256(u[c], u[4 + c], 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (c + 4) * stride),
                        _mm256_permute2x128_si256(u[c], u[4 + c], 0x31));
  }
}

// kTileCols row-major unpacked rows (u [kTileCols][K]) -> the tile's q [K / 4][kTileCols][4].
inline void pack_tile(const uint8_t* u, int64_t k, uint8_t* q) {
  for (int64_t g = 0; g < k / kGroup; ++g)
    for (int h = 0; h < kTileCols / 8; ++h) {
      const uint8_t* rows[8];
      for (int r = 0; r < 8; ++r) rows[r] = u + (8 * h + r) * k + g * kGroup;
      transpose8(rows, q + (g * 8 * kTileCols + 8 * h) * 4, kTileCols * 4);
    }
}

inline int32_t dword_at(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The tile (`WeightTile`: q [K / 4][kTileCols][4], s [K / 16][kTileCols], m [K / 32][kTileCols])
// . rows activation rows (`QuantAct`, with xsum [rows][3 * K / 32]: 128 times each group's,
// then each half-group's sum of q) -> res [rows][kTileCols]. Per group: 8 vectors of the tile,
// each dotted with every row's broadcast dword; then per row one conversion and FMA by the
// tile's scales times the row's d (two for Q6_K's half-group scales), and the offsets times
// the row's group sum.
template <bool kTwo, bool kSignedQ, int MR>
void tile_rows(const WeightTile& t, int64_t groups, const QuantAct* a, const int32_t* xsum,
               float* res) {
  TileFloat acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = t_zerof();
  for (int64_t g = 0; g < groups; ++g) {
    TileInt sum[MR][2];
    for (int r = 0; r < MR; ++r) sum[r][0] = sum[r][1] = t_zero();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const TileInt w = t_load(t.q + (g * 8 + c) * 4 * kTileCols);
#if !MSTAR_QUANT_VNNI
      const TileInt wa = kSignedQ ? _mm256_abs_epi8(w) : w;
#endif
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        TileInt x = t_bcast(dword_at(a[r].q + g * kGroup + 4 * c));
        const int h = kTwo ? c / 4 : 0;
#if MSTAR_QUANT_VNNI
        sum[r][h] = t_dot(sum[r][h], w, x);
#else
        if constexpr (kSignedQ) x = _mm256_sign_epi8(x, w);
        sum[r][h] = t_dot(sum[r][h], wa, x);
#endif
      }
    }
    const TileFloat s0 = t_loadf(t.s + 2 * g * kTileCols), s1 = t_loadf(t.s + (2 * g + 1) * kTileCols);
    const TileFloat mg = kSignedQ ? t_zerof() : t_loadf(t.m + g * kTileCols);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const TileFloat d = t_set1(a[r].d[g]);
      const int32_t* xs = xsum + r * 3 * groups;
      for (int h = 0; h < (kTwo ? 2 : 1); ++h) {
        TileInt v = sum[r][h];
#if MSTAR_QUANT_VNNI
        if constexpr (kSignedQ) v = t_sub(v, t_bcast(kTwo ? xs[groups + 2 * g + h] : xs[g]));
#endif
        acc[r] = t_fma(t_cvt(v), t_mul(h ? s1 : s0, d), acc[r]);
      }
      if constexpr (!kSignedQ) acc[r] = t_fma(mg, t_set1(a[r].dsum[g]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) t_store(res + r * kTileCols, acc[r]);
}

template <class Ty>
struct TileOps {
  static constexpr bool kTwo = Ty::kTwo, kSignedQ = UnpackSink<Ty>::kSignedQ;
  static TileFns fns() {
    TileFns f;
    f.unpack = unpack_row<Ty>;
    f.pack = pack_tile;
    f.cols = kTileCols;
    f.rows = kTileRows;
    [&]<int... I>(std::integer_sequence<int, I...>) {
      ((f.kernels[I] = tile_rows<kTwo, kSignedQ, I + 1>), ...);
    }(std::make_integer_sequence<int, kTileRows>{});
    return f;
  }
};

inline TileFns tile_kernel(int64_t type) {
  switch (type) {
    case kQ8_0: return TileOps<Q8_0>::fns();
    case kQ4_0: return TileOps<Q4_0>::fns();
    case kQ4_1: return TileOps<Q4_1>::fns();
    case kQ5_0: return TileOps<Q5<false>>::fns();
    case kQ5_1: return TileOps<Q5<true>>::fns();
    case kQ4_K: return TileOps<QK45<false>>::fns();
    case kQ5_K: return TileOps<QK45<true>>::fns();
    case kQ6_K: return TileOps<Q6_K>::fns();
    default: return {};
  }
}

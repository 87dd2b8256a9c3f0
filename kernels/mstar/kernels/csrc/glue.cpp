// The fused glue around the GEMMs: RoPE, residual add + RMSNorm, RMSNorm of rows or heads,
// SiLU * up and GELU-tanh * up (float32 or bf16, rounded where torch's ops round).
#include "kernels.h"
#include "vec.h"

#include <type_traits>

namespace mstar_cpu {
namespace {

// x1 * c - x2 * s and x2 * c + x1 * s with every product and sum rounded on its own to T:
// bit-identical to the same expression in torch ops on T tensors (`store` rounds the sums).
template <typename T>
inline void rotate_vec(T* x1, T* x2, vf cv, vf sv) {
  const vf a = load(x1), b = load(x2);
  store(x1, narrow<T>(rounded(a * cv)) - narrow<T>(rounded(b * sv)));
  store(x2, narrow<T>(rounded(b * cv)) + narrow<T>(rounded(a * sv)));
}
template <typename T>
inline void rotate1(T* x1, T* x2, const T* c, const T* s) {
  const float a = *x1, b = *x2, cv = *c, sv = *s;
  *x1 = static_cast<T>(narrow1<T>(rounded(a * cv)) - narrow1<T>(rounded(b * sv)));
  *x2 = static_cast<T>(narrow1<T>(rounded(b * cv)) + narrow1<T>(rounded(a * sv)));
}

}  // namespace

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
        const vf cv = load(c + i), sv = load(s + i);
        for (int64_t h = 0; h < heads; ++h) {
          T* x1 = xt + h * 2 * half + i;
          rotate_vec(x1, x1 + half, cv, sv);
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

namespace {

// x = weight-scaled src * inv over n floats, rounded where torch's RMSNorm rounds: WT == T is
// HF's `weight * T(x * inv)` (two roundings to T); WT == float on bf16 rows is Gemma's `1 + w`
// held in float32, `T(x * inv * w)` (one rounding).
template <typename T, typename WT>
inline void scale_norm(T* dst, const T* src, const WT* w, int64_t n, float inv) {
  const int64_t vec_end = n / W * W;
  for (int64_t i = 0; i < vec_end; i += W) {
    if constexpr (std::is_same_v<T, WT>)
      store(dst + i, load(w + i) * narrow<T>(load(src + i) * inv));
    else
      store(dst + i, load(src + i) * inv * load(w + i));
  }
  for (int64_t i = vec_end; i < n; ++i) {
    const float v = static_cast<float>(src[i]) * inv;
    if constexpr (std::is_same_v<T, WT>)
      dst[i] = static_cast<T>(static_cast<float>(w[i]) * narrow1<T>(v));
    else
      dst[i] = static_cast<T>(v * static_cast<float>(w[i]));
  }
}

inline float inv_rms(float sum_squares, int64_t n, float eps) {
  return 1.f / std::sqrt(sum_squares / static_cast<float>(n) + eps);
}

}  // namespace

// residual += x, then x = weight * (residual * rsqrt(mean(residual^2) + eps)) in place, each
// step rounded to T where torch's ops round (HF's RMSNorm: sum of squares in float32; the
// weight's convention as `scale_norm` says).
template <typename T, typename WT>
void add_rms_norm_rows(T* xs, T* rs, const WT* w, int64_t rows, int64_t hidden, float eps) {
  const int64_t vec_end = hidden / W * W;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* xr = xs + t * hidden;
      T* rr = rs + t * hidden;
      vf acc = vf{};
      for (int64_t i = 0; i < vec_end; i += W) {
        const vf r = narrow<T>(load(rr + i) + load(xr + i));
        store(rr + i, r);
        acc += r * r;
      }
      float ss = hsum(acc);
      for (int64_t i = vec_end; i < hidden; ++i) {
        const float r = narrow1<T>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
        rr[i] = static_cast<T>(r);
        ss += r * r;
      }
      scale_norm(xr, rr, w, hidden, inv_rms(ss, hidden, eps));
    }
  });
}

// RMSNorm in place over rows of `dim` at x + t * row_stride + h * dim (t < rows, h < heads):
// q/k norm over a step's heads, Gemma's post-attention / post-feed-forward norms (heads 1).
template <typename T, typename WT>
void rms_norm_rows(T* x, int64_t rows, int64_t heads, int64_t row_stride, int64_t dim,
                   const WT* w, float eps) {
  const int64_t vec_end = dim / W * W;
  at::parallel_for(0, rows * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + (r / heads) * row_stride + (r % heads) * dim;
      vf acc = vf{};
      for (int64_t i = 0; i < vec_end; i += W) {
        const vf v = load(xr + i);
        acc += v * v;
      }
      float ss = hsum(acc);
      for (int64_t i = vec_end; i < dim; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      scale_norm(xr, xr, w, dim, inv_rms(ss, dim, eps));
    }
  });
}

// act(gate) * up for rows of [gate | up]: ``Act`` maps a gate vector (with `vexp`) and a gate
// scalar (with std::exp) by the same formula; its value is rounded to T before the product, as
// torch rounds F.act(gate).mul_(up).
template <typename T, typename Act>
void act_mul_rows(const T* xs, T* o, int64_t rows, int64_t inter, Act act) {
  const int64_t vec_end = inter / W * W;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = xs + t * 2 * inter;
      const T* up = gate + inter;
      T* dst = o + t * inter;
      for (int64_t i = 0; i < vec_end; i += W) {
        store(dst + i, narrow<T>(act(load(gate + i))) * load(up + i));
      }
      for (int64_t i = vec_end; i < inter; ++i) {
        const float g = gate[i];
        dst[i] = static_cast<T>(narrow1<T>(act(g)) * static_cast<float>(up[i]));
      }
    }
  });
}

// gelu_tanh(g) = 0.5 g (1 + tanh(y)), y = sqrt(2/pi) (g + 0.044715 g^3), computed as
// g / (1 + e^-2y): the same value, without 1 + tanh's cancellation where g is very negative.
struct GeluTanh {
  static constexpr float kA = 0.7978845608028654f, kB = 0.044715f;
  vf operator()(vf g) const { return g / (1.f + vexp(-2.f * (kA * (g + kB * g * g * g)))); }
  float operator()(float g) const {
    return g / (1.f + std::exp(-2.f * (kA * (g + kB * g * g * g))));
  }
};

// torch's silu: x / (1 + exp(-x)).
struct Silu {
  vf operator()(vf g) const { return g / (1.f + vexp(-g)); }
  float operator()(float g) const { return g / (1.f + std::exp(-g)); }
};

template <typename T>
void gelu_tanh_mul_rows(const T* xs, T* o, int64_t rows, int64_t inter) {
  act_mul_rows(xs, o, rows, inter, GeluTanh{});
}

template <typename T>
void silu_mul_rows(const T* xs, T* o, int64_t rows, int64_t inter) {
  act_mul_rows(xs, o, rows, inter, Silu{});
}

template void rotate_rows<float>(float*, int64_t, int64_t, int64_t, int64_t, const float*,
                                 const float*);
template void rotate_rows<bf16>(bf16*, int64_t, int64_t, int64_t, int64_t, const bf16*,
                                const bf16*);
template void add_rms_norm_rows<float, float>(float*, float*, const float*, int64_t, int64_t,
                                              float);
template void add_rms_norm_rows<bf16, bf16>(bf16*, bf16*, const bf16*, int64_t, int64_t, float);
template void add_rms_norm_rows<bf16, float>(bf16*, bf16*, const float*, int64_t, int64_t, float);
template void rms_norm_rows<float, float>(float*, int64_t, int64_t, int64_t, int64_t,
                                          const float*, float);
template void rms_norm_rows<bf16, bf16>(bf16*, int64_t, int64_t, int64_t, int64_t, const bf16*,
                                        float);
template void rms_norm_rows<bf16, float>(bf16*, int64_t, int64_t, int64_t, int64_t,
                                         const float*, float);
template void gelu_tanh_mul_rows<float>(const float*, float*, int64_t, int64_t);
template void gelu_tanh_mul_rows<bf16>(const bf16*, bf16*, int64_t, int64_t);
template void silu_mul_rows<float>(const float*, float*, int64_t, int64_t);
template void silu_mul_rows<bf16>(const bf16*, bf16*, int64_t, int64_t);

}  // namespace mstar_cpu

// The fused glue around the GEMMs: RoPE, residual add + RMSNorm, SiLU * up (float32 or bf16,
// rounded where torch's ops round).
#include "kernels.h"
#include "vec.h"

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

// residual += x, then x = weight * (residual * rsqrt(mean(residual^2) + eps)) in place, each
// step rounded to T where torch's ops round (HF's RMSNorm: sum of squares in float32).
template <typename T>
void add_rms_norm_rows(T* xs, T* rs, const T* w, int64_t rows, int64_t hidden, float eps) {
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
        const vf g = load(gate + i);
        store(dst + i, narrow<T>(g / (1.f + vexp(-g))) * load(up + i));
      }
      for (int64_t i = vec_end; i < inter; ++i) {
        const float g = gate[i];
        dst[i] = static_cast<T>(narrow1<T>(g / (1.f + std::exp(-g))) * static_cast<float>(up[i]));
      }
    }
  });
}

template void rotate_rows<float>(float*, int64_t, int64_t, int64_t, int64_t, const float*,
                                 const float*);
template void rotate_rows<bf16>(bf16*, int64_t, int64_t, int64_t, int64_t, const bf16*,
                                const bf16*);
template void add_rms_norm_rows<float>(float*, float*, const float*, int64_t, int64_t, float);
template void add_rms_norm_rows<bf16>(bf16*, bf16*, const bf16*, int64_t, int64_t, float);
template void silu_mul_rows<float>(const float*, float*, int64_t, int64_t);
template void silu_mul_rows<bf16>(const bf16*, bf16*, int64_t, int64_t);

}  // namespace mstar_cpu

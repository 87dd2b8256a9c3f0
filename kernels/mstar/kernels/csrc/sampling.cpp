// The sampler's per-row kernels: the greedy argmax and one inverse-CDF draw per row.
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace mstar_cpu {

// Argmax of each row of x [n, V] (float32 or bf16, row-contiguous): the first index of the row's
// maximum, or of its first NaN, as torch.argmax answers. bf16 widens exactly, so a bf16 row's
// answer is its float32 copy's: greedy sampling needs no float32 logits. One row per task, W
// lanes per compare.
template <typename T>
void argmax_rows_of(const T* xs, int64_t rows, int64_t vocab, int64_t stride, int64_t* o) {
  const int64_t vec_end = vocab / W * W;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xs + r * stride;
      vf best = vf{} - INFINITY;
      vi best_i = vi{}, idx = lane_index();
      vi nan = vi{};
      for (int64_t i = 0; i < vec_end; i += W, idx += static_cast<int32_t>(W)) {
        const vf v = load(row + i);
        const vi up = v > best;
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

template void argmax_rows_of<float>(const float*, int64_t, int64_t, int64_t, int64_t*);
template void argmax_rows_of<bf16>(const bf16*, int64_t, int64_t, int64_t, int64_t*);

// One draw per row of x [n, V] (float32, contiguous rows) from softmax(x), by inverse CDF: the
// first index whose running sum of exp(x - max) exceeds u[r] (float64 in [0, 1)) times the
// row's total. -inf entries (filtered tokens) and NaN have probability 0. Two passes over a row
// and one uniform per row, where Gumbel-max needs a uniform, two logs and an add per entry.
void sample_rows_of(const float* xs, int64_t rows, int64_t vocab, int64_t stride,
                    const double* us, int64_t* o) {
  const int64_t vec_end = vocab / W * W;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e(vocab);
    std::vector<double> chunk((vocab + W - 1) / W);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xs + r * stride;
      vf mv = vf{} - INFINITY;
      for (int64_t i = 0; i < vec_end; i += W) {
        const vf v = load(row + i);
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
        const vf v = load(row + i);
        vf p = vexp(v - mx);
        p = v > -INFINITY ? p : vf{};  // -inf and NaN lanes weigh nothing
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
}

}  // namespace mstar_cpu

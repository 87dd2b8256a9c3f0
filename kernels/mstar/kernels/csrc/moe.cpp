// Mixture-of-experts expert MLPs, grouped by expert (see moe.h). A step's tokens pick top_k
// experts each; the (token, choice) rows are counting-sorted by expert (stable: token order),
// gathered into one buffer, and each expert with rows multiplies them by its gate/up weight,
// applies the activation and multiplies by its down weight, all through the small-batch GEMMs
// of gemm_*.cpp on that expert's packed weights: a decode step reads each chosen expert's
// weights once whatever the number of its rows, and a prompt chunk's rows per expert make one
// GEMM each. Each token's output is then its choices' rows weighted and summed in choice order
// (no atomics: the same bits whatever the thread count).
//
// Threads: an expert holding more than 1/threads of the rows runs alone, its GEMMs split over
// the threads by panels (at::parallel_for inside); the other experts are handed out whole, the
// largest first, to whichever thread is free (the GEMMs' own parallel_for then runs inline),
// so no weight is read by two threads.
#include "moe.h"

#include <atomic>
#include <memory>
#include <numeric>
#include <vector>

#include "vec.h"

namespace mstar_cpu {
namespace {

// x rows [m, k] (row stride lda) times expert e's packed projection -> out [m, n] contiguous.
template <typename T>
void project(ExpertLayout layout, const ExpertProj<T>& p, int64_t e, const T* x, int64_t lda,
             int64_t m, T* out) {
  const T* w = p.packed + e * p.stride;
  const T* bias = p.bias != nullptr ? p.bias + e * p.n : nullptr;
  if constexpr (std::is_same_v<T, bf16>) {
    if (layout == ExpertLayout::kAmx) return amx_gemm(x, lda, m, p.steps, w, p.panels, p.n, bias, out);
    if (layout == ExpertLayout::kDotBf16) return dpbf16_gemm(x, lda, m, p.k, w, p.panels, p.n, bias, out);
  }
  fma_gemm<T>(x, lda, m, p.k, w, p.panels, p.n, bias, out);
}

// gpt-oss's activation on one row: gate_up [gate (inter) | up (inter)] -> o [inter], computed
// in float32 and rounded to T once.
template <typename T>
void clamped_swiglu_row(const T* gate, T* o, int64_t inter, float alpha, float limit) {
  const T* up = gate + inter;
  const int64_t vec_end = inter / W * W;
  const vf hi = vf{} + limit, lo = vf{} - limit;
  for (int64_t i = 0; i < vec_end; i += W) {
    vf g = load(gate + i), u = load(up + i);
    g = g > hi ? hi : g;
    u = u > hi ? hi : (u < lo ? lo : u);
    store(o + i, (u + 1.f) * (g / (1.f + vexp(-alpha * g))));
  }
  for (int64_t i = vec_end; i < inter; ++i) {
    const float g = std::min(static_cast<float>(gate[i]), limit);
    const float u = std::clamp(static_cast<float>(up[i]), -limit, limit);
    o[i] = static_cast<T>((u + 1.f) * (g / (1.f + std::exp(-alpha * g))));
  }
}

// out row = sum over the token's choices (in order) of weight times its expert's output row,
// float32 sums rounded to T once.
template <typename T>
void combine_row(const T* ys, const int64_t* slots, const float* w, int64_t top_k,
                 int64_t hidden, T* out) {
  const int64_t vec_end = hidden / W * W;
  for (int64_t i = 0; i < vec_end; i += W) {
    vf acc = vf{};
    for (int64_t j = 0; j < top_k; ++j) acc += w[j] * load(ys + slots[j] * hidden + i);
    store(out + i, acc);
  }
  for (int64_t i = vec_end; i < hidden; ++i) {
    float acc = 0.f;
    for (int64_t j = 0; j < top_k; ++j) acc += w[j] * static_cast<float>(ys[slots[j] * hidden + i]);
    out[i] = static_cast<T>(acc);
  }
}

// An uninitialised buffer of n elements (the gathered rows are written before they are read).
template <typename T>
std::unique_ptr<T[]> buffer(int64_t n) {
  return std::unique_ptr<T[]>(new T[std::max<int64_t>(n, 1)]);
}

}  // namespace

template <typename T>
void moe_experts(const T* x, int64_t ldx, int64_t tokens, const int64_t* ids,
                 const float* weights, int64_t top_k, int64_t experts, const ExpertMlp<T>& mlp,
                 T* out, int64_t ldo) {
  const int64_t rows = tokens * top_k, hidden = mlp.down.n, inter = mlp.down.k;
  // Counting sort of the rows by expert: start[e] .. start[e + 1] are expert e's rows, in
  // token order; slot[f] is where choice f (= t * top_k + j) went.
  std::vector<int64_t> start(experts + 1, 0), order(rows), slot(rows);
  for (int64_t f = 0; f < rows; ++f) ++start[ids[f] + 1];
  std::partial_sum(start.begin(), start.end(), start.begin());
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t f = 0; f < rows; ++f) {
    slot[f] = fill[ids[f]]++;
    order[slot[f]] = f;
  }
  // AMX tiles read K in whole steps of 32: its rows are zero-padded to the packed K.
  const bool amx = mlp.layout == ExpertLayout::kAmx;
  const int64_t kx = amx ? mlp.gate_up.steps * kAmxTileK : hidden;
  const int64_t ka = amx ? mlp.down.steps * kAmxTileK : inter;
  auto xs = buffer<T>(rows * kx), gu = buffer<T>(rows * 2 * inter);
  auto act = buffer<T>(rows * ka), ys = buffer<T>(rows * hidden);
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* dst = xs.get() + r * kx;
      std::memcpy(dst, x + (order[r] / top_k) * ldx, hidden * sizeof(T));
      std::fill(dst + hidden, dst + kx, T(0.f));
      std::fill(act.get() + r * ka + inter, act.get() + (r + 1) * ka, T(0.f));
    }
  });
  const auto run = [&](int64_t e) {
    const int64_t r0 = start[e], m = start[e + 1] - r0;
    project(mlp.layout, mlp.gate_up, e, xs.get() + r0 * kx, kx, m, gu.get() + r0 * 2 * inter);
    for (int64_t r = r0; r < r0 + m; ++r) {
      const T* g = gu.get() + r * 2 * inter;
      if (mlp.act == ExpertAct::kSiluMul)
        silu_mul_rows(g, act.get() + r * ka, 1, inter);
      else
        clamped_swiglu_row(g, act.get() + r * ka, inter, mlp.alpha, mlp.limit);
    }
    project(mlp.layout, mlp.down, e, act.get() + r0 * ka, ka, m, ys.get() + r0 * hidden);
  };
  // The experts with rows, largest first; those over 1/threads of the rows run one at a time
  // over every thread, the rest one per thread as threads come free.
  std::vector<int64_t> busy;
  for (int64_t e = 0; e < experts; ++e)
    if (start[e + 1] > start[e]) busy.push_back(e);
  std::stable_sort(busy.begin(), busy.end(), [&](int64_t a, int64_t b) {
    return start[a + 1] - start[a] > start[b + 1] - start[b];
  });
  const int64_t threads = at::get_num_threads();
  size_t first_light = 0;
  while (first_light < busy.size() && threads > 1 &&
         (start[busy[first_light] + 1] - start[busy[first_light]]) * threads > rows)
    run(busy[first_light++]);
  std::atomic<size_t> next{first_light};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (size_t i = next++; i < busy.size(); i = next++) run(busy[i]);
  });
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      combine_row(ys.get(), slot.data() + t * top_k, weights + t * top_k, top_k, hidden,
                  out + t * ldo);
  });
}

template void moe_experts(const float*, int64_t, int64_t, const int64_t*, const float*, int64_t,
                          int64_t, const ExpertMlp<float>&, float*, int64_t);
template void moe_experts(const bf16*, int64_t, int64_t, const int64_t*, const float*, int64_t,
                          int64_t, const ExpertMlp<bf16>&, bf16*, int64_t);

}  // namespace mstar_cpu

// Batched LoRA (see lora.h), Punica's shrink-then-expand per segment of rows sharing a slot:
// the rows go in blocks of up to kRows, so each of the slot's A and B^T rows is read once per
// block. Shrink: v[i][j] = x_i . A_j for the slot's `rank` rows (vector dot products, float32
// lanes); expand: y_i += scale * sum_j v[i][j] B^T_j over W-column chunks, the block's
// accumulators in registers. Blocks run in parallel on torch's OpenMP team when the step has
// enough work to pay for the fork; each block writes its own rows of y, so no two threads
// touch one element.
#include "lora.h"

#include <vector>

#include "vec.h"

namespace mstar_cpu {
namespace {

constexpr int64_t kRows = 4;
// Below this many multiply-adds a step's LoRA runs on the calling thread.
constexpr int64_t kParallelWork = 1 << 16;

struct Block {
  int64_t row;
  int64_t rows;
  int64_t slot;
};

template <typename T>
float dot(const T* x, const T* a, int64_t k) {
  const int64_t vec_end = k / W * W;
  vf acc = vf{};
  for (int64_t i = 0; i < vec_end; i += W) acc += load(x + i) * load(a + i);
  float s = hsum(acc);
  for (int64_t i = vec_end; i < k; ++i) s += static_cast<float>(x[i]) * static_cast<float>(a[i]);
  return s;
}

template <typename T>
void run_block(T* y, int64_t ldy, const T* x, int64_t ldx, const LoraWeights<T>& w,
               const Block& blk) {
  const int64_t rank = w.ranks[blk.slot];
  if (rank <= 0) return;
  const float scale = w.scales[blk.slot];
  const T* a = w.a + blk.slot * w.max_rank * w.k;
  const T* b = w.b + blk.slot * w.max_rank * w.n;
  // v[i][j], already scaled: the expand then adds scale * (x A^T) B^T in one pass
  std::vector<float> v(static_cast<size_t>(kRows * rank));
  for (int64_t j = 0; j < rank; ++j)
    for (int64_t i = 0; i < blk.rows; ++i)
      v[i * rank + j] = scale * dot(x + (blk.row + i) * ldx, a + j * w.k, w.k);
  const int64_t vec_end = w.n / W * W;
  for (int64_t c = 0; c < vec_end; c += W) {
    vf acc[kRows] = {};
    for (int64_t j = 0; j < rank; ++j) {
      const vf bj = load(b + j * w.n + c);
      for (int64_t i = 0; i < blk.rows; ++i) acc[i] += v[i * rank + j] * bj;
    }
    for (int64_t i = 0; i < blk.rows; ++i) {
      T* out = y + (blk.row + i) * ldy + c;
      store(out, load(out) + acc[i]);
    }
  }
  for (int64_t c = vec_end; c < w.n; ++c) {
    for (int64_t i = 0; i < blk.rows; ++i) {
      float acc = 0.f;
      for (int64_t j = 0; j < rank; ++j)
        acc += v[i * rank + j] * static_cast<float>(b[j * w.n + c]);
      T* out = y + (blk.row + i) * ldy + c;
      *out = static_cast<T>(static_cast<float>(*out) + acc);
    }
  }
}

}  // namespace

template <typename T>
void lora_add(T* y, int64_t ldy, const T* x, int64_t ldx, const LoraWeights<T>& w,
              const int64_t* seg_indptr, const int64_t* seg_slot, int64_t segments) {
  std::vector<Block> blocks;
  int64_t work = 0;
  for (int64_t g = 0; g < segments; ++g) {
    const int64_t slot = seg_slot[g];
    if (slot < 0 || w.ranks[slot] <= 0) continue;
    for (int64_t r = seg_indptr[g]; r < seg_indptr[g + 1]; r += kRows) {
      const int64_t rows = std::min(kRows, seg_indptr[g + 1] - r);
      blocks.push_back({r, rows, slot});
      work += rows * w.ranks[slot] * (w.k + w.n);
    }
  }
  const int64_t count = static_cast<int64_t>(blocks.size());
  if (count == 0) return;
  const int64_t grain = work < kParallelWork ? count : 1;
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) run_block(y, ldy, x, ldx, w, blocks[i]);
  });
}

template void lora_add<float>(float*, int64_t, const float*, int64_t, const LoraWeights<float>&,
                              const int64_t*, const int64_t*, int64_t);
template void lora_add<c10::BFloat16>(c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t,
                                      const LoraWeights<c10::BFloat16>&, const int64_t*,
                                      const int64_t*, int64_t);

}  // namespace mstar_cpu

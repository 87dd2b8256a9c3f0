// The tensor side of the batched LoRA kernel: shape, dtype and index checks, then lora.cpp's
// raw-pointer kernel. Compiled once and linked into every level (like moe_bindings.cpp); only
// ATen's core headers.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <utility>
#include <vector>

#include "lora.h"
#include "lora_ops.h"

namespace {

template <typename T>
void run(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
         const at::Tensor& ranks, const at::Tensor& scales, const at::Tensor& seg_indptr,
         const at::Tensor& seg_slot, int64_t col_off) {
  mstar_cpu::LoraWeights<T> w{a.data_ptr<T>(),        b.data_ptr<T>(),  ranks.data_ptr<int64_t>(),
                              scales.data_ptr<float>(), a.size(1),        a.size(2),
                              b.size(2)};
  mstar_cpu::lora_add(y.data_ptr<T>() + col_off, y.stride(0), x.data_ptr<T>(), x.stride(0), w,
                      seg_indptr.data_ptr<int64_t>(), seg_slot.data_ptr<int64_t>(),
                      seg_slot.size(0));
}

}  // namespace

void lora_add_(at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor b, at::Tensor ranks,
               at::Tensor scales, at::Tensor seg_indptr, at::Tensor seg_slot, int64_t col_off) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "lora_add_: x must be float32 or bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && y.dim() == 2 && y.stride(1) == 1 &&
                  y.size(0) == x.size(0) && y.scalar_type() == dtype,
              "lora_add_: x [T, k] and y [T, N] must have contiguous rows, one dtype");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous() &&
                  a.scalar_type() == dtype && b.scalar_type() == dtype &&
                  a.size(0) == b.size(0) && a.size(1) == b.size(1) && a.size(2) == x.size(1),
              "lora_add_: a [S, R, k] and b [S, R, n] must be contiguous in x's dtype");
  const int64_t slots = a.size(0), n = b.size(2);
  TORCH_CHECK(col_off >= 0 && col_off + n <= y.size(1), "lora_add_: columns ", col_off, "..",
              col_off + n, " are outside y's ", y.size(1));
  TORCH_CHECK(ranks.scalar_type() == at::kLong && ranks.is_contiguous() &&
                  ranks.numel() == slots && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && scales.numel() == slots,
              "lora_add_: ranks (int64) and scales (float32) must be contiguous [S]");
  TORCH_CHECK(seg_indptr.scalar_type() == at::kLong && seg_slot.scalar_type() == at::kLong &&
                  seg_indptr.is_contiguous() && seg_slot.is_contiguous() &&
                  seg_indptr.numel() == seg_slot.numel() + 1,
              "lora_add_: seg_indptr [G + 1] and seg_slot [G] must be contiguous int64");
  const auto* ptr = seg_indptr.data_ptr<int64_t>();
  const auto* slot = seg_slot.data_ptr<int64_t>();
  const auto* rank = ranks.data_ptr<int64_t>();
  TORCH_CHECK(ptr[0] == 0 && ptr[seg_slot.numel()] == x.size(0),
              "lora_add_: segments must cover x's rows");
  for (int64_t g = 0; g < seg_slot.numel(); ++g) {
    TORCH_CHECK(ptr[g] <= ptr[g + 1], "lora_add_: seg_indptr must not decrease");
    TORCH_CHECK(slot[g] >= -1 && slot[g] < slots, "lora_add_: slot ", slot[g],
                " is outside [-1, ", slots, ")");
    if (slot[g] >= 0)
      TORCH_CHECK(rank[slot[g]] >= 0 && rank[slot[g]] <= a.size(1), "lora_add_: slot ", slot[g],
                  "'s rank ", rank[slot[g]], " is outside [0, ", a.size(1), "]");
  }
  if (dtype == at::kFloat)
    run<float>(y, x, a, b, ranks, scales, seg_indptr, seg_slot, col_off);
  else
    run<c10::BFloat16>(y, x, a, b, ranks, scales, seg_indptr, seg_slot, col_off);
}

namespace {

// The LoraDecode between begin() and end() on this thread (decode_layers runs on its caller's
// thread, without the GIL).
thread_local const LoraDecode* active_decode = nullptr;

}  // namespace

LoraDecode::LoraDecode(std::vector<at::Tensor> a, std::vector<at::Tensor> b,
                       std::vector<at::Tensor> ranks, std::vector<at::Tensor> scales,
                       std::vector<int64_t> col_offs, std::vector<int64_t> parts)
    : a_(std::move(a)),
      b_(std::move(b)),
      ranks_(std::move(ranks)),
      scales_(std::move(scales)),
      col_offs_(std::move(col_offs)) {
  const auto n = static_cast<int64_t>(a_.size());
  TORCH_CHECK(static_cast<int64_t>(b_.size()) == n && static_cast<int64_t>(ranks_.size()) == n &&
                  static_cast<int64_t>(scales_.size()) == n &&
                  static_cast<int64_t>(col_offs_.size()) == n,
              "LoraDecode: a, b, ranks, scales and col_offs need one entry per part");
  TORCH_CHECK(!parts.empty() && parts.size() % 4 == 0,
              "LoraDecode: parts needs 4 counts per layer");
  first_.assign(1, 0);
  for (const int64_t p : parts) {
    TORCH_CHECK(p >= 0, "LoraDecode: a part count is negative");
    first_.push_back(first_.back() + p);
  }
  TORCH_CHECK(first_.back() == n, "LoraDecode: parts add up to ", first_.back(), ", not ", n);
}

void LoraDecode::begin(at::Tensor seg_indptr, at::Tensor seg_slot) {
  seg_indptr_ = std::move(seg_indptr);
  seg_slot_ = std::move(seg_slot);
  active_decode = this;
}

void LoraDecode::end() {
  if (active_decode == this) active_decode = nullptr;
  seg_indptr_ = at::Tensor();
  seg_slot_ = at::Tensor();
}

void LoraDecode::add(at::Tensor& y, const at::Tensor& x, int64_t layer, int64_t proj) const {
  const int64_t at = 4 * layer + proj;
  TORCH_CHECK(proj >= 0 && proj < 4 && at + 1 < static_cast<int64_t>(first_.size()),
              "LoraDecode: layer ", layer, " projection ", proj, " is outside its weights");
  for (int64_t p = first_[at]; p < first_[at + 1]; ++p)
    lora_add_(y, x, a_[p], b_[p], ranks_[p], scales_[p], seg_indptr_, seg_slot_, col_offs_[p]);
}

void lora_decode_add_(at::Tensor& y, const at::Tensor& x, int64_t layer, int64_t proj) {
  if (active_decode != nullptr) active_decode->add(y, x, layer, proj);
}

// The tensor side of the CPU kernels: shape, dtype and bounds checks, output allocation, and
// the Python bindings. Compiled once for the x86-64 baseline (torch's headers take a minute to
// compile) and linked into every ISA level's library beside that level's kernel objects, which
// it calls through kernels.h. The packed GEMMs' side is gemm_bindings.cpp, the fused decode's
// decode_bindings.cpp (glue_ops.h declares what the files call of one another).
#include <torch/extension.h>

#include <cstring>

#include "binding_checks.h"
#include "decode_loop.h"
#include "glue_ops.h"
#include "kernels.h"
#include "lora_ops.h"
#include "moe_decode.h"
#include "moe_ops.h"

std::string isa_level() { return mstar_cpu::isa_level(); }

// q [B, Hq, D] (heads contiguous, any batch stride); kv_layer [pages, 2, S, Hkv, D];
// page_table int64 [B, max_pages]; kv_lens int64 [B]; window > 0: each row attends its last
// `window` keys only (0: all); sinks (gpt-oss): float32 [Hq], each head's learned logit in the
// softmax's denominator. Returns [B, Hq, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor page_table,
                           torch::Tensor kv_lens, double scale, int64_t window,
                           c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(kv_layer.dim() == 5 && page_table.dim() == 2, "bad ranks");
  check_head_rows(q, "q");
  TORCH_CHECK(kv_layer.is_contiguous() && page_table.is_contiguous() && kv_lens.is_contiguous(),
              "kv_layer, page_table and kv_lens must be contiguous");
  TORCH_CHECK(q.scalar_type() == kv_layer.scalar_type(), "q and the cache differ in dtype");
  TORCH_CHECK(page_table.scalar_type() == torch::kInt64 && kv_lens.scalar_type() == torch::kInt64,
              "page_table and kv_lens must be int64");
  const int64_t batch = q.size(0), hq = q.size(1), dim = q.size(2);
  const int64_t page_size = kv_layer.size(2), hkv = kv_layer.size(3);
  TORCH_CHECK(kv_layer.size(1) == 2 && kv_layer.size(4) == dim && hq % hkv == 0, "bad shapes");
  TORCH_CHECK(page_table.size(0) == batch && kv_lens.size(0) == batch, "bad batch");
  auto out = torch::empty({batch, hq, dim}, q.options());
  const auto* table = page_table.data_ptr<int64_t>();
  const auto* lens = kv_lens.data_ptr<int64_t>();
  const float* sink = sink_logits(sinks, hq);
  by_dtype(q, "paged_decode", [&](auto tag) {
    using T = decltype(tag);
    mstar_cpu::decode_dim<T>(dim, q.data_ptr<T>(), q.stride(0), q.stride(1), kv_layer.data_ptr<T>(), table,
                  lens, out.data_ptr<T>(), batch, hq, hkv, page_size, page_table.size(1),
                  static_cast<float>(scale), window, sink);
  });
  return out;
}

// Causal attention of the several-query sequences of a step, writing their rows of out
// [T, Hq, D] (contiguous): q [T, Hq, D] (heads contiguous), kv_layer [pages, 2, S, Hkv, D],
// page_table int64 [B, max_pages], kv_lens / q_starts / q_lens int64 [B]; sinks as
// `paged_decode` takes them.
void paged_prefill(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor page_table,
                   torch::Tensor kv_lens, torch::Tensor q_starts, torch::Tensor q_lens,
                   double scale, torch::Tensor out, c10::optional<torch::Tensor> sinks) {
  check_head_rows(q, "q");
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(1) == 2 && kv_layer.is_contiguous(),
              "kv_layer must be a contiguous [pages, 2, S, H, D]");
  TORCH_CHECK(q.scalar_type() == kv_layer.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, out and the cache differ in dtype");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous like q");
  const int64_t batch = kv_lens.size(0), hq = q.size(1), hkv = kv_layer.size(3);
  for (const auto* t : {&page_table, &kv_lens, &q_starts, &q_lens})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == torch::kInt64,
                "page table and lengths must be contiguous int64");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == batch && q_starts.size(0) == batch &&
                  q_lens.size(0) == batch, "page table and lengths differ in batch");
  TORCH_CHECK(hq % hkv == 0 && q.size(2) == kv_layer.size(4), "head counts / dims do not match");
  const int64_t max_pages = page_table.size(1), page_size = kv_layer.size(2);
  const int64_t pages = kv_layer.size(0);
  const auto* lens = kv_lens.data_ptr<int64_t>();
  const auto* starts = q_starts.data_ptr<int64_t>();
  const auto* qlens = q_lens.data_ptr<int64_t>();
  const auto* table = page_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(qlens[b] >= 1 && qlens[b] <= lens[b] && starts[b] >= 0 &&
                    starts[b] + qlens[b] <= q.size(0) && lens[b] <= max_pages * page_size,
                "paged_prefill: sequence ", b, " has bad lengths");
    for (int64_t j = 0; j < (lens[b] + page_size - 1) / page_size; ++j)
      TORCH_CHECK(table[b * max_pages + j] >= 0 && table[b * max_pages + j] < pages,
                  "paged_prefill: page ", table[b * max_pages + j], " is outside the cache");
  }
  const float* sink = sink_logits(sinks, hq);
  by_dtype(q, "paged_prefill", [&](auto tag) {
    using T = decltype(tag);
    mstar_cpu::prefill_dim<T>(q.size(2), q.data_ptr<T>(), q.stride(0), q.stride(1), kv_layer.data_ptr<T>(),
                   table, max_pages, lens, starts, qlens, batch, out.data_ptr<T>(), hq, hkv,
                   page_size, static_cast<float>(scale), sink);
  });
}

// Copy k, v [T, Hkv, D] into kv_layer [pages, 2, S, Hkv, D] at flat slots (page * S + offset).
void write_kv(torch::Tensor kv_layer, torch::Tensor k, torch::Tensor v, torch::Tensor slots) {
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(1) == 2 && kv_layer.is_contiguous(),
              "kv_layer must be a contiguous [pages, 2, S, H, D]");
  check_head_rows(k, "k");
  check_head_rows(v, "v");
  TORCH_CHECK(k.scalar_type() == kv_layer.scalar_type() && v.scalar_type() == k.scalar_type(),
              "k, v and the cache differ in dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.is_contiguous() && slots.scalar_type() == torch::kInt64,
              "slots must be a contiguous int64 [T]");
  const int64_t tokens = slots.size(0), page_size = kv_layer.size(2);
  TORCH_CHECK(k.size(0) == tokens && v.size(0) == tokens, "k, v and slots differ in length");
  TORCH_CHECK(k.size(1) == kv_layer.size(3) && k.size(2) == kv_layer.size(4) &&
              v.sizes() == k.sizes(), "k / v shape does not match the cache");
  const int64_t capacity = kv_layer.size(0) * page_size;
  const int64_t row = k.size(1) * k.size(2);
  const int64_t bytes = row * static_cast<int64_t>(k.element_size());
  const auto* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "write_kv: slot ", slot[t],
                " is outside the cache's ", capacity, " slots");
  auto* base = static_cast<char*>(kv_layer.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size();
  const int64_t v_stride = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t page = slot[t] / page_size, offset = slot[t] % page_size;
    char* dst = base + ((page * 2 * page_size) + offset) * bytes;
    std::memcpy(dst, ks + t * k_stride, bytes);
    std::memcpy(dst + page_size * bytes, vs + t * v_stride, bytes);
  }
}

// x, residual [T, H] (float32 or bf16, one dtype) and weight [H] (`by_norm_dtype`): see
// `add_rms_norm_rows`.
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(glue_dtype(x) && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm_: x and residual both float32 or both bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() &&
                  residual.sizes() == x.sizes(),
              "add_rms_norm_: x and residual [T, H] contiguous");
  by_norm_dtype(x, weight, x.size(1), "add_rms_norm_", [&](auto tag, auto wtag) {
    using T = decltype(tag);
    using WT = decltype(wtag);
    mstar_cpu::add_rms_norm_rows<T, WT>(x.data_ptr<T>(), residual.data_ptr<T>(),
                                        weight.data_ptr<WT>(), x.size(0), x.size(1),
                                        static_cast<float>(eps));
  });
}

// RMSNorm in place over x's last dim: x [T, D] (rows contiguous) or [T, H, D] (heads
// contiguous: q/k norm over a slice of fused QKV rows); weight [D] (`by_norm_dtype`).
void rms_norm_(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(glue_dtype(x) && (x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1 &&
                  (x.dim() == 2 || x.stride(1) == x.size(2)),
              "rms_norm_: float32 or bfloat16 [T, D] or [T, H, D] with contiguous rows");
  const int64_t heads = x.dim() == 3 ? x.size(1) : 1, dim = x.size(-1);
  by_norm_dtype(x, weight, dim, "rms_norm_", [&](auto tag, auto wtag) {
    using T = decltype(tag);
    using WT = decltype(wtag);
    mstar_cpu::rms_norm_rows<T, WT>(x.data_ptr<T>(), x.size(0), heads, x.stride(0), dim,
                                    weight.data_ptr<WT>(), static_cast<float>(eps));
  });
}

// x [T, 2I] (gate | up, the fused projection's output), float32 or bf16 -> [T, I]:
// act(gate) * up, act SiLU or (gelu) GELU-tanh.
torch::Tensor act_mul(const torch::Tensor& x, bool gelu, const char* op) {
  TORCH_CHECK(glue_dtype(x) && x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, op,
              ": float32 or bfloat16 contiguous [T, 2I]");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  auto out = torch::empty({rows, inter}, x.options());
  by_dtype(x, op, [&](auto tag) {
    using T = decltype(tag);
    if (gelu)
      mstar_cpu::gelu_tanh_mul_rows(x.data_ptr<T>(), out.data_ptr<T>(), rows, inter);
    else
      mstar_cpu::silu_mul_rows(x.data_ptr<T>(), out.data_ptr<T>(), rows, inter);
  });
  return out;
}
torch::Tensor silu_mul(torch::Tensor x) { return act_mul(x, false, "silu_mul"); }
torch::Tensor gelu_tanh_mul(torch::Tensor x) { return act_mul(x, true, "gelu_tanh_mul"); }

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(glue_dtype(x) && x.dim() == 2 && x.stride(1) == 1,
              "argmax_rows: float32 or bfloat16 [n, V] with contiguous rows");
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 31), "argmax_rows: bad vocab size");
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  by_dtype(x, "argmax_rows", [&](auto tag) {
    using T = decltype(tag);
    mstar_cpu::argmax_rows_of(x.data_ptr<T>(), rows, vocab, x.stride(0), out.data_ptr<int64_t>());
  });
  return out;
}

// One draw per row of x [n, V] (float32, contiguous rows) from softmax(x), by inverse CDF: the
// first index whose running sum of exp(x - max) exceeds u[r] (float64 in [0, 1)) times the
// row's total. -inf entries (filtered tokens) and NaN have probability 0. Two passes over a row
// and one uniform per row, where Gumbel-max needs a uniform, two logs and an add per entry.
torch::Tensor sample_rows(torch::Tensor x, torch::Tensor u) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "sample_rows: float32 [n, V] with contiguous rows");
  TORCH_CHECK(u.scalar_type() == torch::kFloat64 && u.dim() == 1 && u.is_contiguous() &&
                  u.size(0) == x.size(0), "sample_rows: u must be float64 [n]");
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(vocab > 0, "sample_rows: empty rows");
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  mstar_cpu::sample_rows_of(x.data_ptr<float>(), rows, vocab, x.stride(0), u.data_ptr<double>(),
                            out.data_ptr<int64_t>());
  return out;
}

// RoPE in place on x [T, H, D] (rotate_half layout) with cos / sin [T, 1, D/2], all float32
// or all bf16.
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_head_rows(x, "x");
  TORCH_CHECK(glue_dtype(x) && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "rope_: x, cos and sin all float32 or all bfloat16");
  const int64_t half = x.size(2) / 2;
  TORCH_CHECK(x.size(2) % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == x.size(0) * half && sin.numel() == cos.numel(),
              "rope_: cos / sin must be contiguous [T, 1, D/2]");
  by_dtype(x, "rope_", [&](auto tag) {
    using T = decltype(tag);
    mstar_cpu::rotate_rows(x.data_ptr<T>(), x.size(0), x.size(1), x.stride(0), half, cos.data_ptr<T>(),
                sin.data_ptr<T>());
  });
}

#include "quant_bindings.h"

namespace {

// Every function runs without the GIL (none touches a Python object once its arguments are
// converted), as torch's own ops do: the server's event loop streams and admits while a step's
// kernels run (`decode_layers` is a whole decode step's layers, ~9 ms at batch 1).
void define(pybind11::module_& m) {
#define MSTAR_DEF(name) m.def(#name, torch::wrap_pybind_function_no_gil(name), #name)
  MSTAR_DEF(isa_level);
  // sinks: optional, so callers without them pass the positional arguments they always did
  namespace py = pybind11;
  m.def("paged_decode", torch::wrap_pybind_function_no_gil(paged_decode), "paged_decode",
        py::arg("q"), py::arg("kv_layer"), py::arg("page_table"), py::arg("kv_lens"),
        py::arg("scale"), py::arg("window"), py::arg("sinks") = py::none());
  m.def("paged_prefill", torch::wrap_pybind_function_no_gil(paged_prefill), "paged_prefill",
        py::arg("q"), py::arg("kv_layer"), py::arg("page_table"), py::arg("kv_lens"),
        py::arg("q_starts"), py::arg("q_lens"), py::arg("scale"), py::arg("out"),
        py::arg("sinks") = py::none());
  MSTAR_DEF(write_kv);
  MSTAR_DEF(add_rms_norm_);
  MSTAR_DEF(rope_);
  MSTAR_DEF(argmax_rows);
  MSTAR_DEF(silu_mul);
  MSTAR_DEF(gelu_tanh_mul);
  MSTAR_DEF(rms_norm_);
  MSTAR_DEF(sample_rows);
  MSTAR_DEF(amx_available);
  MSTAR_DEF(amx_pack_weight);
  MSTAR_DEF(amx_linear);
  MSTAR_DEF(dpbf16_available);
  MSTAR_DEF(dpbf16_pack_weight);
  MSTAR_DEF(dpbf16_linear);
  MSTAR_DEF(fma_available);
  MSTAR_DEF(fma_pack_weight);
  MSTAR_DEF(fma_linear);
  MSTAR_DEF(decode_layers);
  MSTAR_DEF(quant_vnni);
  MSTAR_DEF(quant_linear);
  MSTAR_DEF(quant_dequantize_);
  MSTAR_DEF(quant_decode_layers);
  MSTAR_DEF(moe_experts);
  MSTAR_DEF(lora_add_);
#undef MSTAR_DEF
  using Tensors = std::vector<at::Tensor>;
  // module_local: every level's library registers it (a process may load several levels)
  py::class_<LoraDecode>(m, "LoraDecode", py::module_local())
      .def(py::init<Tensors, Tensors, Tensors, Tensors, std::vector<int64_t>,
                    std::vector<int64_t>>())
      .def("begin", &LoraDecode::begin)
      .def("end", &LoraDecode::end);
  py::class_<MoeLayer, std::shared_ptr<MoeLayer>>(m, "MoeLayer", py::module_local())
      .def(py::init<at::Tensor, std::optional<at::Tensor>, at::Tensor, std::optional<at::Tensor>,
                    int64_t, int64_t, double, double, int64_t, int64_t, bool, bool>())
      .def("forward", &MoeLayer::forward, py::call_guard<py::gil_scoped_release>());
  py::class_<MoeDecode>(m, "MoeDecode", py::module_local())
      .def(py::init<std::vector<int64_t>, std::vector<std::shared_ptr<MoeLayer>>, Tensors,
                    std::vector<std::optional<at::Tensor>>,
                    std::vector<std::optional<at::Tensor>>>())
      .def("begin", &MoeDecode::begin)
      .def("end", &MoeDecode::end);
}

}  // namespace

// The module for one level's library, named by that library (level.cpp's PyInit): each level
// is its own module, so a process can load several (the tests compare them).
PyObject* mstar_cpu_module(const char* name) {
  auto* def = new PyModuleDef();  // a module's definition lives as long as the process
  try {
    auto m = pybind11::module_::create_extension_module(
        name, "mstar's CPU kernels for one ISA level (see mstar.kernels.cpu_kernels)", def);
    define(m);
    return m.release().ptr();
  } catch (pybind11::error_already_set& e) {
    e.restore();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ImportError, e.what());
  }
  return nullptr;
}

// The tensor-side ops of bindings.cpp, gemm_bindings.cpp and decode_bindings.cpp, declared for
// one another: the fused decode loop (decode_loop.h) calls the glue and GEMM ops, and
// bindings.cpp's module definition registers them all. Each is documented where it is defined.
#pragma once

#include <torch/extension.h>

#include <vector>

// bindings.cpp
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor page_table,
                           torch::Tensor kv_lens, double scale, int64_t window,
                           c10::optional<torch::Tensor> sinks);
void write_kv(torch::Tensor kv_layer, torch::Tensor k, torch::Tensor v, torch::Tensor slots);
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rms_norm_(torch::Tensor x, torch::Tensor weight, double eps);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor act_mul(const torch::Tensor& x, bool gelu, const char* op);

// gemm_bindings.cpp
bool amx_available();
torch::Tensor amx_pack_weight(torch::Tensor weight);
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t n,
                         c10::optional<torch::Tensor> bias);
bool dpbf16_available();
torch::Tensor dpbf16_pack_weight(torch::Tensor weight);
torch::Tensor dpbf16_linear(torch::Tensor x, torch::Tensor packed, int64_t n,
                            c10::optional<torch::Tensor> bias);
bool fma_available();
torch::Tensor fma_pack_weight(torch::Tensor weight);
torch::Tensor fma_linear(torch::Tensor x, torch::Tensor packed, int64_t n,
                         c10::optional<torch::Tensor> bias);
torch::Tensor small_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                           const c10::optional<torch::Tensor>& bias);

// decode_bindings.cpp
const torch::Tensor& convert_rows(const torch::Tensor& src, const torch::Tensor& dst);
std::vector<torch::Tensor> decode_layers(
    torch::Tensor h, torch::Tensor residual, std::vector<torch::Tensor> norm_in,
    std::vector<torch::Tensor> norm_post, std::vector<torch::Tensor> qkv,
    std::vector<torch::Tensor> o, std::vector<torch::Tensor> gate_up,
    std::vector<torch::Tensor> down, std::vector<c10::optional<torch::Tensor>> biases,
    torch::Tensor cache, std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin,
    std::vector<torch::Tensor> page_tables, std::vector<torch::Tensor> kv_lens,
    std::vector<torch::Tensor> slots, std::vector<c10::optional<torch::Tensor>> layout_norms,
    std::vector<int64_t> layout_ints, bool gelu, int64_t num_heads, int64_t num_kv_heads,
    int64_t inter, double scale, double eps);

// The ops kernels/cpu_ops.py exposes (see bindings.cpp for their contracts).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace mesh_cpu {

int64_t vec_size();  // floats per vector in these kernels (16 with AVX-512)

bool supports_head_dim(int64_t head_dim);

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_plan(
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens, int64_t num_kv_heads,
    int64_t group, int64_t head_dim, int64_t sliding_window, bool batch_invariant);

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_table,
                     const at::Tensor& items, const at::Tensor& merges,
                     at::Tensor& partials, double scale, double k_scale, double v_scale,
                     int64_t sliding_window, double soft_cap, bool batch_invariant);

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping, double k_scale,
                       double v_scale);

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps);

at::Tensor silu_and_mul(const at::Tensor& gate_up);

void rotary_embedding(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

bool quant_linear_supported();

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, bool q4, bool bf16);

bool quant_linear_bf16_dot_supported();

bool amx_linear_supported();

at::Tensor amx_pack_bf16(const at::Tensor& weight);

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                      const std::optional<at::Tensor>& bias);

at::Tensor amx_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t n);

std::tuple<at::Tensor, at::Tensor> quantize_per_token(const at::Tensor& x, int64_t zero_point);

at::Tensor dequantize_int32(const at::Tensor& acc, const at::Tensor& x_scales,
                            const at::Tensor& w_scales, const std::optional<at::Tensor>& bias,
                            at::ScalarType out_dtype);

}  // namespace mesh_cpu

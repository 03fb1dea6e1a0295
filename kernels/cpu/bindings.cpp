// Python bindings of the CPU kernels. Tensors are CPU tensors; every op checks its inputs.
#include <torch/python.h>

#include "ops.h"

using namespace pybind11::literals;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "LLM Mesh CPU kernels: paged attention, KV cache write, fused layer ops, "
           "quantized linear, AMX bf16 linear, int8 quantize / dequantize";
  m.attr("vec_size") = mesh_cpu::vec_size();
  m.def("supports_head_dim", &mesh_cpu::supports_head_dim, "head_dim"_a,
        "Whether paged_attention has a kernel for this head size.");
  m.def("attention_plan", &mesh_cpu::attention_plan, "query_start_loc"_a, "seq_lens"_a,
        "num_kv_heads"_a, "group"_a, "head_dim"_a, "sliding_window"_a = 0,
        "batch_invariant"_a = false,
        "A step's attention work, built once and shared by every layer: (items, merges, "
        "partials). Items cut requests x KV heads into query tiles (prefill) or KV splits "
        "(long decodes), largest first; torch's threads take them as each frees up. "
        "batch_invariant: every query token is a tile of the prefill kernel, never split.");
  m.def("paged_attention", &mesh_cpu::paged_attention, "out"_a, "query"_a, "key_cache"_a,
        "value_cache"_a, "block_table"_a, "items"_a, "merges"_a, "partials"_a,
        "scale"_a, "k_scale"_a, "v_scale"_a, "sliding_window"_a = 0, "soft_cap"_a = 0.0,
        "batch_invariant"_a = false,
        "Causal varlen attention of query [T, Hq, D] over each request's paged context "
        "(its cached prefix and this step's keys), read in place through the block table. "
        "sliding_window > 0: a query at p sees keys p - window < j <= p; soft_cap > 0: "
        "scores become cap * tanh(score / cap). Writes out [T, Hq * D].");
  m.def("reshape_and_cache", &mesh_cpu::reshape_and_cache, "key"_a, "value"_a, "key_cache"_a,
        "value_cache"_a, "slot_mapping"_a, "k_scale"_a, "v_scale"_a,
        "Writes key/value [T, Hkv, D] to their slots (slot < 0: skipped); an fp8 cache "
        "stores x / scale saturated at +-448.");
  m.def("rms_norm", &mesh_cpu::rms_norm, "x"_a, "weight"_a, "eps"_a,
        "RMSNorm over the last dim of x [..., D] (rows may be strided); a new tensor.");
  m.def("add_rms_norm", &mesh_cpu::add_rms_norm, "x"_a, "residual"_a, "weight"_a, "eps"_a,
        "x += residual in place (x becomes the new residual), returns rms_norm(x).");
  m.def("silu_and_mul", &mesh_cpu::silu_and_mul, "gate_up"_a,
        "silu(gate_up[:, :I]) * gate_up[:, I:] as a new [T, I] tensor.");
  m.def("rotary_embedding", &mesh_cpu::rotary_embedding, "x"_a, "cos"_a, "sin"_a,
        "Neox rope in place on x [T, H, D] with cos / sin [T, D] (sin's first half negated).");
  m.def("quant_linear_supported", &mesh_cpu::quant_linear_supported,
        "Whether quant_linear has a kernel for this CPU (AVX2 or AVX-512).");
  m.def("quant_linear", &mesh_cpu::quant_linear, "x"_a, "blocks"_a, "q4"_a, "bf16"_a = false,
        "x [M, K] fp32 @ W^T for W [N, K] in GGUF blocks of 32 along K, Q4_1 (q4) or Q8_0, "
        "packed by PackedBlocks.of (groups of vec_size columns), expanded to the dequantized "
        "fp32 values on the fly (rounded to bf16 with bf16). With bf16, x may be bf16 "
        "(where quant_linear_bf16_dot_supported(), up to 8 rows of it are multiplied as "
        "bf16 pairs; otherwise it is widened to fp32). Returns y [M, N] fp32.");
  m.def("quant_linear_bf16_dot_supported", &mesh_cpu::quant_linear_bf16_dot_supported,
        "Whether quant_linear multiplies bf16 x by bf16 weights with AVX512-BF16's pair "
        "products (up to 8 rows).");
  m.def("amx_linear_supported", &mesh_cpu::amx_linear_supported,
        "Whether amx_linear runs here (built for AMX-BF16, and Linux granted the tiles).");
  m.def("amx_pack_bf16", &mesh_cpu::amx_pack_bf16, "weight"_a,
        "W [N, K] bf16 as amx_linear reads it: [ceil(N / 16), ceil(K / 32), 16, 32] bf16 "
        "tiles of 16 columns x 32 k, k pairs side by side, zeros past N and K.");
  m.def("amx_linear", &mesh_cpu::amx_linear, "x"_a, "packed"_a, "n"_a, "bias"_a = pybind11::none(),
        "x [M, K] bf16 @ W^T (+ bias) on AMX tiles, W packed by amx_pack_bf16, N its rows: "
        "fp32 sums of bf16 products, rounded once to bf16. Returns y [M, N] bf16.");
  m.def("amx_linear_silu_mul", &mesh_cpu::amx_linear_silu_mul, "x"_a, "packed"_a, "n"_a,
        "silu_and_mul(amx_linear(x, packed, n)) in one pass, for a gate_up weight [N, K] "
        "(gate rows, then up rows; N / 2 a multiple of 16). Returns [M, N / 2] bf16.");
  m.def("quantize_per_token", &mesh_cpu::quantize_per_token, "x"_a, "zero_point"_a = 0,
        "x [M, K] to (codes [M, K], scales [M] fp32): per row s = max|x| / 127, "
        "q = round(x / s) in [-127, 127]; int8 codes, or q + 128 as uint8 with zero_point 128.");
  m.def("dequantize_int32", &mesh_cpu::dequantize_int32, "acc"_a, "x_scales"_a, "w_scales"_a,
        "bias"_a, "out_dtype"_a,
        "acc [M, N] int32 (or those values as fp32) to acc * x_scales[row] * w_scales[col] "
        "(+ bias fp32 [N]), computed in fp32 and rounded once to out_dtype.");
}

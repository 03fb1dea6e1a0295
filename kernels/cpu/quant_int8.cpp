// The two passes around a W8A8 int8 GEMM (services/worker/models/int8.py): each is one pass
// over the rows in place of the ~5 torch ops (and temporaries) it replaces, ~10 us apiece at
// every one of a step's ~120 linears.
//
// quantize_per_token: each row of x [M, K] (model dtype) to int8 with its own symmetric scale
//   s = max|x_row| / 127 and q = round_half_even(x / s), in [-127, 127] (a zero row: s = 0,
//   q = 0). With zero_point 128 the codes are stored as q + 128 in uint8, the activations
//   oneDNN's int8 GEMM takes.
// dequantize_int32: y = float(acc) * x_scale[row] * w_scale[col] (+ bias[col]) in fp32, each
//   product and sum rounded once in that order, then once to the output dtype. acc is the
//   int32 accumulator, or the same values already converted to fp32.
//
// Both round where the torch expressions in int8.py round, so they agree bit for bit.
#include "cpu_common.h"
#include "ops.h"

#include <ATen/ops/empty.h>

#include <algorithm>

namespace mesh_cpu {

namespace {

// Rows (or row pieces) per parallel task: a small batch stays on the calling thread.
int64_t grain(int64_t row_len) { return std::max<int64_t>(1, 16384 / row_len); }

// n (<= kVec) lanes of v, integral floats in Q's range, stored as Q.
template <typename Q>
inline void store_codes(Q* p, const fVec& v, int n) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i ints = _mm512_cvtps_epi32(v);
  const __m128i bytes = std::is_same_v<Q, int8_t> ? _mm512_cvtsepi32_epi8(ints)
                                                  : _mm512_cvtusepi32_epi8(ints);
  _mm_mask_storeu_epi8(p, static_cast<__mmask16>((1u << n) - 1), bytes);
#else
  alignas(64) float buf[kVec];
  v.store(buf);
  for (int i = 0; i < n; ++i) p[i] = static_cast<Q>(buf[i]);
#endif
}

// n (<= kVec) accumulators as fp32 lanes.
inline fVec load_acc(const float* p, int n) { return load_f32(p, n); }

inline fVec load_acc(const int32_t* p, int n) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i ints = _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << n) - 1), p);
  return fVec(_mm512_cvtepi32_ps(ints));
#else
  alignas(64) float buf[kVec] = {};
  for (int i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
  return fVec::loadu(buf);
#endif
}

template <typename T, typename Q>
void quantize_row(const T* x, Q* q, float* scale, int64_t k, float zero_point) {
  fVec amax(0.f);
  for (int64_t i = 0; i < k; i += kVec) {
    const int c = static_cast<int>(std::min<int64_t>(kVec, k - i));
    amax = at::vec::maximum(amax, load_f32(x + i, c).abs());
  }
  const float s = hmax(amax) / 127.f;
  *scale = s;
  const fVec sv(s == 0.f ? 1.f : s), lo(-127.f), hi(127.f), zp(zero_point);
  for (int64_t i = 0; i < k; i += kVec) {
    const int c = static_cast<int>(std::min<int64_t>(kVec, k - i));
    // NOTE: round() is round-half-even, as torch.round; the clamp only catches x / s landing
    // a hair above 127 for the row's largest element.
    const fVec v = at::vec::clamp(load_f32(x + i, c) / sv, lo, hi).round() + zp;
    store_codes(q + i, v, c);
  }
}

template <typename A, typename T>
void dequantize_piece(const A* acc, float x_scale, const float* w_scales, const float* bias,
                      T* out, int64_t n) {
  const fVec xs(x_scale);
  for (int64_t j = 0; j < n; j += kVec) {
    const int c = static_cast<int>(std::min<int64_t>(kVec, n - j));
    fVec y = load_acc(acc + j, c) * xs * load_f32(w_scales + j, c);
    if (bias != nullptr) y = y + load_f32(bias + j, c);
    store_f32(out + j, y, c);
  }
}

void check_scales(const at::Tensor& scales, int64_t n, const char* name) {
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n && scales.is_contiguous() &&
              scales.scalar_type() == at::kFloat, name, " must be contiguous fp32 [", n, "]");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_per_token(const at::Tensor& x, int64_t zero_point) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(zero_point == 0 || zero_point == 128, "zero_point must be 0 (int8) or 128 (uint8)");
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({m, k}, x.options().dtype(zero_point ? at::kByte : at::kChar));
  at::Tensor scales = at::empty({m}, x.options().dtype(at::kFloat));
  float* s = scales.data_ptr<float>();
  MESH_DISPATCH_MODEL_DTYPE(x.scalar_type(), T, [&] {
    const T* src = x.data_ptr<T>();
    at::parallel_for(0, m, grain(k), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        if (zero_point) {
          quantize_row(src + r * k, q.data_ptr<uint8_t>() + r * k, s + r, k, 128.f);
        } else {
          quantize_row(src + r * k, q.data_ptr<int8_t>() + r * k, s + r, k, 0.f);
        }
      }
    });
  });
  return {q, scales};
}

at::Tensor dequantize_int32(const at::Tensor& acc, const at::Tensor& x_scales,
                            const at::Tensor& w_scales, const std::optional<at::Tensor>& bias,
                            at::ScalarType out_dtype) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() &&
              (acc.scalar_type() == at::kInt || acc.scalar_type() == at::kFloat),
              "acc must be a contiguous int32 (or fp32) [M, N] tensor");
  const int64_t m = acc.size(0), n = acc.size(1);
  check_scales(x_scales, m, "x_scales");
  check_scales(w_scales, n, "w_scales");
  const float* b = nullptr;
  if (bias.has_value()) {
    check_scales(*bias, n, "bias");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({m, n}, acc.options().dtype(out_dtype));
  // NOTE: work splits over rows and pieces of rows, so a wide product at a few rows (the
  // lm_head at batch 1) still uses every thread.
  const int64_t piece = std::min<int64_t>(n, 4096), num_pieces = (n + piece - 1) / piece;
  const float* xs = x_scales.data_ptr<float>();
  const float* ws = w_scales.data_ptr<float>();
  MESH_DISPATCH_MODEL_DTYPE(out_dtype, T, [&] {
    T* o = out.data_ptr<T>();
    at::parallel_for(0, m * num_pieces, grain(piece), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / num_pieces, j = (i % num_pieces) * piece;
        const int64_t len = std::min(piece, n - j), off = r * n + j;
        const float* bj = b == nullptr ? nullptr : b + j;
        if (acc.scalar_type() == at::kInt) {
          dequantize_piece(acc.data_ptr<int32_t>() + off, xs[r], ws + j, bj, o + off, len);
        } else {
          dequantize_piece(acc.data_ptr<float>() + off, xs[r], ws + j, bj, o + off, len);
        }
      }
    });
  });
  return out;
}

}  // namespace mesh_cpu

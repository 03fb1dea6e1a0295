// y = x W^T with W kept in its GGUF block quantization (Q4_1 or Q8_0, blocks of 32 along K)
// and expanded on the fly, row by row, into fp32 values bit-identical to the dequantized
// checkpoint: Q4_1 as fp32(d * q) + m, Q8_0 as d * q, each product and sum rounded once
// (what gguf's numpy dequantizer computes; -ffp-contract=off keeps them unfused). The math
// is the fp32 model's; only the bytes read per step shrink (~5 bits a weight instead of 32),
// which is what a small-batch decode step is bound by.
//
// Work splits over output columns in groups (8 with AVX-512, 4 with AVX2's 16 registers);
// each group's weight rows are expanded once into a thread-local buffer and every row of x
// is dotted against all of them (2 rows at a time, then one). Every (row, column)
// has one accumulator summed in the same order whatever the grouping, so a column's
// result does not depend on the other rows of x: batch-invariant.
// NOTE: with 2 columns a group, a lone row kept only 2 FMA chains in flight (latency-bound)
// and a step paid ~4.5 ms per extra row on SmolLM2 (a decode verifying drafts has 2-5).
#include "cpu_common.h"
#include "ops.h"

#include <ATen/ops/empty.h>

#include <algorithm>

namespace mesh_cpu {

namespace {

constexpr int kBlock = 32;

struct QuantWeight {
  const float* scales;   // [N, K / 32]
  const float* mins;     // [N, K / 32] (Q4_1 only)
  const uint8_t* qs;     // Q4_1: [N, K / 2] nibbles, GGUF order; Q8_0: [N, K] int8
  int64_t n, k;
  bool q4;
};

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#define MESH_HAS_QUANT_LINEAR 1

// kVec bytes (the low ones of `bytes`) as kVec floats.
inline fVec widen(__m128i bytes, bool is_signed) {
#if defined(CPU_CAPABILITY_AVX512)
  return fVec(_mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(bytes)
                                           : _mm512_cvtepu8_epi32(bytes)));
#else
  return fVec(_mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes)
                                           : _mm256_cvtepu8_epi32(bytes)));
#endif
}

// 16 quants -> d * q (+ m) into dst[16]: one rounding per product and per sum, as gguf's.
inline void expand16(__m128i bytes, bool is_signed, const fVec& d, const fVec* m, float* dst) {
  for (int i = 0; i < 16; i += kVec) {
    fVec v = d * widen(bytes, is_signed);
    if (m != nullptr) v = v + *m;
    v.store(dst + i);
    bytes = _mm_srli_si128(bytes, kVec);
  }
}

// Weight row `row` as fp32 into dst[k].
void expand_row(const QuantWeight& w, int64_t row, float* dst) {
  const int64_t nb = w.k / kBlock;
  const float* d = w.scales + row * nb;
  if (w.q4) {
    const float* m = w.mins + row * nb;
    const uint8_t* q = w.qs + row * (w.k / 2);
    const __m128i low_nibbles = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
      const __m128i lo = _mm_and_si128(raw, low_nibbles);                      // elems 0..15
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low_nibbles);  // elems 16..31
      const fVec dv(d[b]), mv(m[b]);
      expand16(lo, false, dv, &mv, dst + b * kBlock);
      expand16(hi, false, dv, &mv, dst + b * kBlock + 16);
    }
  } else {
    const uint8_t* q = w.qs + row * w.k;
    for (int64_t b = 0; b < nb; ++b) {
      const __m128i* src = reinterpret_cast<const __m128i*>(q + b * kBlock);
      const fVec dv(d[b]);
      expand16(_mm_loadu_si128(src), true, dv, nullptr, dst + b * kBlock);
      expand16(_mm_loadu_si128(src + 1), true, dv, nullptr, dst + b * kBlock + 16);
    }
  }
}

// y[r, col .. col + NC) for MR rows of x starting at x_rows; w holds the NC expanded rows.
template <int MR, int NC>
inline void dot_rows(const float* x_rows, int64_t k, const float* w, float* y_rows, int64_t n,
                     int64_t col) {
  fVec acc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = fVec(0.f);
  for (int64_t i = 0; i < k; i += kVec) {
    fVec wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = fVec::loadu(w + c * k + i);
    for (int r = 0; r < MR; ++r) {
      const fVec xv = fVec::loadu(x_rows + r * k + i);
      for (int c = 0; c < NC; ++c) acc[r][c] = at::vec::fmadd(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) y_rows[r * n + col + c] = hsum(acc[r][c]);
}

// Columns [col, col + NC) of y for every row of x, from their expanded weight rows.
template <int NC>
inline void columns(const QuantWeight& w, const float* xp, int64_t m, float* yp, int64_t col,
                    float* rows) {
  const int64_t k = w.k, n = w.n;
  for (int c = 0; c < NC; ++c) expand_row(w, col + c, rows + c * k);
  int64_t r = 0;
  for (; r + 2 <= m; r += 2) dot_rows<2, NC>(xp + r * k, k, rows, yp + r * n, n, col);
  if (r < m) dot_rows<1, NC>(xp + r * k, k, rows, yp + r * n, n, col);
}

// One lone row keeps kCols FMA chains in flight; two rows use 2 * kCols accumulators +
// kCols weight vectors + 2 of x: 26 of AVX-512's 32 registers, 14 of AVX2's 16.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kCols = 8;
#else
constexpr int kCols = 4;
#endif

#endif  // AVX2 or AVX-512

}  // namespace

bool quant_linear_supported() {
#if defined(MESH_HAS_QUANT_LINEAR)
  return true;
#else
  return false;
#endif
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& scales, const at::Tensor& mins,
                        const at::Tensor& qs) {
#if !defined(MESH_HAS_QUANT_LINEAR)
  TORCH_CHECK(false, "quant_linear needs AVX2 or AVX-512");
#else
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be fp32 [M, K]");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat &&
              scales.is_contiguous(), "scales must be contiguous fp32 [N, K / 32]");
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous(), "qs must be uint8");
  const int64_t n = scales.size(0), k = scales.size(1) * kBlock;
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight ", k);
  TORCH_CHECK(n % 2 == 0, "the weight needs an even number of rows");
  const bool q4 = mins.numel() > 0;
  TORCH_CHECK(!q4 || (mins.sizes() == scales.sizes() && mins.is_contiguous() &&
                      mins.scalar_type() == at::kFloat), "mins must match scales");
  TORCH_CHECK(qs.numel() == n * (q4 ? k / 2 : k), "qs has the wrong size");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  const QuantWeight w{scales.data_ptr<float>(), q4 ? mins.data_ptr<float>() : nullptr,
                      qs.data_ptr<uint8_t>(), n, k, q4};
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t groups = n / kCols;   // then pairs, where kCols does not divide n
  at::parallel_for(0, groups, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(kCols * k);
    for (int64_t group = begin; group < end; ++group)
      columns<kCols>(w, xp, m, yp, group * kCols, rows.data());
  });
  std::vector<float> rows(2 * k);
  for (int64_t col = groups * kCols; col < n; col += 2) columns<2>(w, xp, m, yp, col, rows.data());
  return y;
#endif
}

}  // namespace mesh_cpu

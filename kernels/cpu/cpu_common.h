// Shared by the CPU kernels: the vector width -march=native gives, and loads/stores that convert
// the model's and the KV cache's dtypes to and from fp32 vectors (all math is fp32).
#pragma once

// NOTE: at::vec picks its implementation from these macros (ATen defines them per kernel file);
// we compile for the machine we run on, so they follow what -march=native enabled.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace mesh_cpu {

using fVec = at::vec::Vectorized<float>;
constexpr int kVec = fVec::size();  // floats per vector: 16 with AVX-512, 8 with AVX2
using at::BFloat16;
using at::Half;
using Fp8 = c10::Float8_e4m3fn;

// ---- kVec elements of T -> one fp32 vector ----
inline fVec load_f32(const float* p) { return fVec::loadu(p); }

inline fVec load_f32(const BFloat16* p) {
  fVec out;
  at::vec::load_fp32_from_bf16(p, out);
  return out;
}

inline fVec load_f32(const Half* p) {
  fVec out;
  at::vec::load_fp32_from_fp16(p, out);
  return out;
}

inline fVec load_f32(const Fp8* p) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 out;
  at::vec::cvtfp8e4m3_fp32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), out);
  return fVec(out);
#else
  alignas(64) float buf[kVec];
  for (int i = 0; i < kVec; ++i) buf[i] = static_cast<float>(p[i]);
  return fVec::loadu(buf);
#endif
}

// The first n (<= kVec) elements, zero-padded: for rows whose length is not a multiple of kVec.
template <typename T>
inline fVec load_f32(const T* p, int n) {
  if (n == kVec) return load_f32(p);
  alignas(64) T buf[kVec] = {};
  std::memcpy(buf, p, n * sizeof(T));
  return load_f32(buf);
}

// ---- n (<= kVec) fp32 lanes -> T, rounding to nearest even as torch's casts do ----
inline void store_f32(float* p, const fVec& v, int n = kVec) { v.store(p, n); }

#if defined(CPU_CAPABILITY_AVX512)
using Vec16 = __m256i;   // kVec 16-bit values
inline void store16(void* p, Vec16 v) { _mm256_storeu_si256(static_cast<__m256i*>(p), v); }
#elif defined(CPU_CAPABILITY_AVX2)
using Vec16 = __m128i;
inline void store16(void* p, Vec16 v) { _mm_storeu_si128(static_cast<__m128i*>(p), v); }
#endif

// One fp32 vector as kVec bf16 / fp16 values, in registers.
// NOTE: at::vec::convert(float*, BFloat16*, n) converts whole Vectorized<BFloat16>s (32
// values with AVX-512, 16 with AVX2) and the rest one scalar at a time: every store of one
// fp32 vector went the scalar way (bf16 SiLU-and-mul on 32 x 1536: 88 us, 17 in fp32).
template <typename T>
inline auto to_16bit(const fVec& v) {
  static_assert(std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>);
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, BFloat16>) {
    return at::vec::cvtfp32_bf16(v);
  } else {
    return at::vec::cvtfp32_fp16(v);
  }
#endif
}

template <typename T>
inline void store_f32(T* p, const fVec& v, int n = kVec) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (n == kVec) return store16(p, to_16bit<T>(v));
#endif
  alignas(64) float buf[kVec];
  v.store(buf);
  at::vec::convert(buf, p, n);
}

// fp32 -> T -> fp32: the rounding a tensor of dtype T applies to an intermediate result.
template <typename T>
inline fVec round_to(const fVec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    alignas(64) T buf[kVec];
    store_f32(buf, v);
    return load_f32(buf);
  }
}

// The smallest multiple of `multiple` at or above `value` (both positive).
inline int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

inline float hsum(const fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(v);
#else
  return at::vec::vec_reduce_all<float>([](const fVec& a, const fVec& b) { return a + b; }, v);
#endif
}

inline float hmax(const fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_max_ps(v);
#else
  return at::vec::vec_reduce_all<float>(
      [](const fVec& a, const fVec& b) { return at::vec::maximum(a, b); }, v);
#endif
}

// One row of `n` elements of T (n a multiple of kVec) into fp32, times `scale`.
template <typename T>
inline void row_to_f32(const T* src, float* dst, int n, float scale) {
  const fVec s(scale);
  for (int i = 0; i < n; i += kVec) (load_f32(src + i) * s).store(dst + i);
}

// Dispatches on a floating dtype the model may use: float32, bfloat16, float16.
#define MESH_DISPATCH_MODEL_DTYPE(dtype, NAME, ...)                         \
  [&] {                                                                     \
    switch (dtype) {                                                        \
      case at::kFloat: { using NAME = float; return __VA_ARGS__(); }        \
      case at::kBFloat16: { using NAME = BFloat16; return __VA_ARGS__(); }  \
      case at::kHalf: { using NAME = Half; return __VA_ARGS__(); }          \
      default: TORCH_CHECK(false, "unsupported dtype ", dtype);             \
    }                                                                       \
  }()

// ... and the KV cache's dtypes: the model's, or float8_e4m3fn.
#define MESH_DISPATCH_CACHE_DTYPE(dtype, NAME, ...)                                  \
  [&] {                                                                              \
    if (dtype == at::kFloat8_e4m3fn) { using NAME = Fp8; return __VA_ARGS__(); }     \
    return MESH_DISPATCH_MODEL_DTYPE(dtype, NAME, __VA_ARGS__);                      \
  }()

}  // namespace mesh_cpu

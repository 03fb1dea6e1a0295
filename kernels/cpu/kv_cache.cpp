// reshape_and_cache: the step's keys and values into their cache slots (vLLM's name).
#include "cpu_common.h"
#include "ops.h"

#include <algorithm>

namespace mesh_cpu {

namespace {

constexpr float kFp8Max = 448.f;  // largest finite float8_e4m3fn: writes saturate here

// n elements of T to e4m3fn: x / scale clamped to +-448, rounded to nearest even, as torch's
// x.clamp(-448, 448).to(torch.float8_e4m3fn) does (checked byte for byte in the tests).
template <typename T>
void quantize_row(const T* src, Fp8* dst, int n, float scale) {
  for (int i = 0; i < n; i += kVec) {
    const int c = std::min(kVec, n - i);
    fVec x = load_f32(src + i, c);
    if (scale != 1.f) x = x / fVec(scale);  // NOTE: a true division, like the torch path
    x = at::vec::clamp(x, fVec(-kFp8Max), fVec(kFp8Max));
#if defined(CPU_CAPABILITY_AVX512)
    alignas(16) Fp8 buf[kVec];
    _mm_store_si128(reinterpret_cast<__m128i*>(buf), at::vec::cvtfp32_fp8e4m3(x));
#else
    alignas(64) float f[kVec];
    x.store(f);
    Fp8 buf[kVec];
    for (int k = 0; k < c; ++k) buf[k] = Fp8(f[k]);
#endif
    std::memcpy(dst + i, buf, c);
  }
}

template <typename T>
void write_rows(const at::Tensor& x, at::Tensor& cache, const int64_t* slots, double scale) {
  const int64_t num_tokens = x.size(0), row = x.size(1) * x.size(2), stride = x.stride(0);
  const T* src = x.data_ptr<T>();
  const bool is_fp8 = cache.scalar_type() == at::kFloat8_e4m3fn;
  char* base = static_cast<char*>(cache.data_ptr());
  const int64_t row_bytes = row * cache.element_size();
  const int64_t num_slots = cache.size(0) * cache.size(1);
  at::parallel_for(0, num_tokens, std::max<int64_t>(1, 32768 / row), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (slots[t] < 0) continue;
      TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " is outside the cache");
      char* dst = base + slots[t] * row_bytes;
      if (is_fp8) {
        quantize_row(src + t * stride, reinterpret_cast<Fp8*>(dst), static_cast<int>(row),
                     static_cast<float>(scale));
      } else {
        std::memcpy(dst, src + t * stride, row_bytes);
      }
    }
  });
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping, double k_scale,
                       double v_scale) {
  for (const at::Tensor* x : {&key, &value}) {
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->stride(1) == x->size(2),
                "key/value must be [T, Hkv, D] with contiguous heads");
  }
  TORCH_CHECK(key.sizes() == value.sizes() && key.scalar_type() == value.scalar_type());
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() &&
              key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2),
              "caches must be contiguous [N, bs, Hkv, D]");
  TORCH_CHECK(key_cache.scalar_type() == key.scalar_type() ||
              key_cache.scalar_type() == at::kFloat8_e4m3fn, "cache dtype mismatch");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == key.size(0), "slot_mapping must be int64 [T]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  MESH_DISPATCH_MODEL_DTYPE(key.scalar_type(), T, [&] {
    write_rows<T>(key, key_cache, slots, k_scale);
    write_rows<T>(value, value_cache, slots, v_scale);
  });
}

}  // namespace mesh_cpu

// Fused elementwise ops of a decoder layer: RMSNorm (with the residual add), SiLU-and-mul, rope.
//
// Each replaces several torch ops (and their temporaries) with one pass over the rows. They
// round where the torch expressions they replace round: in a 16-bit model every intermediate
// that torch would store as a bf16 / fp16 tensor is rounded to that dtype here too (round_to),
// so outputs match the torch path (and HF) in every dtype, not only in fp32.
#include "cpu_common.h"
#include "ops.h"

#include <ATen/ops/empty.h>

#include <algorithm>

namespace mesh_cpu {

namespace {

// Rows of a [rows, D] or [T, H, D] tensor whose last dim is contiguous.
struct Rows {
  char* base; int64_t s0, s1, heads, elem;
  explicit Rows(const at::Tensor& x)
      : base(static_cast<char*>(x.data_ptr())), s0(x.stride(0)),
        s1(x.dim() == 3 ? x.stride(1) : 0), heads(x.dim() == 3 ? x.size(1) : 1),
        elem(x.element_size()) {
    TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1,
                "expected [rows, D] or [T, H, D] with a contiguous last dim");
  }
  template <typename T>
  T* row(int64_t i) const {
    return reinterpret_cast<T*>(base + ((i / heads) * s0 + (i % heads) * s1) * elem);
  }
};

// Rows per parallel task: small batches (decode) stay on the calling thread.
int64_t grain(int64_t row_len) { return std::max<int64_t>(1, 16384 / row_len); }

template <typename T>
void norm_row(const T* x, const T* w, T* out, int n, float eps) {
  fVec ss(0.f);
  for (int i = 0; i < n; i += kVec) {
    const fVec v = load_f32(x + i, std::min(kVec, n - i));
    ss = at::vec::fmadd(v, v, ss);
  }
  const fVec inv(1.f / std::sqrt(hsum(ss) / n + eps));
  for (int i = 0; i < n; i += kVec) {
    const int c = std::min(kVec, n - i);
    // NOTE: HF's order: normalize in fp32, round to the model dtype, then scale by the weight.
    const fVec y = round_to<T>(load_f32(x + i, c) * inv);
    store_f32(out + i, load_f32(w + i, c) * y, c);
  }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const Rows in(x);
  const int n = static_cast<int>(x.size(-1));
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n && weight.dtype() == x.dtype());
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t rows = x.numel() / n;
  MESH_DISPATCH_MODEL_DTYPE(x.scalar_type(), T, [&] {
    const T* w = weight.data_ptr<T>();
    T* o = out.data_ptr<T>();
    at::parallel_for(0, rows, grain(n), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) norm_row(in.row<T>(i), w, o + i * n, n, eps);
    });
  });
  return out;
}

at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() &&
              residual.sizes() == x.sizes() && residual.dtype() == x.dtype());
  const int n = static_cast<int>(x.size(1));
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n && weight.dtype() == x.dtype());
  at::Tensor out = at::empty(x.sizes(), x.options());
  MESH_DISPATCH_MODEL_DTYPE(x.scalar_type(), T, [&] {
    T* xs = x.data_ptr<T>();
    const T* rs = residual.data_ptr<T>();
    const T* w = weight.data_ptr<T>();
    T* o = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), grain(n), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        T* xr = xs + r * n;
        for (int i = 0; i < n; i += kVec) {
          const int c = std::min(kVec, n - i);
          store_f32(xr + i, load_f32(xr + i, c) + load_f32(rs + r * n + i, c), c);
        }
        norm_row(xr, w, o + r * n, n, eps);
      }
    });
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0);
  const int64_t n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({gate_up.size(0), n}, gate_up.options());
  MESH_DISPATCH_MODEL_DTYPE(gate_up.scalar_type(), T, [&] {
    const T* src = gate_up.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, gate_up.size(0), grain(n), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const T* g = src + r * stride;
        for (int64_t i = 0; i < n; i += kVec) {
          const int c = static_cast<int>(std::min<int64_t>(kVec, n - i));
          const fVec x = load_f32(g + i, c);
          // NOTE: torch's silu kernel: x / (1 + exp(-x)), rounded to the dtype before the mul.
          const fVec silu = round_to<T>(x / (fVec(1.f) + x.neg().exp()));
          store_f32(dst + r * n + i, silu * load_f32(g + n + i, c), c);
        }
      }
    });
  });
  return out;
}

void rotary_embedding(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0);
  const int64_t d = x.size(2), half = d / 2, heads = x.size(1), tokens = x.size(0);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->numel() == tokens * d && t->stride(-1) == 1 && t->stride(0) == d &&
                t->dtype() == x.dtype(), "cos / sin must be contiguous [T, (1,) D]");
  }
  const Rows rows(x);
  MESH_DISPATCH_MODEL_DTYPE(x.scalar_type(), T, [&] {
    const T* cs = cos.data_ptr<T>();
    const T* sn = sin.data_ptr<T>();
    at::parallel_for(0, tokens * heads, grain(d), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        T* xr = rows.row<T>(i);
        const T* c = cs + (i / heads) * d;
        const T* s = sn + (i / heads) * d;
        for (int64_t j = 0; j < half; j += kVec) {
          const int n = static_cast<int>(std::min<int64_t>(kVec, half - j));
          const fVec x1 = load_f32(xr + j, n), x2 = load_f32(xr + half + j, n);
          // NOTE: x * cos + roll(x, half) * sin with torch's roundings: each product, then the
          // sum (sin's first half carries rotate_half's minus sign).
          const fVec o1 = round_to<T>(x1 * load_f32(c + j, n)) +
                          round_to<T>(x2 * load_f32(s + j, n));
          const fVec o2 = round_to<T>(x2 * load_f32(c + half + j, n)) +
                          round_to<T>(x1 * load_f32(s + half + j, n));
          store_f32(xr + j, o1, n);
          store_f32(xr + half + j, o2, n);
        }
      }
    });
  });
}

}  // namespace mesh_cpu

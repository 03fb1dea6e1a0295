// What the decode items (attention_decode.cpp) and the rest of paged attention
// (attention.cpp) share: a step's arguments, a thread's scratch, reading cache rows, the
// score and softmax steps on rows of scores, and P @ V.
#pragma once

#include "attention.h"

#include <algorithm>
#include <limits>

namespace mesh_cpu::attn {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Args {
  const char* query; int64_t q_stride; at::ScalarType q_dtype;
  char* out; int64_t out_stride;
  const char* key_cache; const char* value_cache; at::ScalarType cache_dtype;
  int64_t elem_size, cache_elem_size;
  const int32_t* block_table; int64_t bt_stride, bt_rows, bt_cols;
  int64_t num_tokens;
  int num_kv_heads, group, head_dim, block_size;
  int64_t num_blocks;
  float q_scale, v_scale;
  float* partials;
  int window;      // kNoWindow: none
  float soft_cap;  // 0: none
  bool batch_invariant;  // fp32 items: one way for every item height (attention.cpp)
};

constexpr int kNoWindow = 1 << 30;
// Keys of a decode item per online-softmax step: scores of every row over this many keys,
// one softmax update, then P @ V (attention_decode.cpp).
// NOTE: 16 keys a step, each row's max, exp, sum and rescaling once per 16 keys and every V
// row loaded once per query row, with no prefetch: 11.4 ms (bf16) and 15.4 ms (fp32) a
// step's attention for 32 x 150-token decodes on 2 AMX Xeon cores; this way, 8.7 and 13.6
// (benchmarks/decode_attention.py, one run). Neither change alone gained.
constexpr int kDecodeKeys = 256;
// Accumulators (vectors) P @ V keeps in registers: of 32 with AVX-512, 16 with AVX2.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kAccRegs = 24;
#else
constexpr int kAccRegs = 12;
#endif

struct Scratch {
  std::vector<float> q, acc, s, m, l, corr, pos, lo, kbuf, vbuf, zero;
  std::vector<int64_t> off;
  Scratch(int rows, int d)
      : q(rows * d), acc(rows * d), s(rows * kDecodeKeys), m(rows), l(rows), corr(rows),
        pos(rows), lo(rows), kbuf(kVec * d), vbuf(kVec * d), zero(d, 0.f), off(kDecodeKeys) {}
};

inline void load_row(const Args& a, int token, int head, float* dst) {
  const char* src = a.query + (token * a.q_stride + head * a.head_dim) * a.elem_size;
  MESH_DISPATCH_MODEL_DTYPE(a.q_dtype, T, [&] {
    row_to_f32(reinterpret_cast<const T*>(src), dst, a.head_dim, a.q_scale);
  });
}

inline void store_row(const Args& a, int token, int head, const float* src, float mul) {
  char* dst = a.out + (token * a.out_stride + head * a.head_dim) * a.elem_size;
  MESH_DISPATCH_MODEL_DTYPE(a.q_dtype, T, [&] {
    for (int i = 0; i < a.head_dim; i += kVec) {
      store_f32(reinterpret_cast<T*>(dst) + i, fVec::loadu(src + i) * fVec(mul));
    }
  });
}

// Element offsets of keys [c0, c0 + n)'s cache rows (KV head 0): the block table is read once
// per chunk for every head, with no integer division per key.
inline void row_offsets(const Args& a, const int32_t* bt, int c0, int n, int64_t* off) {
  const int64_t row_elems = static_cast<int64_t>(a.num_kv_heads) * a.head_dim;
  int block_index = c0 / a.block_size, slot = c0 % a.block_size;
  for (int t = 0; t < n; ++t, ++slot) {
    if (slot == a.block_size) slot = 0, ++block_index;
    TORCH_CHECK(block_index < a.bt_cols, "key ", c0 + t, " is past the block table");
    const int64_t block = bt[block_index];
    TORCH_CHECK(block >= 0 && block < a.num_blocks, "block ", block, " is outside the cache");
    off[t] = (block * a.block_size + slot) * row_elems;
  }
}

// Row pointers of KV head `kv_head` of `cache` at the rows `off` (n of them, padded to kVec
// with a zero row), as fp32: fp32 rows in place, others converted into `buf`.
template <typename TC>
void cache_rows(const Args& a, const char* cache, const int64_t* off, int kv_head, int n,
                const float** rows, std::vector<float>& buf, const float* zero) {
  const TC* c = reinterpret_cast<const TC*>(cache) + kv_head * a.head_dim;
  for (int t = 0; t < n; ++t) {
    if constexpr (std::is_same_v<TC, float>) {
      rows[t] = c + off[t];
    } else {
      float* dst = buf.data() + t * a.head_dim;
      row_to_f32(c + off[t], dst, a.head_dim, 1.f);
      rows[t] = dst;
    }
  }
  for (int t = n; t < kVec; ++t) rows[t] = zero;
}

// Rows of one cache (key: a.key_cache into sc.kbuf, else value) as fp32 row pointers.
inline void gather_one(const Args& a, bool key, const int64_t* off, int kv_head, int n,
                const float** rows, Scratch& sc) {
  MESH_DISPATCH_CACHE_DTYPE(a.cache_dtype, TC, [&] {
    cache_rows<TC>(a, key ? a.key_cache : a.value_cache, off, kv_head, n, rows,
                   key ? sc.kbuf : sc.vbuf, sc.zero.data());
  });
}

inline void gather(const Args& a, const int64_t* off, int kv_head, int n, const float** krow,
            const float** vrow, Scratch& sc) {
  gather_one(a, true, off, kv_head, n, krow, sc);
  gather_one(a, false, off, kv_head, n, vrow, sc);
}

inline float soft_capped(float x, float cap) { return cap * std::tanh(x / cap); }

#if defined(CPU_CAPABILITY_AVX512)
// Lane t of the result = the sum of v[t]'s 16 lanes: 16 horizontal sums in 45 shuffles and
// adds (a tree of unpack/shuffle + add) instead of 16 x 8 dependent ones.
inline __m512 transpose_sum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [v0 02, v1 02, v0 13, v1 13]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sum of v[4i .. 4i + 3]
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i) {  // 128-bit lanes: [b0 01, b0 23, b1 01, b1 23]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
#endif

// Scores of keys at or before lo[r] masked, the others soft-capped (where a cap is set).
// NOTE: a second pass, only where a cap or a window edge applies: in the score loops the
// extra tests cost plain decodes ~18% (measured, 32 x 1024 keys, 1 thread).
inline void cap_and_mask_window(int rows, int n, int c0, const float* lo, int max_lo,
                                float soft_cap, float* s, int ld) {
  if (soft_cap == 0.f && c0 > max_lo) return;
  for (int r = 0; r < rows; ++r) {
    for (int t = 0; t < n; ++t) {
      float& score = s[r * ld + t];
      if (static_cast<float>(c0 + t) <= lo[r]) {
        score = kNegInf;
      } else if (soft_cap > 0.f && score != kNegInf) {
        score = soft_capped(score, soft_cap);
      }
    }
  }
}

// S[r][t] = s[r * ld + t] = q_r . k_t for t < n (t < kVec); -inf where key c0 + t is after
// row r's last visible key or at or before lo[r] (the window's edge; max_lo: the largest lo).
template <int NV>
void scores_rows(const float* q, int rows, const float* const* krow, int n, int c0,
                 const float* pos, const float* lo, int max_lo, float soft_cap, float* s,
                 int ld) {
  constexpr int D = NV * kVec;
#if defined(CPU_CAPABILITY_AVX512)
  // Keys in lanes: each row's kVec dot products as vectors, summed by one transpose tree.
  const fVec keys = fVec::arange(static_cast<float>(c0), 1.f);
  for (int r = 0; r < rows; ++r) {
    const float* qr = q + r * D;
    fVec qv[NV];
    for (int j = 0; j < NV; ++j) qv[j] = fVec::loadu(qr + j * kVec);
    __m512 acc[kVec];
    for (int t = 0; t < kVec; ++t) {
      fVec a = qv[0] * fVec::loadu(krow[t]);
      for (int j = 1; j < NV; ++j) a = at::vec::fmadd(qv[j], fVec::loadu(krow[t] + j * kVec), a);
      acc[t] = a;
    }
    // Keys past n are the zero row: masked with those after the row's position.
    const fVec limit(std::min(pos[r], static_cast<float>(c0 + n - 1)));
    fVec::blendv(fVec(transpose_sum16(acc)), fVec(kNegInf), keys > limit).store(s + r * ld);
  }
#else
  for (int t = 0; t < n; ++t) {
    fVec k[NV];
    for (int j = 0; j < NV; ++j) k[j] = fVec::loadu(krow[t] + j * kVec);
    for (int r = 0; r < rows; ++r) {
      const float* qr = q + r * D;
      fVec acc = fVec::loadu(qr) * k[0];
      for (int j = 1; j < NV; ++j) acc = at::vec::fmadd(fVec::loadu(qr + j * kVec), k[j], acc);
      s[r * ld + t] = c0 + t > pos[r] ? kNegInf : hsum(acc);
    }
  }
  for (int r = 0; r < rows; ++r) std::fill(s + r * ld + n, s + r * ld + kVec, kNegInf);
#endif
  cap_and_mask_window(rows, n, c0, lo, max_lo, soft_cap, s, ld);
}

// Rows [r0, r0 + rows) of the online softmax over `width` scores each (a multiple of kVec,
// masked keys -inf), s[(r - r0) * ld + t]: the scores become p, corr[r] the factor the row's
// accumulator takes first.
inline void softmax_rows(float* s, int ld, int width, int r0, int rows, Scratch& sc) {
  for (int r = r0; r < r0 + rows; ++r) {
    float* sr = s + (r - r0) * ld;
    fVec mv(kNegInf);
    for (int t = 0; t < width; t += kVec) mv = at::vec::maximum(mv, fVec::loadu(sr + t));
    const float m_new = std::max(sc.m[r], hmax(mv));
    if (m_new == kNegInf) {  // nothing visible yet: keep the row empty
      sc.corr[r] = 1.f;
      std::fill(sr, sr + width, 0.f);
      continue;
    }
    sc.corr[r] = std::exp(sc.m[r] - m_new);
    fVec sum(0.f);
    for (int t = 0; t < width; t += kVec) {
      const fVec p = (fVec::loadu(sr + t) - fVec(m_new)).exp();
      p.store(sr + t);
      sum = sum + p;
    }
    sc.l[r] = sc.l[r] * sc.corr[r] + hsum(sum);
    sc.m[r] = m_new;
  }
}

// acc[r] = acc[r] (* corr[r] unless corr is null) + sum_t p(r, t) v_t for R rows, with
// p(r, t) = p[r * sr + t * st]. Keys outer: each V row is loaded once for the R rows.
template <int NV, int R>
void accumulate_v_tile(float* acc, const float* p, int sr, int st, const float* const* vrow,
                       int n, const float* corr) {
  constexpr int D = NV * kVec;
  fVec a[R][NV];
  for (int r = 0; r < R; ++r) {
    const fVec c(corr ? corr[r] : 1.f);
    for (int j = 0; j < NV; ++j) a[r][j] = fVec::loadu(acc + r * D + j * kVec) * c;
  }
  for (int t = 0; t < n; ++t) {
    fVec v[NV];
    for (int j = 0; j < NV; ++j) v[j] = fVec::loadu(vrow[t] + j * kVec);
    for (int r = 0; r < R; ++r) {
      const fVec pb(p[r * sr + t * st]);
      for (int j = 0; j < NV; ++j) a[r][j] = at::vec::fmadd(pb, v[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) a[r][j].store(acc + r * D + j * kVec);
}

// accumulate_v_tile over `rows` rows: tiles of R, the rest one shorter tile.
template <int NV, int R = std::max(1, kAccRegs / NV)>
void accumulate_v(float* acc, int rows, const float* p, int sr, int st,
                  const float* const* vrow, int n, const float* corr) {
  constexpr int D = NV * kVec;
  int r = 0;
  for (; r + R <= rows; r += R)
    accumulate_v_tile<NV, R>(acc + r * D, p + r * sr, sr, st, vrow, n, corr ? corr + r : nullptr);
  if constexpr (R > 1) {
    if (r < rows)
      accumulate_v<NV, R - 1>(acc + r * D, rows - r, p + r * sr, sr, st, vrow, n,
                              corr ? corr + r : nullptr);
  }
}

// Zeroes the accumulators of `rows` rows and starts the online softmax of `rows_p` (max -inf,
// sum 0).
inline void start_rows(Scratch& sc, int rows, int rows_p, int d) {
  std::fill(sc.acc.begin(), sc.acc.begin() + rows * d, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + rows_p, kNegInf);
  std::fill(sc.l.begin(), sc.l.begin() + rows_p, 0.f);
}

// A decode item (kAllKvHeads): attention_decode.cpp.
template <int NV>
void run_decode_item(const Args& a, const int32_t* it, Scratch& sc);

// A prefill item's accumulators in bf16 products (AMX tiles or AVX512-BF16), where
// prefill_in_bf16(a) (attention_prefill_bf16.cpp).
bool prefill_in_bf16(const Args& a);
void run_prefill_item_bf16(const Args& a, const int32_t* it, Scratch& sc);

}  // namespace mesh_cpu::attn

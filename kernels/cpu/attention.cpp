// Paged attention over the KV cache in place: no gather copy, no padding to the longest context.
//
// Each work item (attention_plan.cpp) holds R = query tokens x group rows: the query heads of
// one KV head (a decode item: of every KV head, taken head by head per chunk, so the chunk's
// cache rows are read whole). Keys are visited in chunks of kVec tokens; each chunk's K/V rows
// are found through the block table once (fp32 caches are read in place; bf16 / fp16 / fp8
// rows are converted to fp32 once, into L1). Per chunk: scores, an online-softmax update
// (running max and sum per row, accumulators rescaled), then acc += p @ V. Scores come from
// one of two layouts:
// - few rows (decodes): S[row][key], keys in vector lanes: per row kVec dot-product vectors,
//   summed by one transpose tree (AVX-512; AVX2 sums each);
// - R a multiple of kVec (prefill tiles): Q transposed once per item, S[key][row], rows in
//   lanes, so each score vector is D broadcast-FMAs with no horizontal sums.
// All math is fp32; the softmax uses Sleef's 1-ulp exp (torch's own). Where the CPU has
// AVX-512 BF16, a bf16 decode item reads its bf16 query and cache rows as they are
// (vdpbf16ps: pairs multiplied exactly, summed in fp32), with P rounded to bf16 for P @ V
// as flash attention does: no conversion pass, half the instructions.
// A sliding window (query at p sees keys p - window < j <= p): the plan starts each item's keys
// at the first one its first row sees (a plan made for that window; with another, the loop
// starts there anyway), later rows mask the keys before theirs. A soft-cap (Gemma 2) turns
// scores into cap * tanh(score / cap) before masking.
#include "attention.h"

#include <algorithm>
#include <limits>

namespace mesh_cpu {

namespace {

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
};

constexpr int kNoWindow = 1 << 30;

struct Scratch {
  std::vector<float> q, acc, s, m, l, corr, pos, lo, kbuf, vbuf, zero;
  Scratch(int rows, int d)
      : q(rows * d), acc(rows * d), s(rows * kVec), m(rows), l(rows), corr(rows), pos(rows),
        lo(rows), kbuf(kVec * d), vbuf(kVec * d), zero(d, 0.f) {}
};

void load_row(const Args& a, int token, int head, float* dst) {
  const char* src = a.query + (token * a.q_stride + head * a.head_dim) * a.elem_size;
  MESH_DISPATCH_MODEL_DTYPE(a.q_dtype, T, [&] {
    row_to_f32(reinterpret_cast<const T*>(src), dst, a.head_dim, a.q_scale);
  });
}

void store_row(const Args& a, int token, int head, const float* src, float mul) {
  char* dst = a.out + (token * a.out_stride + head * a.head_dim) * a.elem_size;
  MESH_DISPATCH_MODEL_DTYPE(a.q_dtype, T, [&] {
    for (int i = 0; i < a.head_dim; i += kVec) {
      store_f32(reinterpret_cast<T*>(dst) + i, fVec::loadu(src + i) * fVec(mul));
    }
  });
}

// Element offsets of keys [c0, c0 + n)'s cache rows (KV head 0): the block table is read once
// per chunk for every head, with no integer division per key.
void row_offsets(const Args& a, const int32_t* bt, int c0, int n, int64_t* off) {
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

void gather(const Args& a, const int64_t* off, int kv_head, int n, const float** krow,
            const float** vrow, Scratch& sc) {
  MESH_DISPATCH_CACHE_DTYPE(a.cache_dtype, TC, [&] {
    cache_rows<TC>(a, a.key_cache, off, kv_head, n, krow, sc.kbuf, sc.zero.data());
    cache_rows<TC>(a, a.value_cache, off, kv_head, n, vrow, sc.vbuf, sc.zero.data());
  });
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
void cap_and_mask_window(int rows, int n, int c0, const float* lo, int max_lo, float soft_cap,
                         float* s) {
  if (soft_cap == 0.f && c0 > max_lo) return;
  for (int r = 0; r < rows; ++r) {
    for (int t = 0; t < n; ++t) {
      float& score = s[r * kVec + t];
      if (static_cast<float>(c0 + t) <= lo[r]) {
        score = kNegInf;
      } else if (soft_cap > 0.f && score != kNegInf) {
        score = soft_capped(score, soft_cap);
      }
    }
  }
}

// S[r][t] = q_r . k_t for t < n; -inf where key c0 + t is after row r's last visible key or
// at or before lo[r] (the window's edge; max_lo: the largest lo).
template <int NV>
void scores_rows(const float* q, int rows, const float* const* krow, int n, int c0,
                 const float* pos, const float* lo, int max_lo, float soft_cap, float* s) {
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
    fVec::blendv(fVec(transpose_sum16(acc)), fVec(kNegInf), keys > limit).store(s + r * kVec);
  }
#else
  for (int t = 0; t < n; ++t) {
    fVec k[NV];
    for (int j = 0; j < NV; ++j) k[j] = fVec::loadu(krow[t] + j * kVec);
    for (int r = 0; r < rows; ++r) {
      const float* qr = q + r * D;
      fVec acc = fVec::loadu(qr) * k[0];
      for (int j = 1; j < NV; ++j) acc = at::vec::fmadd(fVec::loadu(qr + j * kVec), k[j], acc);
      s[r * kVec + t] = c0 + t > pos[r] ? kNegInf : hsum(acc);
    }
  }
  for (int r = 0; r < rows; ++r) std::fill(s + r * kVec + n, s + (r + 1) * kVec, kNegInf);
#endif
  cap_and_mask_window(rows, n, c0, lo, max_lo, soft_cap, s);
}

// Rows [r0, r0 + rows) of the online softmax; s holds their scores from row r0 on.
void softmax_rows(float* s, int r0, int rows, Scratch& sc) {
  s -= r0 * kVec;
  for (int r = r0; r < r0 + rows; ++r) {
    const fVec sv = fVec::loadu(s + r * kVec);
    const float m_new = std::max(sc.m[r], hmax(sv));
    if (m_new == kNegInf) {  // nothing visible yet: keep the row empty
      sc.corr[r] = 1.f;
      fVec(0.f).store(s + r * kVec);
      continue;
    }
    sc.corr[r] = std::exp(sc.m[r] - m_new);
    const fVec p = (sv - fVec(m_new)).exp();
    p.store(s + r * kVec);
    sc.l[r] = sc.l[r] * sc.corr[r] + hsum(p);
    sc.m[r] = m_new;
  }
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define MESH_BF16_DOT 1
alignas(64) constexpr uint16_t kZeroBf16Row[16 * kVec] = {};   // the longest head_dim

// S[r][t] = scale * q_r . k_t from bf16 queries and bf16 cache rows in place: vdpbf16ps
// multiplies pairs exactly and sums them in fp32, so K is never converted, and a score costs
// half the instructions of fp32 FMAs. -inf where key c0 + t is after row r's last visible one.
template <int NV>
void scores_rows_bf16(const BFloat16* q, int rows, const BFloat16* const* krow, int n, int c0,
                      const float* pos, float scale, float* s) {
  static_assert(NV % 2 == 0, "vdpbf16ps takes 32 bf16 per vector");
  constexpr int D = NV * kVec, NB = NV / 2;
  auto load = [](const BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); };
  const fVec keys = fVec::arange(static_cast<float>(c0), 1.f);
  for (int r = 0; r < rows; ++r) {
    __m512bh qv[NB];
    for (int j = 0; j < NB; ++j) qv[j] = load(q + r * D + j * 2 * kVec);
    __m512 acc[kVec];
    for (int t = 0; t < kVec; ++t) {
      __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], load(krow[t]));
      for (int j = 1; j < NB; ++j) a = _mm512_dpbf16_ps(a, qv[j], load(krow[t] + j * 2 * kVec));
      acc[t] = a;
    }
    const fVec limit(std::min(pos[r], static_cast<float>(c0 + n - 1)));
    fVec::blendv(fVec(transpose_sum16(acc)) * fVec(scale), fVec(kNegInf), keys > limit)
        .store(s + r * kVec);
  }
}

// acc[r] = acc[r] * corr[r] + sum_t p(r, t) v_t (p: S's rows, masked keys 0) from bf16 V rows
// in place: p rounded to bf16 (as flash attention's P @ V), two keys per vdpbf16ps, whose
// operands are the two rows' elements interleaved. acc's lanes are then in that interleave's
// order: bf16_lanes_to_dims puts them back.
template <int NV>
void accumulate_v_bf16(float* acc, int rows, const float* p, const BFloat16* const* vrow,
                       const float* corr) {
  constexpr int D = NV * kVec, NB = NV / 2;
  for (int r = 0; r < rows; ++r) {
    __m512 a[NV];
    const __m512 c = _mm512_set1_ps(corr[r]);
    for (int j = 0; j < NV; ++j) a[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + j * kVec), c);
    alignas(32) uint32_t pairs[kVec / 2];   // (p[2i], p[2i + 1]) as two bf16
    _mm256_store_si256(reinterpret_cast<__m256i*>(pairs),
                       (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + r * kVec)));
    for (int t = 0; t < kVec; t += 2) {
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[t / 2]));
      for (int j = 0; j < NB; ++j) {
        const __m512i x = _mm512_loadu_si512(vrow[t] + j * 2 * kVec);
        const __m512i y = _mm512_loadu_si512(vrow[t + 1] + j * 2 * kVec);
        a[2 * j] = _mm512_dpbf16_ps(a[2 * j], (__m512bh)_mm512_unpacklo_epi16(x, y), pp);
        a[2 * j + 1] = _mm512_dpbf16_ps(a[2 * j + 1], (__m512bh)_mm512_unpackhi_epi16(x, y), pp);
      }
    }
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + r * D + j * kVec, a[j]);
  }
}

// accumulate_v_bf16's lane order -> dimension order. Per 32 dimensions d0.., its two vectors
// hold, per 128-bit lane k: d0 + 8k + 0..3 (unpacklo) and d0 + 8k + 4..7 (unpackhi).
template <int NV>
void bf16_lanes_to_dims(float* acc, int rows) {
  constexpr int D = NV * kVec;
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < NV; j += 2) {
      float* x = acc + r * D + j * kVec;
      const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + kVec);
      _mm512_storeu_ps(x, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_storeu_ps(x + kVec, _mm512_permutex2var_ps(lo, second, hi));
    }
  }
}

// KV head h's rows (r0 = h * group ..) of a decode chunk, from the bf16 query and cache rows
// in place; acc is left in accumulate_v_bf16's lane order.
template <int NV>
void decode_chunk_bf16(const Args& a, int q0, int h, const int64_t* off, int n, int c0,
                       int max_lo, Scratch& sc) {
  constexpr int D = NV * kVec;
  const int G = a.group, r0 = h * G;
  const auto* q = reinterpret_cast<const BFloat16*>(a.query) + q0 * a.q_stride + r0 * D;
  const auto* kc = reinterpret_cast<const BFloat16*>(a.key_cache) + h * D;
  const auto* vc = reinterpret_cast<const BFloat16*>(a.value_cache) + h * D;
  const auto* zero = reinterpret_cast<const BFloat16*>(kZeroBf16Row);
  const BFloat16* kb[kVec];
  const BFloat16* vb[kVec];
  for (int t = 0; t < kVec; ++t) {
    kb[t] = t < n ? kc + off[t] : zero;
    vb[t] = t < n ? vc + off[t] : zero;
  }
  float* s = sc.s.data() + r0 * kVec;
  scores_rows_bf16<NV>(q, G, kb, n, c0, sc.pos.data() + r0, a.q_scale, s);
  cap_and_mask_window(G, n, c0, sc.lo.data() + r0, max_lo, a.soft_cap, s);
  softmax_rows(s, r0, G, sc);
  accumulate_v_bf16<NV>(sc.acc.data() + r0 * D, G, s, vb, sc.corr.data() + r0);
}
#else
#define MESH_BF16_DOT 0
#endif

// S[t][r] = q_r . k_t with rows in vector lanes (qt is Q transposed: [D][rows]); keys after
// pos[r] or at or before lo[r] masked, unless the whole chunk is visible to every row.
template <int NV>
void scores_cols(const float* qt, int rows, const float* const* krow, int c0, int min_pos,
                 int max_lo, const float* pos, const float* lo, float soft_cap, float* s) {
  constexpr int D = NV * kVec;
  for (int rv = 0; rv < rows; rv += kVec) {
    for (int t = 0; t < kVec; t += 4) {
      const float *k0 = krow[t], *k1 = krow[t + 1], *k2 = krow[t + 2], *k3 = krow[t + 3];
      fVec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
      for (int d = 0; d < D; ++d) {
        const fVec qv = fVec::loadu(qt + d * rows + rv);
        a0 = at::vec::fmadd(qv, fVec(k0[d]), a0);
        a1 = at::vec::fmadd(qv, fVec(k1[d]), a1);
        a2 = at::vec::fmadd(qv, fVec(k2[d]), a2);
        a3 = at::vec::fmadd(qv, fVec(k3[d]), a3);
      }
      a0.store(s + t * rows + rv);
      a1.store(s + (t + 1) * rows + rv);
      a2.store(s + (t + 2) * rows + rv);
      a3.store(s + (t + 3) * rows + rv);
    }
    if (soft_cap > 0.f) {
      const fVec inv(1.f / soft_cap), cap(soft_cap);
      for (int t = 0; t < kVec; ++t) {
        ((fVec::loadu(s + t * rows + rv) * inv).tanh() * cap).store(s + t * rows + rv);
      }
    }
    if (c0 + kVec - 1 <= min_pos && c0 > max_lo) continue;  // every row sees the whole chunk
    const fVec pv = fVec::loadu(pos + rv);
    const fVec lv = fVec::loadu(lo + rv);
    for (int t = 0; t < kVec; ++t) {
      const fVec sv = fVec::loadu(s + t * rows + rv);
      const fVec key(static_cast<float>(c0 + t));
      fVec::blendv(sv, fVec(kNegInf), (pv < key) | (lv >= key)).store(s + t * rows + rv);
    }
  }
}

void softmax_cols(float* s, int rows, Scratch& sc) {
  for (int rv = 0; rv < rows; rv += kVec) {
    fVec m_chunk(kNegInf);
    for (int t = 0; t < kVec; ++t) m_chunk = at::vec::maximum(m_chunk, fVec::loadu(s + t * rows + rv));
    const fVec m_old = fVec::loadu(sc.m.data() + rv);
    const fVec m_new = at::vec::maximum(m_old, m_chunk);
    fVec sum(0.f);
    // NOTE: a row may see no key of its first chunks (the window starts later for it): its
    // max stays -inf, and exp against 0 instead keeps its p, corr, l at 0 rather than NaN.
    const fVec m_safe = fVec::blendv(m_new, fVec(0.f), m_new == fVec(kNegInf));
    for (int t = 0; t < kVec; ++t) {
      const fVec p = (fVec::loadu(s + t * rows + rv) - m_safe).exp();
      p.store(s + t * rows + rv);
      sum = sum + p;
    }
    const fVec corr = (m_old - m_safe).exp();
    (fVec::loadu(sc.l.data() + rv) * corr + sum).store(sc.l.data() + rv);
    m_new.store(sc.m.data() + rv);
    corr.store(sc.corr.data() + rv);
  }
}

// acc[r] = acc[r] * corr[r] + sum_t p(r, t) v_t, with p(r, t) = p[r * sr + t * st].
template <int NV>
void accumulate_v(float* acc, int rows, const float* p, int sr, int st,
                  const float* const* vrow, int n, const float* corr) {
  constexpr int D = NV * kVec;
  for (int r = 0; r < rows; ++r) {
    fVec a[NV];
    const fVec c(corr[r]);
    for (int j = 0; j < NV; ++j) a[j] = fVec::loadu(acc + r * D + j * kVec) * c;
    for (int t = 0; t < n; ++t) {
      const fVec pb(p[r * sr + t * st]);
      for (int j = 0; j < NV; ++j) a[j] = at::vec::fmadd(pb, fVec::loadu(vrow[t] + j * kVec), a[j]);
    }
    for (int j = 0; j < NV; ++j) a[j].store(acc + r * D + j * kVec);
  }
}

// Zeroes the accumulators of `rows` rows and starts the online softmax of `rows_p` (max -inf,
// sum 0).
void start_rows(Scratch& sc, int rows, int rows_p, int d) {
  std::fill(sc.acc.begin(), sc.acc.begin() + rows * d, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + rows_p, kNegInf);
  std::fill(sc.l.begin(), sc.l.begin() + rows_p, 0.f);
}

template <int NV>
void run_item(const Args& a, const int32_t* it, Scratch& sc) {
  constexpr int D = NV * kVec;
  const int kv_head = it[kKvHead], q0 = it[kQBegin], G = a.group;
  const int kv0 = it[kKvBegin], kv1 = it[kKvEnd];
  const int rows = (it[kQEnd] - q0) * G;
  TORCH_CHECK(it[kReq] < a.bt_rows && it[kQEnd] <= a.num_tokens && rows > 0,
              "attention plan does not fit this step's tensors");
  // Rows in lanes once they fill most of a vector (prefill tiles); padded rows are zero queries.
  const bool by_cols = rows > kVec / 2;
  const int rows_p = by_cols ? (rows + kVec - 1) / kVec * kVec : rows;
  // A row sees keys up to its own position, and none past this item's key range; none at or
  // before its position - window either (lo), so keys start at the first row's first one.
  const int min_pos = std::min(it[kPos0], kv1 - 1);
  const int max_lo = it[kPos0] + (rows - 1) / G - a.window;
  const int kv_first = std::max(kv0, it[kPos0] - a.window + 1);
  if (by_cols) std::fill(sc.q.begin(), sc.q.begin() + rows_p * D, 0.f);
  for (int r = 0; r < rows_p; ++r) {
    const int position = it[kPos0] + std::min(r, rows - 1) / G;
    sc.pos[r] = static_cast<float>(std::min(position, kv1 - 1));
    sc.lo[r] = static_cast<float>(position - a.window);
    if (r >= rows) continue;
    float* qr = sc.acc.data() + r * D;  // staging: acc is zeroed below
    load_row(a, q0 + r / G, kv_head * G + r % G, qr);
    if (by_cols) {
      for (int d = 0; d < D; ++d) sc.q[d * rows_p + r] = qr[d];
    } else {
      std::copy(qr, qr + D, sc.q.data() + r * D);
    }
  }
  start_rows(sc, rows, rows_p, D);
  const int32_t* bt = a.block_table + it[kReq] * a.bt_stride;
  const float* krow[kVec];
  const float* vrow[kVec];
  int64_t off[kVec];
  float* s = sc.s.data();
  for (int c0 = kv_first; c0 < kv1; c0 += kVec) {
    const int n = std::min(kVec, kv1 - c0);
    row_offsets(a, bt, c0, n, off);
    gather(a, off, kv_head, n, krow, vrow, sc);
    if (by_cols) {
      scores_cols<NV>(sc.q.data(), rows_p, krow, c0, min_pos, max_lo, sc.pos.data(),
                      sc.lo.data(), a.soft_cap, s);
      softmax_cols(s, rows_p, sc);
      accumulate_v<NV>(sc.acc.data(), rows, s, 1, rows_p, vrow, n, sc.corr.data());
    } else {
      scores_rows<NV>(sc.q.data(), rows, krow, n, c0, sc.pos.data(), sc.lo.data(), max_lo,
                      a.soft_cap, s);
      softmax_rows(s, 0, rows, sc);
      accumulate_v<NV>(sc.acc.data(), rows, s, kVec, 1, vrow, n, sc.corr.data());
    }
  }
  if (it[kPartial] < 0) {
    for (int r = 0; r < rows; ++r) {
      store_row(a, q0 + r / G, kv_head * G + r % G, sc.acc.data() + r * D,
                a.v_scale / sc.l[r]);
    }
    return;
  }
  float* part = a.partials + static_cast<int64_t>(it[kPartial]) * G * (D + 2);
  std::copy(sc.acc.begin(), sc.acc.begin() + G * D, part);
  std::copy(sc.m.begin(), sc.m.begin() + G, part + G * D);
  std::copy(sc.l.begin(), sc.l.begin() + G, part + G * D + G);
}

// A decode item: one query token, every KV head (kAllKvHeads). Per chunk of keys, head by
// head, so the chunk's K/V rows are read whole and in order (a row holds every head).
template <int NV>
void run_decode_item(const Args& a, const int32_t* it, Scratch& sc) {
  constexpr int D = NV * kVec;
  const int G = a.group, H = a.num_kv_heads, rows = G * H, q0 = it[kQBegin];
  const int kv0 = it[kKvBegin], kv1 = it[kKvEnd], position = it[kPos0];
  TORCH_CHECK(it[kReq] < a.bt_rows && q0 < a.num_tokens && it[kQEnd] == q0 + 1,
              "attention plan does not fit this step's tensors");
  const int max_lo = position - a.window;
  const int kv_first = std::max(kv0, position - a.window + 1);
  // bf16 queries against a bf16 cache: both read as they are (decode_chunk_bf16).
  const bool dot_bf16 = MESH_BF16_DOT && NV % 2 == 0 && a.q_dtype == at::kBFloat16 &&
                        a.cache_dtype == at::kBFloat16;
  for (int r = 0; r < rows; ++r) {  // row r: query head r, of KV head r / G
    sc.pos[r] = static_cast<float>(std::min(position, kv1 - 1));
    sc.lo[r] = static_cast<float>(max_lo);
    if (!dot_bf16) load_row(a, q0, r, sc.q.data() + r * D);
  }
  start_rows(sc, rows, rows, D);
  const int32_t* bt = a.block_table + it[kReq] * a.bt_stride;
  const float* krow[kVec];
  const float* vrow[kVec];
  int64_t off[kVec];
  for (int c0 = kv_first; c0 < kv1; c0 += kVec) {
    const int n = std::min(kVec, kv1 - c0);
    row_offsets(a, bt, c0, n, off);
    for (int h = 0; h < H; ++h) {
#if MESH_BF16_DOT
      if constexpr (NV % 2 == 0) {
        if (dot_bf16) {
          decode_chunk_bf16<NV>(a, q0, h, off, n, c0, max_lo, sc);
          continue;
        }
      }
#endif
      const int r0 = h * G;
      float* s = sc.s.data() + r0 * kVec;
      gather(a, off, h, n, krow, vrow, sc);
      scores_rows<NV>(sc.q.data() + r0 * D, G, krow, n, c0, sc.pos.data() + r0,
                      sc.lo.data() + r0, max_lo, a.soft_cap, s);
      softmax_rows(s, r0, G, sc);
      accumulate_v<NV>(sc.acc.data() + r0 * D, G, s, kVec, 1, vrow, n, sc.corr.data() + r0);
    }
  }
#if MESH_BF16_DOT
  if constexpr (NV % 2 == 0) {
    if (dot_bf16) bf16_lanes_to_dims<NV>(sc.acc.data(), rows);
  }
#endif
  if (it[kPartial] < 0) {
    for (int r = 0; r < rows; ++r) store_row(a, q0, r, sc.acc.data() + r * D, a.v_scale / sc.l[r]);
    return;
  }
  for (int h = 0; h < H; ++h) {
    float* part = a.partials + (static_cast<int64_t>(it[kPartial]) * H + h) * G * (D + 2);
    std::copy(sc.acc.begin() + h * G * D, sc.acc.begin() + (h + 1) * G * D, part);
    std::copy(sc.m.begin() + h * G, sc.m.begin() + (h + 1) * G, part + G * D);
    std::copy(sc.l.begin() + h * G, sc.l.begin() + (h + 1) * G, part + G * D + G);
  }
}

// Combines the splits of one decode row: out = sum_i acc_i e^(m_i - M) / sum_i l_i e^(m_i - M).
void merge(const Args& a, const int32_t* mg, Scratch& sc) {
  const int G = a.group, D = a.head_dim, num_splits = mg[3];
  const int64_t part_size = G * (D + 2);
  // Split i's partial of this KV head (mg[1]): see kAllKvHeads.
  auto partial = [&](int i) {
    return a.partials + (static_cast<int64_t>(mg[2] + i) * a.num_kv_heads + mg[1]) * part_size;
  };
  for (int g = 0; g < G; ++g) {
    float m_max = kNegInf, sum = 0.f;
    for (int i = 0; i < num_splits; ++i) m_max = std::max(m_max, partial(i)[G * D + g]);
    float* acc = sc.acc.data();
    std::fill(acc, acc + D, 0.f);
    for (int i = 0; i < num_splits; ++i) {
      const float* part = partial(i);
      const float w = std::exp(part[G * D + g] - m_max);
      sum += part[G * D + G + g] * w;
      for (int d = 0; d < D; d += kVec) {
        at::vec::fmadd(fVec::loadu(part + g * D + d), fVec(w), fVec::loadu(acc + d)).store(acc + d);
      }
    }
    store_row(a, mg[0], mg[1] * G + g, acc, a.v_scale / sum);
  }
}

template <int NV>
void run_all(const Args& a, const at::Tensor& items, const at::Tensor& bounds,
             const at::Tensor& merges) {
  const int32_t* it = items.data_ptr<int32_t>();
  const int32_t* bd = bounds.data_ptr<int32_t>();
  const int max_rows = std::max((a.group * kPrefillTile + kVec - 1) / kVec * kVec,
                                a.group * a.num_kv_heads);
  at::parallel_for(0, bounds.numel() - 1, 1, [&](int64_t begin, int64_t end) {
    Scratch sc(max_rows, a.head_dim);
    for (int64_t p = begin; p < end; ++p) {
      for (int i = bd[p]; i < bd[p + 1]; ++i) {
        const int32_t* item = it + i * kItemFields;
        if (item[kKvHead] == kAllKvHeads) {
          run_decode_item<NV>(a, item, sc);
        } else {
          run_item<NV>(a, item, sc);
        }
      }
    }
  });
  const int32_t* mg = merges.data_ptr<int32_t>();
  at::parallel_for(0, merges.size(0), 16, [&](int64_t begin, int64_t end) {
    Scratch sc(1, a.head_dim);
    for (int64_t i = begin; i < end; ++i) merge(a, mg + i * 4, sc);
  });
}

}  // namespace

int64_t vec_size() { return kVec; }

bool supports_head_dim(int64_t head_dim) {
  if (head_dim % kVec != 0) return false;
  switch (head_dim / kVec) {
    case 1: case 2: case 4: case 5: case 6: case 8: case 16: return true;
    default: return false;
  }
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_table,
                     const at::Tensor& items, const at::Tensor& bounds, const at::Tensor& merges,
                     at::Tensor& partials, double scale, double k_scale, double v_scale,
                     int64_t sliding_window, double soft_cap) {
  TORCH_CHECK(sliding_window >= 0 && soft_cap >= 0, "sliding_window and soft_cap: 0 = none");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [T, Hq, D] with contiguous heads");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
              key_cache.sizes() == value_cache.sizes(), "caches must be contiguous [N, bs, Hkv, D]");
  TORCH_CHECK(out.is_contiguous() && out.numel() == query.numel() &&
              out.scalar_type() == query.scalar_type(), "out must be contiguous like query");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1);
  TORCH_CHECK(items.is_contiguous() && bounds.is_contiguous() && merges.is_contiguous());
  const int head_dim = static_cast<int>(query.size(2));
  const int num_kv_heads = static_cast<int>(key_cache.size(2));
  TORCH_CHECK(key_cache.size(3) == head_dim && query.size(1) % num_kv_heads == 0);
  TORCH_CHECK(supports_head_dim(head_dim), "no paged_attention kernel for head_dim ", head_dim);
  const bool same = key_cache.scalar_type() == query.scalar_type();
  TORCH_CHECK(same || key_cache.scalar_type() == at::kFloat8_e4m3fn, "cache dtype mismatch");
  const int group = static_cast<int>(query.size(1)) / num_kv_heads;
  TORCH_CHECK(partials.numel() == 0 || partials.size(1) == group, "partials planned for another group");
  Args a{static_cast<const char*>(query.data_ptr()), query.stride(0), query.scalar_type(),
         static_cast<char*>(out.data_ptr()), query.size(1) * head_dim,
         static_cast<const char*>(key_cache.data_ptr()),
         static_cast<const char*>(value_cache.data_ptr()), key_cache.scalar_type(),
         query.element_size(), key_cache.element_size(),
         block_table.data_ptr<int32_t>(), block_table.stride(0), block_table.size(0),
         block_table.size(1), query.size(0),
         num_kv_heads, group, head_dim, static_cast<int>(key_cache.size(1)), key_cache.size(0),
         static_cast<float>(scale * k_scale), static_cast<float>(v_scale),
         partials.numel() ? partials.data_ptr<float>() : nullptr,
         sliding_window > 0 ? static_cast<int>(std::min<int64_t>(sliding_window, kNoWindow))
                            : kNoWindow,
         static_cast<float>(soft_cap)};
  switch (head_dim / kVec) {
    case 1: return run_all<1>(a, items, bounds, merges);
    case 2: return run_all<2>(a, items, bounds, merges);
    case 4: return run_all<4>(a, items, bounds, merges);
    case 5: return run_all<5>(a, items, bounds, merges);
    case 6: return run_all<6>(a, items, bounds, merges);
    case 8: return run_all<8>(a, items, bounds, merges);
    default: return run_all<16>(a, items, bounds, merges);
  }
}

}  // namespace mesh_cpu

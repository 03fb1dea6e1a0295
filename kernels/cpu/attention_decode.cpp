// Decode items of paged attention: one query token against its context, every KV head.
//
// Keys are taken kDecodeKeys at a time: every row's scores over them (kVec keys and one KV
// head at a time, so each cache row, which holds every head, is read whole and once), one
// online-softmax update per row, then acc = acc * corr + P @ V the same way through the V
// rows, each V row loaded once for a tile of rows. The next rows are prefetched meanwhile.
// Where the CPU has AVX-512 BF16, a bf16 item reads its bf16 query and cache rows as they
// are (vdpbf16ps: pairs multiplied exactly, summed in fp32), with P rounded to bf16 for
// P @ V as flash attention does: no conversion pass, half the instructions.
#include "attention_kernels.h"

namespace mesh_cpu::attn {

namespace {

constexpr int kAhead = 4 * kVec;   // keys: how far ahead K rows are prefetched

// Asks for the whole cache rows (every KV head) of `cache` at off[0 .. n) into L2.
// NOTE: a block's rows are contiguous, but a 16-token block is 6-12 KB read in strides of a
// head, and the hardware prefetcher trains anew in every 4 KB page: one thread read the KV
// of 32 x 150-token bf16 decodes at 5.3 GB/s without these, 6.5 with.
// NOTE: into L2, not L1: prefetches into L1 stalled once its miss buffers filled (perf: 11%
// of the kernel's samples on them). On a 2-core Zen 4, 32 x 192-token decodes took 9.45
// against 10.44 ms in bf16 and 16.3 against 18.7 in fp32 (contiguous blocks), 9.9 against
// 11.7 and 18.6 against 19.9 (scattered); 32 and 64 keys ahead measured alike
// (benchmarks/decode_attention.py, benchmarks.md 10n).
inline void prefetch_rows(const Args& a, const char* cache, const int64_t* off, int n) {
  const int64_t row_bytes =
      static_cast<int64_t>(a.num_kv_heads) * a.head_dim * a.cache_elem_size;
  for (int t = 0; t < n; ++t) {
    const char* row = cache + off[t] * a.cache_elem_size;
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
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
                      const float* pos, float scale, float* s, int ld) {
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
        .store(s + r * ld);
  }
}

// acc[r] = acc[r] (* corr[r] unless corr is null) + sum_t p[r * ld + t] v_t over kVec keys
// (masked ones p = 0 against a zero row) from bf16 V rows in place, for R rows: p rounded to
// bf16 (as flash attention's P @ V), two keys per vdpbf16ps, whose operands are the two rows'
// elements interleaved. acc's lanes are then in that interleave's order: bf16_lanes_to_dims
// puts them back. Keys outer: each pair of V rows is loaded and interleaved once for R rows.
template <int NV, int R>
void accumulate_v_bf16_tile(float* acc, const float* p, int ld, const BFloat16* const* vrow,
                            const float* corr) {
  constexpr int D = NV * kVec, NB = NV / 2;
  __m512 a[R][NV];
  alignas(32) uint32_t pairs[R][kVec / 2];   // (p[2i], p[2i + 1]) as two bf16
  for (int r = 0; r < R; ++r) {
    const __m512 c = _mm512_set1_ps(corr ? corr[r] : 1.f);
    for (int j = 0; j < NV; ++j) {
      a[r][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + j * kVec), c);
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[r]),
                       (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + r * ld)));
  }
  for (int t = 0; t < kVec; t += 2) {
    for (int j = 0; j < NB; ++j) {
      const __m512i x = _mm512_loadu_si512(vrow[t] + j * 2 * kVec);
      const __m512i y = _mm512_loadu_si512(vrow[t + 1] + j * 2 * kVec);
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y);
      const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
      for (int r = 0; r < R; ++r) {
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r][t / 2]));
        a[r][2 * j] = _mm512_dpbf16_ps(a[r][2 * j], lo, pp);
        a[r][2 * j + 1] = _mm512_dpbf16_ps(a[r][2 * j + 1], hi, pp);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + r * D + j * kVec, a[r][j]);
}

template <int NV, int R = std::max(1, kAccRegs / NV)>
void accumulate_v_bf16(float* acc, int rows, const float* p, int ld,
                       const BFloat16* const* vrow, const float* corr) {
  constexpr int D = NV * kVec;
  int r = 0;
  for (; r + R <= rows; r += R)
    accumulate_v_bf16_tile<NV, R>(acc + r * D, p + r * ld, ld, vrow, corr ? corr + r : nullptr);
  if constexpr (R > 1) {
    if (r < rows)
      accumulate_v_bf16<NV, R - 1>(acc + r * D, rows - r, p + r * ld, ld, vrow,
                                   corr ? corr + r : nullptr);
  }
}

// The bf16 query rows r0.. of token q0, in place.
inline const BFloat16* bf16_query(const Args& a, int q0, int r0, int d) {
  return reinterpret_cast<const BFloat16*>(a.query) + q0 * a.q_stride + r0 * d;
}

// KV head h's bf16 rows of the key (or value) cache at `off`, in place: n of them, then the
// zero row up to kVec.
inline const BFloat16* const* bf16_rows(const Args& a, bool key, int h, const int64_t* off,
                                        int n, const BFloat16** rows) {
  const auto* c = reinterpret_cast<const BFloat16*>(key ? a.key_cache : a.value_cache) +
                  h * a.head_dim;
  const auto* zero = reinterpret_cast<const BFloat16*>(kZeroBf16Row);
  for (int t = 0; t < kVec; ++t) rows[t] = t < n ? c + off[t] : zero;
  return rows;
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

#else
#define MESH_BF16_DOT 0
#endif

}  // namespace

// A decode item: one query token, every KV head (kAllKvHeads), keys [kv_begin, kv_end).
template <int NV>
void run_decode_item(const Args& a, const int32_t* it, Scratch& sc) {
  constexpr int D = NV * kVec;
  const int G = a.group, H = a.num_kv_heads, rows = G * H, q0 = it[kQBegin];
  const int kv0 = it[kKvBegin], kv1 = it[kKvEnd], position = it[kPos0];
  TORCH_CHECK(it[kReq] < a.bt_rows && q0 < a.num_tokens && it[kQEnd] == q0 + 1,
              "attention plan does not fit this step's tensors");
  const int max_lo = position - a.window;
  const int kv_first = std::max(kv0, position - a.window + 1);
  // bf16 queries against a bf16 cache: both read as they are (scores_rows_bf16,
  // accumulate_v_bf16).
  const bool dot_bf16 = MESH_BF16_DOT && NV % 2 == 0 && a.q_dtype == at::kBFloat16 &&
                        a.cache_dtype == at::kBFloat16;
  for (int r = 0; r < rows; ++r) {  // row r: query head r, of KV head r / G
    sc.pos[r] = static_cast<float>(std::min(position, kv1 - 1));
    sc.lo[r] = static_cast<float>(max_lo);
    if (!dot_bf16) load_row(a, q0, r, sc.q.data() + r * D);
  }
  start_rows(sc, rows, rows, D);
  const int32_t* bt = a.block_table + it[kReq] * a.bt_stride;
  const float* kvrow[kVec];
#if MESH_BF16_DOT
  const BFloat16* kb[kVec];
#endif
  float* s = sc.s.data();
  for (int c0 = kv_first; c0 < kv1; c0 += kDecodeKeys) {
    const int n = std::min(kDecodeKeys, kv1 - c0), width = (n + kVec - 1) / kVec * kVec;
    row_offsets(a, bt, c0, n, sc.off.data());
    // Every row's scores over the n keys, kVec keys and one KV head at a time (the heads of
    // a cache row are adjacent: the rows are read whole, once).
    for (int t0 = 0; t0 < n; t0 += kVec) {
      const int nt = std::min(kVec, n - t0);
      const int64_t* off = sc.off.data() + t0;
      if (t0 == 0) prefetch_rows(a, a.key_cache, off, std::min(n, kAhead));
      if (t0 + kAhead < n) {
        prefetch_rows(a, a.key_cache, off + kAhead, std::min(kVec, n - t0 - kAhead));
      }
      prefetch_rows(a, a.value_cache, off, nt);
      for (int h = 0; h < H; ++h) {
        const int r0 = h * G;
        float* scores = s + r0 * kDecodeKeys + t0;
#if MESH_BF16_DOT
        if constexpr (NV % 2 == 0) {
          if (dot_bf16) {
            scores_rows_bf16<NV>(bf16_query(a, q0, r0, D), G, bf16_rows(a, true, h, off, nt, kb),
                                 nt, c0 + t0, sc.pos.data() + r0, a.q_scale, scores,
                                 kDecodeKeys);
            cap_and_mask_window(G, nt, c0 + t0, sc.lo.data() + r0, max_lo, a.soft_cap, scores,
                                kDecodeKeys);
            continue;
          }
        }
#endif
        gather_one(a, true, off, h, nt, kvrow, sc);
        scores_rows<NV>(sc.q.data() + r0 * D, G, kvrow, nt, c0 + t0, sc.pos.data() + r0,
                        sc.lo.data() + r0, max_lo, a.soft_cap, scores, kDecodeKeys);
      }
    }
    softmax_rows(s, kDecodeKeys, width, 0, rows, sc);
    // acc = acc * corr + P @ V, the same way through the V rows.
    for (int t0 = 0; t0 < n; t0 += kVec) {
      const int nt = std::min(kVec, n - t0);
      const int64_t* off = sc.off.data() + t0;
      const float* corr = t0 == 0 ? sc.corr.data() : nullptr;
      for (int h = 0; h < H; ++h) {
        const int r0 = h * G;
#if MESH_BF16_DOT
        if constexpr (NV % 2 == 0) {
          if (dot_bf16) {
            accumulate_v_bf16<NV>(sc.acc.data() + r0 * D, G, s + r0 * kDecodeKeys + t0,
                                  kDecodeKeys, bf16_rows(a, false, h, off, nt, kb),
                                  corr ? corr + r0 : nullptr);
            continue;
          }
        }
#endif
        gather_one(a, false, off, h, nt, kvrow, sc);
        accumulate_v<NV>(sc.acc.data() + r0 * D, G, s + r0 * kDecodeKeys + t0, kDecodeKeys, 1,
                         kvrow, nt, corr ? corr + r0 : nullptr);
      }
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

template void run_decode_item<1>(const Args&, const int32_t*, Scratch&);
template void run_decode_item<2>(const Args&, const int32_t*, Scratch&);
template void run_decode_item<4>(const Args&, const int32_t*, Scratch&);
template void run_decode_item<5>(const Args&, const int32_t*, Scratch&);
template void run_decode_item<6>(const Args&, const int32_t*, Scratch&);
template void run_decode_item<8>(const Args&, const int32_t*, Scratch&);
template void run_decode_item<16>(const Args&, const int32_t*, Scratch&);

}  // namespace mesh_cpu::attn

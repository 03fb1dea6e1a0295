// Prefill items of paged attention in bf16 products, where both the query and the cache are
// bf16 and the CPU multiplies bf16 pairs: on AMX tiles, or with AVX512-BF16's dot products
// (AMD Zen 4 and later, Intel Cooper Lake: no AMX there). S = Q K^T and O = P V as bf16
// products summed in fp32; the scale, masks and online softmax are fp32, as elsewhere.
//
// An item is one KV head and up to kPrefillTile query tokens x group rows, in row tiles of
// 16. Per 64 keys: K's rows are laid out once in pairs of d side by side, keys across (S's B
// tiles), and V's in pairs of keys side by side (P V's); each row tile then takes its 16 x 64
// scores, masks them, updates its softmax once (the rows layout of softmax_rows), and adds
// its 16 rows of P V to its accumulators after their rescale. A row tile none of whose rows
// sees any of the 64 keys skips them (exactly: its softmax would not move). The two ways
// differ in the products: tiles (tdpbf16ps), or vectors (vdpbf16ps: a row's pair of d, or of
// p, broadcast against 16 keys' or 16 dims' pairs) in the same layouts; and in P. On tiles P
// goes in as two bf16 halves (its bf16 rounding and the rest), so P V keeps ~16 bits of each
// p (outputs ~1e-6 off the fp32-softmax reference, as the fp32 kernel's). By vectors P is
// rounded once to bf16, as flash attention does (~2e-4 off): the second half would double
// P V's products, and without AMX they are most of the kernel's time.
#include "amx_tiles.h"
#include "attention_kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define MESH_HAS_BF16_DOT 1
#include <immintrin.h>
#endif

namespace mesh_cpu::attn {

#if defined(MESH_HAS_BF16_DOT)

namespace {

constexpr int kTileRows = 16;   // query rows per row tile; keys per S tile; dims per O tile
constexpr int kKeys = 64;       // keys per step: four S tiles, two P tiles' k

struct Buffers {
  std::vector<BFloat16> q;    // [row tiles * 16][D]: the item's query rows, zeros past them
  std::vector<uint32_t> k;    // [D / 2][64 keys]: S's B tiles, per 32 d and 16 keys
  std::vector<BFloat16> v;    // [32 pairs of keys][D][2]: P V's B tiles, per 32 keys, 16 d
  std::vector<BFloat16> p;    // [2][16 rows][64 keys]: P's bf16 rounding and the rest of it
  std::vector<float> o;       // [16 rows][D]

  void fit(int rows_p, int d) {
    q.assign(static_cast<size_t>(rows_p) * d, BFloat16(0.f));
    k.resize(d / 2 * kKeys);
    v.resize(kKeys * d);
    p.resize(2 * kTileRows * kKeys);
    o.resize(kTileRows * d);
  }
};

// r[i] lane j becomes r[j] lane i (16 x 16 32-bit words): pairs of words, then of pairs,
// then the 4 x 4 blocks of 128 bits.
inline void transpose_words(__m512i r[kVec]) {
  __m512i t[kVec];
  for (int i = 0; i < kVec; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < kVec; i += 4) {   // r[4g + c], 128-bit lane L: rows 4g.., word 4L + c
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i b0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
    const __m512i b1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i b2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i b3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(b0, b2, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(b0, b2, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(b1, b3, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(b1, b3, 0xDD);
  }
  std::copy(t, t + kVec, r);
}

// k[w][t] = the 32-bit pair w (d = 2w, 2w + 1) of key t; zeros for keys past n. 16 keys' 16
// pairs at a time, transposed in registers.
void layout_keys(const Args& a, const int64_t* off, int n, int kv_head, uint32_t* k) {
  const int words = a.head_dim / 2;
  const auto* cache = reinterpret_cast<const BFloat16*>(a.key_cache) + kv_head * a.head_dim;
  for (int t0 = 0; t0 < kKeys; t0 += kVec) {
    for (int w0 = 0; w0 < words; w0 += kVec) {
      __m512i r[kVec];
      for (int t = 0; t < kVec; ++t) {
        r[t] = t0 + t < n ? _mm512_loadu_si512(cache + off[t0 + t] + 2 * w0)
                          : _mm512_setzero_si512();
      }
      transpose_words(r);
      for (int w = 0; w < kVec; ++w) _mm512_storeu_si512(k + (w0 + w) * kKeys + t0, r[w]);
    }
  }
}

// v[pair][c][j] = V[2 pair + j][c]: two rows interleaved 32 dims at a time; zeros past n.
void layout_values(const Args& a, const int64_t* off, int n, int kv_head, BFloat16* v) {
  const int d = a.head_dim;
  const auto* cache = reinterpret_cast<const BFloat16*>(a.value_cache) + kv_head * d;
  __m512i lo_index, hi_index;
  alignas(64) int16_t lo[32], hi[32];
  for (int i = 0; i < 32; ++i) {   // even lanes from the first row, odd from the second
    lo[i] = static_cast<int16_t>((i % 2) * 32 + i / 2);
    hi[i] = static_cast<int16_t>((i % 2) * 32 + 16 + i / 2);
  }
  lo_index = _mm512_load_si512(lo);
  hi_index = _mm512_load_si512(hi);
  for (int pair = 0; pair < kKeys / 2; ++pair) {
    const int t = 2 * pair;
    const BFloat16* first = t < n ? cache + off[t] : nullptr;
    const BFloat16* second = t + 1 < n ? cache + off[t + 1] : nullptr;
    for (int c = 0; c < d; c += 32) {
      const __m512i x = first ? _mm512_loadu_si512(first + c) : _mm512_setzero_si512();
      const __m512i y = second ? _mm512_loadu_si512(second + c) : _mm512_setzero_si512();
      BFloat16* out = v + (static_cast<int64_t>(pair) * d + c) * 2;
      _mm512_storeu_si512(out, _mm512_permutex2var_epi16(x, lo_index, y));
      _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi16(x, hi_index, y));
    }
  }
}

#if defined(MESH_HAS_AMX)
constexpr int kDimTiles = 4;    // O tiles per pass over the head's dims

// Tiles (configure_full_tiles): S: tmm0 and tmm5-7 (16 rows x 16 keys each, fp32), from
// tmm1 (Q: 16 rows x 32 d) and tmm2 (K's B tile: 16 pairs of d x 16 keys). P V: tmm3 (P: 16
// rows x 32 keys, bf16) and tmm4 (V's B tile: 16 pairs of keys x 16 d) into tmm0 and tmm5-7
// again (O: 16 rows x 16 d each, fp32).
// The row tile's scores over the step's 64 keys, to s ([16 rows][64 keys] fp32).
void scores_on_tiles(const Buffers& b, int r0, int d, float* s) {
  _tile_zero(0);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int kt = 0; kt < d / 32; ++kt) {
    _tile_loadd(1, b.q.data() + static_cast<int64_t>(r0) * d + kt * 32, d * 2);
    const uint32_t* k = b.k.data() + kt * 16 * kKeys;   // 16 pairs of d, 64 keys a row
    _tile_loadd(2, k, kKeys * 4);
    _tile_dpbf16ps(0, 1, 2);
    _tile_loadd(2, k + 16, kKeys * 4);
    _tile_dpbf16ps(5, 1, 2);
    _tile_loadd(2, k + 32, kKeys * 4);
    _tile_dpbf16ps(6, 1, 2);
    _tile_loadd(2, k + 48, kKeys * 4);
    _tile_dpbf16ps(7, 1, 2);
  }
  _tile_stored(0, s, kKeys * 4);
  _tile_stored(5, s + 16, kKeys * 4);
  _tile_stored(6, s + 32, kKeys * 4);
  _tile_stored(7, s + 48, kKeys * 4);
}

// O tiles [dt0, dt0 + nd) (nd <= 4) of P V over the step's 64 keys, stored to o ([16][D]
// fp32), P as the sum of two bf16 tiles (p_hi + p_lo carry ~16 bits of each p, so P V is
// nearly fp32's).
void p_times_v_tiles(const BFloat16* v, int d, int dt0, int nd, const BFloat16* p_hi,
               const BFloat16* p_lo, float* o) {
  const int v_stride = d * 4;   // bytes between pairs of keys
  const int o_stride = d * 4;
  _tile_zero(0);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int half = 0; half < 2; ++half) {   // keys 0-31, 32-63
    const BFloat16* vh = v + static_cast<int64_t>(half) * kTileRows * d * 2;
    auto v_tile = [&](int dt) { return vh + (dt0 + dt) * kTileRows * 2; };
    for (const BFloat16* p : {p_hi, p_lo}) {
      _tile_loadd(3, p + half * 32, kKeys * 2);
      _tile_loadd(4, v_tile(0), v_stride);
      _tile_dpbf16ps(0, 3, 4);
      if (nd > 1) {
        _tile_loadd(4, v_tile(1), v_stride);
        _tile_dpbf16ps(5, 3, 4);
      }
      if (nd > 2) {
        _tile_loadd(4, v_tile(2), v_stride);
        _tile_dpbf16ps(6, 3, 4);
      }
      if (nd > 3) {
        _tile_loadd(4, v_tile(3), v_stride);
        _tile_dpbf16ps(7, 3, 4);
      }
    }
  }
  _tile_stored(0, o + dt0 * kTileRows, o_stride);
  if (nd > 1) _tile_stored(5, o + (dt0 + 1) * kTileRows, o_stride);
  if (nd > 2) _tile_stored(6, o + (dt0 + 2) * kTileRows, o_stride);
  if (nd > 3) _tile_stored(7, o + (dt0 + 3) * kTileRows, o_stride);
}

// The row tile's P V over the step's 64 keys, to o ([16 rows][D] fp32).
void p_times_v_on_tiles(const Buffers& b, int d, const BFloat16* p_hi, const BFloat16* p_lo,
                        float* o) {
  for (int dt0 = 0; dt0 < d / kTileRows; dt0 += kDimTiles) {
    p_times_v_tiles(b.v.data(), d, dt0, std::min(kDimTiles, d / kTileRows - dt0), p_hi, p_lo, o);
  }
}
#endif  // MESH_HAS_AMX

// Rows in blocks of 4 against 4 vectors of keys or dims: 16 accumulators, each pair loaded
// once per 4 rows and each row's broadcast once per 4 vectors.
constexpr int kBlockRows = 4;

inline __m512bh broadcast_pair(const void* pair) {
  return (__m512bh)_mm512_set1_epi32(*static_cast<const int32_t*>(pair));
}

// The same scores by vectors: lanes are 16 keys, a row's pair of d broadcast.
void scores_by_vectors(const Buffers& b, int r0, int d, float* s) {
  const int words = d / 2;
  const BFloat16* q = b.q.data() + static_cast<int64_t>(r0) * d;
  for (int i0 = 0; i0 < kTileRows; i0 += kBlockRows) {
    __m512 acc[kBlockRows][4];
    for (auto& row : acc)
      for (auto& x : row) x = _mm512_setzero_ps();
    for (int w = 0; w < words; ++w) {
      const uint32_t* k = b.k.data() + w * kKeys;
      __m512bh keys[4];
      for (int j = 0; j < 4; ++j) keys[j] = (__m512bh)_mm512_loadu_si512(k + j * kVec);
      for (int i = 0; i < kBlockRows; ++i) {
        const __m512bh pair = broadcast_pair(q + (i0 + i) * d + 2 * w);
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], pair, keys[j]);
      }
    }
    for (int i = 0; i < kBlockRows; ++i)
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(s + (i0 + i) * kKeys + j * kVec, acc[i][j]);
  }
}

// Dims [c0, c0 + NC x 16) of the row tile's P V by vectors: lanes are 16 dims, a row's pair
// of p (rounded once to bf16) broadcast.
template <int NC>
void p_times_v_dims(const BFloat16* v, int d, int c0, const BFloat16* p, float* o) {
  for (int i0 = 0; i0 < kTileRows; i0 += kBlockRows) {
    __m512 acc[kBlockRows][NC];
    for (auto& row : acc)
      for (auto& x : row) x = _mm512_setzero_ps();
    for (int pair = 0; pair < kKeys / 2; ++pair) {
      __m512bh values[NC];
      for (int j = 0; j < NC; ++j) {
        values[j] = (__m512bh)_mm512_loadu_si512(
            v + (static_cast<int64_t>(pair) * d + c0 + j * kVec) * 2);
      }
      for (int i = 0; i < kBlockRows; ++i) {
        const __m512bh pp = broadcast_pair(p + (i0 + i) * kKeys + 2 * pair);
        for (int j = 0; j < NC; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], pp, values[j]);
      }
    }
    for (int i = 0; i < kBlockRows; ++i)
      for (int j = 0; j < NC; ++j) _mm512_storeu_ps(o + (i0 + i) * d + c0 + j * kVec, acc[i][j]);
  }
}

void p_times_v_by_vectors(const Buffers& b, int d, const BFloat16* p, float* o) {
  int c0 = 0;
  for (; c0 + 4 * kVec <= d; c0 += 4 * kVec) p_times_v_dims<4>(b.v.data(), d, c0, p, o);
  if (c0 < d) p_times_v_dims<2>(b.v.data(), d, c0, p, o);   // d % 32 == 0
}

// The row tile's scores, to s ([16 rows][64 keys]): on tiles where granted, else by vectors.
void scores(const Buffers& b, int r0, int d, float* s, [[maybe_unused]] bool on_tiles) {
#if defined(MESH_HAS_AMX)
  if (on_tiles) return scores_on_tiles(b, r0, d, s);
#endif
  scores_by_vectors(b, r0, d, s);
}

// The row tile's P V, to o ([16 rows][D]): on tiles P as its two halves, by vectors p_hi.
void p_times_v(const Buffers& b, int d, const BFloat16* p_hi,
               [[maybe_unused]] const BFloat16* p_lo, float* o,
               [[maybe_unused]] bool on_tiles) {
#if defined(MESH_HAS_AMX)
  if (on_tiles) return p_times_v_on_tiles(b, d, p_hi, p_lo, o);
#endif
  p_times_v_by_vectors(b, d, p_hi, o);
}

// One row tile over keys [c0, c0 + n): S, its masks and softmax, acc = acc * corr + P V.
void row_tile_step(const Args& a, Buffers& b, Scratch& sc, int r0, int rows, int c0, int n,
                   int max_lo, bool on_tiles) {
  const int d = a.head_dim;
  float* s = sc.s.data();   // [16 rows][64 keys]
  scores(b, r0, d, s, on_tiles);
  // The scale, then -inf past each row's last visible key (keys past n are past every row's).
  for (int i = 0; i < rows; ++i) {
    const fVec limit(std::min(sc.pos[r0 + i], static_cast<float>(c0 + n - 1)));
    for (int t = 0; t < kKeys; t += kVec) {
      const fVec keys = fVec::arange(static_cast<float>(c0 + t), 1.f);
      float* x = s + i * kKeys + t;
      fVec::blendv(fVec::loadu(x) * fVec(a.q_scale), fVec(kNegInf), keys > limit).store(x);
    }
  }
  cap_and_mask_window(rows, n, c0, sc.lo.data() + r0, max_lo, a.soft_cap, s, kKeys);
  softmax_rows(s, kKeys, kKeys, r0, rows, sc);
  // P in bf16: rounded (p_hi), and on tiles the rest of it too (p_lo).
  BFloat16* p_hi = b.p.data();
  BFloat16* p_lo = p_hi + kTileRows * kKeys;
  for (int i = 0; i < kTileRows; ++i) {
    for (int t = 0; t < kKeys; t += kVec) {
      __m256bh hi = (__m256bh)_mm256_setzero_si256(), lo = hi;
      if (i < rows) {
        const __m512 p = _mm512_loadu_ps(s + i * kKeys + t);
        hi = _mm512_cvtneps_pbh(p);
        if (on_tiles) lo = _mm512_cvtneps_pbh(_mm512_sub_ps(p, _mm512_cvtpbh_ps(hi)));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_hi + i * kKeys + t), (__m256i)hi);
      if (on_tiles) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_lo + i * kKeys + t), (__m256i)lo);
      }
    }
  }
  p_times_v(b, d, p_hi, p_lo, b.o.data(), on_tiles);
  for (int i = 0; i < rows; ++i) {
    float* acc = sc.acc.data() + static_cast<int64_t>(r0 + i) * d;
    const float* o = b.o.data() + static_cast<int64_t>(i) * d;
    const fVec corr(sc.corr[r0 + i]);
    for (int c = 0; c < d; c += kVec) {
      at::vec::fmadd(fVec::loadu(acc + c), corr, fVec::loadu(o + c)).store(acc + c);
    }
  }
}

}  // namespace

bool prefill_in_bf16(const Args& a) {
  return a.q_dtype == at::kBFloat16 && a.cache_dtype == at::kBFloat16 && a.head_dim % 32 == 0;
}

void run_prefill_item_bf16(const Args& a, const int32_t* it, Scratch& sc) {
  // NOTE: AMX needs the kernel's permission for its state too (amx_linear_supported).
  const bool on_tiles = amx_linear_supported();
  const int d = a.head_dim, G = a.group, kv_head = it[kKvHead], q0 = it[kQBegin];
  const int kv0 = it[kKvBegin], kv1 = it[kKvEnd];
  const int rows = (it[kQEnd] - q0) * G;
  const int rows_p = static_cast<int>(round_up(rows, kTileRows));
  const int max_lo = it[kPos0] + (rows - 1) / G - a.window;
  const int kv_first = std::max(kv0, it[kPos0] - a.window + 1);
  thread_local Buffers b;
  b.fit(rows_p, d);
  for (int r = 0; r < rows; ++r) {
    const int position = it[kPos0] + r / G;
    sc.pos[r] = static_cast<float>(std::min(position, kv1 - 1));
    sc.lo[r] = static_cast<float>(position - a.window);
    const auto* src = reinterpret_cast<const BFloat16*>(a.query) +
                      (static_cast<int64_t>(q0 + r / G) * a.q_stride + (kv_head * G + r % G) * d);
    std::copy(src, src + d, b.q.begin() + static_cast<int64_t>(r) * d);
  }
  start_rows(sc, rows, rows, d);
  const int32_t* bt = a.block_table + it[kReq] * a.bt_stride;
  int64_t off[kKeys];
#if defined(MESH_HAS_AMX)
  if (on_tiles) configure_full_tiles();
#endif
  for (int c0 = kv_first; c0 < kv1; c0 += kKeys) {
    const int n = std::min(kKeys, kv1 - c0);
    row_offsets(a, bt, c0, n, off);
    layout_keys(a, off, n, kv_head, b.k.data());
    layout_values(a, off, n, kv_head, b.v.data());
    for (int r0 = 0; r0 < rows; r0 += kTileRows) {
      const int tile_rows = std::min(kTileRows, rows - r0);
      if (sc.pos[r0 + tile_rows - 1] < c0) continue;   // it sees none of these keys
      row_tile_step(a, b, sc, r0, tile_rows, c0, n, max_lo, on_tiles);
    }
  }
#if defined(MESH_HAS_AMX)
  if (on_tiles) _tile_release();
#endif
}

#else

bool prefill_in_bf16(const Args&) { return false; }

void run_prefill_item_bf16(const Args&, const int32_t*, Scratch&) {
  TORCH_CHECK(false, "prefill attention in bf16 products needs AMX-BF16 or AVX512-BF16");
}

#endif  // MESH_HAS_BF16_DOT

}  // namespace mesh_cpu::attn

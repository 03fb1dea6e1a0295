// y = x W^T with W kept in its GGUF block quantization (Q4_1 or Q8_0, blocks of 32 along K)
// and expanded on the fly into fp32 values bit-identical to the dequantized checkpoint:
// Q4_1 as fp32(d * q) + m, Q8_0 as d * q (gguf's numpy dequantizer). The math is the fp32
// model's; only the bytes read per step shrink (~5 bits a weight instead of 32). Q4_1 expands
// with one FMA, d * q + m rounded once: the same value, since PackedBlocks.of admits only
// scales whose product with a 4-bit code is exact in fp32 (GGUF's fp16 scales are).
//
// Every output is one FMA chain over k = 0 .. K-1 in order, whatever the path, tile or
// chunk: a row's result does not depend on the other rows of x (batch-invariant). The one
// exception, bf16 x on a CPU with AVX512-BF16 (dp_rows), sums bf16 products in pairs, in the
// same order for every row: batch-invariant as well.
// - Up to kDirectRows rows (decode): each group's weights are expanded in registers and used
//   at once by every row (direct_tile).
// - More rows (prefill, large decode batches): a GEMM of BLIS's outer-product kind. A panel
//   of kPanelGroups groups is expanded, one K chunk at a time, into an L1-sized buffer laid
//   out [k][columns], and tiles of kTileRows rows broadcast x[r, k] against it (tile); the
//   chains carry over between chunks through y itself.
// NOTE: the dot-product kernel before this (4 expanded weight rows dotted with 2 rows of x,
// summed horizontally) re-read all of x from L2 for every 4 columns, 5.8 GB a step at 32 rows
// on SmolLM2: 61-79 GFLOP/s against oneDNN's 94 on 2 AVX2 cores; this one reaches 127
// (benchmarks/quant_linear.py).
#include "cpu_common.h"
#include "ops.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <type_traits>

namespace mesh_cpu {

namespace {

constexpr int kBlock = 32;

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#define MESH_HAS_QUANT_LINEAR 1

// Accumulators a tile keeps in registers (of 16 with AVX2, 32 with AVX-512), leaving room
// for the panel's vectors of one k and the broadcast x.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kAccumulators = 24;
#else
constexpr int kAccumulators = 12;
#endif
// A panel's width in vectors. NOTE: 3 (tiles of 4 rows) measured 1.6x slower than 2 (tiles
// of 6) at 32 rows on 2 AVX2 cores.
constexpr int kPanelGroups = 2;
constexpr int kTileRows = kAccumulators / kPanelGroups;
constexpr int kPanelFloats = 4096;   // the expanded chunk: 16 KB, half of a Zen 2 core's L1d
// Batches up to this many rows expand the weights in registers (direct_tile), larger ones
// into panels (tile): 25.8 against 34.1 ms a SmolLM2 step's linears at 8 rows, 36.0 at 9.
constexpr int kDirectRows = 8;

// A weight packed by PackedBlocks.of (services/worker/models/quantized.py): for each group of
// kVec columns, its blocks of 32 k in order, each block block_bytes(): the kVec scales (fp32),
// Q4_1's kVec mins, then the codes of the 32 k, the group's columns side by side at each k
// (Q4_1: kVec / 2 bytes, column 2j in the low nibble of byte j and 2j + 1 in the high one;
// Q8_0: kVec int8). One group's weights are one stream in memory, as the prefetcher likes.
struct PackedWeight {
  const uint8_t* blocks;   // [N / kVec, K / 32, block_bytes]
  int64_t n, k;
  bool q4;
  bool bf16;               // round each weight to bf16: a bf16 model's values

  int64_t block_bytes() const {
    return q4 ? 2 * 4 * kVec + kBlock * kVec / 2 : 4 * kVec + kBlock * kVec;
  }
  const uint8_t* block(int64_t g, int64_t b) const {
    return blocks + (g * (k / kBlock) + b) * block_bytes();
  }
  static fVec scales(const uint8_t* block) {
    return fVec::loadu(reinterpret_cast<const float*>(block));
  }
  static fVec mins(const uint8_t* block) {
    return fVec::loadu(reinterpret_cast<const float*>(block) + kVec);
  }
  const uint8_t* codes(const uint8_t* block) const { return block + (q4 ? 8 : 4) * kVec; }
};

// Consecutive k of one group expanded at a time: those whose packed Q4_1 codes fill 16
// bytes, 4 with AVX2, 2 with AVX-512 (one nibble split serves them all).
constexpr int kExpandSteps = 16 / (kVec / 2);

// The Q4_1 codes of one group at kExpandSteps consecutive k (16 packed bytes at p) as floats.
inline void q4_codes(const uint8_t* p, fVec* out) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low_nibbles = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(packed, low_nibbles);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low_nibbles);
  // byte j holds column 2j (low nibble) and 2j + 1 (high): interleaving restores the order
  const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);
#if defined(CPU_CAPABILITY_AVX512)
  out[0] = fVec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first)));
  out[1] = fVec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(second)));
#else
  out[0] = fVec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(first)));
  out[1] = fVec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(first, 8))));
  out[2] = fVec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(second)));
  out[3] = fVec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(second, 8))));
#endif
}

// The Q8_0 codes of one group at one k (kVec bytes at p) as floats.
inline fVec q8_codes(const uint8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return fVec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#else
  return fVec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#endif
}

// fp32 -> the nearest bf16, ties to even -> fp32: torch's cast, for finite values.
inline fVec round_bf16(const fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return fVec(_mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(0xFFFF0000))));
#else
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  return fVec(_mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(0xFFFF0000))));
#endif
}

// The group's kVec weights at k = i .. i + kExpandSteps - 1 of a block, as fp32 (rounded to
// bf16 with Bf16).
// NOTE: Bf16 is a template parameter, not a branch on w.bf16 per weight: the branch and its
// constants held registers that the 8-row direct tile then spilled (SmolLM2's linears at 8
// fp32 rows, 2 AVX2 cores: 24.8 -> 20.9 ms; benchmarks.md 10l).
template <bool Bf16>
inline void expand_steps(const PackedWeight& w, const uint8_t* block, int i, fVec* out) {
  const uint8_t* q = w.codes(block);
  const fVec d = PackedWeight::scales(block);
  if (w.q4) {
    const fVec m = PackedWeight::mins(block);
    q4_codes(q + i * (kVec / 2), out);
    for (int j = 0; j < kExpandSteps; ++j) out[j] = at::vec::fmadd(d, out[j], m);
  } else {
    for (int j = 0; j < kExpandSteps; ++j) out[j] = d * q8_codes(q + (i + j) * kVec);
  }
  if constexpr (Bf16)
    for (int j = 0; j < kExpandSteps; ++j) out[j] = round_bf16(out[j]);
}

// use(i, weights) for i in 0 .. 31: the group's kVec weights at the block's i-th k, as fp32.
template <bool Bf16, typename Use>
inline void expand_block(const PackedWeight& w, const uint8_t* block, Use&& use) {
  for (int i = 0; i < kBlock; i += kExpandSteps) {
    fVec weights[kExpandSteps];
    expand_steps<Bf16>(w, block, i, weights);
    for (int j = 0; j < kExpandSteps; ++j) use(i + j, weights[j]);
  }
}

// Groups [g0, g0 + nv) at k in [k0, k0 + kc) as fp32 into panel[(k - k0) * nv * kVec ..].
void expand_panel(const PackedWeight& w, int64_t g0, int nv, int64_t k0, int64_t kc,
                  float* panel) {
  const int64_t width = int64_t(nv) * kVec;
  for (int v = 0; v < nv; ++v) {
    for (int64_t b = k0 / kBlock; b < (k0 + kc) / kBlock; ++b) {
      float* out = panel + (b * kBlock - k0) * width + v * kVec;
      const auto store = [&](int i, const fVec& weights) { weights.store(out + i * width); };
      if (w.bf16) {
        expand_block<true>(w, w.block(g0 + v, b), store);
      } else {
        expand_block<false>(w, w.block(g0 + v, b), store);
      }
    }
  }
}

// y[r, col .. col + NV * kVec) for the MR rows of x at x_rows, over k in [k0, k0 + kc).
template <int MR, int NV>
inline void tile(const float* x_rows, int64_t k, int64_t k0, int64_t kc, const float* panel,
                 float* y_rows, int64_t n, int64_t col) {
  fVec acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      acc[r][v] = k0 == 0 ? fVec(0.f) : fVec::loadu(y_rows + r * n + col + v * kVec);
  for (int64_t i = 0; i < kc; ++i) {
    fVec wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = fVec::loadu(panel + i * NV * kVec + v * kVec);
    for (int r = 0; r < MR; ++r) {
      const fVec xv(x_rows[r * k + k0 + i]);
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(xv, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v].store(y_rows + r * n + col + v * kVec);
}

// One tile of `rows` rows (1 .. MR) at x_rows.
template <int MR, int NV>
inline void tile_of(int64_t rows, const float* x_rows, int64_t k, int64_t k0, int64_t kc,
                    const float* panel, float* y_rows, int64_t n, int64_t col) {
  if (rows == MR) return tile<MR, NV>(x_rows, k, k0, kc, panel, y_rows, n, col);
  if constexpr (MR > 1) tile_of<MR - 1, NV>(rows, x_rows, k, k0, kc, panel, y_rows, n, col);
}

// Rows [0, m) in as few tiles of at most MR rows as can be, of near-equal heights.
// NOTE: 32 rows as 6, 6, 5, 5, 5, 5 rather than 6 x 5 + 2: a 2-row tile keeps 4 FMA chains,
// too few to cover the FMA latency, and costs about what a 6-row one does.
template <int MR, int NV>
inline void tiles(const float* xp, int64_t k, int64_t k0, int64_t kc, const float* panel,
                  float* yp, int64_t n, int64_t col, int64_t m) {
  const int64_t count = (m + MR - 1) / MR, base = m / count, taller = m % count;
  for (int64_t t = 0, r = 0; t < count; ++t) {
    const int64_t rows = base + (t < taller ? 1 : 0);
    tile_of<MR, NV>(rows, xp + r * k, k, k0, kc, panel, yp + r * n, n, col);
    r += rows;
  }
}

// Panels of NV groups from group g_begin on, for every row of x.
template <int NV>
void panels(const PackedWeight& w, const float* xp, int64_t m, float* yp, int64_t g_begin,
            int64_t num_panels) {
  const int64_t kc = std::max<int64_t>(kBlock, kPanelFloats / (NV * kVec) / kBlock * kBlock);
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(kc * NV * kVec);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t g0 = g_begin + p * NV, col = g0 * kVec;
      for (int64_t k0 = 0; k0 < w.k; k0 += kc) {
        const int64_t chunk = std::min(kc, w.k - k0);
        expand_panel(w, g0, NV, k0, chunk, panel.data());
        tiles<std::min(kTileRows, kAccumulators / NV), NV>(xp, w.k, k0, chunk, panel.data(),
                                                           yp, w.n, col, m);
      }
    }
  });
}

// All MR rows of x (MR <= kDirectRows) against group g's columns, its weights expanded in
// registers as they are used: a batch this small does too few FMAs a weight to pay for
// storing a panel and reading it back. The same FMA chains, in the same order, as tile().
// NOTE: one group at a time measured fastest (SmolLM2, 2 AVX2 cores, one row: 15.3 ms a
// step's linears against 16.0, 15.9 and 17.4 with 2, 4 and 12 groups side by side): the
// expansion, not the FMA latency, bounds a small batch, and each group is a memory stream.
template <int MR, bool Bf16>
void direct_tile(const PackedWeight& w, const float* xp, int64_t g, float* yp) {
  fVec acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = fVec(0.f);
  for (int64_t b = 0; b < w.k / kBlock; ++b) {
    const float* x = xp + b * kBlock;
    expand_block<Bf16>(w, w.block(g, b), [&](int i, const fVec& weights) {
      for (int r = 0; r < MR; ++r) acc[r] = at::vec::fmadd(fVec(x[r * w.k + i]), weights, acc[r]);
    });
  }
  for (int r = 0; r < MR; ++r) acc[r].store(yp + r * w.n + g * kVec);
}

// body(g) for every group of kVec columns, the groups split over torch's threads.
template <typename Body>
inline void for_each_group(const PackedWeight& w, Body&& body) {
  at::parallel_for(0, w.n / kVec, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) body(g);
  });
}

// f(std::integral_constant<int, m>()) for m = 1 .. 8 (kDirectRows, kDpRows): a tile's rows as
// a template argument keep its sums in registers.
template <typename F>
inline void with_rows(int64_t m, F&& f) {
  switch (m) {
    case 1: return f(std::integral_constant<int, 1>());
    case 2: return f(std::integral_constant<int, 2>());
    case 3: return f(std::integral_constant<int, 3>());
    case 4: return f(std::integral_constant<int, 4>());
    case 5: return f(std::integral_constant<int, 5>());
    case 6: return f(std::integral_constant<int, 6>());
    case 7: return f(std::integral_constant<int, 7>());
    default: return f(std::integral_constant<int, 8>());
  }
}
static_assert(kDirectRows == 8, "with_rows covers 1 .. 8 rows");

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define MESH_HAS_DPBF16 1
// A bf16 model's batches of up to kDpRows rows on a CPU with AVX512-BF16 (Zen 4, Cooper
// Lake): vdpbf16ps multiplies bf16 pairs into fp32 sums, so each weight pair is expanded
// into one vector and each row costs half the FMAs of the fp32 path.
// NOTE: SmolLM2's linears on a 2-core Zen 4 (benchmarks/quant_linear.py, benchmarks.md
// 10n): 5.8 / 7.4 / 10.6 ms at 1 / 4 / 8 rows against 8.9 / 11.5 / 17.5 with the fp32
// chains and 14.4 / 12.8 / 14.7 with oneDNN's bf16 GEMM. Past 8 rows oneDNN wins: 12-row
// tiles gained nothing over two of 6 (16.1 against 16.6 ms, oneDNN 15.8), and pairs
// expanded once into panels lost at 32-128 rows (expanding the blocks costs ~8 ms a pass).
// NOTE: each row keeps two sums, even and odd k pairs, at every row count: one chain a row
// would stall on vdpbf16ps's latency at one row, and the same chains at every row count keep
// a row's result independent of the others (batch-invariant).
constexpr int kDpRows = 8;
static_assert(kDpRows == 8, "with_rows covers 1 .. 8 rows");

// Column j's weights at k and k + 1 as the bf16 pair in lane j (k in the low half), the
// layout vdpbf16ps reads. cvtne2ps_pbh rounds to nearest even, as torch's cast does.
inline __m512bh bf16_pairs(const fVec& at_k, const fVec& at_next, const __m512i& interleave) {
  const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(at_next, at_k);   // [k | k + 1]
  return (__m512bh)_mm512_permutexvar_epi16(interleave, halves);
}

template <int MR>
void dp_tile(const PackedWeight& w, const uint32_t* x_pairs, int64_t g, float* yp) {
  alignas(64) static constexpr int16_t kInterleave[32] = {
      0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const int64_t pairs_per_row = w.k / 2;
  __m512 even[MR], odd[MR];   // sums over k pairs 0, 2, 4 .. and 1, 3, 5 ..
  for (int r = 0; r < MR; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  const auto x_pair = [&](int r, int64_t p) {
    return (__m512bh)_mm512_set1_epi32(int(x_pairs[r * pairs_per_row + p]));
  };
  for (int64_t b = 0; b < w.k / kBlock; ++b) {
    const uint8_t* block = w.block(g, b);
    for (int i = 0; i < kBlock; i += 4) {   // kExpandSteps == 2: one k pair an expansion
      fVec first[kExpandSteps], second[kExpandSteps];
      expand_steps<false>(w, block, i, first);
      expand_steps<false>(w, block, i + 2, second);
      const __m512bh pair0 = bf16_pairs(first[0], first[1], interleave);
      const __m512bh pair1 = bf16_pairs(second[0], second[1], interleave);
      const int64_t p = (b * kBlock + i) / 2;
      for (int r = 0; r < MR; ++r) even[r] = _mm512_dpbf16_ps(even[r], pair0, x_pair(r, p));
      for (int r = 0; r < MR; ++r) odd[r] = _mm512_dpbf16_ps(odd[r], pair1, x_pair(r, p + 1));
    }
  }
  for (int r = 0; r < MR; ++r)
    _mm512_storeu_ps(yp + r * w.n + g * kVec, _mm512_add_ps(even[r], odd[r]));
}

// All m (<= kDpRows) rows of bf16 x.
void dp_rows(const PackedWeight& w, const BFloat16* xp, int64_t m, float* yp) {
  const auto* x_pairs = reinterpret_cast<const uint32_t*>(xp);
  with_rows(m, [&](auto rows) {
    for_each_group(w, [&](int64_t g) { dp_tile<decltype(rows)::value>(w, x_pairs, g, yp); });
  });
}
#endif  // AVX512-BF16

// Panels of kPanelGroups groups over the groups they divide evenly, then single groups.
void all_panels(const PackedWeight& w, const float* xp, int64_t m, float* yp) {
  const int64_t groups = w.n / kVec, full = groups / kPanelGroups;
  if (full > 0) panels<kPanelGroups>(w, xp, m, yp, 0, full);
  if (groups > full * kPanelGroups)
    panels<1>(w, xp, m, yp, full * kPanelGroups, groups - full * kPanelGroups);
}

void dispatch(const PackedWeight& w, const float* xp, int64_t m, float* yp) {
  if (m > kDirectRows) return all_panels(w, xp, m, yp);
  with_rows(m, [&](auto rows) {
    constexpr int MR = decltype(rows)::value;
    if (w.bf16) {
      for_each_group(w, [&](int64_t g) { direct_tile<MR, true>(w, xp, g, yp); });
    } else {
      for_each_group(w, [&](int64_t g) { direct_tile<MR, false>(w, xp, g, yp); });
    }
  });
}

#endif  // AVX2 or AVX-512

}  // namespace

bool quant_linear_supported() {
#if defined(MESH_HAS_QUANT_LINEAR)
  return true;
#else
  return false;
#endif
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, bool q4, bool bf16) {
#if !defined(MESH_HAS_QUANT_LINEAR)
  TORCH_CHECK(false, "quant_linear needs AVX2 or AVX-512");
#else
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat ||
                               (bf16 && x.scalar_type() == at::kBFloat16)),
              "x must be fp32 [M, K] (or bf16 with bf16 weights)");
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "blocks must be packed: contiguous uint8 [N / ", kVec, ", K / 32, bytes] "
              "(PackedBlocks.of)");
  const int64_t n = blocks.size(0) * kVec, k = blocks.size(1) * kBlock;
  const PackedWeight probe{nullptr, n, k, q4, bf16};
  TORCH_CHECK(blocks.size(2) == probe.block_bytes(), "a packed block has ", blocks.size(2),
              " bytes; ", q4 ? "Q4_1" : "Q8_0", " with ", kVec, " columns a group has ",
              probe.block_bytes());
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight ", k);
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m == 0) return y;
  const PackedWeight w{blocks.data_ptr<uint8_t>(), n, k, q4, bf16};
#if defined(MESH_HAS_DPBF16)
  if (x.scalar_type() == at::kBFloat16 && m <= kDpRows) {
    const at::Tensor xc = x.contiguous();
    dp_rows(w, xc.data_ptr<BFloat16>(), m, y.data_ptr<float>());
    return y;
  }
#endif
  const at::Tensor xc = x.to(at::kFloat).contiguous();
  dispatch(w, xc.data_ptr<float>(), m, y.data_ptr<float>());
  return y;
#endif
}

bool quant_linear_bf16_dot_supported() {
#if defined(MESH_HAS_DPBF16)
  return true;
#else
  return false;
#endif
}

}  // namespace mesh_cpu

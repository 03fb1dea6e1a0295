// y = x W^T for a bf16 model on AMX tiles (Intel Xeon 4th gen and later): bf16 products,
// fp32 sums, y rounded once to bf16, as oneDNN's bf16 GEMM computes them.
//
// Why not oneDNN (what the dense bf16 linears ran on before): at the few rows of a decode
// step its AMX kernels read SmolLM2's weights at ~60% of the memory bandwidth (a step's
// 120 linears in 11-13 ms at 1-32 rows on 2 cores, 212 MB), and a decode step is that
// read. Here every weight byte is read once per 32 rows of x, in the order the tiles take it:
// W is packed at load into B tiles (16 columns x 32 k, k pairs side by side: AMX's VNNI
// layout), a column tile's tiles one stream in memory.
//
// Each output is the same chain of tile products over k = 0, 32, 64, ... whatever M is or
// which thread computes it: a row's result does not depend on the other rows of x.
//
// amx_linear_silu_mul is a Llama MLP's gate_up projection with SiLU-and-mul in its epilogue:
// a block pairs gate column tile j with up column tile j, so silu(gate) * up is computed from
// the sums while they are in L1, and neither the [M, 2I] product nor a second pass over it
// exists. It rounds where gate_up followed by silu_and_mul (layer_ops.cpp) rounds: gate and
// up to bf16, silu to bf16, the product to bf16; the results are the same bits.
#include "cpu_common.h"
#include "ops.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

#include "amx_tiles.h"

#if defined(MESH_HAS_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace mesh_cpu {

namespace {

constexpr int64_t kTileRows = 16;   // rows of x in an A tile, of y in a C tile
constexpr int64_t kTileCols = 16;   // columns of y in a B or C tile
constexpr int64_t kTileK = 32;      // bf16 k in a tile row (64 bytes)
constexpr int64_t kTileElems = kTileRows * kTileK;   // bf16 in one packed B tile (1 KB)

#if defined(MESH_HAS_AMX)

// Linux gives a process AMX's tile state only when it asks (arch_prctl, once per process).
bool request_amx() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

bool amx_permitted() {
  static const bool permitted = request_amx();
  return permitted;
}

// What a block does with its sums: y = sums (+ bias), or y = silu(gate) * up.
enum class Epilogue { kLinear, kSiluMul };

struct Problem {
  const BFloat16* x;       // [m_padded, k_padded], zero past m and k
  const BFloat16* packed;  // [column tiles, k_padded / 32, 16, 32]
  const float* bias;       // [n] or nullptr
  BFloat16* y;             // [m, n], or [m, n / 2] for kSiluMul
  int64_t m, n, k_padded;
  // A block's second column tile is its first + pair_offset: the next one for a linear, the
  // matching up tile (n / 32 further) for kSiluMul.
  int64_t pair_offset;

  int64_t k_tiles() const { return k_padded / kTileK; }
  const BFloat16* b_tile(int64_t column_tile, int64_t kt) const {
    return packed + (column_tile * k_tiles() + kt) * kTileElems;
  }
};

// y[row0 + r, col0 .. col0 + 16) = silu(gate) * up, gate in sums[r][0..16), up in
// sums[r][16..32), with silu_and_mul's roundings (its helpers, so the same bits).
void silu_mul_rows(const Problem& p, const float (*sums)[2 * kTileCols], int64_t rows,
                   int64_t row0, int64_t col0) {
  static_assert(kVec == kTileCols, "one fp32 vector per tile row");
  const int64_t n_out = p.n / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const fVec gate = round_to<BFloat16>(fVec::loadu(&sums[r][0]));
    const fVec up = round_to<BFloat16>(fVec::loadu(&sums[r][kTileCols]));
    const fVec silu = round_to<BFloat16>(gate / (fVec(1.f) + gate.neg().exp()));
    store_f32(p.y + (row0 + r) * n_out + col0, silu * up);
  }
}

// Rows [row0, row0 + 16 * RT) of y at column tile ct0 (and ct0 + pair_offset when CT is 2).
template <int RT, int CT, Epilogue E>
void tile_block(const Problem& p, int64_t row0, int64_t ct0) {
  static_assert(E == Epilogue::kLinear || CT == 2, "SiLU-and-mul pairs two column tiles");
  const int64_t ct1 = ct0 + p.pair_offset;
  _tile_zero(0);
  if constexpr (CT == 2) _tile_zero(1);
  if constexpr (RT == 2) _tile_zero(2);
  if constexpr (RT == 2 && CT == 2) _tile_zero(3);
  const int64_t x_stride = p.k_padded * 2;
  const BFloat16* a0 = p.x + row0 * p.k_padded;
  const BFloat16* a1 = a0 + kTileRows * p.k_padded;
  for (int64_t kt = 0; kt < p.k_tiles(); ++kt) {
    _tile_loadd(4, a0 + kt * kTileK, x_stride);
    _tile_loadd(6, p.b_tile(ct0, kt), 64);
    if constexpr (CT == 2) _tile_loadd(7, p.b_tile(ct1, kt), 64);
    if constexpr (RT == 2) _tile_loadd(5, a1 + kt * kTileK, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RT == 2 && CT == 2) _tile_dpbf16ps(3, 5, 7);
  }
  // C row r, column c of the block at sums[r][c]; rows 16 apart per row tile.
  alignas(64) float sums[2 * kTileRows][2 * kTileCols];
  constexpr int64_t sums_stride = sizeof(sums[0]);
  _tile_stored(0, &sums[0][0], sums_stride);
  if constexpr (CT == 2) _tile_stored(1, &sums[0][kTileCols], sums_stride);
  if constexpr (RT == 2) _tile_stored(2, &sums[kTileRows][0], sums_stride);
  if constexpr (RT == 2 && CT == 2) _tile_stored(3, &sums[kTileRows][kTileCols], sums_stride);

  const int64_t rows = std::min<int64_t>(RT * kTileRows, p.m - row0);
  if constexpr (E == Epilogue::kSiluMul) {
    silu_mul_rows(p, sums, rows, row0, ct0 * kTileCols);
  } else {
    for (int c = 0; c < CT; ++c) {
      const int64_t col0 = (ct0 + c * p.pair_offset) * kTileCols;
      const int64_t cols = std::min<int64_t>(kTileCols, p.n - col0);
      const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
      const __m512 bias =
          p.bias ? _mm512_maskz_loadu_ps(mask, p.bias + col0) : _mm512_setzero_ps();
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 v = _mm512_add_ps(_mm512_loadu_ps(&sums[r][c * kTileCols]), bias);
        const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(v);
        _mm256_mask_storeu_epi16(p.y + (row0 + r) * p.n + col0, mask, rounded);
      }
    }
  }
}

template <int CT, Epilogue E>
void column_tiles(const Problem& p, int64_t ct0) {
  // NOTE: row blocks inside, so a column tile's weights come from memory once and from L2
  // for the row blocks after the first.
  const int64_t row_tiles = (p.m + kTileRows - 1) / kTileRows;
  int64_t rt = 0;
  for (; rt + 2 <= row_tiles; rt += 2) tile_block<2, CT, E>(p, rt * kTileRows, ct0);
  if (rt < row_tiles) tile_block<1, CT, E>(p, rt * kTileRows, ct0);
}

// Units of work: a linear's column tiles in pairs (the last one may be single); a SiLU-and-mul's
// gate tiles, each with its up tile.
template <Epilogue E>
void run(const Problem& p, int64_t column_tiles_total) {
  const int64_t pairs = column_tiles_total / 2;
  const int64_t units = E == Epilogue::kSiluMul ? pairs : pairs + column_tiles_total % 2;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    configure_full_tiles();   // C: tiles 0-3 (2 row x 2 column tiles), A: 4-5, B: 6-7
    for (int64_t u = begin; u < end; ++u) {
      if constexpr (E == Epilogue::kSiluMul) {
        column_tiles<2, E>(p, u);
      } else if (u < pairs) {
        column_tiles<2, E>(p, 2 * u);
      } else {
        column_tiles<1, E>(p, 2 * u);
      }
    }
    _tile_release();
  });
}

// x as the A tiles read it: rows a multiple of 16, k of 32, zeros past the ends.
at::Tensor padded_input(const at::Tensor& x, int64_t k_padded) {
  at::Tensor xp = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), m_padded = round_up(m, kTileRows);
  if (m_padded == m && k_padded == k) return xp;
  at::Tensor padded = at::zeros({m_padded, k_padded}, x.options());
  padded.narrow(0, 0, m).narrow(1, 0, k).copy_(xp);
  return padded;
}

void check_inputs(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(amx_permitted(), "the kernel did not grant this process AMX's tile state");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bf16 [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.size(2) == kTileRows &&
                  packed.size(3) == kTileK,
              "packed must come from amx_pack_bf16: contiguous bf16 [N/16, K/32, 16, 32]");
  const int64_t k = x.size(1), k_padded = packed.size(1) * kTileK;
  TORCH_CHECK(round_up(k, kTileK) == k_padded, "x has ", k, " columns, the weight ",
              k_padded, " (padded to 32)");
  TORCH_CHECK(n > 0 && round_up(n, kTileCols) == packed.size(0) * kTileCols,
              "n = ", n, " does not match the packed weight's ", packed.size(0),
              " column tiles");
}

// y (allocated: [M, n], or [M, n / 2] for kSiluMul) = the epilogue E of x @ W^T.
template <Epilogue E>
void multiply(const at::Tensor& x, const at::Tensor& packed, int64_t n, const float* bias,
              at::Tensor& y) {
  if (x.size(0) == 0) return;
  const int64_t k_padded = packed.size(1) * kTileK;
  const at::Tensor xp = padded_input(x, k_padded);
  const int64_t pair_offset = E == Epilogue::kSiluMul ? n / 2 / kTileCols : 1;
  run<E>(Problem{xp.data_ptr<BFloat16>(), packed.data_ptr<BFloat16>(), bias,
                 y.data_ptr<BFloat16>(), x.size(0), n, k_padded, pair_offset},
         packed.size(0));
}

#endif  // MESH_HAS_AMX

}  // namespace

bool amx_linear_supported() {
#if defined(MESH_HAS_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

at::Tensor amx_pack_bf16(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "weight must be bf16 [N, K]");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t column_tiles = round_up(n, kTileCols) / kTileCols;
  const int64_t k_tiles = round_up(k, kTileK) / kTileK;
  at::Tensor packed = at::zeros({column_tiles, k_tiles, kTileRows, kTileK}, w.options());
  const BFloat16* src = w.data_ptr<BFloat16>();
  BFloat16* dst = packed.data_ptr<BFloat16>();
  // B tile row p holds k = 2p and 2p + 1 of its 16 columns side by side (VNNI pairs).
  at::parallel_for(0, column_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ct = begin; ct < end; ++ct) {
      for (int64_t c = 0; c < kTileCols && ct * kTileCols + c < n; ++c) {
        const BFloat16* row = src + (ct * kTileCols + c) * k;
        for (int64_t kk = 0; kk < k; ++kk) {
          const int64_t kt = kk / kTileK, within = kk % kTileK;
          dst[((ct * k_tiles + kt) * kTileRows + within / 2) * kTileK + 2 * c + within % 2] =
              row[kk];
        }
      }
    }
  });
  return packed;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                      const std::optional<at::Tensor>& bias) {
#if !defined(MESH_HAS_AMX)
  TORCH_CHECK(false, "amx_linear needs a CPU with AMX-BF16 (and a kernel that allows it)");
#else
  check_inputs(x, packed, n);
  at::Tensor bias_fp32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias must be [N]");
    bias_fp32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  multiply<Epilogue::kLinear>(x, packed, n,
                              bias.has_value() ? bias_fp32.data_ptr<float>() : nullptr, y);
  return y;
#endif
}

at::Tensor amx_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
#if !defined(MESH_HAS_AMX)
  TORCH_CHECK(false, "amx_linear_silu_mul needs a CPU with AMX-BF16 (and a kernel that allows it)");
#else
  check_inputs(x, packed, n);
  TORCH_CHECK(n % (2 * kTileCols) == 0, "gate and up must each be a multiple of ", kTileCols,
              " columns (n = ", n, ")");
  at::Tensor y = at::empty({x.size(0), n / 2}, x.options());
  multiply<Epilogue::kSiluMul>(x, packed, n, nullptr, y);
  return y;
#endif
}

}  // namespace mesh_cpu

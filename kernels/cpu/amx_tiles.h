// What the AMX kernels (amx_linear.cpp, attention_prefill_bf16.cpp) share: their tile shape.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define MESH_HAS_AMX 1
#include <immintrin.h>

#include <cstdint>

namespace mesh_cpu {

// Palette 1's layout of a tile configuration (ldtilecfg's 64-byte operand).
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile 16 rows of 64 bytes: an A tile of 16 x 32 bf16, a B tile of 16 pairs x 16
// columns, a C tile of 16 x 16 fp32. Per thread: call it before the tiles, _tile_release()
// after.
inline void configure_full_tiles() {
  TileConfig config{};
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

}  // namespace mesh_cpu

#endif

// AMX tile configuration shared by the AMX GEMM and the AMX prompt attention: eight tiles of
// 16 rows x 64 bytes (an A tile is 16 rows x 32 bf16, a B tile 16 k-pairs x 16 columns, a C
// tile 16 x 16 float32). Only the AMX level compiles the code that includes it.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace mstar_cpu {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline void configure_tiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace mstar_cpu
#endif

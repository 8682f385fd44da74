// AMX tile plumbing shared by the kernels that use tiles (amx_linear.cpp,
// paged_decode.cpp). RADIXMUX_AMX is defined where the compiler targets AMX.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define RADIXMUX_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace radixmux {

// The 64-byte operand of ldtilecfg (palette 1).
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out AMX state only to processes that ask (ARCH_REQ_XCOMP_PERM
// for XTILEDATA); asking again is harmless.
inline bool request_amx() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// Tiles 0-7 all 16 rows of 64 bytes: one config for kernels whose operands
// are padded to whole tiles.
inline void configure_full_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace radixmux
#endif

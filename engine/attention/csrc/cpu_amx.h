// What our AMX kernels share (bfloat16 matmuls in tiles: cpu_amx_linear.cpp; decode attention's
// scores: cpu_decode_attention.cpp): whether this build has AMX, the tile configuration record and
// the one-time request for AMX state that Linux requires.

#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#define PDSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define PDSERVE_AMX 0
#endif

namespace pdserve_amx {

#if PDSERVE_AMX

// Linux gives a process AMX's 8 KiB of tile state only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA); asking again is harmless.
inline bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// The 64-byte record ldtilecfg reads: palette 1, then each tile's bytes per row and rows.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// ldtilecfg with `cfg`. GCC 12's builtin is not seen to read the whole record: inlined into a
// caller, the stores of the rows and widths were dropped as dead, leaving palette 1 with no tile
// configured, and the first tile instruction faulted (SIGILL). The empty asm, reading all 64
// bytes, keeps every store ahead of the load.
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "m"(cfg) : "memory");
  _tile_loadconfig(&cfg);
}

#endif  // PDSERVE_AMX

}  // namespace pdserve_amx

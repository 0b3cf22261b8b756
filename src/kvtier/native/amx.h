// AMX helpers shared by kvtier's CPU operators (linear_ops.cpp, attend_bf16.cpp): the tile
// configuration record and Linux's permission. Compiled only where the compiler targets
// AMX (-march=native on a CPU with AMX-TILE and AMX-BF16); callers check kvtier_amx::kBuilt.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvtier_amx {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr bool kBuilt = true;

struct alignas(64) TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux hands a process AMX's tile state only when asked (arch_prctl, once per process).
inline bool granted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

// Every tile 16 rows of 64 bytes (palette 1), for the calling thread.
inline void configure_full() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}
#else
constexpr bool kBuilt = false;
inline bool granted() { return false; }
#endif

}  // namespace kvtier_amx

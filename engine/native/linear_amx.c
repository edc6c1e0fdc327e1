/* Multi-row bf16 projections on AMX tiles (TDPBF16PS), for CPUs that have them.
 *
 * One TDPBF16PS multiplies a 16 x 32 bf16 tile of input rows by a 16-pair x 16-column
 * tile of weights into a 16 x 16 float32 tile: 8192 multiply-adds per instruction,
 * where VDPBF16PS (linear_bf16.c) does 32. The weights need no repacking: a strip of
 * linear_bf16.c's layout, [K2 / 2][NR = 32][2], is two weight tiles side by side (16
 * columns x 2 k = 64 bytes each, 128 bytes apart from one k pair to the next), which
 * is the pair-interleaved form the instruction reads. The input rows are the bf16
 * scratch linear_team_bf16 fills ([M][K2]).
 *
 * Tiles: C00 C01 C10 C11 (tmm0-3) accumulate a 32-row x 32-column block, A0 A1 (tmm4,
 * tmm5) hold rows 0-15 and 16-31 of it, B0 B1 (tmm6, tmm7) the strip's two column
 * halves. The sums leave through a small buffer, where the bias and the residual
 * (accumulate) are added with AVX-512. Rows per tile follow the block, so a tail block
 * is configured with fewer rows rather than padded.
 *
 * Linux hands out the tile state per process on request (arch_prctl); pd_use_amx asks
 * once, and linear_team_bf16 uses these tiles only after it said yes.
 */
#include "native.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && VL == 16
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define PAIRS_PER_TILE 16      /* k pairs in one A row / one B tile: 32 bf16, 64 bytes */
#define BLOCK_ROWS 32          /* two A tiles */
#define PANEL_BYTES (768 << 10) /* input rows per panel, in bf16 bytes: stays in L2 */
/* From 2 rows on the tiles win: one core, 576 -> 960, 2 rows: 14 against 29 us on
 * VDPBF16PS; 16 rows x 576 -> 3072: 0.15 against 0.54 ms. */
#define AMX_MIN_ROWS 2

static int amx_on = 0;

int pd_use_amx(int wanted) {
  static int granted = -1;
  if (wanted && granted < 0)
    granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  amx_on = wanted && granted > 0;
  return amx_on;
}

int amx_takes(long M, long K2) {
  return amx_on && M >= AMX_MIN_ROWS && K2 % (2 * PAIRS_PER_TILE) == 0;
}

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

/* C0x and A0 hold rows0 rows, C1x and A1 rows1 (0: unused); every tile row is 64 bytes. */
static void configure_tiles(int rows0, int rows1) {
  tile_config cfg = {0};
  cfg.palette = 1;
  int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, PAIRS_PER_TILE, PAIRS_PER_TILE};
  for (int t = 0; t < 8; t++) {
    cfg.rows[t] = (uint8_t)rows[t];
    cfg.colsb[t] = rows[t] ? 64 : 0;
  }
  _tile_loadconfig(&cfg);
}

/* y[r][c] (+)= sums[r][c] + bias[c] for a block's rows and its strip's 32 columns. */
static void store_block(const float (*sums)[PD_NR], int rows, const float *bias, float *y,
                        long ldy, int accumulate) {
  for (int r = 0; r < rows; r++)
    for (int v = 0; v < PD_NR; v += 16) {
      __m512 out = _mm512_load_ps(&sums[r][v]);
      if (bias) out = _mm512_add_ps(out, _mm512_loadu_ps(bias + v));
      if (accumulate) out = _mm512_add_ps(out, _mm512_loadu_ps(y + r * ldy + v));
      _mm512_storeu_ps(y + r * ldy + v, out);
    }
}

/* One 32-column strip over rows [0, rows) of x (at most BLOCK_ROWS), all of K. */
static void strip_block(const uint16_t *x, long K2, const uint16_t *ws, int rows0, int rows1,
                        float (*sums)[PD_NR]) {
  const long x_stride = K2 * 2, w_stride = PD_NR * 2 * 2; /* bytes per row */
  _tile_zero(0);
  _tile_zero(1);
  if (rows1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (long p = 0; p < K2 / 2; p += PAIRS_PER_TILE) {
    const uint16_t *wp = ws + p * 2 * PD_NR;
    _tile_loadd(6, wp, w_stride);
    _tile_loadd(7, wp + 32, w_stride);
    _tile_loadd(4, x + 2 * p, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (rows1) {
      _tile_loadd(5, x + 16 * K2 + 2 * p, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, &sums[0][0], sizeof sums[0]);
  _tile_stored(1, &sums[0][16], sizeof sums[0]);
  if (rows1) {
    _tile_stored(2, &sums[16][0], sizeof sums[0]);
    _tile_stored(3, &sums[16][16], sizeof sums[0]);
  }
}

void gemm_amx(const uint16_t *x, long M, long K2, const uint16_t *w, long s0, long s1,
              const float *bias, float *y, long ldy, int accumulate) {
  float sums[BLOCK_ROWS][PD_NR] __attribute__((aligned(64)));
  long panel = PANEL_BYTES / (2 * K2) / BLOCK_ROWS * BLOCK_ROWS;
  panel = panel < BLOCK_ROWS ? BLOCK_ROWS : panel;
  int configured = -1;
  for (long m0 = 0; m0 < M; m0 += panel) {
    long m1 = m0 + panel < M ? m0 + panel : M;
    for (long s = s0; s < s1; s++) {
      const uint16_t *ws = w + s * K2 * PD_NR;
      for (long m = m0; m < m1; m += BLOCK_ROWS) {
        long left = m1 - m;
        int rows0 = left < 16 ? (int)left : 16;
        int rows1 = left > 16 ? (int)(left < BLOCK_ROWS ? left - 16 : 16) : 0;
        int shape = rows0 * (BLOCK_ROWS + 1) + rows1; /* the tile rows now configured */
        if (configured != shape) {
          configure_tiles(rows0, rows1);
          configured = shape;
        }
        strip_block(x + m * K2, K2, ws, rows0, rows1, sums);
        store_block((const float (*)[PD_NR])sums, rows0 + rows1, bias ? bias + s * PD_NR : 0,
                    y + m * ldy + s * PD_NR, ldy, accumulate);
      }
    }
  }
  if (configured >= 0) _tile_release();
}

#else

int pd_use_amx(int wanted) {
  (void)wanted;
  return 0;
}

int amx_takes(long M, long K2) {
  (void)M, (void)K2;
  return 0;
}

void gemm_amx(const uint16_t *x, long M, long K2, const uint16_t *w, long s0, long s1,
              const float *bias, float *y, long ldy, int accumulate) {
  (void)x, (void)M, (void)K2, (void)w, (void)s0, (void)s1, (void)bias, (void)y, (void)ldy,
      (void)accumulate; /* never called: amx_takes() said no */
}

#endif

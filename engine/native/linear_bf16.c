/* Projections on bfloat16 weights with AVX512-BF16 dot products (VDPBF16PS): each
 * instruction multiplies 16 pairs of bf16 and adds both products of a pair into one
 * float32 lane, twice the multiply-adds of a float32 FMA on the same vector, from half
 * the weight bytes. Inputs are rounded to bf16 on their way in (as a bf16 model's
 * activations are); outputs, the residual and everything between the projections stay
 * float32.
 *
 * Weights are packed at load into strips of PD_NR output columns whose K runs in pairs
 * ([N / NR][K2 / 2][NR][2], K2 = K rounded up to even, the pad zero): one vector load is
 * 16 columns x 2 k. Input rows go into the shared scratch as bf16 [M][K2] (through the
 * RMSNorm or SiLU*mul prologue, or as they are), so a pair of them broadcasts as one
 * 32-bit value. Tiling, strip split across the team and prefetching follow linear.c.
 *
 * Built only where the compiler targets AVX512-BF16 (`pd_has_bf16`); the Python side
 * packs bf16 weights only then.
 */
#include "native.h"

#if defined(__AVX512BF16__) && VL == 16
#include <immintrin.h>

int pd_has_bf16(void) { return 1; }

#define GEMV_PF_AHEAD 2048 /* bf16 elements a one-row projection prefetches ahead */
#define KP 256 /* k pairs per block: a strip piece of KP x NR x 2 bf16 (32 KiB) stays in L1 */

static inline __m512bh bf16_pair_lanes(const uint16_t *w) {
  return (__m512bh)_mm512_loadu_si512((const void *)w);
}

/* MR rows x NR columns over kp pairs; x: bf16 pairs of the rows (stride ldx pairs). */
static inline __attribute__((always_inline)) void tile_bf16(int MR, const uint32_t *x, long ldx,
                                                            const uint16_t *w, long kp, float *y,
                                                            long ldy, int load_c,
                                                            const float *bias,
                                                            const uint16_t *pf) {
  __m512 acc[12][2];
  for (int i = 0; i < MR; i++)
    for (int c = 0; c < 2; c++)
      acc[i][c] = load_c ? _mm512_loadu_ps(y + i * ldy + c * 16) : _mm512_setzero_ps();
  for (long p = 0; p < kp; p++) {
    if (pf) __builtin_prefetch(pf + p * 2 * PD_NR, 0, 2), __builtin_prefetch(pf + p * 2 * PD_NR + 32, 0, 2);
    __m512bh b0 = bf16_pair_lanes(w + p * 2 * PD_NR), b1 = bf16_pair_lanes(w + p * 2 * PD_NR + 32);
    for (int i = 0; i < MR; i++) {
      __m512bh a = (__m512bh)_mm512_set1_epi32((int)x[i * ldx + p]);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
    }
  }
  for (int i = 0; i < MR; i++)
    for (int c = 0; c < 2; c++) {
      __m512 out = acc[i][c];
      if (bias) out = _mm512_add_ps(out, _mm512_loadu_ps(bias + c * 16));
      _mm512_storeu_ps(y + i * ldy + c * 16, out);
    }
}

typedef void (*tile_bf16_fn)(const uint32_t *, long, const uint16_t *, long, float *, long, int,
                             const float *, const uint16_t *);
#define TILE_BF16(MR)                                                                       \
  static void tile_bf16_##MR(const uint32_t *x, long ldx, const uint16_t *w, long kp, float *y, \
                             long ldy, int load_c, const float *bias, const uint16_t *pf) {  \
    tile_bf16(MR, x, ldx, w, kp, y, ldy, load_c, bias, pf);                                 \
  }
TILE_BF16(1) TILE_BF16(2) TILE_BF16(3) TILE_BF16(4) TILE_BF16(5) TILE_BF16(6) TILE_BF16(7)
TILE_BF16(8) TILE_BF16(9) TILE_BF16(10) TILE_BF16(11) TILE_BF16(12)
static const tile_bf16_fn TILES_BF16[13] = {
    0, tile_bf16_1, tile_bf16_2, tile_bf16_3, tile_bf16_4,  tile_bf16_5,  tile_bf16_6,
    tile_bf16_7, tile_bf16_8, tile_bf16_9, tile_bf16_10, tile_bf16_11, tile_bf16_12,
};
#define MR_BF16 12

/* One row over NS (1 or 2) consecutive strips, pairs split over two chains (even and
 * odd pairs, summed at the end): memory-bound; gemv_group in linear.c, on bf16 pairs.
 * Each strip's stream is prefetched into L2 GEMV_PF_AHEAD bf16 (4 KiB) ahead: the
 * hardware prefetchers alone left a batch-1 bf16 decode step streaming its weights at
 * about half a plain read's bandwidth, and this took 11-14% off the
 * step (A/B in one process, both orders; into L1, or non-temporal, it was slower). */
static inline __attribute__((always_inline)) void gemv_group_bf16(int NS, const uint32_t *x,
                                                                  const uint16_t *ws, long K2,
                                                                  const float *bias, float *y,
                                                                  int accumulate) {
  long pairs = K2 / 2, strip = K2 * PD_NR; /* bf16 per strip */
  __m512 acc[2][2][2];                      /* [chain][strip][vector] */
  for (int c = 0; c < 2; c++)
    for (int t = 0; t < NS; t++)
      for (int v = 0; v < 2; v++) acc[c][t][v] = _mm512_setzero_ps();
  long p = 0;
  for (; p + 2 <= pairs; p += 2)
    for (int c = 0; c < 2; c++) {
      for (int t = 0; t < NS; t++)
        __builtin_prefetch(ws + t * strip + (p + c) * 2 * PD_NR + GEMV_PF_AHEAD, 0, 2);
      __m512bh a = (__m512bh)_mm512_set1_epi32((int)x[p + c]);
      for (int t = 0; t < NS; t++)
        for (int v = 0; v < 2; v++)
          acc[c][t][v] = _mm512_dpbf16_ps(
              acc[c][t][v], a, bf16_pair_lanes(ws + t * strip + (p + c) * 2 * PD_NR + v * 32));
    }
  for (; p < pairs; p++) {
    __m512bh a = (__m512bh)_mm512_set1_epi32((int)x[p]);
    for (int t = 0; t < NS; t++)
      for (int v = 0; v < 2; v++)
        acc[0][t][v] = _mm512_dpbf16_ps(acc[0][t][v], a,
                                        bf16_pair_lanes(ws + t * strip + p * 2 * PD_NR + v * 32));
  }
  for (int t = 0; t < NS; t++)
    for (int v = 0; v < 2; v++) {
      float *dst = y + t * PD_NR + v * 16;
      __m512 out = _mm512_add_ps(acc[0][t][v], acc[1][t][v]);
      if (bias) out = _mm512_add_ps(out, _mm512_loadu_ps(bias + t * PD_NR + v * 16));
      if (accumulate) out = _mm512_add_ps(out, _mm512_loadu_ps(dst));
      _mm512_storeu_ps(dst, out);
    }
}

static void gemv_bf16(const uint32_t *x, const uint16_t *w, long K2, long s0, long s1,
                      const float *bias, float *y, int accumulate) {
  for (long s = s0; s < s1; s += 2) {
    const float *b = bias ? bias + s * PD_NR : 0;
    if (s + 2 <= s1)
      gemv_group_bf16(2, x, w + s * K2 * PD_NR, K2, b, y + s * PD_NR, accumulate);
    else
      gemv_group_bf16(1, x, w + s * K2 * PD_NR, K2, b, y + s * PD_NR, accumulate);
  }
}

#define MC_BYTES_BF16 (256 * 1024) /* input rows per panel: about this many bytes of bf16 */

static void gemm_bf16(const uint32_t *x, long M, long K2, const uint16_t *w, long s0, long s1,
                      const float *bias, float *y, long ldy, int accumulate) {
  long pairs = K2 / 2, strip = K2 * PD_NR, ldx = pairs;
  long mc = MC_BYTES_BF16 / (2 * K2) / MR_BF16 * MR_BF16;
  mc = mc < MR_BF16 ? MR_BF16 : mc;
  const uint16_t *end = w + s1 * strip;
  for (long m0 = 0; m0 < M; m0 += mc) {
    long m1 = m0 + mc < M ? m0 + mc : M;
    row_groups rg = split_rows(m1 - m0, MR_BF16);
    for (long s = s0; s < s1; s++) {
      const uint16_t *ws = w + s * strip;
      for (long p0 = 0; p0 < pairs; p0 += KP) {
        long kp = pairs - p0 < KP ? pairs - p0 : KP;
        int last = p0 + kp >= pairs;
        const uint16_t *next = ws + (p0 + kp) * 2 * PD_NR;
        next = next + kp * 2 * PD_NR <= end ? next : 0;
        for (long g = 0, m = m0; g < rg.groups; g++) {
          long mr = group_rows(rg, g);
          int fetcher = g == (rg.groups > 1);
          TILES_BF16[mr](x + m * ldx + p0, ldx, ws + p0 * 2 * PD_NR, kp, y + m * ldy + s * PD_NR,
                         ldy, accumulate || p0 > 0, last && bias ? bias + s * PD_NR : 0,
                         fetcher ? next : 0);
          m += mr;
        }
      }
    }
  }
}

/* Columns past N in the last strip: scalar, into y directly (rare: N % NR != 0). */
static void tail_bf16(const uint16_t *x, long M, long K2, const uint16_t *ws, long col0,
                      long ncols, const float *bias, float *y, long ldy, int accumulate) {
  for (long m = 0; m < M; m++)
    for (long j = 0; j < ncols; j++) {
      float s = 0.0f;
      for (long k = 0; k < K2; k++)
        s += bf16_to_float(x[m * K2 + k]) * bf16_to_float(ws[(k / 2) * 2 * PD_NR + 2 * j + k % 2]);
      if (bias) s += bias[col0 + j];
      float *out = y + m * ldy + col0 + j;
      *out = accumulate ? *out + s : s;
    }
}

/* 16 floats -> 16 bf16 (round to nearest even) at out. */
static inline void store_bf16x16(uint16_t *out, __m512 v) {
  _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(v));
}

/* As store_bf16x16, one float (native.h's float_to_bf16 differs on denormals). */
static inline uint16_t round_bf16_ss(float f) {
  return (uint16_t)_mm_cvtsi128_si32((__m128i)_mm_cvtneps_pbh(_mm_set_ss(f)));
}

/* One input row into bf16 [K2]: through the prologue, the pad column zero. */
static void row_to_bf16(const linear_args *a, long m, uint16_t *out) {
  long K = a->K, k = 0;
  const float *x = a->x + m * a->ldx;
  if (a->prologue == PROLOGUE_RMSNORM) {
    __m512 acc = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(x + k), acc);
    float ss = _mm512_reduce_add_ps(acc);
    for (; k < K; k++) ss += x[k] * x[k];
    float scale = 1.0f / sqrtf(ss / (float)K + a->eps);
    __m512 vs = _mm512_set1_ps(scale);
    for (k = 0; k + 16 <= K; k += 16)
      store_bf16x16(out + k, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + k), vs),
                                           _mm512_loadu_ps(a->norm_weight + k)));
    for (; k < K; k++) out[k] = round_bf16_ss(x[k] * scale * a->norm_weight[k]);
  } else if (a->prologue == PROLOGUE_SILU_MUL) {
    for (; k + 16 <= K; k += 16) {
      vf g = LOADU(x + k), u = LOADU(x + K + k);
      store_bf16x16(out + k, (__m512)(g / (splat(1.0f) + vexp(-g)) * u));
    }
    for (; k < K; k++) out[k] = round_bf16_ss(x[k] / (1.0f + sexp(-x[k])) * x[K + k]);
  } else {
    for (; k + 16 <= K; k += 16) store_bf16x16(out + k, _mm512_loadu_ps(x + k));
    for (; k < K; k++) out[k] = round_bf16_ss(x[k]);
  }
  if (K % 2) out[K] = 0;
}

void linear_team_bf16(const linear_args *a, int t, int nt) {
  long K2 = a->K + a->K % 2, strips = (a->N + PD_NR - 1) / PD_NR, full = a->N / PD_NR;
  uint16_t *in = (uint16_t *)a->scratch;
  const uint16_t *w = (const uint16_t *)a->w;
  for (long m = t; m < a->M; m += nt) row_to_bf16(a, m, in + m * K2);
#pragma omp barrier
  long s0, s1;
  team_strips(a->N, t, nt, &s0, &s1);
  const uint32_t *pairs = (const uint32_t *)in;
  if (s0 < s1) {
    /* Deterministic mode: every M on the VDPBF16PS tiles, whose rows each sum their pairs
     * in order; the one-row pass (two chains) and the AMX tiles (another instruction's
     * rounding) would give a row other bits by its batch. */
    if (a->M == 1 && !a->deterministic)
      gemv_bf16(pairs, w, K2, s0, s1, a->bias, a->y, a->accumulate);
    else if (!a->deterministic && amx_takes(a->M, K2))
      gemm_amx(in, a->M, K2, w, s0, s1, a->bias, a->y, a->ldy, a->accumulate);
    else
      gemm_bf16(pairs, a->M, K2, w, s0, s1, a->bias, a->y, a->ldy, a->accumulate);
  }
  if (full < strips && t == nt - 1)
    tail_bf16(in, a->M, K2, w + full * K2 * PD_NR, full * PD_NR, a->N - full * PD_NR, a->bias,
              a->y, a->ldy, a->accumulate);
}

#else

int pd_has_bf16(void) { return 0; }

void linear_team_bf16(const linear_args *a, int t, int nt) {
  (void)a, (void)t, (void)nt; /* never called: pd_has_bf16() says so first */
}

#endif

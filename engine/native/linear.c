/* Projections on weights packed once at load into strips of PD_NR output columns
 * ([N / NR][K][NR]): every matmul streams its weight sequentially. One row (batch-1
 * decode) is a memory-bound pass over four strips at a time, two to four rows (small
 * decode batches) one over two or three; more rows run register tiles of MR_MAX x NR
 * over K blocks of KC, each strip piece staying in cache across the row groups. A prologue
 * (RMSNorm, or SiLU(gate) * up) runs on the input rows first, into a scratch the team
 * shares (a one-row projection: each thread's own copy); bias and the residual add are
 * the epilogue.
 *
 * Why our own: on AVX2 CPUs, MKL's sgemm streamed a
 * decode step's weights at ~11 GB/s, under half the read bandwidth, and repacks the
 * weight on every small-batch call.
 */
#include "native.h"

#ifndef PF_LOCALITY
#define PF_LOCALITY 2 /* __builtin_prefetch locality of the next weight piece */
#endif
#define GEMV_PF_AHEAD 1024 /* floats a one-row projection prefetches ahead, per strip */
#ifndef GEMV_STRIPS
#define GEMV_STRIPS 4 /* strips a one-row projection streams at once (gemv_strips) */
#endif

int pd_strip_width(void) { return PD_NR; }

/* MR rows x NR columns, over kc of K. load_c: start from y (accumulate / later K block).
 * pf: npf lines (strip rows of NR floats: one line each on AVX2) of the weight piece to
 * be streamed next, or NULL; one every other k where they fit, else one per k. */
static inline __attribute__((always_inline)) void tile(int MR, const float *x, long ldx,
                                                       const float *w, long kc, float *y,
                                                       long ldy, int load_c, const float *bias,
                                                       const float *pf, long npf) {
  const int every_other = npf * 2 <= kc; /* 1: a line at each even k, 0: at each k */
  vf acc[24][PD_NV];
  for (int i = 0; i < MR; i++)
    for (int c = 0; c < PD_NV; c++) acc[i][c] = load_c ? LOADU(y + i * ldy + c * VL) : splat(0.0f);
  for (long k = 0; k < kc; k++) {
    vf b[PD_NV];
    if (pf && !(k & every_other) && (k >> every_other) < npf)
      __builtin_prefetch(pf + (k >> every_other) * PD_NR, 0, PF_LOCALITY);
    for (int c = 0; c < PD_NV; c++) b[c] = LOADA(w + k * PD_NR + c * VL);
    for (int i = 0; i < MR; i++) {
      vf xa = splat(x[i * ldx + k]);
      for (int c = 0; c < PD_NV; c++) acc[i][c] = vfma(xa, b[c], acc[i][c]);
    }
  }
  for (int c = 0; c < PD_NV && bias; c++)
    for (int i = 0; i < MR; i++) acc[i][c] += LOADU(bias + c * VL);
  for (int i = 0; i < MR; i++)
    for (int c = 0; c < PD_NV; c++) STOREU(y + i * ldy + c * VL, acc[i][c]);
}

typedef void (*tile_fn)(const float *, long, const float *, long, float *, long, int,
                        const float *, const float *, long);
#define TILE(MR)                                                                        \
  static void tile_##MR(const float *x, long ldx, const float *w, long kc, float *y,   \
                        long ldy, int load_c, const float *bias, const float *pf,      \
                        long npf) {                                                    \
    tile(MR, x, ldx, w, kc, y, ldy, load_c, bias, pf, npf);                            \
  }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8) TILE(9) TILE(10) TILE(11)
TILE(12) TILE(13) TILE(14) TILE(15) TILE(16) TILE(17) TILE(18) TILE(19) TILE(20) TILE(21)
TILE(22) TILE(23) TILE(24)
static const tile_fn TILES[25] = {
    0,       tile_1,  tile_2,  tile_3,  tile_4,  tile_5,  tile_6,  tile_7,  tile_8,
    tile_9,  tile_10, tile_11, tile_12, tile_13, tile_14, tile_15, tile_16, tile_17,
    tile_18, tile_19, tile_20, tile_21, tile_22, tile_23, tile_24,
};

/* Columns past N in the last strip: scalar, into y directly (rare: N % NR != 0). */
static void tail_strip(const float *x, long ldx, long M, long K, const float *ws, long col0,
                       long ncols, const float *bias, float *y, long ldy, int accumulate) {
  for (long m = 0; m < M; m++)
    for (long j = 0; j < ncols; j++) {
      float s = 0.0f;
      for (long k = 0; k < K; k++) s += x[m * ldx + k] * ws[k * PD_NR + j];
      if (bias) s += bias[col0 + j];
      float *out = y + m * ldy + col0 + j;
      *out = accumulate ? *out + s : s;
    }
}

/* One row over NS (1 to GEMV_STRIPS) consecutive strips, K split over two dependency
 * chains (even and odd k, summed at the end): memory-bound. Every column sums in that
 * order, whatever the strip width, the strips grouped together or their split over
 * threads. Each strip's stream is prefetched into L2 GEMV_PF_AHEAD floats ahead: 8 KiB
 * over two strips made a float32 batch-1 decode step 10-17% shorter
 * (A/B in one process, both orders; 4 KiB ahead gained 7%). Over four strips, 4 KiB
 * each (the same 16 KiB in flight per thread) was 1.4-1.6% faster than 8 KiB,
 * and 2 KiB the same as 4. */
static inline __attribute__((always_inline)) void gemv_group(int NS, const float *x,
                                                             const float *ws, long K,
                                                             const float *bias, float *y,
                                                             int accumulate) {
  vf acc[2][GEMV_STRIPS][PD_NV]; /* [chain][strip][vector] */
  for (int c = 0; c < 2; c++)
    for (int t = 0; t < NS; t++)
      for (int v = 0; v < PD_NV; v++) acc[c][t][v] = splat(0.0f);
  long k = 0;
  for (; k + 2 <= K; k += 2)
    for (int c = 0; c < 2; c++) {
      for (int t = 0; t < NS; t++)
        __builtin_prefetch(ws + t * K * PD_NR + (k + c) * PD_NR + GEMV_PF_AHEAD, 0, PF_LOCALITY);
      vf xk = splat(x[k + c]);
      for (int t = 0; t < NS; t++)
        for (int v = 0; v < PD_NV; v++)
          acc[c][t][v] += xk * LOADA(ws + t * K * PD_NR + (k + c) * PD_NR + v * VL);
    }
  for (; k < K; k++) {
    vf xk = splat(x[k]);
    for (int t = 0; t < NS; t++)
      for (int v = 0; v < PD_NV; v++) acc[0][t][v] += xk * LOADA(ws + t * K * PD_NR + k * PD_NR + v * VL);
  }
  for (int t = 0; t < NS; t++)
    for (int v = 0; v < PD_NV; v++) {
      float *dst = y + t * PD_NR + v * VL;
      vf out = acc[0][t][v] + acc[1][t][v];
      if (bias) out += LOADU(bias + t * PD_NR + v * VL);
      if (accumulate) out += LOADU(dst);
      STOREU(dst, out);
    }
}

/* A thread's strips [s0, s1), GEMV_STRIPS at a time: four weight streams per core kept
 * more reads in flight than two. A batch-1 float32 step of the demo model
 * took 3.7-7% less at four than at two (step-interleaved A/B in one process, three
 * runs), 2.7-5% less at three or six; eight spilled the accumulators (+5%). */
static void gemv_strips(const float *x, const float *w, long K, long s0, long s1,
                        const float *bias, float *y, int accumulate) {
  for (long s = s0; s < s1;) {
    const float *b = bias ? bias + s * PD_NR : 0, *ws = w + s * K * PD_NR;
    float *ys = y + s * PD_NR;
    switch (s1 - s < GEMV_STRIPS ? s1 - s : GEMV_STRIPS) {
      case 1: gemv_group(1, x, ws, K, b, ys, accumulate); s += 1; break;
      case 2: gemv_group(2, x, ws, K, b, ys, accumulate); s += 2; break;
      case 3: gemv_group(3, x, ws, K, b, ys, accumulate); s += 3; break;
      default: gemv_group(GEMV_STRIPS, x, ws, K, b, ys, accumulate); s += GEMV_STRIPS;
    }
  }
}

/* A projection of 2 to FEW_ROWS_MAX rows (a small decode batch), memory-bound like one
 * row: NS strips streamed at once, each prefetched as in gemv_group, every row against
 * every weight vector loaded. Each column sums as tile() sums it (from y when
 * accumulating, else 0, k in order, the bias last), so a row's values do not depend on
 * the path its batch took. Decode steps of the demo model (float32,
 * 2 threads, step-interleaved A/B against the tiles, which stream one strip a piece at a
 * time): batch 2 19% shorter, 3 and 4 9-10%. One strip at a time was slower than the
 * tiles at 4 rows (+4%). */
#define FEW_ROWS_MAX 4

static inline __attribute__((always_inline)) void few_rows_group(int M, int NS, const float *x,
                                                                 long ldx, const float *ws,
                                                                 long K, const float *bias,
                                                                 float *y, long ldy,
                                                                 int accumulate) {
  vf acc[FEW_ROWS_MAX][GEMV_STRIPS][PD_NV]; /* [row][strip][vector] */
  for (int i = 0; i < M; i++)
    for (int t = 0; t < NS; t++)
      for (int v = 0; v < PD_NV; v++)
        acc[i][t][v] = accumulate ? LOADU(y + i * ldy + t * PD_NR + v * VL) : splat(0.0f);
  for (long k = 0; k < K; k++) {
    for (int t = 0; t < NS; t++)
      __builtin_prefetch(ws + t * K * PD_NR + k * PD_NR + GEMV_PF_AHEAD, 0, PF_LOCALITY);
    for (int t = 0; t < NS; t++)
      for (int v = 0; v < PD_NV; v++) {
        vf w = LOADA(ws + t * K * PD_NR + k * PD_NR + v * VL);
        for (int i = 0; i < M; i++) acc[i][t][v] = vfma(splat(x[i * ldx + k]), w, acc[i][t][v]);
      }
  }
  for (int i = 0; i < M; i++)
    for (int t = 0; t < NS; t++)
      for (int v = 0; v < PD_NV; v++) {
        vf out = acc[i][t][v];
        if (bias) out += LOADU(bias + t * PD_NR + v * VL);
        STOREU(y + i * ldy + t * PD_NR + v * VL, out);
      }
}

/* Strips [s0, s1) for M rows, NS at a time (the most whose accumulators fit the 16 AVX2
 * registers, or measured best: 3 strips at 2 rows, 2 at 3 and at 4), the rest one by one. */
#define FEW_ROWS(MM, NS)                                                                 \
  case MM:                                                                               \
    for (long s = s0; s < s1;) {                                                         \
      int group = s1 - s >= NS ? NS : 1;                                                 \
      const float *b = bias ? bias + s * PD_NR : 0, *ws = w + s * K * PD_NR;             \
      if (group == NS)                                                                   \
        few_rows_group(MM, NS, x, ldx, ws, K, b, y + s * PD_NR, ldy, accumulate);        \
      else                                                                               \
        few_rows_group(MM, 1, x, ldx, ws, K, b, y + s * PD_NR, ldy, accumulate);         \
      s += group;                                                                        \
    }                                                                                    \
    return;

static void few_rows_strips(const float *x, long ldx, long M, long K, const float *w, long s0,
                            long s1, const float *bias, float *y, long ldy, int accumulate) {
  switch (M) {
    FEW_ROWS(1, GEMV_STRIPS) /* deterministic mode's single row (linear_team) */
    FEW_ROWS(2, 3)
    FEW_ROWS(3, 2)
    FEW_ROWS(4, 2)
  }
}

/* Strip rows of the piece after [k0, k0 + kc) of a strip: the rest of its K, or the
 * next strip's first piece (strips are consecutive in memory). */
static inline long next_piece_lines(long K, long k0, long kc) {
  long left = k0 + kc < K ? K - (k0 + kc) : K;
  return left < KC ? left : KC;
}

/* Rows in panels of about MC_BYTES of input, so that a panel stays in L2 while every
 * strip of the weight streams past it (prefill: thousands of rows). A quarter of a
 * core's 512 KiB L2: a panel that filled it spilled to the shared L3, where the decode
 * worker's weight stream on the other core evicts it. With such a neighbour, a prefill
 * worker's thread ran 2-3% faster at 128 KiB than at 512 (alternated in one process;
 * neutral alone on one thread). Smaller panels stream each weight once per 50-odd
 * rows instead of 200-odd: ~3 GB/s more reads at prefill's pace, which left the
 * neighbour's own stream unchanged within its noise. */
#define MC_BYTES (128 * 1024)

static void gemm_strips(const float *x, long ldx, long M, long K, const float *w, long s0,
                        long s1, const float *bias, float *y, long ldy, int accumulate) {
  long mc = MC_BYTES / (4 * K) / MR_MAX * MR_MAX;
  mc = mc < MR_MAX ? MR_MAX : mc;
  const float *end = w + s1 * K * PD_NR;
  for (long m0 = 0; m0 < M; m0 += mc) {
    long m1 = m0 + mc < M ? m0 + mc : M;
    for (long s = s0; s < s1; s++) {
      const float *ws = w + s * K * PD_NR;
      for (long k0 = 0; k0 < K; k0 += KC) {
        long kc = K - k0 < KC ? K - k0 : KC;
        int last = k0 + kc >= K;
        /* Each row group prefetches a share of the following piece: spread over all
         * the piece's groups, the requests keep pace with the work. Against one group
         * fetching all of it (then at a KC of 256), this made 8-64-row projections 8-25%
         * faster; prefill's were unchanged. */
        long next_lines = next_piece_lines(K, k0, kc);
        const float *next = ws + (k0 + kc) * PD_NR;
        if (next + next_lines * PD_NR > end) next = 0, next_lines = 0;
        row_groups rg = split_rows(m1 - m0, MR_MAX);
        long share = (next_lines + rg.groups - 1) / rg.groups;
        for (long g = 0, m = m0; g < rg.groups; g++) {
          long mr = group_rows(rg, g);
          long first = g * share, lines = next_lines - first < share ? next_lines - first : share;
          TILES[mr](x + m * ldx + k0, ldx, ws + k0 * PD_NR, kc, y + m * ldy + s * PD_NR, ldy,
                    accumulate || k0 > 0, last && bias ? bias + s * PD_NR : 0,
                    lines > 0 ? next + first * PD_NR : 0, lines);
          m += mr;
        }
      }
    }
  }
}

static void rmsnorm_row(const float *x, long K, const float *weight, float eps, float *out) {
  vf acc = splat(0.0f);
  long k = 0;
  for (; k + VL <= K; k += VL) {
    vf v = LOADU(x + k);
    acc += v * v;
  }
  float ss = hsum(acc);
  for (; k < K; k++) ss += x[k] * x[k];
  float scale = 1.0f / sqrtf(ss / (float)K + eps);
  for (k = 0; k + VL <= K; k += VL) STOREU(out + k, LOADU(x + k) * splat(scale) * LOADU(weight + k));
  for (; k < K; k++) out[k] = x[k] * scale * weight[k];
}

/* gate = x[0:K], up = x[K:2K]: out = gate * sigmoid(gate) * up */
static void silu_mul_row(const float *x, long K, float *out) {
  long k = 0;
  for (; k + VL <= K; k += VL) {
    vf g = LOADU(x + k);
    STOREU(out + k, g / (splat(1.0f) + vexp(-g)) * LOADU(x + K + k));
  }
  for (; k < K; k++) out[k] = x[k] / (1.0f + sexp(-x[k])) * x[K + k];
}

/* A one-row projection (batch-1 decode) runs its prologue on every thread, each into its
 * own stack copy, instead of on one thread into the shared scratch behind a barrier:
 * the same float ops, so the same values, and 60 fewer barriers in a demo-model step.
 * Rows wider than this (the K of a very wide MLP) take the shared scratch. */
#define PROLOGUE_OWN_MAX 16384

/* One body, never inlined: a single row's own copy and the shared scratch of several
 * rows get the prologue from the same instructions (see native.h's fma8). */
static __attribute__((noinline)) void prologue_row(const linear_args *a, const float *x,
                                                   float *out) {
  if (a->prologue == PROLOGUE_RMSNORM)
    rmsnorm_row(x, a->K, a->norm_weight, a->eps, out);
  else
    silu_mul_row(x, a->K, out);
}

void linear_team(const linear_args *a, int t, int nt) {
  if (a->weights_bf16) {
    linear_team_bf16(a, t, nt);
    return;
  }
  long K = a->K, strips = (a->N + PD_NR - 1) / PD_NR, full = a->N / PD_NR;
  const float *in = a->prologue == PROLOGUE_NONE ? a->x : a->scratch;
  long ldin = a->prologue == PROLOGUE_NONE ? a->ldx : K;
  int own_row = a->prologue != PROLOGUE_NONE && a->M == 1 && K <= PROLOGUE_OWN_MAX;
  float own[own_row ? K : 1];
  if (own_row) {
    prologue_row(a, a->x, own);
    in = own;
  } else if (a->prologue != PROLOGUE_NONE) {
    for (long m = t; m < a->M; m += nt) prologue_row(a, a->x + m * a->ldx, a->scratch + m * K);
#pragma omp barrier
  }
  long s0, s1;
  team_strips(a->N, t, nt, &s0, &s1);
  if (s0 < s1) {
    /* gemv_strips sums over two chains, the bias and the residual last: other bits
     * than the tiles'. Deterministic mode gives a single row the few-row pass, which
     * sums each column as tile() does, so a row's values do not depend on its batch. */
    if (a->M == 1 && !a->deterministic)
      gemv_strips(in, a->w, K, s0, s1, a->bias, a->y, a->accumulate);
    else if (a->M <= FEW_ROWS_MAX)
      few_rows_strips(in, ldin, a->M, K, a->w, s0, s1, a->bias, a->y, a->ldy, a->accumulate);
    else
      gemm_strips(in, ldin, a->M, K, a->w, s0, s1, a->bias, a->y, a->ldy, a->accumulate);
  }
  if (full < strips && t == nt - 1)
    tail_strip(in, ldin, a->M, K, a->w + full * K * PD_NR, full * PD_NR, a->N - full * PD_NR,
               a->bias, a->y, a->ldy, a->accumulate);
}

void pd_linear(const float *x, long ldx, long M, long K, const float *w_packed, long N,
               const float *bias, int prologue, const float *norm_weight, float eps,
               float *scratch, float *y, long ldy, int accumulate, int weights_bf16,
               int deterministic, int nthreads) {
  linear_args a = {x,       ldx,         M,   K,       w_packed, N,   bias,       prologue,
                   norm_weight, eps, scratch, y,        ldy, accumulate, weights_bf16,
                   deterministic};
#pragma omp parallel num_threads(nthreads)
  linear_team(&a, omp_get_thread_num(), omp_get_num_threads());
}

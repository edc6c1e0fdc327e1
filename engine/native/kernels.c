/* pdserve's float32 CPU kernels: one decode or prefill step of a Llama-family layer.
 *
 * A step through these kernels, per layer (engine/native/ops.py calls them):
 *   pd_linear (RMSNorm prologue)  -> qkv
 *   pd_rope_store                 -> q, k rotated in place; k, v written into the paged pool
 *   pd_decode_attention           -> decode rows attend to their blocks in place (no gather)
 *   pd_linear (accumulate)        -> residual += attn @ Wo^T
 *   pd_linear (RMSNorm prologue)  -> gate | up
 *   pd_linear (SiLU*mul prologue, accumulate) -> residual += (silu(gate) * up) @ Wdown^T
 *
 * Why our own: on the AVX2 EPYC machines this project runs on, MKL's sgemm streams a
 * decode step's weights at ~11 GB/s, less than half the read bandwidth, and packs the
 * weight matrix again on every small-batch call. Weights here are packed once at load
 * into strips of PD_NR output columns ([N / NR][K][NR]), so every kernel streams them
 * sequentially. Parallel regions use the OpenMP runtime torch already loaded (same
 * soname), with the thread count the caller passes (torch.get_num_threads()).
 *
 * Compiled at first use by engine/native/build.py (gcc -O3 -march=native -fopenmp),
 * cached on disk by a hash of this file, the flags and the CPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
#ifndef PD_NV
#define PD_NV 2 /* vectors per packed strip */
#endif
#ifndef MR_MAX
#define MR_MAX ((VL == 16 ? 24 : 12) / PD_NV) /* rows per tile: accumulators fill the registers */
#endif
#define PD_NR (PD_NV * VL) /* output columns per packed strip */
#ifndef KC
#define KC 256 /* K block of the multi-row tiles: one strip piece stays in L1 */
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

#define LOADU(p) (*(const vfu *)(p))
#define STOREU(p, v) (*(vfu *)(p) = (v))
#define LOADA(p) (*(const vf *)(p))

static inline vf splat(float f) { return f - (vf){0}; }

static inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < VL; i++) s += v[i];
  return s;
}

/* exp for x <= ~88: 2^n * p(r), Cephes' expf polynomial (about 1 ulp), for any vector
 * type VT with integer lanes IT. C has no vector ?:, so clamping selects through the
 * comparison masks; adding 1.5 * 2^23 rounds to an integer, whose low mantissa bits
 * then give n for the exponent. */
#define DEFINE_VEXP(NAME, VT, IT)                                                    \
  static inline VT NAME(VT x) {                                                      \
    const VT zero = {0}, hi = zero + 88.0f, lo = zero - 87.0f;                       \
    const float magic = 12582912.0f;                                                 \
    IT below = x < hi, above = x > lo;                                               \
    x = (VT)(((IT)x & below) | ((IT)hi & ~below));                                   \
    x = (VT)(((IT)x & above) | ((IT)lo & ~above));                                   \
    VT t = x * 1.44269504088896341f + magic;                                         \
    VT n = t - magic;                                                                \
    VT r = x - n * 0.693359375f + n * 2.12194440e-4f;                                \
    VT p = zero + 1.9875691500e-4f;                                                  \
    p = p * r + 1.3981999507e-3f;                                                    \
    p = p * r + 8.3334519073e-3f;                                                    \
    p = p * r + 4.1665795894e-2f;                                                    \
    p = p * r + 1.6666665459e-1f;                                                    \
    p = p * r + 5.0000001201e-1f;                                                    \
    p = p * r * r + r + 1.0f;                                                        \
    IT bits = ((IT)t - (IT)(zero + magic) + 127) << 23;                              \
    return p * (VT)bits;                                                             \
  }
DEFINE_VEXP(vexp, vf, vi)

static inline float sexp(float x) {
  vf v = vexp(splat(x));
  return v[0];
}

int pd_strip_width(void) { return PD_NR; }

/* ---- linear: y = prologue(x) @ W^T (+ bias), or y += ... -------------------------- */

enum { PROLOGUE_NONE = 0, PROLOGUE_RMSNORM = 1, PROLOGUE_SILU_MUL = 2 };

/* MR rows x NR columns, over kc of K. load_c: start from y (accumulate / later K block). */
static inline __attribute__((always_inline)) void tile(int MR, const float *x, long ldx,
                                                       const float *w, long kc, float *y,
                                                       long ldy, int load_c,
                                                       const float *bias) {
  vf acc[24][PD_NV];
  for (int i = 0; i < MR; i++)
    for (int c = 0; c < PD_NV; c++) acc[i][c] = load_c ? LOADU(y + i * ldy + c * VL) : splat(0.0f);
  for (long k = 0; k < kc; k++) {
    vf b[PD_NV];
    for (int c = 0; c < PD_NV; c++) b[c] = LOADA(w + k * PD_NR + c * VL);
    for (int i = 0; i < MR; i++) {
      vf xa = splat(x[i * ldx + k]);
      for (int c = 0; c < PD_NV; c++) acc[i][c] += xa * b[c];
    }
  }
  for (int c = 0; c < PD_NV && bias; c++)
    for (int i = 0; i < MR; i++) acc[i][c] += LOADU(bias + c * VL);
  for (int i = 0; i < MR; i++)
    for (int c = 0; c < PD_NV; c++) STOREU(y + i * ldy + c * VL, acc[i][c]);
}

typedef void (*tile_fn)(const float *, long, const float *, long, float *, long, int,
                        const float *);
#define TILE(MR)                                                                        \
  static void tile_##MR(const float *x, long ldx, const float *w, long kc, float *y,   \
                        long ldy, int load_c, const float *bias) {                     \
    tile(MR, x, ldx, w, kc, y, ldy, load_c, bias);                                     \
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

/* One row: two strips at a time, K split over two dependency chains (memory-bound). */
static void gemv_strips(const float *x, const float *w, long K, long s0, long s1,
                        const float *bias, float *y, int accumulate) {
  long s = s0;
  for (; s + 2 <= s1; s += 2) {
    const float *ws = w + s * K * PD_NR; /* strip s, then strip s + 1 right after it */
    vf acc[2][2][PD_NV];                 /* [chain][strip][vector] */
    for (int c = 0; c < 2; c++)
      for (int t = 0; t < 2; t++)
        for (int v = 0; v < PD_NV; v++) acc[c][t][v] = splat(0.0f);
    long k = 0;
    for (; k + 2 <= K; k += 2)
      for (int c = 0; c < 2; c++) {
        vf xk = splat(x[k + c]);
        for (int t = 0; t < 2; t++)
          for (int v = 0; v < PD_NV; v++)
            acc[c][t][v] += xk * LOADA(ws + t * K * PD_NR + (k + c) * PD_NR + v * VL);
      }
    for (; k < K; k++) {
      vf xk = splat(x[k]);
      for (int t = 0; t < 2; t++)
        for (int v = 0; v < PD_NV; v++)
          acc[0][t][v] += xk * LOADA(ws + t * K * PD_NR + k * PD_NR + v * VL);
    }
    for (int t = 0; t < 2; t++)
      for (int v = 0; v < PD_NV; v++) {
        float *dst = y + (s + t) * PD_NR + v * VL;
        vf out = acc[0][t][v] + acc[1][t][v];
        if (bias) out += LOADU(bias + (s + t) * PD_NR + v * VL);
        if (accumulate) out += LOADU(dst);
        STOREU(dst, out);
      }
  }
  for (; s < s1; s++)
    tile_1(x, 0, w + s * K * PD_NR, K, y + s * PD_NR, 0, accumulate,
           bias ? bias + s * PD_NR : 0);
}

static void gemm_strips(const float *x, long ldx, long M, long K, const float *w, long s0,
                        long s1, const float *bias, float *y, long ldy, int accumulate) {
  for (long s = s0; s < s1; s++) {
    const float *ws = w + s * K * PD_NR;
    for (long k0 = 0; k0 < K; k0 += KC) {
      long kc = K - k0 < KC ? K - k0 : KC;
      int last = k0 + kc >= K;
      for (long m = 0; m < M; m += MR_MAX) {
        long mr = M - m < MR_MAX ? M - m : MR_MAX;
        TILES[mr](x + m * ldx + k0, ldx, ws + k0 * PD_NR, kc, y + m * ldy + s * PD_NR, ldy,
                  accumulate || k0 > 0, last && bias ? bias + s * PD_NR : 0);
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

/* y[M, N] (row stride ldy) = prologue(x)[M, K] @ W^T (+ bias); accumulate: y += ...
 * w_packed: [ceil(N / NR)][K][NR]. scratch: M * K floats when a prologue is used.
 * The prologue's input row has K (RMSNorm) or 2K (SiLU*mul) columns at stride ldx. */
void pd_linear(const float *x, long ldx, long M, long K, const float *w_packed, long N,
               const float *bias, int prologue, const float *norm_weight, float eps,
               float *scratch, float *y, long ldy, int accumulate, int nthreads) {
  long strips = (N + PD_NR - 1) / PD_NR, full = N / PD_NR;
  const float *in = prologue == PROLOGUE_NONE ? x : scratch;
  long ldin = prologue == PROLOGUE_NONE ? ldx : K;
#pragma omp parallel num_threads(nthreads)
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    if (prologue != PROLOGUE_NONE) {
      for (long m = t; m < M; m += nt) {
        if (prologue == PROLOGUE_RMSNORM)
          rmsnorm_row(x + m * ldx, K, norm_weight, eps, scratch + m * K);
        else
          silu_mul_row(x + m * ldx, K, scratch + m * K);
      }
#pragma omp barrier
    }
    long per = (strips + nt - 1) / nt;
    long s0 = t * per, s1 = s0 + per < full ? s0 + per : full;
    if (s0 < s1) {
      if (M == 1)
        gemv_strips(in, w_packed, K, s0, s1, bias, y, accumulate);
      else
        gemm_strips(in, ldin, M, K, w_packed, s0, s1, bias, y, ldy, accumulate);
    }
    if (full < strips && t == nt - 1)
      tail_strip(in, ldin, M, K, w_packed + full * K * PD_NR, full * PD_NR, N - full * PD_NR,
                 bias, y, ldy, accumulate);
  }
}

/* ---- rotary embedding + KV store ----------------------------------------------------- */

/* Rotate-half RoPE on q and k heads of each packed row (in place), then copy that row's
 * k and v heads into the pool slot (block, offset). cos/sin: [positions][D]. The pool
 * pointers address block 0 of this layer's keys / values; blocks are block_stride apart. */
void pd_rope_store(float *qkv, long ldqkv, long T, long Hq, long Hkv, long D,
                   const int64_t *positions, const float *cos_table, const float *sin_table,
                   float *k_cache, float *v_cache, long block_stride,
                   const int64_t *slot_blocks, const int64_t *slot_offsets, int nthreads) {
  long half = D / 2, heads = Hq + Hkv, row_kv = Hkv * D;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 1)
  for (long t = 0; t < T; t++) {
    float *row = qkv + t * ldqkv;
    const float *c = cos_table + positions[t] * D, *s = sin_table + positions[t] * D;
    for (long h = 0; h < heads; h++) {
      float *x = row + h * D;
      for (long i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i + half] + x1 * s[i + half];
      }
    }
    long slot = slot_blocks[t] * block_stride + slot_offsets[t] * row_kv;
    memcpy(k_cache + slot, row + Hq * D, sizeof(float) * row_kv);
    memcpy(v_cache + slot, row + (Hq + Hkv) * D, sizeof(float) * row_kv);
  }
}

/* ---- paged attention over the pool, in place ----------------------------------------- */
/* A work item is one sequence's span of blocks, all heads: each block of the pool is
 * then read as one contiguous piece (block_size * Hkv * D floats) and the next block is
 * prefetched while this one is used, since blocks sit anywhere in the pool. With fewer
 * sequences than threads, a sequence's blocks are split into spans whose partial
 * softmax results are merged (max, sum, weighted values). Eight-wide vectors whatever
 * the ISA: head dims are multiples of 8 and the score reduction is written for 8 lanes. */

typedef float f8 __attribute__((vector_size(32)));
typedef float f8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8 __attribute__((vector_size(32)));
#define LOAD8(p) ((f8)(*(const f8u *)(p)))
#define STORE8(p, v) (*(f8u *)(p) = (v))
#define MAX_GROUP 8   /* query heads per kv head with a register-tiled value pass */
#define MAX_HEADS 256 /* query heads this kernel takes */

static inline f8 splat8(float f) { return f - (f8){0}; }
DEFINE_VEXP(vexp8, f8, i8)

/* Lane j of the result is the sum of v[j]'s lanes: eight dot products finished at once. */
static inline f8 transpose_sum8(const f8 v[8]) {
  const i8 even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
  const i8 lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
  const i8 lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
  f8 u[4];
  for (int i = 0; i < 4; i++)
    u[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], even) +
           __builtin_shuffle(v[2 * i], v[2 * i + 1], odd);
  f8 w0 = __builtin_shuffle(u[0], u[1], lo2) + __builtin_shuffle(u[0], u[1], hi2);
  f8 w1 = __builtin_shuffle(u[2], u[3], lo2) + __builtin_shuffle(u[2], u[3], hi2);
  return __builtin_shuffle(w0, w1, lo4) + __builtin_shuffle(w0, w1, hi4);
}

static inline float dot8(const float *a, const float *b, long D) {
  f8 acc = splat8(0.0f);
  for (long d = 0; d < D; d += 8) acc += LOAD8(a + d) * LOAD8(b + d);
  f8 parts[8] = {acc};
  return transpose_sum8(parts)[0];
}

static inline void prefetch_span(const float *data, long floats) {
  for (long i = 0; i < floats; i += 16) __builtin_prefetch(data + i);
}

/* Where a sequence's paged KV is and how it is laid out. */
typedef struct {
  const float *k, *v;
  long block_stride, block_size, Hq, Hkv, D;
  const int64_t *table;
} paged_seq;

static inline long span_tokens(long t0, long t_end, long block_size) {
  return t_end - t0 < block_size ? t_end - t0 : block_size;
}

/* scores[j * span + t] = q_j . k_t (q pre-scaled), query head j over kv head j / G. */
static void span_scores(const paged_seq *s, const float *q, long t_begin, long t_end,
                        float *scores) {
  long G = s->Hq / s->Hkv, D = s->D, row = s->Hkv * D, span = t_end - t_begin;
  for (long t0 = t_begin; t0 < t_end; t0 += s->block_size) {
    long n = span_tokens(t0, t_end, s->block_size);
    const float *kb = s->k + s->table[t0 / s->block_size] * s->block_stride;
    if (t0 + s->block_size < t_end)
      prefetch_span(s->k + s->table[t0 / s->block_size + 1] * s->block_stride,
                    span_tokens(t0 + s->block_size, t_end, s->block_size) * row);
    for (long j = 0; j < s->Hq; j++) {
      const float *qj = q + j * D, *kh = kb + (j / G) * D;
      float *out = scores + j * span + (t0 - t_begin);
      long i = 0;
      for (; i + 8 <= n; i += 8) {
        f8 acc[8] = {0};
        for (long d = 0; d < D; d += 8) {
          f8 qv = LOAD8(qj + d);
          for (int t = 0; t < 8; t++) acc[t] += qv * LOAD8(kh + (i + t) * row + d);
        }
        STORE8(out + i, transpose_sum8(acc));
      }
      for (; i < n; i++) out[i] = dot8(qj, kh + i * row, D);
    }
  }
}

/* exp(s - peak) in place over each query head's scores; peak and sum per head. */
static void span_softmax(float *scores, long heads, long span, float *peak, float *total) {
  for (long j = 0; j < heads; j++) {
    float *row = scores + j * span, m = -INFINITY;
    for (long t = 0; t < span; t++) m = row[t] > m ? row[t] : m;
    f8 acc = splat8(0.0f);
    long t = 0;
    for (; t + 8 <= span; t += 8) {
      f8 e = vexp8(LOAD8(row + t) - splat8(m));
      STORE8(row + t, e);
      acc += e;
    }
    f8 parts[8] = {acc};
    float sum = transpose_sum8(parts)[0];
    for (; t < span; t++) {
      row[t] = sexp(row[t] - m);
      sum += row[t];
    }
    peak[j] = m;
    total[j] = sum;
  }
}

/* out[j] += sum_t p_j[t] * v_t over one block's n rows for the G heads of kv head h,
 * NV vectors of columns at a time: G * NV independent accumulators in registers. */
static inline __attribute__((always_inline)) void block_values(int G, int NV, const float *p,
                                                               long span, long n,
                                                               const float *vh, long row,
                                                               long D, float *out) {
  for (long d = 0; d < D; d += 8 * NV) {
    f8 acc[MAX_GROUP][4];
    for (int g = 0; g < G; g++)
      for (int c = 0; c < NV; c++) acc[g][c] = LOAD8(out + g * D + d + 8 * c);
    for (long i = 0; i < n; i++) {
      f8 v[4];
      for (int c = 0; c < NV; c++) v[c] = LOAD8(vh + i * row + d + 8 * c);
      for (int g = 0; g < G; g++) {
        f8 w = splat8(p[g * span + i]);
        for (int c = 0; c < NV; c++) acc[g][c] += w * v[c];
      }
    }
    for (int g = 0; g < G; g++)
      for (int c = 0; c < NV; c++) STORE8(out + g * D + d + 8 * c, acc[g][c]);
  }
}

/* Fewest passes whose accumulators still fit the 16 AVX2 registers. */
#define BLOCK_VALUES(GC, NVC)                                                          \
  case GC:                                                                           \
    if (D % (8 * NVC) == 0) {                                                        \
      block_values(GC, NVC, p, span, n, vh, row, D, out);                            \
      return;                                                                        \
    }                                                                                \
    block_values(GC, 1, p, span, n, vh, row, D, out);                                \
    return;

static void group_block_values(long G, const float *p, long span, long n, const float *vh,
                               long row, long D, float *out) {
  switch (G) {
    BLOCK_VALUES(1, 4) BLOCK_VALUES(2, 4) BLOCK_VALUES(3, 4) BLOCK_VALUES(4, 2)
    BLOCK_VALUES(5, 2) BLOCK_VALUES(6, 2) BLOCK_VALUES(7, 1) BLOCK_VALUES(8, 1)
  }
  for (long g = 0; g < G; g++)
    for (long i = 0; i < n; i++) {
      float w = p[g * span + i];
      for (long d = 0; d < D; d += 8)
        STORE8(out + g * D + d, LOAD8(out + g * D + d) + splat8(w) * LOAD8(vh + i * row + d));
    }
}

/* Unnormalized sum_t p_j[t] v_t for every query head j over the span (out: Hq * D). */
static void span_values(const paged_seq *s, const float *scores, long t_begin, long t_end,
                        float *out) {
  long G = s->Hq / s->Hkv, D = s->D, row = s->Hkv * D, span = t_end - t_begin;
  memset(out, 0, sizeof(float) * (size_t)(s->Hq * D));
  for (long t0 = t_begin; t0 < t_end; t0 += s->block_size) {
    long n = span_tokens(t0, t_end, s->block_size);
    const float *vb = s->v + s->table[t0 / s->block_size] * s->block_stride;
    if (t0 + s->block_size < t_end)
      prefetch_span(s->v + s->table[t0 / s->block_size + 1] * s->block_stride,
                    span_tokens(t0 + s->block_size, t_end, s->block_size) * row);
    for (long h = 0; h < s->Hkv; h++)
      group_block_values(G, scores + h * G * span + (t0 - t_begin), span, n, vb + h * D, row,
                         D, out + h * G * D);
  }
}

/* Merge the spans' partial softmax results of one row into out (Hq * D). */
static void merge_spans(long spans, long Hq, long D, const float *partial, long stride,
                        float *out) {
  for (long j = 0; j < Hq; j++) {
    float m = -INFINITY, total = 0.0f;
    for (long p = 0; p < spans; p++) {
      float pm = partial[p * stride + Hq * D + j];
      m = pm > m ? pm : m;
    }
    for (long d = 0; d < D; d++) out[j * D + d] = 0.0f;
    for (long p = 0; p < spans; p++) {
      const float *part = partial + p * stride;
      float w = sexp(part[Hq * D + j] - m);
      total += w * part[Hq * D + Hq + j];
      for (long d = 0; d < D; d++) out[j * D + d] += w * part[j * D + d];
    }
    for (long d = 0; d < D; d++) out[j * D + d] /= total;
  }
}

/* Decode rows: row r attends to the first context_lens[r] tokens of block_tables[r].
 * q: [R, Hq * D] at stride ldq; out: [R, Hq * D] at stride ldo. GQA: query head j uses
 * kv head j / (Hq / Hkv). Returns -1 (nothing done) for a head dim that is not a
 * multiple of 8, query heads that are not a multiple of the kv heads, or more than
 * MAX_HEADS query heads. */
int pd_decode_attention(const float *q, long ldq, long R, long Hq, long Hkv, long D,
                        const float *k_cache, const float *v_cache, long block_stride,
                        long block_size, const int64_t *block_tables, long table_stride,
                        const int64_t *context_lens, float scale, float *out, long ldo,
                        int nthreads) {
  if (D % 8 || Hq % Hkv || Hq > MAX_HEADS) return -1;
  long max_blocks = 0;
  for (long r = 0; r < R; r++) {
    long blocks = (context_lens[r] + block_size - 1) / block_size;
    max_blocks = blocks > max_blocks ? blocks : max_blocks;
  }
  long spans = R >= 2 * nthreads ? 1 : (2 * nthreads + R - 1) / R;
  spans = spans < max_blocks ? spans : max_blocks;
  long blocks_per_span = (max_blocks + spans - 1) / spans;
  long stride = Hq * D + 2 * Hq, items = R * spans;
  float *partial = spans > 1 ? malloc(sizeof(float) * (size_t)(items * stride)) : 0;
#pragma omp parallel num_threads(nthreads) if (items > 1)
  {
    float *scratch = malloc(sizeof(float) * (size_t)(Hq * (blocks_per_span * block_size + D)));
    float *qs = scratch + Hq * blocks_per_span * block_size;
#pragma omp for schedule(dynamic, 1)
    for (long item = 0; item < items; item++) {
      long r = item / spans, sp = item % spans, ctx = context_lens[r];
      long t_begin = sp * blocks_per_span * block_size, t_end = t_begin + blocks_per_span * block_size;
      t_end = t_end < ctx ? t_end : ctx;
      paged_seq s = {k_cache, v_cache, block_stride, block_size, Hq, Hkv, D,
                     block_tables + r * table_stride};
      float peak[MAX_HEADS], total[MAX_HEADS], *dst = partial ? partial + item * stride : out + r * ldo;
      float *p_peak = partial ? dst + Hq * D : peak, *p_total = partial ? dst + Hq * D + Hq : total;
      if (t_begin >= t_end) { /* an empty span: contributes nothing to the merge */
        for (long j = 0; j < Hq; j++) p_peak[j] = -INFINITY, p_total[j] = 0.0f;
        memset(dst, 0, sizeof(float) * (size_t)(Hq * D));
        continue;
      }
      for (long i = 0; i < Hq * D; i++) qs[i] = q[r * ldq + i] * scale;
      span_scores(&s, qs, t_begin, t_end, scratch);
      span_softmax(scratch, Hq, t_end - t_begin, p_peak, p_total);
      span_values(&s, scratch, t_begin, t_end, dst);
      if (!partial)
        for (long j = 0; j < Hq; j++)
          for (long d = 0; d < D; d++) dst[j * D + d] /= p_total[j];
    }
    if (partial) {
#pragma omp for schedule(static)
      for (long r = 0; r < R; r++)
        merge_spans(spans, Hq, D, partial + r * spans * stride, stride, out + r * ldo);
    }
    free(scratch);
  }
  free(partial);
  return 0;
}

/* Keys and values of one sequence's first n tokens, as [Hkv][n][D] each (what SDPA
 * takes), for a prefill chunk that attends to context already in the pool. */
void pd_gather_kv(const float *k_cache, const float *v_cache, long block_stride,
                  long block_size, long Hkv, long D, const int64_t *table, long n,
                  float *k_out, float *v_out, int nthreads) {
  long row_kv = Hkv * D;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n > 256)
  for (long t = 0; t < n; t++) {
    long slot = table[t / block_size] * block_stride + (t % block_size) * row_kv;
    for (long h = 0; h < Hkv; h++) {
      memcpy(k_out + (h * n + t) * D, k_cache + slot + h * D, sizeof(float) * D);
      memcpy(v_out + (h * n + t) * D, v_cache + slot + h * D, sizeof(float) * D);
    }
  }
}

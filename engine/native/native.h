/* Shared by the native kernels (linear.c, attention.c, decode_step.c): vector types,
 * the vectorized exp, and the "team" functions. A team function is called by every
 * thread of an OpenMP parallel region with its thread number t of nt; the pd_* entry
 * points open a region around one of them, pd_decode_step runs a whole decode step in
 * one region, with a barrier between the phases. */
#ifndef PDSERVE_NATIVE_H
#define PDSERVE_NATIVE_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* Floats per vector of the projections (linear.c): build.py passes -DVL=16 (zmm) where
 * the CPU has AVX-512F, else 8 (ymm). A projection's output column sums its K products
 * in the same order at either width (one lane per column), so the width changes speed,
 * not the matmuls' results. Attention keeps its own 8-wide types (f8 below). */
#ifndef VL
#define VL 8
#endif
#ifndef PD_NV
#define PD_NV 2 /* vectors per packed strip */
#endif
#ifndef MR_MAX
#define MR_MAX ((VL == 16 ? 24 : 12) / PD_NV) /* rows per tile: accumulators fill the registers */
#endif
#define PD_NR (PD_NV * VL) /* output columns per packed strip */
/* K block of the multi-row tiles (linear.c's gemm_strips). 8-wide: up to 1536 k, a strip
 * piece of 96 KiB that stays in L2 while the row groups stream it, in one block for the
 * demo model's K of 576 and 1536. Against blocks of 192 (a piece in L1 beside a 16-row
 * panel of x), float32, 2 threads, step-interleaved in one process: a
 * 256-token prefill 4-5% shorter, 4 x 256 tokens 7%, decode steps of 6-16 rows 2-9%; K
 * of 4096 ran 2-5% faster at 1024 or 1536 and up to 4% slower at 4096.
 * The 16-wide (AVX-512) builds keep 192: not measured there. */
#ifndef KC
#define KC (VL == 16 ? 192 : 1536)
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

typedef float f8 __attribute__((vector_size(32)));
typedef float f8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8 __attribute__((vector_size(32)));
#define LOAD8(p) ((f8)(*(const f8u *)(p)))
#define STORE8(p, v) (*(f8u *)(p) = (v))
#define MAX_GROUP 8   /* query heads per kv head with a register-tiled value pass */
#define MAX_HEADS 256 /* query heads this kernel takes */

static inline f8 splat8(float f) { return f - (f8){0}; }
DEFINE_VEXP(vexp8, f8, i8)

/* a * b + c, rounded once, spelled out. GCC fuses `c += a * b` into an FMA or not by the
 * code around it (in one instance of a loop it left the sum unfused), so two kernels that
 * must round a row alike (deterministic mode: the projections' tiles and their few-row
 * pass, a prefill row and a decode row's attention) write their sums with these. */
static inline __attribute__((always_inline)) f8 fma8(f8 a, f8 b, f8 c) {
#ifdef __FMA__
  return (f8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  f8 r;
  for (int i = 0; i < 8; i++) r[i] = fmaf(a[i], b[i], c[i]);
  return r;
#endif
}

static inline __attribute__((always_inline)) vf vfma(vf a, vf b, vf c) {
#if VL == 16 && defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif VL == 16 /* two eight-float halves, as GCC runs a 16-float vector without AVX-512F */
  f8 lo = fma8(__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
               __builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
               __builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
  f8 hi = fma8(__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
               __builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
               __builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return fma8(a, b, c);
#endif
}

/* The KV pool holds float32, or bfloat16 (`bf16` below: half the bytes that decode
 * attention streams per step). Kernels address it by element: element i of a layer's
 * keys or values from their block 0. A bf16 value is a float32's top half, so reading
 * one back is a shift; storing rounds to nearest even, as torch's conversion does.
 * Callers pass `bf16` as a constant through always-inline functions, so the branch is
 * compiled out of the inner loops. */
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2)));

static inline const void *kv_at(const void *base, long i, int bf16) {
  return bf16 ? (const void *)((const uint16_t *)base + i) : (const void *)((const float *)base + i);
}

static inline f8 kv_load8(const void *base, long i, int bf16) {
  if (!bf16) return LOAD8((const float *)base + i);
  const uint16_t *half = (const uint16_t *)base + i;
#ifdef __AVX2__ /* one widening load; GCC splits the generic conversion in two halves */
  return (f8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)half)), 16);
#else
  return (f8)(__builtin_convertvector(*(const u16x8 *)half, i8) << 16);
#endif
}

static inline float bf16_to_float(uint16_t half) {
  uint32_t bits = (uint32_t)half << 16;
  float x;
  memcpy(&x, &bits, sizeof x);
  return x;
}

static inline uint16_t float_to_bf16(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline float kv_load1(const void *base, long i, int bf16) {
  return bf16 ? bf16_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

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


/* v with its lanes swapped in pairs, in pairs of pairs, in halves: the three steps of a
 * horizontal reduction in transpose_sum8's order. */
static inline f8 swap_pairs8(f8 v) { return __builtin_shuffle(v, (i8){1, 0, 3, 2, 5, 4, 7, 6}); }
static inline f8 swap_quads8(f8 v) { return __builtin_shuffle(v, (i8){2, 3, 0, 1, 6, 7, 4, 5}); }
static inline f8 swap_halves8(f8 v) { return __builtin_shuffle(v, (i8){4, 5, 6, 7, 0, 1, 2, 3}); }

/* v's lanes summed in transpose_sum8's order (pairs, then pairs of pairs, then halves), so
 * either gives the same float. */
static inline float hsum8(f8 v) {
  v += swap_pairs8(v);
  v += swap_quads8(v);
  return (v + swap_halves8(v))[0];
}

/* Lanes of a where mask is set, else of b (mask lanes all ones or all zeros). */
static inline f8 select8(i8 mask, f8 a, f8 b) { return (f8)(((i8)a & mask) | ((i8)b & ~mask)); }

/* Lane-wise max that keeps cur where x is not greater (a NaN in x is skipped). */
static inline f8 max8(f8 cur, f8 x) { return select8(x > cur, x, cur); }

static inline float hmax8(f8 v) {
  v = max8(v, swap_pairs8(v));
  v = max8(v, swap_quads8(v));
  return max8(v, swap_halves8(v))[0];
}

/* A panel's rows as the fewest tile groups of at most mr_max rows, their sizes apart by
 * at most one (16 rows of 12 at most: 8 + 8, not 12 + 4): group g has group_rows(). */
typedef struct {
  long groups, base, extra;
} row_groups;

static inline row_groups split_rows(long rows, long mr_max) {
  long groups = (rows + mr_max - 1) / mr_max;
  row_groups rg = {groups, rows / groups, rows % groups};
  return rg;
}

static inline long group_rows(row_groups rg, long g) { return rg.base + (g < rg.extra); }

enum { PROLOGUE_NONE = 0, PROLOGUE_RMSNORM = 1, PROLOGUE_SILU_MUL = 2 };

/* y[M, N] (row stride ldy) = prologue(x)[M, K] @ W^T (+ bias); accumulate: y += ...
 * w: packed [ceil(N / NR)][K][NR]. scratch: M * K floats, shared by the team, when a
 * prologue is used; the prologue's input rows have K (RMSNorm) or 2K (SiLU*mul)
 * columns at stride ldx. */
typedef struct {
  const float *x;
  long ldx, M, K;
  const float *w;
  long N;
  const float *bias;
  int prologue;
  const float *norm_weight;
  float eps;
  float *scratch;
  float *y;
  long ldy;
  int accumulate;
  int weights_bf16; /* w packed as bf16 pairs (linear_bf16.c); scratch holds M * K floats */
  int deterministic; /* every row on one summation order, whatever M (see linear_team) */
} linear_args;

/* The full strips [s0, s1) of an N-column projection that thread t of nt computes; the
 * last thread also takes the columns of a partial strip at the end. So thread t writes
 * columns [s0 * PD_NR, s1 * PD_NR), the last thread's running on to N. */
static inline void team_strips(long N, int t, int nt, long *s0, long *s1) {
  long strips = (N + PD_NR - 1) / PD_NR, full = N / PD_NR, per = (strips + nt - 1) / nt;
  *s0 = t * per < full ? t * per : full;
  *s1 = *s0 + per < full ? *s0 + per : full;
}

static inline void team_columns(long N, int t, int nt, long *c0, long *c1) {
  long s0, s1;
  team_strips(N, t, nt, &s0, &s1);
  *c0 = s0 * PD_NR;
  *c1 = t == nt - 1 ? N : s1 * PD_NR;
}

/* Ends without a barrier: the caller waits before reading y. */
void linear_team(const linear_args *a, int t, int nt);
void linear_team_bf16(const linear_args *a, int t, int nt);
int pd_has_bf16(void);
/* AMX tiles for multi-row bf16 projections (linear_amx.c). pd_use_amx(1) asks Linux for
 * the tile state (once) and turns the tiles on if granted, pd_use_amx(0) off; call it
 * before any team runs. amx_takes says whether gemm_amx runs an M-row projection of K2
 * (even) inputs. gemm_amx: strips [s0, s1) of w (bf16 pairs), x: bf16 rows [M][K2]. */
int pd_use_amx(int wanted);
int amx_takes(long M, long K2);
void gemm_amx(const uint16_t *x, long M, long K2, const uint16_t *w, long s0, long s1,
              const float *bias, float *y, long ldy, int accumulate);

/* Greedy tokens (greedy.c): a thread's best of row columns [c0, c1) (index -1: none),
 * and the merge of every thread's bests (best[thread * rows + row]) into tokens. */
typedef struct {
  float value;
  long index;
  int nan; /* value is the first NaN of the columns */
} column_best;

column_best best_column(const float *row, long c0, long c1);
void greedy_merge(const column_best *best, long rows, int64_t *tokens, int t, int nt);

/* Rotate-half RoPE on the q and k heads of rows [0, T) of qkv in place, then copy each
 * row's k and v heads into its pool slot. */
typedef struct {
  float *qkv;
  long ldqkv, T, Hq, Hkv, D;
  const int64_t *positions;
  const float *cos, *sin; /* [positions][D] */
  void *k_cache, *v_cache; /* block 0 of this layer's keys / values */
  long block_stride;       /* in elements, as every pool stride */
  const int64_t *slot_blocks, *slot_offsets;
  int kv_bf16; /* the pool holds bf16: k and v are rounded, in qkv too, as they are stored */
} rope_store_args;

void rope_store_team(const rope_store_args *a, int t, int nt);

/* Decode rows r < R attend to the first context_lens[r] tokens of block_tables[r]. */
typedef struct {
  const float *q;
  long ldq, R, Hq, Hkv, D;
  const void *k_cache, *v_cache;
  long block_stride, block_size;
  const int64_t *block_tables;
  long table_stride;
  const int64_t *context_lens;
  float scale;
  float *out;
  long ldo;
  /* from attention_plan: */
  long spans, blocks_per_span;
  float *partial; /* R * spans * attention_partial_stride floats when spans > 1 */
  int kv_bf16;
  int deterministic; /* each row in a prefill row's arithmetic (decode_row_exact) */
  long max_context;  /* from attention_plan: the longest row's keys */
  long head_parts;   /* from attention_plan, deterministic mode: items per row */
} attention_args;

/* 0, or -1 for shapes the kernel does not take; fills spans and blocks_per_span. */
int attention_plan(attention_args *a, int nthreads);
long attention_partial_stride(const attention_args *a);
long attention_scratch_floats(const attention_args *a);
/* Work-shares over the team (omp for, with its barriers); scratch is this thread's. */
void attention_team(const attention_args *a, float *scratch);
/* Deterministic mode (prefill_attention.c): decode row r's query heads over kv heads
 * [h0, h1), read in place, in the arithmetic pd_prefill_attention gives a row at that
 * position. scratch: attention_scratch_floats(a) floats. */
void decode_row_exact(const attention_args *a, long r, long h0, long h1, float *scratch);

#endif

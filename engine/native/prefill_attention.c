/* Causal attention of one prefill chunk over its sequence's paged KV, read from the pool
 * (the chunk's own keys and values are already there: rope_store runs first).
 *
 * Query row i of the chunk sits at position context_start + i and attends to keys
 * [0, context_start + i]. The work is two small matmuls per query head, so it runs as
 * register tiles like linear.c, not as one dot product per key like the decode kernel
 * (which reloads every key for every query and reduces each score across lanes):
 *  1. the team gathers each kv head's context once: keys transposed to [D][n] (a
 *     vector holds 8 keys) through 8 x 8 register transposes, values to [n][D], both
 *     zero-padded to whole tiles;
 *  2. an item is PA_ROWS query rows of one query head: scores for PA_ROWS x 16 keys
 *     at a time (12 accumulators over D), an exact softmax per row over its causal
 *     prefix, then probabilities x values for PA_ROWS x 16 value columns at a time.
 * The tiles run on the projections' vectors (VL floats: one 16-key row of a tile is two
 * ymm or one zmm, and zmm tiles take twice the rows); every lane sums its score or value
 * column in the same order at either width, so the width changes speed, not results.
 * The softmax's exponentials run VL wide too, its sums in eight lanes. Items are
 * independent and each one's arithmetic is fixed by the shapes alone, so the result does
 * not depend on the thread count. On the demo model's shapes (9 query heads over 3 kv
 * heads, D 64), 2 AVX2 threads: 256-token chunk 0.77 ms against
 * 2.0 ms for torch's CPU flash SDPA, 512 tokens 3.1 against 7.3 ms (~97 GFLOP/s).
 * Gathering keys one float at a time and scaling the queries by scalar loops took a
 * tenth of that (256 tokens 0.885 of the time without, 512 tokens 0.925); the
 * tiles' FMAs take ~60% now and the softmax's exponentials ~17% (interleaving a tile's
 * rows in one exp loop gained nothing: they are bound by throughput, not latency).
 */
#include "native.h"

#define PA_COLS 16              /* keys (scores) or value columns per tile */
#define PA_NV (PA_COLS / VL)     /* vectors per tile row */
#define PA_ROWS (12 / PA_NV)    /* query rows per tile: 12 vectors of accumulators */

typedef struct {
  const float *q;
  long ldq, T, Hq, Hkv, D;
  const void *k_cache, *v_cache; /* float32, or bf16 with kv_bf16 */
  long block_stride, block_size;
  const int64_t *table;
  long context_start;
  float scale;
  float *out;
  long ldo;
  long n, n_pad; /* keys attended by the last row; rounded up to PA_COLS */
  float *keys_t; /* [Hkv][D][n_pad] */
  float *values; /* [Hkv][n_pad][D] */
  int kv_bf16;
} prefill_args;

/* Element offset of token t's kv head h in the pool. */
static long pool_row(const prefill_args *a, long t, long h) {
  return a->table[t / a->block_size] * a->block_stride + (t % a->block_size) * a->Hkv * a->D +
         h * a->D;
}

/* dims[c] = lane c of every rows[u], as lane u: an 8 x 8 transpose. */
static inline void transpose8x8(const f8 rows[8], f8 dims[8]) {
  const i8 lo1 = {0, 8, 1, 9, 4, 12, 5, 13}, hi1 = {2, 10, 3, 11, 6, 14, 7, 15};
  const i8 lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
  const i8 lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
  f8 pairs[8], quads[8];
  for (int u = 0; u < 8; u += 2) {
    pairs[u] = __builtin_shuffle(rows[u], rows[u + 1], lo1);     /* lanes 0 1 4 5 of u, u+1 */
    pairs[u + 1] = __builtin_shuffle(rows[u], rows[u + 1], hi1); /* lanes 2 3 6 7 */
  }
  for (int u = 0; u < 8; u += 4)
    for (int k = 0; k < 2; k++) {
      quads[u + 2 * k] = __builtin_shuffle(pairs[u + k], pairs[u + k + 2], lo2);
      quads[u + 2 * k + 1] = __builtin_shuffle(pairs[u + k], pairs[u + k + 2], hi2);
    }
  for (int c = 0; c < 4; c++) {
    dims[c] = __builtin_shuffle(quads[c], quads[c + 4], lo4);
    dims[c + 4] = __builtin_shuffle(quads[c], quads[c + 4], hi4);
  }
}

/* Tokens [t0, t0 + 8) of kv head h: keys transposed into kt (column t0 of [D][n_pad]),
 * eight dims at a time through a register transpose, values as rows into v; tokens
 * from n on are zeros. */
static inline __attribute__((always_inline)) void gather_tokens(const prefill_args *a, long t0,
                                                                long h, float *kt, float *v,
                                                                int bf16) {
  long rows[8], D = a->D;
  for (int u = 0; u < 8; u++) rows[u] = t0 + u < a->n ? pool_row(a, t0 + u, h) : -1;
  for (long d = 0; d < D; d += 8) {
    f8 keys[8], dims[8];
    for (int u = 0; u < 8; u++)
      keys[u] = rows[u] < 0 ? splat8(0.0f) : kv_load8(a->k_cache, rows[u] + d, bf16);
    transpose8x8(keys, dims);
    for (int c = 0; c < 8; c++) STORE8(kt + (d + c) * a->n_pad, dims[c]);
  }
  for (int u = 0; u < 8; u++)
    for (long d = 0; d < D; d += 8)
      STORE8(v + u * D + d, rows[u] < 0 ? splat8(0.0f) : kv_load8(a->v_cache, rows[u] + d, bf16));
}

static void gather_context(const prefill_args *a) {
  long D = a->D;
#pragma omp for schedule(static)
  for (long t0 = 0; t0 < a->n_pad; t0 += 8) /* n_pad is a multiple of PA_COLS */
    for (long h = 0; h < a->Hkv; h++) {
      float *kt = a->keys_t + h * D * a->n_pad + t0, *v = a->values + (h * a->n_pad + t0) * D;
      if (a->kv_bf16)
        gather_tokens(a, t0, h, kt, v, 1);
      else
        gather_tokens(a, t0, h, kt, v, 0);
    }
}

/* scores[i][t] = qs[i] . k_t for t < n_tile (a multiple of PA_COLS). */
static void tile_scores(const float *qs, const float *kt, long n_pad, long D, long n_tile,
                        float *scores, long ld_scores) {
  for (long t0 = 0; t0 < n_tile; t0 += PA_COLS) {
    vf acc[PA_ROWS][PA_NV];
    for (int i = 0; i < PA_ROWS; i++)
      for (int c = 0; c < PA_NV; c++) acc[i][c] = splat(0.0f);
    for (long d = 0; d < D; d++) {
      const float *k = kt + d * n_pad + t0;
      vf keys[PA_NV];
      for (int c = 0; c < PA_NV; c++) keys[c] = LOADU(k + c * VL);
      for (int i = 0; i < PA_ROWS; i++) {
        vf qv = splat(qs[i * D + d]);
        for (int c = 0; c < PA_NV; c++) acc[i][c] = vfma(qv, keys[c], acc[i][c]);
      }
    }
    for (int i = 0; i < PA_ROWS; i++)
      for (int c = 0; c < PA_NV; c++) STOREU(scores + i * ld_scores + t0 + c * VL, acc[i][c]);
  }
}

/* Lanes [8 h, 8 h + 8) of v, kept in registers (a memcpy went through the stack). */
static inline f8 eight_lanes(vf v, int h) {
#if VL == 16
  return h ? __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)
           : __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
#else
  (void)h;
  return v;
#endif
}

/* Row i keeps keys [0, limit): exp(score - max) there, 0 after; returns 1 / their sum.
 * The peak and the exponentials run on VL-float vectors; the sum runs in eight lanes,
 * lane l adding keys l, l + 8, l + 16, ... in order at either width, so a 16-float
 * build halves the exponentials' instructions and keeps the 8-float build's bits. One
 * body, never inlined, serves prefill rows and deterministic decode rows alike, so the
 * compiler cannot fuse its arithmetic one way for one and another way for the other. */
static __attribute__((noinline)) float row_softmax(float *row, long limit, long n_tile) {
  vf peaks = splat(-INFINITY);
  long t = 0;
  for (; t + VL <= limit; t += VL) {
    vf v = LOADU(row + t);
    vi above = v > peaks;
    peaks = (vf)(((vi)v & above) | ((vi)peaks & ~above));
  }
  float peak = -INFINITY, sum = 0.0f;
  for (int lane = 0; lane < VL; lane++) peak = peaks[lane] > peak ? peaks[lane] : peak;
  for (; t < limit; t++) peak = row[t] > peak ? row[t] : peak;
  t = 0;
  f8 acc = splat8(0.0f);
  for (; t + VL <= limit; t += VL) {
    vf e = vexp(LOADU(row + t) - splat(peak));
    STOREU(row + t, e);
    for (int h = 0; h < VL / 8; h++) acc += eight_lanes(e, h);
  }
  for (; t + 8 <= limit; t += 8) { /* a 16-float build's last eight keys */
    f8 e = vexp8(LOAD8(row + t) - splat8(peak));
    STORE8(row + t, e);
    acc += e;
  }
  for (int lane = 0; lane < 8; lane++) sum += acc[lane];
  for (; t < limit; t++) {
    row[t] = sexp(row[t] - peak);
    sum += row[t];
  }
  for (; t < n_tile; t++) row[t] = 0.0f;
  return 1.0f / sum;
}

/* out[i][d0 + c] = inv[i] * sum_t p[i][t] v[t][d0 + c], PA_COLS columns at a time. */
static void tile_values(const float *p, long ld_p, const float *v, long D, long n_tile,
                        const float *inv, long rows, float *out, long ldo) {
  for (long d0 = 0; d0 < D; d0 += PA_COLS) {
    vf acc[PA_ROWS][PA_NV];
    for (int i = 0; i < PA_ROWS; i++)
      for (int c = 0; c < PA_NV; c++) acc[i][c] = splat(0.0f);
    for (long t = 0; t < n_tile; t++) {
      vf values[PA_NV];
      for (int c = 0; c < PA_NV; c++) values[c] = LOADU(v + t * D + d0 + c * VL);
      for (int i = 0; i < PA_ROWS; i++) {
        vf w = splat(p[i * ld_p + t]);
        for (int c = 0; c < PA_NV; c++) acc[i][c] = vfma(w, values[c], acc[i][c]);
      }
    }
    for (long i = 0; i < rows; i++)
      for (int c = 0; c < PA_NV; c++)
        STOREU(out + i * ldo + d0 + c * VL, acc[i][c] * splat(inv[i]));
  }
}

/* Rows [r0, r0 + rows) of query head j. scratch: PA_ROWS * (D + n_pad) floats. */
static void attend_tile(const prefill_args *a, long r0, long rows, long j, float *scratch) {
  long D = a->D, h = j / (a->Hq / a->Hkv);
  float *qs = scratch, *scores = scratch + PA_ROWS * D, inv[PA_ROWS];
  for (long i = 0; i < PA_ROWS; i++) {
    const float *q = a->q + (r0 + i) * a->ldq + j * D;
    for (long d = 0; d < D; d += VL) /* D is a multiple of PA_COLS */
      STOREU(qs + i * D + d, i < rows ? LOADU(q + d) * splat(a->scale) : splat(0.0f));
  }
  long last_limit = a->context_start + r0 + rows;
  long n_tile = (last_limit + PA_COLS - 1) / PA_COLS * PA_COLS;
  tile_scores(qs, a->keys_t + h * D * a->n_pad, a->n_pad, D, n_tile, scores, a->n_pad);
  for (long i = 0; i < PA_ROWS; i++) {
    float *row = scores + i * a->n_pad;
    if (i < rows)
      inv[i] = row_softmax(row, a->context_start + r0 + i + 1, n_tile);
    else
      memset(row, 0, sizeof(float) * (size_t)n_tile); /* a padding row weighs nothing */
  }
  tile_values(scores, a->n_pad, a->values + h * a->n_pad * D, D, n_tile, inv, rows,
              a->out + r0 * a->ldo + j * D, a->ldo);
}

/* q: the chunk's T rows [T, Hq * D] at stride ldq; out likewise at ldo; table: the
 * sequence's blocks covering [0, context_start + T). Returns -1 (nothing done) for
 * shapes it does not take: a head dim that is not a multiple of 16, or query heads
 * that are not a multiple of the kv heads. */
int pd_prefill_attention(const float *q, long ldq, long T, long Hq, long Hkv, long D,
                         const void *k_cache, const void *v_cache, long block_stride,
                         long block_size, const int64_t *table, long context_start,
                         float scale, float *out, long ldo, int nthreads, int kv_bf16) {
  if (D % PA_COLS || Hkv <= 0 || Hq % Hkv || T <= 0 || nthreads < 1) return -1;
  long n = context_start + T, n_pad = (n + PA_COLS - 1) / PA_COLS * PA_COLS;
  long per_thread = PA_ROWS * (D + n_pad);
  float *buffer = aligned_alloc(
      64, sizeof(float) * (size_t)(2 * Hkv * D * n_pad + nthreads * per_thread));
  if (!buffer) return -1;
  prefill_args a = {q,     ldq,   T,    Hq,   Hkv,    D,     k_cache, v_cache, block_stride,
                    block_size, table, context_start, scale, out, ldo, n, n_pad, buffer,
                    buffer + Hkv * D * n_pad, kv_bf16};
  float *scratch = buffer + 2 * Hkv * D * n_pad;
  long tiles = (T + PA_ROWS - 1) / PA_ROWS;
#pragma omp parallel num_threads(nthreads)
  {
    float *mine = scratch + omp_get_thread_num() * per_thread;
    gather_context(&a);
    /* omp for ends in a barrier: every head's context is gathered before it is read.
     * Items run from the longest rows down: the last tiles attend to the most keys. */
#pragma omp for schedule(dynamic, 1)
    for (long item = 0; item < tiles * Hq; item++) {
      long tile = tiles - 1 - item / Hq, r0 = tile * PA_ROWS;
      long rows = T - r0 < PA_ROWS ? T - r0 : PA_ROWS;
      attend_tile(&a, r0, rows, item % Hq, mine);
    }
  }
  free(buffer);
  return 0;
}

/* Deterministic mode's decode rows (attention.c's attention_team calls this per item: a
 * row and a range of its kv heads): each query head over the row's context_lens[r] keys,
 * read in place from the pool, in the arithmetic attend_tile gives a prefill row at that
 * position: each score one FMA chain over D from zero on the pre-scaled query (a lane per
 * key, the keys turned by transpose8x8 as gather_tokens turns them), row_softmax over the
 * row's keys, each value column one FMA chain over the keys in order, times the inverse
 * sum. The default decode kernel's online softmax over blocks and its spans give other
 * bits, and its spans change with the batch; here a token's attention output is the same
 * whether it is a decode row in any batch or a row of any prefill chunk, so its KV and
 * logits do not depend on how it was scheduled.
 *
 * Two passes over the row's blocks, in order, each reading a block's whole piece of the
 * pool (keys, then values) for every head of the item while the next block's piece is
 * prefetched (where the item has every head: with a share of them, the piece is not all
 * its own); the value sums are parked in scratch between blocks (a float stored and
 * reloaded is the same float). Up to EXACT_HEADS query heads share each key tile or
 * value row: their sums and a tile's eight dims fill the registers. */
#define EXACT_HEADS 4

typedef struct {
  const char *at, *end;
  long per_step; /* lines per prefetch step */
} exact_prefetch;

/* Aim the prefetch at the next block's keys (kind 0) or values (kind 1), spread over
 * `steps` calls of exact_prefetch_step; nothing after the row's last block, nor for an
 * item with a share of the heads (`whole` 0). */
static inline void exact_prefetch_block(exact_prefetch *pf, const attention_args *a,
                                        const int64_t *table, long next_block, long n,
                                        int kind, long steps, int whole, int bf16) {
  long bs = a->block_size, elem = bf16 ? 2 : 4;
  if (next_block * bs >= n || !whole) {
    pf->at = pf->end = 0, pf->per_step = 0;
    return;
  }
  const void *base = kind ? a->v_cache : a->k_cache;
  pf->at = (const char *)kv_at(base, table[next_block] * a->block_stride, bf16);
  pf->end = pf->at + bs * a->Hkv * a->D * elem;
  long lines = (pf->end - pf->at + 63) / 64;
  pf->per_step = (lines + steps - 1) / steps;
}

static inline void exact_prefetch_step(exact_prefetch *pf) {
  for (long i = 0; i < pf->per_step && pf->at < pf->end; i++, pf->at += 64)
    __builtin_prefetch(pf->at, 0, 2);
}

/* Scores of NG query heads (queries qs, pre-scaled) over the eight keys at `rows` (pool
 * offsets of kv head kh's key, -1: past the row) into scores[g * ld]. */
static inline __attribute__((always_inline)) void exact_score_tile(int NG, const attention_args *a,
                                                                   const long rows[8],
                                                                   const float *qs,
                                                                   float *scores, long ld,
                                                                   int bf16) {
  long D = a->D;
  f8 acc[EXACT_HEADS];
  for (int g = 0; g < NG; g++) acc[g] = splat8(0.0f);
  for (long d = 0; d < D; d += 8) {
    f8 keys[8], dims[8];
    for (int u = 0; u < 8; u++)
      keys[u] = rows[u] < 0 ? splat8(0.0f) : kv_load8(a->k_cache, rows[u] + d, bf16);
    transpose8x8(keys, dims);
    for (int c = 0; c < 8; c++)
      for (int g = 0; g < NG; g++) acc[g] = fma8(splat8(qs[g * D + d + c]), dims[c], acc[g]);
  }
  for (int g = 0; g < NG; g++) STORE8(scores + g * ld, acc[g]);
}

/* Pass 1: scores of query heads [h0 * G, h1 * G) over keys [0, n), eight tokens at a
 * time, their pool offsets stepped through the block table (no division per token). */
static inline __attribute__((always_inline)) void exact_scores(const attention_args *a,
                                                               const int64_t *table, long n,
                                                               long h0, long h1,
                                                               const float *qs, float *scores,
                                                               long ld, int bf16) {
  long D = a->D, G = a->Hq / a->Hkv, row_kv = a->Hkv * D, bs = a->block_size;
  long block = 0, offset = 0, prefetched = -1;
  exact_prefetch pf = {0, 0, 0};
  for (long t0 = 0; t0 < n; t0 += 8) {
    if (block != prefetched) {
      exact_prefetch_block(&pf, a, table, block + 1, n, 0, (bs + 7) / 8 * (h1 - h0),
                           h1 - h0 == a->Hkv, bf16);
      prefetched = block;
    }
    long rows[8];
    for (int u = 0; u < 8; u++) {
      rows[u] = t0 + u < n ? table[block] * a->block_stride + offset * row_kv : -1;
      if (++offset == bs) block++, offset = 0;
    }
    for (long h = h0; h < h1; h++) {
      long kh[8];
      for (int u = 0; u < 8; u++) kh[u] = rows[u] < 0 ? -1 : rows[u] + h * D;
      exact_prefetch_step(&pf);
      for (long g0 = 0; g0 < G; g0 += EXACT_HEADS) {
        const float *q = qs + (h * G + g0) * D;
        float *out = scores + (h * G + g0) * ld + t0;
        switch (G - g0 < EXACT_HEADS ? G - g0 : EXACT_HEADS) {
          case 1: exact_score_tile(1, a, kh, q, out, ld, bf16); break;
          case 2: exact_score_tile(2, a, kh, q, out, ld, bf16); break;
          case 3: exact_score_tile(3, a, kh, q, out, ld, bf16); break;
          default: exact_score_tile(4, a, kh, q, out, ld, bf16);
        }
      }
    }
  }
}

/* sums[g][d + 8c] += sum over the block's `count` tokens (from `values`, one token a
 * row_kv stride) of p[g][t] * v_t[d + 8c], for NG heads and NV vectors of columns. */
static inline __attribute__((always_inline)) void exact_value_tile(int NG, int NV,
                                                                   const attention_args *a,
                                                                   long values, long count,
                                                                   const float *p, long ld,
                                                                   float *sums, int bf16) {
  long D = a->D, row_kv = a->Hkv * D;
  f8 acc[EXACT_HEADS][4];
  for (int g = 0; g < NG; g++)
    for (int c = 0; c < NV; c++) acc[g][c] = LOAD8(sums + g * D + 8 * c);
  for (long i = 0; i < count; i++) {
    f8 v[4];
    for (int c = 0; c < NV; c++) v[c] = kv_load8(a->v_cache, values + i * row_kv + 8 * c, bf16);
    for (int g = 0; g < NG; g++) {
      f8 w = splat8(p[g * ld + i]);
      for (int c = 0; c < NV; c++) acc[g][c] = fma8(w, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < NG; g++)
    for (int c = 0; c < NV; c++) STORE8(sums + g * D + 8 * c, acc[g][c]);
}

#define EXACT_VALUES(NG)                                                                  \
  case NG:                                                                                \
    for (long d = 0; d < D; d += 8 * nv)                                                  \
      if (nv == 4)                                                                        \
        exact_value_tile(NG, 4, a, base + h * D + d, count, p, ld, sums + d, bf16);       \
      else                                                                                \
        exact_value_tile(NG, 2, a, base + h * D + d, count, p, ld, sums + d, bf16);       \
    break;

/* Pass 2: the value sums of query heads [h0 * G, h1 * G) block by block, t in order. */
static inline __attribute__((always_inline)) void exact_values(const attention_args *a,
                                                               const int64_t *table, long n,
                                                               long h0, long h1,
                                                               const float *scores, long ld,
                                                               float *all_sums, int bf16) {
  long D = a->D, G = a->Hq / a->Hkv, bs = a->block_size;
  exact_prefetch pf = {0, 0, 0};
  for (long t0 = 0; t0 < n; t0 += bs) {
    long base = table[t0 / bs] * a->block_stride, count = n - t0 < bs ? n - t0 : bs;
    exact_prefetch_block(&pf, a, table, t0 / bs + 1, n, 1, h1 - h0, h1 - h0 == a->Hkv, bf16);
    for (long h = h0; h < h1; h++) {
      exact_prefetch_step(&pf);
      for (long g0 = 0; g0 < G; g0 += EXACT_HEADS) {
        long ng = G - g0 < EXACT_HEADS ? G - g0 : EXACT_HEADS;
        int nv = ng <= 3 && D % 32 == 0 ? 4 : 2; /* ng * nv sums + nv values <= 16 */
        const float *p = scores + (h * G + g0) * ld + t0;
        float *sums = all_sums + (h * G + g0) * D;
        switch (ng) {
          EXACT_VALUES(1) EXACT_VALUES(2) EXACT_VALUES(3) EXACT_VALUES(4)
        }
      }
    }
  }
}

static inline __attribute__((always_inline)) void exact_heads(const attention_args *a, long r,
                                                              long h0, long h1,
                                                              float *scratch, int bf16) {
  long G = a->Hq / a->Hkv, D = a->D, n = a->context_lens[r];
  long ld = (a->max_context + 15) / 16 * 16, first = h0 * G * D, width = (h1 - h0) * G * D;
  const int64_t *table = a->block_tables + r * a->table_stride;
  float *qs = scratch, *scores = qs + a->Hq * D, *sums = scores + a->Hq * ld;
  const float *q = a->q + r * a->ldq;
  for (long i = first; i < first + width; i += 8) {
    STORE8(qs + i, LOAD8(q + i) * splat8(a->scale));
    STORE8(sums + i, splat8(0.0f));
  }
  exact_scores(a, table, n, h0, h1, qs, scores, ld, bf16);
  float *out = a->out + r * a->ldo;
  for (long j = h0 * G; j < h1 * G; j++) {
    float inv = row_softmax(scores + j * ld, n, n);
    out[j * D] = inv; /* parked until the values are summed */
  }
  exact_values(a, table, n, h0, h1, scores, ld, sums, bf16);
  for (long j = h0 * G; j < h1 * G; j++) {
    f8 inv = splat8(out[j * D]);
    for (long d = 0; d < D; d += 8) STORE8(out + j * D + d, LOAD8(sums + j * D + d) * inv);
  }
}

void decode_row_exact(const attention_args *a, long r, long h0, long h1, float *scratch) {
  if (a->kv_bf16)
    exact_heads(a, r, h0, h1, scratch, 1);
  else
    exact_heads(a, r, h0, h1, scratch, 0);
}

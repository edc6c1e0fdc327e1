/* Attention on the paged pool, read in place: rotary embedding + KV store of a step's
 * new tokens, decode attention (each row over its own blocks), and the gather a
 * prefill chunk after cached context needs for torch's SDPA (the head dims
 * prefill_attention.c does not take).
 *
 * Decode: a work item is one sequence's span of blocks, all heads. It makes one pass
 * over its blocks, each block's keys then values (one contiguous piece of the pool,
 * 2 * block_size * Hkv * D floats), with an online softmax (running peak and sum per
 * head, rescaled as the peak rises), while the next block is prefetched a line or two
 * per inner-loop iteration. Blocks sit anywhere in the pool, so without that the
 * hardware prefetcher loses the stream at every block: 16 sequences x 290 tokens, 30
 * layers, one thread: 28-31 ms with a pass over all keys then one over all values,
 * 18-22 ms this way. Issued in bursts (a share per head before its scores), the
 * prefetches filled the core's miss buffers and stalled the arithmetic behind them:
 * 16 x 272 tokens took 19.9 ms on one Zen 3 thread that way, 16.3 trickled.
 * With fewer than MIN_ITEMS sequences, a sequence's blocks are split into spans whose
 * partial results (peak, sum, weighted values) are merged: a power of two of them, so
 * that they share out evenly over a team of two or four, each at least MIN_SPAN_BLOCKS
 * long, since a span's first block comes in unprefetched and its partial result costs a
 * merge. At batch 1 and ~270 tokens (17 blocks), two spans of nine blocks took a
 * tenth off the attention of a Zen 3 step in place (0.72-0.73 against 0.78-0.87 ms over
 * 30 layers, alternated in one process), against six spans of three (eight planned).
 * Eight-wide vectors whatever the ISA: head dims are multiples of 8 and the score
 * reduction is written for 8.
 */
#include "native.h"

#ifndef ATT_PF
#define ATT_PF 2 /* the next block is prefetched into L2 (into L1 it was slower) */
#endif
#define MIN_ITEMS 8 /* decode work items per step: a sequence splits into spans below this */
#define MIN_SPAN_BLOCKS 8 /* blocks of the shortest span a sequence splits into */
#ifndef PF_SCORE_LINES
#define PF_SCORE_LINES 2
#endif
#ifndef PF_VALUE_LINES
#define PF_VALUE_LINES 1
#endif

/* The next block's lines not yet prefetched. The score loop takes PF_SCORE_LINES per
 * iteration and the value loop PF_VALUE_LINES, which covers a float32 block of the demo
 * model (384 lines: 144 score and 96 value iterations) by the end of its own work. */
typedef struct {
  const char *at, *end;
} pf_cursor;

static inline __attribute__((always_inline)) void pf_lines(pf_cursor *c, int lines) {
  for (int i = 0; i < lines && c->at < c->end; i++, c->at += 64)
    __builtin_prefetch(c->at, 0, ATT_PF);
}

void rope_store_team(const rope_store_args *a, int t, int nt) {
  long D = a->D, half = D / 2, heads = a->Hq + a->Hkv, row_kv = a->Hkv * D;
  for (long r = t; r < a->T; r += nt) {
    float *row = a->qkv + r * a->ldqkv;
    const float *c = a->cos + a->positions[r] * D, *s = a->sin + a->positions[r] * D;
    for (long h = 0; h < heads; h++) {
      float *x = row + h * D;
      for (long i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i + half] + x1 * s[i + half];
      }
    }
    long slot = a->slot_blocks[r] * a->block_stride + a->slot_offsets[r] * row_kv;
    float *k = row + a->Hq * D, *v = row + (a->Hq + a->Hkv) * D;
    if (!a->kv_bf16) {
      memcpy((float *)a->k_cache + slot, k, sizeof(float) * row_kv);
      memcpy((float *)a->v_cache + slot, v, sizeof(float) * row_kv);
      continue;
    }
    uint16_t *k_slot = (uint16_t *)a->k_cache + slot, *v_slot = (uint16_t *)a->v_cache + slot;
    for (long i = 0; i < row_kv; i++) {
      k_slot[i] = float_to_bf16(k[i]), k[i] = bf16_to_float(k_slot[i]);
      v_slot[i] = float_to_bf16(v[i]), v[i] = bf16_to_float(v_slot[i]);
    }
  }
}

void pd_rope_store(float *qkv, long ldqkv, long T, long Hq, long Hkv, long D,
                   const int64_t *positions, const float *cos_table, const float *sin_table,
                   void *k_cache, void *v_cache, long block_stride,
                   const int64_t *slot_blocks, const int64_t *slot_offsets, int nthreads,
                   int kv_bf16) {
  rope_store_args a = {qkv,     ldqkv,   T,       Hq,           Hkv,         D,
                       positions, cos_table, sin_table, k_cache, v_cache, block_stride,
                       slot_blocks, slot_offsets, kv_bf16};
#pragma omp parallel num_threads(nthreads) if (T > 1)
  rope_store_team(&a, omp_get_thread_num(), omp_get_num_threads());
}

static inline float dot8(const float *a, const float *b, long D) {
  f8 acc = splat8(0.0f);
  for (long d = 0; d < D; d += 8) acc += LOAD8(a + d) * LOAD8(b + d);
  return hsum8(acc);
}


/* Where a sequence's paged KV is and how it is laid out (offsets in elements). */
typedef struct {
  const void *k, *v;
  long block_stride, block_size, Hq, Hkv, D;
  const int64_t *table;
} paged_seq;

static inline long span_tokens(long t0, long t_end, long block_size) {
  return t_end - t0 < block_size ? t_end - t0 : block_size;
}

/* scores[j * stride + i] = q_j . k_i for the n tokens of one block, whose keys are
 * float32 rows of Hkv * D from `keys` (q pre-scaled), query head j over kv head j / G. */
static void block_scores(const paged_seq *s, const float *q, const float *keys, long n,
                         float *scores, long stride, pf_cursor *pf) {
  long G = s->Hq / s->Hkv, D = s->D, row = s->Hkv * D;
  for (long j = 0; j < s->Hq; j++) {
    const float *qj = q + j * D, *kh = keys + (j / G) * D;
    float *out = scores + j * stride;
    long i = 0;
    for (; i + 8 <= n; i += 8) {
      f8 acc[8] = {0};
      for (long d = 0; d < D; d += 8) {
        pf_lines(pf, PF_SCORE_LINES);
        f8 qv = LOAD8(qj + d);
        for (int t = 0; t < 8; t++) acc[t] += qv * LOAD8(kh + (i + t) * row + d);
      }
      STORE8(out + i, transpose_sum8(acc));
    }
    for (; i < n; i++) out[i] = dot8(qj, kh + i * row, D);
  }
}

/* A bf16 block's n key rows as float32 at out: each key is read by G query heads, and
 * widening it once, not per head, took a fifth off a bf16 step's attention. */
static void widen_keys(const uint16_t *keys, long n, long row, float *out) {
  for (long e = 0; e < n * row; e += 8) STORE8(out + e, kv_load8(keys, e, 1));
}

/* Online softmax over one block: p = exp(s - peak) in place, where each head's running
 * peak rises to cover the block; its running total and weighted values (out) are
 * rescaled to the new peak first. */
static void block_softmax(float *scores, long stride, long heads, long n, long D, float *peak,
                          float *total, float *out) {
  for (long j = 0; j < heads; j++) {
    float *row = scores + j * stride;
    f8 running = splat8(peak[j]);
    long t = 0;
    for (; t + 8 <= n; t += 8) running = max8(running, LOAD8(row + t));
    float m = hmax8(running);
    for (; t < n; t++) m = row[t] > m ? row[t] : m;
    if (m > peak[j]) {
      float rescale = sexp(peak[j] - m); /* 0 on the first block: peak starts at -inf */
      total[j] *= rescale;
      for (long d = 0; d < D; d += 8) STORE8(out + j * D + d, LOAD8(out + j * D + d) * splat8(rescale));
      peak[j] = m;
    }
    f8 acc = splat8(0.0f);
    for (t = 0; t + 8 <= n; t += 8) {
      f8 e = vexp8(LOAD8(row + t) - splat8(m));
      STORE8(row + t, e);
      acc += e;
    }
    float sum = hsum8(acc);
    for (; t < n; t++) {
      row[t] = sexp(row[t] - m);
      sum += row[t];
    }
    total[j] += sum;
  }
}

/* out[j] += sum_t p_j[t] * v_t over one block's n rows for the G heads of kv head h,
 * whose values start at element vh of `values`, NV vectors of columns at a time: G * NV
 * independent accumulators in registers. */
static inline __attribute__((always_inline)) void block_values(int G, int NV, const float *p,
                                                               long span, long n,
                                                               const void *values, long vh,
                                                               long row, long D, float *out,
                                                               int bf16, pf_cursor *pf) {
  for (long d = 0; d < D; d += 8 * NV) {
    f8 acc[MAX_GROUP][4];
    for (int g = 0; g < G; g++)
      for (int c = 0; c < NV; c++) acc[g][c] = LOAD8(out + g * D + d + 8 * c);
    for (long i = 0; i < n; i++) {
      pf_lines(pf, PF_VALUE_LINES);
      f8 v[4];
      for (int c = 0; c < NV; c++) v[c] = kv_load8(values, vh + i * row + d + 8 * c, bf16);
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
      block_values(GC, NVC, p, span, n, values, vh, row, D, out, bf16, pf);          \
      return;                                                                        \
    }                                                                                \
    block_values(GC, 1, p, span, n, values, vh, row, D, out, bf16, pf);              \
    return;

static inline __attribute__((always_inline)) void group_block_values(
    long G, const float *p, long span, long n, const void *values, long vh, long row, long D,
    float *out, int bf16, pf_cursor *pf) {
  switch (G) {
    BLOCK_VALUES(1, 4) BLOCK_VALUES(2, 4) BLOCK_VALUES(3, 4) BLOCK_VALUES(4, 2)
    BLOCK_VALUES(5, 2) BLOCK_VALUES(6, 2) BLOCK_VALUES(7, 1) BLOCK_VALUES(8, 1)
  }
  for (long g = 0; g < G; g++)
    for (long i = 0; i < n; i++) {
      float w = p[g * span + i];
      for (long d = 0; d < D; d += 8)
        STORE8(out + g * D + d,
               LOAD8(out + g * D + d) + splat8(w) * kv_load8(values, vh + i * row + d, bf16));
    }
}

/* One pass over the span's blocks, each block's keys then values (one contiguous piece
 * of the pool): out = unnormalized sum_t p_j[t] v_t per query head j (Hq * D), with
 * peak and total the softmax's running max and sum. scores: Hq * block_size floats;
 * wide_keys: block_size * Hkv * D floats (used with bf16). */
static inline __attribute__((always_inline)) void span_attend(
    const paged_seq *s, const float *q, long t_begin, long t_end, float *scores,
    float *wide_keys, float *out, float *peak, float *total, int bf16) {
  long G = s->Hq / s->Hkv, D = s->D, row = s->Hkv * D, bs = s->block_size;
  /* keys to values of a block: the pool's kind stride */
  long kind = ((const char *)s->v - (const char *)s->k) / (bf16 ? 2 : 4);
  for (long j = 0; j < s->Hq; j++) peak[j] = -INFINITY, total[j] = 0.0f;
  memset(out, 0, sizeof(float) * (size_t)(s->Hq * D));
  for (long t0 = t_begin; t0 < t_end; t0 += bs) {
    long n = span_tokens(t0, t_end, bs), block = s->table[t0 / bs] * s->block_stride;
    const char *next =
        t0 + bs < t_end ? kv_at(s->k, s->table[t0 / bs + 1] * s->block_stride, bf16) : 0;
    long next_bytes = (kind + span_tokens(t0 + bs, t_end, bs) * row) * (bf16 ? 2 : 4);
    const float *keys = (const float *)s->k + block;
    if (bf16) {
      widen_keys((const uint16_t *)s->k + block, n, row, wide_keys);
      keys = wide_keys;
    }
    pf_cursor pf = {next, next ? next + next_bytes : 0};
    block_scores(s, q, keys, n, scores, bs, &pf);
    block_softmax(scores, bs, s->Hq, n, D, peak, total, out);
    for (long h = 0; h < s->Hkv; h++)
      group_block_values(G, scores + h * G * bs, bs, n, s->v, block + h * D, row, D,
                         out + h * G * D, bf16, &pf);
    pf_lines(&pf, 1 << 30); /* what the loops left (short blocks) */
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

int attention_plan(attention_args *a, int nthreads) {
  if (a->D % 8 || a->Hq % a->Hkv || a->Hq > MAX_HEADS) return -1;
  long max_blocks = 1;
  for (long r = 0; r < a->R; r++) {
    long blocks = (a->context_lens[r] + a->block_size - 1) / a->block_size;
    max_blocks = blocks > max_blocks ? blocks : max_blocks;
  }
  /* Split by the batch alone, never by the thread count, so that a step's result (its
   * merge order) is the same on any number of threads. */
  (void)nthreads;
  long wanted = a->R >= MIN_ITEMS ? 1 : (MIN_ITEMS + a->R - 1) / a->R;
  long fit = max_blocks / MIN_SPAN_BLOCKS, cap = wanted < fit ? wanted : fit, spans = 1;
  while (spans * 2 <= cap) spans *= 2;
  a->spans = spans;
  a->blocks_per_span = (max_blocks + a->spans - 1) / a->spans;
  return 0;
}

long attention_partial_stride(const attention_args *a) { return a->Hq * a->D + 2 * a->Hq; }

/* Per thread: a block's scores, the scaled query, a bf16 block's keys widened. */
long attention_scratch_floats(const attention_args *a) {
  return a->Hq * (a->block_size + a->D) + a->block_size * a->Hkv * a->D;
}

/* One item: row r's span sp; its result goes to out (normalized) or to partial. */
static void attend_item(const attention_args *a, long item, float *scratch) {
  long Hq = a->Hq, D = a->D, spans = a->spans, r = item / spans, sp = item % spans;
  long ctx = a->context_lens[r], stride = attention_partial_stride(a);
  long t_begin = sp * a->blocks_per_span * a->block_size;
  long t_end = t_begin + a->blocks_per_span * a->block_size;
  t_end = t_end < ctx ? t_end : ctx;
  paged_seq s = {a->k_cache, a->v_cache, a->block_stride, a->block_size, Hq, a->Hkv, D,
                 a->block_tables + r * a->table_stride};
  float peak[MAX_HEADS], total[MAX_HEADS], *qs = scratch + Hq * a->block_size;
  float *wide_keys = qs + Hq * D;
  float *dst = a->partial ? a->partial + item * stride : a->out + r * a->ldo;
  float *p_peak = a->partial ? dst + Hq * D : peak, *p_total = a->partial ? dst + Hq * D + Hq : total;
  if (t_begin >= t_end) { /* an empty span contributes nothing to the merge */
    for (long j = 0; j < Hq; j++) p_peak[j] = -INFINITY, p_total[j] = 0.0f;
    memset(dst, 0, sizeof(float) * (size_t)(Hq * D));
    return;
  }
  for (long i = 0; i < Hq * D; i++) qs[i] = a->q[r * a->ldq + i] * a->scale;
  if (a->kv_bf16)
    span_attend(&s, qs, t_begin, t_end, scratch, wide_keys, dst, p_peak, p_total, 1);
  else
    span_attend(&s, qs, t_begin, t_end, scratch, wide_keys, dst, p_peak, p_total, 0);
  if (!a->partial)
    for (long j = 0; j < Hq; j++)
      for (long d = 0; d < D; d++) dst[j * D + d] /= p_total[j];
}

void attention_team(const attention_args *a, float *scratch) {
  long items = a->R * a->spans, stride = attention_partial_stride(a);
#pragma omp for schedule(dynamic, 1)
  for (long item = 0; item < items; item++) attend_item(a, item, scratch);
  if (a->partial) {
#pragma omp for schedule(static)
    for (long r = 0; r < a->R; r++)
      merge_spans(a->spans, a->Hq, a->D, a->partial + r * a->spans * stride, stride,
                  a->out + r * a->ldo);
  }
}

/* q: [R, Hq * D] at stride ldq; out: [R, Hq * D] at stride ldo. GQA: query head j
 * uses kv head j / (Hq / Hkv). Returns -1 (nothing done) for a head dim that is not a
 * multiple of 8, query heads that are not a multiple of the kv heads, or more than
 * MAX_HEADS query heads. */
int pd_decode_attention(const float *q, long ldq, long R, long Hq, long Hkv, long D,
                        const void *k_cache, const void *v_cache, long block_stride,
                        long block_size, const int64_t *block_tables, long table_stride,
                        const int64_t *context_lens, float scale, float *out, long ldo,
                        int nthreads, int kv_bf16) {
  attention_args a = {q,          ldq,        R,           Hq,    Hkv, D,   k_cache,
                      v_cache,    block_stride, block_size, block_tables, table_stride,
                      context_lens, scale,     out,         ldo,   0,   0,   0, kv_bf16};
  if (attention_plan(&a, nthreads)) return -1;
  long items = R * a.spans;
  a.partial = a.spans > 1 ? malloc(sizeof(float) * (size_t)(items * attention_partial_stride(&a))) : 0;
#pragma omp parallel num_threads(nthreads) if (items > 1)
  {
    float *scratch = malloc(sizeof(float) * (size_t)attention_scratch_floats(&a));
    attention_team(&a, scratch);
    free(scratch);
  }
  free(a.partial);
  return 0;
}

/* Keys and values of one sequence's first n tokens, as float32 [Hkv][n][D] each (what
 * SDPA takes), for a prefill chunk that attends to context already in the pool. */
void pd_gather_kv(const void *k_cache, const void *v_cache, long block_stride,
                  long block_size, long Hkv, long D, const int64_t *table, long n,
                  float *k_out, float *v_out, int nthreads, int kv_bf16) {
  long row_kv = Hkv * D;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n > 256)
  for (long t = 0; t < n; t++) {
    long slot = table[t / block_size] * block_stride + (t % block_size) * row_kv;
    for (long h = 0; h < Hkv; h++) {
      float *k = k_out + (h * n + t) * D, *v = v_out + (h * n + t) * D;
      for (long d = 0; d < D; d++) {
        k[d] = kv_load1(k_cache, slot + h * D + d, kv_bf16);
        v[d] = kv_load1(v_cache, slot + h * D + d, kv_bf16);
      }
    }
  }
}

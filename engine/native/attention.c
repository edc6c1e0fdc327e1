/* Attention on the paged pool, read in place: rotary embedding + KV store of a step's
 * new tokens, decode attention (each row over its own blocks), and the gather a
 * prefill chunk after cached context needs for torch's SDPA (the head dims
 * prefill_attention.c does not take).
 *
 * Decode: a work item is one sequence's span of blocks, all heads. It makes one pass
 * over its blocks, each block's keys then values (one contiguous piece of the pool,
 * 2 * block_size * Hkv * D floats), with an online softmax (running peak and sum per
 * head, rescaled as the peak rises), while the next block is prefetched a line or two
 * per inner-loop iteration. Keys are scored a group of query heads at a time (the G
 * heads that share a kv head), so each key is read, and widened from bf16, once per
 * group. Blocks sit anywhere in the pool, so without the prefetch the
 * hardware prefetcher loses the stream at every block: 16 sequences x 290 tokens, 30
 * layers, one thread: 28-31 ms with a pass over all keys then one over all values,
 * 18-22 ms this way. Issued in bursts (a share per head before its scores), the
 * prefetches filled the core's miss buffers and stalled the arithmetic behind them:
 * 16 x 272 tokens took 19.9 ms on one thread that way, 16.3 trickled.
 * With fewer than MIN_ITEMS sequences, a sequence's blocks are split into spans whose
 * partial results (peak, sum, weighted values) are merged: a power of two of them, so
 * that they share out evenly over a team of two or four, each at least MIN_SPAN_BLOCKS
 * long, since a span's first block comes in unprefetched and its partial result costs a
 * merge. At batch 1 and ~270 tokens (17 blocks), two spans of nine blocks took a
 * tenth off the attention of a step in place (0.72-0.73 against 0.78-0.87 ms over
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

/* The next block's lines not yet prefetched, issued at a steady pace over the current
 * block's inner iterations (scores and values): `rate` sixteenths of a line each, set
 * when the block starts so that the last line goes out with its last iteration, whatever
 * the dtype, group size and tile shape make of the counts. */
typedef struct {
  const char *at, *end;
  int credit, rate;
  long calls; /* inner iterations so far */
} pf_cursor;

static inline __attribute__((always_inline)) void pf_pace(pf_cursor *c) {
  c->calls++;
  for (c->credit += c->rate; c->credit >= 16 && c->at < c->end; c->credit -= 16, c->at += 64)
    __builtin_prefetch(c->at, 0, ATT_PF);
}

static inline void pf_rest(pf_cursor *c) {
  for (; c->at < c->end; c->at += 64) __builtin_prefetch(c->at, 0, ATT_PF);
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

/* q . k over D, k read from the pool (widened from bf16 on the way), summed in
 * transpose_sum8's lane order. */
static inline __attribute__((always_inline)) float dot_kv8(const float *q, const void *keys,
                                                           long k, long D, int bf16) {
  f8 acc = splat8(0.0f);
  for (long d = 0; d < D; d += 8) acc += LOAD8(q + d) * kv_load8(keys, k + d, bf16);
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

/* Scores of the G query heads that share one kv head over a block's n keys:
 * scores[g * stride + i] = q_g . k_i, where key i starts at element kh + i * row of
 * `keys` (q pre-scaled). TP keys at a time against all G queries, both in registers, so
 * a key is loaded (and widened from bf16) once for its G heads, not once per head; each
 * (head, key) vector of partial sums is parked until eight keys' worth can be finished by
 * one transpose_sum8. */
static inline __attribute__((always_inline)) void group_scores(int G, int TP, const float *q,
                                                               const void *keys, long kh,
                                                               long n, long row, long D,
                                                               float *scores, long stride,
                                                               int bf16, pf_cursor *pf) {
  long i = 0;
  for (; i + 8 <= n; i += 8) {
    f8 parts[MAX_GROUP][8];
    for (int p = 0; p < 8; p += TP) {
      f8 acc[MAX_GROUP][4];
      for (int g = 0; g < G; g++)
        for (int t = 0; t < TP; t++) acc[g][t] = splat8(0.0f);
      for (long d = 0; d < D; d += 8) {
        pf_pace(pf);
        f8 k[4];
        for (int t = 0; t < TP; t++) k[t] = kv_load8(keys, kh + (i + p + t) * row + d, bf16);
        for (int g = 0; g < G; g++) {
          f8 qv = LOAD8(q + g * D + d);
          for (int t = 0; t < TP; t++) acc[g][t] += qv * k[t];
        }
      }
      for (int g = 0; g < G; g++)
        for (int t = 0; t < TP; t++) parts[g][p + t] = acc[g][t];
    }
    for (int g = 0; g < G; g++) STORE8(scores + g * stride + i, transpose_sum8(parts[g]));
  }
  for (; i < n; i++)
    for (int g = 0; g < G; g++)
      scores[g * stride + i] = dot_kv8(q + g * D, keys, kh + i * row, D, bf16);
}

/* Keys per pass for G heads: the G * TP sums and TP keys fill the 16 AVX2 registers at
 * most (queries are the FMAs' memory operands). On the demo model's groups of 3, 16
 * rows x ~290 tokens over 30 layers' blocks from DRAM, against scoring head by head
 * (over bf16, after widening the block's keys into scratch): 0.90-0.93 of the time over
 * float32 and 0.88-0.92 over bf16; 4 keys a pass, not 2, since the keys come from L2
 * and more of them at once hide more of its latency (2 keys: 0.96 and 0.89-0.91, though
 * 0.6 of the time over bf16 with all in L1). */
#define GROUP_SCORES(GC, TPC)                                                          \
  case GC:                                                                             \
    for (long h = 0; h < s->Hkv; h++)                                                  \
      group_scores(GC, TPC, q + h * GC * D, keys, h * D, n, row, D,                    \
                   scores + h * GC * stride, stride, bf16, pf);                        \
    return;

/* scores[j * stride + i] = q_j . k_i for the n keys of one block at `keys` (rows of
 * Hkv * D, float32 or bf16), query head j over kv head j / G. */
static inline __attribute__((always_inline)) void block_scores(const paged_seq *s,
                                                               const float *q,
                                                               const void *keys, long n,
                                                               float *scores, long stride,
                                                               int bf16, pf_cursor *pf) {
  long G = s->Hq / s->Hkv, D = s->D, row = s->Hkv * D;
  switch (G) {
    GROUP_SCORES(1, 4) GROUP_SCORES(2, 4) GROUP_SCORES(3, 4) GROUP_SCORES(4, 2)
    GROUP_SCORES(5, 2) GROUP_SCORES(6, 2) GROUP_SCORES(7, 2) GROUP_SCORES(8, 1)
  }
  for (long j = 0; j < s->Hq; j++) /* larger groups: one head at a time */
    group_scores(1, 4, q + j * D, keys, (j / G) * D, n, row, D, scores + j * stride, stride,
                 bf16, pf);
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
      pf_pace(pf);
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

/* Fewest passes whose accumulators still fit the 16 AVX2 registers. Float32 values are
 * FMA memory operands, so G * NV sums take the registers; bf16 values are widened into
 * registers first, which then hold G * NV sums, NV values and a weight: for the demo
 * model's groups of 3, two 8-column vectors a pass instead of four took 0.78 of the time
 * over bf16 and 1.15 over float32. */
#define BLOCK_VALUES(GC, NV32, NV16)                                                   \
  case GC:                                                                           \
    if (!bf16 && D % (8 * NV32) == 0) {                                              \
      block_values(GC, NV32, p, span, n, values, vh, row, D, out, 0, pf);            \
      return;                                                                        \
    }                                                                                \
    if (bf16 && D % (8 * NV16) == 0) {                                               \
      block_values(GC, NV16, p, span, n, values, vh, row, D, out, 1, pf);            \
      return;                                                                        \
    }                                                                                \
    block_values(GC, 1, p, span, n, values, vh, row, D, out, bf16, pf);              \
    return;

static inline __attribute__((always_inline)) void group_block_values(
    long G, const float *p, long span, long n, const void *values, long vh, long row, long D,
    float *out, int bf16, pf_cursor *pf) {
  switch (G) {
    BLOCK_VALUES(1, 4, 4) BLOCK_VALUES(2, 4, 4) BLOCK_VALUES(3, 4, 2) BLOCK_VALUES(4, 2, 2)
    BLOCK_VALUES(5, 2, 2) BLOCK_VALUES(6, 2, 2) BLOCK_VALUES(7, 1, 1) BLOCK_VALUES(8, 1, 1)
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
 * peak and total the softmax's running max and sum. scores: Hq * block_size floats.
 * The next block is prefetched at the pace of the inner iterations the previous block
 * ran (all full blocks run the same count; the first one guesses). */
static inline __attribute__((always_inline)) void span_attend(
    const paged_seq *s, const float *q, long t_begin, long t_end, float *scores, float *out,
    float *peak, float *total, int bf16) {
  long G = s->Hq / s->Hkv, D = s->D, row = s->Hkv * D, bs = s->block_size;
  /* keys to values of a block: the pool's kind stride */
  long kind = ((const char *)s->v - (const char *)s->k) / (bf16 ? 2 : 4);
  long iterations = 0;
  for (long j = 0; j < s->Hq; j++) peak[j] = -INFINITY, total[j] = 0.0f;
  memset(out, 0, sizeof(float) * (size_t)(s->Hq * D));
  for (long t0 = t_begin; t0 < t_end; t0 += bs) {
    long n = span_tokens(t0, t_end, bs), block = s->table[t0 / bs] * s->block_stride;
    const char *next =
        t0 + bs < t_end ? kv_at(s->k, s->table[t0 / bs + 1] * s->block_stride, bf16) : 0;
    long next_bytes = (kind + span_tokens(t0 + bs, t_end, bs) * row) * (bf16 ? 2 : 4);
    long next_lines = next ? (next_bytes + 63) / 64 : 0;
    long pace_over = iterations ? iterations : n * s->Hkv * D / 8;
    int rate = (int)((16 * next_lines + pace_over - 1) / pace_over);
    pf_cursor pf = {next, next ? next + 64 * next_lines : 0, 0, rate, 0};
    block_scores(s, q, kv_at(s->k, block, bf16), n, scores, bs, bf16, &pf);
    block_softmax(scores, bs, s->Hq, n, D, peak, total, out);
    for (long h = 0; h < s->Hkv; h++)
      group_block_values(G, scores + h * G * bs, bs, n, s->v, block + h * D, row, D,
                         out + h * G * D, bf16, &pf);
    pf_rest(&pf); /* what the loops left (short blocks) */
    iterations = pf.calls;
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
  a->max_context = 0;
  for (long r = 0; r < a->R; r++)
    a->max_context = a->context_lens[r] > a->max_context ? a->context_lens[r] : a->max_context;
  if (a->deterministic) {
    /* decode_row_exact: no spans. With fewer rows than threads, a row's kv heads are
     * shared out over items, which may follow the thread count: each head's arithmetic
     * is the same whichever item computes it. */
    if (a->D % 16) return -1; /* the head dims pd_prefill_attention takes */
    long parts = a->R >= nthreads ? 1 : (nthreads + a->R - 1) / a->R;
    a->head_parts = parts < a->Hkv ? parts : a->Hkv;
    a->spans = 1, a->blocks_per_span = max_blocks;
    return 0;
  }
  /* Split by the batch alone, never by the thread count, so that a step's result (its
   * merge order) is the same on any number of threads. A row's bits still depend on
   * its batch (spans below MIN_ITEMS rows) and differ from a prefill row's: see
   * decode_row_exact for the mode where they do not. */
  (void)nthreads;
  long wanted = a->R >= MIN_ITEMS ? 1 : (MIN_ITEMS + a->R - 1) / a->R;
  long fit = max_blocks / MIN_SPAN_BLOCKS, cap = wanted < fit ? wanted : fit, spans = 1;
  while (spans * 2 <= cap) spans *= 2;
  a->spans = spans;
  a->blocks_per_span = (max_blocks + a->spans - 1) / a->spans;
  return 0;
}

long attention_partial_stride(const attention_args *a) { return a->Hq * a->D + 2 * a->Hq; }

/* Per thread: a block's scores and the scaled query; in deterministic mode, the scaled
 * queries, their scores over the longest row (whole vectors) and their value sums. */
long attention_scratch_floats(const attention_args *a) {
  if (a->deterministic) return a->Hq * (2 * a->D + (a->max_context + 15) / 16 * 16);
  return a->Hq * (a->block_size + a->D);
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
  float *dst = a->partial ? a->partial + item * stride : a->out + r * a->ldo;
  float *p_peak = a->partial ? dst + Hq * D : peak, *p_total = a->partial ? dst + Hq * D + Hq : total;
  if (t_begin >= t_end) { /* an empty span contributes nothing to the merge */
    for (long j = 0; j < Hq; j++) p_peak[j] = -INFINITY, p_total[j] = 0.0f;
    memset(dst, 0, sizeof(float) * (size_t)(Hq * D));
    return;
  }
  for (long i = 0; i < Hq * D; i++) qs[i] = a->q[r * a->ldq + i] * a->scale;
  if (a->kv_bf16)
    span_attend(&s, qs, t_begin, t_end, scratch, dst, p_peak, p_total, 1);
  else
    span_attend(&s, qs, t_begin, t_end, scratch, dst, p_peak, p_total, 0);
  if (!a->partial)
    for (long j = 0; j < Hq; j++)
      for (long d = 0; d < D; d++) dst[j * D + d] /= p_total[j];
}

void attention_team(const attention_args *a, float *scratch) {
  if (a->deterministic) {
    long parts = a->head_parts;
#pragma omp for schedule(dynamic, 1)
    for (long item = 0; item < a->R * parts; item++) {
      long part = item % parts;
      decode_row_exact(a, item / parts, part * a->Hkv / parts, (part + 1) * a->Hkv / parts,
                       scratch);
    }
    return;
  }
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
 * multiple of 8 (16 with `deterministic`), query heads that are not a multiple of the kv
 * heads, or more than MAX_HEADS query heads. `deterministic`: each row as
 * decode_row_exact computes it (prefill_attention.c), the same bits in any batch. */
int pd_decode_attention(const float *q, long ldq, long R, long Hq, long Hkv, long D,
                        const void *k_cache, const void *v_cache, long block_stride,
                        long block_size, const int64_t *block_tables, long table_stride,
                        const int64_t *context_lens, float scale, float *out, long ldo,
                        int nthreads, int kv_bf16, int deterministic) {
  attention_args a = {q,          ldq,        R,           Hq,    Hkv, D,   k_cache,
                      v_cache,    block_stride, block_size, block_tables, table_stride,
                      context_lens, scale,     out,         ldo,   0,   0,   0, kv_bf16,
                      deterministic, 0, 0};
  if (attention_plan(&a, nthreads)) return -1;
  long items = a.deterministic ? R * a.head_parts : R * a.spans;
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

/* A whole decode step (every row a sequence's next token) in one call and one OpenMP
 * parallel region: embedding -> per layer [RMSNorm + qkv, RoPE + KV store, attention
 * over the pool, residual += o_proj, RMSNorm + gate|up, residual += down(SiLU*mul)]
 * -> final RMSNorm + LM head [-> each row's greedy token], with a team barrier between
 * phases.
 *
 * The same team functions run prefill steps one call per operation from Python
 * (engine/native/ops.py); at batch 1 the ~150 calls, their Python glue and their
 * fork/joins cost about a tenth of a memory-bound step, so decode steps come here.
 */
#include "native.h"

/* The phase clock (`pdserve bench engine --phases`): built with -DPD_PHASE_CLOCK, thread 0
 * reads the time after each phase's barrier, so each interval is the whole team's wall
 * time for that phase, summed over the steps since the last pd_phase_clock call. One
 * clock per process (benchmarks run one engine); without the flag the marks compile to
 * nothing. */
enum { PHASE_EMBED, PHASE_QKV, PHASE_ROPE, PHASE_ATTENTION, PHASE_O, PHASE_GATE_UP, PHASE_DOWN,
       PHASE_HEAD, PD_PHASES };
#ifdef PD_PHASE_CLOCK
static double phase_seconds[PD_PHASES], phase_mark;
static long phase_steps;
#define PHASE_START(t) ((t) == 0 ? (void)(phase_mark = omp_get_wtime()) : (void)0)
#define PHASE_END(t, phase)                       \
  do {                                            \
    if ((t) == 0) {                               \
      double now_ = omp_get_wtime();              \
      phase_seconds[phase] += now_ - phase_mark;  \
      phase_mark = now_;                          \
    }                                             \
  } while (0)
#define PHASE_STEP_DONE()                         \
  do {                                            \
    PHASE_END(0, PHASE_HEAD);                     \
    phase_steps++;                                \
  } while (0)
#else
#define PHASE_START(t) ((void)(t))
#define PHASE_END(t, phase) ((void)(t))
#define PHASE_STEP_DONE() ((void)0)
#endif

/* Seconds per phase (PD_PHASES of them, in the enum's order) and the steps they cover,
 * reset on the way out; returns PD_PHASES, or 0 in a build without the clock. */
int pd_phase_clock(double *seconds, long *steps) {
#ifdef PD_PHASE_CLOCK
  for (int i = 0; i < PD_PHASES; i++) seconds[i] = phase_seconds[i], phase_seconds[i] = 0.0;
  *steps = phase_steps, phase_steps = 0;
  return PD_PHASES;
#else
  (void)seconds, (void)steps;
  return 0;
#endif
}

typedef struct {
  const float *input_norm, *post_norm;
  const float *qkv, *qkv_bias, *o_proj, *o_bias, *gate_up, *down; /* packed; biases or NULL */
} pd_layer_weights;

typedef struct {
  long num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim, vocab;
  float eps, scale;
  const pd_layer_weights *layers;
  const float *final_norm, *lm_head; /* lm_head packed */
  const float *embed;                /* [vocab][hidden], or NULL: rows of the packed lm_head */
  const float *rope_cos, *rope_sin;  /* [positions][head_dim] */
  int weights_bf16;                  /* projections packed as bf16 pairs (linear_bf16.c) */
  int deterministic;                 /* each row's bits independent of the batch */
} pd_model;

typedef struct {
  long rows;
  const int64_t *tokens, *positions, *slot_blocks, *slot_offsets, *block_tables, *context_lens;
  long table_stride;
  void *kv; /* the pool: [blocks][layers][2][block_size][kv_heads][head_dim] */
  long block_stride, layer_stride, kind_stride, block_size; /* in elements */
  /* step buffers, rows x: hidden, qkv width, heads * head_dim, 2 * intermediate,
   * max(hidden, intermediate), vocab */
  float *residual, *qkv, *attn, *gate_up, *scratch, *logits;
  int kv_bf16;     /* the pool holds bf16 */
  int64_t *greedy; /* rows: each row's argmax token (greedy.c), or NULL: not wanted */
} pd_decode_batch;

/* The sizes of the structs above, for engine/native/bindings.py to check its ctypes
 * copies against when it loads the library. */
void pd_struct_sizes(long *sizes) {
  sizes[0] = (long)sizeof(pd_layer_weights);
  sizes[1] = (long)sizeof(pd_model);
  sizes[2] = (long)sizeof(pd_decode_batch);
}

static void embed_rows(const pd_model *m, const pd_decode_batch *b, int t, int nt) {
  long H = m->hidden;
  for (long r = t; r < b->rows; r += nt) {
    long token = b->tokens[r];
    float *out = b->residual + r * H;
    if (m->embed) {
      memcpy(out, m->embed + token * H, sizeof(float) * H);
      continue;
    }
    if (m->weights_bf16) { /* strips of [H2 / 2][NR][2] bf16 */
      long H2 = H + H % 2;
      const uint16_t *strip = (const uint16_t *)m->lm_head + (token / PD_NR) * H2 * PD_NR;
      for (long k = 0; k < H; k++) {
        uint32_t bits = (uint32_t)strip[(k / 2) * 2 * PD_NR + 2 * (token % PD_NR) + k % 2] << 16;
        memcpy(out + k, &bits, sizeof bits);
      }
      continue;
    }
    const float *strip = m->lm_head + (token / PD_NR) * H * PD_NR + token % PD_NR;
    for (long k = 0; k < H; k++) out[k] = strip[k * PD_NR];
  }
}

static linear_args projection(const float *x, long ldx, long rows, long K, const float *w,
                              long N, const float *bias, int prologue, const float *norm,
                              const pd_model *m, const pd_decode_batch *b, float *y,
                              int accumulate) {
  linear_args a = {x, ldx, rows, K, w, N, bias, prologue, norm, m->eps, b->scratch, y, N,
                   accumulate, m->weights_bf16, m->deterministic};
  return a;
}

static void layer_step(const pd_model *m, const pd_decode_batch *b, long l, attention_args *att,
                       float *attn_scratch, int t, int nt) {
  const pd_layer_weights *w = m->layers + l;
  long H = m->hidden, I = m->intermediate, R = b->rows, D = m->head_dim;
  long q_width = m->num_heads * D, qkv_width = q_width + 2 * m->num_kv_heads * D;
  void *k_cache = (void *)kv_at(b->kv, l * b->layer_stride, b->kv_bf16);
  void *v_cache = (void *)kv_at(k_cache, b->kind_stride, b->kv_bf16);
  linear_args qkv = projection(b->residual, H, R, H, w->qkv, qkv_width, w->qkv_bias,
                               PROLOGUE_RMSNORM, w->input_norm, m, b, b->qkv, 0);
  linear_team(&qkv, t, nt);
#pragma omp barrier
  PHASE_END(t, PHASE_QKV);
  rope_store_args rope = {b->qkv,      qkv_width,        R,       m->num_heads, m->num_kv_heads,
                          D,           b->positions,     m->rope_cos, m->rope_sin, k_cache,
                          v_cache,     b->block_stride, b->slot_blocks, b->slot_offsets,
                          b->kv_bf16};
  rope_store_team(&rope, t, nt);
#pragma omp barrier
  PHASE_END(t, PHASE_ROPE);
  att->k_cache = k_cache;
  att->v_cache = v_cache;
  attention_team(att, attn_scratch); /* ends with the omp for's barrier */
  PHASE_END(t, PHASE_ATTENTION);
  linear_args o = projection(b->attn, q_width, R, q_width, w->o_proj, H, w->o_bias,
                             PROLOGUE_NONE, 0, m, b, b->residual, 1);
  linear_team(&o, t, nt);
#pragma omp barrier
  PHASE_END(t, PHASE_O);
  linear_args gate_up = projection(b->residual, H, R, H, w->gate_up, 2 * I, 0, PROLOGUE_RMSNORM,
                                   w->post_norm, m, b, b->gate_up, 0);
  linear_team(&gate_up, t, nt);
#pragma omp barrier
  PHASE_END(t, PHASE_GATE_UP);
  linear_args down = projection(b->gate_up, 2 * I, R, I, w->down, H, 0, PROLOGUE_SILU_MUL, 0,
                                m, b, b->residual, 1);
  linear_team(&down, t, nt);
#pragma omp barrier
  PHASE_END(t, PHASE_DOWN);
}

/* Logits [rows][vocab] of one decode step; 0, or -1 when attention cannot take the
 * shapes (the caller then runs the step operation by operation). */
int pd_decode_step(const pd_model *m, const pd_decode_batch *b, int nthreads) {
  long D = m->head_dim, q_width = m->num_heads * D;
  attention_args att = {b->qkv,          q_width + 2 * m->num_kv_heads * D,
                        b->rows,         m->num_heads,
                        m->num_kv_heads, D,
                        0,               0,
                        b->block_stride, b->block_size,
                        b->block_tables, b->table_stride,
                        b->context_lens, m->scale,
                        b->attn,         q_width,
                        0,               0,
                        0,               b->kv_bf16,
                        m->deterministic, 0, 0};
  if (attention_plan(&att, nthreads)) return -1;
  size_t partial = (size_t)(b->rows * att.spans * attention_partial_stride(&att));
  att.partial = att.spans > 1 ? malloc(sizeof(float) * partial) : 0;
  column_best *best = b->greedy ? malloc(sizeof(column_best) * (size_t)(b->rows * nthreads)) : 0;
#pragma omp parallel num_threads(nthreads)
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    attention_args mine = att; /* k/v pointers change per layer: one copy per thread */
    float *scratch = malloc(sizeof(float) * (size_t)attention_scratch_floats(&att));
    PHASE_START(t);
    embed_rows(m, b, t, nt);
#pragma omp barrier
    PHASE_END(t, PHASE_EMBED);
    for (long l = 0; l < m->num_layers; l++) layer_step(m, b, l, &mine, scratch, t, nt);
    linear_args head = projection(b->residual, m->hidden, b->rows, m->hidden, m->lm_head,
                                  m->vocab, 0, PROLOGUE_RMSNORM, m->final_norm, m, b, b->logits,
                                  0);
    linear_team(&head, t, nt);
    if (best) {
      long c0, c1;
      team_columns(m->vocab, t, nt, &c0, &c1);
      for (long r = 0; r < b->rows; r++)
        best[t * b->rows + r] = best_column(b->logits + r * m->vocab, c0, c1);
#pragma omp barrier
      greedy_merge(best, b->rows, b->greedy, t, nt);
    }
    free(scratch);
  }
  PHASE_STEP_DONE(); /* the region's end joined the team: the head and greedy are done */
  free(best);
  free(att.partial);
  return 0;
}

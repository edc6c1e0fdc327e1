/* Greedy tokens inside the fused decode step: the first index of each row's largest
 * logit, as numpy's argmax gives it (the first NaN where a row has one). Each thread
 * scans the columns its share of the LM head has just written, still in its cache; the
 * threads' bests, in column order, are merged after a barrier.
 *
 * Why here: numpy's argmax over a batch-1 step's logits ran on caches the step's weight
 * stream had just flushed (~100 us cold, 5 us warm). With it here and the step's inputs
 * passed as plain ints (engine/native/decode_step.py), the Python around a batch-1 step
 * went from 540-640 to 250-290 us.
 */
#include "native.h"

/* Each lane keeps the largest value of its columns and the first column that has it. */
static column_best lanes_best(const float *row, long c0, long c1, long *done) {
  const i8 lanes = {0, 1, 2, 3, 4, 5, 6, 7}, stride = lanes - lanes + 8;
  f8 peak = splat8(-INFINITY);
  i8 at = lanes, where = lanes, nan = lanes - lanes;
  long c = c0;
  for (; c + 8 <= c1; c += 8, at += stride) {
    f8 x = LOAD8(row + c);
    i8 greater = x > peak;
    peak = select8(greater, x, peak);
    where = (at & greater) | (where & ~greater);
    nan |= x != x;
  }
  column_best best = {-INFINITY, c0, 0};
  for (int lane = 0; lane < 8; lane++) {
    long index = c0 + where[lane];
    if (peak[lane] > best.value || (peak[lane] == best.value && index < best.index))
      best.value = peak[lane], best.index = index;
    best.nan |= nan[lane] != 0;
  }
  *done = c;
  return best;
}

column_best best_column(const float *row, long c0, long c1) {
  column_best best = {-INFINITY, -1, 0};
  if (c0 >= c1) return best; /* this thread wrote no column */
  long c = c0;
  best = lanes_best(row, c0, c1, &c);
  for (; c < c1; c++) {
    best.nan |= row[c] != row[c];
    if (row[c] > best.value) best.value = row[c], best.index = c;
  }
  if (best.nan)
    for (c = c0;; c++)
      if (row[c] != row[c]) {
        best.value = row[c], best.index = c;
        break;
      }
  return best;
}

void greedy_merge(const column_best *best, long rows, int64_t *tokens, int t, int nt) {
  for (long r = t; r < rows; r += nt) {
    column_best pick = {-INFINITY, -1, 0};
    for (int u = 0; u < nt; u++) {
      column_best b = best[u * rows + r];
      if (b.index < 0) continue;
      if (b.nan) { /* the first NaN, in the first thread's columns that have one */
        pick = b;
        break;
      }
      if (pick.index < 0 || b.value > pick.value) pick = b;
    }
    tokens[r] = pick.index;
  }
}

/* tokens[r] = argmax of row r of x [rows][N], split over the team as a projection's
 * columns are (the tests' entry to the fused step's merge). */
void pd_greedy_rows(const float *x, long rows, long N, int64_t *tokens, int nthreads) {
  column_best *best = malloc(sizeof(column_best) * (size_t)(rows * nthreads));
#pragma omp parallel num_threads(nthreads)
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    long c0, c1;
    team_columns(N, t, nt, &c0, &c1);
    for (long r = 0; r < rows; r++) best[t * rows + r] = best_column(x + r * N, c0, c1);
#pragma omp barrier
    greedy_merge(best, rows, tokens, t, nt);
  }
  free(best);
}

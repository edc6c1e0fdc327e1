/* XXH3-64 (seed 0) of KV blocks, optionally fused with their copy.
 *
 * Called by kv_transfer.integrity when a receiver copies KV blocks on the CPU (shm,
 * local, gRPC into a CPU pool). The hash is xxHash's own: xxhash.h beside this file
 * (release 0.8.3, the one the `xxhash` package bundles; XXH3's output is frozen since
 * 0.8.0), inlined, so it takes this build's -march vector path. Sender (the package) and
 * receiver (this file) compute the same digest by construction, which
 * tests/test_kv_transfer_units.py checks at every length class.
 *
 * Each block is copied and hashed a 2 KiB step at a time, the hash reading the step
 * from L1 right behind its copy, so the block is read from memory once (copy, then
 * hash, reads it twice: half the speed). */
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define XXH_INLINE_ALL /* static copies of xxHash's functions: no symbols to clash */
#include "xxhash.h"

/* Bytes per copy step, and how far ahead of the copy the source is prefetched, so that
 * memory keeps reading while a step is hashed. Copying 16 MiB to 256 MiB of 180 KiB to
 * 1 MiB blocks on one core, 2 KiB steps 8 KiB ahead ran as fast as a copy loop hashing
 * each stripe from the registers it had just loaded (0.95-1.2x of it); 4 and 8 KiB
 * steps, or a prefetch only one step ahead, ran 10-20% slower. */
#ifndef PD_COPY_STEP
#define PD_COPY_STEP 2048
#endif
#ifndef PD_PREFETCH_AHEAD
#define PD_PREFETCH_AHEAD 8192
#endif

/* n bytes from `src` to `dst`, 64 at a time (then the tail). */
static void plain_copy(uint8_t *dst, const uint8_t *src, size_t n) {
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __builtin_prefetch(src + i + PD_PREFETCH_AHEAD);
    memcpy(dst + i, src + i, 64);
  }
  memcpy(dst + i, src + i, n - i);
}

/* n bytes (a multiple of 64) from `src` to a 64-byte aligned `dst`, stored around the
 * cache: an imported block is next read by a decode step, which streams it with the
 * weights, so caching it now only costs reading each destination line first. */
static void stream_copy(uint8_t *dst, const uint8_t *src, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    const uint8_t *from = src + i;
    uint8_t *to = dst + i;
    __builtin_prefetch(from + PD_PREFETCH_AHEAD);
#if defined(__AVX512F__)
    _mm512_stream_si512((void *)to, _mm512_loadu_si512((const void *)from));
#elif defined(__AVX__)
    _mm256_stream_si256((__m256i *)to, _mm256_loadu_si256((const __m256i *)from));
    _mm256_stream_si256((__m256i *)(to + 32), _mm256_loadu_si256((const __m256i *)(from + 32)));
#elif defined(__x86_64__)
    for (int j = 0; j < 64; j += 16)
      _mm_stream_si128((__m128i *)(to + j), _mm_loadu_si128((const __m128i *)(from + j)));
#else
    memcpy(to, from, 64);
#endif
  }
}

/* The digest of `len` bytes copied from `src` to `dst`, a step at a time, each step
 * hashed right behind its copy, while it is in L1. `stream`: `dst` and `len` are 64-byte
 * multiples and the copy goes around the cache; the hash then reads the step from the
 * source, which the copy has just loaded (a source rewritten in between gives a digest
 * the ticket does not hold: the fetch fails, it never passes a torn copy). Otherwise the
 * step is hashed from `dst`, the bytes written. */
static uint64_t copy_hash(const uint8_t *src, uint8_t *dst, size_t len, int stream) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  for (size_t at = 0; at < len; at += PD_COPY_STEP) {
    const size_t n = len - at < PD_COPY_STEP ? len - at : PD_COPY_STEP;
    if (stream) {
      stream_copy(dst + at, src + at, n);
      XXH3_64bits_update(&state, src + at, n);
    } else {
      plain_copy(dst + at, src + at, n);
      XXH3_64bits_update(&state, dst + at, n);
    }
  }
  return XXH3_64bits_digest(&state);
}

/* Digests of `count` consecutive blocks of `block_nbytes` each, into `out`; copies them
 * from `src` to `dst` on the way when `dst` is not NULL. Returns 0, or -1 for a block
 * size below 1. ctypes releases the GIL for the call, so copy lanes on other threads run
 * meanwhile. The copy streams around the cache where every block starts 64-byte aligned
 * (pool pages, blocks of whole 64-byte lines): an shm fetch of 16 to 256 MiB on 2 lanes
 * took 21-29% less time for it (docs/kv_transfer.md). */
int pd_copy_xxh3_blocks(const uint8_t *src, uint8_t *dst, int64_t block_nbytes, int64_t count,
                        uint64_t *out) {
  if (block_nbytes < 1) return -1;
  const size_t size = (size_t)block_nbytes;
  const int stream = dst != NULL && (uintptr_t)dst % 64 == 0 && size % 64 == 0;
  for (int64_t i = 0; i < count; i++) {
    const uint8_t *block = src + i * size;
    out[i] = dst == NULL ? XXH3_64bits(block, size) : copy_hash(block, dst + i * size, size, stream);
  }
#if defined(__x86_64__)
  if (stream) _mm_sfence(); /* the streamed lines reach memory before the caller reads */
#endif
  return 0;
}

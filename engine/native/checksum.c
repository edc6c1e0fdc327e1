/* XXH3-64 (seed 0, default secret) of KV blocks, optionally fused with their copy.
 *
 * Called by kv_transfer.integrity when a receiver copies KV blocks on the CPU (shm,
 * local, gRPC into a CPU pool): each block is copied and hashed in one pass over it,
 * one 64-byte stripe at a time, so the hash reads registers the copy just loaded
 * instead of reading the block again from cache or memory. The digests equal the
 * `xxhash` package's `xxh3_64_intdigest` of the block's bytes (tests/test_kv_transfer_units.py
 * checks every length class this file serves), so a sender that hashed with the
 * package and a receiver that hashes here agree. Only the long-input path (more than
 * 240 bytes) is here: KV blocks are kilobytes to megabytes; shorter inputs stay in
 * Python. The algorithm follows xxHash's specification (doc/xxhash_spec.md in
 * Cyan4973/xxHash); the 192-byte secret below is a constant of it. */
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define XXH_STRIPE 64
#define XXH_SECRET_SIZE 192
#define XXH_STRIPES_PER_BLOCK ((XXH_SECRET_SIZE - XXH_STRIPE) / 8) /* 16 */
#define XXH_BLOCK (XXH_STRIPE * XXH_STRIPES_PER_BLOCK)              /* 1024 bytes */
#define XXH_MIDSIZE_MAX 240

#define PRIME32_1 0x9E3779B1ull
#define PRIME32_2 0x85EBCA77ull
#define PRIME32_3 0xC2B2AE3Dull
#define PRIME64_1 0x9E3779B185EBCA87ull
#define PRIME64_2 0xC2B2AE3D27D4EB4Full
#define PRIME64_3 0x165667B19E3779F9ull
#define PRIME64_4 0x85EBCA77C2B2AE63ull
#define PRIME64_5 0x27D4EB2F165667C5ull

static const uint8_t k_secret[XXH_SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* Eight 64-bit accumulators (the spec's acc[8]) and the three steps on them: load a
 * 64-byte stripe, accumulate it (the spec's accumulate_512) and scramble after each
 * 1 KiB block. With AVX-512 GCC lowers the generic vector code to one zmm. AVX2 has
 * its own intrinsics: from the generic code GCC emitted a full 64x64-bit multiply
 * (three vpmuludq and shifts) and spilled both halves to the stack, which hashed at
 * 10 GB/s where the xxhash package reaches 40. */
#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>

typedef struct {
  __m256i lo, hi; /* lanes 0-3 and 4-7 */
} acc_t;
typedef struct {
  __m256i lo, hi;
} stripe_t;

static inline stripe_t load_stripe(const uint8_t *p) {
  return (stripe_t){_mm256_loadu_si256((const __m256i *)p),
                    _mm256_loadu_si256((const __m256i *)(p + 32))};
}

static inline void store_stripe(uint8_t *p, stripe_t data) {
  _mm256_storeu_si256((__m256i *)p, data.lo);
  _mm256_storeu_si256((__m256i *)(p + 32), data.hi);
}

/* A store that does not read the destination line first nor keep it in cache; `p` must be
 * 32-byte aligned. */
static inline void stream_stripe(uint8_t *p, stripe_t data) {
  _mm256_stream_si256((__m256i *)p, data.lo);
  _mm256_stream_si256((__m256i *)(p + 32), data.hi);
}

static inline __m256i accumulate_half(__m256i acc, __m256i data, const uint8_t *secret) {
  const __m256i keyed = _mm256_xor_si256(data, _mm256_loadu_si256((const __m256i *)secret));
  /* vpmuludq multiplies the low 32 bits of each lane: low half times high half. */
  const __m256i product = _mm256_mul_epu32(keyed, _mm256_srli_epi64(keyed, 32));
  const __m256i swapped = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
  return _mm256_add_epi64(acc, _mm256_add_epi64(product, swapped));
}

static inline acc_t accumulate(acc_t acc, stripe_t data, const uint8_t *secret) {
  return (acc_t){accumulate_half(acc.lo, data.lo, secret),
                 accumulate_half(acc.hi, data.hi, secret + 32)};
}

static inline __m256i scramble_half(__m256i acc, const uint8_t *secret) {
  const __m256i prime = _mm256_set1_epi32((int)PRIME32_1);
  acc = _mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47));
  acc = _mm256_xor_si256(acc, _mm256_loadu_si256((const __m256i *)secret));
  /* acc * PRIME32_1 mod 2^64 = low * prime + ((high * prime) << 32) */
  const __m256i low = _mm256_mul_epu32(acc, prime);
  const __m256i high = _mm256_mul_epu32(_mm256_srli_epi64(acc, 32), prime);
  return _mm256_add_epi64(low, _mm256_slli_epi64(high, 32));
}

static inline acc_t scramble(acc_t acc) {
  const uint8_t *secret = k_secret + XXH_SECRET_SIZE - XXH_STRIPE;
  return (acc_t){scramble_half(acc.lo, secret), scramble_half(acc.hi, secret + 32)};
}

static inline acc_t initial_acc(void) {
  return (acc_t){_mm256_setr_epi64x(PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3),
                 _mm256_setr_epi64x(PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1)};
}

static inline void acc_lanes(acc_t acc, uint64_t lanes[8]) {
  _mm256_storeu_si256((__m256i *)lanes, acc.lo);
  _mm256_storeu_si256((__m256i *)(lanes + 4), acc.hi);
}
#else
typedef uint64_t acc_t __attribute__((vector_size(64)));
typedef acc_t stripe_t;
typedef uint64_t u64x8u __attribute__((vector_size(64), aligned(1)));

static inline stripe_t load_stripe(const uint8_t *p) { return *(const u64x8u *)p; }

static inline void store_stripe(uint8_t *p, stripe_t data) { *(u64x8u *)p = data; }

#if defined(__AVX512F__)
static inline void stream_stripe(uint8_t *p, stripe_t data) {
  _mm512_stream_si512((void *)p, (__m512i)data);
}
#else
static inline void stream_stripe(uint8_t *p, stripe_t data) { store_stripe(p, data); }
#endif

/* Each lane adds its neighbour's input word and the product of its keyed word's two
 * 32-bit halves. */
static inline acc_t accumulate(acc_t acc, stripe_t data, const uint8_t *secret) {
  const acc_t keyed = data ^ load_stripe(secret);
  const acc_t low32 = keyed & 0xFFFFFFFFull;
  const acc_t swapped = __builtin_shuffle(data, (acc_t){1, 0, 3, 2, 5, 4, 7, 6});
  return acc + swapped + low32 * (keyed >> 32);
}

static inline acc_t scramble(acc_t acc) {
  acc ^= acc >> 47;
  acc ^= load_stripe(k_secret + XXH_SECRET_SIZE - XXH_STRIPE);
  return acc * PRIME32_1;
}

static inline acc_t initial_acc(void) {
  return (acc_t){PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3,
                 PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1};
}

static inline void acc_lanes(acc_t acc, uint64_t lanes[8]) { memcpy(lanes, &acc, 64); }
#endif

static inline uint64_t fold64(uint64_t lhs, uint64_t rhs) {
  const __uint128_t product = (__uint128_t)lhs * rhs;
  return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static inline uint64_t read64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v; /* little-endian hosts only (x86-64, aarch64) */
}

static uint64_t avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= 0x165667919E3779F9ull;
  return h ^ (h >> 32);
}

static uint64_t merge(acc_t acc, uint64_t len) {
  const uint8_t *secret = k_secret + 11;
  uint64_t lanes[8];
  acc_lanes(acc, lanes);
  uint64_t result = len * PRIME64_1;
  for (int i = 0; i < 4; i++)
    result += fold64(lanes[2 * i] ^ read64(secret + 16 * i),
                     lanes[2 * i + 1] ^ read64(secret + 16 * i + 8));
  return avalanche(result);
}

/* One stripe stored at `p`, around the cache when `stream` (`p` 64-byte aligned). */
static inline void put_stripe(uint8_t *p, stripe_t data, int stream) {
  if (stream)
    stream_stripe(p, data);
  else
    store_stripe(p, data);
}

/* The long-input XXH3-64 of `len` (> 240) bytes at `src`; with `dst` non-NULL each
 * stripe is also stored there, so `dst` ends up a copy of `src` and the digest is of
 * the bytes written (the last stripe is re-read from `dst`). `stream`: `dst` is
 * 64-byte aligned, store around the cache. */
static inline uint64_t copy_hash_long(const uint8_t *src, uint8_t *dst, int64_t len,
                                      int stream) {
  acc_t acc = initial_acc();
  const int64_t blocks = (len - 1) / XXH_BLOCK;
  int64_t at = 0;
  for (int64_t b = 0; b < blocks; b++) {
    for (int s = 0; s < XXH_STRIPES_PER_BLOCK; s++, at += XXH_STRIPE) {
      const stripe_t data = load_stripe(src + at);
      if (dst) put_stripe(dst + at, data, stream);
      acc = accumulate(acc, data, k_secret + 8 * s);
    }
    acc = scramble(acc);
  }
  const int stripes = (int)((len - 1 - at) / XXH_STRIPE);
  for (int s = 0; s < stripes; s++, at += XXH_STRIPE) {
    const stripe_t data = load_stripe(src + at);
    if (dst) put_stripe(dst + at, data, stream);
    acc = accumulate(acc, data, k_secret + 8 * s);
  }
  if (dst) {
    memcpy(dst + at, src + at, (size_t)(len - at)); /* the tail after the last whole stripe */
    src = dst;
  }
  acc = accumulate(acc, load_stripe(src + len - XXH_STRIPE), k_secret + XXH_SECRET_SIZE - XXH_STRIPE - 7);
  return merge(acc, (uint64_t)len);
}

/* Digests of `count` consecutive blocks of `block_nbytes` (> 240) each, into `out`;
 * copies them from `src` to `dst` on the way when `dst` is not NULL. Returns 0, or -1
 * for a block size this file does not serve (the caller hashes in Python). ctypes
 * releases the GIL for the call, so copy lanes on other threads run meanwhile.
 *
 * Where every block starts 64-byte aligned (pool pages, whole-stripe blocks), the copy
 * uses non-temporal stores: an imported block is next read by a decode step, which
 * streams it along with the weights, so caching it now only costs reading each
 * destination line before it is written. An shm fetch of 16 to 256 MiB
 * on 2 lanes took 21-29% less time. */
int pd_copy_xxh3_blocks(const uint8_t *src, uint8_t *dst, int64_t block_nbytes, int64_t count,
                        uint64_t *out) {
  if (block_nbytes <= XXH_MIDSIZE_MAX) return -1;
  const int stream = dst != NULL && (uintptr_t)dst % 64 == 0 && block_nbytes % 64 == 0;
  for (int64_t i = 0; i < count; i++) {
    const int64_t offset = i * block_nbytes;
    /* `stream` a constant at each call: both inline into loops without its branch */
    out[i] = stream ? copy_hash_long(src + offset, dst + offset, block_nbytes, 1)
                    : copy_hash_long(src + offset, dst ? dst + offset : NULL, block_nbytes, 0);
  }
#if defined(__x86_64__)
  if (stream) _mm_sfence(); /* the streamed lines reach memory before the caller reads */
#endif
  return 0;
}

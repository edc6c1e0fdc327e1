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

/* Eight 64-bit accumulators in one vector: GCC lowers it to one zmm with AVX-512, two
 * ymm with AVX2, scalar code otherwise. */
typedef uint64_t u64x8 __attribute__((vector_size(64)));
typedef uint64_t u64x8u __attribute__((vector_size(64), aligned(1)));

static inline u64x8 load8(const uint8_t *p) { return *(const u64x8u *)p; }

/* One stripe into the accumulators (the spec's accumulate_512): each lane adds its
 * neighbour's input word and the product of its keyed word's two 32-bit halves. */
static inline u64x8 accumulate(u64x8 acc, u64x8 data, const uint8_t *secret) {
  const u64x8 keyed = data ^ load8(secret);
  const u64x8 low32 = keyed & 0xFFFFFFFFull;
  const u64x8 swapped = __builtin_shuffle(data, (u64x8){1, 0, 3, 2, 5, 4, 7, 6});
  return acc + swapped + low32 * (keyed >> 32);
}

static inline u64x8 scramble(u64x8 acc) {
  acc ^= acc >> 47;
  acc ^= load8(k_secret + XXH_SECRET_SIZE - XXH_STRIPE);
  return acc * PRIME32_1;
}

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

static uint64_t merge(u64x8 acc, uint64_t len) {
  const uint8_t *secret = k_secret + 11;
  uint64_t result = len * PRIME64_1;
  for (int i = 0; i < 4; i++)
    result += fold64(acc[2 * i] ^ read64(secret + 16 * i),
                     acc[2 * i + 1] ^ read64(secret + 16 * i + 8));
  return avalanche(result);
}

/* The long-input XXH3-64 of `len` (> 240) bytes at `src`; with `dst` non-NULL each
 * stripe is also stored there, so `dst` ends up a copy of `src` and the digest is of
 * the bytes written (the last stripe is re-read from `dst`). */
static uint64_t copy_hash_long(const uint8_t *src, uint8_t *dst, int64_t len) {
  u64x8 acc = {PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3,
               PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1};
  const int64_t blocks = (len - 1) / XXH_BLOCK;
  int64_t at = 0;
  for (int64_t b = 0; b < blocks; b++) {
    for (int s = 0; s < XXH_STRIPES_PER_BLOCK; s++, at += XXH_STRIPE) {
      const u64x8 data = load8(src + at);
      if (dst) *(u64x8u *)(dst + at) = data;
      acc = accumulate(acc, data, k_secret + 8 * s);
    }
    acc = scramble(acc);
  }
  const int stripes = (int)((len - 1 - at) / XXH_STRIPE);
  for (int s = 0; s < stripes; s++, at += XXH_STRIPE) {
    const u64x8 data = load8(src + at);
    if (dst) *(u64x8u *)(dst + at) = data;
    acc = accumulate(acc, data, k_secret + 8 * s);
  }
  if (dst) {
    memcpy(dst + at, src + at, (size_t)(len - at)); /* the tail after the last whole stripe */
    src = dst;
  }
  acc = accumulate(acc, load8(src + len - XXH_STRIPE), k_secret + XXH_SECRET_SIZE - XXH_STRIPE - 7);
  return merge(acc, (uint64_t)len);
}

/* Digests of `count` consecutive blocks of `block_nbytes` (> 240) each, into `out`;
 * copies them from `src` to `dst` on the way when `dst` is not NULL. Returns 0, or -1
 * for a block size this file does not serve (the caller hashes in Python). ctypes
 * releases the GIL for the call, so copy lanes on other threads run meanwhile. */
int pd_copy_xxh3_blocks(const uint8_t *src, uint8_t *dst, int64_t block_nbytes, int64_t count,
                        uint64_t *out) {
  if (block_nbytes <= XXH_MIDSIZE_MAX) return -1;
  for (int64_t i = 0; i < count; i++) {
    const int64_t offset = i * block_nbytes;
    out[i] = copy_hash_long(src + offset, dst ? dst + offset : NULL, block_nbytes);
  }
  return 0;
}

"""Reuse of KV blocks across requests that share a prompt prefix.

A full block is named by a hash chained over (its parent block's hash, its token ids),
the chain seeded with the model id, the KV dtype and the block size, so two blocks
have one name only if they hold the KV of the same tokens after the same prefix, of
the same model. Lifecycle of a block here:

    computed: a step filled it, or an import landed its bytes (never before: a block
      whose KV is half written is never published, whatever happens to its request)
    -> `publish`: its hash maps to its block id; later sequences starting with the same
       tokens `match` it and share it read-only (the allocator counts references)
    -> its last reference dropped: `park`ed, still in the table, evictable, oldest first
    -> revived by a hit (`unpark`), or `evict`ed when the pool needs a fresh block and
       has no never-cached one left: forgotten.

A match also compares the block's tokens and parent hash with the sequence's own, so a
hash collision can cost a hit but never serve another prompt's KV. The cache lives
inside the `BlockAllocator` (engine/block_manager.py), which alone decides when a block
is free; the scheduler matches, the engine publishes after each step.

Cost: one tuple hash per full block, computed once per sequence (a cached prompt's
first lookup stops at its first miss), so unique prompts pay almost nothing.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

REPORTED_HASHES = 65536
"""Most block hashes one health report carries (the most recently used first)."""

TokenSlice = Callable[[int, int], list[int]]
"""`(start, end) -> token ids`, e.g. `Sequence.token_slice`."""


def hash_seed(model_id: str, dtype: str, block_size: int) -> int:
    """The chain's root: stable across processes (unlike `hash(str)`), so the driver and
    every worker of one model name a block alike."""
    return _root_of(f"{model_id}|{dtype}|{block_size}")


def salted_root(seed: int, salt: str | None) -> int:
    """The chain root of requests with prefix-cache salt `salt` (None: the shared root):
    a salted chain shares no block with any other chain."""
    return seed if salt is None else _root_of(f"{seed}|{salt}")


def _root_of(text: str) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    # Tuples of ints hash the same in every process (no string hash randomization).
    return hash((parent, tokens))


def extend_hashes(
    hashes: list[int], tokens: TokenSlice, seed: int, block_size: int, num_blocks: int
) -> list[int]:
    """Grow `hashes` (the chain of a token sequence's leading full blocks) to
    `num_blocks` entries, in place; returns it."""
    parent = hashes[-1] if hashes else seed
    for index in range(len(hashes), num_blocks):
        start = index * block_size
        parent = block_hash(parent, tuple(tokens(start, start + block_size)))
        hashes.append(parent)
    return hashes


def prompt_hashes(seed: int, token_ids: list[int], block_size: int) -> list[int]:
    """The chain of every full block of `token_ids` (the router's view of a prompt)."""
    full = len(token_ids) // block_size
    return extend_hashes([], lambda a, b: token_ids[a:b], seed, block_size, full)


@dataclass(frozen=True)
class CacheReport:
    """What a worker's health report says about its prefix cache; the router reads
    `hashes` to score where a prompt's prefix is held, metrics the counters."""

    seed: int
    block_size: int
    hashes: list[int]
    """Hashes of the blocks cached now (in use or evictable), most recently used first."""
    queried_tokens: int
    """Tokens looked up so far (each admitted sequence's tokens, each import's prompt)."""
    hit_tokens: int
    """Of those, tokens whose KV was already here."""
    evictions: int
    cached_blocks: int


@dataclass
class _Entry:
    block_hash: int
    parent: int
    tokens: tuple[int, ...]


class PrefixCache:
    """Owned by one `BlockAllocator`; single-threaded like the engine that owns both."""

    def __init__(self, seed: int, block_size: int):
        self.seed = seed
        self.block_size = block_size
        self.by_hash: dict[int, int] = {}
        """Hash -> block id of every published block."""
        self.entries: dict[int, _Entry] = {}
        """Block id -> what it holds, for every published block."""
        self.evictable: OrderedDict[int, None] = OrderedDict()
        """Published blocks nobody references, least recently used first."""
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0

    # --- the scheduler ------------------------------------------------------------------

    def match(
        self, hashes: list[int], tokens: TokenSlice, max_blocks: int, salt: str | None = None
    ) -> list[int]:
        """Block ids of the longest cached chain of `hashes` (grown on demand with
        `extend_hashes` from the root of `salt`), at most `max_blocks`. Takes nothing:
        the caller checks room, then `BlockAllocator.take_cached`."""
        found: list[int] = []
        size = self.block_size
        root = salted_root(self.seed, salt)
        for index in range(max_blocks):
            extend_hashes(hashes, tokens, root, size, index + 1)
            block_id = self.by_hash.get(hashes[index])
            if block_id is None:
                break
            entry = self.entries[block_id]
            parent = hashes[index - 1] if index else root
            if entry.parent != parent or entry.tokens != tuple(
                tokens(index * size, (index + 1) * size)
            ):
                break  # a collision: same hash, other tokens
            found.append(block_id)
        return found

    def count_lookup(self, tokens: int, hits: int) -> None:
        self.queried_tokens += tokens
        self.hit_tokens += hits

    # --- the engine, after a step or an import ---------------------------------------

    def publish(self, block_id: int, block_hash_: int, parent: int, tokens: tuple) -> bool:
        """Name a block whose KV is complete. False (and nothing changes) when another
        block already holds the same tokens: this one stays private and is freed as usual."""
        if block_hash_ in self.by_hash or block_id in self.entries:
            return False
        self.by_hash[block_hash_] = block_id
        self.entries[block_id] = _Entry(block_hash_, parent, tokens)
        return True

    # --- the allocator --------------------------------------------------------------------

    def park(self, block_id: int) -> bool:
        """The block's last reference is gone: keep it (True) if it is published."""
        if block_id not in self.entries:
            return False
        self.evictable[block_id] = None
        return True

    def unpark(self, block_id: int) -> None:
        """A hit on a parked block: it is in use again, no longer evictable."""
        del self.evictable[block_id]

    def evict(self) -> int:
        """Forget the least recently used parked block; returns its id, now plain free."""
        block_id, _ = self.evictable.popitem(last=False)
        entry = self.entries.pop(block_id)
        if self.by_hash.get(entry.block_hash) == block_id:
            del self.by_hash[entry.block_hash]
        self.evictions += 1
        return block_id

    def is_cached(self, block_id: int) -> bool:
        return block_id in self.entries

    # --- reports --------------------------------------------------------------------------

    def report(self, limit: int = REPORTED_HASHES) -> CacheReport:
        """Called by the worker's health report, on its event loop while the engine
        thread runs: each container is copied in one C call (atomic under the GIL), and
        a report a step out of date is as good a routing hint as an exact one."""
        entries = dict(self.entries)
        parked = list(self.evictable)
        parked_set = set(parked)
        in_use = [e.block_hash for b, e in entries.items() if b not in parked_set]
        parked_hashes = [entries[b].block_hash for b in reversed(parked) if b in entries]
        return CacheReport(
            seed=self.seed,
            block_size=self.block_size,
            hashes=(in_use + parked_hashes)[:limit],
            queried_tokens=self.queried_tokens,
            hit_tokens=self.hit_tokens,
            evictions=self.evictions,
            cached_blocks=len(entries),
        )

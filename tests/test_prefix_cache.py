"""The engine's prefix cache: the same greedy tokens with and without it, KV reused only
from blocks whose KV was complete, shared blocks counted, eviction under pressure, and
no leaks after any of it."""

from __future__ import annotations

import pytest

from engine.prefix_cache import PrefixCache, hash_seed, prompt_hashes, salted_root
from engine.sampling_params import SamplingParams
from tests.factories import assert_no_leaks, hf_greedy, make_engine

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
BLOCK = 8


def tokens_of(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 31 * salt) % 300 + 3 for i in range(n)]


BASE = tokens_of(48)
# (name, prompt): sharing 0, 1 and many blocks with BASE, partial and whole last blocks.
PROMPTS = [
    ("base, 6 whole blocks", BASE),
    ("shares 0 blocks", tokens_of(21, salt=5)),
    ("shares 1 block, partial last", BASE[:BLOCK] + tokens_of(5, salt=2)),
    ("shares 5 blocks, partial last", [*BASE[:44], 9, 9, 9]),
    ("all of base plus 1 token", [*BASE, 11]),
    ("base's first 4 blocks exactly", BASE[:32]),
]


def run_alone(engine, prompt):
    seq = engine.generate([prompt], GREEDY)[0]
    return seq.output_token_ids, seq.num_cached_tokens


@pytest.mark.parametrize(("family", "chunk"), [("llama", 512), ("llama", 5), ("qwen2", 512)])
def test_greedy_tokens_are_identical_with_and_without_the_cache(tiny_model_dirs, family, chunk):
    model_dir = tiny_model_dirs[family]
    # chunk 5: the rest of a prompt after its cached blocks is prefilled in pieces
    cached = make_engine(model_dir, block_size=BLOCK, prefill_chunk_size=chunk)
    plain = make_engine(model_dir, block_size=BLOCK, prefix_caching=False)
    hits = {}
    for name, prompt in PROMPTS:
        ours, hits[name] = run_alone(cached, prompt)
        assert ours == run_alone(plain, prompt)[0] == hf_greedy(model_dir, prompt, 10)[0], name
    assert hits == {
        "base, 6 whole blocks": 0,
        "shares 0 blocks": 0,
        "shares 1 block, partial last": 8,
        "shares 5 blocks, partial last": 40,
        "all of base plus 1 token": 48,
        # Every block cached, yet the last token must be computed to be sampled from:
        # its block is computed again (into a fresh block; the cached one stays shared).
        "base's first 4 blocks exactly": 24,
    }
    assert plain.allocator.cache is None
    assert_no_leaks(cached)
    assert_no_leaks(plain)


def test_requests_share_cached_blocks_only_under_the_same_cache_salt(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, block_size=BLOCK)

    def run(salt):
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, cache_salt=salt)
        seq = engine.generate([[*BASE, 5]], params)[0]
        return seq.output_token_ids, seq.num_cached_tokens

    first, unsalted_hits = run(None)
    assert unsalted_hits == 0
    assert run("tenant-a") == (first, 0)  # the shared cache holds BASE; tenant a sees none
    assert run("tenant-a") == (first, 48)  # ... but its own blocks
    assert run("tenant-b") == (first, 0)
    assert run(None) == (first, 48)
    assert_no_leaks(engine)


def test_salted_chains_share_no_hash_with_the_shared_chain():
    seed = hash_seed("m", "float32", BLOCK)
    shared = prompt_hashes(seed, BASE, BLOCK)
    salted = {salt: prompt_hashes(salted_root(seed, salt), BASE, BLOCK) for salt in "ab"}
    assert salted_root(seed, None) == seed
    assert not set(shared) & set(salted["a"]) and not set(salted["a"]) & set(salted["b"])
    assert salted["a"] == prompt_hashes(salted_root(seed, "a"), BASE, BLOCK)


def test_sequences_sharing_a_prefix_in_one_batch_decode_the_same_as_alone(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, block_size=BLOCK)
    plain = make_engine(tiny_llama_dir, block_size=BLOCK, prefix_caching=False)
    engine.generate([BASE], GREEDY)  # the prefix is now cached
    prompts = [BASE[:40] + tokens_of(3 + i, salt=i) for i in range(6)]

    together = engine.generate(prompts, GREEDY)

    assert [s.output_token_ids for s in together] == [
        s.output_token_ids for s in plain.generate(prompts, GREEDY)
    ]
    assert [s.num_cached_tokens for s in together] == [40] * 6
    shared = engine.allocator.cache.by_hash[prompt_hashes(engine.allocator.cache.seed, BASE, 8)[0]]
    assert engine.allocator.ref_counts[shared] == 0  # all gone: parked, still cached
    assert_no_leaks(engine)


def test_a_request_aborted_mid_prefill_publishes_only_its_complete_blocks(tiny_llama_dir):
    # 1. chunks of 12 tokens over blocks of 8: after one step block 0 is complete and
    #    block 1 half written
    engine = make_engine(tiny_llama_dir, block_size=BLOCK, prefill_chunk_size=12)
    engine.add_request("r", BASE, GREEDY)
    engine.step()
    cache = engine.allocator.cache
    assert engine.sequences["r"].num_computed_tokens == 12
    assert len(cache.entries) == 1
    # 2. aborted: the half-written block is freed, never published
    engine.abort("r")
    assert len(cache.entries) == 1 and len(cache.evictable) == 1
    assert_no_leaks(engine)
    # 3. the same prompt again reuses block 0 only, and decodes what transformers does
    ours, cached = run_alone(engine, BASE)
    assert cached == 8
    assert ours == hf_greedy(tiny_llama_dir, BASE, 10)[0]
    assert_no_leaks(engine)


def test_eviction_under_pool_pressure_reuses_only_unreferenced_blocks(tiny_llama_dir):
    # 14 blocks: one 48-token prompt plus its 10 outputs needs 8; distinct prefixes
    # evict each other, shared ones are never handed out while referenced.
    engine = make_engine(tiny_llama_dir, block_size=BLOCK, num_kv_blocks=14)
    plain = make_engine(tiny_llama_dir, block_size=BLOCK, prefix_caching=False)
    prompts = [[*tokens_of(40, salt=s), s + 3] for s in (1, 2, 3, 1, 2, 1, 4, 1)]

    ours = [run_alone(engine, p)[0] for p in prompts]
    together = engine.generate(prompts[:3], GREEDY)

    assert ours == [run_alone(plain, p)[0] for p in prompts]
    assert [s.output_token_ids for s in together] == ours[:3]
    assert engine.allocator.cache.evictions > 0
    assert_no_leaks(engine)


def test_preemption_with_shared_blocks_recomputes_to_the_same_output(tiny_llama_dir):
    tight = make_engine(tiny_llama_dir, block_size=BLOCK, num_kv_blocks=14)
    plain = make_engine(tiny_llama_dir, block_size=BLOCK, prefix_caching=False)
    prompts = [BASE[:32] + tokens_of(4 + i, salt=i) for i in range(5)]

    actual = [s.output_token_ids for s in tight.generate(prompts, GREEDY)]

    assert tight.scheduler.num_preemptions > 0
    assert actual == [s.output_token_ids for s in plain.generate(prompts, GREEDY)]
    assert_no_leaks(tight)


def test_an_import_takes_its_cached_blocks_and_recomputes_only_the_rest(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, block_size=BLOCK)
    expected = run_alone(make_engine(tiny_llama_dir, block_size=BLOCK), [*BASE, 5, 6])[0]
    engine.generate([BASE[:40]], GREEDY)  # the decode side already holds 5 blocks
    # 1. the import of a 50-token prompt: 5 blocks hit, 2 to be written by the transfer
    seq = engine.begin_import("r", [*BASE, 5, 6], [expected[0]], GREEDY, 50)
    assert engine.reserve_imports() == [seq]
    assert seq.num_cached_tokens == 40 and len(seq.block_ids) == 7
    assert all(engine.allocator.cache.is_cached(b) for b in seq.block_ids[:5])
    # 2. the transfer fails: only tokens 40.. are computed here, and decoding is exact
    assert engine.finish_import("r", ok=False, recompute=True)
    assert seq.num_computed_tokens == 40
    while engine.has_unfinished():
        engine.step()
    assert seq.output_token_ids == expected
    assert_no_leaks(engine)


def test_block_names_depend_on_the_model_and_dtype_and_collisions_are_refused():
    tokens = tokens_of(20)
    seed = hash_seed("m", "float32", 8)
    assert prompt_hashes(seed, tokens, 8) == prompt_hashes(seed, list(tokens), 8)
    assert len(prompt_hashes(seed, tokens, 8)) == 2  # full blocks only
    assert seed != hash_seed("m", "bfloat16", 8) != hash_seed("n", "float32", 8)
    assert prompt_hashes(seed, tokens, 8) != prompt_hashes(hash_seed("n", "float32", 8), tokens, 8)
    # a block published under this prompt's first hash but holding other tokens
    cache = PrefixCache(seed, 8)
    first = prompt_hashes(seed, tokens, 8)[0]
    cache.publish(3, first, seed, tuple(tokens_of(8, salt=9)))
    assert cache.match([], lambda a, b: tokens[a:b], 2) == []


def test_hashes_are_computed_only_with_caching_on(tiny_llama_dir):
    plain = make_engine(tiny_llama_dir, block_size=BLOCK, prefix_caching=False)
    seq = plain.generate([BASE], GREEDY)[0]
    assert seq.block_hashes == [] and seq.num_cached_tokens == 0
    assert plain.cache_report() is None
    cached = make_engine(tiny_llama_dir, block_size=BLOCK)
    seq = cached.generate([BASE], GREEDY)[0]
    report = cached.cache_report()
    assert seq.block_hashes[:6] == prompt_hashes(report.seed, BASE, BLOCK)
    assert set(prompt_hashes(report.seed, BASE, BLOCK)) <= set(report.hashes)
    assert report.queried_tokens == 48 and report.hit_tokens == 0

"""What prefix caching costs when nothing is shared: unique random prompts through two
engines of the same model in one process, one with the cache and one without, run in
alternation (A B B A ...) so that a noisy machine slows both alike; plus the hashing
itself, timed alone.

    .venv/bin/python -m bench.prefix_overhead --rounds 8 --prompts 8 --prompt-len 256

Prints the median ratio of cached to plain wall time per round (1.00 = no cost), the
median of each, and the chain hash's cost per 1,000 prompt tokens next to the measured
prefill time of 1,000 tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.prefix_cache import hash_seed, prompt_hashes
from engine.sampling_params import SamplingParams


def _prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


def _timed_run(engine: LLMEngine, prompts, params) -> float:
    start = time.perf_counter()
    engine.generate(prompts, params)
    return time.perf_counter() - start


def _hash_cost_per_1k(tokens: int = 1024, repeats: int = 2000) -> float:
    ids = list(range(1000, 1000 + tokens))
    seed = hash_seed("bench", "float32", 16)
    start = time.perf_counter()
    for _ in range(repeats):
        prompt_hashes(seed, ids, 16)
    return (time.perf_counter() - start) / repeats * 1000 / tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--rounds", type=int, default=8, help="A/B pairs")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per run (one batch)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--plain-first",
        action="store_true",
        help="build the plain engine first (a process's first and second engine can differ "
        "by a percent or two on their own: run both orders)",
    )
    args = parser.parse_args(argv)
    settings = dict(model=args.model, num_kv_blocks=512, num_threads=args.threads)
    order = (False, True) if args.plain_first else (True, False)
    built = {on: LLMEngine(EngineConfig(**settings, prefix_caching=on)) for on in order}
    engines = {"cached": built[True], "plain": built[False]}
    vocab = engines["plain"].spec.vocab_size
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    for engine in engines.values():  # warm-up: kernels compiled, thread choice settled
        _timed_run(engine, _prompts(rng, 2, args.prompt_len, vocab), params)
    times: dict[str, list[float]] = {"cached": [], "plain": []}
    for round_ in range(args.rounds):
        order = ("cached", "plain") if round_ % 2 == 0 else ("plain", "cached")
        for name in order:
            prompts = _prompts(rng, args.prompts, args.prompt_len, vocab)  # never repeated
            times[name].append(_timed_run(engines[name], prompts, params))
    ratios = [c / p for c, p in zip(times["cached"], times["plain"], strict=True)]
    cache = engines["cached"].allocator.cache
    print(
        f"{args.rounds} rounds x {args.prompts} unique prompts x {args.prompt_len} tokens, "
        f"{args.output_len} out, {args.threads} thread(s), "
        f"{'plain' if args.plain_first else 'cached'} engine built first"
    )
    print(f"  plain  median {statistics.median(times['plain']):.3f} s  {times['plain']}")
    print(f"  cached median {statistics.median(times['cached']):.3f} s  {times['cached']}")
    print(f"  cached / plain per round: median {statistics.median(ratios):.4f}, {ratios}")
    print(f"  cache hits: {cache.hit_tokens} of {cache.queried_tokens} tokens looked up")
    per_1k = _hash_cost_per_1k()
    print(f"  chain hash: {per_1k * 1e6:.1f} us per 1,000 prompt tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Grammar engines compared on this CPU: what a structured-output request costs.

For each engine (llguidance, xgrammar) and each grammar (a JSON schema, a regex), one
request is walked through a fixed valid answer token by token, as the sampler does
it: fill the next-token bitmask, apply it to a [1, vocab] logits row, accept the
token. Reported: tokenizer set-up (once per engine process), grammar compile (once
per request), and the median per-step cost of mask fill and mask apply (every
step of every constrained row). pdserve uses llguidance (engine/structured.py);
this is the measurement behind that choice (docs/benchmarks.md). xgrammar is not a
dependency: install it to compare (`.venv/bin/pip install xgrammar`).

    .venv/bin/python -m bench.structured_bench [--model demo] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.hardware import cpu_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "Berlin", "Tokyo"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
ANSWER = '{"name": "Ada Lovelace", "age": 36, "city": "Paris", "tags": ["math", "engines"]}'
REGEX = r"\d{3}-[a-z]{4}-[A-Z][a-z]+"
REGEX_ANSWER = "123-abcd-Hello"


class _Llguidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab: int):
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab)
        self.words = (vocab + 31) // 32

    def compile(self, kind: str, spec: str):
        matcher_cls = self.ll.LLMatcher
        grammar = (
            matcher_cls.grammar_from_json_schema(spec)
            if kind == "json"
            else matcher_cls.grammar_from_regex(spec)
        )
        return matcher_cls(self.tokenizer, grammar)

    def new_bitmask(self) -> torch.Tensor:
        return torch.full((1, self.words), -1, dtype=torch.int32)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        row = bitmask[0]
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        from engine.structured import apply_bitmask

        apply_bitmask(logits, bitmask)

    def accept(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab: int):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.vocab = vocab

    def compile(self, kind: str, spec: str):
        compiled = (
            self.compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "json"
            else self.compiler.compile_regex(spec)
        )
        return self.xgr.GrammarMatcher(compiled)

    def new_bitmask(self) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(1, self.vocab)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)


def _walk(engine, kind: str, spec: str, tokens: list[int], vocab: int) -> dict:
    start = time.perf_counter()
    matcher = engine.compile(kind, spec)
    compile_s = time.perf_counter() - start
    bitmask, fills, applies = engine.new_bitmask(), [], []
    logits = torch.zeros(1, vocab)
    for token in tokens:
        start = time.perf_counter()
        engine.fill(matcher, bitmask)
        fills.append(time.perf_counter() - start)
        logits.zero_()
        start = time.perf_counter()
        engine.apply(logits, bitmask)
        applies.append(time.perf_counter() - start)
        assert logits[0, token] == 0, f"{engine.name} masked a valid token"
        engine.accept(matcher, token)
    return {"compile_s": compile_s, "fill_s": fills, "apply_s": applies}


def measure(model: str = "demo", repeats: int = 5) -> list[dict]:
    from engine.demo_model import resolve_model
    from engine.model_spec import load_model_spec
    from engine.tokenizer import Tokenizer

    model_dir, model_id = resolve_model(model)
    tokenizer = Tokenizer(model_dir)
    vocab = load_model_spec(model_dir, model_id).vocab_size
    cases = [
        ("json", json.dumps(SCHEMA), tokenizer.hf.encode(ANSWER, add_special_tokens=False)),
        ("regex", REGEX, tokenizer.hf.encode(REGEX_ANSWER, add_special_tokens=False)),
    ]
    rows = []
    for engine_cls in (_Llguidance, _Xgrammar):
        start = time.perf_counter()
        try:
            engine = engine_cls(tokenizer.hf, vocab)
        except ImportError:
            print(f"{engine_cls.name}: not installed (pip install {engine_cls.name}), skipped")
            continue
        setup_s = time.perf_counter() - start
        for kind, spec, tokens in cases:
            runs = [_walk(engine, kind, spec, tokens, vocab) for _ in range(repeats)]
            fills = [s for run in runs for s in run["fill_s"]]
            applies = [s for run in runs for s in run["apply_s"]]
            rows.append(
                {
                    "engine": engine.name,
                    "grammar": kind,
                    "tokens": len(tokens),
                    "setup_ms": setup_s * 1e3,
                    "compile_ms": statistics.median(r["compile_s"] for r in runs) * 1e3,
                    "fill_us": statistics.median(fills) * 1e6,
                    "fill_p90_us": sorted(fills)[int(0.9 * (len(fills) - 1))] * 1e6,
                    "apply_us": statistics.median(applies) * 1e6,
                }
            )
    return rows


def engine_steps(model: str, batch: int, tokens: int) -> dict:
    """Median decode step, and median time in the sampler within it, of `batch` sampled
    rows, every row constrained by a regex grammar or none, in one engine; two rounds
    interleaved (the mask's cost in a real step; the step itself is noisier than it)."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams, StructuredSpec

    engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=512))
    prompt = engine.tokenizer.encode("Write a long sentence about the sea:")
    spec = StructuredSpec("regex", f"[a-z ]{{{4 * tokens}}}")
    sampler_s: list[float] = []
    run = engine.sampler.run

    def timed_run(*args, **kwargs):
        start = time.perf_counter()
        result = run(*args, **kwargs)
        sampler_s.append(time.perf_counter() - start)
        return result

    engine.sampler.run = timed_run
    steps: dict[str, list[float]] = {"plain": [], "grammar": []}
    in_sampler: dict[str, list[float]] = {"plain": [], "grammar": []}
    for round_ in range(2):
        for name, structured in (("plain", None), ("grammar", spec)):
            params = SamplingParams(
                max_tokens=tokens, temperature=1.0, seed=1, ignore_eos=True, structured=structured
            )
            for i in range(batch):
                engine.add_request(f"{name}-{round_}-{i}", prompt, params)
            sampler_s.clear()
            while engine.has_unfinished():
                start = time.perf_counter()
                engine.step()
                steps[name].append(time.perf_counter() - start)
            in_sampler[name] += sampler_s[2:]  # past the prefill steps
    return {
        name: (statistics.median(steps[name]) * 1e3, statistics.median(in_sampler[name]) * 1e3)
        for name in steps
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", help="model whose tokenizer is used")
    parser.add_argument("--repeats", type=int, default=5, help="walks per engine and grammar")
    parser.add_argument("--batch", type=int, default=8, help="rows of the engine-step check")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per row in that check")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import os

    print(f"CPU: {cpu_model()}  load average: {os.getloadavg()[0]:.2f}  threads: 1")
    header = "engine       grammar tokens  setup ms  compile ms  fill us (p50/p90)  apply us"
    print(header)
    for r in measure(args.model, args.repeats):
        print(
            f"{r['engine']:<12} {r['grammar']:<7} {r['tokens']:>6} {r['setup_ms']:>9.0f} "
            f"{r['compile_ms']:>11.2f} {r['fill_us']:>9.0f} / {r['fill_p90_us']:<7.0f} "
            f"{r['apply_us']:>8.0f}"
        )
    steps = engine_steps(args.model, args.batch, args.tokens)
    for name, (step_ms, sampler_ms) in steps.items():
        print(
            f"engine step, {args.batch} sampled rows, {name:<7}: {step_ms:6.1f} ms median, "
            f"{sampler_ms:.2f} ms of it in the sampler"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

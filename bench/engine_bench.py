"""`pdserve bench engine`: our engine next to transformers on the same model, same run.

What it measures, per the benchmark method in docs/benchmarks.md:
  * decode step time and tokens/s at several batch sizes (steady state after prefill),
  * prefill tokens/s,
  * transformers `generate` at batch 1 and batched, and transformers continuous
    batching (`generate_batch`) with the same requests,
  * the batch-1 step time against a memory roofline: weight bytes per step divided
    by the copy bandwidth measured in this run.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from bench.timing import best_of, copy_bandwidth
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


@dataclass
class EngineBenchResult:
    model: str
    dtype: str
    threads: int
    prompt_len: int
    decode_steps: int
    copy_bandwidth_gbps: float
    weight_bytes: int
    roofline_step_ms: float
    ours_step_ms: dict[int, float] = field(default_factory=dict)
    ours_prefill_tok_s: float = 0.0
    hf_step_ms_batch1: float | None = None
    hf_tok_s_batched: dict[int, float] = field(default_factory=dict)
    hf_cb_tok_s: dict[int, float] = field(default_factory=dict)

    def ours_tok_s(self, batch: int) -> float:
        return batch * 1000.0 / self.ours_step_ms[batch]


def _prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(100, vocab - 100, (batch, prompt_len), generator=generator).tolist()


def _decode_step_ms(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> float:
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(_prompts(batch, prompt_len, engine.spec.vocab_size)):
        engine.add_request(f"bench-{batch}-{i}", prompt, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.sequences.values()):
        engine.step()
    start = time.perf_counter()
    count = 0
    while engine.has_unfinished():
        engine.step()
        count += 1
    return (time.perf_counter() - start) * 1000.0 / max(count, 1)


def _prefill_tok_s(engine: LLMEngine, prompt_len: int) -> float:
    prompts = _prompts(8, prompt_len, engine.spec.vocab_size)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    return 8 * prompt_len / best_of(lambda: engine.generate(prompts, params), repeats=2)


def _hf_model(engine: LLMEngine):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        engine.model_dir, dtype=engine.config.torch_dtype
    ).eval()


def _hf_generate_seconds(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def run():
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )

    return best_of(run, repeats=2)


def _hf_step_ms_batch1(model, prompt: list[int], steps: int) -> float:
    """Decode step time of HF generate: (N+1 tokens) minus (1 token), divided by N."""
    long = _hf_generate_seconds(model, [prompt], steps + 1)
    short = _hf_generate_seconds(model, [prompt], 1)
    return (long - short) * 1000.0 / steps


def _hf_continuous_batching_tok_s(model, prompts: list[list[int]], new_tokens: int) -> float:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=0,
        num_blocks=512,
        block_size=16,
        max_batch_tokens=512,
    )
    with torch.inference_mode():
        model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        start = time.perf_counter()
        model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def run_engine_bench(args) -> int:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    max_batch = max(batch_sizes)
    blocks = max_batch * ((args.prompt_len + args.decode_steps + 16) // 16 + 1)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        num_kv_blocks=blocks,
        max_num_seqs=max_batch,
        max_batch_tokens=max(2048, args.prompt_len),
        prefill_chunk_size=max(512, args.prompt_len),
        num_threads=args.threads,
    )
    engine = LLMEngine(config)
    weight_bytes = sum(t.numel() * t.element_size() for t in _weight_tensors(engine))
    bandwidth = copy_bandwidth()
    result = EngineBenchResult(
        model=engine.model_id,
        dtype=config.resolved_dtype,
        threads=torch.get_num_threads(),
        prompt_len=args.prompt_len,
        decode_steps=args.decode_steps,
        copy_bandwidth_gbps=bandwidth / 1e9,
        weight_bytes=weight_bytes,
        roofline_step_ms=weight_bytes / bandwidth * 1000.0,
    )
    _decode_step_ms(engine, 1, 16, 4)  # warm-up: first calls pay for allocator and kernel setup
    for batch in tqdm(batch_sizes, desc="pdserve decode"):
        result.ours_step_ms[batch] = _decode_step_ms(
            engine, batch, args.prompt_len, args.decode_steps
        )
    result.ours_prefill_tok_s = _prefill_tok_s(engine, args.prompt_len)
    engine.allocator.assert_all_free()
    if not args.skip_transformers:
        _run_transformers(engine, result, args, batch_sizes)
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(asdict(result), handle, indent=2)
    return 0


def _run_transformers(engine, result: EngineBenchResult, args, batch_sizes) -> None:
    model = _hf_model(engine)
    vocab = engine.spec.vocab_size
    steps = args.decode_steps
    result.hf_step_ms_batch1 = _hf_step_ms_batch1(
        model, _prompts(1, args.prompt_len, vocab)[0], steps
    )
    for batch in tqdm([b for b in batch_sizes if 1 < b <= 16], desc="transformers"):
        prompts = _prompts(batch, args.prompt_len, vocab)
        result.hf_tok_s_batched[batch] = batch * steps / _hf_generate_seconds(model, prompts, steps)
        result.hf_cb_tok_s[batch] = _hf_continuous_batching_tok_s(model, prompts, steps)


def _weight_tensors(engine: LLMEngine):
    weights = engine.model.weights
    yield weights.embed if weights.lm_head is weights.embed else weights.lm_head
    yield weights.final_norm
    for layer in weights.layers:
        yield from (t for t in vars(layer).values() if isinstance(t, torch.Tensor))


def format_report(r: EngineBenchResult) -> str:
    lines = [
        f"model {r.model}  dtype {r.dtype}  threads {r.threads}  prompt {r.prompt_len}  "
        f"decode steps {r.decode_steps}",
        f"copy bandwidth {r.copy_bandwidth_gbps:.2f} GB/s; weights {r.weight_bytes / 1e6:.0f} MB "
        f"-> roofline step {r.roofline_step_ms:.1f} ms",
        "",
        f"{'batch':>5} {'step ms':>9} {'tok/s':>9} {'x batch1':>9} {'HF generate tok/s':>18} {'HF CB tok/s':>12}",
    ]
    base = r.ours_tok_s(min(r.ours_step_ms))
    for batch, step in sorted(r.ours_step_ms.items()):
        hf = r.hf_tok_s_batched.get(batch)
        if batch == 1 and r.hf_step_ms_batch1:
            hf = 1000.0 / r.hf_step_ms_batch1
        cb = r.hf_cb_tok_s.get(batch)
        lines.append(
            f"{batch:>5} {step:>9.1f} {r.ours_tok_s(batch):>9.1f} {r.ours_tok_s(batch) / base:>9.2f} "
            f"{_fmt(hf):>18} {_fmt(cb):>12}"
        )
    lines.append(f"prefill {r.ours_prefill_tok_s:.0f} tok/s (8 prompts x {r.prompt_len})")
    step1 = r.ours_step_ms.get(1)
    if step1:
        lines.append(f"batch-1 step / roofline = {step1 / r.roofline_step_ms:.2f}")
        if r.hf_step_ms_batch1:
            lines.append(
                f"batch-1 step / transformers step = {step1 / r.hf_step_ms_batch1:.2f} "
                f"(HF {r.hf_step_ms_batch1:.1f} ms)"
            )
    if 16 in r.ours_step_ms and 16 in r.hf_cb_tok_s:
        lines.append(
            f"16 seqs vs transformers continuous batching = {r.ours_tok_s(16) / r.hf_cb_tok_s[16]:.2f}x"
        )
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"

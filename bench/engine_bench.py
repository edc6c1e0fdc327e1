"""`pdserve bench engine`: our engine next to transformers on the same model, same run.

Two kinds of figure, never mixed in one column:

* steady-state decode: every prompt already prefilled, one step = one new token for
  each of `batch` sequences. Ours is the median step of a decode run; transformers'
  is the median of its one-token forward calls with its KV cache, after the prefill.
* end to end: the same `batch` prompts of `prompt_len` tokens prefilled and decoded
  to `decode_steps` new tokens, as transformers' batched `generate` and its continuous
  batching (`generate_batch`) measure it: our `generate`, their two, tokens/s.

Each decode step is set against the roofline of the same process's CPU, measured in
this run (`bench.roofline`; read bandwidth = a sum over 256 MiB, probed between every
two timed runs, each run judged at the better of the two probes around it: the step
of this shared machine moves by a third within minutes, so a bound probed once per
batch size could come from another minute than the step): the weights alone (bytes
streamed per step / read bandwidth: the batch-1 target, the median of the per-run
ratios) and the lower bound with the KV cache read too. Prefill is tokens/s of 8
prompts in one batch. The KV pool's pages are all mapped before anything is timed, as a
server maps them from its start. Every figure is a median of `--repeats` runs; the CPU
and the load average are printed.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from bench.hardware import ReadProbe, cpu_model, hardware_profile, read_bandwidth
from bench.model_shape import DTYPE_BYTES, streamed_weight_params
from bench.roofline import decode_step
from bench.timing import load_average, median_of
from engine.config import EngineConfig
from engine.engine_loop import PREFAULT_STEP_BYTES
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PREFILL_PROMPTS = 8


@dataclass
class EngineBenchResult:
    model: str
    dtype: str
    threads: int
    kernels: str
    prompt_len: int
    decode_steps: int
    repeats: int
    cpu: str
    read_bandwidth_gbps: float
    """Median over the batch-1 runs of the better of the probes around each."""
    weight_bytes: int
    weight_roofline_ms: float
    """Weights streamed per step / read bandwidth: the floor of a batch-1 step."""
    weight_roofline_ratio: float = 0.0
    """Median over the batch-1 runs of step / weight roofline at that run's bandwidth."""
    paired_roofline_ratio: float = 0.0
    """Median over every batch-1 step of a paired run of step / weight roofline at the read
    bandwidth probed right before and right after that step (`_paired_step_ratios`)."""
    paired_steps: int = 0
    load_before: float = 0.0
    load_after: float = 0.0
    ours_step_ms: dict[int, float] = field(default_factory=dict)
    roofline_step_ms: dict[int, float] = field(default_factory=dict)
    """Weights + KV read per step / read bandwidth (bench.roofline lower bound)."""
    ours_prefill_tok_s: float = 0.0
    ours_e2e_tok_s: dict[int, float] = field(default_factory=dict)
    hf_step_ms: dict[int, float] = field(default_factory=dict)
    hf_e2e_tok_s: dict[int, float] = field(default_factory=dict)
    hf_cb_tok_s: dict[int, float] = field(default_factory=dict)
    phase_ms: dict[int, dict[str, float]] = field(default_factory=dict)
    """With --phases, per batch size: ms per fused decode step in each phase (the phase
    clock of decode_step.c, over the timed runs)."""
    thread_choice: dict[str, dict[int, float]] = field(default_factory=dict)
    """Per kind of step and size bucket: moving-average ms per thread count (engine.threads)."""

    def ours_tok_s(self, batch: int) -> float:
        return batch * 1000.0 / self.ours_step_ms[batch]


_PROMPT_SEEDS = itertools.count()


def _prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """Fresh random prompts on every call (deterministic per run): a repeat must not hit
    the engine's prefix cache with the previous run's blocks."""
    generator = torch.Generator().manual_seed(next(_PROMPT_SEEDS))
    return torch.randint(100, vocab - 100, (batch, prompt_len), generator=generator).tolist()


def _greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def _prefilled(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> None:
    """Add `batch` prompts that decode `steps` tokens after the first, and prefill them."""
    for i, prompt in enumerate(_prompts(batch, prompt_len, engine.spec.vocab_size)):
        engine.add_request(f"bench-{batch}-{i}-{time.monotonic_ns()}", prompt, _greedy(steps + 1))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.sequences.values()):
        engine.step()


def _decode_step_ms(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> float:
    """Median decode step of `batch` sequences after their prompts are prefilled."""
    _prefilled(engine, batch, prompt_len, steps)
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[:-1] or times) * 1000.0  # the last step only finishes


PROBE_BYTES = 128 << 20
"""One read probe between two steps: 4x a 32 MiB last-level cache, about 4 ms here."""


def _paired_step_ratios(
    engine: LLMEngine, prompt_len: int, steps: int, weight_bytes: int
) -> list[float]:
    """Each batch-1 decode step / the weight roofline at the read bandwidth probed right
    before and right after it (the better of the two), one sum over `PROBE_BYTES` each.
    On a shared machine the bandwidth moves by a third within seconds, so a step and a
    probe taken a run apart can differ by that much; a step and its neighbours cannot.
    The probes evict nothing a step keeps: its 500 MB of weights stream through the
    caches anyway."""
    bandwidth = ReadProbe(PROBE_BYTES)
    _prefilled(engine, 1, prompt_len, steps)
    before, ratios = bandwidth(), []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        after = bandwidth()
        if engine.has_unfinished():  # the last step only finishes the request
            ratios.append(seconds * max(before, after) / weight_bytes)
        before = after
    return ratios


def _median_generate_s(engine: LLMEngine, batch: int, prompt_len: int, tokens: int, repeats):
    """Median seconds of `engine.generate` over fresh prompts each repeat."""
    times = []
    for _ in range(repeats):
        prompts = _prompts(batch, prompt_len, engine.spec.vocab_size)
        start = time.perf_counter()
        engine.generate(prompts, _greedy(tokens))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _prefill_tok_s(engine: LLMEngine, prompt_len: int, repeats: int) -> float:
    seconds = _median_generate_s(engine, PREFILL_PROMPTS, prompt_len, 1, repeats)
    return PREFILL_PROMPTS * prompt_len / seconds


def _e2e_tok_s(engine: LLMEngine, batch: int, prompt_len: int, steps: int, repeats) -> float:
    return batch * steps / _median_generate_s(engine, batch, prompt_len, steps, repeats)


def _engine(args, max_batch: int) -> LLMEngine:
    blocks = max_batch * ((args.prompt_len + args.decode_steps + 16) // 16 + 1)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        num_kv_blocks=blocks,
        max_num_seqs=max_batch,
        max_batch_tokens=max(2048, args.prompt_len * PREFILL_PROMPTS),
        prefill_chunk_size=max(512, args.prompt_len),
        num_threads=args.threads,
        kernels=args.kernels,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine = LLMEngine(config)
    engine.model.pin_threads = args.pin_threads
    return engine


def _map_pool(engine: LLMEngine) -> None:
    """Map every page of the KV pool before timing, as a server's warming thread does
    from its start (`EngineLoop._warm_pool`): otherwise the first write to each page
    falls in a timed step (~8 ms, in the first layer's KV store, of each 256-token
    prefill into blocks never used before)."""
    while engine.kv_pool.prefault(PREFAULT_STEP_BYTES):
        pass


def run_engine_bench(args) -> int:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.threads:  # transformers' runs and the bandwidth probe on the engine's count
        torch.set_num_threads(args.threads)
    load_before = load_average()
    if args.phases:  # read when the kernels are first built in this process
        os.environ["PDSERVE_KERNEL_PHASE_CLOCK"] = "1"
    engine = _engine(args, max(batch_sizes))
    _map_pool(engine)
    result = _new_result(engine, args, load_before)
    _decode_step_ms(engine, 1, 16, 4)  # warm-up: first calls pay for allocator and kernel setup
    for batch in tqdm(batch_sizes, desc="pdserve decode"):
        _decode_rows(engine, result, args, batch)
    result.ours_prefill_tok_s = _prefill_tok_s(engine, args.prompt_len, args.repeats)
    for batch in _e2e_batches(batch_sizes):
        result.ours_e2e_tok_s[batch] = _e2e_tok_s(
            engine, batch, args.prompt_len, args.decode_steps, args.repeats
        )
    engine.allocator.assert_all_free()
    result.thread_choice = _thread_choice(engine)
    if args.phases and not result.phase_ms:
        print("--phases: no phase clock here (the decode steps do not run the fused native step)")
    if not args.skip_transformers:
        _run_transformers(engine, result, args, batch_sizes)
    result.load_after = load_average()
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(asdict(result), handle, indent=2)
    return 0


def _decode_rows(engine: LLMEngine, result: EngineBenchResult, args, batch: int) -> None:
    """Median decode step of `batch` sequences, and its roofline at the read bandwidth
    probed between the runs: each run against the better of the probes just before and
    just after it (a bound taken at a busier moment than the step would flatter it)."""
    probes = [read_bandwidth()]
    runs = []
    clock = _phase_clock(engine) if args.phases else None
    for _ in range(args.repeats):
        runs.append(_decode_step_ms(engine, batch, args.prompt_len, args.decode_steps))
        probes.append(read_bandwidth())
    if clock is not None:
        result.phase_ms[batch] = _phase_ms(clock)
    around = [max(before, after) for before, after in itertools.pairwise(probes)]
    bandwidth = statistics.median(around)
    result.ours_step_ms[batch] = statistics.median(runs)
    hardware = dataclasses.replace(
        hardware_profile("cpu", dtypes=(result.dtype,), threads=args.threads),
        memory_bandwidth=bandwidth,
    )
    context = args.prompt_len + args.decode_steps // 2
    bound = decode_step(engine.spec, hardware, batch, context, result.dtype, engine.layout.dtype)
    result.roofline_step_ms[batch] = bound.lower_bound_s * 1000.0
    if batch == 1 or not result.read_bandwidth_gbps:
        result.read_bandwidth_gbps = bandwidth / 1e9
        result.weight_roofline_ms = result.weight_bytes / bandwidth * 1000.0
        result.weight_roofline_ratio = statistics.median(
            ms / (result.weight_bytes / bw * 1000.0) for ms, bw in zip(runs, around, strict=True)
        )
    if batch == 1:
        paired = [
            ratio
            for _ in range(args.repeats)
            for ratio in _paired_step_ratios(
                engine, args.prompt_len, args.decode_steps, result.weight_bytes
            )
        ]
        result.paired_roofline_ratio = statistics.median(paired)
        result.paired_steps = len(paired)


def _phase_clock(engine: LLMEngine):
    """The native kernels with their phase clock running, now reset; None where the
    engine's steps do not run the fused native step or the kernels lack the clock."""
    kernels = getattr(engine.model.ops, "kernels", None)
    if kernels is None or kernels.decode_phases() is None:
        return None
    return kernels


def _phase_ms(kernels) -> dict[str, float]:
    """ms per fused decode step in each phase since the clock was last read."""
    seconds, steps = kernels.decode_phases()
    return {phase: s * 1000.0 / max(steps, 1) for phase, s in seconds.items()}


def _new_result(engine: LLMEngine, args, load_before: float) -> EngineBenchResult:
    dtype = engine.config.resolved_dtype
    return EngineBenchResult(
        model=engine.model_id,
        dtype=dtype,
        threads=engine.num_threads,
        kernels=(
            f"{engine.model.ops.name} ops, {engine.model.attention.name} attention, "
            f"{engine.layout.dtype} KV"
        ),
        prompt_len=args.prompt_len,
        decode_steps=args.decode_steps,
        repeats=args.repeats,
        cpu=cpu_model(),
        read_bandwidth_gbps=0.0,
        weight_bytes=streamed_weight_params(engine.spec, tokens=1) * DTYPE_BYTES[dtype],
        weight_roofline_ms=0.0,
        load_before=load_before,
    )


def _thread_choice(engine: LLMEngine) -> dict[str, dict[int, float]]:
    choice = engine.model.thread_choice
    if choice is None:
        return {}
    named = {}
    for (decode_only, bucket), averages in sorted(choice.averages().items()):
        rows = f"{1 << (bucket - 1)}-{(1 << bucket) - 1}" if bucket > 1 else "1"
        kind = "decode" if decode_only else "prefill/mixed"
        named[f"{kind} {rows} rows"] = {n: s * 1000.0 for n, s in averages.items()}
    return named


def _e2e_batches(batch_sizes: list[int]) -> list[int]:
    """Batched end-to-end runs: transformers' generate pads and slows past 16."""
    return [b for b in batch_sizes if 1 < b <= 16]


def _hf_model(engine: LLMEngine):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        engine.model_dir, dtype=engine.config.torch_dtype
    ).eval()


def _hf_generate_seconds(model, prompts: list[list[int]], new_tokens: int, repeats) -> float:
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

    return median_of(run, repeats)


def _hf_step_ms(model, prompts: list[list[int]], steps: int, repeats: int) -> float:
    """Steady-state decode step of transformers, measured like ours: the batch prefilled
    with its KV cache, then the median of `steps` one-token forward calls (greedy)."""
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            out = model(torch.tensor(prompts), use_cache=True)
            for _ in range(steps):
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                start = time.perf_counter()
                out = model(token, past_key_values=out.past_key_values, use_cache=True)
                times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000.0


def _hf_continuous_batching_tok_s(model, prompts, new_tokens: int, repeats: int) -> float:
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

    def run():
        with torch.inference_mode():
            model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)

    run()  # warm-up: its first call builds the paged cache
    return len(prompts) * new_tokens / median_of(run, repeats)


def _run_transformers(engine, result: EngineBenchResult, args, batch_sizes) -> None:
    model = _hf_model(engine)
    vocab, steps, repeats = engine.spec.vocab_size, args.decode_steps, args.repeats
    for batch in tqdm([b for b in batch_sizes if b <= 16], desc="transformers"):
        prompts = _prompts(batch, args.prompt_len, vocab)
        result.hf_step_ms[batch] = _hf_step_ms(model, prompts, steps, repeats)
        if batch in _e2e_batches(batch_sizes):
            seconds = _hf_generate_seconds(model, prompts, steps, repeats)
            result.hf_e2e_tok_s[batch] = batch * steps / seconds
            result.hf_cb_tok_s[batch] = _hf_continuous_batching_tok_s(
                model, prompts, steps, repeats
            )


def format_report(r: EngineBenchResult) -> str:
    lines = [
        f"model {r.model}  dtype {r.dtype}  threads {r.threads}  kernels: {r.kernels}",
        f"CPU {r.cpu}; load average {r.load_before:.2f} before, {r.load_after:.2f} after; "
        f"medians of {r.repeats} runs",
        f"read bandwidth {r.read_bandwidth_gbps:.2f} GB/s (probed around each batch-1 run); weights "
        f"per step {r.weight_bytes / 1e6:.0f} MB -> weight roofline {r.weight_roofline_ms:.1f} ms",
        "",
        f"Steady-state decode (prompts of {r.prompt_len} prefilled; one step = one token per "
        "sequence; roofline = weights + KV read at the read bandwidth):",
        f"{'batch':>5} {'step ms':>8} {'tok/s':>8} {'x batch1':>8} {'roofline ms':>11} "
        f"{'/roofline':>9} {'HF step ms':>10} {'HF tok/s':>8} {'ours/HF':>7}",
    ]
    base = r.ours_tok_s(min(r.ours_step_ms))
    for batch, step in sorted(r.ours_step_ms.items()):
        hf = r.hf_step_ms.get(batch)
        lines.append(
            f"{batch:>5} {step:>8.1f} {r.ours_tok_s(batch):>8.1f} "
            f"{r.ours_tok_s(batch) / base:>8.2f} {r.roofline_step_ms[batch]:>11.1f} "
            f"{step / r.roofline_step_ms[batch]:>9.2f} {_fmt(hf):>10} "
            f"{_fmt(hf and batch * 1000.0 / hf):>8} {_fmt(hf and hf / step, 2):>7}"
        )
    lines += _e2e_lines(r)
    lines.append(
        f"Prefill: {r.ours_prefill_tok_s:.0f} tok/s ({PREFILL_PROMPTS} prompts x {r.prompt_len})"
    )
    if 1 in r.ours_step_ms:
        stream = r.weight_bytes / r.ours_step_ms[1] / 1e6
        ratio = r.weight_roofline_ratio or r.ours_step_ms[1] / r.weight_roofline_ms
        lines.append(
            f"batch-1 step / weight roofline = {ratio:.2f}, the median of each run against "
            f"the bandwidth probed around it (weights streamed at {stream:.1f} GB/s, read "
            f"bandwidth {r.read_bandwidth_gbps:.1f})"
        )
        if r.paired_steps:
            lines.append(
                f"batch-1 step / weight roofline = {r.paired_roofline_ratio:.2f} step by step: "
                f"the median of {r.paired_steps} steps, each against a read probe taken "
                "right before and right after it"
            )
    lines += _phase_lines(r)
    if r.thread_choice:
        lines.append("Thread choice (moving average per thread count; the faster one runs):")
        for name, averages in r.thread_choice.items():
            shown = ", ".join(f"{n} thr {ms:.1f} ms" for n, ms in sorted(averages.items()))
            lines.append(f"  {name}: {shown}")
    return "\n".join(lines)


def _phase_lines(r: EngineBenchResult) -> list[str]:
    """The --phases table: ms per decode step in each phase, a column per batch size,
    then their sum against the step timed around the whole call (the rest is Python)."""
    if not r.phase_ms:
        return []
    batches = sorted(r.phase_ms)
    phases = list(r.phase_ms[batches[0]])
    lines = [
        "",
        "Where a decode step goes (mean ms per step, timed inside the fused native step; "
        "% of the step):",
        f"{'phase':>12} " + " ".join(f"{f'batch {b}':>16}" for b in batches),
    ]
    for phase in phases:
        cells = [
            f"{r.phase_ms[b][phase]:.2f} ({100 * r.phase_ms[b][phase] / r.ours_step_ms[b]:.1f}%)"
            for b in batches
        ]
        lines.append(f"{phase:>12} " + " ".join(f"{c:>16}" for c in cells))
    sums = [sum(r.phase_ms[b].values()) for b in batches]
    lines.append(f"{'sum':>12} " + " ".join(f"{s:>16.2f}" for s in sums))
    lines.append(f"{'step':>12} " + " ".join(f"{r.ours_step_ms[b]:>16.2f}" for b in batches))
    return lines


def _e2e_lines(r: EngineBenchResult) -> list[str]:
    if not r.ours_e2e_tok_s:
        return []
    lines = [
        "",
        f"End to end (batch prompts of {r.prompt_len} -> {r.decode_steps} new tokens, "
        "prefill included), tok/s:",
        f"{'batch':>5} {'ours':>8} {'HF generate':>11} {'HF cont. batching':>17} "
        f"{'ours/HF gen':>11} {'ours/HF CB':>10}",
    ]
    for batch, ours in sorted(r.ours_e2e_tok_s.items()):
        hf, cb = r.hf_e2e_tok_s.get(batch), r.hf_cb_tok_s.get(batch)
        lines.append(
            f"{batch:>5} {ours:>8.1f} {_fmt(hf):>11} {_fmt(cb):>17} "
            f"{_fmt(hf and ours / hf, 2):>11} {_fmt(cb and ours / cb, 2):>10}"
        )
    return [*lines, ""]


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"

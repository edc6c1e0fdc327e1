"""`pdserve bench bandwidth --kv-modes ...`: TTFT and ITL against the KV link's cap, for
whole-prompt vs chunk-streamed KV, pulled vs pushed, at several prompt lengths.

For each cap a fresh 1 + 1 cluster starts in this process (its driver), its `shm` link
shaped to the cap (kv_transfer/shaping.py), with `first_token_from: decode`, so that a
request's first token waits for its KV and TTFT shows what the link costs; prefix
caching is off, so every request computes and moves its whole prompt. For each prompt
length and mode (how the KV moves: `RequestFlow.kv_stream`, switched between requests
on the same workers), `--requests` requests run one at a time after one warm-up: no
queue, TTFT = prefill + the transfer's exposed part + the decode worker's first step.

Beside each measured TTFT it puts the expected one (bench/kv_stream_model.py): the
prefill time measured on this cluster, the KV bytes over the cap, and the overheads
measured on the uncapped whole-prompt run, whole vs pipelined; and the receipts'
hidden and exposed transfer time. The plot has a panel per prompt length with the
modes as lines; `--gpu-plot` draws the same curves for GPU clusters from the roofline
and kv-calc, a model, not a measurement.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench.kv_stream_model import expected_ttft
from bench.stats import percentile
from worker.messages import KVStream

KV_MODES: dict[str, tuple[KVStream, bool]] = {
    "whole-pull": (KVStream.WHOLE, False),
    "chunk-pull": (KVStream.PULL, True),
    "whole-push": (KVStream.PUSH, False),
    "chunk-push": (KVStream.PUSH, True),
}
"""Mode name -> (how the KV moves, a segment per prefill chunk)."""
OUTPUT_TOKENS = 8


@dataclass(frozen=True)
class SweepSpec:
    model: str
    dtype: str
    caps: list[float | None]
    """Link caps in bytes/s (None: unshaped)."""
    modes: list[str]
    prompts: list[int]
    requests: int
    long_caps: list[float | None] | None = None
    """The caps prompts over `LONG_PROMPT` tokens run at (None: all): on a small CPU
    such a prompt prefills for tens of seconds."""


LONG_PROMPT = 1024


def caps_for(prompt: int, spec: SweepSpec) -> list[float | None]:
    if prompt <= LONG_PROMPT or spec.long_caps is None:
        return spec.caps
    return [c for c in spec.caps if c in spec.long_caps]


def parse_caps(text: str) -> list[float | None]:
    """'12.5,125,none' (MB/s) -> bytes/s, None for unshaped."""
    return [None if c.strip() in ("none", "inf") else float(c) * 1e6 for c in text.split(",")]


def cluster_config(spec: SweepSpec, cap: float | None):
    from cluster.config import ClusterConfig

    transport: dict = {"name": "shm"}
    if cap is not None:
        transport["bandwidth_bytes_per_s"] = cap
    return ClusterConfig.from_dict(
        {
            "model": spec.model,
            "dtype": spec.dtype,
            "transport": transport,
            "first_token_from": "decode",
            "kv_streaming": "chunk",
            "prefix_caching": False,
        }
    )


async def run_cap(spec: SweepSpec, cap: float | None, prompt_ids) -> list[dict]:
    """One cluster at `cap`: every (prompt length, mode) of the spec that runs at it."""
    from cluster.flow.cluster import PDCluster
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    cluster = await PDCluster(cluster_config(spec, cap)).start()
    closed: list = []
    cluster.on_finish.append(closed.append)
    rows = []
    try:
        await _generate(cluster, prompt_ids(min(spec.prompts), -1), params)  # warm-up
        for prompt in [p for p in spec.prompts if cap in caps_for(p, spec)]:
            for mode in spec.modes:
                cluster.flow.delivery.kv_stream, cluster.flow.delivery.per_chunk = KV_MODES[mode]
                samples = []
                for index in range(spec.requests):
                    closed.clear()
                    await _generate(cluster, prompt_ids(prompt, index), params)
                    samples.append(_sample(closed[0].timeline))
                rows.append(_point(cap, prompt, mode, samples, cluster.config.prefill_chunk_size))
                print(_line(rows[-1]), flush=True)
    finally:
        await cluster.shutdown()
    return rows


async def _generate(cluster, prompt: list[int], params) -> None:
    async for _ in cluster.generate(prompt, params, f"sweep-{uuid.uuid4().hex[:12]}"):
        pass


def _sample(timeline) -> dict:
    b = timeline.breakdown()
    gaps = timeline.inter_token_latencies()
    return {
        "ttft_s": b["ttft_s"],
        "itl_s": statistics.median(gaps) if gaps else None,
        "prefill_s": b["prefill_s"],
        "kv_transfer_s": b["kv_transfer_s"],
        "hidden_s": b["kv_transfer_hidden_s"],
        "exposed_s": b["kv_transfer_exposed_s"],
        "kv_bytes": b["kv_bytes"],
        "segments": b["kv_stream_segments"],
        "ok": bool(timeline.transfer_ok) and not timeline.recoveries,
    }


def _point(cap, prompt: int, mode: str, samples: list[dict], chunk: int) -> dict:
    def values(key):
        return [s[key] for s in samples if s[key] is not None]

    ttft, itl = values("ttft_s"), values("itl_s")
    return {
        "bandwidth_mb_s": None if cap is None else cap / 1e6,
        "prompt": prompt,
        "mode": mode,
        "chunk": chunk,
        "requests": len(samples),
        "all_ok": all(s["ok"] for s in samples),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        **{f"{key}_mean": _mean(values(key)) for key in ("prefill_s", "kv_transfer_s")},
        **{f"{key}_mean": _mean(values(key)) for key in ("hidden_s", "exposed_s", "kv_bytes")},
        "segments": max(values("segments"), default=0),
    }


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def add_expected(rows: list[dict]) -> None:
    """Put the expected TTFT beside each measured point (bench/kv_stream_model.py): the
    KV bytes over the cap (unshaped: at the bandwidth the unshaped whole-prompt run
    measured), plus the overheads that run measured (its TTFT less its prefill and
    transfer). `expected_s` takes the point's own prefill time (a busy machine's
    prefill varies from run to run: the model is tested against what the point ran),
    `expected_whole_s` / `expected_streamed_s` the prompt's mean one (the curves)."""
    for prompt in {r["prompt"] for r in rows}:
        mine = [r for r in rows if r["prompt"] == prompt]
        whole = [r for r in mine if r["mode"] == "whole-pull"] or mine
        compute = _mean([r["prefill_s_mean"] for r in mine if r["prefill_s_mean"]])
        kv_bytes = _mean([r["kv_bytes_mean"] for r in mine if r["kv_bytes_mean"]])
        free = [r for r in whole if r["bandwidth_mb_s"] is None]
        if compute is None or not kv_bytes or not free:
            continue
        unshaped = free[0]["kv_transfer_s_mean"] or 1e-9
        base = free[0]["ttft_p50_s"] - free[0]["prefill_s_mean"] - unshaped
        for row in mine:
            cap = row["bandwidth_mb_s"]
            bandwidth = kv_bytes / unshaped if cap is None else cap * 1e6
            curve = expected_ttft(prompt, row["chunk"], compute, kv_bytes, bandwidth, base)
            row["expected_whole_s"] = curve.whole_s
            row["expected_streamed_s"] = curve.streamed_s
            own = expected_ttft(
                prompt, row["chunk"], row["prefill_s_mean"], kv_bytes, bandwidth, base
            )
            streamed = row["mode"].startswith("chunk")
            row["expected_s"] = own.streamed_s if streamed else own.whole_s


def format_rows(rows: list[dict]) -> str:
    lines = [
        f"{'prompt':>6} {'mode':<11}{'MB/s':>9}{'TTFT p50':>9}{'p99':>7}{'expect':>7}"
        f"{'ITL p50':>8}{'prefill':>8}{'xfer':>7}{'hidden':>7}{'exposed':>8}{'segs':>5}  (ms)"
    ]
    for r in rows:
        lines.append(_line(r))
    return "\n".join(lines)


def _line(r: dict) -> str:
    from bench.report import ms

    cap = "unshaped" if r["bandwidth_mb_s"] is None else f"{r['bandwidth_mb_s']:.1f}"
    flag = "" if r["all_ok"] else "  (a request recovered: see JSON)"
    return (
        f"{r['prompt']:>6} {r['mode']:<11}{cap:>9}{ms(r['ttft_p50_s']):>9}"
        f"{ms(r['ttft_p99_s']):>7}{ms(r.get('expected_s')):>7}{ms(r['itl_p50_s']):>8}"
        f"{ms(r['prefill_s_mean']):>8}{ms(r['kv_transfer_s_mean']):>7}"
        f"{ms(r['hidden_s_mean']):>7}{ms(r['exposed_s_mean']):>8}{r['segments']:>5}{flag}"
    )


def run_stream_sweep(args) -> int:
    """`pdserve bench bandwidth --kv-modes ...` (bench/bandwidth_sweep.py hands over)."""
    from bench.hardware import cpu_identity
    from bench.prompt_text import PromptMaker
    from bench.report import source_commit
    from engine.demo_model import resolve_model

    directory, _ = resolve_model(args.model)
    maker = PromptMaker.from_arg(str(directory))
    modes = [m.strip() for m in args.kv_modes.split(",")]
    unknown = [m for m in modes if m not in KV_MODES]
    if unknown:
        raise SystemExit(f"--kv-modes takes {', '.join(KV_MODES)} (comma list), not {unknown}")
    spec = SweepSpec(
        model=args.model,
        dtype=args.dtype,
        caps=parse_caps(args.mbps),
        modes=modes,
        prompts=[int(p) for p in args.prompt_lens.split(",")],
        requests=args.requests,
        long_caps=parse_caps(args.long_mbps) if args.long_mbps else None,
    )

    vocab = maker.vocab_size

    def prompt_ids(length: int, index: int) -> list[int]:
        rng = random.Random(args.seed * 7919 + length * 31 + index)
        return [rng.randrange(100, vocab - 100) for _ in range(length)]

    started = time.monotonic()
    rows: list[dict] = []
    for cap in spec.caps:
        rows += asyncio.run(run_cap(spec, cap, prompt_ids))
    add_expected(rows)
    print(format_rows(rows))
    print(f"sweep took {time.monotonic() - started:.0f} s")
    result = {
        "rows": rows,
        "machine": cpu_identity(),
        "commit": source_commit(),
        "spec": {**spec.__dict__},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        from bench.kv_stream_plot import plot_measured

        plot_measured(rows, args.plot)
    if args.gpu_plot:
        from bench.kv_stream_plot import plot_gpu_projection

        plot_gpu_projection(spec.prompts, args.gpu_plot)
    return 0

"""`pdserve drill --duration D --every E`: a steady load for D with a kill every E, and
the checks a long run needs beyond "nothing lost".

A soak's life: an open-loop load at `--rate` requests/s (capped at `--concurrency` in
flight) cycles through the drill's prompts for D seconds while the kill schedule
strikes; every 2 s the resident memory of the frontend and of every routed worker
process (a spare from its promotion on) is sampled (every fifth sample goes into the
JSON report). A process's RSS is judged without its KV pool and its shared memory:
the pool is sized at start and filled in by the kernel on first touch, and with prefix
caching new blocks keep coming from untouched pages until the pool has been used once
over, which at a soak's rate takes longer than the soak. The pool's resident bytes
come from the worker (`mincore`, in `/admin/workers`) when it is private memory, and
from `RssShmem` (with Ray's object store) when it lives in /dev/shm for the shm
transport. A leak shows in what is left (`RssAnon + RssFile` less the private pool).
At the end (besides the drill's own verdict):
  * throughput: output tokens per window; the level before the first kill is the
    baseline, and after each kill a window must reach 80% of it before the next kill;
  * memory: no process's RSS (less its KV pool and shared memory) may grow by more
    than max(64 MiB, 10%) from the end of its warm-up (`_RSS_WARMUP_S`, a quarter of shorter soaks) to its last sample
    (workers restart, so each process is judged on its own life, if sampled for twice
    the warm-up); the pool and shared part is reported beside it;
  * a PNG of throughput and TTFT over time with every kill marked.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp

from bench.loadgen import LoadSpec, RequestRecord, stream_completion

_RSS_EVERY_S = 2.0
_BACK_TO = 0.8
"""Share of the pre-kill throughput a window after a kill must reach."""
_RSS_SLACK = (64 << 20, 0.10)
_RSS_WARMUP_S = 120.0


async def run_soak(admin, spec: LoadSpec, args, kills, watchers):
    from bench.drill import kill_schedule, kill_times, parse_duration

    duration = parse_duration(args.duration)
    rate = args.rate or _default_rate(args)
    start = time.perf_counter()
    rss: dict[int, list[tuple[float, int, int]]] = {}
    killer = asyncio.create_task(
        kill_schedule(admin, args, kill_times(args), start, kills, watchers)
    )
    sampler = asyncio.create_task(_sample_rss(admin, rss, start))
    try:
        records = await _open_loop(spec, rate, duration, start)
        await killer
    finally:
        sampler.cancel()
    window = max(2.0, args.every / 6)
    throughput = _windows(records, start, window, duration)
    summary = {
        "duration_s": duration,
        "rate_per_s": rate,
        "window_s": window,
        **_throughput_back(throughput, window, [k for k in kills if k.hit], args.every),
        **_rss_growth(rss, min(_RSS_WARMUP_S, duration / 4)),
    }
    summary["plot"] = _plot(args.plot, records, throughput, window, kills, start)
    summary["passed"] = summary["throughput_back"] and summary["rss_flat"]
    return records, summary


def _default_rate(args) -> float:
    # About what `concurrency` streams of `max_tokens` finish per second at ~20 tok/s
    # each: enough to keep every worker busy without an ever-growing queue.
    return max(0.2, args.concurrency * 20.0 / max(args.max_tokens, 1) * 0.5)


async def _open_loop(spec: LoadSpec, rate: float, duration: float, start: float):
    records: list[RequestRecord] = []
    gate = asyncio.Semaphore(spec.concurrency)
    tasks = []
    timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(record: RequestRecord) -> None:
            async with gate:
                await stream_completion(session, spec, record)

        index = 0
        while (due := start + index / rate) < start + duration:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            record = RequestRecord(index, spec.prompts[index % len(spec.prompts)], scheduled=due)
            records.append(record)
            tasks.append(asyncio.create_task(one(record)))
            index += 1
        await asyncio.gather(*tasks)
    return records


async def _sample_rss(admin, rss: dict, start: float) -> None:
    while True:
        body = await admin.get("/admin/workers")
        # A spare is judged from its promotion on: its first requests are its warm-up.
        routed = [w for w in body["workers"] if w.get("alive") and not w.get("standby")]
        pools = {w.get("pid"): w.get("kv_pool_private_resident_bytes", 0) for w in routed}
        pools[body.get("frontend_pid")] = 0
        for pid, pool in pools.items():
            # A process that just died, or lives on another node, is skipped.
            if pid and (sample := resident_memory(pid)) is not None:
                private, shared = sample
                at = time.perf_counter() - start
                rss.setdefault(pid, []).append((at, private - pool, shared + pool))
        await asyncio.sleep(_RSS_EVERY_S)


def resident_memory(pid: int) -> tuple[int, int] | None:
    """(private, shared) resident bytes of a process: `RssAnon + RssFile` and
    `RssShmem` from /proc/<pid>/status; off Linux, psutil's RSS as private."""
    try:
        with open(f"/proc/{pid}/status") as status:
            fields = dict(line.split(":", 1) for line in status if line.startswith("Rss"))
        kib = {name: int(value.split()[0]) << 10 for name, value in fields.items()}
        return kib["RssAnon"] + kib["RssFile"], kib["RssShmem"]
    except (OSError, KeyError, ValueError):
        pass
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss, 0
    except psutil.Error:
        return None


def _windows(records, start: float, window: float, duration: float) -> list[float]:
    """Output tokens per second in consecutive windows (each text chunk ~ one token)."""
    counts = [0] * (int(duration / window) + 1)
    for record in records:
        for t in record.chunk_times:
            slot = int((t - start) / window)
            if 0 <= slot < len(counts):
                counts[slot] += 1
    return [c / window for c in counts]


def _throughput_back(throughput: list[float], window: float, kills, every: float) -> dict:
    first_kill = min((k.at_s for k in kills), default=len(throughput) * window)
    before = throughput[1 : max(2, int(first_kill / window))]
    baseline = statistics.median(before) if before else 0.0
    back_after = []
    for kill in kills:
        slot = int(kill.at_s / window)
        later = [i for i in range(slot, len(throughput)) if throughput[i] >= _BACK_TO * baseline]
        back_after.append(None if not later else (later[0] + 1) * window - kill.at_s)
    ok = all(t is not None and t <= every for t in back_after)
    return {
        "tokens_per_s_before_kills": round(baseline, 2),
        "throughput_back_after_s": [None if t is None else round(t, 1) for t in back_after],
        "throughput_back": ok,
    }


def _rss_growth(rss: dict[int, list[tuple[float, int, int]]], warmup_s: float) -> dict:
    """Judge each process's RSS less its KV pool and shared memory (the samples' middle
    value) from the end of its warm-up to its last sample."""
    worst, worst_pid, warmup_worst, judged = 0, None, 0, 0
    flat = True
    for pid, samples in rss.items():
        born, died = samples[0][0], samples[-1][0]
        if died - born < 2 * warmup_s:
            continue
        judged += 1
        warm = next(private for t, private, _ in samples if t >= born + warmup_s)
        warmup_worst = max(warmup_worst, warm - samples[0][1])
        growth = samples[-1][1] - warm
        if growth > max(_RSS_SLACK[0], _RSS_SLACK[1] * warm):
            flat = False
        if growth > worst:
            worst, worst_pid = growth, pid
    mib = 1 << 20
    return {
        "rss_processes": len(rss),
        "rss_judged": judged,
        "rss_samples_mib": {
            str(pid): [
                [round(t, 1), round(private / mib, 1), round(shared / mib, 1)]
                for t, private, shared in samples[::5]
            ]
            for pid, samples in rss.items()
        },
        "rss_warmup_growth_mib": round(warmup_worst / mib, 1),
        "rss_worst_growth_mib": round(worst / mib, 1),
        "rss_worst_pid": worst_pid,
        "rss_shared_growth_mib": round(
            max((s[-1][2] - s[0][2] for s in rss.values()), default=0) / mib, 1
        ),
        "rss_flat": flat,
    }


def _plot(path: str, records, throughput, window: float, kills, start: float) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
    top.step([i * window for i in range(len(throughput))], throughput, where="post")
    top.set_ylabel("output tokens/s")
    top.set_ylim(bottom=0)
    done = [r for r in records if r.ttft_s is not None]
    bottom.scatter([r.start - start for r in done], [r.ttft_s for r in done], s=6)
    failed = [r for r in records if not r.ok]
    bottom.scatter([r.start - start for r in failed], [0] * len(failed), s=12, c="red", marker="x")
    bottom.set_ylabel("TTFT (s)")
    bottom.set_xlabel("seconds into the soak")
    colors = {"prefill": "tab:red", "decode": "tab:purple"}
    for kill in kills:
        color = colors.get(kill.role, "tab:red") if kill.hit else "grey"
        for axis in (top, bottom):
            axis.axvline(kill.at_s, color=color, linestyle="--", lw=0.8)
    # A legend, not a label per line: a 30-minute soak has ~60 kills.
    for role, color in colors.items():
        top.plot([], [], color=color, linestyle="--", lw=0.8, label=f"{role} worker killed")
    top.plot([], [], color="grey", linestyle="--", lw=0.8, label="kill missed")
    top.legend(loc="lower left", fontsize=7, ncol=3)
    top.set_title("pdserve soak: throughput and TTFT, kills marked")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

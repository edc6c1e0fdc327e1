"""`pdserve drill`: kill workers of a running cluster under load and check nothing is lost.

Phases:
  1. reference: each distinct prompt once, greedy, with no faults -> expected text;
  2. load: N streaming requests at concurrency C while worker processes are killed
     (by PID, with SIGKILL or SIGTERM) at the chosen times; when the N requests finish
     before the last kill (a fast model), the load goes on in rounds of C more requests
     until every kill has landed under load;
  3. verdict: per request completed / recovered / failed; streams compared with their
     reference (duplicated or missing text is counted); extra latency of requests that
     went through a recovery; time until every worker was alive again; KV blocks still
     held on each worker once the load is over.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from dataclasses import asdict, dataclass, field

from bench.loadgen import (
    LoadSpec,
    RequestRecord,
    get_json,
    percentile,
    run_load,
    served_model_id,
)

_SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM}


@dataclass
class KillEvent:
    at_s: float
    worker_id: str
    role: str
    pid: int
    recovered_after_s: float | None = None


@dataclass
class DrillReport:
    requests: int
    completed: int
    recovered: int
    failed: int
    exact: int
    duplicated_text: int
    missing_text: int
    diverged: int
    extra_latency_p50_s: float | None
    extra_latency_p99_s: float | None
    kills: list[KillEvent] = field(default_factory=list)
    kills_planned: int = 0
    full_strength_after_s: float | None = None
    leaked_blocks: dict[str, int] = field(default_factory=dict)
    leaked_leases: dict[str, int] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return (
            self.failed == 0
            and len(self.kills) == self.kills_planned
            and self.exact == self.requests
            and not any(self.leaked_blocks.values())
            and not any(self.leaked_leases.values())
        )


class Admin:
    """The frontend's /admin and /v1/models endpoints, as the drill uses them."""

    def __init__(self, url: str, api_key: str | None):
        self.url = url
        self.api_key = api_key

    async def get(self, path: str) -> dict:
        return await get_json(self.url, path, self.api_key)

    async def workers(self) -> list[dict]:
        return (await self.get("/admin/workers"))["workers"]

    async def model(self) -> str:
        return await served_model_id(self.url, self.api_key)


def drill_prompts(count: int, distinct: int = 16) -> list[str]:
    topics = [
        "the sea",
        "a lighthouse",
        "paged attention",
        "a mountain",
        "the moon",
        "a river",
        "a library",
        "a storm",
        "a garden",
        "a train",
        "the desert",
        "a violin",
    ]
    return [
        f"Write a long story about {topics[i % len(topics)]}, part {i % distinct}."
        for i in range(count)
    ]


async def run_drill(args) -> DrillReport:
    admin = Admin(args.url.rstrip("/"), args.api_key)
    model = args.model or await admin.model()
    prompts = drill_prompts(args.requests)
    spec = LoadSpec(
        url=admin.url,
        model=model,
        prompts=sorted(set(prompts)),
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        api_key=args.api_key,
    )
    reference = {r.prompt: r for r in await run_load(spec) if r.ok}
    load = LoadSpec(**{**asdict(spec), "prompts": prompts})
    kills: list[KillEvent] = []
    watchers: list[asyncio.Task] = []
    killer = asyncio.create_task(_kill_schedule(admin, args, kills, watchers))
    records = await run_load(load)
    while not killer.done():
        extra_round = LoadSpec(**{**asdict(spec), "prompts": prompts[: args.concurrency]})
        records += await run_load(extra_round)
    await killer  # surfaces an error of the kill schedule (e.g. /admin unreachable)
    full_strength = await _wait_full_strength(admin, kills, timeout_s=args.recovery_timeout)
    for watcher in watchers:
        watcher.cancel()
    blocks, leases = await _leaks(admin, timeout_s=args.recovery_timeout)
    report = _verdict(records, reference, kills, full_strength, blocks, leases)
    report.kills_planned = len(kill_times(args))
    return report


async def _kill_schedule(
    admin: Admin, args, kills: list[KillEvent], watchers: list[asyncio.Task]
) -> None:
    start = time.monotonic()
    for when in kill_times(args):
        await asyncio.sleep(max(0.0, start + when - time.monotonic()))
        victim = await _next_victim(admin, args.kill, args.recovery_timeout)
        if victim is None:
            continue
        os.kill(victim["pid"], _SIGNALS[args.signal])
        kills.append(
            KillEvent(time.monotonic() - start, victim["worker_id"], victim["role"], victim["pid"])
        )
        watchers.append(asyncio.create_task(_time_recovery(admin, kills[-1], time.monotonic())))


def kill_times(args) -> list[float]:
    """Seconds into the load at which to kill, from --at or --every/--count."""
    times = [args.at] if args.at is not None else [args.every * (i + 1) for i in range(args.count)]
    return times[: args.count]


async def _next_victim(admin: Admin, role: str, timeout_s: float) -> dict | None:
    """A live worker of `role`; waits for one to come back when all of them are down."""
    deadline = time.monotonic() + timeout_s
    while (victim := _choose_victim(await admin.workers(), role)) is None:
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.2)
    return victim


def _choose_victim(workers: list[dict], role: str) -> dict | None:
    alive = [w for w in workers if w["alive"] and w.get("pid")]
    if role != "random":
        alive = [w for w in alive if w["role"] == role]
    return random.choice(alive) if alive else None


async def _time_recovery(admin: Admin, kill: KillEvent, killed_at: float) -> None:
    """Time from the kill until the same worker is alive again (with a new process)."""
    while True:
        await asyncio.sleep(0.2)
        for worker in await admin.workers():
            if (
                worker["worker_id"] == kill.worker_id
                and worker["alive"]
                and worker.get("pid") != kill.pid
            ):
                kill.recovered_after_s = time.monotonic() - killed_at
                return


async def _wait_full_strength(
    admin: Admin, kills: list[KillEvent], timeout_s: float
) -> float | None:
    if not kills:
        return 0.0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(k.recovered_after_s is not None for k in kills):
            return max(k.at_s + k.recovered_after_s for k in kills) - min(k.at_s for k in kills)
        await asyncio.sleep(0.2)
    return None


async def _leaks(admin: Admin, timeout_s: float) -> tuple[dict[str, int], dict[str, int]]:
    """Blocks and leases still held once the load is over (acks land asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = [w for w in await admin.workers() if w["alive"]]
        blocks = {w["worker_id"]: w.get("used_blocks", 0) for w in workers}
        leases = {
            w["worker_id"]: w.get("outstanding_leases", 0)
            for w in workers
            if "outstanding_leases" in w
        }
        if (not any(blocks.values()) and not any(leases.values())) or time.monotonic() > deadline:
            return blocks, leases
        await asyncio.sleep(0.2)


def _verdict(
    records: list[RequestRecord], reference: dict[str, str], kills, full_strength, blocks, leases
) -> DrillReport:
    done = [r for r in records if r.ok]
    affected = [r for r in done if r.server_timings.get("recoveries")]
    # Extra latency: each affected request against the same prompt's uninterrupted run
    # at the same concurrency (the reference pass), not against other prompts.
    extra = [r.e2e_s - reference[r.prompt].e2e_s for r in affected if r.prompt in reference]
    expected = {prompt: ref.text for prompt, ref in reference.items()}
    exact = sum(1 for r in done if r.text == expected.get(r.prompt))
    wrong = [r for r in done if r.text != expected.get(r.prompt)]
    return DrillReport(
        requests=len(records),
        completed=len(done),
        recovered=len(affected),
        failed=len(records) - len(done),
        exact=exact,
        duplicated_text=sum(1 for r in wrong if len(r.text) > len(expected.get(r.prompt, ""))),
        missing_text=sum(1 for r in wrong if len(r.text) < len(expected.get(r.prompt, ""))),
        diverged=sum(1 for r in wrong if len(r.text) == len(expected.get(r.prompt, ""))),
        extra_latency_p50_s=percentile(extra, 50),
        extra_latency_p99_s=percentile(extra, 99),
        kills=kills,
        full_strength_after_s=full_strength,
        leaked_blocks=blocks,
        leaked_leases=leases,
    )


def format_report(report: DrillReport) -> str:
    def fmt(value):
        return "-" if value is None else f"{value:.2f}"

    lines = [
        f"{'requests':<36}{report.requests}",
        f"{'completed':<36}{report.completed}",
        f"{'recovered (went through a fault)':<36}{report.recovered}",
        f"{'failed':<36}{report.failed}",
        f"{'exact text vs reference':<36}{report.exact}/{report.requests}",
        f"{'duplicated / missing / diverged':<36}{report.duplicated_text} / {report.missing_text} / {report.diverged}",
        f"{'extra latency p50 / p99 (s)':<36}{fmt(report.extra_latency_p50_s)} / {fmt(report.extra_latency_p99_s)}",
        f"{'full strength again after (s)':<36}{fmt(report.full_strength_after_s)}",
        f"{'kills done / planned':<36}{len(report.kills)} / {report.kills_planned}",
    ]
    for kill in report.kills:
        lines.append(
            f"  killed {kill.worker_id} (pid {kill.pid}) at {kill.at_s:.2f}s, "
            f"back after {fmt(kill.recovered_after_s)}s"
        )
    leaks = {w: n for w, n in report.leaked_blocks.items() if n}
    lines.append(f"{'leaked KV blocks':<36}{leaks or 0}")
    lines.append(
        f"{'leaked leases':<36}{({w: n for w, n in report.leaked_leases.items() if n}) or 0}"
    )
    lines.append("PASS" if report.passed else "FAIL")
    return "\n".join(lines)


def add_drill_parser(sub) -> None:
    parser = sub.add_parser(
        "drill",
        help="kill workers of a running cluster under load and verify nothing is lost",
        description="Run a streaming load against a running pdserve, kill worker processes at the "
        "chosen times, and report completed/recovered/failed requests, duplicated or missing text "
        "(each stream is compared with its greedy reference), extra latency of affected requests, "
        "time to full strength, and KV blocks leaked per worker. Exit code 1 when anything was lost.",
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--kill", choices=["prefill", "decode", "random"], default="random")
    parser.add_argument("--count", type=int, default=1, help="number of kills")
    when = parser.add_mutually_exclusive_group()
    when.add_argument(
        "--at", type=float, default=None, help="kill once, this many seconds into the load"
    )
    when.add_argument("--every", type=float, default=2.0, help="kill every this many seconds")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--signal", choices=sorted(_SIGNALS), default="kill")
    parser.add_argument("--model", default=None, help="model id (default: the server's)")
    parser.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    parser.add_argument("--recovery-timeout", type=float, default=60.0)
    parser.add_argument("--json", default=None, help="write the report as JSON to this file")
    parser.set_defaults(func=_run_drill_cli)


def _run_drill_cli(args) -> int:
    report = asyncio.run(run_drill(args))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({**asdict(report), "passed": report.passed}, handle, indent=2)
    return 0 if report.passed else 1

"""`pdserve drill`: kill workers of a running cluster under load and check nothing is lost.

Phases:
  1. reference: each distinct prompt once, greedy, with no faults -> expected text;
     then the load of phase 2 once with no kill -> each request's uninterrupted time
     (not with `--duration`);
  2. load: streaming requests while worker processes are killed (SIGKILL or SIGTERM)
     at the chosen times. Each victim is the worker of the asked role holding the most
     requests right then; a kill with no loaded victim is a miss, never a kill. When
     the requests finish before the last kill, the load goes on in rounds until every
     kill has been tried. With `--duration` the load is a steady open loop instead, for
     as long as asked, with a kill every `--every` seconds (a soak, bench/soak.py);
  3. verdict (bench/drill_report.py): requests completed / recovered / failed /
     refused; streams compared with their reference; extra latency and stream resume
     gaps of affected requests; per kill the time to detect, to full strength and to
     restart; how each recovery got the KV back; KV blocks and leases left over.
`--kill frontend-driver` instead kills the `pdserve serve` process itself and reports
what a driver death does (see docs/operations.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import time
from dataclasses import asdict, replace

from bench.drill_report import DrillReport, KillEvent, format_report, verdict
from bench.loadgen import LoadSpec, get_json, run_load, served_model_id

_SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM}
_POLL_S = 0.05
_SOAK_SEED = 12
_HIT_WAIT_S = 5.0
"""How long a kill waits for a worker of its role to hold a request before it misses."""
_ROLE_DRAWS = random.Random(_SOAK_SEED)
_RANK_DRAWS = random.Random(_SOAK_SEED + 1)
"""The role of each `--kill random` kill, in a sequence a soak repeats when rerun."""


class Admin:
    """The frontend's /admin and /v1/models endpoints, as the drill uses them."""

    def __init__(self, url: str, api_key: str | None, admin_api_key: str | None):
        self.url = url
        self.api_key = api_key
        self.admin_api_key = admin_api_key

    async def get(self, path: str) -> dict:
        return await get_json(self.url, path, self.admin_api_key)

    async def workers(self) -> list[dict]:
        return (await self.get("/admin/workers"))["workers"]

    async def model(self) -> str:
        return await served_model_id(self.url, self.api_key)


_CONTEXT_WORDS = [
    "harbour",
    "evening",
    "lantern",
    "keeper",
    "storm",
    "north",
    "rope",
    "ledger",
    "window",
    "tide",
    "silver",
    "gull",
    "bridge",
    "market",
    "winter",
    "letter",
    "candle",
    "orchard",
    "stone",
    "violin",
    "road",
    "river",
    "clock",
    "lamp",
    "garden",
    "thread",
    "island",
    "kettle",
    "mirror",
    "ribbon",
    "anchor",
    "compass",
    "meadow",
    "forge",
]


def drill_prompts(count: int, distinct: int = 16, context_words: int = 0) -> list[str]:
    """`count` prompts cycling through `distinct` ones; with `context_words`, each of
    those opens with its own passage of that many words (a longer prefill)."""
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
        _context(i % distinct, context_words)
        + f"Write a long story about {topics[i % len(topics)]}, part {i % distinct}."
        for i in range(count)
    ]


def _context(part: int, words: int) -> str:
    if words <= 0:
        return ""
    step = 7 + 2 * part  # odd, so each part walks the words in its own order
    passage = " ".join(
        _CONTEXT_WORDS[(part + k * step) % len(_CONTEXT_WORDS)] for k in range(words)
    )
    return f"Notes {part}: {passage}.\n"


async def run_drill(args) -> DrillReport:
    admin = Admin(args.url.rstrip("/"), args.api_key, args.admin_api_key)
    model = args.model or await admin.model()
    prompts = drill_prompts(args.requests, context_words=args.context_words)
    spec = LoadSpec(
        url=admin.url,
        model=model,
        prompts=sorted(set(prompts)),
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        api_key=args.api_key,
    )
    reference = {r.prompt: r for r in await run_load(spec) if r.ok}
    kills: list[KillEvent] = []
    watchers: list[asyncio.Task] = []
    soak_summary = {}
    baseline = None
    spec = replace(spec, cold_cache=args.cold_cache)  # the reference pass shared the cache
    if args.duration:
        from bench.soak import run_soak

        records, soak_summary = await run_soak(admin, spec, args, kills, watchers)
    else:
        load = replace(spec, prompts=prompts)
        # What each request of the kill pass takes with no kill (verdict's `baseline`).
        baseline = await run_load(load)
        records = await _load_with_kills(admin, load, args, kills, watchers)
    await _settle(kills, watchers, args.recovery_timeout)
    blocks, leases = await _leaks(admin, timeout_s=args.recovery_timeout)
    report = verdict(
        records, reference, kills, blocks, leases, baseline, open_loop=bool(args.duration)
    )
    report.kills_planned = len(kill_times(args))
    report.soak = soak_summary
    return report


async def _load_with_kills(admin, load: LoadSpec, args, kills, watchers):
    start = time.perf_counter()
    killer = asyncio.create_task(
        kill_schedule(admin, args, kill_times(args), start, kills, watchers)
    )
    records = await run_load(load)
    while not killer.done():
        records += await run_load(replace(load, prompts=load.prompts[: args.concurrency]))
    await killer  # surfaces an error of the kill schedule (e.g. /admin unreachable)
    return records


def kill_times(args) -> list[float]:
    """Seconds into the load at which to kill: --at, --every x --count, or every
    --every seconds of a --duration soak (the last one leaves time to heal)."""
    if args.duration:
        duration = parse_duration(args.duration)
        every = args.every
        # Jittered by up to a quarter period each way (seeded: a soak can be rerun):
        # kills on an exact grid lock onto the load's own period (a fixed --rate puts an
        # arrival on every multiple of 2 s), always catching the same phase of a request.
        jitter = random.Random(_SOAK_SEED)
        return [
            k * every + jitter.uniform(-every / 4, every / 4)
            for k in range(1, int(duration / every) + 1)
            if k * every < duration - every / 2
        ]
    times = [args.at] if args.at is not None else [args.every * (i + 1) for i in range(args.count)]
    return times[: args.count]


def parse_duration(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", str(text).strip())
    if not match:
        raise ValueError(f"duration {text!r}: use e.g. 90s, 30m or 2h")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[match[2]]


async def kill_schedule(admin, args, times, start, kills, watchers) -> None:
    for when in times:
        await asyncio.sleep(max(0.0, start + when - time.perf_counter()))
        kill = await strike(admin, args.kill, _SIGNALS[args.signal], start, args.rank)
        kills.append(kill)
        if kill.hit:
            watchers.append(asyncio.create_task(_watch_kill(admin, kill)))


async def strike(admin: Admin, role: str, sig: int, start: float, rank: str | int = 0) -> KillEvent:
    """Kill the worker of `role` that holds the most requests; a miss when none holds one
    within `_HIT_WAIT_S`. `rank`: which of a tensor-parallel worker's processes dies (an
    index into its `rank_pids`, or `random`: drawn among them, seeded), the whole worker
    with it. For `random` a role is drawn first, evenly over the cluster's
    roles (seeded), and waited for as long; only then does any loaded worker do.
    Drawing among the roles loaded at that instant picked decode workers for all 59
    kills of a soak whose prefill workers are busy a fifth of the time."""
    wanted = role
    if role == "random":
        roles = sorted({w["role"] for w in await admin.workers()})
        wanted = _ROLE_DRAWS.choice(roles) if roles else role
    drawn_until = time.monotonic() + _HIT_WAIT_S
    deadline = drawn_until + (_HIT_WAIT_S if wanted != role else 0.0)
    while True:
        workers = await admin.workers()
        victim = choose_victim(workers, wanted if time.monotonic() < drawn_until else role)
        if victim is not None:
            break
        if time.monotonic() > deadline:
            return KillEvent(time.perf_counter() - start, "-", role, None, 0)
        await asyncio.sleep(_POLL_S)
    chosen_rank, pid = victim_rank(victim, rank)
    os.kill(pid, sig)
    killed_at = time.perf_counter()
    kill = KillEvent(killed_at - start, victim["worker_id"], victim["role"], pid, held(victim))
    kill.rank, kill.worker_pid = chosen_rank, victim["pid"]
    kill.killed_at = killed_at
    kill.strength_before = _routed(workers, victim["role"])
    return kill


def victim_rank(worker: dict, rank: str | int) -> tuple[int, int]:
    """(rank, pid) of the process of `worker` to kill; a rank it does not have is the
    highest it has (a drill against mixed pools names one rank for all of them)."""
    pids = worker.get("rank_pids") or [worker["pid"]]
    chosen = _RANK_DRAWS.randrange(len(pids)) if rank == "random" else min(int(rank), len(pids) - 1)
    return chosen, pids[chosen]


def held(worker: dict) -> int:
    """Requests a worker's death would touch: its sequences with more than their next
    token to make (one in its last step has finished by the time the signal lands: 3
    such "held" requests made a drill FAIL with nothing to recover), and (prefill
    workers) the exports it would lose: not pulled yet, and not in a pool file that
    outlives it (shm). An export already pulled stays leased until its request ends,
    but losing it costs that request nothing."""
    left = worker.get("tokens_left") or {}
    sequences = [rid for rid in worker.get("requests") or {} if rid not in left or left[rid] > 1]
    exports = worker.get("exports_at_risk", worker.get("leases"))
    return len(sequences) + len(exports or [])


def choose_victim(workers: list[dict], role: str) -> dict | None:
    """The most loaded live worker of `role` (`random`: of any role with a loaded one)."""
    loaded = [
        w for w in workers if w["alive"] and not w.get("standby") and w.get("pid") and held(w) > 0
    ]
    roles = sorted({w["role"] for w in loaded})
    if role != "random":
        roles = [r for r in roles if r == role]
    if not roles:
        return None
    chosen = random.choice(roles)
    candidates = [w for w in loaded if w["role"] == chosen]
    most = max(held(w) for w in candidates)
    return random.choice([w for w in candidates if held(w) == most])


def _routed(workers: list[dict], role: str) -> int:
    return sum(1 for w in workers if w["role"] == role and w["alive"] and not w.get("standby"))


async def _watch_kill(admin: Admin, kill: KillEvent) -> None:
    """Time from the kill until it is noticed, the role is at strength again (a spare
    or the restart), and the victim itself is back as a new process."""
    while kill.recovered_after_s is None or kill.full_strength_after_s is None:
        await asyncio.sleep(_POLL_S)
        # The liveness in the answer is read as the call arrives; the call itself may
        # take seconds while busy workers finish their steps.
        elapsed = time.perf_counter() - kill.killed_at
        workers = await admin.workers()
        me = next(w for w in workers if w["worker_id"] == kill.worker_id)
        if kill.detected_after_s is None and not me["alive"]:
            kill.detected_after_s = max(0.0, elapsed - (me.get("dead_for_s") or 0.0))
        back = me["alive"] and me.get("pid") != (kill.worker_pid or kill.pid)
        # When the victim came back, to the moment (a look may come a second later).
        back_after = elapsed - (me.get("alive_for_s") or 0.0) if back else None
        if kill.detected_after_s is None and back:
            kill.detected_after_s = back_after  # died and came back between two looks
        noticed = kill.detected_after_s is not None
        at_strength = _routed(workers, kill.role) >= kill.strength_before
        if kill.full_strength_after_s is None and noticed and at_strength:
            # Its own return, or the first look that saw a spare in its place.
            kill.full_strength_after_s = elapsed if back_after is None else back_after
        if kill.recovered_after_s is None and back:
            kill.recovered_after_s = back_after


async def _settle(kills: list[KillEvent], watchers: list[asyncio.Task], timeout_s: float):
    """Let every kill's watcher see the cluster heal (bounded), then stop them."""
    if watchers:
        await asyncio.wait(watchers, timeout=timeout_s)
    for watcher in watchers:
        watcher.cancel()


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


def add_drill_parser(sub) -> None:
    parser = sub.add_parser(
        "drill",
        help="kill workers of a running cluster under load and verify nothing is lost",
        description="Run a streaming load against a running pdserve, kill the most loaded worker "
        "of the chosen role at the chosen times, and report completed/recovered/failed/refused "
        "requests, duplicated or missing text (each stream is compared with its greedy "
        "reference), extra latency and resume gaps of affected streams, per kill the time to "
        "detect, to full strength and to restart, the recovery path of each affected request, "
        "and KV blocks and leases left per worker. With --duration it soaks: a steady load for "
        "that long with a kill every --every seconds, checking throughput and memory too. "
        "Exit code 1 when anything was lost or a kill missed.",
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the pdserve server")
    parser.add_argument(
        "--kill",
        choices=["prefill", "decode", "random", "frontend-driver"],
        default="random",
        help="role of the victims (random: each kill's role drawn evenly, seeded, and waited "
        "for up to 5 s before any role will do); frontend-driver kills `pdserve serve`",
    )
    parser.add_argument(
        "--count", type=int, default=1, help="number of kills (not with --duration)"
    )
    when = parser.add_mutually_exclusive_group()
    when.add_argument(
        "--at", type=float, default=None, help="kill once, this many seconds into the load"
    )
    when.add_argument("--every", type=float, default=2.0, help="kill every this many seconds")
    parser.add_argument(
        "--duration",
        default=None,
        help="soak for this long (e.g. 90s, 30m): steady load at --rate, a kill every "
        "--every S (each jittered by up to a quarter of it, seeded, so kills do not lock "
        "onto the load's own period); adds throughput recovery after each kill and RSS "
        "growth after a warm-up to the verdict, and a plot (--plot)",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="soak: requests per second (default: 2 x concurrency / expected request time)",
    )
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    parser.add_argument(
        "--requests", type=int, default=32, help="requests of the load (not with --duration)"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument(
        "--context-words",
        type=int,
        default=0,
        help="open each prompt with its own passage of this many words (about a token "
        "each), so that prefills take long enough for prefill kills to find work; the "
        "default prompts are ~15 tokens",
    )
    parser.add_argument(
        "--cold-cache",
        action="store_true",
        help="every request of the load carries its own cache_salt, so no prefix cache "
        "serves it and each prompt is prefilled in full: without it a soak's repeated prompts "
        "hit the prefill workers' caches, which then hold almost nothing a kill could take",
    )
    parser.add_argument(
        "--signal", choices=sorted(_SIGNALS), default="kill", help="kill: SIGKILL, term: SIGTERM"
    )
    parser.add_argument(
        "--rank",
        type=_rank_choice,
        default=0,
        help="which process of a tensor-parallel victim to kill: its rank (0, the default, "
        "is the worker's own actor; a higher one is a follower, whose death takes the "
        "worker down as a whole) or `random`; the scorecard names the rank",
    )
    parser.add_argument("--model", default=None, help="model id (default: the server's)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY"),
        help="bearer key of the load's requests (or PDSERVE_API_KEY)",
    )
    parser.add_argument(
        "--admin-api-key",
        default=os.environ.get("PDSERVE_ADMIN_API_KEY"),
        help="bearer key of the server's /admin endpoints, which the drill reads to find and "
        "watch workers (or PDSERVE_ADMIN_API_KEY; a server started without one needs none)",
    )
    parser.add_argument(
        "--recovery-timeout",
        type=float,
        default=60.0,
        help="how long to wait for the cluster to heal and for leftovers to clear",
    )
    parser.add_argument(
        "--plot", default="drill-soak.png", help="soak: throughput and TTFT over time, kills marked"
    )
    parser.add_argument("--json", default=None, help="write the report as JSON to this file")
    parser.set_defaults(func=_run_drill_cli)


def _rank_choice(text: str) -> str | int:
    if text == "random":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"--rank takes a rank (0, 1, ...) or random, not {text!r}")
    return int(text)


def _run_drill_cli(args) -> int:
    if args.kill == "frontend-driver":
        from bench.driver_kill import run_driver_kill

        return run_driver_kill(args)
    report = asyncio.run(run_drill(args))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as handle:
            body = {**asdict(report), "passed": report.passed, "kills_hit": report.kills_hit}
            json.dump(body, handle, indent=2)
    return 0 if report.passed else 1

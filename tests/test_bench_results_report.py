"""`pdserve bench report`: the standing tables of docs/benchmarks.md come from the saved
sittings in docs/results/, and the committed doc says exactly what they render."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.results_report import BEGIN, END, block_of, load_sitting, render, write_block

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "docs" / "results").glob("*.json"))


def test_the_committed_doc_holds_what_the_committed_sittings_render():
    """Regenerate with `pdserve bench report docs/results/*.json --write docs/benchmarks.md`."""
    assert RESULTS, "docs/results/ holds no saved sitting"
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    assert block_of(doc) == render([load_sitting(path) for path in RESULTS])


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_every_saved_sitting_names_its_machine_date_commit_and_command(path):
    report = load_sitting(path)
    sitting = report["sitting"]
    assert sitting["kind"] and sitting["dtype"] and sitting["date"] and sitting["commit"]
    assert sitting["command"].startswith("pdserve bench compare-servers ")
    assert report["machine"]["cpu_model"]
    assert any(r["server"].startswith("vllm") for r in report["servers"])


def summary(tok_s, ttft, tpot, itl=None) -> dict:
    return {"output_throughput": tok_s, "ttft_p50_s": ttft, "tpot_p50_s": tpot, "itl_p99_s": itl}


def sitting_with(servers: dict[str, list[dict]], **header) -> dict:
    return {
        "sitting": header,
        "machine": {"cpu_model": "Some CPU", "cpu_family": "6", "cpu_model_number": "143",
                    "vector_features": ["avx2", "amx_bf16"], "logical_cpus": 2},
        "servers": [
            {
                "server": name,
                "points": [
                    {"label": f"concurrency={c}", "variable": {"concurrency": c}, "summary": s}
                    for c, s in zip((1, 16), points, strict=True)
                ],
            }
            for name, points in servers.items()
        ],
        "failed": [],
    }  # fmt: skip


def test_a_table_gives_each_figure_against_the_best_vllm_at_its_point():
    report = sitting_with(
        {
            "vllm-fp32": [summary(20.0, 0.5, 0.04), summary(80.0, 4.0, 0.13, 2.5)],
            "vllm-default": [summary(10.0, 0.9, 0.09), summary(90.0, 3.0, 0.12, 0.6)],
            "pdserve-colocated": [summary(30.0, 0.45, 0.02), summary(108.0, 2.7, 0.1, 1.5)],
        },
        kind="Kind X",
        dtype="float32",
        date="2030-01-02",
        commit="abc1234",
        command="pdserve bench compare-servers --concurrency 1,16",
        repeats=3,
    )
    lines = render([report]).splitlines()
    assert lines[0] == "### Kind X, float32"
    assert (
        "- CPU: Some CPU (family 6, model 143); 2 logical CPUs; vector features: avx2, amx_bf16"
        in lines
    )
    assert "- date 2030-01-02, commit `abc1234`, medians of 3 runs" in lines
    assert "- command: `pdserve bench compare-servers --concurrency 1,16`" in lines
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert rows == [
        "| vllm-fp32 | 1 | 20.0 | 500 ms | 40 ms | - |",  # the best vLLM at c=1: no ratio
        "| vllm-default | 1 | 10.0 (0.50x) | 900 ms (1.80x) | 90 ms (2.25x) | - |",
        "| pdserve-colocated | 1 | 30.0 (1.50x) | 450 ms (0.90x) | 20 ms (0.50x) | - |",
        "| vllm-fp32 | 16 | 80.0 (0.89x) | 4.00 s (1.33x) | 130 ms (1.08x) | 2.50 s (4.17x) |",
        "| vllm-default | 16 | 90.0 | 3.00 s | 120 ms | 600 ms |",
        "| pdserve-colocated | 16 | 108.0 (1.20x) | 2.70 s (0.90x) | 100 ms (0.83x) | 1.50 s (2.50x) |",
    ]


def test_a_fresh_compare_servers_report_drops_in_as_it_is_written(monkeypatch, tmp_path):
    """What `compare-servers --json` writes (its sitting header included) renders
    without an edit: the kind given by --kind, the day, the commit and the command."""
    import bench.compare_servers as compare
    import bench.prompt_text

    async def fake_measure(server, args, maker):
        tok_s = {"vllm-fp32": 50.0, "pdserve-colocated": 60.0}[server.label]
        point = {"label": "concurrency=4", "variable": {"concurrency": 4},
                 "summary": summary(tok_s, 1.0, 0.05, 0.2)}  # fmt: skip
        return {"server": server.label, "startup_s": 1.0, "points": [point]}

    monkeypatch.setattr(compare, "measure", fake_measure)
    monkeypatch.setattr(bench.prompt_text.PromptMaker, "from_arg", staticmethod(lambda _: None))
    monkeypatch.setattr(sys, "argv", ["pdserve", "bench", "compare-servers", "--kind", "Kind Y"])
    saved = tmp_path / "kind-y.json"
    args = argparse.Namespace(
        servers="vllm-fp32,pdserve-colocated", tokenizer="demo", json=str(saved),
        from_json=None, plot=None, kind="Kind Y", dtype="bfloat16", repeats=2,
    )  # fmt: skip
    assert compare._run(args) == 0
    report = json.loads(saved.read_text())
    assert report["sitting"]["commit"]  # this checkout's short hash
    lines = render([load_sitting(saved)]).splitlines()
    assert lines[0] == "### Kind Y, bfloat16"
    assert "- command: `pdserve bench compare-servers --kind 'Kind Y'`" in lines
    assert f"commit `{report['sitting']['commit']}`, medians of 2 runs" in "\n".join(lines)
    assert (
        "| pdserve-colocated | 4 | 60.0 (1.20x) | 1.00 s (1.00x) | 50 ms (1.00x) | 200 ms (1.00x) |"
        in lines
    )


def test_write_replaces_only_the_generated_block(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"# Title\n\nbefore\n\n{BEGIN}\nstale table\n{END}\n\nafter\n")
    path = tmp_path / "x.json"
    path.write_text(json.dumps(sitting_with({"vllm-fp32": [summary(1.0, 1.0, 1.0)] * 2})))
    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "bench", "report", str(path), "--write", str(doc)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = doc.read_text()
    assert text.startswith("# Title\n\nbefore\n\n") and text.endswith(f"{END}\n\nafter\n")
    assert "stale table" not in text
    assert block_of(text) == render([load_sitting(path)])


def test_a_file_without_servers_is_refused_by_name(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"servers": [], "failed": [{"server": "x", "error": "y"}]}))
    with pytest.raises(ValueError, match=r"empty\.json"):
        load_sitting(path)
    doc = tmp_path / "doc.md"
    doc.write_text("no markers\n")
    with pytest.raises(SystemExit, match="block"):
        write_block(doc, "tables\n")

"""`pdserve bench report`: the standing tables of docs/benchmarks.md, from saved sittings.

A sitting is what `pdserve bench compare-servers --json` writes: `sitting` (machine
kind, dtype, date, commit, the exact command, where the figures came from),
`machine` (CPU model name, family and model number, vector features, logical CPUs)
and, per server, each `concurrency=N` point's median `summary`. One file per machine
kind lives in docs/results/; a newer sitting of a kind replaces its file.

The command renders one markdown table per file: every server at every point, output
tok/s, TTFT p50, TPOT p50 and ITL p99, each with its ratio against the best vLLM
configuration at that point of the same sitting. `--write DOC` puts the tables between
BEGIN and END in DOC, so the doc's figures are regenerated, never edited by hand (a
test checks that the committed doc equals what the committed JSON renders).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.compare_servers import best_vllm

BEGIN = "<!-- begin: pdserve bench report docs/results/*.json (generated, do not edit) -->"
END = "<!-- end: pdserve bench report -->"

FIGURES = (
    ("output tok/s", "output_throughput"),
    ("TTFT p50", "ttft_p50_s"),
    ("TPOT p50", "tpot_p50_s"),
    ("ITL p99", "itl_p99_s"),
)


def load_sitting(path: Path) -> dict:
    """A saved sitting; raises ValueError naming the file when it has no servers."""
    report = json.loads(path.read_text())
    if not report.get("servers"):
        raise ValueError(f"{path}: no measured servers (not a compare-servers report?)")
    return report


def render(sittings: list[dict]) -> str:
    """The markdown of every sitting's table, in the order given."""
    return "\n\n".join(render_sitting(sitting) for sitting in sittings) + "\n"


def render_sitting(report: dict) -> str:
    sitting, machine = report.get("sitting") or {}, report.get("machine") or {}
    lines = [f"### {_title(sitting, machine)}", "", *_provenance(sitting, machine)]
    lines += [*_startup(report["servers"]), ""]
    lines += ["| server | streams | " + " | ".join(name for name, _ in FIGURES) + " |"]
    lines += ["|---|---|" + "---|" * len(FIGURES)]
    results = report["servers"]
    for index, point in enumerate(results[0]["points"]):
        best = best_vllm(results, index)
        for result in results:
            summary = result["points"][index]["summary"]
            cells = [_cell(summary, best, key) for _, key in FIGURES]
            lines.append(f"| {result['server']} | {_streams(point)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _title(sitting: dict, machine: dict) -> str:
    kind = sitting.get("kind") or machine.get("cpu_model") or "unknown CPU"
    dtype = sitting.get("dtype")
    return f"{kind}, {dtype}" if dtype else kind


def _provenance(sitting: dict, machine: dict) -> list[str]:
    cpu = machine.get("cpu_model", "?")
    family, number = machine.get("cpu_family"), machine.get("cpu_model_number")
    if family is not None:
        cpu += f" (family {family}" + (f", model {number})" if number is not None else ")")
    features = ", ".join(machine.get("vector_features") or []) or "none recorded"
    repeats = sitting.get("repeats")
    lines = [
        f"- CPU: {cpu}; {machine.get('logical_cpus', '?')} logical CPUs; vector features: "
        f"{features}",
        f"- date {sitting.get('date', '?')}, commit `{sitting.get('commit', '?')}`"
        + (f", medians of {repeats} runs" if repeats else ""),
        f"- command: `{sitting.get('command', '?')}`",
    ]
    if sitting.get("source"):
        lines.append(f"- source: {sitting['source']}")
    return lines


def _startup(results: list[dict]) -> list[str]:
    started = [f"{r['server']} {r['startup_s']:.1f} s" for r in results if r.get("startup_s")]
    return [f"- startup to the first answer: {', '.join(started)}"] if started else []


def _streams(point: dict) -> str:
    concurrency = (point.get("variable") or {}).get("concurrency")
    return str(concurrency) if concurrency is not None else point["label"]


def _cell(summary: dict, best: dict | None, key: str) -> str:
    value = summary.get(key)
    if value is None:
        return "-"
    text = f"{value:.1f}" if key == "output_throughput" else _duration(value)
    if best is not None and best.get(key) and summary is not best:
        text += f" ({value / best[key]:.2f}x)"
    return text


def _duration(seconds: float) -> str:
    """Three significant digits: 42.7 ms, 515 ms, 2.54 s, 10.3 s."""
    if seconds >= 1:
        return f"{seconds:.3g} s" if seconds >= 100 else f"{seconds:#.3g} s"
    return f"{seconds * 1000:.3g} ms"


def write_block(doc: Path, tables: str) -> None:
    """Replaces what lies between BEGIN and END in `doc` with `tables`."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc}: no `{BEGIN}` ... `{END}` block to write the tables into")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n\n{tables}\n{END}{tail}")


def block_of(doc_text: str) -> str:
    """The tables a doc holds between BEGIN and END, as write_block put them there."""
    return doc_text.split(BEGIN, 1)[1].split(END, 1)[0].removeprefix("\n\n").removesuffix("\n")


def add_report_parser(kinds) -> None:
    parser = kinds.add_parser(
        "report",
        help="markdown tables of saved compare-servers sittings (docs/results/*.json)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("files", nargs="+", metavar="JSON", help="saved sittings, in order")
    parser.add_argument(
        "--write",
        default=None,
        metavar="DOC",
        help="put the tables between the generated-block markers of this markdown file "
        "instead of printing them",
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        tables = render([load_sitting(Path(name)) for name in args.files])
    except (OSError, ValueError) as exc:
        raise SystemExit(str(exc)) from None
    if args.write:
        write_block(Path(args.write), tables)
        print(f"wrote {len(args.files)} table(s) into {args.write}")
    else:
        print(tables, end="")
    return 0

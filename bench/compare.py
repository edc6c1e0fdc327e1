"""`pdserve bench compare A.json B.json`: two runs side by side, with B / A ratios.

For example colocated (A) against disaggregated (B) on the same workload. Points
are paired by label when both reports have the same labels, else by position. When
both runs stored server metrics (`/metrics` deltas), the comparison also shows what
moved inside the server: batch sizes, queue and prefill times, transfer time,
recomputations. That answers which resource a change freed and what happened to
latency, which client figures alone cannot.
"""

from __future__ import annotations

import argparse

from bench.report import load_json

CLIENT_ROWS = (
    ("ok", "completed requests", 1, "{:.0f}"),
    ("failed", "failed requests", 1, "{:.0f}"),
    ("request_throughput", "requests/s", 1, "{:.3f}"),
    ("output_throughput", "output tok/s", 1, "{:.1f}"),
    ("total_token_throughput", "total tok/s (incl. prompt)", 1, "{:.1f}"),
    ("ttft_p50_s", "TTFT p50 (ms)", 1000, "{:.0f}"),
    ("ttft_p99_s", "TTFT p99 (ms)", 1000, "{:.0f}"),
    ("itl_p50_s", "ITL p50 (ms)", 1000, "{:.1f}"),
    ("itl_p99_s", "ITL p99 (ms)", 1000, "{:.1f}"),
    ("tpot_mean_s", "TPOT mean (ms)", 1000, "{:.1f}"),
    ("e2e_p50_s", "E2E p50 (ms)", 1000, "{:.0f}"),
    ("e2e_p99_s", "E2E p99 (ms)", 1000, "{:.0f}"),
    ("goodput_req_s", "goodput req/s", 1, "{:.3f}"),
    ("goodput_share", "goodput share", 1, "{:.0%}"),
    ("client_cpu_share", "client CPU (share of a core)", 1, "{:.1%}"),
)


def pair_points(a: dict, b: dict) -> list[tuple[dict, dict]]:
    labels_a = [p["label"] for p in a["points"]]
    labels_b = [p["label"] for p in b["points"]]
    if labels_a == labels_b or set(labels_a) != set(labels_b):
        return list(zip(a["points"], b["points"], strict=False))
    by_label = {p["label"]: p for p in b["points"]}
    return [(p, by_label[p["label"]]) for p in a["points"]]


def ratio(a, b) -> str:
    if a is None or b is None or a == 0:
        return "-"
    return f"{b / a:.2f}x"


def _cell(value, scale: float, fmt: str) -> str:
    return "-" if value is None else fmt.format(value * scale)


def compare_points(a: dict, b: dict) -> list[tuple[str, str, str, str]]:
    """(figure, A, B, B/A) rows: client figures, then server digests when both have them."""
    rows = []
    for key, name, scale, fmt in CLIENT_ROWS:
        va, vb = a["summary"].get(key), b["summary"].get(key)
        if va is None and vb is None:
            continue
        rows.append((name, _cell(va, scale, fmt), _cell(vb, scale, fmt), ratio(va, vb)))
    digest_a, digest_b = server_digest(a), server_digest(b)
    if digest_a and digest_b:
        rows.append(("-- server (/metrics delta) --", "", "", ""))
        for name in [k for k in digest_a if k in digest_b]:
            va, vb = digest_a[name], digest_b[name]
            rows.append((name, _num(va), _num(vb), ratio(va, vb)))
    return rows


def server_digest(point: dict) -> dict:
    """The first run's digest (repeats share a workload; medians of digests would mislead)."""
    metrics = point["runs"][0].get("server_metrics") if point.get("runs") else None
    return (metrics or {}).get("digest") or {}


def _num(value: float) -> str:
    if float(value).is_integer() and abs(value) < 1e6:
        return f"{value:.0f}"
    if abs(value) >= 1e6:
        return f"{value:.3g}"
    return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"


def format_comparison(path_a: str, path_b: str) -> str:
    a, b = load_json(path_a), load_json(path_b)
    lines = [f"A: {path_a}  ({_describe(a)})", f"B: {path_b}  ({_describe(b)})"]
    if a["header"].get("workload") != b["header"].get("workload"):
        lines.append("warning: the two runs used different workloads; ratios mix two changes")
    for point_a, point_b in pair_points(a, b):
        lines.append("")
        lines.append(f"== A {point_a['label']}  vs  B {point_b['label']}")
        rows = compare_points(point_a, point_b)
        width = max(len(r[0]) for r in rows) + 2
        lines.append(f"{'':<{width}}{'A':>12}{'B':>12}{'B/A':>9}")
        lines.extend(f"{n:<{width}}{x:>12}{y:>12}{r:>9}" for n, x, y, r in rows)
    return "\n".join(lines)


def _describe(report: dict) -> str:
    h = report["header"]
    workload = h.get("workload") or {}
    machine = h.get("machine") or {}
    return (
        f"{h.get('url')} {h.get('endpoint')}, model {h.get('model')}, workload "
        f"{workload.get('kind')}, {machine.get('cpu_model')}, {h.get('started_at')}"
    )


def add_compare_parser(kinds) -> None:
    parser = kinds.add_parser(
        "compare",
        help="two bench serve / sweep JSON reports side by side, with ratios",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("a", help="baseline JSON report (A)")
    parser.add_argument("b", help="JSON report to compare with it (B); ratios are B / A")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    print(format_comparison(args.a, args.b))
    return 0

"""Where `disaggregation: auto` switches between remote and local prefill, from what a
bandwidth sweep measured (`pdserve bench bandwidth --crossover PNG`).

For every sweep point (one server, one KV link cap) the sweep records the prefill
worker's step costs fitted from its own step trace (`/admin/steps`), the achieved KV
bandwidth and block size from the receipts, and the measured call overhead; this module
feeds those into the same prediction `auto` makes (cluster/flow/disaggregation.py) and finds,
per bandwidth, the shortest prompt `auto` sends remote while the decode worker has a
running batch. The plot draws that curve (remote above, local below) and, for points
run with `--disaggregation auto`, the path each request actually took.
"""

from __future__ import annotations

from types import SimpleNamespace

from cluster.flow.disaggregation import PathInputs, crossover_prompt_len
from engine.step_costs import StepCosts, fit_step_costs

MAX_PROMPT = 8192


def prefill_costs(step_traces: dict[str, list[dict]]) -> dict | None:
    """The prefill workers' step costs from a server's `/admin/steps` answer."""
    steps = [
        SimpleNamespace(**step)
        for worker, trace in step_traces.items()
        if worker.startswith("prefill")
        for step in trace
    ]
    costs = fit_step_costs(steps, last=len(steps))
    return None if costs.prefill_token_s is None else vars(costs)


def receipt_costs(records) -> dict:
    """Block bytes, achieved bandwidth, call overhead and auto's choices from receipts."""
    timed = [r.server_timings for r in records if r.ok and r.server_timings]
    moved = [t for t in timed if t.get("kv_blocks_moved") and t.get("kv_transfer_s")]
    overheads = [
        t["ttft_parts"]["prefill_call_overhead_s"]
        for t in timed
        if "prefill_call_overhead_s" in (t.get("ttft_parts") or {})
    ]
    paths = [
        (r.prompt_tokens, (r.server_timings.get("disaggregation") or {}).get("path"))
        for r in records
        if r.ok and r.server_timings
    ]
    total_bytes = sum(t["kv_bytes"] for t in moved)
    return {
        "kv_block_bytes": moved[0]["kv_bytes"] // moved[0]["kv_blocks_moved"] if moved else None,
        "kv_bandwidth_measured": total_bytes / sum(t["kv_transfer_s"] for t in moved)
        if moved
        else None,
        "call_overhead_s": sum(overheads) / len(overheads) if overheads else None,
        "paths": [p for p in paths if p[1] is not None],
    }


def crossover_points(results: list[dict], block_size: int, chunk: int, running: int) -> list:
    """(bandwidth MB/s, crossover prompt tokens or None) per point with the costs known."""
    points = []
    for row in results:
        costs, block_bytes = row.get("prefill_costs"), row.get("kv_block_bytes")
        bandwidth = row.get("kv_bandwidth_measured") or (row["bandwidth_mb_s"] or 0) * 1e6
        if not costs or not block_bytes or not bandwidth:
            continue
        inputs = PathInputs(
            prompt_tokens=0,
            block_size=block_size,
            block_bytes=block_bytes,
            prefill_costs=StepCosts(**costs),
            decode_costs=None,
            bandwidth=bandwidth,
            prefill_chunk=chunk,
            decode_running=running,
            overhead_s=row.get("call_overhead_s") or 0.005,
        )
        points.append((bandwidth / 1e6, crossover_prompt_len(inputs, MAX_PROMPT)))
    return sorted(points)


def plot_crossover(results: list[dict], path: str, block_size: int, chunk: int, running: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = crossover_points(results, block_size, chunk, running)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = [bw for bw, _ in points]
    ys = [n if n is not None else MAX_PROMPT for _, n in points]
    ax.plot(xs, ys, marker="o", color="black", label="auto's crossover (measured costs)")
    if xs:
        ax.fill_between(xs, ys, MAX_PROMPT, alpha=0.12, color="tab:blue", label="remote prefill")
        ax.fill_between(xs, 1, ys, alpha=0.12, color="tab:orange", label="local prefill")
    for row in results:
        bandwidth = row.get("kv_bandwidth_measured") or (row["bandwidth_mb_s"] or 0) * 1e6
        for tokens, chosen in row.get("paths", []):
            color = "tab:blue" if chosen == "remote" else "tab:orange"
            ax.scatter([bandwidth / 1e6], [tokens], color=color, marker="x", s=18)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("KV link bandwidth (MB/s, achieved)")
    ax.set_ylabel("prompt tokens (uncached)")
    ax.set_title(f"disaggregation: auto, decode worker running {running} streams (x: chosen)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return points

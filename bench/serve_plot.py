"""One `pdserve bench serve` invocation as a picture: `--plot PNG`.

A row of four panels per point (each `--concurrency` or `--rate` value):
- every request of the point's first run as a line from its start to its last chunk,
  a dot at its first token, in the order sent (failures in red): queueing, waves of
  prefill and stalls show up as shapes;
- the distribution (CDF) of TTFT, and of E2E, over every run of the point;
- the distribution of inter-token gaps (log scale: a stall is a tail, not a mean);
- text chunks per second over the first run (one token each as pdserve streams; a
  server that batches tokens into chunks reads lower), in one-second bins.
"""

from __future__ import annotations

import numpy as np

FAILED_COLOR = "#d62728"
OK_COLOR = "#1f77b4"


def plot_run(entries: list[dict], path: str) -> str:
    """Writes the PNG for the point entries `run_points` returned (the report's
    `points`); returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(entries), 4, figsize=(18, 3.6 * len(entries)), squeeze=False)
    for row, entry in enumerate(entries):
        runs = entry["runs"]
        records = [r for run in runs for r in run["records"]]
        label = entry["label"]
        _timeline(axes[row][0], runs[0]["records"], f"requests of run 1, {label}")
        _cdf(axes[row][1], {"TTFT": _ms(records, "ttft_s"), "E2E": _ms(records, "e2e_s")},
             f"TTFT and E2E, {label} ({len(runs)} run{'s' if len(runs) > 1 else ''})")  # fmt: skip
        gaps = [gap * 1000 for r in records for gap in r.get("itl_s") or []]
        _cdf(axes[row][2], {"ITL": gaps}, f"inter-token gaps, {label}", log=True)
        _throughput(axes[row][3], runs[0]["records"], f"chunks/s of run 1, {label}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def token_times(record: dict) -> list[float]:
    """Seconds from the run's start at which each chunk of a request arrived."""
    if record.get("ttft_s") is None:
        return []
    first = record["start_s"] + record["ttft_s"]
    return [first, *(first + np.cumsum(record.get("itl_s") or [])).tolist()]


def _timeline(ax, records: list[dict], title: str) -> None:
    for y, record in enumerate(sorted(records, key=lambda r: r["start_s"])):
        ok = record["outcome"] == "ok"
        start, e2e = record["start_s"], record.get("e2e_s") or 0.0
        ax.hlines(y, start, start + e2e, color=OK_COLOR if ok else FAILED_COLOR, linewidth=1)
        if record.get("ttft_s") is not None:
            ax.plot(start + record["ttft_s"], y, ".", color="black", markersize=3)
    ax.set_xlabel("seconds from the run's start")
    ax.set_ylabel("request, in the order sent")
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)


def _cdf(ax, series: dict[str, list[float]], title: str, log: bool = False) -> None:
    for name, values in series.items():
        if not values:
            continue
        ordered = np.sort(values)
        ax.step(ordered, np.arange(1, len(ordered) + 1) / len(ordered), where="post",
                label=f"{name} (p50 {np.percentile(ordered, 50):.0f}, "
                      f"p99 {np.percentile(ordered, 99):.0f} ms)")  # fmt: skip
    if log:
        ax.set_xscale("log")
    ax.set_xlabel("ms")
    ax.set_ylabel("share of requests" if not log else "share of gaps")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")


def _throughput(ax, records: list[dict], title: str) -> None:
    arrivals = [t for r in records if r["outcome"] == "ok" for t in token_times(r)]
    if arrivals:
        edges = np.arange(0.0, max(arrivals) + 1.0, 1.0)
        counts, _ = np.histogram(arrivals, bins=edges)
        ax.step(edges[:-1], counts, where="post", color=OK_COLOR)
    ax.set_xlabel("seconds from the run's start")
    ax.set_ylabel("text chunks per second")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)


def _ms(records: list[dict], key: str) -> list[float]:
    return [r[key] * 1000 for r in records if r.get(key) is not None and r["outcome"] == "ok"]

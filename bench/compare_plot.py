"""The side-by-side sitting as a picture: `pdserve bench compare-servers --plot PNG`.

One row of panels per point (concurrency 1, 16, ...), one panel per figure of the
table (output tok/s, TTFT p50, TPOT p50, ITL p99). Each server is a bar at its median
over the repeats, with a whisker from the lowest to the highest run, labelled with the
median and its ratio against the best vLLM configuration at that point (the table's
ratio). vLLM's bars are grey, pdserve's coloured.
"""

from __future__ import annotations

from bench.compare_servers import FIGURES, best_vllm

VLLM_COLOR = "#9e9e9e"
PDSERVE_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def plot_comparison(report: dict, path: str) -> str:
    """Writes the PNG of a compare-servers report (its JSON, as written) to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    results = report["servers"]
    labels = [p["label"] for p in results[0]["points"]]
    names = [r["server"] for r in results]
    fig, axes = plt.subplots(
        len(labels),
        len(FIGURES),
        figsize=(4.2 * len(FIGURES), 0.5 * len(names) * len(labels) + 1.6 * len(labels)),
        squeeze=False,
    )
    colors = _colors(names)
    for row, label in enumerate(labels):
        best = best_vllm(results, row)
        for column, (title, key, scale, fmt) in enumerate(FIGURES):
            ax = axes[row][column]
            for y, result in enumerate(results):
                _bar(ax, y, result["points"][row], best, key, scale, fmt, colors[y])
            ax.set_yticks(range(len(names)), names if column == 0 else [""] * len(names))
            ax.invert_yaxis()
            better = "higher" if key == "output_throughput" else "lower"
            ax.set_title(f"{title}, {label} ({better} is better)", fontsize=9)
            ax.xaxis.set_major_locator(MaxNLocator(5))
            ax.grid(True, axis="x", alpha=0.3)
            ax.margins(x=0.35)
    machine = report.get("machine", {})
    fig.suptitle(
        f"pdserve vs vLLM, same client, medians with min-max of the repeats "
        f"({machine.get('cpu_model', '?')}, {machine.get('logical_cpus', '?')} CPUs)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bar(ax, y: int, point: dict, best: dict | None, key, scale, fmt, color) -> None:
    value = point["summary"].get(key)
    if value is None:
        return
    runs = [r["summary"].get(key) for r in point.get("runs", []) if r["summary"].get(key)]
    low, high = (min(runs), max(runs)) if runs else (value, value)
    ax.barh(y, value * scale, color=color, height=0.6)
    ax.errorbar(value * scale, y, xerr=[[(value - low) * scale], [(high - value) * scale]],
                color="black", capsize=3, linewidth=1)  # fmt: skip
    text = fmt.format(value * scale)
    if best is not None and best.get(key):
        text += f" ({value / best[key]:.2f}x)"
    ax.annotate(text, (high * scale, y), xytext=(4, 0), textcoords="offset points",
                va="center", fontsize=8)  # fmt: skip


def _colors(names: list[str]) -> list[str]:
    others = iter(PDSERVE_COLORS * len(names))
    return [VLLM_COLOR if name.startswith("vllm") else next(others) for name in names]

"""Plots of `pdserve bench bandwidth --kv-modes`: measured TTFT per mode against the KV
link's cap, one panel per prompt length, the expected curves dashed beside them; and
the same curves projected for GPU clusters (a model, labelled so)."""

from __future__ import annotations

MODE_STYLES = {
    "whole-pull": ("tab:blue", "o"),
    "chunk-pull": ("tab:orange", "s"),
    "whole-push": ("tab:green", "^"),
    "chunk-push": ("tab:red", "D"),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_measured(rows: list[dict], path: str) -> None:
    """TTFT p50 per mode against the cap (unshaped drawn at the right edge, labelled),
    expected whole and streamed dashed, one panel per prompt length."""
    plt = _pyplot()
    prompts = sorted({r["prompt"] for r in rows})
    fig, axes = plt.subplots(1, len(prompts), figsize=(5.2 * len(prompts), 4.6), squeeze=False)
    for ax, prompt in zip(axes[0], prompts, strict=True):
        mine = [r for r in rows if r["prompt"] == prompt]
        xs = _positions(mine)
        for mode in [m for m in MODE_STYLES if any(r["mode"] == m for r in mine)]:
            color, marker = MODE_STYLES[mode]
            points = sorted((xs[_key(r)], r) for r in mine if r["mode"] == mode)
            ax.plot(
                [x for x, _ in points],
                [1000 * r["ttft_p50_s"] for _, r in points],
                color=color,
                marker=marker,
                label=f"{mode} (measured p50)",
            )
        for key, style, label in (
            ("expected_whole_s", ":", "expected, whole: compute + transfer"),
            ("expected_streamed_s", "--", "expected, streamed: pipelined chunks"),
        ):
            points = sorted({xs[_key(r)]: r[key] for r in mine if r.get(key)}.items())
            if points:
                ax.plot(
                    [x for x, _ in points],
                    [1000 * y for _, y in points],
                    color="black",
                    linestyle=style,
                    label=label,
                )
        ax.set_xscale("log")
        _log_ms_axis(ax)
        ticks = sorted(set(xs.values()))
        ax.set_xticks(ticks, [_tick(x, xs) for x in ticks], rotation=30, fontsize=8)
        ax.minorticks_off()
        ax.set_title(f"{prompt}-token prompts")
        ax.set_xlabel("KV link cap (Mb/s)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("TTFT p50 (ms), first_token_from: decode")
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.suptitle("Whole-prompt vs chunk-streamed KV, pull vs push: measured (demo model, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _key(row: dict):
    return row["bandwidth_mb_s"]


def _positions(rows: list[dict]) -> dict:
    """Cap (MB/s, None = unshaped) -> x (Mb/s); unshaped sits 3x past the highest cap."""
    caps = sorted(c for c in {r["bandwidth_mb_s"] for r in rows} if c is not None)
    top = caps[-1] * 8 if caps else 8000.0
    return {c: (c * 8 if c is not None else top * 3) for c in [*caps, None]}


def _tick(x: float, xs: dict) -> str:
    if xs.get(None) == x:
        return "unshaped"
    return f"{x / 1000:.0f}G" if x >= 1000 else f"{x:.0f}M"


def plot_gpu_projection(prompts: list[int], path: str) -> None:
    """Projected TTFT (less the fixed overheads) of Llama-3-8B and 70B on H100s at 25,
    100 and 400 Gb/s, whole vs streamed, from the roofline and kv-calc: a model."""
    from bench.kv_stream_model import GPU_CHUNK, GPU_MODELS, MFU, gpu_projection

    plt = _pyplot()
    rows = gpu_projection(tuple(prompts))
    models = list(GPU_MODELS)
    fig, axes = plt.subplots(1, len(models), figsize=(5.6 * len(models), 4.6), squeeze=False)
    for ax, name in zip(axes[0], models, strict=True):
        for prompt, color in zip(
            prompts, ("tab:blue", "tab:orange", "tab:red", "tab:green"), strict=False
        ):
            mine = sorted(
                (r for r in rows if r["model"] == name and r["prompt"] == prompt),
                key=lambda r: r["link_gbit"],
            )
            xs = [r["link_gbit"] for r in mine]
            ax.plot(
                xs,
                [1000 * r["whole_s"] for r in mine],
                color=color,
                linestyle=":",
                marker="o",
                label=f"{prompt} tokens, whole",
            )
            ax.plot(
                xs,
                [1000 * r["streamed_s"] for r in mine],
                color=color,
                linestyle="--",
                marker="s",
                label=f"{prompt} tokens, chunk-streamed",
            )
        tp = GPU_MODELS[name][1]
        ax.set_title(f"{name}, {tp}x H100 (TP {tp}), bf16")
        ax.set_xscale("log")
        _log_ms_axis(ax)
        ax.set_xticks([25, 100, 400], ["25", "100", "400"])
        ax.minorticks_off()
        ax.set_xlabel("KV link per GPU (Gb/s)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("prefill + KV transfer (ms)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(
        f"MODEL, NOT A MEASUREMENT: roofline prefill at {MFU:.0%} of peak, {GPU_CHUNK}-token\n"
        "chunks, KV bytes from kv-calc over the link; fixed overheads left out"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _log_ms_axis(ax) -> None:
    """A log y axis labelled in plain milliseconds (a range under a decade would
    otherwise show no label at all)."""
    from matplotlib.ticker import LogLocator, ScalarFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_minor_locator(LogLocator(base=10, subs=(1.5, 3.0, 4.0, 7.0)))
    formatter = ScalarFormatter()
    formatter.set_scientific(False)
    ax.yaxis.set_major_formatter(formatter)

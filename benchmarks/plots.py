"""PNG plots of `telerag bench e2e` rows (matplotlib, imported only here; `pip install
telerag[bench]`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from telerag.benchmarks.e2e import E2ERow
from telerag.benchmarks.e2e_modes import MODES

STAGES = (  # stacked bottom to top: mean ms per request
    ("pre-retrieval LLM", lambda r: r.t_llm_ms),
    ("retrieval", lambda r: r.retrieval_ms_mean),
    ("final answer", lambda r: r.generate_ms_mean),
    ("other", lambda r: max(0.0, r.latency_ms_mean - r.t_llm_ms - r.retrieval_ms_mean - r.generate_ms_mean)),
)


def write_plots(rows: Sequence[E2ERow], out_dir: Path) -> list[Path]:
    """`latency_breakdown.png` (per batch size: mean latency per pipeline and mode, split into
    stages) and `throughput.png` (per pipeline: requests/s against batch size, one line per mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pipelines = list(dict.fromkeys(r.pipeline for r in rows))
    batches = sorted({r.batch for r in rows})
    modes = [m.value for m in MODES if any(r.mode == m.value for r in rows)]  # those that ran
    by_key = {(r.pipeline, r.batch, r.mode): r for r in rows}
    title = f"LLM {rows[0].llm}" if rows else ""

    fig, axes = plt.subplots(len(batches), 1, figsize=(max(6, 2.2 * len(pipelines)), 3.2 * len(batches)), squeeze=False)
    width = 0.8 / len(modes)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, batch in zip(axes[:, 0], batches, strict=True):
        for m, mode in enumerate(modes):
            xs = [p + (m - (len(modes) - 1) / 2) * width for p in range(len(pipelines))]
            bottom = [0.0] * len(pipelines)
            for s, (stage, value) in enumerate(STAGES):
                heights = [value(by_key[p, batch, mode]) if (p, batch, mode) in by_key else 0.0 for p in pipelines]
                ax.bar(
                    xs,
                    heights,
                    width * 0.95,
                    bottom=bottom,
                    color=colors[s % len(colors)],
                    label=stage if m == 0 else None,
                    edgecolor="black",
                    linewidth=0.3,
                )
                bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
            for x, total in zip(xs, bottom, strict=True):
                ax.text(x, total, mode, rotation=90, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(pipelines)), pipelines)
        ax.set_ylabel("mean latency (ms)")
        ax.set_title(f"batch {batch}: latency by stage ({title}; bars: {', '.join(modes)})", fontsize=9)
        ax.margins(y=0.25)
    axes[0, 0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    breakdown = out_dir / "latency_breakdown.png"
    fig.savefig(breakdown, dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(pipelines), figsize=(3.6 * len(pipelines), 3.2), squeeze=False)
    for ax, pipeline in zip(axes[0], pipelines, strict=True):
        for mode in modes:
            points = [(b, by_key[pipeline, b, mode].throughput_rps) for b in batches if (pipeline, b, mode) in by_key]
            ax.plot([b for b, _ in points], [t for _, t in points], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch (concurrent requests)")
        ax.set_ylabel("requests/s")
        ax.set_title(pipeline, fontsize=9)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"throughput ({title})", fontsize=9)
    fig.tight_layout()
    throughput = out_dir / "throughput.png"
    fig.savefig(throughput, dpi=120)
    plt.close(fig)
    return [breakdown, throughput]

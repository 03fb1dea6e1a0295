"""The sweep as one picture: output throughput per device against interactivity.

Each point is one sweep value; moving right trades aggregate throughput for per-user speed.
This is the curve used to compare serving stacks (and to pick an operating point).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from llm_mesh.bench.benchmark_metrics import BenchmarkMetrics


def write_plot(path: str | Path, series: Mapping[str, Sequence[BenchmarkMetrics]],
               num_devices: int = 1, title: str = "") -> None:
    """One curve per named series (a server, a configuration), its points labelled."""
    import matplotlib

    matplotlib.use("Agg")  # NOTE: headless: no display on servers or in CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    all_points = []
    for name, metrics in series.items():
        points = sorted((m.interactivity, m.output_throughput / num_devices, m.label)
                        for m in metrics if m.interactivity is not None)
        if not points:
            continue
        xs, ys, _ = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", label=name)
        for x, y, label in points:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        all_points += points
    if all_points:
        if len(series) > 1:
            ax.legend()
        # Room right and above for the labels; both axes start at 0 so ratios read true.
        ax.set_xlim(0, max(p[0] for p in all_points) * 1.2)
        ax.set_ylim(0, max(p[1] for p in all_points) * 1.15)
    else:
        ax.text(0.5, 0.5, "no point with two or more output tokens", ha="center",
                transform=ax.transAxes)
    ax.set_xlabel("Interactivity: output tokens/s per user (1000 / median TPOT ms)")
    ax.set_ylabel("Output throughput: tokens/s per GPU/CPU")
    ax.set_title(title or "Throughput vs interactivity")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)

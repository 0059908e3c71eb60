"""PNG plots of a run (``fairbench --plots DIR``), drawn with matplotlib (the ``plots`` extra).

Two figures from fairbench's results: end-to-end throughput against worker processes x threads
(``e2e``), and B's wait against A's backlog (``fairness``). ``line_chart`` is the drawing both
use; ``benchmarks/compare`` draws its side-by-side figures with it too.

matplotlib is imported only when a plot is drawn, through ``importlib`` (it is optional, and
absent from the type-checking environment).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django_fairqueue.contrib.bench.harness import BenchmarkError

E2E_FILE = "fairbench-e2e.png"
FAIRNESS_FILE = "fairbench-fairness.png"


@dataclass(frozen=True)
class Series:
    label: str
    #: (x, y) points, drawn in this order
    points: Sequence[tuple[float, float]]
    style: str = "o-"


@dataclass(frozen=True)
class Chart:
    title: str
    xlabel: str
    ylabel: str
    series: Sequence[Series]
    logx: bool = False
    logy: bool = False
    #: x positions -> tick labels (e.g. "2x32"); default: matplotlib's ticks
    xticks: dict[float, str] = field(default_factory=dict)
    #: (y, label) of a dashed horizontal line, e.g. a goal
    hline: tuple[float, str] | None = None


def pyplot() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise BenchmarkError(
            "plots need matplotlib: pip install 'django-fairqueue[plots]'"
        ) from None
    matplotlib.use("Agg")  # files only, no display
    return importlib.import_module("matplotlib.pyplot")


def line_chart(chart: Chart, path: Path) -> Path:
    """Draw ``chart`` into the PNG file ``path`` (its directory is created)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    try:
        for s in chart.series:
            if not s.points:
                continue
            xs, ys = zip(*s.points, strict=True)
            ax.plot(xs, ys, s.style, label=s.label, markersize=5, linewidth=1.6)
        if chart.logx:
            ax.set_xscale("log")
        if chart.logy:
            ax.set_yscale("log")
        if chart.xticks:
            ax.set_xticks(list(chart.xticks), list(chart.xticks.values()))
            ax.minorticks_off()
        if chart.hline is not None:
            y, label = chart.hline
            ax.axhline(y, color="grey", linestyle="--", linewidth=1)
            ax.annotate(label, (0.01, y), xycoords=("axes fraction", "data"), va="bottom")
        ax.set_title(chart.title)
        ax.set_xlabel(chart.xlabel)
        ax.set_ylabel(chart.ylabel)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path


def e2e_chart(cells: Sequence[Any]) -> Chart:
    """tasks/s against processes x threads, one line per channel count (``e2e`` results)."""
    order = sorted(
        {(c.processes, c.threads, c.prefetch) for c in cells},
        key=lambda pt: (pt[0] * pt[1], pt[2]),
    )
    position = {pt: float(i) for i, pt in enumerate(order)}
    series = [
        Series(
            f"{channels} channel{'s' if channels > 1 else ''}",
            [
                (position[(c.processes, c.threads, c.prefetch)], c.rate)
                for c in sorted(cells, key=lambda c: position[(c.processes, c.threads, c.prefetch)])
                if c.channels == channels
            ],
        )
        for channels in sorted({c.channels for c in cells})
    ]
    return Chart(
        title="End-to-end no-op tasks, runfairworker",
        xlabel="worker processes x handler threads (+ prefetch)",
        ylabel="tasks/s",
        series=series,
        xticks={position[pt]: f"{pt[0]}x{pt[1]}" + (f"+{pt[2]}" if pt[2] else "") for pt in order},
    )


def fairness_chart(cells: Sequence[Any]) -> Chart:
    """B's p50 and p99 wait against A's backlog, per number of claimer processes."""
    series = []
    for processes in sorted({c.processes for c in cells}):
        mine = sorted((c for c in cells if c.processes == processes), key=lambda c: c.a_backlog)
        series.append(
            Series(f"p99, {processes} claimer(s)", [(c.a_backlog, c.b_wait_p99_ms) for c in mine])
        )
        series.append(
            Series(
                f"p50, {processes} claimer(s)",
                [(c.a_backlog, c.b_wait_p50_ms) for c in mine],
                style="s--",
            )
        )
    return Chart(
        title="B's wait for a burst of 10 behind A's backlog",
        xlabel="A's backlog (messages)",
        ylabel="B's wait (ms)",
        series=series,
        logx=True,
        hline=(50.0, "goal: p99 < 50 ms"),
    )


TIMESHARE_FILE = "fairbench-timeshare.png"


def timeshare_chart(cells: Sequence[Any], path: Path) -> Path:
    """Bars: Jain's index over worker time and over counts, by count and by time, per
    workload (the first backlog), and the small tenants' p99 wait."""
    plt = pyplot()
    first = min(c.backlog for c in cells)
    rows = [c for c in cells if c.backlog == first]
    workloads = list(dict.fromkeys(c.workload for c in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.2
    for i, (mode, metric, label) in enumerate(
        [
            ("count", "jain_time", "by count: Jain over time"),
            ("time", "jain_time", "by time: Jain over time"),
            ("count", "jain_count", "by count: Jain over counts"),
            ("time", "jain_count", "by time: Jain over counts"),
        ]
    ):
        ys = []
        for w in workloads:
            cell = next((c for c in rows if c.workload == w and c.fairness == mode), None)
            value = getattr(cell, metric) if cell is not None else None
            ys.append(value if value is not None else 0.0)
        left.bar([x + (i - 1.5) * width for x in range(len(workloads))], ys, width, label=label)
    left.axhline(0.95, linestyle="--", color="grey", linewidth=0.8)
    left.set_xticks(range(len(workloads)), workloads)
    left.set_ylim(0, 1.05)
    left.set_title(f"Jain's index (backlog {first:,})")
    left.legend(fontsize=7, loc="lower left")
    waits = [
        w
        for w in workloads
        if any(c.small_wait_p99_ms is not None for c in rows if c.workload == w)
    ]
    for i, mode in enumerate(("count", "time")):
        ys = []
        for w in waits:
            cell = next(
                (
                    c
                    for c in cells
                    if c.workload == w
                    and c.fairness == mode
                    and c.backlog == max(x.backlog for x in cells if x.workload == w)
                ),
                None,
            )
            ys.append(cell.small_wait_p99_ms if cell is not None else 0.0)
        right.bar([x + (i - 0.5) * 0.35 for x in range(len(waits))], ys, 0.35, label=f"by {mode}")
    right.set_xticks(range(len(waits)), waits)
    right.set_yscale("log")
    right.axhline(50, linestyle="--", color="grey", linewidth=0.8)
    right.set_title("small tenant's p99 wait, ms (largest backlog run)")
    right.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(results: Mapping[str, Sequence[Any]], directory: Path) -> list[Path]:
    """The plots the scenarios in ``results`` (name -> cells) allow; the files written."""
    written = []
    if results.get("e2e"):
        written.append(line_chart(e2e_chart(results["e2e"]), directory / E2E_FILE))
    if results.get("fairness"):
        written.append(line_chart(fairness_chart(results["fairness"]), directory / FAIRNESS_FILE))
    if results.get("timeshare"):
        written.append(timeshare_chart(results["timeshare"], directory / TIMESHARE_FILE))
    return written

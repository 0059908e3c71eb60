"""Claim latency against the backlog size and the number of channels, in one process.

Every sample is one ``claim_messages(batch)`` call, timed alone; then, untimed, the claimed
messages are completed and as many new ones enqueued to the same channels, so the backlog stays
at its size for the whole cell and the claim keeps folding fresh enqueue deltas as it does in
steady traffic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

from django_fairqueue.api import EnqueueRequest, enqueue_many
from django_fairqueue.contrib.bench.figures import median, percentile
from django_fairqueue.contrib.bench.harness import Bench, load1
from django_fairqueue.contrib.bench.scenario import Column, Scenario, relative_to_first
from django_fairqueue.contrib.bench.sizes import Sizes
from django_fairqueue.contrib.bench.tasks import NOOP_TASK_NAME
from django_fairqueue.db import message_store

LEASE = timedelta(minutes=10)
WORKER_ID = "fairbench-latency"


@dataclass(frozen=True)
class LatencyCell:
    #: "backlog" (backlog grows, channels fixed) or "channels" (channels grow, backlog fixed)
    series: str
    backlog: int
    channels: int

    @property
    def label(self) -> str:
        return f"claim latency  backlog {self.backlog:>9,}  channels {self.channels:>6,}"


@dataclass(frozen=True)
class LatencyResult:
    series: str
    backlog: int
    channels: int
    batch: int
    samples: int
    claim_p50_ms: float
    claim_p95_ms: float
    claim_max_ms: float
    complete_p50_ms: float
    #: average messages and distinct channels per claim
    per_claim: float
    channels_per_claim: float
    #: claim p50 relative to the first cell of the same series
    vs_first: float | None
    load_seconds: float
    load1: float


def plan(sizes: Sizes) -> list[LatencyCell]:
    cells = [
        LatencyCell("backlog", n, sizes.latency_backlog_channels) for n in sizes.latency_backlogs
    ]
    cells += [
        LatencyCell("channels", sizes.latency_channel_backlog, k)
        for k in sizes.latency_channel_counts
    ]
    return cells


def run(bench: Bench, cell: LatencyCell) -> LatencyResult:
    sizes = bench.sizes
    using = bench.using
    load = load1()
    bench.reset()
    names = [f"tenant-{i:05d}" for i in range(cell.channels)]
    load_seconds = bench.load(names, cell.backlog)

    claim_ms: list[float] = []
    complete_ms: list[float] = []
    got_counts: list[int] = []
    channel_counts: list[int] = []
    total = sizes.latency_warmup + sizes.latency_samples
    for i in range(total):
        began = time.perf_counter()
        got = message_store.claim_messages(
            sizes.latency_batch, lease=LEASE, worker_id=WORKER_ID, using=using
        )
        claimed = time.perf_counter()
        message_store.complete_messages([(m.id, m.lease_token, None) for m in got], using=using)
        completed = time.perf_counter()
        # Put back what was taken, to the same channels: the backlog stays at its size.
        enqueue_many(EnqueueRequest(NOOP_TASK_NAME, channel=m.channel) for m in got)
        if i >= sizes.latency_warmup:
            claim_ms.append(1000 * (claimed - began))
            complete_ms.append(1000 * (completed - claimed))
            got_counts.append(len(got))
            channel_counts.append(len({m.channel_id for m in got}))
        if i % 10 == 0:
            bench.progress.update(f"{i}/{total} claims", i / total)
    bench.reset()
    return LatencyResult(
        series=cell.series,
        backlog=cell.backlog,
        channels=cell.channels,
        batch=sizes.latency_batch,
        samples=len(claim_ms),
        claim_p50_ms=round(median(claim_ms), 3),
        claim_p95_ms=round(percentile(claim_ms, 95), 3),
        claim_max_ms=round(max(claim_ms), 3),
        complete_p50_ms=round(median(complete_ms), 3),
        per_claim=round(sum(got_counts) / len(got_counts), 1),
        channels_per_claim=round(sum(channel_counts) / len(channel_counts), 1),
        vs_first=None,
        load_seconds=round(load_seconds, 2),
        load1=round(load, 2),
    )


def finish(results: list[LatencyResult]) -> list[LatencyResult]:
    return relative_to_first(results, group="series", value="claim_p50_ms", into="vs_first")


SCENARIO = Scenario(
    name="latency",
    title="Claim latency (ms per claim_messages call)",
    plan=plan,
    run=run,
    finish=finish,
    columns=(
        Column("series", "series"),
        Column("backlog", "backlog", ","),
        Column("channels", "channels", ","),
        Column("batch", "batch"),
        Column("p50 ms", "claim_p50_ms", ".2f"),
        Column("p95 ms", "claim_p95_ms", ".2f"),
        Column("max ms", "claim_max_ms", ".2f"),
        Column("x first", "vs_first", ".2f"),
        Column("msgs/claim", "per_claim", ".0f"),
        Column("ch/claim", "channels_per_claim", ".1f"),
        Column("complete p50", "complete_p50_ms", ".2f"),
        Column("samples", "samples"),
        Column("load s", "load_seconds", ".1f"),
    ),
    summary=lambda r: f"p50 {r.claim_p50_ms:.2f} ms, p95 {r.claim_p95_ms:.2f} ms",
    key=("series", "backlog", "channels"),
    metric="claim_p50_ms",
    higher_is_better=False,
    notes=(
        "One process, no concurrency. Each sample is one claim_messages(batch) call timed in "
        "Python (network round trip included); completing and re-enqueueing what it claimed "
        "(keeping the backlog constant) is not timed. x first: p50 over the series' first cell.",
        "load s: seconds to bulk-load the backlog (INSERT ... SELECT generate_series, fold, "
        "ANALYZE).",
    ),
)

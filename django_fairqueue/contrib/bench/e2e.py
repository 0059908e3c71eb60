"""End-to-end throughput: no-op tasks through real ``runfairworker --burst`` processes.

Each cell bulk-loads a backlog of no-op messages over its channels, starts P worker processes
with T handler threads each (``runfairworker --burst --concurrency T --batch-size B
--prefetch F``), and polls the channel counters until every message has succeeded. Unlike
``claim``, this includes everything a worker does per message: decoding, looking the task up,
running it on a handler thread, settling results in batches, heartbeats and maintenance.

A claim never takes more messages than the process has free threads plus F, so with T threads
and no prefetch a claim takes at most T messages: few threads means small claims.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from django_fairqueue.contrib.bench.claim import channel_names
from django_fairqueue.contrib.bench.harness import START_TIMEOUT, Bench, BenchmarkError, load1
from django_fairqueue.contrib.bench.scenario import Column, Scenario
from django_fairqueue.contrib.bench.sizes import Sizes
from django_fairqueue.contrib.bench.workerproc import Fleet
from django_fairqueue.db import channel_store

#: Seconds between two reads of the channel counters.
POLL = 0.02
#: The steady rate is measured between these fractions of the backlog done (startup and the
#: drain's tail excluded).
STEADY = (0.1, 0.9)
#: Seconds a cell may run beyond its expected time before it is abandoned.
SLACK = 120.0


@dataclass(frozen=True)
class E2ECell:
    channels: int
    processes: int
    threads: int
    #: ``runfairworker --prefetch``: messages a claim may take beyond the free threads
    prefetch: int = 0

    @property
    def label(self) -> str:
        extra = f" +{self.prefetch} prefetch" if self.prefetch else ""
        return (
            f"end to end {self.channels:>3} ch  {self.processes} proc x {self.threads:>2} "
            f"threads{extra}"
        )


@dataclass(frozen=True)
class E2EResult:
    channels: int
    processes: int
    threads: int
    prefetch: int
    batch: int
    #: tasks/s while 10% to 90% of the backlog was done
    rate: float
    #: tasks/s from the first finished task to the last
    drain_rate: float
    backlog: int
    #: seconds from starting the processes to the first finished task (Django start-up)
    startup_s: float
    #: seconds from the first finished task to the last
    drain_s: float
    #: seconds from starting the processes until all had exited
    wall_s: float
    failed: int
    load1: float
    #: the fastest cell of its channel count (set once every cell has run)
    best: bool = False


def plan(sizes: Sizes) -> list[E2ECell]:
    return [
        E2ECell(channels, processes, threads, prefetch)
        for channels in sizes.e2e_channels
        for processes, threads, prefetch in sizes.e2e_workers
    ]


def finish(results: list[E2EResult]) -> list[E2EResult]:
    """Mark the fastest cell of each channel count."""
    best: dict[int, float] = {}
    for r in results:
        best[r.channels] = max(best.get(r.channels, 0.0), r.rate)
    return [replace(r, best=r.rate == best[r.channels]) for r in results]


def _backlog(bench: Bench, cell: E2ECell) -> int:
    """Enough to drain in about ``duration``, guessed from the previous cell with as many
    channels: its rate scaled by the ratio of handler threads (an overestimate at many threads,
    which only lengthens the cell)."""
    sizes = bench.sizes
    previous: dict[int, tuple[float, int]] = bench.state.setdefault("e2e.rate", {})
    rate, threads = previous.get(cell.channels, (sizes.e2e_first_guess, 1))
    guess = rate * cell.processes * cell.threads / threads
    wanted = math.ceil(guess * sizes.duration)
    return max(sizes.e2e_min_backlog, min(sizes.e2e_max_backlog, wanted))


def run(bench: Bench, cell: E2ECell) -> E2EResult:
    sizes = bench.sizes
    using = bench.using
    load = load1()
    bench.reset()
    names = channel_names(cell.channels)
    backlog = _backlog(bench, cell)
    bench.load(names, backlog)
    ids = list(channel_store.select_channel_ids(names, using=using).values())
    args = [
        "--burst",
        "--concurrency",
        str(cell.threads),
        "--batch-size",
        str(sizes.e2e_batch),
        "--verbosity",
        "0",
        "--prefetch",
        str(cell.prefetch),
    ]
    samples: list[tuple[float, int]] = []  # (seconds since start, tasks done)
    failed = 0
    with Fleet(using, cell.processes, args) as fleet:
        began = fleet.started
        deadline = began + START_TIMEOUT + SLACK + 10 * backlog / sizes.e2e_first_guess
        while True:
            rows = channel_store.select_channel_counters(ids, using=using)
            now = time.perf_counter()
            failed = sum(r.failed for r in rows)
            done = sum(r.succeeded for r in rows) + failed
            samples.append((now - began, done))
            bench.progress.update(f"{done:,}/{backlog:,} done", done / backlog)
            if done >= backlog:
                break
            fleet.check()
            if fleet.all_exited():
                raise BenchmarkError(f"the workers exited with {backlog - done:,} tasks left")
            if now > deadline:
                raise BenchmarkError(f"the workers did not drain {backlog:,} tasks in time")
            time.sleep(POLL)
        for worker in fleet.workers:
            worker.wait(SLACK)
        fleet.check()
        wall = time.perf_counter() - began
    bench.reset()

    first = next(t for t, d in samples if d > 0)
    last = samples[-1][0]
    low = next((t, d) for t, d in samples if d >= STEADY[0] * backlog)
    high = next((t, d) for t, d in samples if d >= STEADY[1] * backlog)
    steady = (high[1] - low[1]) / (high[0] - low[0]) if high[0] > low[0] else math.nan
    # Drained between two reads of the counters: the poll interval bounds the time.
    drain = backlog / max(last - first, POLL)
    rate = steady if not math.isnan(steady) else drain
    previous = bench.state.setdefault("e2e.rate", {})
    previous[cell.channels] = (max(rate, drain, 1.0), cell.processes * cell.threads)
    return E2EResult(
        channels=cell.channels,
        processes=cell.processes,
        threads=cell.threads,
        prefetch=cell.prefetch,
        batch=sizes.e2e_batch,
        rate=round(rate, 1),
        drain_rate=round(drain, 1),
        backlog=backlog,
        startup_s=round(first, 2),
        drain_s=round(last - first, 2),
        wall_s=round(wall, 2),
        failed=failed,
        load1=round(load, 2),
    )


SCENARIO = Scenario(
    name="e2e",
    title="End-to-end no-op task throughput, real runfairworker processes (tasks/s)",
    plan=plan,
    run=run,
    finish=finish,
    columns=(
        Column("channels", "channels"),
        Column("processes", "processes"),
        Column("threads", "threads"),
        Column("prefetch", "prefetch"),
        Column("tasks/s", "rate", ",.0f"),
        Column("drain tasks/s", "drain_rate", ",.0f"),
        Column("backlog", "backlog", ","),
        Column("start-up s", "startup_s", ".2f"),
        Column("drain s", "drain_s", ".2f"),
        Column("wall s", "wall_s", ".1f"),
        Column("failed", "failed", ","),
        Column("best", "best"),
    ),
    summary=lambda r: f"{r.rate:,.0f} tasks/s ({r.drain_rate:,.0f} over the whole drain)",
    key=("channels", "processes", "threads", "prefetch"),
    metric="rate",
    notes=(
        "P `runfairworker --burst --concurrency T --batch-size 100 --prefetch F` subprocesses "
        "drain a bulk-loaded backlog of no-op tasks; the benchmark reads the channel counters "
        f"every {POLL * 1000:.0f} ms until all have succeeded.",
        "tasks/s: while 10% to 90% of the backlog was done (start-up and the drain's tail "
        "excluded); drain tasks/s: from the first finished task to the last.",
        "A claim takes at most as many messages as the process has free threads plus "
        "--prefetch (leased, heartbeated, counted against the caps while they wait): with T "
        "threads and no prefetch, claims of at most T messages, whatever --batch-size says.",
        "start-up s: process start to the first finished task (Python, Django, connections).",
        "best: the fastest processes x threads (x prefetch) of each channel count.",
    ),
)

"""Claim latency while another session holds an old snapshot (docs/reliability.md, scenario 5).

A snapshot held open (``pg_dump``, an analytics query, a session left idle in transaction)
stops every cleanup of row versions newer than it: no VACUUM, no page pruning, no marking of
dead index entries. The queue writes new versions all the time (each claim updates its
channel rows, each settlement deletes a message and inserts a counter delta), so while the
snapshot lasts, every claim walks past more of them.

One cell: a few channels with a standing backlog; with the snapshot held (or, for the
``none`` series, without one) ``cycles`` untimed cycles run, each enqueueing one message,
claiming one and completing it, as steady traffic would; then ``samples`` more cycles are run
with their claim timed. The ``held`` series shows how a claim's cost grows with the traffic
since the snapshot began; the ``none`` series, the same traffic without it, is the control.
Over the timed cycles the scenario also counts the index entries the queue's statements read
(``pg_stat_user_indexes``), live and dead, per cycle, and names the index read most: where a
claim under an old snapshot spends its time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

from django_fairqueue.api import EnqueueRequest, enqueue_many
from django_fairqueue.contrib.bench import db
from django_fairqueue.contrib.bench.figures import median, percentile
from django_fairqueue.contrib.bench.harness import Bench, BenchmarkError, load1
from django_fairqueue.contrib.bench.scenario import Column, Scenario, relative_to_first
from django_fairqueue.contrib.bench.sizes import Sizes
from django_fairqueue.contrib.bench.tasks import NOOP_TASK_NAME
from django_fairqueue.db import message_store

LEASE = timedelta(minutes=10)
WORKER_ID = "fairbench-snapshot"


@dataclass(frozen=True)
class SnapshotCell:
    #: "held" (an old snapshot open during the cycles) or "none" (the control)
    series: str
    #: claim cycles run (untimed) since the snapshot began, before the timed ones
    cycles: int

    @property
    def label(self) -> str:
        return f"old snapshot  {self.series:<4}  after {self.cycles:>7,} cycles"


@dataclass(frozen=True)
class SnapshotResult:
    series: str
    cycles: int
    channels: int
    samples: int
    claim_p50_ms: float
    claim_p95_ms: float
    #: claim p50 relative to the first cell run of the series (the fewest cycles)
    vs_first: float | None
    #: untimed cycles per second (enqueue + claim + complete, one process)
    cycles_per_second: float
    #: index entries read per timed cycle (enqueue, claim, complete), over every queue index
    index_reads_per_cycle: float
    #: the index read most over the timed cycles, with its share of those reads
    most_read_index: str
    #: index entries read per timed cycle, by index (the JSON report's breakdown)
    index_reads: dict[str, float]
    load1: float


def plan(sizes: Sizes) -> list[SnapshotCell]:
    cells = [SnapshotCell("held", n) for n in sizes.snapshot_cycles]
    cells += [
        SnapshotCell("none", n) for n in (min(sizes.snapshot_cycles), max(sizes.snapshot_cycles))
    ]
    return cells


def _cycle(bench: Bench, channels: list[str], i: int) -> float:
    """Enqueue one message, claim one, complete it; returns the claim's milliseconds."""
    enqueue_many([EnqueueRequest(NOOP_TASK_NAME, channel=channels[i % len(channels)])])
    began = time.perf_counter()
    got = message_store.claim_messages(1, lease=LEASE, worker_id=WORKER_ID, using=bench.using)
    claimed = time.perf_counter()
    if not got:
        raise BenchmarkError("snapshot: a claim came back empty with a standing backlog")
    message_store.complete_messages([(m.id, m.lease_token, None) for m in got], using=bench.using)
    return 1000 * (claimed - began)


@dataclass(frozen=True)
class TimedCycles:
    claim_ms: list[float]
    #: untimed cycles per second
    per_second: float
    #: index entries read per timed cycle, by index
    index_reads: dict[str, float]


def _run_cycles(bench: Bench, channels: list[str], cell: SnapshotCell) -> TimedCycles:
    sizes = bench.sizes
    began = time.perf_counter()
    for i in range(cell.cycles):
        _cycle(bench, channels, i)
        if i % 200 == 0:
            bench.progress.update(f"{i:,}/{cell.cycles:,} cycles", i / cell.cycles)
    per_second = cell.cycles / (time.perf_counter() - began) if cell.cycles else 0.0
    db.force_stats_flush(using=bench.using)  # every statement's reads so far are counted
    before = db.select_index_reads(using=bench.using)
    claim_ms = [_cycle(bench, channels, cell.cycles + i) for i in range(sizes.snapshot_samples)]
    db.force_stats_flush(using=bench.using)
    after = db.select_index_reads(using=bench.using)
    reads = {
        name: (read - before.get(name, 0)) / len(claim_ms)
        for name, read in after.items()
        if read > before.get(name, 0)
    }
    return TimedCycles(claim_ms, per_second, reads)


def _most_read(reads: dict[str, float]) -> str:
    if not reads:
        return "-"
    name = max(reads, key=lambda n: reads[n])
    return f"{name} {100 * reads[name] / sum(reads.values()):.0f}%"


def run(bench: Bench, cell: SnapshotCell) -> SnapshotResult:
    sizes = bench.sizes
    load = load1()
    bench.reset()
    channels = [f"tenant-{i:02d}" for i in range(sizes.snapshot_channels)]
    bench.load(channels, sizes.snapshot_backlog)
    if cell.series == "held":
        with db.hold_old_snapshot(using=bench.using) as pid:
            timed = _run_cycles(bench, channels, cell)
            # A snapshot that was not really held would make these figures the control's.
            if not db.select_backend_holds_xmin(pid, using=bench.using):
                raise BenchmarkError(
                    "snapshot: the old snapshot did not hold back the xmin horizon"
                )
    else:
        timed = _run_cycles(bench, channels, cell)
    bench.reset()
    claim_ms = timed.claim_ms
    return SnapshotResult(
        series=cell.series,
        cycles=cell.cycles,
        channels=sizes.snapshot_channels,
        samples=len(claim_ms),
        claim_p50_ms=round(median(claim_ms), 3),
        claim_p95_ms=round(percentile(claim_ms, 95), 3),
        vs_first=None,
        cycles_per_second=round(timed.per_second, 1),
        index_reads_per_cycle=round(sum(timed.index_reads.values()), 1),
        most_read_index=_most_read(timed.index_reads),
        index_reads={
            name: round(read, 1)
            for name, read in sorted(timed.index_reads.items(), key=lambda kv: -kv[1])
        },
        load1=round(load, 2),
    )


def finish(results: list[SnapshotResult]) -> list[SnapshotResult]:
    return relative_to_first(results, group="series", value="claim_p50_ms", into="vs_first")


SCENARIO = Scenario(
    name="snapshot",
    title="Claim latency under an old snapshot (ms per claim of 1)",
    plan=plan,
    run=run,
    finish=finish,
    columns=(
        Column("series", "series"),
        Column("cycles", "cycles", ","),
        Column("channels", "channels"),
        Column("p50 ms", "claim_p50_ms", ".2f"),
        Column("p95 ms", "claim_p95_ms", ".2f"),
        Column("x first", "vs_first", ".2f"),
        Column("cycles/s", "cycles_per_second", ",.0f"),
        Column("index reads/cycle", "index_reads_per_cycle", ",.0f"),
        Column("read most", "most_read_index"),
        Column("samples", "samples"),
    ),
    summary=lambda r: f"p50 {r.claim_p50_ms:.2f} ms ({r.series})",
    key=("series", "cycles"),
    metric="claim_p50_ms",
    higher_is_better=False,
    notes=(
        "held: a REPEATABLE READ session keeps its snapshot while `cycles` cycles (enqueue 1, "
        "claim 1, complete; one process) run, then the claims of `samples` more are timed. "
        "none: the same traffic without the snapshot, the control.",
        "Nothing newer than the snapshot can be cleaned up, so each claim walks past every "
        "channel row version and counter delta written since it began.",
        "index reads/cycle: index entries the timed cycles' statements read, live and dead "
        "(pg_stat_user_indexes), per cycle; read most: the index read most, with its share.",
    ),
)

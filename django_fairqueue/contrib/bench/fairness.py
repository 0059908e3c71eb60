"""Fairness: tenant A has a large backlog, tenant B enqueues a small burst. How long does B wait?

A's backlog is bulk-loaded, then claimer processes start draining it (claim a batch, complete
it). Once they run, B enqueues ``burst`` messages in one transaction, several rounds apart. B's
wait is the time from the message's ``enqueued_at`` (the server's clock at enqueue) to the
moment the claim that took it returned (the claimer's clock: the same machine, so one clock).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.synchronize import Barrier, Event
from typing import Any

from django_fairqueue.api import EnqueueRequest, enqueue_many
from django_fairqueue.contrib.bench.figures import jain_index, median, percentile
from django_fairqueue.contrib.bench.harness import START_TIMEOUT, Bench, BenchmarkError, load1
from django_fairqueue.contrib.bench.scenario import Column, Scenario
from django_fairqueue.contrib.bench.sizes import Sizes
from django_fairqueue.contrib.bench.tasks import NOOP_TASK_NAME
from django_fairqueue.db import message_store

LEASE = timedelta(minutes=10)
A = "tenant-a"
B = "tenant-b"
#: A burst not fully claimed within this many seconds fails the cell.
SERVE_TIMEOUT = 30.0


@dataclass(frozen=True)
class FairnessCell:
    a_backlog: int
    processes: int

    @property
    def label(self) -> str:
        return f"fairness  A backlog {self.a_backlog:>9,}  x{self.processes}"


@dataclass(frozen=True)
class FairnessResult:
    a_backlog: int
    processes: int
    batch: int
    burst: int
    rounds: int
    b_wait_p50_ms: float
    b_wait_p99_ms: float
    b_wait_max_ms: float
    #: the most A messages claimed while a burst waited: by the claims made after its commit
    #: (:func:`burst_figures`) that returned by the claim of its last message
    a_before_b_max: int
    #: the most non-empty claim calls (all processes) among those claims
    claims_before_b_max: int
    #: Jain's fairness index over the first 2 x burst messages of the claims made after B's
    #: commit (1.0: equal shares; 0.5: one tenant took everything), the lowest of the rounds
    jain_min: float
    #: A's throughput over the cell (messages/s)
    a_rate: float
    a_left: int
    load1: float


def plan(sizes: Sizes) -> list[FairnessCell]:
    return [FairnessCell(n, p) for n in sizes.fairness_backlogs for p in sizes.fairness_processes]


#: One claim call: (started, returned, A messages, [(B id, enqueued_at, returned)]).
Record = tuple[float, float, int, list[tuple[int, float, float]]]


def _worker(
    index: int, using: str, batch: int, served: Any, stop: Event, start: Barrier
) -> list[Record]:
    """Claim until told to stop; returns a record per claim call."""
    worker_id = f"fairbench-{os.getpid()}"
    records: list[Record] = []
    start.wait(START_TIMEOUT)
    while not stop.is_set():
        started = time.time()
        got = message_store.claim_messages(batch, lease=LEASE, worker_id=worker_id, using=using)
        returned = time.time()
        if got:
            message_store.complete_messages([(m.id, m.lease_token, None) for m in got], using=using)
        bs = [(m.id, m.enqueued_at.timestamp(), returned) for m in got if m.channel == B]
        if bs:
            with served.get_lock():
                served.value += len(bs)
        records.append((started, returned, sum(1 for m in got if m.channel == A), bs))
    return records


def _after_commit(record: Record, committed: float, ids: set[int]) -> bool:
    """Whether a claim counts as made after B's commit: it started once the commit had returned
    (``committed``, read just after), or it took some of B's messages ``ids`` (so it ran after
    the commit, though it started before that reading). One definition for every column."""
    return record[0] >= committed or any(bid in ids for bid, _, _ in record[3])


@dataclass(frozen=True)
class BurstFigures:
    """One burst's figures, all over the claims made after its commit."""

    #: per message of the burst: enqueued_at -> the return of the claim that took it
    waits_ms: list[float]
    #: A messages, and non-empty claims, from B's commit to the claim of its last message
    a_before: int
    claims: int
    #: Jain's index over the first 2 x burst messages those claims took
    jain: float


def burst_figures(records: list[Record], ids: list[int], committed: float) -> BurstFigures:
    """The figures of the burst ``ids`` whose commit returned at ``committed``.

    The claims after the commit, in the order they returned: those up to the one that took B's
    last message are what B waited for; Jain's index runs over the same claims, continued
    until 2 x burst messages (both tenants had ready messages, so a fair queue gives B about
    half, all of its burst; first in, first out gives A all of them). A claim counts B's
    messages before A's: the last one counts in part, A's messages after B's within it.
    """
    wanted = set(ids)
    after = sorted((r for r in records if _after_commit(r, committed, wanted)), key=lambda r: r[1])
    taken = {bid: (enq, ret) for r in after for bid, enq, ret in r[3] if bid in wanted}
    last = max(ret for _, ret in taken.values())
    window = [r for r in after if r[1] <= last]
    a = b = 0
    for record in after:
        room = 2 * len(ids) - a - b
        if room <= 0:
            break
        took_b = min(len(record[3]), room)
        b += took_b
        a += min(record[2], room - took_b)
    return BurstFigures(
        waits_ms=[1000 * (taken[i][1] - taken[i][0]) for i in ids],
        a_before=sum(r[2] for r in window),
        # Empty claims (a peer held the channels) served nobody: they do not count.
        claims=sum(1 for r in window if r[2] or r[3]),
        jain=jain_index([a, b]),
    )


def run(bench: Bench, cell: FairnessCell) -> FairnessResult:
    sizes = bench.sizes
    load = load1()
    bench.reset()
    bench.load([A], cell.a_backlog)
    bursts: list[tuple[list[int], float]] = []  # (B's ids, when their commit returned)
    with bench.processes() as group:
        served = group.ctx.Value("i", 0)
        stop = group.event()
        start = group.barrier(cell.processes + 1)
        group.start(cell.processes, _worker, bench.using, sizes.fairness_batch, served, stop, start)
        start.wait(START_TIMEOUT)
        began = time.time()
        time.sleep(sizes.fairness_pause)
        for r in range(sizes.fairness_rounds):
            bench.progress.update(
                f"burst {r + 1}/{sizes.fairness_rounds}", r / sizes.fairness_rounds
            )
            ids = enqueue_many(
                EnqueueRequest(NOOP_TASK_NAME, (r, j), channel=B)
                for j in range(sizes.fairness_burst)
            )
            bursts.append((ids, time.time()))
            deadline = time.monotonic() + SERVE_TIMEOUT
            while served.value < sizes.fairness_burst * (r + 1):
                if time.monotonic() > deadline:
                    raise BenchmarkError(
                        f"B's burst {r + 1} was not claimed within {SERVE_TIMEOUT:.0f}s "
                        f"({served.value - sizes.fairness_burst * r} of {sizes.fairness_burst})"
                    )
                time.sleep(0.001)
            time.sleep(sizes.fairness_pause)
        stop.set()
        records = [rec for out in group.collect(timeout=START_TIMEOUT) for rec in out]
    ended = max((rec[1] for rec in records), default=time.time())

    figures = [burst_figures(records, ids, committed) for ids, committed in bursts]
    waits_ms = [w for f in figures for w in f.waits_ms]
    a_claimed = sum(rec[2] for rec in records)
    bench.reset()
    return FairnessResult(
        a_backlog=cell.a_backlog,
        processes=cell.processes,
        batch=sizes.fairness_batch,
        burst=sizes.fairness_burst,
        rounds=len(bursts),
        b_wait_p50_ms=round(median(waits_ms), 2),
        b_wait_p99_ms=round(percentile(waits_ms, 99), 2),
        b_wait_max_ms=round(max(waits_ms), 2),
        a_before_b_max=max(f.a_before for f in figures),
        claims_before_b_max=max(f.claims for f in figures),
        jain_min=round(min(f.jain for f in figures), 3),
        a_rate=round(a_claimed / (ended - began), 1) if ended > began else 0.0,
        a_left=cell.a_backlog - a_claimed,
        load1=round(load, 2),
    )


SCENARIO = Scenario(
    name="fairness",
    title="Fairness: A's backlog, then B's burst (B's wait, ms)",
    plan=plan,
    run=run,
    columns=(
        Column("A backlog", "a_backlog", ","),
        Column("processes", "processes"),
        Column("batch", "batch"),
        Column("B burst", "burst"),
        Column("rounds", "rounds"),
        Column("B p50 ms", "b_wait_p50_ms", ".1f"),
        Column("B p99 ms", "b_wait_p99_ms", ".1f"),
        Column("B max ms", "b_wait_max_ms", ".1f"),
        Column("A before B", "a_before_b_max", ","),
        Column("claims", "claims_before_b_max"),
        Column("Jain", "jain_min", ".3f"),
        Column("A msgs/s", "a_rate", ",.0f"),
        Column("A left", "a_left", ","),
    ),
    summary=lambda r: f"B p50 {r.b_wait_p50_ms:.1f} ms, p99 {r.b_wait_p99_ms:.1f} ms",
    key=("a_backlog", "processes"),
    metric="b_wait_p99_ms",
    higher_is_better=False,
    notes=(
        "Claimer processes loop claim_messages(batch) -> complete on A's backlog; B then "
        "enqueues its burst in one transaction, once per round. B's wait: enqueued_at -> the "
        "return of the claim that took it.",
        "Claims after B's commit: those that started once its commit had returned, and those "
        "that took its messages. A before B / claims: over the rounds, the most A messages "
        "(non-empty claim calls) a burst waited for: the claims after its commit that returned "
        "by the claim of its last message.",
        "Jain: Jain's index over the first 2 x burst messages taken by the same claims, in the "
        "order they returned (both tenants had work then), (a + b)^2 / (2 (a^2 + b^2)); 1 is an "
        "equal split, 0.5 one tenant served alone; the worst round.",
        "A left: A's messages still queued at the end (0 would mean B was measured on an "
        "idle queue).",
    ),
)

"""Pickup latency at low load: sending the enqueue's COMMIT to handler start, one idle worker.

One ``runfairworker --concurrency 1`` process waits on an empty queue. The benchmark enqueues
one message at a time in a transaction of its own, reads ``time.time()`` just before sending the
COMMIT (:func:`enqueue_stamped`), waits for the message to succeed, pauses, and enqueues the
next. The pause (random, at least ``pickup_pause``) outlasts the worker's quick re-claims after a
message, so each message finds it idle. The task returns ``time.time()`` when its handler starts
(kept as the message's result), so the latency is the difference of two readings of the same
machine's clock: it includes the commit, and it cannot be negative (no worker sees the message
before its commit), however late a busy client gets back from it. With LISTEN the commit's
NOTIFY wakes the worker; with ``--no-listen`` it finds the message at its next poll.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from django.db import transaction

from django_fairqueue.api import enqueue
from django_fairqueue.contrib.bench.figures import median, percentile
from django_fairqueue.contrib.bench.harness import START_TIMEOUT, Bench, BenchmarkError, load1
from django_fairqueue.contrib.bench.scenario import Column, Scenario
from django_fairqueue.contrib.bench.sizes import Sizes
from django_fairqueue.contrib.bench.tasks import STAMP_TASK_NAME
from django_fairqueue.contrib.bench.workerproc import Fleet
from django_fairqueue.models import Message, MessageState

CHANNEL = "fairbench-pickup"
#: Seconds between two looks at whether the message has run, and before the first.
POLL = 0.005
FIRST_LOOK = 0.02


@dataclass(frozen=True)
class PickupCell:
    #: "listen" (LISTEN/NOTIFY wake-ups, the default) or "poll" (``--no-listen``)
    mode: str

    @property
    def label(self) -> str:
        return f"pickup latency  {'LISTEN' if self.mode == 'listen' else 'polling only'}"


@dataclass(frozen=True)
class PickupResult:
    mode: str
    poll_interval: float
    samples: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    min_ms: float
    load1: float


def plan(sizes: Sizes) -> list[PickupCell]:
    return [PickupCell(mode) for mode in sizes.pickup_modes]


def _started_at(using: str, message_id: int) -> float | None:
    """The handler's start time (the task's result), once the message has succeeded."""
    row = (
        Message.objects.using(using)
        .filter(pk=message_id, state=MessageState.SUCCEEDED)
        .values_list("result", flat=True)
        .first()
    )
    return float(row) if row is not None else None


def enqueue_stamped(using: str, clock: Callable[[], float] = time.time) -> tuple[int, float]:
    """Enqueue one message in a transaction of its own: its id, and ``clock()`` read just
    before the COMMIT is sent.

    Read after the commit returned, the stamp could come after the handler's start (a busy
    client gets the CPU back late) and the latency would read negative.
    """
    with transaction.atomic(using=using):
        message_id = enqueue(STAMP_TASK_NAME, channel=CHANNEL)
        committing = clock()
    return message_id, committing


def _one(using: str, timeout: float) -> float:
    """Enqueue one message and wait until it has run; the latency in seconds.

    The first look is after ``FIRST_LOOK``: reading the result sooner would only take CPU the
    worker needs (the handler stamps its own start, whenever the benchmark looks).
    """
    message_id, committing = enqueue_stamped(using)
    time.sleep(FIRST_LOOK)
    deadline = time.monotonic() + timeout
    while True:
        started = _started_at(using, message_id)
        if started is not None:
            return started - committing
        if time.monotonic() > deadline:
            raise BenchmarkError(f"message {message_id} did not run within {timeout:.0f}s")
        time.sleep(POLL)


def run(bench: Bench, cell: PickupCell) -> PickupResult:
    sizes = bench.sizes
    using = bench.using
    load = load1()
    bench.reset()
    args = ["--concurrency", "1", "--poll-interval", str(sizes.pickup_poll_interval)]
    args += ["--verbosity", "0"]
    if cell.mode == "poll":
        args.append("--no-listen")
    count = sizes.pickup_samples if cell.mode == "listen" else sizes.pickup_poll_samples
    timeout = 10 * sizes.pickup_poll_interval + 5
    # Random pauses: enqueues arrive at a random point of the worker's poll cycle.
    jitter = random.Random(0)
    spread = sizes.pickup_poll_interval if cell.mode == "poll" else sizes.pickup_pause
    latencies: list[float] = []
    with Fleet(using, 1, args) as fleet:
        # The first message waits for the worker to start; the rest warm it up.
        _one(using, START_TIMEOUT)
        for i in range(sizes.pickup_warmup + count):
            time.sleep(sizes.pickup_pause + jitter.uniform(0, spread))
            latency = _one(using, timeout)
            if i >= sizes.pickup_warmup:
                latencies.append(latency)
            bench.progress.update(f"{i + 1}/{count} messages", (i + 1) / count)
        fleet.check()
    bench.reset()
    ms = [1000 * x for x in latencies]
    return PickupResult(
        mode=cell.mode,
        poll_interval=sizes.pickup_poll_interval,
        samples=len(ms),
        p50_ms=round(median(ms), 2),
        p90_ms=round(percentile(ms, 90), 2),
        p99_ms=round(percentile(ms, 99), 2),
        max_ms=round(max(ms), 2),
        min_ms=round(min(ms), 2),
        load1=round(load, 2),
    )


SCENARIO = Scenario(
    name="pickup",
    title="Pickup latency at low load: enqueue's COMMIT sent to handler start (ms)",
    plan=plan,
    run=run,
    columns=(
        Column("mode", "mode"),
        Column("poll s", "poll_interval", ".1f"),
        Column("p50 ms", "p50_ms", ".2f"),
        Column("p90 ms", "p90_ms", ".2f"),
        Column("p99 ms", "p99_ms", ".2f"),
        Column("max ms", "max_ms", ".2f"),
        Column("min ms", "min_ms", ".2f"),
        Column("samples", "samples"),
    ),
    summary=lambda r: f"p50 {r.p50_ms:.2f} ms, p99 {r.p99_ms:.2f} ms",
    key=("mode",),
    metric="p50_ms",
    higher_is_better=False,
    notes=(
        "One idle `runfairworker --concurrency 1` process; messages are enqueued one at a time "
        "(the next once the previous has run, after a random pause of 0.1-0.2 s, or 0.1 s plus "
        "up to the poll interval when polling: past the worker's quick re-claims after a "
        "message, so it is idle). Latency: the handler's "
        "time.time() at start minus the benchmark's time.time() just before it sent the COMMIT "
        "of the enqueue's transaction: the commit included, never negative; same machine, "
        "same clock.",
        "listen: the commit's NOTIFY wakes the worker. poll: `--no-listen`, the worker claims "
        "every poll interval (jittered +-20%), so the latency is spread over 0 to the interval "
        "(about half on average).",
    ),
)

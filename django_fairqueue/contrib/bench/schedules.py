"""The cost of periodic schedules (docs/performance.md): a worker's firing check when nothing is
due, and a pass that fires N due schedules.

One cell: ``schedules`` schedules (a daily cron, so none comes due by itself) over up to 100
channels; a first pass computes every schedule's next slot (``first pass``, per schedule).
Then ``samples`` passes run with ``due`` of them made due at the current minute (their fired
slots forgotten, so each sample fires the same slots again): one pass is what each worker's
maintenance loop runs, ``select_due_schedules`` + one transaction per due schedule (slot key,
enqueue, advance) + ``select_next_schedule_fire``. ``due`` 0 is the check every worker makes
every ``SCHEDULE_INTERVAL`` seconds and at each next slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

from django.db import transaction

from django_fairqueue import cron, schedules
from django_fairqueue.api import EnqueueRequest, enqueue_many
from django_fairqueue.contrib.bench import db
from django_fairqueue.contrib.bench.figures import median, percentile
from django_fairqueue.contrib.bench.harness import Bench, BenchmarkError, load1
from django_fairqueue.contrib.bench.scenario import Column, Scenario
from django_fairqueue.contrib.bench.sizes import Sizes
from django_fairqueue.contrib.bench.tasks import NOOP_TASK_NAME
from django_fairqueue.db import pg
from django_fairqueue.models import Channel, Schedule

CRON = "0 3 * * *"
TIMEZONE = "Europe/Berlin"


@dataclass(frozen=True)
class SchedulesCell:
    schedules: int
    due: int

    @property
    def label(self) -> str:
        return f"schedules {self.schedules:>7,}  due {self.due:>5,}"


@dataclass(frozen=True)
class SchedulesResult:
    schedules: int
    due: int
    samples: int
    pass_p50_ms: float
    pass_p95_ms: float
    #: pass p50 per due schedule (None when none is due)
    per_fire_ms: float | None
    #: the first pass (every schedule's next slot computed), per schedule
    first_pass_per_schedule_ms: float
    #: the same message enqueued alone in a transaction of its own (p50), for comparison
    enqueue_alone_ms: float
    #: ms per fire over enqueue_alone_ms (None when none is due)
    vs_enqueue: float | None
    load1: float


def plan(sizes: Sizes) -> list[SchedulesCell]:
    return [
        SchedulesCell(total, due)
        for total in sizes.schedules_counts
        for due in sizes.schedules_due
        if due <= total
    ]


def _create(bench: Bench, total: int) -> None:
    channels = Channel.objects.using(bench.using).bulk_create(
        [Channel(name=f"tenant-{i:03d}") for i in range(min(total, 100))]
    )
    made = 0
    while made < total:
        n = min(5_000, total - made)
        Schedule.objects.using(bench.using).bulk_create(
            [
                Schedule(
                    name=f"report-{made + i}",
                    channel=channels[(made + i) % len(channels)],
                    task_name=NOOP_TASK_NAME,
                    cron=CRON,
                    timezone=TIMEZONE,
                )
                for i in range(n)
            ]
        )
        made += n
        bench.progress.update(f"{made:,}/{total:,} schedules")


def run(bench: Bench, cell: SchedulesCell) -> SchedulesResult:
    sizes = bench.sizes
    load = load1()
    bench.reset()
    _create(bench, cell.schedules)
    # the slot made due is a day old at most: on time for this pass (no missed-slot warnings)
    firer = schedules.Firer(limit=max(cell.schedules, 1), grace=2 * 86_400.0)
    began = time.perf_counter()
    firer.fire_due()
    first = time.perf_counter() - began
    db.analyze_schedules(using=bench.using)
    if firer.seconds_to_next() in (None, 0):
        raise BenchmarkError("schedules: the first pass left schedules without a next slot")
    now = pg.select_clock(using=bench.using)
    (slot,) = cron.due_slots(CRON, TIMEZONE, now - timedelta(days=2), now, 1)
    timings, alone = [], []
    for i in range(sizes.schedules_samples):
        if cell.due:
            db.make_schedules_due(cell.due, slot, using=bench.using)
        began = time.perf_counter()
        fired = firer.fire_due()
        firer.seconds_to_next()
        timings.append(1000 * (time.perf_counter() - began))
        if fired != cell.due:
            raise BenchmarkError(f"schedules: a pass fired {fired} of {cell.due} due schedules")
        began = time.perf_counter()
        with transaction.atomic(using=bench.using):
            enqueue_many([EnqueueRequest(NOOP_TASK_NAME, channel="tenant-000")])
        alone.append(1000 * (time.perf_counter() - began))
        bench.progress.update(f"{i + 1}/{sizes.schedules_samples} passes")
    bench.reset()
    p50 = median(timings)
    alone_p50 = median(alone)
    per_fire = p50 / cell.due if cell.due else None
    return SchedulesResult(
        schedules=cell.schedules,
        due=cell.due,
        samples=len(timings),
        pass_p50_ms=round(p50, 3),
        pass_p95_ms=round(percentile(timings, 95), 3),
        per_fire_ms=None if per_fire is None else round(per_fire, 3),
        first_pass_per_schedule_ms=round(1000 * first / max(cell.schedules, 1), 3),
        enqueue_alone_ms=round(alone_p50, 3),
        vs_enqueue=None if per_fire is None else round(per_fire / alone_p50, 2),
        load1=round(load, 2),
    )


SCENARIO = Scenario(
    name="schedules",
    title="Periodic schedules: one firing pass (ms)",
    plan=plan,
    run=run,
    columns=(
        Column("schedules", "schedules", ","),
        Column("due", "due", ","),
        Column("pass p50 ms", "pass_p50_ms", ".2f"),
        Column("pass p95 ms", "pass_p95_ms", ".2f"),
        Column("ms per fire", "per_fire_ms", ".2f"),
        Column("enqueue alone ms", "enqueue_alone_ms", ".2f"),
        Column("x enqueue", "vs_enqueue", ".1f"),
        Column("first pass ms/schedule", "first_pass_per_schedule_ms", ".3f"),
        Column("samples", "samples"),
    ),
    summary=lambda r: f"pass p50 {r.pass_p50_ms:.2f} ms ({r.due} due)",
    key=("schedules", "due"),
    metric="pass_p50_ms",
    higher_is_better=False,
    notes=(
        "A pass: the due schedules (one indexed query), then per due schedule one transaction "
        "(its slot's unique key, the enqueue of its message, the advance of its state), then "
        "the time to the next slot (one indexed query). due 0: the check each worker runs "
        "every SCHEDULE_INTERVAL seconds.",
        "enqueue alone: one message enqueued by enqueue_many() in a transaction of its own, "
        "timed after each pass, so that x enqueue (ms per fire over it) compares within the run.",
        "first pass: every schedule's next slot computed (cronsim, in Europe/Berlin) and "
        "written, per schedule; a worker does this for new or edited schedules only.",
    ),
)

"""Maintenance services: small loops that keep the queue healthy.

* :class:`Rescuer` returns messages whose lease expired (a worker was killed, stalled past its
  lease, or lost its database connection) to ``ready``, or dead-letters them as ``failed`` when
  they have no attempts left (``at_most_once`` messages always). **Caveat:** a lease expires
  because its worker stopped renewing it, not because the handler stopped running. A worker
  frozen longer than the lease (SIGSTOP, a long GC pause, a partitioned network) may still be
  running the handler while another worker runs it again; its late writes are fenced by the
  lease token and change nothing, but the handler's own side effects happen twice. Make
  at-least-once handlers idempotent.
* :class:`Pruner` deletes ``succeeded``, ``cancelled`` and ``aborted`` rows older than
  ``FAIRQUEUE['RESULT_RETENTION']``, in bounded batches, and the hold rows of unique keys
  whose message is gone or finished for good.
* :class:`StatsPruner` deletes per-channel statistics older than a day
  (:func:`django_fairqueue.stats.prune`), and usage older than ``FAIRQUEUE['USAGE_RETENTION']``
  (:mod:`django_fairqueue.observe.usage`).
* :class:`DeltaFolder` folds the channel counter deltas that completions leave behind into the
  channel rows (the claim folds only the deltas that can make a channel claimable).
* :class:`~django_fairqueue.schedules.Scheduler` fires the periodic schedules that are due,
  once per slot however many copies run (:mod:`django_fairqueue.schedules`), and wakes at the
  next slot.
* :class:`BatchRescuer` and :class:`BatchPruner` do the same for work batches
  (:mod:`django_fairqueue.batches`): expired batch leases go back to pending (or failed), and
  jobs whose every batch succeeded are deleted after ``FAIRQUEUE['BATCH_RETENTION']``.

Each service has an interval and a ``run_once()`` that does one bounded pass and returns how
many rows it handled; a service whose pass ended on a full batch sets ``more``, and runs again
as soon as the others due have had their turn, so the rescuer and the pruner keep up with any
rate of work instead of one pass per interval. Every worker runs them in its maintenance
thread (:class:`MaintenanceRunner`); ``manage.py fairqueue maintain`` runs them alone. Any
number of copies may run at once: the statements skip or wait out rows another copy holds, and
each row is moved once.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

from django.utils import timezone

from django_fairqueue import batches, conf, schedules, stats
from django_fairqueue.db import (
    channel_store,
    integrity_store,
    message_store,
    schedule_store,
    stats_store,
    worker_store,
)
from django_fairqueue.models import Channel
from django_fairqueue.queues import display_name, split_row_name
from django_fairqueue.runtime import (
    CONNECTION_ERRORS,
    Backoff,
    StopFlag,
    after_database_error,
    drop_broken_connection,
    worker_registry,
)
from django_fairqueue.tasks.spec import registry

logger = logging.getLogger("django_fairqueue.maintenance")
#: Failed attempts are records of this logger whoever settles them, the rescuer included
#: (docs/howto/observability.md, "Task errors in Sentry").
_attempt_logger = logging.getLogger("django_fairqueue.worker")


class Service(Protocol):
    """A maintenance task run every ``interval`` seconds (and, optionally, again at once while
    its attribute ``more`` says its last pass left work behind)."""

    name: str

    @property
    def interval(self) -> float: ...

    def run_once(self) -> int: ...


def in_batches(step: Callable[[int], int], batch_size: int, max_batches: int) -> tuple[int, bool]:
    """Run ``step(batch_size)``, which handles at most that many rows and returns how many it
    did, until a batch comes back short or ``max_batches`` ran. Returns the rows handled and
    whether the pass ended on a full batch (rows may be left)."""
    total = 0
    for _ in range(max_batches):
        handled = step(batch_size)
        total += handled
        if handled < batch_size:
            return total, False
    return total, True


@dataclass
class Rescuer:
    """Requeue (or dead-letter) messages whose lease expired, after expiring the leases of
    workers the registry finds dead (no beat for WORKER_DEAD_AFTER)."""

    batch_size: int = 1000
    max_batches: int = 10  # a pass handles at most batch_size * max_batches messages
    every: float | None = None  # seconds; None: FAIRQUEUE['RESCUE_INTERVAL']
    name: str = "rescuer"
    more: bool = False  # the last pass ended on a full batch

    @property
    def interval(self) -> float:
        return self.every if self.every is not None else conf.get().RESCUE_INTERVAL

    def run_once(self) -> int:
        worker_registry.rescue_dead_workers()
        # An expired lease is a timed-out attempt (its worker stopped renewing it): counted in
        # the per-minute statistics like the attempts workers settle, as a timeout, so
        # "timeouts in the last minutes" (the admin, status, metrics) include it. Its run time
        # is unknown: 0.
        recorder = stats.StatsRecorder()

        def rescue(limit: int) -> int:
            rescued = message_store.rescue_expired_messages(
                limit, at_most_once=registry.at_most_once_names()
            )
            for message in rescued:
                recorder.record_settled(
                    message.channel_id,
                    "failed" if message.state == "failed" else "retried",
                    0.0,
                    timed_out=True,
                )
            if rescued:
                _log_rescued(rescued)
            return len(rescued)

        total, self.more = in_batches(rescue, self.batch_size, self.max_batches)
        recorder.flush()
        return total


def _log_rescued(rescued: Sequence[message_store.RescuedMessage]) -> None:
    """Log each rescued attempt as the worker logs a failed one: the same logger and fields,
    ``channel`` named as the API names it (within its queue), ``outcome`` ``"retry"`` when it
    runs again, else the state it ended in, so that what a project does with failed attempts
    (an error reporter, a filter on the outcome) also sees those whose worker died."""
    rows = dict(
        Channel.objects.using(conf.get().DATABASE)
        .filter(pk__in={m.channel_id for m in rescued})
        .values_list("id", "name")
    )
    for message in rescued:
        # no row: the channel was deleted since, and its messages with it
        queue, channel = split_row_name(rows.get(message.channel_id, ""))
        outcome = "retry" if message.state == "ready" else message.state
        _attempt_logger.warning(
            "lease expired: %s message %s channel %r of worker %s, attempt %s -> %s",
            message.task_name,
            message.id,
            channel,
            message.worker_id or "?",
            message.attempts,
            outcome,
            extra={
                "channel": channel,
                "queue": queue,
                "task": message.task_name,
                "message_id": message.id,
                "attempt": message.attempts,
                "outcome": outcome,
            },
        )


@dataclass
class Pruner:
    """Delete succeeded, cancelled and aborted messages older than RESULT_RETENTION, and the
    hold rows of unique keys whose message is gone or finished for good."""

    batch_size: int = 5000
    max_batches: int = 20
    every: float | None = None  # seconds; None: FAIRQUEUE['PRUNE_INTERVAL']
    name: str = "pruner"
    more: bool = False  # the last pass ended on a full batch

    @property
    def interval(self) -> float:
        return self.every if self.every is not None else conf.get().PRUNE_INTERVAL

    def run_once(self) -> int:
        before = timezone.now() - conf.get().RESULT_RETENTION
        total, more_messages = in_batches(
            lambda limit: message_store.prune_finished_messages(before, limit=limit),
            self.batch_size,
            self.max_batches,
        )
        # the hold rows of unique keys whose message finished or is gone (not counted: they
        # are bookkeeping, not messages)
        _, more_holds = in_batches(
            lambda limit: message_store.prune_unique_holds(limit=limit),
            self.batch_size,
            self.max_batches,
        )
        self.more = more_messages or more_holds
        if total:
            logger.info("pruned %s finished messages", total, extra={"pruned": total})
        return total


@dataclass
class DeltaFolder:
    """Fold pending channel counter deltas into the channel rows (completions of uncapped
    channels, quiet enqueues), then the drained markers (docs/explanation/fairness.md)."""

    batch_size: int = 10_000
    max_batches: int = 10
    every: float = 1.0  # seconds
    name: str = "folder"
    using: str | None = None  # database alias; None: FAIRQUEUE['DATABASE']

    @property
    def interval(self) -> float:
        return self.every

    def run_once(self) -> int:
        total, _ = in_batches(
            lambda limit: channel_store.fold_channel_deltas(limit, using=self.using),
            self.batch_size,
            self.max_batches,
        )
        return total + channel_store.fold_drained_markers(using=self.using)


@dataclass
class StatsPruner:
    """Delete per-channel statistics rows older than ``keep``, the registry rows of workers
    stopped or dead for that long, the fired slots of periodic schedules as old, and the
    usage hours older than ``FAIRQUEUE['USAGE_RETENTION']``."""

    keep: timedelta = timedelta(days=1)
    every: float | None = None  # seconds; None: FAIRQUEUE['PRUNE_INTERVAL']
    name: str = "stats-pruner"

    @property
    def interval(self) -> float:
        return self.every if self.every is not None else conf.get().PRUNE_INTERVAL

    def run_once(self) -> int:
        stats.prune(self.keep)
        stats_store.prune_usage(timezone.now() - conf.get().USAGE_RETENTION)
        worker_store.prune_workers(timezone.now() - self.keep)
        while schedule_store.prune_schedule_fires(timezone.now() - self.keep) >= 10_000:
            pass
        return 0  # the statements do not count what they deleted


@dataclass
class BatchRescuer:
    """Return work batches whose lease expired to pending (after a backoff) or failed."""

    batch_size: int = 1000
    every: float | None = None  # seconds; None: FAIRQUEUE['RESCUE_INTERVAL']
    name: str = "batch-rescuer"

    @property
    def interval(self) -> float:
        return self.every if self.every is not None else conf.get().RESCUE_INTERVAL

    def run_once(self) -> int:
        rescued = batches.rescue_expired(limit=self.batch_size)
        for batch in rescued:
            logger.warning(
                "lease expired: work batch %s (%s) of worker %s, attempt %s -> %s",
                batch.id,
                batch.job_name,
                batch.worker_id or "?",
                batch.attempts,
                batch.state,
                extra={"batch_id": batch.id, "job": batch.job_name, "outcome": batch.state},
            )
        return len(rescued)


@dataclass
class BatchPruner:
    """Delete the batches of jobs that fully succeeded more than BATCH_RETENTION ago."""

    every: float | None = None  # seconds; None: FAIRQUEUE['PRUNE_INTERVAL']
    name: str = "batch-pruner"

    @property
    def interval(self) -> float:
        return self.every if self.every is not None else conf.get().PRUNE_INTERVAL

    def run_once(self) -> int:
        pruned = batches.prune()
        if pruned:
            logger.info("pruned %s finished work batches", pruned, extra={"pruned": pruned})
        return pruned


@dataclass
class CounterVerifier:
    """Recount every channel's counters from its rows; repair and log any drift.

    The queue's own statements keep counters exact, and ORM writes recount what they touch
    (:mod:`django_fairqueue.integrity`); this is the last line of defence for anything else
    (rows written by hand in SQL, a restore of part of a dump). Detection is one read-only,
    lock-free statement; only a channel found wrong is recounted, under its row lock.
    """

    every: float | None = None  # seconds; None: FAIRQUEUE['VERIFY_INTERVAL']
    name: str = "verifier"

    @property
    def interval(self) -> float:
        return self.every if self.every is not None else conf.get().VERIFY_INTERVAL

    def run_once(self) -> int:
        return len(verify(repair=True, log=logger))


def verify(
    *, repair: bool, log: logging.Logger | None = None
) -> list[integrity_store.CounterDrift]:
    """Counters that disagree with the rows (channel groups' sums that disagree with their
    channels', unique jobs of scope ``active`` their key's hold row does not name, and rows of
    no channel, as drift of a channel named ``(none)``); with ``repair``, recount, name and
    delete them, then report what was wrong."""
    drift = integrity_store.verify_channel_counters()
    if repair and drift:
        # each drifted channel recounted under its row lock; what was wrong then is reported
        drift = integrity_store.repair_channel_counters(sorted({d.channel_id for d in drift}))
    groups = integrity_store.verify_group_counters()
    if repair and groups:
        groups = integrity_store.repair_group_counters(sorted({d.channel_id for d in groups}))
    drift += groups
    holds = integrity_store.verify_unique_holds()
    if repair and holds:
        integrity_store.repair_unique_holds(sorted({d.channel_id for d in holds}))
    drift += holds
    orphans = {t: n for t, n in integrity_store.verify_orphans().items() if n}
    if repair and orphans:
        orphans = {t: n for t, n in integrity_store.repair_orphans().items() if n}
    drift += [
        integrity_store.CounterDrift(0, "(none)", f"{t} rows", n, 0) for t, n in orphans.items()
    ]
    if log is not None:
        for d in drift:
            log.warning(
                "counter drift%s: %s %r %s recorded %s, counted %s",
                " repaired" if repair else "",
                d.kind,
                display_name(d.channel),
                d.counter,
                d.recorded,
                d.actual,
                extra={
                    "channel": split_row_name(d.channel)[1],
                    "queue": split_row_name(d.channel)[0],
                    "counter": d.counter,
                },
            )
    return drift


def default_services() -> list[Service]:
    return [
        DeltaFolder(),
        Rescuer(),
        Pruner(),
        StatsPruner(),
        BatchRescuer(),
        BatchPruner(),
        CounterVerifier(),
        schedules.Scheduler(),
    ]


class MaintenanceRunner:
    """Run services on their intervals until ``stop`` is set.

    Every service runs once at start (a restarted worker rescues what it left behind; one with
    ``at_start`` set even when the worker stops at once), then every ``interval`` seconds,
    jittered by ±10% so a fleet started together spreads out. Connection errors are logged and
    retried with backoff on a fresh connection; any other error is logged with its traceback
    and the service tries again at its next interval. ``on_work(name, count)`` is called after
    a pass that handled rows.
    """

    def __init__(
        self,
        services: Sequence[Service] | None = None,
        *,
        stop: StopFlag,
        on_work: Callable[[str, int], None] | None = None,
    ) -> None:
        self.services = list(services) if services is not None else default_services()
        self.stop = stop
        self.on_work = on_work
        self._backoff = Backoff(first=0.2, cap=10.0)

    def run_once(self) -> dict[str, int]:
        """Run every service once, in order; errors propagate. Returns {name: rows handled}."""
        return {service.name: service.run_once() for service in self.services}

    def run(self) -> None:
        if not self.services:
            return
        now = time.monotonic()
        due = {service.name: now for service in self.services}
        # A first pass promised at start (the scheduler's sync of the code schedules) runs even
        # when the worker is stopping already: a --burst worker with nothing to do ends within
        # milliseconds, before the loop below reaches it.
        for service in self.services:
            if getattr(service, "at_start", False):
                due[service.name] = time.monotonic() + self._pass(service)
        while not self.stop.is_set():
            wait = min(due.values()) - time.monotonic()
            if wait > 0 and self.stop.wait(wait):
                break
            for service in self.services:
                if self.stop.is_set() or due[service.name] > time.monotonic():
                    continue
                due[service.name] = time.monotonic() + self._pass(service)
            drop_broken_connection()

    def _pass(self, service: Service) -> float:
        """Run one pass of a service; returns seconds until its next pass."""
        try:
            count = service.run_once()
        except CONNECTION_ERRORS as exc:
            what = after_database_error(exc)
            delay = self._backoff.next()
            logger.warning("%s: %s; retrying in %.2fs", service.name, what, delay)
            return delay
        except Exception:
            logger.exception("%s failed; trying again in %.1fs", service.name, service.interval)
            return service.interval
        self._backoff.reset()
        if count and self.on_work is not None:
            self.on_work(service.name, count)
        if getattr(service, "more", False):
            return 0.0  # its pass was cut short: again after the others due
        if getattr(service, "precise", False):
            return service.interval  # it knows when its next work is due
        return service.interval * random.uniform(0.9, 1.1)

"""Work batches: a big table's id range split into batches that workers claim fairly.

A *job* (``"enrich:alice"``) covers one tenant's rows of one source table. :func:`plan` walks the
table's id index and records contiguous id ranges of about ``batch_size`` rows; workers then
:func:`claim` batches one at a time — round-robin across channels (tenants), never more running
at once than the channel's ``max_concurrency`` — keep them alive with heartbeats, and finish
them with :func:`fenced` (their writes and the batch's completion commit together) or
:func:`fail` (retry with backoff, then the failed state). The rescuer returns batches whose
worker died; :func:`prune` deletes finished jobs after ``FAIRQUEUE['BATCH_RETENTION']``.

Every statement is named in ``db/statements/work_batches.sql`` (claim:
``db/functions/batches.sql``) and run by :mod:`django_fairqueue.db.batch_store`. Design and
guarantees: docs/explanation/work-batches.md.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import IO, Any

from django.db import DataError, ProgrammingError, connections, models, transaction
from django.utils import timezone

from django_fairqueue import conf, limits
from django_fairqueue.api import validate_channel_name
from django_fairqueue.cli import terminal
from django_fairqueue.db import batch_store, channel_store
from django_fairqueue.db.batch_store import ClaimedBatch, RescuedBatch
from django_fairqueue.exceptions import LeaseLost
from django_fairqueue.models import Channel
from django_fairqueue.runtime.attempts import (  # messages' backoff and record
    error_info,
    retry_delay,
)

__all__ = [
    "ClaimedBatch",
    "Fence",
    "Heartbeat",
    "JobProgress",
    "PlanResult",
    "RescuedBatch",
    "claim",
    "delete_failed",
    "fail",
    "fenced",
    "heartbeat",
    "jobs",
    "plan",
    "progress",
    "prune",
    "release",
    "rescue_expired",
    "retry_failed",
]

#: Longest job name (the column's length).
JOB_NAME_MAX_LENGTH = 200
#: Where a walk starts for a new job: below every bigint id.
_BIGINT_MIN = -(2**63)
_INTEGER_TYPES = ("smallint", "integer", "bigint")

ProgressCallback = Callable[[int, float], None]


# ---------------------------------------------------------------------------------------------
# Planning


@dataclass(frozen=True)
class PlanResult:
    job_name: str
    channel: str
    created: int  # batches added by this call
    batches_total: int  # batches the job has now
    rows_planned: int  # rows covered by the batches added by this call
    seconds: float


def _validate_job_name(job_name: Any) -> str:
    if not isinstance(job_name, str) or not job_name.strip():
        raise ValueError(f"job name must be a non-empty string, got {job_name!r}")
    if job_name != job_name.strip() or "\x00" in job_name:
        raise ValueError(f"job name must not have surrounding blanks or NUL: {job_name!r}")
    if len(job_name) > JOB_NAME_MAX_LENGTH:
        raise ValueError(f"job name is {len(job_name)} characters; the most is 200")
    return job_name


def _source(
    table: object, id_column: str | None, using: str
) -> tuple[batch_store.SourceColumn, str]:
    """Resolve a model or table name to its catalog entry and integer id column."""
    if isinstance(table, type) and issubclass(table, models.Model):
        pk = table._meta.pk
        schema, name = None, table._meta.db_table
        column = id_column or pk.column or "id"
    elif isinstance(table, str) and table:
        schema, _, name = table.rpartition(".")
        schema = schema or None
        column = id_column or "id"
    else:
        raise TypeError(f"table must be a Django model or a table name, got {table!r}")
    found = batch_store.select_table_column(name, column, schema=schema, using=using)
    if found is None:
        where = f"{schema}.{name}" if schema else name
        raise ValueError(f"no column {column!r} in table {where!r} (or no such table)")
    if found.type not in _INTEGER_TYPES:
        raise ValueError(
            f"{found.table}.{column} is {found.type}; work batches need an integer id column "
            f"({', '.join(_INTEGER_TYPES)})"
        )
    return found, column


def _id_span(
    source: batch_store.SourceColumn, column: str, filters: dict[str, Any], alias: str
) -> tuple[int | None, int | None]:
    """The lowest and highest id of the rows matching ``filters``: the first statement to
    compare the filter values with their columns, so a value of the wrong type is a
    ValueError here, before anything is written."""
    if not filters:
        return batch_store.select_id_span(source, column, filters=filters, using=alias)
    try:
        # a savepoint when the caller has a transaction open: it stays usable after the refusal
        with transaction.atomic(using=alias):
            return batch_store.select_id_span(source, column, filters=filters, using=alias)
    except (DataError, ProgrammingError) as exc:
        reason = str(exc).strip().splitlines()[0]
        raise ValueError(
            f"filters {filters!r} do not fit the columns of {source.table!r}: {reason}"
        ) from None


def plan(
    job_name: str,
    *,
    channel: str,
    table: type[models.Model] | str,
    id_column: str | None = None,
    batch_size: int = 100_000,
    max_attempts: int = 3,
    filters: dict[str, Any] | None = None,
    progress: bool | ProgressCallback = False,
    using: str | None = None,
) -> PlanResult:
    """Split ``table``'s rows (those matching ``filters``) into batches of ``batch_size`` rows.

    The id index is walked ``batch_size`` entries at a time, so sparse ids still give full
    batches and no id is ever loaded into Python. Ranges are contiguous (a batch ends where the
    next begins), so rows inserted later inside a planned range are processed with it. Planning
    resumes after the job's last batch: planning again adds nothing, or only batches for rows
    appended since. Concurrent planners of one job take turns per batch (an advisory lock).

    ``filters`` are column = value conditions (``{"tenant_id": 7}``); give the table an index on
    (filter columns..., id) so the walk reads only the tenant's entries. ``progress=True`` draws
    a bar on stderr; a callable gets ``(rows_planned, fraction_of_id_span)``.
    """
    started = time.monotonic()
    alias = using or conf.get().DATABASE
    job_name = _validate_job_name(job_name)
    channel = validate_channel_name(channel)
    # up to what the batch table's columns hold (bigint, integer): checked before anything
    # is written
    limits.integer(batch_size, "batch_size", minimum=1, maximum=limits.MAX_ID)
    limits.integer(max_attempts, "max_attempts", minimum=1, maximum=limits.MAX_LIMIT)
    filters = dict(filters or {})
    source, column = _source(table, id_column, alias)
    for name in filters:
        if (
            batch_store.select_table_column(source.table, name, schema=source.schema, using=alias)
            is None
        ):
            raise ValueError(f"filter column {name!r} is not a column of {source.table!r}")

    low, high = _id_span(source, column, filters, alias)
    channel_id = channel_store.ensure_channel(
        channel, defaults=conf.get().CHANNEL_DEFAULTS, using=alias
    )
    report = _progress_reporter(progress, job_name)
    # Windows walked per transaction: about two million index entries, so a step takes well
    # under a second (the bar moves, other planners of the job get their turn) yet plans many
    # small batches per round trip.
    steps = max(1, min(1000, 2_000_000 // batch_size))
    created = rows = 0
    while True:
        with transaction.atomic(using=alias):
            batch_store.lock_plan(job_name, using=alias)
            last = batch_store.select_last_planned_batch(job_name, using=alias)
            if last is not None and last[0] != channel_id:
                owner = (
                    Channel.objects.using(alias).filter(pk=last[0]).values_list("name", flat=True)
                ).first()
                raise ValueError(
                    f"job {job_name!r} is planned on channel {owner!r}, not {channel!r}"
                )
            start = last[1] + 1 if last is not None else _BIGINT_MIN
            windows = batch_store.walk_id_index(
                source,
                column,
                start=start,
                size=batch_size,
                steps=steps,
                filters=filters,
                using=alias,
            )
            if not windows:
                break
            ranges: list[tuple[int, int, int]] = []
            for window in windows:
                # contiguous: a batch starts right after the previous one ends (the first
                # batch of a job at its first id), so no id between them is ever orphaned
                first = start if (last is not None or ranges) else window.first_id
                ranges.append((first, window.last_id, window.count))
                start = window.last_id + 1
            added, added_rows = batch_store.insert_planned_batches(
                channel_id=channel_id,
                job=job_name,
                ranges=ranges,
                max_attempts=max_attempts,
                using=alias,
            )
            created += added
            rows += added_rows
            reached = windows[-1].last_id
        if report is not None:
            span = (high - low) if high is not None and low is not None else 0
            fraction = 1.0 if span <= 0 else min(1.0, (reached - (low or 0)) / span)
            report(rows, fraction)
    if report is not None:
        report(rows, 1.0)
    total = batch_store.select_job_progress(job=job_name, using=alias)
    return PlanResult(
        job_name=job_name,
        channel=channel,
        created=created,
        batches_total=total[0].batches_total if total else 0,
        rows_planned=rows,
        seconds=time.monotonic() - started,
    )


def plan_ranges(
    job_name: str,
    *,
    channel: str,
    ranges: Sequence[tuple[int, int, int]],
    max_attempts: int = 3,
    using: str | None = None,
) -> PlanResult:
    """Plan one batch per given id range ``(first id, last id, rows)``, for a job that chooses
    its rows itself (say, only the rows changed since a date) instead of walking a table.

    Ranges are in id order, do not overlap, and start after the job's last planned batch: a
    range at or below it is a ValueError and nothing is planned. Like :func:`plan`, concurrent
    planners of one job take turns (the same advisory lock), and a job stays on one channel.
    """
    started = time.monotonic()
    alias = using or conf.get().DATABASE
    job_name = _validate_job_name(job_name)
    channel = validate_channel_name(channel)
    limits.integer(max_attempts, "max_attempts", minimum=1, maximum=limits.MAX_LIMIT)
    checked = _checked_ranges(ranges)
    channel_id = channel_store.ensure_channel(
        channel, defaults=conf.get().CHANNEL_DEFAULTS, using=alias
    )
    created = rows_planned = 0
    with transaction.atomic(using=alias):
        batch_store.lock_plan(job_name, using=alias)
        last_batch = batch_store.select_last_planned_batch(job_name, using=alias)
        if last_batch is not None and last_batch[0] != channel_id:
            raise ValueError(f"job {job_name!r} is planned on another channel, not {channel!r}")
        if checked and last_batch is not None and checked[0][0] <= last_batch[1]:
            raise ValueError(
                f"job {job_name!r} has batches up to id {last_batch[1]}: ranges must start after"
            )
        if checked:
            created, rows_planned = batch_store.insert_planned_batches(
                channel_id=channel_id,
                job=job_name,
                ranges=checked,
                max_attempts=max_attempts,
                using=alias,
            )
    total = batch_store.select_job_progress(job=job_name, using=alias)
    return PlanResult(
        job_name=job_name,
        channel=channel,
        created=created,
        batches_total=total[0].batches_total if total else 0,
        rows_planned=rows_planned,
        seconds=time.monotonic() - started,
    )


def _checked_ranges(ranges: Any) -> list[tuple[int, int, int]]:
    """``plan_ranges``'s ranges as checked tuples: each ``(first id, last id, rows)`` of
    integers the batch table holds (bigint), first <= last, in id order without overlap."""
    if isinstance(ranges, str | bytes) or not isinstance(ranges, Iterable):
        raise TypeError(f"ranges must be a list of (first id, last id, rows), got {ranges!r}")
    checked: list[tuple[int, int, int]] = []
    for i, given in enumerate(ranges):
        if not isinstance(given, Sequence) or isinstance(given, str | bytes) or len(given) != 3:
            raise TypeError(f"ranges[{i}] must be (first id, last id, rows), got {given!r}")
        first, last, rows = given
        first = limits.integer(
            first, f"ranges[{i}]: the first id", minimum=_BIGINT_MIN, maximum=limits.MAX_ID
        )
        last = limits.integer(
            last, f"ranges[{i}]: the last id", minimum=_BIGINT_MIN, maximum=limits.MAX_ID
        )
        rows = limits.integer(rows, f"ranges[{i}]: the rows", minimum=0, maximum=limits.MAX_ID)
        if first > last:
            raise ValueError(
                f"ranges[{i}]: a range is (first id, last id, rows) with first <= last, "
                f"got {given!r}"
            )
        if checked and first <= checked[-1][1]:
            raise ValueError(
                f"ranges must be in id order without overlap: {checked[-1]}, {given!r}"
            )
        checked.append((first, last, rows))
    return checked


def _progress_reporter(progress: bool | ProgressCallback, label: str) -> ProgressCallback | None:
    if callable(progress):
        return progress
    if progress:
        return ProgressBar(label)
    return None


class ProgressBar:
    """A one-line terminal progress bar: ``label [#####.....] 42% 1,234,567 rows 3.1s``."""

    def __init__(self, label: str, *, stream: IO[str] | None = None, width: int = 30) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.started = time.monotonic()
        self._throttle = terminal.Throttle()
        self._done = False

    def __call__(self, rows: int, fraction: float) -> None:
        if self._done or not self._throttle.due(final=fraction >= 1.0):
            return
        elapsed = time.monotonic() - self.started
        drawn = terminal.bar(fraction, self.width)
        self.stream.write(f"\r{self.label} {drawn} {fraction:4.0%} {rows:,} rows {elapsed:.1f}s")
        if fraction >= 1.0:
            self.stream.write("\n")
            self._done = True
        self.stream.flush()


# ---------------------------------------------------------------------------------------------
# Claiming and settling


def _lease(lease: timedelta | None) -> timedelta:
    """The lease to take or renew: ``FAIRQUEUE['LEASE_SECONDS']`` for None. One shorter than
    ``limits.MIN_LEASE`` is refused, as ``runfairworker --lease`` refuses it: it would expire
    before the first heartbeat renews it, each claim costing an attempt."""
    if lease is None:
        return conf.get().lease
    return limits.lease(lease)


def _split_jobs(jobs: Sequence[str] | None) -> tuple[list[str] | None, list[str] | None]:
    if jobs is None:
        return None, None
    if isinstance(jobs, str):
        raise TypeError("jobs must be a list of job names, not a string")
    exact = [j for j in jobs if not j.endswith("*")]
    prefixes = [j[:-1] for j in jobs if j.endswith("*")]
    return exact, prefixes


def _channel_ids(names: Sequence[str] | None, using: str) -> list[int] | None:
    if names is None:
        return None
    return list(channel_store.select_channel_ids(list(names), using=using).values())


def claim(
    *,
    worker_id: str,
    jobs: Sequence[str] | None = None,
    lease: timedelta | None = None,
    channels: Sequence[str] | None = None,
    exclude_channels: Sequence[str] | None = None,
    using: str | None = None,
) -> ClaimedBatch | None:
    """Claim the next batch, or None when no batch can run now.

    Channels take turns (least recently served first; a channel of weight w keeps its turn for w
    batches), a paused channel waits, and a channel never runs more batches at once than its
    ``max_concurrency``. ``jobs`` limits the claim to these job names; a name ending in ``*`` is
    a prefix (``"enrich:*"``). The lease (default ``FAIRQUEUE['LEASE_SECONDS']``, at least
    ``limits.MIN_LEASE`` seconds) must be renewed (:func:`heartbeat`, :class:`Heartbeat`) until
    the batch is settled.
    """
    # as a worker's message claims (WorkerConfig): the name an operator finds the claim by
    limits.worker_id(worker_id)
    taken = _lease(lease)
    alias = using or conf.get().DATABASE
    exact, prefixes = _split_jobs(jobs)

    def look() -> ClaimedBatch | None:
        return batch_store.claim_work_batch(
            worker=worker_id,
            lease=taken,
            jobs=exact,
            job_prefixes=prefixes,
            only=_channel_ids(channels, alias),
            exclude=_channel_ids(exclude_channels, alias),
            using=alias,
        )

    claimed = look()
    if claimed is None and _fold_backlog(alias):
        claimed = look()
    return claimed


#: The waking deltas the claim statement folds itself before it looks (the server function's
#: own figure), and those one fold statement takes when more wait (see _fold_backlog).
CLAIM_FOLDS = 1000
FOLD_CHUNK = 10_000


def _fold_backlog(alias: str) -> int:
    """When more waking counter deltas wait than the claim folded, fold them all; returns how
    many were folded.

    The claim folds the oldest thousand waking deltas before it looks, which is all there is
    while workers run (their folder keeps up). Behind many enqueues no worker folded yet, the
    delta that flags a channel's newly planned batches, or frees a slot of a capped one, may
    wait behind many more: a claim that found nothing folds them, then looks again. Concurrent
    callers share the work (the fold skips deltas another one holds)."""
    if not channel_store.select_waking_backlog(CLAIM_FOLDS, using=alias):
        return 0
    total = 0
    while True:
        folded = channel_store.fold_channel_deltas(FOLD_CHUNK, wake_only=True, using=alias)
        total += folded
        if folded < FOLD_CHUNK:
            return total


def heartbeat(
    batch: ClaimedBatch, *, lease: timedelta | None = None, using: str | None = None
) -> bool:
    """Renew the batch's lease; False means it was lost (stop working on it: its writes would be
    refused)."""
    expires = batch_store.heartbeat_work_batch(
        batch.id, batch.lease_token, lease=_lease(lease), using=using
    )
    return expires is not None


class _Settled:
    """Leases this process settled (completed, failed, released), so that a heartbeat racing
    the settlement stops quietly instead of reporting the lease lost. Bounded: the newest
    1,024.

    A lease is added *before* its settlement commits (and discarded if it did not settle): a
    heartbeat waiting on the batch row's lock wakes at that commit and finds the row settled,
    possibly before the settling thread runs another line.
    """

    def __init__(self) -> None:
        self._leases: dict[tuple[int, Any], None] = {}
        self._lock = threading.Lock()

    def add(self, batch: ClaimedBatch) -> None:
        with self._lock:
            self._leases[(batch.id, batch.lease_token)] = None
            while len(self._leases) > 1024:
                self._leases.pop(next(iter(self._leases)))

    def discard(self, batch: ClaimedBatch) -> None:
        with self._lock:
            self._leases.pop((batch.id, batch.lease_token), None)

    def __contains__(self, batch: ClaimedBatch) -> bool:
        with self._lock:
            return (batch.id, batch.lease_token) in self._leases


_settled = _Settled()


class Heartbeat:
    """Renew a batch's lease from a background thread while the block runs.

    Renews three times per lease period, so one missed beat never loses the lease. ``lost`` is
    set when the lease is gone (the batch was rescued and may run elsewhere): stop early.
    Database errors are retried at the next beat; the lease only expires if they last.
    """

    def __init__(
        self,
        batch: ClaimedBatch,
        *,
        lease: timedelta | None = None,
        interval: float | None = None,
        using: str | None = None,
    ) -> None:
        self.batch = batch
        self.lease = _lease(lease)
        self.interval = interval if interval is not None else self.lease.total_seconds() / 3
        self.alias = using or conf.get().DATABASE
        self.lost = threading.Event()
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"fairqueue-batch-heartbeat-{batch.id}", daemon=True
        )

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import logging

        logger = logging.getLogger("django_fairqueue.batches")
        try:
            while not self._stop.wait(self.interval):
                try:
                    alive = heartbeat(self.batch, lease=self.lease, using=self.alias)
                except Exception as exc:  # the database may be restarting: try next beat
                    logger.warning("batch %s: heartbeat failed (%s)", self.batch.id, exc)
                    connections[self.alias].close()
                    continue
                self.beats += 1
                if not alive:
                    if self.batch in _settled:  # this process settled it meanwhile
                        return
                    logger.warning("batch %s: lease lost", self.batch.id)
                    self.lost.set()
                    return
        finally:
            connections[self.alias].close()  # this thread's own connection


@dataclass
class Fence:
    """Handed out by :func:`fenced`: set ``rows_processed`` before the block ends."""

    batch: ClaimedBatch
    rows_processed: int = 0
    finished_at: datetime | None = field(default=None)


@contextmanager
def fenced(batch: ClaimedBatch, *, using: str | None = None) -> Iterator[Fence]:
    """Commit the batch's results and its completion together, only if it is still ours.

    Opens a transaction on Django connection ``using`` and locks the batch row under its lease
    token first: if the lease was lost (it expired and the batch was rescued, so another
    worker may be redoing it), :class:`~django_fairqueue.exceptions.LeaseLost` is raised before
    any write. The lock is held to commit, so the rescuer cannot take the batch meanwhile. Write
    the results inside the block on the same connection; on a clean exit the batch becomes
    ``succeeded`` in the same commit. An exception rolls back both.
    """
    alias = using or conf.get().DATABASE
    try:
        with transaction.atomic(using=alias):
            if not batch_store.lock_leased_work_batch(batch.id, batch.lease_token, using=alias):
                raise LeaseLost(
                    f"work batch {batch.id} ({batch.job_name} {batch.start_id}..{batch.end_id}) "
                    "is no longer leased to this worker; its results were not written"
                )
            fence = Fence(batch)
            yield fence
            if not batch_store.complete_work_batch(
                batch.id, batch.lease_token, rows=fence.rows_processed, using=alias
            ):  # cannot happen while the row lock is held; a guard, not a path
                raise LeaseLost(f"work batch {batch.id} lost its lease while locked")
            fence.finished_at = timezone.now()
            _settled.add(batch)  # before the commit: see _Settled
    except BaseException:
        _settled.discard(batch)
        raise


def _error_dict(error: BaseException | str, batch: ClaimedBatch) -> dict[str, Any]:
    """The ``last_error`` of a failed attempt, shaped (and made storable) like a message's."""
    if isinstance(error, BaseException):
        return error_info(error, attempt=batch.attempts, worker_id=batch.worker_id)
    # A plain message: the same truncation and NUL escaping, no traceback.
    info = error_info(
        RuntimeError(error),
        attempt=batch.attempts,
        worker_id=batch.worker_id,
        with_traceback=False,
    )
    return {**info, "type": "Error"}


def fail(
    batch: ClaimedBatch,
    error: BaseException | str,
    *,
    retry_delay_seconds: float | None = None,
    final: bool = False,
    using: str | None = None,
) -> str | None:
    """Record a failed attempt: back to ``pending`` after a backoff, or ``failed`` (a dead
    letter keeping the error, with the worker that claimed the batch) when its attempts are
    used up or ``final`` is set.

    Returns the new state, or None if the lease was already lost (nothing changes).
    """
    delay = retry_delay_seconds if retry_delay_seconds is not None else retry_delay(batch.attempts)
    if not math.isfinite(delay) or delay < 0:
        raise ValueError(f"retry delay must be a finite number >= 0, got {delay!r}")
    _settled.add(batch)  # before the commit: see _Settled
    try:
        state = batch_store.fail_work_batch(
            batch.id,
            batch.lease_token,
            error=_error_dict(error, batch),
            retry_in=timedelta(seconds=delay),
            final=final,
            using=using,
        )
    except BaseException:
        _settled.discard(batch)
        raise
    if state is None:
        _settled.discard(batch)
    return state


def release(batch: ClaimedBatch, *, using: str | None = None) -> bool:
    """Give the batch back untouched (graceful shutdown): pending again, attempt not counted."""
    _settled.add(batch)  # before the commit: see _Settled
    try:
        released = batch_store.release_work_batch(batch.id, batch.lease_token, using=using)
    except BaseException:
        _settled.discard(batch)
        raise
    if not released:
        _settled.discard(batch)
    return released


# ---------------------------------------------------------------------------------------------
# Maintenance and dead letters


def rescue_expired(*, limit: int = 1000, using: str | None = None) -> list[RescuedBatch]:
    """Batches whose lease expired go back to pending (after a backoff) or to failed: at most
    ``limit`` (1 to ``limits.MAX_LIMIT``) of them."""
    limits.limit(limit)
    cfg = conf.get()
    return batch_store.rescue_expired_work_batches(
        backoff_base=timedelta(seconds=cfg.RETRY_BACKOFF_BASE),
        backoff_max=timedelta(seconds=cfg.RETRY_BACKOFF_MAX),
        limit=limit,
        using=using,
    )


def prune(*, older_than: timedelta | None = None, using: str | None = None) -> int:
    """Delete the batches of jobs whose every batch succeeded more than ``older_than`` ago
    (default ``FAIRQUEUE['BATCH_RETENTION']``). Jobs with failed batches are kept."""
    keep = older_than if older_than is not None else conf.get().BATCH_RETENTION
    return batch_store.prune_finished_work_batches(timezone.now() - keep, using=using)


def retry_failed(
    *, job_name: str | None = None, ids: Sequence[int] | None = None, using: str | None = None
) -> list[int]:
    """Put failed batches (by id, or all of a job, or all) back to pending with a fresh attempt
    budget. Idempotent. Returns the ids retried."""
    if ids is None:
        ids = batch_store.select_failed_work_batch_ids(job_name, using=using)
    return batch_store.retry_failed_work_batches(limits.row_ids(ids, "batch"), using=using)


def delete_failed(ids: Sequence[int], *, using: str | None = None) -> list[int]:
    """Delete failed batches (dead letters); other states are never deleted."""
    return batch_store.delete_failed_work_batches(limits.row_ids(ids, "batch"), using=using)


# ---------------------------------------------------------------------------------------------
# Progress


@dataclass(frozen=True)
class JobProgress:
    job_name: str
    channel: str | None
    batches_total: int
    batches_by_state: dict[str, int]
    rows_total: int  # rows in the job's batches when planned
    rows_done: int  # rows of succeeded batches (as planned)
    rows_written: int  # rows the succeeded batches reported writing
    started_at: datetime | None
    last_finished_at: datetime | None
    rows_per_second: float | None
    eta: timedelta | None

    @property
    def state(self) -> str:
        """``succeeded``, ``failed`` (only dead letters left), ``running`` or ``pending``."""
        by = self.batches_by_state
        if by["succeeded"] == self.batches_total:
            return "succeeded"
        if by["pending"] == 0 and by["running"] == 0:
            return "failed"
        return "running" if by["running"] or by["succeeded"] or by["failed"] else "pending"

    @property
    def fraction_done(self) -> float:
        return self.rows_done / self.rows_total if self.rows_total else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "job": self.job_name,
            "channel": self.channel,
            "state": self.state,
            "batches_total": self.batches_total,
            "batches": dict(self.batches_by_state),
            "rows_total": self.rows_total,
            "rows_done": self.rows_done,
            "rows_written": self.rows_written,
            "started_at": self.started_at.isoformat() if self.started_at else None,
            "last_finished_at": self.last_finished_at.isoformat()
            if self.last_finished_at
            else None,
            "rows_per_second": self.rows_per_second,
            "eta_seconds": self.eta.total_seconds() if self.eta is not None else None,
        }


def _job_progress(row: batch_store.JobRow) -> JobProgress:
    rate: float | None = None
    eta: timedelta | None = None
    if row.started_at is not None and row.last_finished_at is not None and row.rows_done:
        elapsed = (row.last_finished_at - row.started_at).total_seconds()
        if elapsed > 0:
            rate = row.rows_done / elapsed
    remaining = row.rows_total - row.rows_done
    if rate and remaining > 0 and (row.pending or row.running):
        eta = timedelta(seconds=remaining / rate)
    elif remaining <= 0:
        eta = timedelta(0)
    return JobProgress(
        job_name=row.job_name,
        channel=row.channel,
        batches_total=row.batches_total,
        batches_by_state={
            "pending": row.pending,
            "running": row.running,
            "succeeded": row.succeeded,
            "failed": row.failed,
        },
        rows_total=row.rows_total,
        rows_done=row.rows_done,
        rows_written=row.rows_written,
        started_at=row.started_at,
        last_finished_at=row.last_finished_at,
        rows_per_second=rate,
        eta=eta,
    )


def progress(job_name: str, *, using: str | None = None) -> JobProgress:
    """Batches and rows done / total, rate and ETA of one job; LookupError if it has no batches."""
    rows = batch_store.select_job_progress(job=job_name, using=using)
    if not rows:
        raise LookupError(f"no work batches for job {job_name!r} (planned and since pruned?)")
    return _job_progress(rows[0])


def jobs(*, prefix: str | None = None, using: str | None = None) -> list[JobProgress]:
    """Progress of every job (or of the jobs whose name starts with ``prefix``), by name."""
    return [_job_progress(r) for r in batch_store.select_job_progress(prefix=prefix, using=using)]

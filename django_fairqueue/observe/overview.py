"""The per-tenant picture shared by the admin, its dashboard, ``fairqueue status`` and metrics.

Every figure comes from maintained counters or bounded probes, never from counting the message
table:

* counts (ready, delayed, running, failed, succeeded) are the channel row's counters plus its
  pending counter deltas (docs/explanation/fairness.md, *Counters without a hot row*): for a
  few channels :func:`django_fairqueue.db.channel_store.select_channel_counters`, for all of
  them one statement joining the channel table to the deltas summed per channel
  (:func:`django_fairqueue.db.channel_store.select_all_channel_counts`);
* the oldest ready message is a loose index scan of ``fq_message_ready_idx``, one probe per
  priority level in use (:func:`django_fairqueue.db.channel_store.select_channel_oldest_ready`);
* finished, served, wait, failures and timeouts come from the per-minute statistics
  (:mod:`django_fairqueue.stats`): per channel one statement for a window, over all channels
  the per-minute sums;
* retrying (messages waiting out a retry's backoff) reads the retries of the channels whose
  scheduled counter is positive, through the partial ``fq_message_retrying_idx``
  (:func:`django_fairqueue.db.channel_store.select_channel_retrying`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import (
    BigIntegerField,
    DateTimeField,
    Field,
    OuterRef,
    QuerySet,
    Subquery,
    Sum,
    Value,
)
from django.db.models.expressions import RawSQL
from django.db.models.functions import Coalesce

from django_fairqueue import conf, stats
from django_fairqueue.db import channel_store, message_store
from django_fairqueue.models import Channel, ChannelDelta
from django_fairqueue.observe import moments
from django_fairqueue.queues import split_row_name
from django_fairqueue.runtime import worker_registry

__all__ = [
    "SORTS",
    "ChannelCounts",
    "ChannelRow",
    "all_counts",
    "annotate_counters",
    "dashboard",
    "failing_ids",
    "format_age",
    "format_since",
    "format_time",
    "ranked_ids",
    "rows",
    "totals",
]

#: Orders a channel listing can take: most ready first, longest-waiting first, by name, most
#: running first, most failed first.
SORTS = ("backlog", "age", "name", "running", "failed")
#: The window of "finished in the last minutes" (the admin's column, status, dashboard).
FINISHED_MINUTES = 5


def _db() -> str:
    return conf.get().DATABASE


def state_column(name: str, output_field: Field[Any, Any] | None = None) -> RawSQL:
    """A scheduler column of the channel row, for reading in a ``Channel`` queryset.

    The scheduler's columns are not model fields (so no ORM write can touch them); a query
    reads them by name. Only for querysets whose base table is the channel table.
    """
    if name not in STATE_COLUMNS:
        raise ValueError(f"not a scheduler column of fairqueue_channel: {name!r}")
    table = Channel._meta.db_table
    return RawSQL(f'"{table}"."{name}"', (), output_field=output_field or BigIntegerField())


#: Scheduler columns of fairqueue_channel, written only by the queue's SQL functions.
STATE_COLUMNS = frozenset(
    {
        "ready_count",
        "scheduled_count",
        "running_count",
        "failed_count",
        "succeeded_total",
        "last_claimed_at",
        "next_turn_at",
    }
)


# --------------------------------------------------------------------------------------------
# Counts of every channel (one read)


#: A channel's configuration the listings show and its exact counts.
ChannelCounts = channel_store.ChannelSummary


def all_counts() -> dict[int, ChannelCounts]:
    """Exact counts of every channel: its counter columns plus its pending deltas.

    One statement (:func:`django_fairqueue.db.channel_store.select_all_channel_counts`): the channel
    table joined to the pending deltas summed once per channel, cheaper than a correlated sum
    per channel row, and read without the ORM's per-row work (10,000 channels in a few ms).
    """
    return {c.id: c for c in channel_store.select_all_channel_counts(using=_db())}


def totals(counts: Mapping[int, ChannelCounts]) -> dict[str, int]:
    """Sums over channels, plus how many channels are backlogged (ready > 0) and paused."""
    values = counts.values()
    return {
        "channels": len(counts),
        "backlogged": sum(1 for c in values if c.ready > 0),
        "paused": sum(1 for c in values if c.paused),
        "ready": sum(c.ready for c in values),
        "scheduled": sum(c.scheduled for c in values),
        "running": sum(c.running for c in values),
        "failed": sum(c.failed for c in values),
        "succeeded": sum(c.succeeded for c in values),
    }


def _delta_sum(column: str) -> Coalesce:
    return Coalesce(
        Subquery(
            ChannelDelta.objects.filter(channel_id=OuterRef("pk"))
            .order_by()
            .values("channel_id")
            .annotate(total=Sum(column))
            .values("total")[:1]
        ),
        Value(0),
        output_field=BigIntegerField(),
    )


def annotate_counters(queryset: QuerySet[Channel]) -> QuerySet[Channel]:
    """Annotate ``backlog`` (ready) and ``failed_now`` with each channel's exact value, for
    ordering and filtering in the ORM (one probe of ``fq_delta_channel_idx`` per channel row
    the query evaluates: the page when sorted by name, every row when sorted or filtered by
    them)."""
    return queryset.annotate(
        backlog=state_column("ready_count") + _delta_sum("ready"),
        running_now=state_column("running_count") + _delta_sum("running"),
        failed_now=state_column("failed_count") + _delta_sum("failed"),
        last_claimed_at=state_column("last_claimed_at", DateTimeField()),
    )


# --------------------------------------------------------------------------------------------
# Rows of a page of channels


@dataclass(frozen=True, slots=True)
class ChannelRow:
    """One channel's line in a listing: limits, exact counts, oldest ready, recent finishes."""

    id: int
    name: str
    ready: int
    scheduled: int
    running: int
    failed: int
    succeeded: int
    max_concurrency: int | None
    release_interval: timedelta
    weight: int
    paused: bool
    max_backlog: int | None
    #: since when the longest-waiting head of its line has been ready (None: nothing ready)
    oldest_ready_since: datetime | None
    #: messages finished (succeeded or failed for good) in the last FINISHED_MINUTES minutes
    finished_recent: int
    #: of ``scheduled``, messages waiting out a retry's backoff after a failed attempt
    retrying: int = 0
    #: attempts whose task raised in the last FINISHED_MINUTES minutes, retried or
    #: dead-lettered
    failures_recent: int = 0
    #: attempts that ran out of time in the last FINISHED_MINUTES minutes (past the task's time
    #: limit, or their lease expired and was rescued), retried or dead-lettered
    timeouts_recent: int = 0
    #: the median wait (enqueue or due time to claim) of what it claimed in the last
    #: FINISHED_MINUTES minutes, in ms (None: it claimed nothing then)
    wait_p50_ms: float | None = None
    #: of ``running``, messages whose lease expired: their worker stopped renewing it (died,
    #: stalled), and they wait for a live worker's rescuer. Not running anything any more.
    expired_leases: int = 0
    #: when it was last claimed from (None: never, or not since it was created)
    last_claimed_at: datetime | None = None
    #: messages claimed from it in the last FINISHED_MINUTES minutes
    served_recent: int = 0

    @property
    def delayed(self) -> int:
        """Scheduled messages that are not retries: delayed by their sender."""
        return max(self.scheduled - self.retrying, 0)

    def oldest_age(self, now: datetime) -> float | None:
        """Seconds the oldest ready message has been waiting (None: nothing ready)."""
        if self.oldest_ready_since is None:
            return None
        return max((moments.aware(now) - self.oldest_ready_since).total_seconds(), 0.0)

    def as_dict(self, now: datetime) -> dict[str, Any]:
        age = self.oldest_age(now)
        return {
            "id": self.id,
            "name": self.name,
            "ready": self.ready,
            "scheduled": self.scheduled,
            "delayed": self.delayed,
            "retrying": self.retrying,
            "running": self.running,
            "max_concurrency": self.max_concurrency,
            "failed": self.failed,
            "succeeded": self.succeeded,
            "release_interval_seconds": self.release_interval.total_seconds(),
            "weight": self.weight,
            "paused": self.paused,
            "max_backlog": self.max_backlog,
            "oldest_ready_since": self.oldest_ready_since.isoformat()
            if self.oldest_ready_since
            else None,
            "oldest_ready_age_seconds": None if age is None else round(age, 3),
            f"finished_last_{FINISHED_MINUTES}m": self.finished_recent,
            f"failures_last_{FINISHED_MINUTES}m": self.failures_recent,
            f"timeouts_last_{FINISHED_MINUTES}m": self.timeouts_recent,
            f"wait_p50_ms_last_{FINISHED_MINUTES}m": self.wait_p50_ms,
            "expired_leases": self.expired_leases,
            "last_claimed_at": self.last_claimed_at.isoformat() if self.last_claimed_at else None,
            f"served_last_{FINISHED_MINUTES}m": self.served_recent,
        }


def rows(ids: Sequence[int], *, now: datetime | None = None) -> list[ChannelRow]:
    """The rows of these channels, in the order given (unknown ids are skipped).

    Seven queries whatever the number of ids: limits, counters with deltas (and when each was
    last claimed from), oldest ready (only for channels with ready messages), retrying (only
    for channels with scheduled messages), recent finishes and failures, recent waits, expired
    leases (the running rows whose lease ran out, an index range of fq_message_lease_idx).
    """
    if not ids:
        return []
    ids = list(ids)
    db = _db()
    channels = (
        Channel.objects.using(db)
        .annotate(served_at=state_column("last_claimed_at", DateTimeField()))
        .in_bulk(ids)
    )
    counters = {c.id: c for c in channel_store.select_channel_counters(ids, using=db)}
    with_ready = [cid for cid, c in counters.items() if c.ready > 0]
    oldest = channel_store.select_channel_oldest_ready(with_ready, using=db)
    with_scheduled = [cid for cid, c in counters.items() if c.scheduled > 0]
    retrying = channel_store.select_channel_retrying(with_scheduled, using=db)
    recent = stats.window_stats(FINISHED_MINUTES, channel_ids=ids, now=now)
    finished = stats.finished_of(recent)
    served = stats.served_of(recent)
    failing = stats.failing_of(recent)
    waits = stats.wait_by_channel(FINISHED_MINUTES, ids, now=now)
    expired = message_store.select_expired_leases_by_channel(using=db)
    none = stats.Failing()
    out = []
    for cid in ids:
        channel = channels.get(cid)
        c = counters.get(cid)
        if channel is None or c is None:
            continue
        out.append(
            ChannelRow(
                id=cid,
                name=channel.name,
                ready=c.ready,
                scheduled=c.scheduled,
                running=c.running,
                failed=c.failed,
                succeeded=c.succeeded,
                max_concurrency=channel.max_concurrency,
                release_interval=channel.release_interval,
                weight=channel.weight,
                paused=channel.paused,
                max_backlog=channel.max_backlog,
                oldest_ready_since=oldest.get(cid),
                finished_recent=finished.get(cid, 0),
                retrying=retrying.get(cid, 0),
                failures_recent=failing.get(cid, none).failures,
                timeouts_recent=failing.get(cid, none).timeouts,
                wait_p50_ms=waits[cid].p50_ms if cid in waits else None,
                expired_leases=expired.get(cid, 0),
                last_claimed_at=moments.aware(getattr(channel, "served_at", None)),
                served_recent=served.get(cid, 0),
            )
        )
    return out


def ranked_ids(
    sort: str,
    limit: int | None = None,
    *,
    counts: Mapping[int, ChannelCounts] | None = None,
    among: Sequence[int] | None = None,
) -> list[int]:
    """Channel ids in the order ``sort`` (one of :data:`SORTS`), at most ``limit``.

    ``among`` restricts the ranking to these channels. ``name`` and ties go by the name
    shown (the name within its queue), then the queue. ``age`` puts the channels with nothing
    ready last (by name); it probes the oldest ready message of every channel with a backlog,
    so it costs one index probe (per priority level) per such channel.
    """
    if sort not in SORTS:
        raise ValueError(f"sort must be one of {SORTS}, got {sort!r}")
    if counts is None:
        counts = all_counts()
    pool = list(counts.values())
    if among is not None:
        wanted = set(among)
        pool = [c for c in pool if c.id in wanted]
    # the name a listing shows, then the queue: by the row's own name ("<queue>\x1f<name>"),
    # another queue's channels would come as a block among the default queue's
    shown = {c.id: split_row_name(c.name)[::-1] for c in pool}
    if sort == "age":
        since = channel_store.select_backlogged_oldest_ready(using=_db())
        far = moments.now() + timedelta(days=36500)
        pool.sort(key=lambda c: (since.get(c.id, far), shown[c.id]))
    elif sort == "name":
        pool.sort(key=lambda c: shown[c.id])
    else:
        attr = {"backlog": "ready", "running": "running", "failed": "failed"}[sort]
        pool.sort(key=lambda c: (-getattr(c, attr), shown[c.id]))
    ordered = [c.id for c in pool]
    return ordered if limit is None else ordered[:limit]


def failing_ids(
    counts: Mapping[int, ChannelCounts],
    failures: Mapping[int, stats.Failing],
    retrying: Mapping[int, int],
    limit: int | None = None,
) -> list[int]:
    """The channels failing, most failing first, at most ``limit``: failed attempts in the
    recent window (``failures``: failures and timeouts together), then messages waiting for a
    retry (``retrying``), then dead letters kept (the ``failed`` counter); ties by name. A
    channel with none of the three is not failing."""

    def attempts(cid: int) -> int:
        found = failures.get(cid)
        return found.total if found is not None else 0

    failing = [
        c
        for c in counts.values()
        if attempts(c.id) > 0 or retrying.get(c.id, 0) > 0 or c.failed > 0
    ]
    failing.sort(key=lambda c: (-attempts(c.id), -retrying.get(c.id, 0), -c.failed, c.name))
    ordered = [c.id for c in failing]
    return ordered if limit is None else ordered[:limit]


def format_ms(ms: float | None) -> str:
    """A wait as the dashboard shows it: ``850 ms``, ``2.02 s``, ``12.5 s``; ``-`` for None."""
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{round(ms)} ms"
    return f"{ms / 1000:.{2 if ms < 10000 else 1}f} s"


def format_time(moment: datetime | None) -> str:
    """A moment as every operator view shows it: ``2026-11-25 21:04:05`` in the zone Django
    shows times in (:func:`~django_fairqueue.observe.moments.local`), to the second; ``-`` for
    None."""
    if moment is None:
        return "-"
    return moments.local(moment).strftime("%Y-%m-%d %H:%M:%S")


def format_since(moment: datetime | None, now: datetime) -> str:
    """A moment and how far it is from ``now``: ``2026-11-25 21:04:05 (3m 12s ago)`` or
    ``... (in 45s)``; ``-`` for None."""
    if moment is None:
        return "-"
    seconds = (moments.aware(moment) - moments.aware(now)).total_seconds()
    if seconds >= 0:
        return f"{format_time(moment)} (in {format_age(seconds)})"
    return f"{format_time(moment)} ({format_age(-seconds)} ago)"


def format_age(seconds: float | None) -> str:
    """A short human duration: ``45s``, ``3m 12s``, ``2h 05m``, ``3d 04h``; ``-`` for None."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


# --------------------------------------------------------------------------------------------
# The dashboard's data


def dashboard(
    *,
    sort: str = "backlog",
    limit: int = 20,
    window: int = 5,
    series_minutes: int = 30,
    now: datetime | None = None,
    queue: str | None = None,
) -> dict[str, Any]:
    """Everything the admin dashboard shows, JSON-ready.

    Each channel (``tenants``, ``failing``) has its ``name`` within its ``queue``, as enqueue
    takes it. With ``queue``, the channels, totals, served share and fairness are that
    queue's; ``series`` and the overall ``wait`` are every queue's.

    ``tenants`` are the first ``limit`` channels in order ``sort``, each with its row, what it
    was served in the last ``window`` minutes (count and share) and its wait p50/p95 there;
    ``failing`` are the ``limit`` channels failing most (:func:`failing_ids`), whatever
    ``sort`` is, each with its failures and timeouts in the last FINISHED_MINUTES minutes,
    messages waiting for a retry and dead letters;
    ``series`` has one entry per minute of the last ``series_minutes``; ``fairness`` is Jain's
    index over the backlogged channels (see :mod:`django_fairqueue.stats`).
    """
    now = moments.aware(now or moments.now())
    counts = all_counts()
    if queue is not None:
        counts = {k: c for k, c in counts.items() if split_row_name(c.name)[0] == queue}
    ids = ranked_ids(sort, limit, counts=counts)
    recent = stats.window_stats(FINISHED_MINUTES, now=now)
    if queue is not None:
        recent = {k: w for k, w in recent.items() if k in counts}
    failures = stats.failing_of(recent)
    none = stats.Failing()
    retrying = channel_store.select_channel_retrying(
        [c.id for c in counts.values() if c.scheduled > 0], using=_db()
    )
    failing = [
        {
            "id": cid,
            "name": split_row_name(counts[cid].name)[1],
            "queue": split_row_name(counts[cid].name)[0],
            "paused": counts[cid].paused,
            f"failures_last_{FINISHED_MINUTES}m": failures.get(cid, none).failures,
            f"timeouts_last_{FINISHED_MINUTES}m": failures.get(cid, none).timeouts,
            "retrying": retrying.get(cid, 0),
            "failed": counts[cid].failed,
        }
        for cid in failing_ids(counts, failures, retrying, limit)
    ]
    in_window = recent if window == FINISHED_MINUTES else stats.window_stats(window, now=now)
    if queue is not None:
        in_window = {k: w for k, w in in_window.items() if k in counts}
    served = stats.served_of(in_window)
    backlogged = {c.id: c.weight for c in counts.values() if c.ready > 0 and not c.paused}
    fair = stats.fairness(backlogged, window, served=served, now=now)
    total_served = sum(served.values())
    waits = stats.wait_by_channel(window, ids, now=now)
    tenants = []
    for row in rows(ids, now=now):
        item = row.as_dict(now)
        item["queue"], item["name"] = split_row_name(row.name)
        item["served"] = served.get(row.id, 0)
        item["served_share"] = (
            round(served.get(row.id, 0) / total_served, 4) if total_served else 0.0
        )
        wait = waits.get(row.id)
        item["wait"] = wait.as_dict() if wait is not None else None
        tenants.append(item)
    return {
        "generated_at": now.isoformat(),
        "window_minutes": window,
        "sort": sort,
        "queue": queue,
        "totals": {
            **totals(counts),
            "retrying": sum(retrying.values()),
            f"failures_last_{FINISHED_MINUTES}m": sum(f.failures for f in failures.values()),
            f"timeouts_last_{FINISHED_MINUTES}m": sum(f.timeouts for f in failures.values()),
        },
        "served": total_served,
        "wait": stats.wait_summary(window, now=now).as_dict(),
        "fairness": fair.as_dict(),
        "series": [m.as_dict() for m in stats.minute_series(series_minutes, now=now)],
        "tenants": tenants,
        "failing": failing,
        **fleet(),
    }


def fleet() -> dict[str, Any]:
    """The workers as the dashboard shows them: how many are live (alive or silent) and in
    each state, and the running messages whose lease expired. With no live worker, nothing
    that counts as running runs: the dashboard says so beside the running count."""
    views = worker_registry.workers()
    states = ("alive", "silent", "dead", "stopped")
    return {
        "workers": {
            "live": len(worker_registry.live(views)),
            **{state: sum(1 for v in views if v.state == state) for state in states},
        },
        "expired_leases": message_store.select_stale_lease_count(using=_db()),
    }

"""Per channel and minute statistics: what workers claimed and settled, and how long it waited.

Workers tally in memory with a :class:`StatsRecorder` and flush every few seconds (a
synchronous pass, ``Worker.run_once()`` or ``testing.drain()``, at its end): one upsert
of one row per (channel, minute) into ``fairqueue_channel_stat``
(:func:`django_fairqueue.db.stats_store.record_channel_stats`), so the claim itself writes nothing
extra. The same flush adds the sums of its rows per minute, all channels together, to
``fairqueue_minute_stat`` (in the same transaction, so the two agree). The query helpers below
feed the admin dashboard, ``manage.py fairqueue status`` and the metrics; they read with the
ORM and sum in the database (histogram buckets are summed element by element,
``SUM(wait_histogram[i])``), so their cost grows with the rows of the window asked for, never
with the message table. Figures over all channels (the per-minute series, the overall wait,
the outcome totals) read the per-minute sums: one row a minute, whatever the number of
channels.

**Wait** is the time from when a message became claimable to the claim that took it:
``claimed_at - max(enqueued_at, run_at)`` (a delayed message or a retry waits from its
``run_at``). It is counted into the histogram of :data:`~django_fairqueue.models.WAIT_BUCKETS_MS`:
bucket ``i`` holds waits in ``(bound[i-1], bound[i]]`` milliseconds (bucket 0: ``[0, 1]``), the
last bucket everything above 60 s.

**Percentiles** are estimated from summed histograms by linear interpolation inside the bucket
that holds the wanted rank (the last bucket is closed by the largest wait seen, ``wait_ms_max``).
The estimate always lies in the same bucket as the true value, so its error is at most that
bucket's width. The bounds grow by x2 or x2.5 (1, 2, 5, 10, 20, 50 ms ... 30 s, 60 s), so the
resolution is about one step of that scale: a true p95 of 700 ms is reported somewhere in
500-1,000 ms, of 1.1 s somewhere in 1-2 s; above 60 s it is bounded only by the largest wait
seen. Good enough to tell who waits seconds from who waits milliseconds; not a stopwatch.

**Jain's fairness index** of values ``x_1..x_n`` is ``(sum x)^2 / (n * sum x^2)``: 1 when all
are equal, ``1/n`` when one takes everything. :func:`fairness` applies it to the *served
shares* of the channels that are *backlogged now* (ready messages waiting, not paused): ``x_c``
is the number of messages claimed from channel ``c`` in the window divided by its ``weight``,
so weighted shares that match the weights score 1. A channel held back by its own limits
(``max_concurrency`` reached, ``release_interval``) gets less by design and lowers the index; a
channel whose backlog started late in the window counts with what it got since. The index
says whether the contenders were served alike; the per-channel shares say who was not.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from django.db.models import Max, Sum

from django_fairqueue import conf
from django_fairqueue.db import message_store, stats_store
from django_fairqueue.models import WAIT_BUCKETS_MS, ChannelStat, MinuteStat
from django_fairqueue.observe import moments

__all__ = [
    "BUCKETS",
    "Failing",
    "Fairness",
    "MinuteSummary",
    "StatsRecorder",
    "WaitSummary",
    "bucket_of",
    "failing_counts",
    "failing_of",
    "fairness",
    "finished_counts",
    "finished_of",
    "jain_index",
    "minute_series",
    "percentile_from_histogram",
    "prune",
    "served_counts",
    "served_of",
    "wait_by_channel",
    "wait_summary",
    "window_start",
    "window_stats",
]

#: Upper bounds (ms) of the wait histogram's buckets; one more bucket holds everything above.
BUCKETS: tuple[int, ...] = tuple(WAIT_BUCKETS_MS)
N_BUCKETS = len(BUCKETS) + 1

Outcome = Literal["succeeded", "failed", "retried", "aborted"]
_OUTCOMES = ("succeeded", "failed", "retried", "aborted")


def bucket_of(wait_ms: float) -> int:
    """Index of the histogram bucket of a wait in milliseconds (negative waits count as 0)."""
    return bisect_left(BUCKETS, max(wait_ms, 0.0))


def minute_of(moment: datetime) -> datetime:
    """``moment`` truncated to its minute, in UTC (a naive one is in ``TIME_ZONE``, as Django
    has it with ``USE_TZ = False``)."""
    return moments.aware(moment).astimezone(UTC).replace(second=0, microsecond=0)


# --------------------------------------------------------------------------------------------
# Recording (workers)


@dataclass(slots=True)
class _Tally:
    claimed: int = 0
    succeeded: int = 0
    failed: int = 0
    retried: int = 0
    wait_ms_sum: int = 0
    wait_ms_max: int = 0
    histogram: list[int] = field(default_factory=lambda: [0] * N_BUCKETS)
    run_ms_sum: int = 0
    timed_out: int = 0

    def add(self, other: _Tally) -> None:
        self.claimed += other.claimed
        self.succeeded += other.succeeded
        self.failed += other.failed
        self.retried += other.retried
        self.timed_out += other.timed_out
        self.wait_ms_sum += other.wait_ms_sum
        self.wait_ms_max = max(self.wait_ms_max, other.wait_ms_max)
        self.histogram = [a + b for a, b in zip(self.histogram, other.histogram, strict=True)]
        self.run_ms_sum += other.run_ms_sum


class StatsRecorder:
    """Tallies claims and outcomes per (channel, minute) in memory; :meth:`flush` writes them.

    Thread-safe: the claimer, the handlers and a flushing thread may call it concurrently.
    A flush that fails puts its tallies back, so the next flush writes them (nothing is
    counted twice: the upsert adds, and a failed statement added nothing).
    """

    def __init__(self, *, using: str | None = None) -> None:
        self.using = using
        self._lock = threading.Lock()
        self._tallies: dict[tuple[int, datetime], _Tally] = {}

    def _tally(self, channel_id: int, minute: datetime) -> _Tally:
        key = (channel_id, minute)
        tally = self._tallies.get(key)
        if tally is None:
            tally = self._tallies[key] = _Tally()
        return tally

    def record_claimed(
        self, messages: Iterable[message_store.ClaimedMessage], claimed_at: datetime
    ) -> None:
        """Count messages one claim returned at ``claimed_at`` (an aware datetime), with their
        wait: ``claimed_at - max(enqueued_at, run_at)``."""
        claimed_at = moments.aware(claimed_at)
        minute = minute_of(claimed_at)
        # Grouped by channel first: a tally is found once per channel of the claim, not once
        # per message (its key hashes an aware datetime, which is not cheap).
        waits: dict[int, list[float]] = {}
        for message in messages:
            ready_since = max(message.enqueued_at, message.run_at)
            wait_ms = max((claimed_at - ready_since).total_seconds() * 1000.0, 0.0)
            waits.setdefault(message.channel_id, []).append(wait_ms)
        with self._lock:
            for channel_id, channel_waits in waits.items():
                tally = self._tally(channel_id, minute)
                tally.claimed += len(channel_waits)
                tally.wait_ms_sum += sum(round(wait_ms) for wait_ms in channel_waits)
                tally.wait_ms_max = max(tally.wait_ms_max, math.ceil(max(channel_waits)))
                histogram = tally.histogram
                for wait_ms in channel_waits:
                    histogram[bucket_of(wait_ms)] += 1

    def record_settled(
        self,
        channel_id: int,
        outcome: Outcome,
        run_ms: float,
        *,
        at: datetime | None = None,
        timed_out: bool = False,
    ) -> None:
        """Count one finished attempt: ``succeeded``, ``failed`` (for good) or ``retried``
        (failed, will run again), which ran ``run_ms`` milliseconds. ``timed_out``: the failed
        attempt ran out of time (its time limit, or its lease expired) instead of raising.

        ``aborted`` (stopped on an abort request) adds its worker time only: it neither
        succeeded nor failed, yet a worker ran it, and usage bills worker time."""
        self.record_settled_many([(channel_id, outcome, run_ms, timed_out)], at=at)

    def record_settled_many(
        self,
        attempts: Iterable[tuple[int, Outcome, float, bool]],
        *,
        at: datetime | None = None,
    ) -> None:
        """Count finished attempts given as ``(channel_id, outcome, run_ms, timed_out)`` (see
        :meth:`record_settled`), all at ``at``: one lock and one minute for the lot, as a
        worker settles them."""
        minute = minute_of(at if at is not None else moments.now())
        rows = list(attempts)
        for _channel_id, outcome, _run_ms, timed_out in rows:
            if outcome not in _OUTCOMES:
                raise ValueError(f"outcome must be one of {_OUTCOMES}, got {outcome!r}")
            if timed_out and outcome == "succeeded":
                raise ValueError("a succeeded attempt did not time out")
        with self._lock:
            for channel_id, outcome, run_ms, timed_out in rows:
                tally = self._tally(channel_id, minute)
                if outcome == "succeeded":
                    tally.succeeded += 1
                elif outcome == "failed":
                    tally.failed += 1
                elif outcome == "retried":
                    tally.retried += 1
                tally.timed_out += timed_out
                tally.run_ms_sum += max(round(run_ms), 0)

    def pending(self) -> int:
        """How many (channel, minute) rows the next flush would write."""
        with self._lock:
            return len(self._tallies)

    def flush(self) -> int:
        """Write the tallies (one upsert) and forget them; returns the rows written."""
        with self._lock:
            tallies, self._tallies = self._tallies, {}
        if not tallies:
            return 0
        rows = [
            stats_store.ChannelMinuteStats(
                channel_id=channel_id,
                minute=minute,
                claimed=t.claimed,
                succeeded=t.succeeded,
                failed=t.failed,
                retried=t.retried,
                wait_ms_sum=t.wait_ms_sum,
                wait_ms_max=t.wait_ms_max,
                wait_histogram=tuple(t.histogram),
                run_ms_sum=t.run_ms_sum,
                timed_out=t.timed_out,
            )
            for (channel_id, minute), t in sorted(tallies.items())
        ]
        try:
            stats_store.record_channel_stats(rows, using=self.using)
        except BaseException:
            with self._lock:
                for key, tally in tallies.items():
                    current = self._tallies.get(key)
                    if current is None:
                        self._tallies[key] = tally
                    else:
                        current.add(tally)
            raise
        return len(rows)


def prune(older_than: timedelta = timedelta(days=1), *, using: str | None = None) -> None:
    """Delete statistics rows older than ``older_than`` (the maintenance loop's job)."""
    stats_store.prune_channel_stats(moments.now() - older_than, using=using)


# --------------------------------------------------------------------------------------------
# Reading (dashboard, status, metrics)


def window_start(minutes: int, now: datetime | None = None) -> datetime:
    """First minute of a window of ``minutes`` minutes ending now: the current (partial)
    minute and the ``minutes - 1`` before it."""
    if minutes < 1:
        raise ValueError(f"minutes must be >= 1, got {minutes}")
    return minute_of(now or moments.now()) - timedelta(minutes=minutes - 1)


def _window(minutes: int, now: datetime | None, channel_ids: Sequence[int] | None) -> Any:
    qs = ChannelStat.objects.using(conf.get().DATABASE).filter(
        minute__gte=window_start(minutes, now)
    )
    if channel_ids is not None:
        qs = qs.filter(channel_id__in=list(channel_ids))
    return qs.order_by()


def _minutes(minutes: int, now: datetime | None) -> Any:
    """The per-minute sums over all channels in the window (one row a minute)."""
    return (
        MinuteStat.objects.using(conf.get().DATABASE)
        .filter(minute__gte=window_start(minutes, now))
        .order_by()
    )


_HISTOGRAM_SUMS = {f"h{i}": Sum(f"wait_histogram__{i}") for i in range(N_BUCKETS)}


def _histogram(row: Mapping[str, Any]) -> list[int]:
    return [int(row[f"h{i}"] or 0) for i in range(N_BUCKETS)]


def window_stats(
    minutes: int = 5, *, channel_ids: Sequence[int] | None = None, now: datetime | None = None
) -> dict[int, stats_store.WindowStats]:
    """{channel id: its sums over the window}, for the channels (of ``channel_ids``, or all)
    with statistics there. One statement; :func:`served_of`, :func:`finished_of` and
    :func:`failing_of` take the figures out of it."""
    since = window_start(minutes, now)
    rows = stats_store.select_channel_window_stats(since, channel_ids, using=conf.get().DATABASE)
    return {w.channel_id: w for w in rows}


def served_of(window: Mapping[int, stats_store.WindowStats]) -> dict[int, int]:
    """{channel id: messages claimed}, for the channels with any."""
    return {cid: w.claimed for cid, w in window.items() if w.claimed}


def finished_of(window: Mapping[int, stats_store.WindowStats]) -> dict[int, int]:
    """{channel id: messages finished}: succeeded plus failed for good (retried attempts are
    not finished), for the channels with any."""
    return {cid: w.succeeded + w.failed for cid, w in window.items() if w.succeeded + w.failed}


def served_counts(
    minutes: int = 5, *, channel_ids: Sequence[int] | None = None, now: datetime | None = None
) -> dict[int, int]:
    """{channel id: messages claimed in the window}, for channels with any."""
    return served_of(window_stats(minutes, channel_ids=channel_ids, now=now))


def finished_counts(
    minutes: int = 5, *, channel_ids: Sequence[int] | None = None, now: datetime | None = None
) -> dict[int, int]:
    """{channel id: messages finished in the window}: succeeded plus failed for good (retried
    attempts are not finished)."""
    return finished_of(window_stats(minutes, channel_ids=channel_ids, now=now))


def percentile_from_histogram(
    histogram: Sequence[int], q: float, *, max_ms: float | None = None
) -> float | None:
    """Estimated ``q``-th percentile (0-100) in ms of a wait histogram; ``None`` if empty.

    The rank ``q/100 * count`` is located in its bucket and interpolated linearly between the
    bucket's bounds; the last, open bucket ends at ``max_ms`` (or at its lower bound without
    one).
    """
    if not 0 <= q <= 100:
        raise ValueError(f"q must be between 0 and 100, got {q}")
    if len(histogram) != N_BUCKETS:
        raise ValueError(f"a wait histogram has {N_BUCKETS} buckets, got {len(histogram)}")
    total = sum(histogram)
    if total <= 0:
        return None
    rank = q / 100 * total
    seen = 0
    for i, count in enumerate(histogram):
        if count <= 0:
            continue
        if seen + count >= rank:
            lower = float(BUCKETS[i - 1]) if i > 0 else 0.0
            if i < len(BUCKETS):
                upper = float(BUCKETS[i])
            else:
                upper = max(float(max_ms), lower) if max_ms is not None else lower
            if max_ms is not None:
                upper = min(upper, max(float(max_ms), lower))
            return lower + (upper - lower) * max(rank - seen, 0.0) / count
        seen += count
    raise AssertionError("unreachable: the rank is at most the total")  # pragma: no cover


@dataclass(frozen=True, slots=True)
class WaitSummary:
    """Waits of the messages claimed in a window (ms); percentiles estimated, see the module."""

    count: int
    mean_ms: float | None
    p50_ms: float | None
    p95_ms: float | None
    max_ms: int | None

    @classmethod
    def of(cls, histogram: Sequence[int], wait_sum: int, wait_max: int | None) -> WaitSummary:
        count = sum(histogram)
        if count == 0:
            return cls(0, None, None, None, None)
        return cls(
            count=count,
            mean_ms=wait_sum / count,
            p50_ms=percentile_from_histogram(histogram, 50, max_ms=wait_max),
            p95_ms=percentile_from_histogram(histogram, 95, max_ms=wait_max),
            max_ms=wait_max,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "mean_ms": _round(self.mean_ms),
            "p50_ms": _round(self.p50_ms),
            "p95_ms": _round(self.p95_ms),
            "max_ms": self.max_ms,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def wait_summary(
    minutes: int = 5, *, channel_ids: Sequence[int] | None = None, now: datetime | None = None
) -> WaitSummary:
    """Wait of every message claimed in the window (of the given channels, or all: then read
    from the per-minute sums)."""
    rows = _minutes(minutes, now) if channel_ids is None else _window(minutes, now, channel_ids)
    row = rows.aggregate(
        wait_sum=Sum("wait_ms_sum"), wait_max=Max("wait_ms_max"), **_HISTOGRAM_SUMS
    )
    return WaitSummary.of(_histogram(row), int(row["wait_sum"] or 0), row["wait_max"])


def wait_by_channel(
    minutes: int, channel_ids: Sequence[int] | None, *, now: datetime | None = None
) -> dict[int, WaitSummary]:
    """{channel id: its waits in the window}, for the given channels (None: all) that claimed
    any."""
    rows = (
        _window(minutes, now, channel_ids)
        .values("channel_id")
        .annotate(wait_sum=Sum("wait_ms_sum"), wait_max=Max("wait_ms_max"), **_HISTOGRAM_SUMS)
    )
    out = {}
    for row in rows:
        summary = WaitSummary.of(_histogram(row), int(row["wait_sum"] or 0), row["wait_max"])
        if summary.count:
            out[row["channel_id"]] = summary
    return out


@dataclass(frozen=True, slots=True)
class MinuteSummary:
    """Everything claimed and settled in one minute, all channels together."""

    minute: datetime
    claimed: int
    succeeded: int
    failed: int
    retried: int
    wait: WaitSummary

    def as_dict(self) -> dict[str, Any]:
        return {
            "minute": self.minute.isoformat(),
            "claimed": self.claimed,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "retried": self.retried,
            "wait": self.wait.as_dict(),
        }


def minute_series(minutes: int = 30, *, now: datetime | None = None) -> list[MinuteSummary]:
    """One summary per minute of the window, oldest first; minutes without claims included
    (with zeros), so a chart's time axis has no holes."""
    first = window_start(minutes, now)
    rows = {moments.aware(row.minute): row for row in _minutes(minutes, now)}
    out = []
    for i in range(minutes):
        minute = first + timedelta(minutes=i)
        row = rows.get(minute)
        if row is None:
            out.append(MinuteSummary(minute, 0, 0, 0, 0, WaitSummary(0, None, None, None, None)))
            continue
        histogram = [0] * N_BUCKETS
        for i, n in enumerate(row.wait_histogram[:N_BUCKETS]):
            histogram[i] = int(n or 0)
        out.append(
            MinuteSummary(
                minute=minute,
                claimed=row.claimed,
                succeeded=row.succeeded,
                failed=row.failed,
                retried=row.retried,
                wait=WaitSummary.of(histogram, row.wait_ms_sum, row.wait_ms_max),
            )
        )
    return out


def jain_index(values: Iterable[float]) -> float | None:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)`` of non-negative values.

    1.0 when all are equal, ``1/n`` when one value holds everything; ``None`` for no values or
    all zero (nobody was served: there is no share to compare).
    """
    xs = [float(x) for x in values]
    if any(x < 0 for x in xs):
        raise ValueError("Jain's index is defined for non-negative values")
    squares = sum(x * x for x in xs)
    if not xs or squares == 0:
        return None
    return sum(xs) ** 2 / (len(xs) * squares)


@dataclass(frozen=True, slots=True)
class Fairness:
    """Jain's index of the weighted served shares of the backlogged channels (see module)."""

    minutes: int
    index: float | None
    #: backlogged channels the index is taken over
    channels: int
    #: messages claimed in the window from those channels
    served: int
    #: {channel id: share of ``served``} (0..1), for the backlogged channels
    shares: dict[int, float]

    def as_dict(self) -> dict[str, Any]:
        return {
            "minutes": self.minutes,
            "index": None if self.index is None else round(self.index, 4),
            "channels": self.channels,
            "served": self.served,
        }


def fairness(
    backlogged: Mapping[int, int],
    minutes: int = 5,
    *,
    served: Mapping[int, int] | None = None,
    now: datetime | None = None,
) -> Fairness:
    """Jain's index over ``backlogged`` ({channel id: weight}) of what each was served in the
    window (``served``: {channel id: claimed}; read from the statistics when not given)."""
    if served is None:
        served = served_counts(minutes, now=now)
    got = {cid: served.get(cid, 0) for cid in backlogged}
    total = sum(got.values())
    index = jain_index(got[cid] / max(weight, 1) for cid, weight in backlogged.items())
    shares = {cid: (n / total if total else 0.0) for cid, n in got.items()}
    return Fairness(minutes, index, len(backlogged), total, shares)


def outcome_totals(minutes: int = 5, *, now: datetime | None = None) -> dict[str, int]:
    """Claimed, succeeded, retried and failed (for good) over the window, over all channels;
    ``timed_out``: of retried and failed, the attempts that ran out of time."""
    row = _minutes(minutes, now).aggregate(
        claimed=Sum("claimed"),
        succeeded=Sum("succeeded"),
        retried=Sum("retried"),
        failed=Sum("failed"),
        timed_out=Sum("timed_out"),
    )
    return {key: int(value or 0) for key, value in row.items()}


@dataclass(frozen=True, slots=True)
class Failing:
    """A channel's failed attempts in a window, retried or dead-lettered, in two kinds."""

    #: attempts whose task raised
    failures: int = 0
    #: attempts that ran out of time: past the task's time limit, or their lease expired and
    #: the rescuer took them back
    timeouts: int = 0

    @property
    def total(self) -> int:
        return self.failures + self.timeouts


def failing_of(window: Mapping[int, stats_store.WindowStats]) -> dict[int, Failing]:
    """{channel id: its failed attempts}, for the channels with any: failures (the task
    raised) and timeouts (time limit, expired lease), retried or failed for good."""
    out = {}
    for cid, w in window.items():
        failed = w.retried + w.failed
        if failed:
            late = min(w.timed_out, failed)
            out[cid] = Failing(failures=failed - late, timeouts=late)
    return out


def failing_counts(
    minutes: int = 5, *, channel_ids: Sequence[int] | None = None, now: datetime | None = None
) -> dict[int, Failing]:
    """{channel id: its failed attempts in the window}, for the channels with any: failures
    (the task raised) and timeouts (time limit, expired lease), retried or failed for good."""
    return failing_of(window_stats(minutes, channel_ids=channel_ids, now=now))

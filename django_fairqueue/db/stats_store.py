"""Statistics: the per-channel and per-minute tallies workers flush, and their windows."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import transaction
from psycopg.types.json import Jsonb

from django_fairqueue import conf
from django_fairqueue.db import pg

queries = pg.StatementFile("django_fairqueue.db", "statements/statistics.sql")
_run = queries.run


@dataclass(frozen=True, slots=True)
class WindowStats:
    """A channel's statistics summed over a window of minutes."""

    channel_id: int
    claimed: int
    succeeded: int
    #: failed for good (dead letters)
    failed: int
    #: failed and will run again
    retried: int
    #: of ``failed`` and ``retried``, the attempts that ran out of time
    timed_out: int


def select_channel_window_stats(
    since: datetime, ids: Sequence[int] | None = None, *, using: str | None = None
) -> list[WindowStats]:
    """Per channel with statistics since ``since`` (of ``ids``, or all): the window's sums."""
    if ids is not None:
        return select_window_stats_of_channels(since, ids, using=using)
    return [WindowStats(*r) for r in _run("select_channel_window_stats", {"since": since}, using)]


def select_window_stats_of_channels(
    since: datetime, ids: Sequence[int], *, using: str | None = None
) -> list[WindowStats]:
    """:func:`select_channel_window_stats` for the channels of ``ids`` only."""
    if not ids:
        return []
    params = {"since": since, "ids": list(ids)}
    return [WindowStats(*r) for r in _run("select_window_stats_of_channels", params, using)]


@dataclass(frozen=True, slots=True)
class ChannelMinuteStats:
    """Tallies of one channel for one minute, as flushed by a worker."""

    channel_id: int
    minute: datetime
    claimed: int = 0
    succeeded: int = 0
    failed: int = 0
    retried: int = 0
    wait_ms_sum: int = 0
    wait_ms_max: int = 0
    wait_histogram: tuple[int, ...] = ()
    run_ms_sum: int = 0
    #: of ``failed`` and ``retried``, the attempts that ran out of time (time limit, or an
    #: expired lease rescued)
    timed_out: int = 0


def record_channel_stats(stats: Sequence[ChannelMinuteStats], *, using: str | None = None) -> None:
    """Add per-(channel, minute) tallies to the statistics table (one upsert), their sums
    per minute to the per-minute table (a second upsert), and their usage per channel and hour
    (:func:`record_usage`), in one transaction."""
    if not stats:
        return
    alias = using or conf.get().DATABASE
    with transaction.atomic(using=alias):
        _run(
            "record_channel_stats",
            {
                "channel_ids": [x.channel_id for x in stats],
                "minutes": [x.minute for x in stats],
                "claimed": [x.claimed for x in stats],
                "succeeded": [x.succeeded for x in stats],
                "failed": [x.failed for x in stats],
                "retried": [x.retried for x in stats],
                "wait_ms_sum": [x.wait_ms_sum for x in stats],
                "wait_ms_max": [x.wait_ms_max for x in stats],
                "histograms": [Jsonb(list(x.wait_histogram)) for x in stats],
                "run_ms_sum": [x.run_ms_sum for x in stats],
                "timed_out": [x.timed_out for x in stats],
            },
            alias,
        )
        record_minute_stats(stats, using=alias)
        record_usage(stats, using=alias)  # per tenant and hour, for billing (after: lock order)


def record_minute_stats(stats: Sequence[ChannelMinuteStats], *, using: str | None = None) -> None:
    """Add the sums per minute of these tallies (all their channels together) to the
    per-minute table. :func:`record_channel_stats` calls it in its transaction, after writing
    the channel rows (the lock order of the two statements)."""
    if not stats:
        return
    totals: dict[datetime, list[Any]] = {}
    for x in stats:
        t = totals.get(x.minute)
        if t is None:
            t = totals[x.minute] = [0, 0, 0, 0, 0, 0, 0, [], 0]
        for i, value in enumerate(
            (x.claimed, x.succeeded, x.failed, x.retried, x.timed_out, x.wait_ms_sum)
        ):
            t[i] += value
        t[6] = max(t[6], x.wait_ms_max)
        histogram = t[7]
        if len(histogram) < len(x.wait_histogram):
            histogram.extend([0] * (len(x.wait_histogram) - len(histogram)))
        for i, n in enumerate(x.wait_histogram):
            histogram[i] += n
        t[8] += x.run_ms_sum
    minutes = sorted(totals)
    columns = list(zip(*(totals[m] for m in minutes), strict=True))
    _run(
        "record_minute_stats",
        {
            "minutes": minutes,
            "claimed": list(columns[0]),
            "succeeded": list(columns[1]),
            "failed": list(columns[2]),
            "retried": list(columns[3]),
            "timed_out": list(columns[4]),
            "wait_ms_sum": list(columns[5]),
            "wait_ms_max": list(columns[6]),
            "histograms": [Jsonb(h) for h in columns[7]],
            "run_ms_sum": list(columns[8]),
        },
        using,
    )


def prune_channel_stats(before: datetime, *, using: str | None = None) -> None:
    _run("prune_channel_stats", {"before": before}, using)


# --------------------------------------------------------------------------------------------
# Per-tenant usage (django_fairqueue.observe.usage): per channel and hour, and per channel in all


def hour_of(moment: datetime) -> datetime:
    """``moment`` truncated to its hour, in UTC: the key of a usage row."""
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


#: The figures of a usage row, in the order of the record_usage_* statements' arrays.
USAGE_FIGURES = ("attempts", "succeeded", "failures", "timeouts", "worker_ms")


def _usage_sums(rows: Iterable[tuple[Any, Sequence[int]]]) -> dict[Any, list[int]]:
    """The figures of ``(key, figures)`` pairs summed per key."""
    sums: dict[Any, list[int]] = {}
    for key, figures in rows:
        total = sums.setdefault(key, [0] * len(USAGE_FIGURES))
        for i, value in enumerate(figures):
            total[i] += value
    return sums


def _usage_params(sums: Mapping[Any, Sequence[int]], keys: list[Any]) -> dict[str, list[int]]:
    columns = list(zip(*(sums[k] for k in keys), strict=True))
    return {name: list(columns[i]) for i, name in enumerate(USAGE_FIGURES)}


def record_usage(stats: Sequence[ChannelMinuteStats], *, using: str | None = None) -> None:
    """Add the usage of a statistics flush per (channel, hour) and per channel: attempts
    settled, succeeded, failed (timeouts among them) and worker time. Called by
    :func:`record_channel_stats` in its transaction, after the minute rows (the lock order)."""
    hours = _usage_sums(
        (
            (hour_of(x.minute), x.channel_id),
            (
                x.succeeded + x.failed + x.retried,
                x.succeeded,
                x.failed + x.retried,
                x.timed_out,
                x.run_ms_sum,
            ),
        )
        for x in stats
        if x.succeeded + x.failed + x.retried or x.run_ms_sum  # claims alone: nothing settled
    )
    if hours:
        record_usage_hours(hours, using=using)
        record_usage_totals(
            _usage_sums((cid, figures) for (_, cid), figures in hours.items()), using=using
        )


def record_usage_hours(
    hours: Mapping[tuple[datetime, int], Sequence[int]], *, using: str | None = None
) -> None:
    """Add figures per (hour, channel id) (:data:`USAGE_FIGURES`) to the usage hours."""
    keys = sorted(hours)
    params = {"hours": [h for h, _ in keys], "channel_ids": [c for _, c in keys]}
    _run("record_usage_hours", {**params, **_usage_params(hours, keys)}, using)


def record_usage_totals(totals: Mapping[int, Sequence[int]], *, using: str | None = None) -> None:
    """Add figures per channel id (:data:`USAGE_FIGURES`) to the usage totals."""
    ids = sorted(totals)
    _run("record_usage_totals", {"channel_ids": ids, **_usage_params(totals, ids)}, using)


def prune_usage(before: datetime, *, using: str | None = None) -> None:
    _run("prune_usage", {"before": before}, using)

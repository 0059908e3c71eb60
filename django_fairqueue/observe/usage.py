"""Per-tenant usage: the worker time, attempts and failures of each channel and group, per hour.

Workers write it with their statistics flush
(:func:`django_fairqueue.db.stats_store.record_usage`, in
the transaction of the per-minute statistics, so the settle path itself writes nothing more)
into ``fairqueue_usage``, one row per channel and hour, kept ``FAIRQUEUE['USAGE_RETENTION']``
(31 days by default, pruned by maintenance), and into ``fairqueue_usage_total``, one row per
channel since it was first recorded (the Prometheus counters).

This module reads it for the admin's usage page, ``manage.py fairqueue usage`` and the
metrics. A report sums the hours of a range of days: days are those of the current time zone
(``TIME_ZONE``), each from its local midnight, so "yesterday" is the operator's yesterday.
Rows are hours in UTC: in a zone whose offset is not a whole number of hours, a day's first and
last hours are those of the UTC hours that start in it.

Worker time is what the attempts ran, measured by their workers (an attempt whose lease expired
is charged 0 s by the rescuer, which cannot know how long it ran). Usage counts attempts as
they settle: an attempt running across midnight counts on the day it ended.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta
from typing import Any, Literal

from django.db.models import Max, Sum
from django.utils import timezone

from django_fairqueue import conf
from django_fairqueue.models import UsageHour, UsageTotal
from django_fairqueue.observe import moments
from django_fairqueue.queues import DEFAULT_QUEUE, SEPARATOR, split_row_name

__all__ = [
    "BY",
    "LAST_DAY",
    "SORTS",
    "UsageRow",
    "as_csv",
    "day_range",
    "parse_day",
    "report",
    "totals",
]

By = Literal["channel", "group"]
#: What a report sums by: each channel, or each channel group (channels of no group together).
BY: tuple[str, ...] = ("channel", "group")
#: The orders a report can take (a leading "-" for descending, as in the admin's URLs).
SORTS: tuple[str, ...] = (
    "name",
    "queue",
    "worker_seconds",
    "attempts",
    "succeeded",
    "failures",
    "timeouts",
    "failure_rate",
)
#: The name of the row of channels that belong to no group, in a report by group.
NO_GROUP = "(no group)"
_SUMS = ("attempts", "succeeded", "failures", "timeouts", "worker_ms")


@dataclass(frozen=True, slots=True)
class UsageRow:
    """The usage of one channel (or group) over a report's range."""

    #: the channel's (or group's) name within its queue, as enqueue takes it
    name: str
    queue: str
    attempts: int
    succeeded: int
    failures: int
    timeouts: int
    worker_ms: int
    #: the channel's id (None in a report by group)
    channel_id: int | None = None
    #: the channel's group ("" for none; in a report by group, the group itself)
    group: str = ""

    @property
    def worker_seconds(self) -> float:
        return self.worker_ms / 1000

    @property
    def failure_rate(self) -> float:
        """Failed attempts over attempts settled (0 with none)."""
        return self.failures / self.attempts if self.attempts else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "queue": self.queue,
            "group": self.group,
            "channel_id": self.channel_id,
            "worker_seconds": round(self.worker_seconds, 3),
            "attempts": self.attempts,
            "succeeded": self.succeeded,
            "failures": self.failures,
            "timeouts": self.timeouts,
            "failure_rate": round(self.failure_rate, 4),
        }


#: The last day a report can cover: a report runs to the midnight after its last day, and
#: 9999-12-31 has none a ``datetime`` can hold.
LAST_DAY = date.max - timedelta(days=1)


_DAY = re.compile(r"\d{4}-\d\d-\d\d")


def parse_day(text: str) -> date:
    """A day as ``YYYY-MM-DD`` (up to :data:`LAST_DAY`), or ``today`` / ``yesterday``;
    ValueError otherwise."""
    today = moments.today()
    if text == "today":
        return today
    if text == "yesterday":
        return today - timedelta(days=1)
    try:
        # (fromisoformat also reads 20261130 and 2026-W48-1: the day as documented only)
        day = date.fromisoformat(text) if _DAY.fullmatch(text) else None
    except ValueError:
        day = None
    if day is None or day > LAST_DAY:
        raise ValueError(
            f"a day is YYYY-MM-DD up to {LAST_DAY}, 'today' or 'yesterday', got {text!r}"
        )
    return day


def day_range(first: date, last: date) -> tuple[datetime, datetime]:
    """The instants from ``first``'s local midnight to the midnight after ``last`` (in the
    zone Django shows times in, :func:`~django_fairqueue.observe.moments.zone`): the range of
    a report of the days ``first`` to ``last``."""
    if last < first:
        raise ValueError(f"the last day ({last}) is before the first ({first})")
    zone = moments.zone()
    start = timezone.make_aware(datetime.combine(first, time()), zone)
    end = timezone.make_aware(datetime.combine(last + timedelta(days=1), time()), zone)
    return start, end


def _sort_key(order: str) -> tuple[str, bool]:
    field = order.removeprefix("-")
    if field not in SORTS:
        raise ValueError(f"order must be one of {SORTS} (with - for descending), got {order!r}")
    return field, order.startswith("-")


def report(
    start: datetime,
    end: datetime,
    *,
    by: str = "channel",
    order: str = "-worker_seconds",
    queue: str | None = None,
    limit: int | None = None,
) -> list[UsageRow]:
    """Usage from ``start`` (included) to ``end`` (excluded), summed per channel or group
    (``by``), in ``order`` (a field of :data:`SORTS`, ``-`` first for descending; ties by
    name), of one ``queue`` or every queue, at most ``limit`` rows.

    One statement: the hours of the range (``fq_usage_hour_channel``'s leading hour), grouped.
    """
    if by not in BY:
        raise ValueError(f"by must be one of {BY}, got {by!r}")
    field, descending = _sort_key(order)
    hours = UsageHour.objects.using(conf.get().DATABASE).filter(hour__gte=start, hour__lt=end)
    if queue is not None:  # a channel row's name says its queue (queues.row_name)
        if queue == DEFAULT_QUEUE:
            hours = hours.exclude(channel_name__contains=SEPARATOR)
        else:
            hours = hours.filter(channel_name__startswith=queue + SEPARATOR)
    sums = {name: Sum(name) for name in _SUMS}
    rows: list[UsageRow] = []
    # per channel, by its row's name (queue and name): a channel deleted and created again is
    # one tenant, one line, with the id of its newest row; per group (a group's row name says
    # its queue), and the channels of no group together, in the queue asked for or every
    # queue ("")
    key = "channel_name" if by == "channel" else "group_name"
    grouped: Any = hours.values(key).annotate(
        row=Max("channel_name"), grp=Max("group_name"), newest=Max("channel_id"), **sums
    )
    for r in grouped.order_by():
        if by == "channel":
            q, name = split_row_name(r["row"])
            rows.append(_row(name, q, r, channel_id=r["newest"], group=r["grp"]))
        elif r["grp"]:
            q, name = split_row_name(r["grp"])
            rows.append(_row(name, q, r, group=r["grp"]))
        else:
            rows.append(_row(NO_GROUP, queue or "", r))
    rows.sort(key=lambda r: (r.name, r.queue))  # ties by name, whatever the order
    if field not in ("name", "queue"):
        rows.sort(key=lambda r: getattr(r, field), reverse=descending)
    elif field == "queue":
        rows.sort(key=lambda r: r.queue, reverse=descending)
    elif descending:
        rows.reverse()
    return rows if limit is None else rows[:limit]


def _row(
    name: str, queue: str, r: dict[str, Any], *, channel_id: int | None = None, group: str = ""
) -> UsageRow:
    return UsageRow(
        name=name,
        queue=queue,
        channel_id=channel_id,
        group=group,
        **{k: int(r[k] or 0) for k in _SUMS},
    )


def summed(rows: Iterable[UsageRow]) -> UsageRow:
    """The sum of a report's rows (its "total" line)."""
    rows = list(rows)
    return UsageRow(name="total", queue="", **{k: sum(getattr(r, k) for r in rows) for k in _SUMS})


CSV_COLUMNS = (
    "name",
    "queue",
    "group",
    "worker_seconds",
    "attempts",
    "succeeded",
    "failures",
    "timeouts",
    "failure_rate",
)


def as_csv(rows: Sequence[UsageRow], *, start: datetime, end: datetime, by: str) -> str:
    """A report as CSV: a header line, then one line per row (the range in two columns, so
    files of several ranges can be concatenated)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    # Before Python 3.13 the csv module leaves a carriage return in a field unquoted, and it
    # would end the row for every reader: a row with one has each of its fields quoted.
    quoted = csv.writer(out, lineterminator="\n", quoting=csv.QUOTE_ALL)
    # by group, the name is the group's: no column of its own repeats it
    columns = [c for c in CSV_COLUMNS if not (by == "group" and c == "group")]
    writer.writerow(["from", "to", by, *columns[1:]])
    for r in rows:
        d = r.as_dict()
        cells = [start.isoformat(), end.isoformat(), *(_cell(d[c]) for c in columns)]
        breaks = any(isinstance(c, str) and "\r" in c for c in cells)
        (quoted if breaks else writer).writerow(cells)
    return out.getvalue()


def _cell(value: Any) -> Any:
    """A CSV cell a spreadsheet shows as text: a tenant's name starting with ``=``, ``+``,
    ``-``, ``@`` (or a tab or carriage return) would be read as a formula, so it gets a
    leading ``'`` (OWASP's advice on CSV injection). Numbers are left as they are."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def totals() -> dict[int, UsageTotal]:
    """{channel id: its usage since it was first recorded} (the metrics' counters)."""
    return {t.channel_id: t for t in UsageTotal.objects.using(conf.get().DATABASE).all()}

"""Periodic schedules (``django_fairqueue.schedules``): due schedules, the slots a
pass claims, advancing a schedule, its fires.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django_fairqueue.db import pg

queries = pg.StatementFile("django_fairqueue.db", "statements/schedules.sql")
_run = queries.run


@dataclass(frozen=True, slots=True)
class DueSchedule:
    id: int
    name: str
    channel: str
    task_name: str
    args: Any
    kwargs: Any
    cron: str
    timezone: str
    missed: str
    catch_up_max: int
    jitter: timedelta
    priority: int | None
    enabled: bool
    spec: str
    fired_spec: str | None
    next_fire_at: datetime | None
    last_slot_at: datetime | None
    now: datetime


@dataclass(frozen=True, slots=True)
class ScheduleState:
    id: int
    next_fire_at: datetime | None
    last_slot_at: datetime | None
    last_fired_at: datetime | None
    last_message_id: int | None
    current: bool


def select_due_schedules(
    limit: int,
    *,
    skip_tasks: Sequence[str] = (),
    skip_ids: Sequence[int] = (),
    using: str | None = None,
) -> list[DueSchedule]:
    params = {"limit": limit, "skip_tasks": list(skip_tasks), "skip_ids": list(skip_ids)}
    return [DueSchedule(*row) for row in _run("select_due_schedules", params, using)]


def select_next_schedule_fire(
    *, skip_tasks: Sequence[str] = (), skip_ids: Sequence[int] = (), using: str | None = None
) -> float | None:
    """Seconds until a schedule is due (0: now), or None when no schedule is enabled."""
    params = {"skip_tasks": list(skip_tasks), "skip_ids": list(skip_ids)}
    value = _run("select_next_schedule_fire", params, using)[0][0]
    return None if value is None else float(value)


def claim_schedule_slots(
    schedule_id: int, slots: Sequence[datetime], *, using: str | None = None
) -> list[datetime]:
    params = {"schedule_id": schedule_id, "slots": list(slots)}
    return [row[0] for row in _run("claim_schedule_slots", params, using)]


def advance_schedule(
    schedule: DueSchedule,
    *,
    slots: Sequence[datetime],
    message_ids: Sequence[int],
    last_slot: datetime | None,
    next_fire_at: datetime | None,
    using: str | None = None,
) -> bool:
    """Record the messages of the ``slots`` this pass took, its ``last_slot`` (the newest it
    handled) and ``next_fire_at``, if the row is as ``schedule`` read it; False if not."""
    params = {
        "schedule_id": schedule.id,
        "slots": list(slots),
        "message_ids": list(message_ids),
        "next_fire_at": next_fire_at,
        "last_slot": last_slot,
        "last_message_id": message_ids[-1] if message_ids else None,
        "spec": schedule.spec,
        "seen_fired_spec": schedule.fired_spec,
        "seen_next": schedule.next_fire_at,
        "seen_last": schedule.last_slot_at,
    }
    return bool(_run("advance_schedule", params, using))


def advance_schedules_without_slots(
    rows: Sequence[tuple[DueSchedule, datetime | None]], *, using: str | None = None
) -> list[int]:
    """Write each schedule's next slot (no slot fired) if its row is as read and not held by
    another transaction; returns the ids written."""
    params = {
        "ids": [s.id for s, _ in rows],
        "next": [n for _, n in rows],
        "specs": [s.spec for s, _ in rows],
        "seen_fired": [s.fired_spec for s, _ in rows],
        "seen_next": [s.next_fire_at for s, _ in rows],
        "seen_last": [s.last_slot_at for s, _ in rows],
    }
    return [row[0] for row in _run("advance_schedules_without_slots", params, using)]


def select_schedule_states(
    ids: Sequence[int], *, using: str | None = None
) -> dict[int, ScheduleState]:
    rows = _run("select_schedule_states", {"ids": list(ids)}, using)
    return {row[0]: ScheduleState(*row) for row in rows}


#: Longest wait for the schedule sync's lock (another process syncing, or frozen mid-sync).
SCHEDULE_SYNC_LOCK_TIMEOUT = "5s"


def lock_schedule_sync(*, using: str | None = None) -> None:
    """Take the schedule sync's lock for this transaction; raises ``OperationalError``
    (SQLSTATE 55P03, see :func:`~django_fairqueue.db.pg.is_lock_timeout`) after
    ``SCHEDULE_SYNC_LOCK_TIMEOUT``."""
    _run("lock_schedule_sync", {"lock_timeout": SCHEDULE_SYNC_LOCK_TIMEOUT}, using)


def prune_schedule_fires(before: datetime, *, limit: int = 10_000, using: str | None = None) -> int:
    with pg.kept_cursor(using, values=False) as cur:
        cur.execute(
            queries()["prune_schedule_fires"],
            {"before": before, "limit": limit},
            prepare=False,  # planned at each run, as pg.named_statements says
            binary=True,
        )
        return cur.rowcount

"""Periodic tasks: schedules declared in code or per channel in the admin, fired once per slot.

A schedule enqueues one message of a registered task into a channel at every slot of a cron
expression, read in the schedule's own timezone (:mod:`django_fairqueue.cron`). Schedules come
from two places:

* code: ``@periodic(cron=...)`` stacked on a ``@task``, or ``FAIRQUEUE['SCHEDULES']``. Each
  worker syncs them into the schedule table when it starts (:func:`sync`); an operator can only
  pause and resume them there.
* the admin: an operator's schedule for one channel (a tenant's own report, in its timezone).

Every worker's maintenance loop runs :class:`Scheduler`, which fires what is due
(:func:`fire_due`) and sleeps until the next slot. A slot fires exactly once whatever the number
of workers, processes and restarts: the transaction that enqueues a slot's message first inserts
the slot's row under a unique key (schedule, slot); a concurrent firer of the same slot waits
for it and then finds the key taken. No leader is elected and no lock is held between passes.
The message goes through the normal enqueue path into the schedule's channel, so the channel's
fairness, caps, rate limit and backlog bound apply.

Slots missed while nothing fired (no worker ran, the channel was full) follow the schedule's
``missed`` policy: ``latest`` fires the latest of them once, ``skip`` fires none (a slot within
``FAIRQUEUE['SCHEDULE_GRACE']`` of its time is on time, not missed), ``catch_up`` fires each,
at most ``catch_up_max`` (the newest). A channel with room for fewer of them gets the newest
that fit, and the others are dropped. ``jitter`` delays each slot's message by a fraction of
it that is the same in every process (a hash of the schedule and the slot).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, TypeVar
from zoneinfo import ZoneInfo

from django.db import DatabaseError, OperationalError, transaction

from django_fairqueue import conf, cron, limits
from django_fairqueue.cron import ScheduleSpec, slots_after, validate_cron, validate_timezone
from django_fairqueue.db import channel_store, pg, schedule_store
from django_fairqueue.exceptions import ChannelFull, InvalidChannel, InvalidSchedule, UnknownTask
from django_fairqueue.limits import CHANNEL_NAME_MAX_LENGTH
from django_fairqueue.queues import display_name, row_name, split_row_name
from django_fairqueue.tasks.spec import TaskSpec, check_arguments, registry

logger = logging.getLogger("django_fairqueue.schedules")

T = TypeVar("T")

#: Schedules declared with @periodic in this process, by name.
_declared: dict[str, ScheduleSpec] = {}


def periodic(
    cron: str,
    *,
    name: str | None = None,
    timezone: str = "UTC",
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    channel: str | None = None,
    missed: str = "latest",
    catch_up_max: int = 10,
    jitter: float | timedelta = 0,
    priority: int | None = None,
    enabled: bool = True,
) -> Callable[[T], T]:
    """Run a registered task on a cron schedule; stack it on ``@task``::

        @periodic(cron="0 3 * * *", timezone="Europe/Berlin", name="reports.nightly")
        @task(name="reports.build")
        def build_report() -> None: ...

    ``name`` (default: the task's name) identifies the schedule; stack several ``@periodic``
    with different names for several schedules of one task. ``args``/``kwargs`` are the call's
    arguments (JSON). ``channel`` defaults to the task's channel rule, else
    ``FAIRQUEUE['DEFAULT_CHANNEL']``. ``missed`` is ``"latest"``, ``"skip"`` or
    ``"catch_up"`` (at most ``catch_up_max`` slots); ``jitter`` (seconds or timedelta) delays
    each slot's message by a fixed fraction of it. A bad option raises
    :class:`~django_fairqueue.exceptions.InvalidSchedule` at import.
    """

    def wrap(task_object: T) -> T:
        spec = getattr(task_object, "spec", None)
        if not isinstance(spec, TaskSpec):
            raise InvalidSchedule(
                "@periodic goes above @task: it schedules a registered task, got "
                f"{type(task_object).__name__}"
            )
        schedule_name = name if name is not None else spec.name
        options: dict[str, Any] = {
            "task": spec.name,
            "cron": cron,
            "timezone": timezone,
            "args": args,  # checked as given: list() would turn a string or a set into a list
            "kwargs": kwargs,
            "channel": channel,
            "missed": missed,
            "catch_up_max": catch_up_max,
            "jitter": jitter,
            "priority": priority,
            "enabled": enabled,
        }
        where = f"@periodic {schedule_name!r}"
        built = ScheduleSpec.build(schedule_name, options, where)
        try:  # arguments the task cannot take would fail at each firing
            check_arguments(spec, built.args, built.kwargs)
        except TypeError as exc:
            raise InvalidSchedule(f"{where}: {exc}") from None
        if built.channel is not None:
            from django_fairqueue.api import validate_channel_name

            try:
                validate_channel_name(built.channel)
            except InvalidChannel as exc:
                raise InvalidSchedule(f"{where}: {exc}") from None
        old = _declared.get(schedule_name)
        if old is not None and old.task != built.task:
            raise InvalidSchedule(
                f"schedule name {schedule_name!r} is already declared for task {old.task!r}; "
                "give each @periodic of a task its own name="
            )
        if old is not None and old != built:
            # the same declaration imported again is harmless; a different one would replace
            # the first without a word
            raise InvalidSchedule(
                f"schedule name {schedule_name!r} is already declared for task {old.task!r} "
                f"with other options (cron {old.cron!r}); give each @periodic its own name="
            )
        _declared[schedule_name] = built
        return task_object

    return wrap


def declared() -> list[ScheduleSpec]:
    """Every schedule declared in code: ``@periodic`` (after importing the task modules) and
    ``FAIRQUEUE['SCHEDULES']``. A name declared in both raises."""
    registry.autodiscover()
    specs = dict(_declared)
    for spec in conf.get().SCHEDULES:
        if spec.name in specs:
            raise InvalidSchedule(
                f"schedule {spec.name!r} is declared both with @periodic and in "
                "FAIRQUEUE['SCHEDULES']"
            )
        specs[spec.name] = spec
    return [specs[name] for name in sorted(specs)]


def undeclare(name: str) -> None:
    """Forget a ``@periodic`` schedule of this process (tests)."""
    _declared.pop(name, None)


@dataclass
class SyncResult:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    #: schedules left as they were (not created, changed or deleted), each with why
    skipped: dict[str, str] = field(default_factory=dict)


def schedule_row(
    spec: ScheduleSpec, cfg: conf.FairQueueSettings, where: str
) -> tuple[str, dict[str, Any]]:
    """The channel row name and the column values of a code schedule, or
    :class:`InvalidSchedule` naming ``where`` when the queue would refuse its messages (an
    unregistered task, arguments that do not fit it, a bad channel). Writes nothing: the
    system check (fairqueue.E006) asks it too."""
    from django_fairqueue.api import check_call, validate_channel_name

    try:
        task = registry.get(spec.task)
    except UnknownTask:
        message = f"{where} names task {spec.task!r}, which is not registered"
        raise InvalidSchedule(message) from None
    try:  # (before channel_from, which takes the same arguments)
        check_call(task, spec.args, spec.kwargs, cfg.MAX_PAYLOAD_BYTES)
    except (ValueError, TypeError) as exc:  # PayloadError is a TypeError
        raise InvalidSchedule(f"{where}: {exc}") from None
    channel = spec.channel
    if channel is None and task.channel_from is not None:
        channel = task.channel_from(*spec.args, **spec.kwargs)
    try:
        channel = validate_channel_name(channel or task.channel or cfg.DEFAULT_CHANNEL)
    except InvalidChannel as exc:
        raise InvalidSchedule(f"{where}: {exc}") from None
    # The channel's row in the task's queue, which its messages go to (and where the
    # schedule is listed): "acme" of a task of queue "reports" is the row "reports\x1facme".
    channel = row_name(task.queue, channel)
    if len(channel) > CHANNEL_NAME_MAX_LENGTH:
        raise InvalidSchedule(
            f"{where}: channel {split_row_name(channel)[1]!r} is too long for queue "
            f"{task.queue!r}: queue and channel names and the one character between them take "
            f"{len(channel)} of the "
            f"{CHANNEL_NAME_MAX_LENGTH} characters a channel row's name may have"
        )
    return channel, {
        "task_name": spec.task,
        "args": spec.args,
        "kwargs": spec.kwargs,
        "cron": spec.cron,
        "timezone": spec.timezone,
        "missed": spec.missed,
        "catch_up_max": spec.catch_up_max,
        "jitter": spec.jitter,
        "priority": spec.priority,
    }


def sync(specs: Sequence[ScheduleSpec] | None = None, *, skip_invalid: bool = False) -> SyncResult:
    """Make the code schedules of the table match ``specs`` (default: :func:`declared`).

    Creates the missing ones, updates the configuration of changed ones (never their
    ``enabled`` flag once created: pausing is the operator's) and deletes code schedules no
    longer declared. The firing state is not touched: an edit that changes the slots makes the
    next firing pass compute them afresh. Concurrent syncs (workers starting together) take
    turns. A schedule the queue would refuse (:func:`schedule_row`) raises
    :class:`InvalidSchedule` before anything is written; with ``skip_invalid`` (a worker's
    sync) it is logged as an error and left as it is in the table, and the others are synced.
    """
    from django_fairqueue.models import Schedule, ScheduleSource

    specs = declared() if specs is None else _specs(specs)
    cfg = conf.get()
    result = SyncResult()
    rows: dict[str, tuple[str, dict[str, Any]]] = {}
    for spec in specs:
        try:
            rows[spec.name] = schedule_row(spec, cfg, f"schedule {spec.name!r}")
        except InvalidSchedule as exc:
            if not skip_invalid:
                raise
            # One bad declaration must not keep every other code schedule out of the table.
            logger.error("code schedule %r not synced (the others are): %s", spec.name, exc)
            result.skipped[spec.name] = str(exc)
    alias = cfg.DATABASE
    with transaction.atomic(using=alias):
        # Lock order: the sync's own advisory lock, then channel rows (created if missing),
        # then schedule rows; a firing pass takes schedule rows last of all.
        schedule_store.lock_schedule_sync()
        channel_ids = {
            name: channel_store.ensure_channel(name, defaults=cfg.CHANNEL_DEFAULTS)
            for name in sorted({channel for channel, _ in rows.values()})
        }
        existing = {s.name: s for s in Schedule.objects.using(alias).filter(source="code")}
        for name, (channel, values) in rows.items():
            values = {**values, "channel_id": channel_ids[channel]}
            row = existing.get(name)
            if row is None:
                enabled = next(s.enabled for s in specs if s.name == name)
                Schedule.objects.using(alias).create(
                    name=name, source=ScheduleSource.CODE, enabled=enabled, **values
                )
                result.created.append(name)
            elif any(getattr(row, key) != value for key, value in values.items()):
                Schedule.objects.using(alias).filter(pk=row.pk).update(**values)
                result.updated.append(name)
        gone = sorted(set(existing) - set(rows) - set(result.skipped))
        if gone:
            Schedule.objects.using(alias).filter(source="code", name__in=gone).delete()
            result.deleted.extend(gone)
    for what, names in (("created", result.created), ("updated", result.updated)):
        if names:
            logger.info("code schedules %s: %s", what, ", ".join(names))
    if result.deleted:
        logger.info("code schedules no longer declared, deleted: %s", ", ".join(result.deleted))
    return result


def _specs(specs: object) -> list[ScheduleSpec]:
    """``specs`` as a list, if it is a list or tuple of :class:`ScheduleSpec`; else a
    TypeError, before :func:`sync` deletes the code schedules missing from it. Nothing else
    is taken: an empty dict or set (a mistake, not a declaration) would delete them all."""
    what = "ScheduleSpec (django_fairqueue.cron.ScheduleSpec, as declared() returns them)"
    if not isinstance(specs, list | tuple):
        raise TypeError(f"specs must be a list of {what}, got {specs!r}")
    found = list(specs)
    for i, spec in enumerate(found):
        if not isinstance(spec, ScheduleSpec):
            raise TypeError(f"specs[{i}] must be a {what}, got {spec!r}")
    return found


# -- firing -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What a pass does with one schedule: fire ``slots`` and move on to ``next_fire_at``."""

    slots: list[datetime]
    next_fire_at: datetime | None
    #: the pass comes later than SCHEDULE_GRACE after the first due slot: slots were missed
    missed: bool = False


def plan(schedule: schedule_store.DueSchedule, *, grace: timedelta) -> Plan:
    """The slots to fire now and the next slot, from the row as read and the database's
    clock (``schedule.now``)."""
    now = schedule.now
    if schedule.fired_spec != schedule.spec or schedule.next_fire_at is None:
        # new, edited, paused or resumed: no catching up over that; slots only move forward
        if not schedule.enabled:
            return Plan([], None)
        anchor = max(now, schedule.last_slot_at) if schedule.last_slot_at else now
        return Plan([], cron.next_slot(schedule.cron, schedule.timezone, anchor))
    since = schedule.next_fire_at
    limit = schedule.catch_up_max if schedule.missed == "catch_up" else 1
    slots = cron.due_slots(schedule.cron, schedule.timezone, since, now, limit)
    on_time = [s for s in slots if now - s <= grace]
    chosen = on_time[-1:] if schedule.missed == "skip" else slots
    return Plan(chosen, cron.next_slot(schedule.cron, schedule.timezone, now), now - since > grace)


class _Lost(Exception):
    """Another pass fired the schedule first, or it was edited meanwhile: roll back."""


#: A schedule a pass could not move forward waits this long (seconds) before this process
#: tries it again, doubled while it keeps failing: another transaction held its row, or
#: another pass advanced it first (RETRY_SOON, at most SCHEDULE_INTERVAL); an error other
#: than a full channel (from SCHEDULE_INTERVAL, at most RETRY_ERROR_CAP). A full channel is
#: tried every SCHEDULE_INTERVAL: room comes when the channel's workers run.
RETRY_SOON = 0.05
RETRY_ERROR_CAP = 300.0


@dataclass
class _Hold:
    """A schedule this process does not try again before ``until`` (``time.monotonic()``)."""

    until: float
    delay: float


@dataclass
class Firer:
    """Fires due schedules; keeps what this process could not fire, so it neither retries a
    task it does not know on every pass, nor a schedule that cannot fire faster than its own
    pace (:data:`RETRY_SOON`, ``SCHEDULE_INTERVAL``, a backoff), nor logs the same failure
    every pass. One firer may serve several threads: its holds are kept under a lock."""

    limit: int = 100
    #: seconds; None: FAIRQUEUE['SCHEDULE_GRACE']
    grace: float | None = None
    unknown_tasks: set[str] = field(default_factory=set)
    #: schedules that could not fire, by id: tried again when their hold ends
    held: dict[int, _Hold] = field(default_factory=dict)
    _held_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _complained: dict[tuple[int, str], float] = field(default_factory=dict)

    def fire_due(self) -> int:
        """One pass: fire every due schedule (at most ``limit``) not held back; returns the
        messages enqueued."""
        seconds = self.grace if self.grace is not None else conf.get().SCHEDULE_GRACE
        grace = timedelta(seconds=seconds)
        now = time.monotonic()
        with self._held_lock:
            ended = {i for i, hold in self.held.items() if hold.until <= now}
        due = schedule_store.select_due_schedules(
            self.limit, skip_tasks=sorted(self.unknown_tasks), skip_ids=self._holding()
        )
        # a hold that ended on a schedule no longer due (fired elsewhere, edited, deleted)
        for schedule_id in ended - {schedule.id for schedule in due}:
            self._unhold(schedule_id)
        fired = 0
        quiet: list[tuple[schedule_store.DueSchedule, datetime | None]] = []
        for schedule in due:
            step = self._plan(schedule, grace)
            if step is None:
                continue
            if step.slots:
                fired += self._fire(schedule, step)
            else:
                quiet.append((schedule, step.next_fire_at))
        if quiet:
            # new, edited or resumed schedules (and slots skipped): only their next slot to
            # write, all in one statement, no enqueue, so no transaction each
            written = set(schedule_store.advance_schedules_without_slots(quiet))
            for schedule, _next in quiet:
                if schedule.id in written:
                    self._unhold(schedule.id)
                else:  # another transaction held its row
                    self._hold(schedule.id, RETRY_SOON, self._interval())
        return fired

    def seconds_to_next(self) -> float | None:
        """Seconds until this process has a schedule to try: the next slot of one not held
        back, or the end of a hold; None when there is neither."""
        found = schedule_store.select_next_schedule_fire(
            skip_tasks=sorted(self.unknown_tasks), skip_ids=self._holding()
        )
        with self._held_lock:
            ends = [hold.until for hold in self.held.values()]
        if ends:
            hold_ends = min(ends) - time.monotonic()
            found = hold_ends if found is None else min(found, hold_ends)
        return found

    def _holding(self) -> list[int]:
        """The schedules held back now."""
        now = time.monotonic()
        with self._held_lock:
            return sorted(i for i, hold in self.held.items() if hold.until > now)

    def _hold(self, schedule_id: int, first: float, cap: float) -> float:
        """Hold a schedule back for ``first`` seconds, doubled while it stays held, at most
        ``cap``; returns the delay."""
        with self._held_lock:
            previous = self.held.get(schedule_id)
            delay = first if previous is None else min(cap, max(first, previous.delay * 2))
            self.held[schedule_id] = _Hold(time.monotonic() + delay, delay)
        return delay

    def _unhold(self, schedule_id: int) -> None:
        with self._held_lock:
            self.held.pop(schedule_id, None)

    @staticmethod
    def _interval() -> float:
        return conf.get().SCHEDULE_INTERVAL

    def fire(self, schedule: schedule_store.DueSchedule, *, grace: timedelta) -> int:
        """Fire one schedule as read (in a transaction of its own); returns the messages
        enqueued."""
        step = self._plan(schedule, grace)
        if step is None:
            return 0
        if not step.slots:
            schedule_store.advance_schedules_without_slots([(schedule, step.next_fire_at)])
            return 0
        return self._fire(schedule, step)

    def _plan(self, schedule: schedule_store.DueSchedule, grace: timedelta) -> Plan | None:
        """What to do with a schedule as read; None for a task this process does not know."""
        if schedule.task_name not in registry and schedule.enabled:
            try:
                registry.get(schedule.task_name)
            except UnknownTask:
                self.unknown_tasks.add(schedule.task_name)
                logger.error(
                    "schedule %r of channel %r names task %r, which this worker does not know; "
                    "it fires on workers that do",
                    schedule.name,
                    display_name(schedule.channel),
                    schedule.task_name,
                    extra={"schedule": schedule.name, "task": schedule.task_name},
                )
                return None
        step = plan(schedule, grace=grace)
        if step.missed:
            self._complain(
                schedule,
                f"missed {schedule.next_fire_at:%Y-%m-%d %H:%M}",
                logging.WARNING,
                "schedule %r of channel %r missed slots since %s; %s: firing up to %d (a slot "
                "fired already is not fired again)",
                schedule.name,
                display_name(schedule.channel),
                schedule.next_fire_at,
                schedule.missed,
                len(step.slots),
            )
        return step

    def _fire(self, schedule: schedule_store.DueSchedule, step: Plan) -> int:
        """Fire the slots of ``step``; returns the messages enqueued.

        A channel with room for some but not all of the slots gets the newest that fit, and
        the schedule moves on past the others: a catch-up larger than the channel's
        ``max_backlog`` would otherwise never fit, and the schedule never fire again."""
        fitting = step
        while True:
            try:
                fired = self._fire_slots(schedule, fitting)
                break
            except _Lost:
                self._hold(schedule.id, RETRY_SOON, self._interval())
                return 0
            except (ChannelFull, DatabaseError) as exc:
                full = exc if isinstance(exc, ChannelFull) else ChannelFull.from_error(exc)
                if full is None:
                    # (a lost connection, say: the runner retries the pass after a backoff)
                    self._hold(schedule.id, self._interval(), RETRY_ERROR_CAP)
                    raise
                room = full.max_backlog - full.backlog
                if 0 < room < len(fitting.slots):
                    # (the room the refusal reports; should it shrink meanwhile, the next
                    # refusal reports less: each try has fewer slots)
                    fitting = replace(fitting, slots=fitting.slots[-room:])
                    continue
                return self._full(schedule, step)
            except Exception as exc:
                delay = self._hold(schedule.id, self._interval(), RETRY_ERROR_CAP)
                self._complain(
                    schedule,
                    f"error {type(exc).__name__}: {exc}",
                    logging.ERROR,
                    "schedule %r of channel %r could not fire: %s; trying again in %.0fs",
                    schedule.name,
                    display_name(schedule.channel),
                    exc,
                    delay,
                )
                return 0
        if len(fitting.slots) < len(step.slots):
            logger.warning(
                "schedule %r of channel %r: the channel has room for only %d of the %d missed "
                "slots to fire: fired the newest %d (%s to %s), dropped the other %d",
                schedule.name,
                display_name(schedule.channel),
                len(fitting.slots),
                len(step.slots),
                fired,
                fitting.slots[0],
                fitting.slots[-1],
                len(step.slots) - len(fitting.slots),
                extra={"schedule": schedule.name},
            )
        self._unhold(schedule.id)
        return fired

    def _full(self, schedule: schedule_store.DueSchedule, step: Plan) -> int:
        """A channel with no room: nothing was stored, the slot stays due, and fires when the
        channel has room (as its missed policy says by then); this process tries it every
        SCHEDULE_INTERVAL meanwhile."""
        self._hold(schedule.id, self._interval(), self._interval())
        self._complain(
            schedule,
            f"full {step.slots[-1] if step.slots else ''}",
            logging.WARNING,
            "schedule %r: channel %r is full; its slot %s fires when there is room",
            schedule.name,
            display_name(schedule.channel),
            step.slots[-1] if step.slots else "-",
        )
        return 0

    def _fire_slots(self, schedule: schedule_store.DueSchedule, step: Plan) -> int:
        """Enqueue a message for each slot of ``step`` not taken yet and move the schedule
        on, in one transaction; returns the messages enqueued. Raises :class:`_Lost` when the
        row changed meanwhile, :class:`ChannelFull` (or a database error standing for it, at
        commit) when the channel has no room for them all: nothing is stored then."""
        from django_fairqueue.api import EnqueueRequest, enqueue_many
        from django_fairqueue.queues import DEFAULT_QUEUE, split_row_name

        with transaction.atomic(using=conf.get().DATABASE):
            message_ids: list[int] = []
            taken: list[datetime] = []
            if step.slots:
                # The channel's name lock before the slot rows: inserting a slot locks
                # the schedule row (its foreign key), which deleting the channel deletes
                # after taking that name lock, so the enqueue below must not be the first
                # to take it (a deadlock with a deletion in between).
                channel_store.share_channel_name(schedule.channel)
                # A slot already taken is another pass's (committed: its message exists;
                # in flight: this waited for it). A pass with the same view then changed
                # the row too, and the advance below finds that out; a rewound state (a
                # restore) just moves on without the slots fired before.
                got = set(schedule_store.claim_schedule_slots(schedule.id, step.slots))
                taken = [slot for slot in step.slots if slot in got]
                # A schedule of a channel row of another queue than the default enqueues
                # into that queue; of the default queue's, into the task's own queue.
                queue, channel = split_row_name(schedule.channel)
                requests = [
                    EnqueueRequest(
                        schedule.task_name,
                        list(schedule.args),
                        dict(schedule.kwargs),
                        channel=channel,
                        queue=None if queue == DEFAULT_QUEUE else queue,
                        run_after=self._run_after(schedule, slot),
                        priority=schedule.priority,
                    )
                    for slot in taken
                ]
                message_ids = enqueue_many(requests)
            if not schedule_store.advance_schedule(
                schedule,
                slots=taken,
                message_ids=message_ids,
                last_slot=step.slots[-1] if step.slots else None,
                next_fire_at=step.next_fire_at,
            ):
                raise _Lost
        return len(taken)

    @staticmethod
    def _run_after(schedule: schedule_store.DueSchedule, slot: datetime) -> datetime | None:
        if not schedule.jitter:
            return None  # now: the slot's time has come
        return slot + cron.jitter_offset(schedule.id, slot, schedule.jitter)

    def _complain(
        self, schedule: schedule_store.DueSchedule, what: str, level: int, message: str, *args: Any
    ) -> None:
        """Log once per schedule and kind of trouble every ten minutes (every worker's every
        pass meets it)."""
        key = (schedule.id, what)
        now = time.monotonic()
        if now - self._complained.get(key, -1e9) < 600:
            return
        if len(self._complained) > 10_000:
            self._complained.clear()
        self._complained[key] = now
        logger.log(level, message, *args, extra={"schedule": schedule.name})


def fire_due(limit: int = 100) -> int:
    """Fire every due schedule (at most ``limit``, 1 to ``limits.MAX_LIMIT``) once; returns
    the messages enqueued."""
    return Firer(limit=limits.limit(limit)).fire_due()


@dataclass
class Scheduler:
    """The maintenance service that syncs code schedules at its first pass, then fires due
    schedules every ``FAIRQUEUE['SCHEDULE_INTERVAL']`` seconds, or at the next slot when that
    comes sooner (it asks the database when that is after every pass)."""

    every: float | None = None  # seconds; None: FAIRQUEUE['SCHEDULE_INTERVAL']
    limit: int = 100
    name: str = "scheduler"
    #: the maintenance runner wakes it at its interval exactly (no ±10% spread)
    precise: bool = True
    #: its first pass (the sync) runs even in a worker that stops at once (a burst with
    #: nothing to do): every worker syncs the code schedules when it starts
    at_start: bool = True
    synced: bool = False
    firer: Firer = field(default_factory=Firer)
    _next_in: float | None = None

    @property
    def interval(self) -> float:
        base = self.every if self.every is not None else conf.get().SCHEDULE_INTERVAL
        if self._next_in is None:
            return base
        if self._next_in <= 0:
            # more due than one pass took (a schedule that could not fire is held back by the
            # firer, and not counted here): soon, not at once
            return min(base, RETRY_SOON)
        # a few milliseconds past the slot: the database's clock must have reached it
        return min(base, self._next_in + 0.005)

    def run_once(self) -> int:
        if not self.synced:
            try:
                sync(skip_invalid=True)
                self.synced = True
            except InvalidSchedule as exc:
                # Declarations this release gets wrong as a whole (a name declared twice) must
                # not stop the schedules already in the table (the admin's, the code's as last
                # synced): say so, and fire them.
                logger.error("code schedules not synced: %s", exc)
                self.synced = True
            except OperationalError as exc:
                if not pg.is_lock_timeout(exc):
                    raise
                # Another process holds the sync's lock (syncing, or frozen in the middle of
                # it): fire what the table has now and sync at the next pass.
                logger.warning(
                    "code schedules not synced yet: another process holds the sync lock; "
                    "trying again at the next pass"
                )
        self.firer.limit = self.limit
        self._next_in = None  # a pass that raises is tried again at the interval
        fired = self.firer.fire_due()
        self._next_in = self.firer.seconds_to_next()
        return fired


# -- reading ------------------------------------------------------------------------------------


def states(ids: Sequence[int]) -> dict[int, schedule_store.ScheduleState]:
    """The firing state of schedules by id (next slot, last slot, last fired, last message)."""
    checked = limits.row_ids(ids, "schedule")
    return schedule_store.select_schedule_states(checked) if checked else {}


#: Most slots one :func:`upcoming` call previews.
MAX_UPCOMING = 1000


def upcoming(cron: str, timezone: str, after: datetime, count: int = 5) -> list[datetime]:
    """The next ``count`` (0 to :data:`MAX_UPCOMING`) slots of the cron expression ``cron``
    in ``timezone`` after ``after`` (a preview), in UTC; fewer if the expression has fewer
    in the next 50 years (or before the end of year 9999). A bad expression or timezone raises
    :class:`InvalidSchedule`; an ``after`` that is not a datetime, :class:`TypeError`. A naive
    ``after`` is a wall-clock time in ``timezone``, as the schedule reads its cron."""
    given: object = count  # callers may pass anything
    if isinstance(given, bool) or not isinstance(given, int) or not 0 <= given <= MAX_UPCOMING:
        raise ValueError(f"count must be an integer from 0 to {MAX_UPCOMING}, got {count!r}")
    expr = validate_cron(cron)
    tz = validate_timezone(timezone)
    start: object = after
    if not isinstance(start, datetime):
        raise TypeError(f"after must be a datetime, got {after!r}")
    if after.tzinfo is None or after.utcoffset() is None:
        after = after.replace(tzinfo=ZoneInfo(tz))
    found: list[datetime] = []
    try:
        for slot in slots_after(expr, tz, after):
            if len(found) == count:
                break
            found.append(slot)
    except OverflowError:
        pass  # past the last datetime Python has (year 9999): no more slots
    return found

"""Cron expressions and schedule slots: parsing, validation and slot arithmetic.

Parsing and evaluation are `cronsim <https://pypi.org/project/cronsim/>`_'s (the evaluator of
healthchecks.io): five fields (minute, hour, day of month, month, day of week) with ``*``,
lists, ranges, steps, names (``MON``, ``JAN``), ``L`` and ``#``, evaluated in the schedule's
own timezone with the daylight-saving rules of Debian's cron: a job at a fixed time that falls
in the hour skipped in spring runs once, at the first valid moment after it; a fixed-time job
in the hour repeated in autumn runs once, at its first occurrence; an every-N-minutes job runs
through both copies of a repeated hour. This module adds only the usual ``@hourly``-style
aliases and the slot queries the scheduler needs, and imports nothing from the queue, so the
settings can validate schedules with it.

Every datetime it returns is aware and in UTC, the database's frame.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from cronsim import CronSim, CronSimError

from django_fairqueue.db.jsontext import has_nul
from django_fairqueue.exceptions import InvalidChannel, InvalidSchedule
from django_fairqueue.limits import number_text, seconds_text

#: What to do with the slots that passed while nothing fired (no worker ran, a channel was
#: full): fire only the latest; fire none of them; fire each, up to ``catch_up_max``.
MISSED_POLICIES = ("latest", "skip", "catch_up")
MAX_CATCH_UP = 1000
#: The longest jitter: messages of a slot are spread over at most this after it.
MAX_JITTER = timedelta(hours=24)
NAME_MAX_LENGTH = 200

ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

_MICROSECOND = timedelta(microseconds=1)


def expand(expr: str) -> str:
    """The five-field form of ``expr`` (aliases expanded, blanks collapsed)."""
    text = " ".join(expr.split())
    return ALIASES.get(text.lower(), text)


def validate_cron(expr: object, where: str = "cron") -> str:
    """Return ``expr`` with blanks collapsed, or raise :class:`InvalidSchedule` saying what
    is wrong with it (cronsim's reason: "Bad minute", "Bad day-of-month", ...)."""
    if not isinstance(expr, str) or not expr.strip():
        raise InvalidSchedule(
            f"{where} must be a cron expression such as '*/5 * * * *', got {expr!r}"
        )
    text = " ".join(expr.split())
    fields_given = len(expand(text).split())
    if fields_given != 5:
        # cronsim reads a sixth field as seconds ("* * * * * *": every second): refused, so
        # every expression means what the five-field syntax says
        raise InvalidSchedule(
            f"{where} {expr!r} is not a valid cron expression: Wrong number of fields "
            f"({fields_given}, not five: minute hour day-of-month month day-of-week, or "
            "@hourly, @daily, @weekly, @monthly, @yearly)"
            + ("; a field of seconds is not supported" if fields_given == 6 else "")
        )
    try:
        slots = CronSim(expand(text), datetime.now(UTC))
    except CronSimError as exc:
        raise InvalidSchedule(
            f"{where} {expr!r} is not a valid cron expression: {exc} (five fields: minute hour "
            "day-of-month month day-of-week, or @hourly, @daily, @weekly, @monthly, @yearly)"
        ) from None
    if next(slots, None) is None:  # cronsim looks 50 years ahead
        raise InvalidSchedule(f"{where} {expr!r} has no slot in the next 50 years")
    return text


@functools.cache
def _iana_names() -> frozenset[str]:
    """The IANA timezone names this system knows (empty if it lists none)."""
    # "localtime" (a link to the system's zone) and the posix/ and right/ copies are files of
    # the zoneinfo tree, not names of a zone
    return frozenset(
        name
        for name in available_timezones()
        if name != "localtime" and not name.startswith(("posix/", "right/"))
    )


def validate_timezone(name: object, where: str = "timezone") -> str:
    """Return ``name`` if it is an IANA timezone (``"Europe/Berlin"``, ``"UTC"``), else raise."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidSchedule(f"{where} must be an IANA timezone name such as 'UTC', got {name!r}")
    try:
        ZoneInfo(name)
        known = name in _iana_names() or not _iana_names()
    except (ZoneInfoNotFoundError, ValueError):
        known = False
    if not known:  # "localtime" and the like are files of the zoneinfo tree, not IANA names
        raise InvalidSchedule(
            f"{where} {name!r} is not a known timezone (an IANA name such as 'Europe/Berlin')"
        ) from None
    return name


def validate_missed(policy: object, catch_up_max: object, where: str = "schedule") -> None:
    if policy not in MISSED_POLICIES:
        raise InvalidSchedule(f"{where}: missed must be one of {MISSED_POLICIES}, got {policy!r}")
    if (
        isinstance(catch_up_max, bool)
        or not isinstance(catch_up_max, int)
        or not 1 <= catch_up_max <= MAX_CATCH_UP
    ):
        raise InvalidSchedule(
            f"{where}: catch_up_max must be an integer from 1 to {MAX_CATCH_UP}, "
            f"got {catch_up_max!r}"
        )


def validate_jitter(value: object, where: str = "schedule") -> timedelta:
    """A jitter as a timedelta (seconds are accepted), from 0 to :data:`MAX_JITTER`."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError, ValueError):
            value = timedelta(seconds=value)
    if not isinstance(value, timedelta) or not timedelta(0) <= value <= MAX_JITTER:
        got = (
            f"{number_text(value.total_seconds())} seconds"
            if isinstance(value, timedelta)
            else repr(value)
        )
        raise InvalidSchedule(
            f"{where}: jitter must be a number of seconds or a timedelta from 0 to "
            f"{seconds_text(MAX_JITTER)}, got {got}"
        )
    return value


def slots_after(expr: str, tz: str, after: datetime) -> Iterator[datetime]:
    """The slots of ``expr`` in ``tz`` strictly after ``after``, oldest first, in UTC."""
    for slot in CronSim(expand(expr), after.astimezone(ZoneInfo(tz))):
        yield slot.astimezone(UTC)


def next_slot(expr: str, tz: str, after: datetime) -> datetime | None:
    """The first slot strictly after ``after``; None if there is none in the 50 years after
    it (an expression such as ``* * */20 * 1L``, checked away by :func:`validate_cron`)."""
    return next(slots_after(expr, tz, after), None)


def due_slots(expr: str, tz: str, since: datetime, until: datetime, limit: int) -> list[datetime]:
    """The newest ``limit`` slots from ``since`` to ``until`` (both included), oldest first.

    Walks back from ``until``, so a schedule that missed a year of minutes costs ``limit``
    steps, not half a million.
    """
    found: list[datetime] = []
    if limit <= 0 or since > until:
        return found
    # cronsim walks back from the minute of its start; one microsecond past `until` makes a
    # slot exactly at `until` count.
    for slot in CronSim(expand(expr), (until + _MICROSECOND).astimezone(ZoneInfo(tz)), True):
        utc = slot.astimezone(UTC)
        if utc < since:
            break
        if utc <= until:
            found.append(utc)
            if len(found) >= limit:
                break
    found.reverse()
    return found


def jitter_offset(schedule_id: int, slot: datetime, jitter: timedelta) -> timedelta:
    """How long after ``slot`` its message runs: a fraction of ``jitter`` every process
    computes alike (a hash of the schedule and the slot), whole milliseconds."""
    if jitter <= timedelta(0):
        return timedelta(0)
    key = f"{schedule_id}:{slot.astimezone(UTC).isoformat()}".encode()
    fraction = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2**64
    return timedelta(milliseconds=int(jitter / timedelta(milliseconds=1) * fraction))


def _check_payload(args: object, kwargs: object, where: str) -> tuple[list[Any], dict[str, Any]]:
    """Arguments as JSON keeps them: a list and a dict with string keys that survive a round
    trip unchanged (the enqueue path checks them again, with the size limit)."""
    if isinstance(args, tuple):
        args = list(args)
    if kwargs is None:
        kwargs = {}
    elif isinstance(kwargs, Mapping) and not isinstance(kwargs, dict):
        kwargs = dict(kwargs)
    if not isinstance(args, list):
        raise InvalidSchedule(f"{where}: args must be a list or tuple, got {type(args).__name__}")
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidSchedule(f"{where}: kwargs must be a dict with string keys, got {kwargs!r}")
    try:
        text = json.dumps([args, kwargs], allow_nan=False, ensure_ascii=False)
        text.encode("utf-8")  # a lone surrogate: not text PostgreSQL can store
        same = json.loads(text) == [args, kwargs]
    except UnicodeEncodeError:
        raise InvalidSchedule(f"{where}: args and kwargs are not valid Unicode") from None
    except (TypeError, ValueError) as exc:
        raise InvalidSchedule(f"{where}: args and kwargs must be JSON: {exc}") from None
    except RecursionError:
        raise InvalidSchedule(f"{where}: args and kwargs are nested too deeply") from None
    if has_nul(text):
        raise InvalidSchedule(f"{where}: args and kwargs contain a NUL character")
    if not same:
        raise InvalidSchedule(
            f"{where}: args and kwargs do not survive a JSON round trip unchanged "
            "(tuples, sets or non-string dict keys inside?)"
        )
    return args, kwargs


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule declared in code (``@periodic`` or ``FAIRQUEUE['SCHEDULES']``), checked.

    ``channel`` None: the task's own channel rule, else ``FAIRQUEUE['DEFAULT_CHANNEL']``.
    ``priority`` None: the task's priority.
    """

    name: str
    task: str
    cron: str
    timezone: str = "UTC"
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    channel: str | None = None
    missed: str = "latest"
    catch_up_max: int = 10
    jitter: timedelta = timedelta(0)
    priority: int | None = None
    enabled: bool = True

    @classmethod
    def build(
        cls, name: object, options: dict[str, Any], where: str, *, check_channel: bool = True
    ) -> ScheduleSpec:
        """Check every option (raising :class:`InvalidSchedule` naming ``where``); the
        channel's name too unless ``check_channel`` is false (the settings' schedules, whose
        channel the system check ``fairqueue.E006`` judges, each schedule on its own)."""
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise InvalidSchedule(f"{where}: the name must be non-empty text, got {name!r}")
        if "\x00" in name:
            raise InvalidSchedule(f"{where}: the name must not contain NUL characters")
        if len(name) > NAME_MAX_LENGTH:
            raise InvalidSchedule(f"{where}: the name is longer than {NAME_MAX_LENGTH} characters")
        known = {f.name for f in fields(cls)} - {"name"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidSchedule(f"{where} has unknown keys {unknown}; known: {sorted(known)}")
        for required in ("task", "cron"):
            if required not in options:
                raise InvalidSchedule(f"{where} needs {required!r}")
        task = options["task"]
        if not isinstance(task, str) or not task:
            raise InvalidSchedule(f"{where}: task must be a registered task's name, got {task!r}")
        cron = validate_cron(options["cron"], f"{where}: cron")
        tz = validate_timezone(options.get("timezone", "UTC"), f"{where}: timezone")
        args, kwargs = _check_payload(options.get("args", []), options.get("kwargs"), where)
        channel = options.get("channel")
        if channel is not None and not isinstance(channel, str):
            raise InvalidSchedule(f"{where}: channel must be a channel name, got {channel!r}")
        if channel is not None and check_channel:
            # enqueue's own check, here at import, naming the schedule
            from django_fairqueue.api import validate_channel_name  # (the API imports this)

            try:
                validate_channel_name(channel)
            except InvalidChannel as exc:
                raise InvalidSchedule(f"{where}: {exc}") from None
        missed = options.get("missed", "latest")
        catch_up_max = options.get("catch_up_max", 10)
        validate_missed(missed, catch_up_max, where)
        jitter = validate_jitter(options.get("jitter", 0), where)
        priority = options.get("priority")
        if priority is not None and (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not -100 <= priority <= 100
        ):
            raise InvalidSchedule(f"{where}: priority must be an integer from -100 to 100")
        enabled = options.get("enabled", True)
        if not isinstance(enabled, bool):
            raise InvalidSchedule(f"{where}: enabled must be True or False, got {enabled!r}")
        return cls(
            name,
            task,
            cron,
            tz,
            args,
            kwargs,
            channel,
            missed,
            catch_up_max,
            jitter,
            priority,
            enabled,
        )

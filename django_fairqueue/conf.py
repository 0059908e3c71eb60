"""Settings: one ``FAIRQUEUE = {...}`` dict, read into a frozen dataclass.

Validation happens in :func:`load` so both the system checks (``fairqueue.E0xx``, at start-up)
and the first use raise the same clear message; :func:`get` also refuses, at first use, a
``DATABASE`` that cannot hold the queue, with the message of its check (E002, E003, E007).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from datetime import timedelta
from functools import lru_cache
from typing import Any

from django.apps import apps
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver

from django_fairqueue.limits import (
    MAX_CONCURRENCY_LIMIT,
    MAX_LEASE,
    MAX_LIMIT,
    MAX_POLL_INTERVAL,
    MAX_RELEASE_INTERVAL,
    MAX_RETENTION,
    MAX_RETRY_DELAY,
    MAX_WEIGHT,
    integer,
    number_text,
    seconds_text,
)

DELIVERY_MODES = ("at_most_once", "at_least_once")
FAIRNESS_MODES = ("count", "time")
#: What ``FAIRQUEUE_METRICS_MAX_CHANNELS`` (a Django setting of its own) is when unset.
METRICS_MAX_CHANNELS_DEFAULT = 10_000
_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
MAX_CLAIM_WAIT = 10.0


@dataclass(frozen=True)
class ChannelDefaults:
    """Limits given to a channel created on first use."""

    max_concurrency: int | None = None
    release_interval: timedelta = timedelta(0)
    weight: int = 1
    max_backlog: int | None = None


@dataclass(frozen=True)
class FairQueueSettings:
    DATABASE: str = "default"
    DEFAULT_CHANNEL: str = "default"
    CHANNEL_DEFAULTS: ChannelDefaults = field(default_factory=ChannelDefaults)
    DEFAULT_DELIVERY: str = "at_least_once"
    DEFAULT_MAX_ATTEMPTS: int = 5
    RETRY_BACKOFF_BASE: float = 2.0  # seconds; attempt n waits base * 2**(n-1), jittered
    RETRY_BACKOFF_MAX: float = 3600.0
    LEASE_SECONDS: float = 60.0  # heartbeats renew it every LEASE_SECONDS / 3
    KEEP_RESULTS: bool = False  # keep succeeded rows (with their return value) until pruned
    RESULT_RETENTION: timedelta = timedelta(days=1)
    # Work batches of a job that fully succeeded are deleted this long after its last batch.
    BATCH_RETENTION: timedelta = timedelta(days=7)
    # Per-tenant usage (worker time, attempts, failures per channel and hour) is kept this
    # long, then pruned by maintenance (docs/howto/observability.md, "Usage per tenant").
    USAGE_RETENTION: timedelta = timedelta(days=31)
    NOTIFY: bool = True  # LISTEN/NOTIFY wake-ups; polling always runs as well
    NOTIFY_CHANNEL: str = "fairqueue"
    POLL_INTERVAL: float = 1.0
    # Seconds a claim in a transaction of its own may queue behind concurrent claims holding
    # the only eligible channels (one hot tenant, several claimers); 0: never wait, come back
    # empty. See docs/explanation/fairness.md, "Several claimers, one channel".
    CLAIM_WAIT: float = 0.05
    # The worker's claims and completions commit without waiting for their WAL flush
    # (synchronous_commit = off for those transactions alone; a claim of an at-most-once message
    # always waits). A database crash can then lose the last moments of them: those messages run
    # again, as at-least-once delivery allows. See docs/howto/delivery-modes.md.
    ASYNC_COMMIT: bool = True
    # What channels share fairly: "time", the worker time their messages run (weights divide
    # the charge), or "count", turns of messages (weight x quantum each; the default before
    # migration 0046). See docs/explanation/fairness.md, "Fairness by time".
    FAIRNESS: str = "time"
    RESCUE_INTERVAL: float = 15.0
    PRUNE_INTERVAL: float = 60.0
    # Seconds between recounts of every channel's counters from its rows (maintenance), which
    # repair and log any drift; a pass reads the queue's waiting and running rows once.
    VERIFY_INTERVAL: float = 600.0
    # Seconds between a worker's beats in the worker registry, and how long without one makes
    # it dead (its leases are then expired at once and rescued, instead of after the lease).
    WORKER_HEARTBEAT: float = 5.0
    WORKER_DEAD_AFTER: float = 30.0
    MAX_PAYLOAD_BYTES: int = 1_048_576
    # Seconds an attempt may run before the worker fails it (TaskTimeout) and stops waiting
    # for its thread; None: no limit. A task's own ``timeout`` overrides it.
    TASK_TIMEOUT: float | None = None
    # Seconds a running task has, after its worker saw an abort request, to stop by itself;
    # then the worker settles it as aborted and abandons its thread, as at a time limit.
    ABORT_GRACE: float = 30.0
    # Seconds a handler thread may stay in a task past its time limit (or its abort's grace
    # period) before its worker recycles itself (a process exit is the only way to stop a
    # thread). Until the thread returns, the attempt keeps its channel slot.
    STUCK_TASK_LIMIT: float = 300.0
    # Prepare queue statements (named, per connection). Turn off behind a transaction-pooling
    # proxy that does not support prepared statements (PgBouncer < 1.21).
    PREPARED_STATEMENTS: bool = True
    # With the `otel` extra installed: carry the enqueuing trace context in each message and
    # run each attempt in a span (django_fairqueue.observe.tracing). False turns both off.
    TRACING: bool = True
    TASK_MODULES: tuple[str, ...] = ()
    # Periodic schedules declared in settings, by name (docs/howto/periodic-tasks.md); checked
    # into ScheduleSpec objects. Workers sync them (with the @periodic ones) into the
    # schedule table when they start.
    SCHEDULES: tuple[Any, ...] = ()
    # Seconds between a worker's looks for due schedules when none is known to be due sooner
    # (the maintenance loop also wakes at the next fire time it read).
    SCHEDULE_INTERVAL: float = 5.0
    # Seconds after a slot's time during which firing it is on time; a slot found later was
    # missed, and its schedule's missed policy (latest, skip, catch_up) decides.
    SCHEDULE_GRACE: float = 60.0
    # Seconds a transaction (or prepared transaction) may hold the queue database's xmin
    # horizon before ``fairqueue status``, the dashboard and the metrics name it: while it is
    # open, VACUUM keeps every row version the queue writes, and claims slow down.
    HORIZON_WARN_AFTER: float = 300.0

    @property
    def lease(self) -> timedelta:
        """``LEASE_SECONDS`` as the lease a claim takes when it is given none."""
        return timedelta(seconds=self.LEASE_SECONDS)


def _duration(value: Any, name: str) -> timedelta:
    if isinstance(value, timedelta):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return timedelta(seconds=value)
        except (OverflowError, ValueError):  # beyond timedelta's ~2.7 million years, or NaN
            raise ValueError(
                f"{name} must be a duration timedelta can hold, got {value!r}"
            ) from None
    raise ValueError(f"{name} must be a number of seconds or a timedelta, got {value!r}")


def _number(value: Any, name: str, *, minimum: float, integer: bool = False) -> Any:
    kinds = (int,) if integer else (int, float)
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ValueError(f"{name} must be {kind} >= {minimum}, got {value!r}")
    # NaN compares false with everything, so it would pass `value < minimum`; infinity makes
    # no sense for any of these (a sleep, a lease, a wait).
    if not math.isfinite(value):
        raise ValueError(f"{name} must be {kind} >= {minimum} (a finite one), got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be {kind} >= {minimum}, got {value!r}")
    return value


def validate_timeout(value: Any, name: str) -> float | None:
    """A task time limit in seconds: None (no limit of its own), or a positive number or
    timedelta up to a year, as every other interval; 0 means no limit. Raise ``ValueError``
    naming the bad value."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(
            f"{name} must be a number of seconds >= 0 (0: no limit) or None, got {value!r}"
        )
    if value > MAX_RETRY_DELAY.total_seconds():
        # (a year, as every other interval: the worker's timer must stay one Python holds)
        raise ValueError(
            f"{name} must be at most {seconds_text(MAX_RETRY_DELAY)} (0: no limit), got {value!r}"
        )
    return float(value)


def validate_channel_limits(
    *,
    max_concurrency: Any = None,
    release_interval: Any = timedelta(0),
    weight: Any = 1,
    max_backlog: Any = None,
    where: str = "channel",
) -> ChannelDefaults:
    """Check channel limits; raise ``ValueError`` with a message naming the bad value."""
    if max_concurrency is not None:
        _number(max_concurrency, f"{where} max_concurrency", minimum=1, integer=True)
        if max_concurrency > MAX_CONCURRENCY_LIMIT:
            raise ValueError(
                f"{where} max_concurrency must be at most {MAX_CONCURRENCY_LIMIT}, "
                f"got {max_concurrency} (leave it empty for no limit)"
            )
    interval = _duration(release_interval, f"{where} release_interval")
    if interval < timedelta(0) or interval > MAX_RELEASE_INTERVAL:
        raise ValueError(
            f"{where} release_interval must be from 0 to {seconds_text(MAX_RELEASE_INTERVAL)}, "
            f"got {number_text(interval.total_seconds())} seconds"
        )
    _number(weight, f"{where} weight", minimum=1, integer=True)
    if weight > MAX_WEIGHT:
        raise ValueError(f"{where} weight must be at most {MAX_WEIGHT}, got {weight}")
    if max_backlog is not None:
        _number(max_backlog, f"{where} max_backlog", minimum=1, integer=True)
        if max_backlog > 2_147_483_647:
            raise ValueError(
                f"{where} max_backlog must be at most 2,147,483,647, got {max_backlog:,}"
            )
    return ChannelDefaults(max_concurrency, interval, weight, max_backlog)


def load(raw: Any) -> FairQueueSettings:
    """Build settings from the ``FAIRQUEUE`` dict; raise ``ValueError`` on any bad entry."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"FAIRQUEUE must be a dict, got {type(raw).__name__}")
    known = {f.name for f in dataclasses.fields(FairQueueSettings)}
    unknown = sorted(set(raw) - known)
    if "SPARK" in unknown:  # the Spark pipeline's settings moved to its app
        raise ValueError(
            "FAIRQUEUE['SPARK'] is now FAIRQUEUE_PIPELINE['SPARK']: the Spark pipeline is an "
            "app of its own, with its own setting (docs/howto/spark-pipeline.md)"
        )
    # Every bad entry is reported, not only the first: a fix, then another check run, then the
    # next fix would otherwise be the way to find them.
    problems: list[str] = []
    if unknown:
        problems.append(f"FAIRQUEUE has unknown keys {unknown}; known keys: {sorted(known)}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key in known:
            try:
                values[key] = _value(key, value)
            except SettingsError as exc:
                problems.extend(exc.problems)
            except (ValueError, TypeError) as exc:
                problems.append(str(exc))
    beat = values.get("WORKER_HEARTBEAT", FairQueueSettings.WORKER_HEARTBEAT)
    dead = values.get("WORKER_DEAD_AFTER", FairQueueSettings.WORKER_DEAD_AFTER)
    if dead < 3 * beat and not math.isclose(dead, 3 * beat):  # (3 * 0.2 is 0.6000000000000001)
        problems.append(
            f"FAIRQUEUE['WORKER_DEAD_AFTER'] ({dead:g} s) must be at least three times "
            f"FAIRQUEUE['WORKER_HEARTBEAT'] ({beat:g} s): a live worker that missed a beat "
            "would be declared dead, and the messages it runs would run again elsewhere"
        )
    if problems:
        raise SettingsError(problems)
    return FairQueueSettings(**values)


class SettingsError(ValueError):
    """Every bad entry of ``FAIRQUEUE``, one problem a line (``problems``)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class DatabaseSettingError(SettingsError, ImproperlyConfigured):
    """``FAIRQUEUE['DATABASE']`` cannot hold the queue (fairqueue.E002, E003, E007), raised at
    first use with the system check's message. Still a ValueError, as every bad setting is,
    for the commands that turn those into a usage error."""


def _channel_defaults(value: Any) -> ChannelDefaults:
    """``CHANNEL_DEFAULTS`` checked key by key, every bad one reported (SettingsError)."""
    where = "FAIRQUEUE['CHANNEL_DEFAULTS']"
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a dict")
    known = {f.name for f in dataclasses.fields(ChannelDefaults)}
    problems = []
    extra = sorted(set(value) - known)
    if extra:
        problems.append(f"{where} has unknown keys {extra}")
    for key in sorted(set(value) & known):
        try:
            validate_channel_limits(**{key: value[key]}, where=where)
        except (ValueError, TypeError) as exc:
            problems.append(str(exc))
    if problems:
        raise SettingsError(problems)
    return validate_channel_limits(**value, where=where)


def _value(key: str, value: Any) -> Any:
    """One ``FAIRQUEUE`` entry checked and converted; ``ValueError`` when it is bad."""
    if key == "CHANNEL_DEFAULTS":
        return _channel_defaults(value)
    elif key in ("DATABASE", "DEFAULT_CHANNEL"):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"FAIRQUEUE['{key}'] must be a non-empty string")
        return value
    elif key == "NOTIFY_CHANNEL":
        if not isinstance(value, str) or not _IDENT.match(value):
            raise ValueError(
                "FAIRQUEUE['NOTIFY_CHANNEL'] must be a lower-case identifier: a letter or _ "
                f"first, then letters, digits or _, at most 63 in all; got {value!r}"
            )
        return value
    elif key == "FAIRNESS":
        if value not in FAIRNESS_MODES:
            raise ValueError(
                f"FAIRQUEUE['FAIRNESS'] must be one of {FAIRNESS_MODES}, got {value!r}"
            )
        return value
    elif key == "DEFAULT_DELIVERY":
        if value not in DELIVERY_MODES:
            raise ValueError(f"FAIRQUEUE['DEFAULT_DELIVERY'] must be one of {DELIVERY_MODES}")
        return value
    elif key == "DEFAULT_MAX_ATTEMPTS":
        attempts = _number(value, "FAIRQUEUE['DEFAULT_MAX_ATTEMPTS']", minimum=1, integer=True)
        if attempts > MAX_LIMIT:  # as a task's own max_attempts
            raise ValueError(
                f"FAIRQUEUE['DEFAULT_MAX_ATTEMPTS'] must be at most {MAX_LIMIT} (the messages' "
                f"max_attempts column is a 32-bit integer), got {value!r}"
            )
        return attempts
    elif key == "MAX_PAYLOAD_BYTES":
        return _number(value, f"FAIRQUEUE['{key}']", minimum=1, integer=True)
    elif key in ("ASYNC_COMMIT", "KEEP_RESULTS", "NOTIFY", "PREPARED_STATEMENTS", "TRACING"):
        if not isinstance(value, bool):
            raise ValueError(f"FAIRQUEUE['{key}'] must be True or False, got {value!r}")
        return value
    elif key in ("RESULT_RETENTION", "BATCH_RETENTION", "USAGE_RETENTION"):
        retention = _duration(value, f"FAIRQUEUE['{key}']")
        # (not below 0: a row cannot be pruned before it finished)
        if not timedelta(0) <= retention <= MAX_RETENTION:
            raise ValueError(
                f"FAIRQUEUE['{key}'] must be from 0 to {seconds_text(MAX_RETENTION)}: the "
                "most keeps rows for ever in practice; got "
                f"{number_text(retention.total_seconds())} seconds"
            )
        return retention
    elif key == "CLAIM_WAIT":
        wait = float(_number(value, "FAIRQUEUE['CLAIM_WAIT']", minimum=0.0))
        if wait > MAX_CLAIM_WAIT:
            raise ValueError(
                f"FAIRQUEUE['CLAIM_WAIT'] must be at most {MAX_CLAIM_WAIT:g} seconds (a claim "
                f"holding its caller that long is a stall, not a queue), got {value!r}"
            )
        return wait
    elif key == "TASK_TIMEOUT":
        timeout = validate_timeout(value, "FAIRQUEUE['TASK_TIMEOUT']")
        return timeout or None  # 0: no limit, as None
    elif key == "SCHEDULES":
        return _schedules(value)
    elif key == "TASK_MODULES":
        if not isinstance(value, list | tuple) or not all(isinstance(m, str) for m in value):
            raise ValueError("FAIRQUEUE['TASK_MODULES'] must be a list of module names")
        return tuple(value)
    elif key in ("RETRY_BACKOFF_BASE", "RETRY_BACKOFF_MAX"):
        minimum = 0.001 if key == "RETRY_BACKOFF_MAX" else 0.0
        delay = float(_number(value, f"FAIRQUEUE['{key}']", minimum=minimum))
        if delay > MAX_RETRY_DELAY.total_seconds():
            raise ValueError(
                f"FAIRQUEUE['{key}'] must be at most {seconds_text(MAX_RETRY_DELAY)}, got {value!r}"
            )
        return delay
    else:  # the float-valued intervals
        seconds = float(_number(value, f"FAIRQUEUE['{key}']", minimum=0.001))
        # As --lease and --poll-interval take them; every other interval within a year, so
        # that a sleep, a lease's end or a timestamp built from it stays one Python and
        # PostgreSQL hold (a worker crashed on 1e14).
        most = {"LEASE_SECONDS": MAX_LEASE, "POLL_INTERVAL": MAX_POLL_INTERVAL}.get(
            key, MAX_RETRY_DELAY.total_seconds()
        )
        if seconds > most:
            raise ValueError(
                f"FAIRQUEUE['{key}'] must be at most {seconds_text(timedelta(seconds=most))}, "
                f"got {value!r}"
            )
        return seconds


def _schedules(value: Any) -> tuple[Any, ...]:
    from django_fairqueue.cron import ScheduleSpec  # cronsim only: no models, no queue

    if not isinstance(value, dict):
        raise ValueError(
            "FAIRQUEUE['SCHEDULES'] must be a dict of schedule name -> options "
            f"({{'task': ..., 'cron': ...}}), got {type(value).__name__}"
        )
    specs = []
    for name, options in value.items():
        where = f"FAIRQUEUE['SCHEDULES'][{name!r}]"
        if not isinstance(options, dict):
            raise ValueError(f"{where} must be a dict of options, got {type(options).__name__}")
        specs.append(ScheduleSpec.build(name, options, where, check_channel=False))
    return tuple(specs)


def metrics_max_channels() -> int:
    """The Django setting ``FAIRQUEUE_METRICS_MAX_CHANNELS`` (docs/howto/observability.md),
    checked: an integer from 1 to :data:`~django_fairqueue.limits.MAX_LIMIT`; raises
    ``ImproperlyConfigured`` with fairqueue.E001's message otherwise."""
    value = getattr(django_settings, "FAIRQUEUE_METRICS_MAX_CHANNELS", METRICS_MAX_CHANNELS_DEFAULT)
    try:
        return integer(value, "FAIRQUEUE_METRICS_MAX_CHANNELS", minimum=1, maximum=MAX_LIMIT)
    except (ValueError, TypeError) as exc:
        raise ImproperlyConfigured(str(exc)) from None


@lru_cache(maxsize=1)
def values() -> FairQueueSettings:
    """The ``FAIRQUEUE`` dict, checked, without looking at its database: for what :func:`get`'s
    look at the database consults (the router), and what must work whatever that database is
    (the system checks' import of ``TASK_MODULES``)."""
    return load(getattr(django_settings, "FAIRQUEUE", {}))


def get() -> FairQueueSettings:
    """The current settings, checked with the database they name (cached; the cache is cleared
    when a test overrides FAIRQUEUE, DATABASES or DATABASE_ROUTERS).

    A ``DATABASE`` that cannot hold the queue raises :class:`DatabaseSettingError` with the
    message of its system check. Before the app registry is ready (the routers' check needs
    the models) only the dict is checked.
    """
    return _checked() if apps.ready else values()


@lru_cache(maxsize=1)
def _checked() -> FairQueueSettings:
    from django_fairqueue.checks import database_problems

    cfg = values()
    problems = [
        f"{problem.message} {problem.hint or ''}".strip()
        for problem in database_problems(cfg)
        if problem.error
    ]
    if problems:
        raise DatabaseSettingError(problems)
    return cfg


@receiver(setting_changed)
def _reset(*, setting: str, **kwargs: Any) -> None:
    if setting == "FAIRQUEUE":
        values.cache_clear()
    if setting in ("FAIRQUEUE", "DATABASES", "DATABASE_ROUTERS"):
        _checked.cache_clear()

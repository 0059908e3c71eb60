"""System checks with stable ids: a bad FAIRQUEUE setting stops start-up with a clear message."""

from __future__ import annotations

from typing import Any, NamedTuple

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from django_fairqueue import conf
from django_fairqueue.limits import MIN_LEASE


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    raw = getattr(settings, "FAIRQUEUE", {})
    try:
        cfg = conf.load(raw)
    except (ValueError, TypeError) as exc:
        problems = exc.problems if isinstance(exc, conf.SettingsError) else [str(exc)]
        return [
            Error(
                f"Invalid FAIRQUEUE setting: {problem}",
                hint="See docs/reference/settings.md for every key and its type.",
                id="fairqueue.E001",
            )
            for problem in problems
        ]
    for problem in database_problems(cfg):
        kind = Error if problem.error else Warning
        errors.append(kind(problem.message, hint=problem.hint, id=problem.id))
    errors.extend(_metrics_checks())
    errors.extend(_task_checks(cfg))
    errors.extend(_lease_warnings(cfg))
    errors.extend(_default_channel_checks(cfg))
    return errors


def _default_channel_checks(cfg: conf.FairQueueSettings) -> list[CheckMessage]:
    """fairqueue.E004: the default channel is one every enqueue without a channel takes."""
    from django_fairqueue.api import validate_channel_name
    from django_fairqueue.exceptions import InvalidChannel

    try:
        validate_channel_name(cfg.DEFAULT_CHANNEL)
    except InvalidChannel as exc:
        return [Error(f"FAIRQUEUE['DEFAULT_CHANNEL']: {exc}", id="fairqueue.E004")]
    return []


class Problem(NamedTuple):
    """One finding about the queue's database: an error stops start-up (and first use)."""

    id: str
    message: str
    hint: str | None = None
    error: bool = True


def database_problems(cfg: conf.FairQueueSettings) -> list[Problem]:
    """fairqueue.E002, E003, E007 and W003: for the system checks, and for the settings' first
    use (:func:`django_fairqueue.conf.get`), which raises the errors in the same words."""
    if cfg.DATABASE not in settings.DATABASES:
        message = f"FAIRQUEUE['DATABASE'] is {cfg.DATABASE!r}, which is not in DATABASES."
        return [Problem("fairqueue.E002", message)]
    vendor = connections[cfg.DATABASE].vendor
    if vendor != "postgresql":
        message = f"django-fairqueue needs PostgreSQL; database {cfg.DATABASE!r} is {vendor}."
        return [Problem("fairqueue.E003", message)]
    return _routing_problems(cfg)


def _routing_problems(cfg: conf.FairQueueSettings) -> list[Problem]:
    """The ORM must reach the queue's tables where its statements do: with the queue in another
    database and no router, the admin and the model API would read and change (empty) copies
    in ``default`` while enqueue and the workers use the queue's database. Reads routed
    elsewhere (a replica for the admin's lists) are allowed, and said."""
    from django.db import router

    from django_fairqueue.models import Channel

    read, write = router.db_for_read(Channel), router.db_for_write(Channel)
    if write != cfg.DATABASE:
        message = (
            f"FAIRQUEUE['DATABASE'] is {cfg.DATABASE!r}, but Django's database routers send "
            f"django-fairqueue's models to {write!r} for writes (and {read!r} for reads)."
        )
        return [Problem("fairqueue.E007", message, _routing_fix(cfg, "db_for_write"))]
    if read != cfg.DATABASE:
        message = (
            f"Django's database routers send reads of django-fairqueue's models to {read!r}, "
            f"not to FAIRQUEUE['DATABASE'] ({cfg.DATABASE!r}): the admin's lists show that "
            "database's rows (a replica's lag behind)."
        )
        hint = f"Intended for a replica; otherwise: {_routing_fix(cfg, 'db_for_read')}"
        return [Problem("fairqueue.W003", message, hint, error=False)]
    return []


def _routing_fix(cfg: conf.FairQueueSettings, action: str) -> str:
    """How to route the queue's models to its database: add QueueRouter, or, when a router
    of the project answers ``action`` first, put QueueRouter before it (or have it leave the
    queue's models alone). The models' tables are in ``default`` already; another database
    needs them migrated there."""
    from django.db import router

    from django_fairqueue.models import Channel
    from django_fairqueue.routers import QueueRouter

    path = "django_fairqueue.routers.QueueRouter"
    migrate = (
        "."
        if cfg.DATABASE == "default"
        else f", then run `manage.py migrate --database {cfg.DATABASE}`."
    )
    listed = any(isinstance(r, QueueRouter) for r in router.routers)
    for found in router.routers:
        if isinstance(found, QueueRouter):
            break
        method = getattr(found, action, None)
        if method is not None and method(Channel) is not None:
            name = f"{type(found).__module__}.{type(found).__qualname__}"
            return (
                f"{'Move' if listed else 'Add'} {path!r} before {name!r} in DATABASE_ROUTERS "
                f"({name!r} answers first for django-fairqueue's models), or have {name!r} "
                f"return None for them{migrate}"
            )
    return f"Add {path!r} to DATABASE_ROUTERS{migrate}"


def _metrics_checks() -> list[Error]:
    try:
        conf.metrics_max_channels()
    except ImproperlyConfigured as exc:
        return [
            Error(
                f"Invalid FAIRQUEUE_METRICS_MAX_CHANNELS setting: {exc}",
                hint="See docs/howto/observability.md for the metrics' settings.",
                id="fairqueue.E001",
            )
        ]
    return []


def _lease_warnings(cfg: conf.FairQueueSettings) -> list[Warning]:
    """The shortest lease `runfairworker --lease` takes, for the setting too."""
    if cfg.LEASE_SECONDS >= MIN_LEASE:
        return []
    return [
        Warning(
            f"FAIRQUEUE['LEASE_SECONDS'] is {cfg.LEASE_SECONDS:g} s, shorter than the "
            f"{MIN_LEASE:g} s `runfairworker --lease` accepts: under load a claimed message may "
            "not reach its thread and its first renewal in time, and each one that does not "
            "costs an attempt.",
            id="fairqueue.W002",
        )
    ]


def _task_checks(cfg: conf.FairQueueSettings) -> list[Error]:
    """TASK_MODULES must import, and each of SCHEDULES must name a registered task and give
    arguments it takes: a worker would otherwise die at start (the modules) or never sync and
    fire the schedule (the task, its arguments)."""
    from django_fairqueue.tasks.spec import registry

    errors = [
        Error(
            f"FAIRQUEUE['TASK_MODULES'] names {module!r}, which cannot be imported: "
            f"{type(exc).__name__}: {exc}",
            hint="Give the dotted path of a module on the Python path (python -c "
            f"'import {module}' shows the full error).",
            id="fairqueue.E005",
        )
        for module, exc in registry.import_task_modules()
    ]
    if errors or not cfg.SCHEDULES:
        return errors
    from django_fairqueue.exceptions import InvalidSchedule
    from django_fairqueue.schedules import schedule_row

    registry.autodiscover()
    for spec in cfg.SCHEDULES:
        where = f"FAIRQUEUE['SCHEDULES'][{spec.name!r}]"
        if spec.task not in registry:
            errors.append(
                Error(
                    f"{where} names task {spec.task!r}, which is not registered.",
                    hint="Use the name of a @task (its module must be an installed app's "
                    "tasks module or in FAIRQUEUE['TASK_MODULES']).",
                    id="fairqueue.E006",
                )
            )
            continue
        try:  # what the workers' sync would refuse: arguments, channel (their own words)
            schedule_row(spec, cfg, where)
        except InvalidSchedule as exc:
            errors.append(
                Error(
                    str(exc),
                    hint="Give the arguments and channel an enqueue of the task would take; "
                    "workers skip this schedule (and sync the others) until then.",
                    id="fairqueue.E006",
                )
            )
    return errors


@register(Tags.database)
def check_isolation_level(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    """The queue's guarantees assume READ COMMITTED, PostgreSQL's default.

    Under REPEATABLE READ or SERIALIZABLE a transaction's snapshot cannot see enqueues committed
    meanwhile, so the max_backlog bound cannot be checked (enqueue to a bounded channel is
    refused) and serialization failures replace waits.
    """
    databases = kwargs.get("databases")
    alias = _queue_alias()
    if alias is None or (databases is not None and alias not in databases):
        return []
    options = settings.DATABASES[alias].get("OPTIONS", {})
    level = options.get("isolation_level")
    if level is None:
        return []
    try:
        from psycopg import IsolationLevel

        name = IsolationLevel(level).name
    except (ImportError, ValueError):
        name = str(level)
    if name.replace("_", " ").upper() == "READ COMMITTED":
        return []
    return [
        Warning(
            f"The queue's database {alias!r} uses isolation level {name}; django-fairqueue "
            "expects READ COMMITTED.",
            hint="Enqueue to a channel with max_backlog is refused at other levels, and "
            "concurrent queue statements fail with serialization errors instead of waiting. "
            "Use a separate DATABASES alias at READ COMMITTED for FAIRQUEUE['DATABASE'].",
            id="fairqueue.W001",
        )
    ]


def _queue_alias() -> str | None:
    try:
        alias = conf.load(getattr(settings, "FAIRQUEUE", {})).DATABASE
    except (ValueError, TypeError):
        return None  # reported by check_settings
    return alias if alias in settings.DATABASES else None

"""System checks with stable ids: a bad FAIRQUEUE setting stops start-up with a clear message."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
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
    if cfg.DATABASE not in settings.DATABASES:
        errors.append(
            Error(
                f"FAIRQUEUE['DATABASE'] is {cfg.DATABASE!r}, which is not in DATABASES.",
                id="fairqueue.E002",
            )
        )
    elif connections[cfg.DATABASE].vendor != "postgresql":
        errors.append(
            Error(
                f"django-fairqueue needs PostgreSQL; database {cfg.DATABASE!r} is "
                f"{connections[cfg.DATABASE].vendor}.",
                id="fairqueue.E003",
            )
        )
    else:
        errors.extend(_routing_checks(cfg))
    errors.extend(_task_checks(cfg))
    errors.extend(_lease_warnings(cfg))
    if len(cfg.DEFAULT_CHANNEL) > 200 or cfg.DEFAULT_CHANNEL.strip() != cfg.DEFAULT_CHANNEL:
        errors.append(
            Error(
                "FAIRQUEUE['DEFAULT_CHANNEL'] must be at most 200 characters without "
                "surrounding blanks.",
                id="fairqueue.E004",
            )
        )
    return errors


def _routing_checks(cfg: conf.FairQueueSettings) -> list[CheckMessage]:
    """The ORM must reach the queue's tables where its statements do: with the queue in another
    database and no router, the admin and the model API would read and change (empty) copies
    in ``default`` while enqueue and the workers use the queue's database. Reads routed
    elsewhere (a replica for the admin's lists) are allowed, and said."""
    from django.db import router

    from django_fairqueue.models import Channel

    read, write = router.db_for_read(Channel), router.db_for_write(Channel)
    fix = (
        "Add 'django_fairqueue.routers.QueueRouter' to DATABASE_ROUTERS, then run "
        f"`manage.py migrate --database {cfg.DATABASE}`."
    )
    if write != cfg.DATABASE:
        return [
            Error(
                f"FAIRQUEUE['DATABASE'] is {cfg.DATABASE!r}, but Django's database routers send "
                f"django-fairqueue's models to {write!r} for writes (and {read!r} for reads).",
                hint=fix,
                id="fairqueue.E007",
            )
        ]
    if read != cfg.DATABASE:
        return [
            Warning(
                f"Django's database routers send reads of django-fairqueue's models to "
                f"{read!r}, not to FAIRQUEUE['DATABASE'] ({cfg.DATABASE!r}): the admin's lists "
                "show that database's rows (a replica's lag behind).",
                hint=f"Intended for a replica; otherwise: {fix}",
                id="fairqueue.W003",
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
    """TASK_MODULES must import, and each of SCHEDULES must name a registered task: a worker
    would otherwise die at start (the modules) or never fire the schedule (the task)."""
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
    registry.autodiscover()
    for spec in cfg.SCHEDULES:
        if spec.task not in registry:
            errors.append(
                Error(
                    f"FAIRQUEUE['SCHEDULES'][{spec.name!r}] names task {spec.task!r}, which is "
                    "not registered.",
                    hint="Use the name of a @task (its module must be an installed app's "
                    "tasks module or in FAIRQUEUE['TASK_MODULES']).",
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

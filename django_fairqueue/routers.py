"""Keep the queue in a database of its own: route django-fairqueue's models there.

The queue's statements already run on ``FAIRQUEUE['DATABASE']``; this router sends what goes
through the ORM (the admin's lists, the worker registry's reads, ``migrate``) to the same
alias, so one project can keep its own tables in ``default`` and the queue elsewhere::

    DATABASES = {"default": {...}, "queue": {...}}
    DATABASE_ROUTERS = ["django_fairqueue.routers.QueueRouter"]
    FAIRQUEUE = {"DATABASE": "queue"}

then ``manage.py migrate`` and ``manage.py migrate --database queue``. The apps routed are
django-fairqueue's own (``fairqueue``) and the Spark pipeline's (``fairqueue_pipeline``), whose
tables refer to the queue's. See docs/explanation/scaling-postgresql.md.
"""

from __future__ import annotations

from typing import Any

from django_fairqueue import conf

#: The app labels whose tables live in the queue's database.
QUEUE_APPS = frozenset({"fairqueue", "fairqueue_pipeline"})


class QueueRouter:
    """Reads, writes and migrations of the queue's apps go to ``FAIRQUEUE['DATABASE']``;
    everything else is left to the next router (or ``default``)."""

    def _route(self, model: Any) -> str | None:
        # conf.values(), not conf.get(): get() asks the routers where the models go
        return conf.values().DATABASE if model._meta.app_label in QUEUE_APPS else None

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return self._route(model)

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return self._route(model)

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool | None:
        # Two queue rows relate (a message and its channel); anything else is left to Django
        # (rows of two databases never relate).
        both = all(obj._meta.app_label in QUEUE_APPS for obj in (obj1, obj2))
        return True if both else None

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        if app_label in QUEUE_APPS:
            return db == conf.values().DATABASE
        return None

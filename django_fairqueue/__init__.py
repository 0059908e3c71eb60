"""django-fairqueue: a fair, multi-tenant task queue on PostgreSQL.

The public API is small::

    from django_fairqueue import task, enqueue, enqueue_many, EnqueueRequest
    from django_fairqueue import cancel, abort, abort_requested, current_message

Everything else is internal and may change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "ChannelFull",
    "DuplicateJob",
    "EnqueueRequest",
    "FairQueueError",
    "InvalidChannel",
    "InvalidQueue",
    "InvalidSchedule",
    "IsolationLevelError",
    "LeaseLost",
    "PayloadError",
    "ResultNotStorable",
    "TaskAborted",
    "TaskCancelled",
    "TaskTimeout",
    "UnknownTask",
    "abort",
    "abort_requested",
    "cancel",
    "current_message",
    "enqueue",
    "enqueue_many",
    "periodic",
    "raise_if_abort_requested",
    "task",
]

from django_fairqueue.context import abort_requested, current_message, raise_if_abort_requested
from django_fairqueue.exceptions import (
    ChannelFull,
    DuplicateJob,
    FairQueueError,
    InvalidChannel,
    InvalidQueue,
    InvalidSchedule,
    IsolationLevelError,
    LeaseLost,
    PayloadError,
    ResultNotStorable,
    TaskAborted,
    TaskCancelled,
    TaskTimeout,
    UnknownTask,
)

if TYPE_CHECKING:
    from django_fairqueue.api import EnqueueRequest, abort, cancel, enqueue, enqueue_many
    from django_fairqueue.schedules import periodic
    from django_fairqueue.tasks import task


def __getattr__(name: str) -> Any:
    # Lazy: importing the package (e.g. from settings.py or INSTALLED_APPS) must not import
    # models before the app registry is ready.
    if name in ("enqueue", "enqueue_many", "EnqueueRequest", "cancel", "abort"):
        from django_fairqueue import api

        return getattr(api, name)
    if name == "task":
        from django_fairqueue.tasks import task

        return task
    if name == "periodic":
        from django_fairqueue.schedules import periodic

        return periodic
    raise AttributeError(f"module 'django_fairqueue' has no attribute {name!r}")

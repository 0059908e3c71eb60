"""Errors raised by django-fairqueue. All derive from :class:`FairQueueError`."""

from __future__ import annotations


class FairQueueError(Exception):
    """Base class of every django-fairqueue error."""


class ChannelFull(FairQueueError):
    """Enqueue would take a channel past its ``max_backlog``. Nothing of the batch was stored."""

    def __init__(self, channel: str, backlog: int, max_backlog: int, batch: int) -> None:
        self.channel = channel
        self.backlog = backlog
        self.max_backlog = max_backlog
        self.batch = batch
        super().__init__(
            f"channel {channel!r} is full: {backlog} waiting, max_backlog {max_backlog}, "
            f"refused a batch of {batch}"
        )


class InvalidChannel(FairQueueError, ValueError):
    """A channel name or channel setting is not acceptable."""


class UnknownTask(FairQueueError, LookupError):
    """No task is registered under this name in this process."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            f"no task named {name!r} is registered; define it with @django_fairqueue.task "
            f"(or django.tasks.task) in a module the worker imports (an app's tasks.py, "
            f"or FAIRQUEUE['TASK_MODULES'])"
        )


class PayloadError(FairQueueError, TypeError):
    """Task arguments that cannot be stored as JSON (or are too large / too deep)."""


class LeaseLost(FairQueueError):
    """The worker no longer holds the lease of a message (or work batch) it was running."""

"""Errors raised by django-fairqueue. All derive from :class:`FairQueueError`."""

from __future__ import annotations

import json


class FairQueueError(Exception):
    """Base class of every django-fairqueue error."""


def _channel_of(row: str) -> tuple[str, str, str]:
    """(channel, queue, how to name it in a message) of a channel row's name: the row of
    channel ``acme`` in queue ``reports`` is named ``reports<U+001F>acme``."""
    from django_fairqueue.queues import DEFAULT_QUEUE, split_row_name  # (it imports this module)

    queue, channel = split_row_name(row)
    where = f"channel {channel!r}" + (f" of queue {queue!r}" if queue != DEFAULT_QUEUE else "")
    return channel, queue, where


class ChannelFull(FairQueueError):
    """Enqueue would take a channel past its ``max_backlog``. Nothing of the batch was stored.
    ``channel`` is the name within its ``queue``."""

    def __init__(self, channel: str, backlog: int, max_backlog: int, batch: int) -> None:
        self.channel, self.queue, where = _channel_of(channel)
        self.backlog = backlog
        self.max_backlog = max_backlog
        self.batch = batch
        super().__init__(
            f"{where} is full: {backlog} waiting, max_backlog {max_backlog}, "
            f"refused a batch of {batch}"
        )

    @classmethod
    def from_error(cls, exc: BaseException) -> ChannelFull | None:
        """The ChannelFull a database error stands for, or None.

        Inside a transaction, ``enqueue()`` refuses at once a batch for a channel already full,
        and the exact bound is checked again when the transaction commits, in channel order
        (so concurrent transactions never deadlock over it). A transaction that would overfill
        the channel then fails at commit, the end of its ``atomic()`` block, with a
        ``django.db.DatabaseError``; this gives the ChannelFull it stands for::

            try:
                with transaction.atomic():
                    enqueue(..., channel="acme")
            except DatabaseError as exc:
                if (full := ChannelFull.from_error(exc)) is None:
                    raise
                ...  # nothing of the transaction was stored
        """
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        if getattr(cause, "sqlstate", None) != "FQ001":
            return None
        detail = json.loads(cause.diag.message_detail or "{}")  # type: ignore[attr-defined]
        return cls(detail["channel"], detail["backlog"], detail["max_backlog"], detail["batch"])


class IsolationLevelError(FairQueueError):
    """Enqueue to a channel with ``max_backlog``, or ``exactly_once.batch()``, inside a
    REPEATABLE READ or SERIALIZABLE transaction: its snapshot cannot see what others committed
    meanwhile, so the bound cannot be checked, nor a claim see the messages it should take.
    Nothing was stored or claimed. Use READ COMMITTED (PostgreSQL's default), which the queue
    expects."""


class InvalidChannel(FairQueueError, ValueError):
    """A channel name or channel setting is not acceptable."""


class InvalidQueue(InvalidChannel):
    """A queue name is not acceptable (a kind of :class:`InvalidChannel`: where work goes)."""


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


class ResultNotStorable(FairQueueError, TypeError):
    """A task's return value cannot be stored as a JSON result. The task ran: the attempt
    fails, and is not retried (running the task again would repeat its effects)."""


class TaskTimeout(FairQueueError):
    """An attempt ran past its task's time limit (``@task(timeout=...)``,
    ``FAIRQUEUE['TASK_TIMEOUT']``). The worker fails the attempt at the limit (it is retried
    like any failed attempt) and stops waiting for its thread, which Python cannot stop: that
    thread's eventual return is discarded."""


class LeaseLost(FairQueueError):
    """The worker no longer holds the lease of a message (or work batch) it was running."""


class DuplicateJob(FairQueueError):
    """Enqueue with ``unique_key=...`` and ``on_conflict="raise"`` met a message of the same
    channel that holds the key, or an earlier request of the same ``enqueue_many`` batch that
    carries it (``in_batch``: that request's position; ``message_id`` and ``state`` are then
    None). ``channel`` is the name within its ``queue``. Nothing of the batch was stored."""

    def __init__(
        self,
        channel: str,
        unique_key: str,
        message_id: int | None,
        state: str | None,
        *,
        in_batch: int | None = None,
    ) -> None:
        self.channel, self.queue, where = _channel_of(channel)
        self.unique_key = unique_key
        #: the message holding the key, and its state then
        self.message_id = message_id
        self.state = state
        #: the position of the batch's earlier request that carries the key
        self.in_batch = in_batch
        if in_batch is not None:
            text = (
                f"{where} gets unique key {unique_key!r} twice in one batch "
                f"(request {in_batch} carries it first); nothing of the batch was stored"
            )
        else:
            text = (
                f"{where} already has message {message_id} ({state}) with unique key {unique_key!r}"
            )
        super().__init__(text)

    @classmethod
    def from_error(cls, exc: BaseException) -> DuplicateJob | None:
        """The DuplicateJob a database error stands for (SQLSTATE FQ003), or None."""
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        if getattr(cause, "sqlstate", None) != "FQ003":
            return None
        detail = json.loads(cause.diag.message_detail or "{}")  # type: ignore[attr-defined]
        return cls(detail["channel"], detail["unique_key"], detail["message_id"], detail["state"])


class TaskCancelled(FairQueueError):
    """What a cancelled message's result reports: it was taken off the queue before it ran
    (by ``cancel()``, ``abort()`` or an operator, or superseded by a newer unique job)."""


class TaskAborted(FairQueueError):
    """Raised by :func:`django_fairqueue.raise_if_abort_requested` inside a task whose abort
    was requested, and what an aborted message's result reports."""


class InvalidSchedule(FairQueueError, ValueError):
    """A periodic schedule is malformed: a bad cron expression, timezone, missed-slot policy,
    jitter or payload. The message says which, and what was given."""

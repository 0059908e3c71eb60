"""Failed messages (dead letters): list, retry, delete.

A message ends in the ``failed`` state when it ran out of attempts, could not run at all (an
unknown task, a payload that does not decode) or was failed on purpose; it keeps its last error
(type, message, traceback). From here it can be retried, with a fresh attempt budget, or deleted.

Reads use the ORM; every write goes through :mod:`django_fairqueue.db.message_store`. Everything
joins the caller's transaction when there is one. Retry and delete are idempotent: ids that are not
(or no longer) failed are skipped, so running the same command twice is harmless.

The same operations as a command: ``manage.py fairqueue failures list|retry|delete``
(:mod:`django_fairqueue.cli.failures`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from itertools import islice
from typing import Any

from django.db.models import QuerySet

from django_fairqueue import conf, limits
from django_fairqueue.db import message_store
from django_fairqueue.models import Channel, Message, MessageState
from django_fairqueue.queues import row_name, split_row_name, validate_queue_name

__all__ = [
    "FailedMessage",
    "delete",
    "delete_all",
    "key_held",
    "list_failed",
    "retry",
    "retry_all",
    "retry_reporting_held",
]

#: Ids per statement for the bulk operations: one statement's locks and WAL stay bounded.
BATCH_SIZE = 1000


@dataclass(frozen=True, slots=True)
class FailedMessage:
    """One dead letter, as listed: ``channel`` is the channel's name within its ``queue``."""

    id: int
    channel: str
    queue: str
    task: str
    attempts: int
    max_attempts: int
    error_type: str
    error_message: str
    finished_at: datetime | None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``finished_at`` as ISO 8601."""
        return {
            "id": self.id,
            "channel": self.channel,
            "queue": self.queue,
            "task": self.task,
            "attempts": self.attempts,
            "max_attempts": self.max_attempts,
            "error_type": self.error_type,
            "error_message": self.error_message,
            "finished_at": self.finished_at.isoformat() if self.finished_at else None,
        }


def list_failed(
    channel: str | None = None,
    task: str | None = None,
    limit: int = 100,
    after_id: int = 0,
    *,
    queue: str | None = None,
) -> list[FailedMessage]:
    """Failed messages, oldest id first, optionally of one channel, task name and/or queue.

    ``queue`` narrows the selection to that queue: ``channel`` is then that queue's channel of
    that name. Without it, ``channel`` is a channel of the default queue, and a selection
    without a channel covers every queue. Pages by id: pass the last id you got as
    ``after_id`` for the next page.
    """
    limits.limit(limit)
    limits.integer(after_id, "after_id", minimum=0, maximum=limits.MAX_ID)
    rows = _failed(channel, task, queue, after_id).values_list(
        "id",
        "channel__name",
        "task_name",
        "attempts",
        "max_attempts",
        "last_error",
        "finished_at",
    )[:limit]
    return [
        FailedMessage(
            id=pk,
            channel=split_row_name(channel_name)[1],
            queue=split_row_name(channel_name)[0],
            task=task_name,
            attempts=attempts,
            max_attempts=max_attempts,
            error_type=_error_field(error, "type"),
            error_message=_error_field(error, "message"),
            finished_at=finished_at,
        )
        for pk, channel_name, task_name, attempts, max_attempts, error, finished_at in rows
    ]


def retry(ids: Iterable[int]) -> list[int]:
    """Make these failed messages ready again, with a fresh attempt budget.

    Returns the ids retried now; ids that are not failed (already retried, deleted, never
    failed) are skipped, and so is a unique job whose key another message holds (it stays
    failed: :func:`key_held` tells which).
    """
    return _in_batches(ids, message_store.retry_failed_messages)


def key_held(skipped: Iterable[int]) -> list[int]:
    """Of ids :func:`retry` just skipped, those it left failed because another message holds
    their unique key (that message does the work); the others were not failed (any more).

    Retry skips a failed message for that reason alone, so these are the skipped ones still
    failed: what an operator is told, without a second look at the key."""
    return _in_batches(skipped, _failed_with_key)


def retry_reporting_held(ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """:func:`retry`, and of the ids it skipped those :func:`key_held` names: ``(retried,
    held)``, what a retry tells its operator."""
    retried = retry(ids)
    return retried, key_held(set(ids).difference(retried))


def retry_all(
    channel: str | None = None, task: str | None = None, *, queue: str | None = None
) -> int:
    """Retry every failed message (of a channel, task name and/or queue, selected as by
    :func:`list_failed`); returns how many."""
    return _each_page(channel, task, queue, message_store.retry_failed_messages)


def delete(ids: Iterable[int]) -> list[int]:
    """Delete these failed messages; returns the ids deleted. Other states are left alone."""
    return _in_batches(ids, message_store.delete_failed_messages)


def delete_all(
    channel: str | None = None, task: str | None = None, *, queue: str | None = None
) -> int:
    """Delete every failed message (of a channel, task name and/or queue, selected as by
    :func:`list_failed`); returns how many."""
    return _each_page(channel, task, queue, message_store.delete_failed_messages)


# ---------------------------------------------------------------------------------------------


def _failed(
    channel: str | None, task: str | None, queue: str | None, after_id: int = 0
) -> QuerySet[Message]:
    """The one filter behind listing and the bulk actions, so ``retry_all(channel, task)`` acts
    on exactly what ``list_failed(channel, task)`` shows. With a channel it reads the partial
    index fq_message_failed_idx (channel, id)."""
    database = conf.get().DATABASE
    qs = Message.objects.using(database).filter(state=MessageState.FAILED, id__gt=after_id)
    if queue is not None:
        validate_queue_name(queue)
    if channel is not None:
        name = channel if queue is None else row_name(queue, channel)
        channel_id = (
            Channel.objects.using(database).filter(name=name).values_list("id", flat=True)
        ).first()
        if channel_id is None:
            return qs.none()
        qs = qs.filter(channel_id=channel_id)
    elif queue is not None:
        qs = qs.filter(channel__queue=queue)
    if task is not None:
        qs = qs.filter(task_name=task)
    return qs.order_by("id")


def _each_page(
    channel: str | None,
    task: str | None,
    queue: str | None,
    action: Callable[[Sequence[int]], list[int]],
) -> int:
    # An id cursor, not OFFSET: acted-on rows leave the failed state, and a message that fails
    # again meanwhile keeps its (lower) id, so each message is acted on at most once per call.
    done = 0
    after = 0
    while True:
        ids = list(_failed(channel, task, queue, after).values_list("id", flat=True)[:BATCH_SIZE])
        if not ids:
            return done
        done += len(action(ids))
        after = ids[-1]


def _in_batches(ids: Iterable[int], action: Callable[[Sequence[int]], list[int]]) -> list[int]:
    wanted = _ids(ids)
    done: list[int] = []
    it = iter(wanted)
    while chunk := list(islice(it, BATCH_SIZE)):
        done.extend(action(chunk))
    return sorted(done)


def _failed_with_key(ids: Sequence[int]) -> list[int]:
    rows = Message.objects.using(conf.get().DATABASE).filter(
        id__in=ids, state=MessageState.FAILED, unique_key__isnull=False
    )
    return list(rows.values_list("id", flat=True))


def _ids(ids: Iterable[int]) -> list[int]:
    return sorted(set(limits.message_ids(ids)))


def _error_field(error: Any, key: str) -> str:
    if isinstance(error, dict) and error.get(key) is not None:
        return str(error[key])
    return ""

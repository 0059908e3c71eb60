"""Public enqueue API.

Enqueue runs on the Django connection, inside whatever transaction the caller has open: in a
view wrapped in ``transaction.atomic()`` a rollback enqueues nothing, and workers see the
messages exactly when the transaction commits. No ``on_commit`` is needed (or wanted).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from django_fairqueue import conf, store
from django_fairqueue.exceptions import InvalidChannel, PayloadError
from django_fairqueue.models import CHANNEL_NAME_MAX_LENGTH, Message
from django_fairqueue.signals import message_enqueued
from django_fairqueue.tasks import BoundTask, FairTask, TaskSpec, registry

#: Same range as django.tasks, so a task moves between backends unchanged.
MIN_PRIORITY = -100
MAX_PRIORITY = 100

TaskRef = str | FairTask[Any, Any] | TaskSpec


@dataclass(frozen=True)
class EnqueueRequest:
    """One call to queue, for :func:`enqueue_many`."""

    task: TaskRef
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    channel: str | None = None
    run_after: datetime | timedelta | None = None
    priority: int | None = None


def enqueue(
    task: TaskRef | BoundTask,
    *args: Any,
    channel: str | None = None,
    run_after: datetime | timedelta | None = None,
    priority: int | None = None,
    **kwargs: Any,
) -> int:
    """Queue one call of a registered task; returns the message id.

    ``task`` is a task name, or the object ``@django_fairqueue.task`` returned.
    ``channel`` is the fairness key (a tenant); without it the task's own channel rule or
    ``FAIRQUEUE['DEFAULT_CHANNEL']`` applies. ``run_after`` (aware datetime or timedelta) delays
    the message; ``priority`` (-100..100, higher first) orders it within its channel.
    Raises :class:`~django_fairqueue.exceptions.ChannelFull` when the channel's backlog is at its
    ``max_backlog``.
    """
    if isinstance(task, BoundTask):
        if channel is None:
            channel = task.channel
        if run_after is None:
            run_after = task.run_after
        if priority is None:
            priority = task.priority
        task = task.task
    request = EnqueueRequest(task, args, kwargs, channel, run_after, priority)
    return enqueue_many([request])[0]


def enqueue_many(requests: Iterable[EnqueueRequest]) -> list[int]:
    """Queue many calls in one round trip; returns message ids in the same order.

    All or nothing: a bad request or a full channel raises before anything is stored.
    """
    cfg = conf.get()
    now = timezone.now()
    messages = [_prepare(r, cfg, now) for r in requests]
    ids = store.enqueue_messages(
        messages,
        defaults=cfg.CHANNEL_DEFAULTS,
        notify_channel=cfg.NOTIFY_CHANNEL if cfg.NOTIFY else None,
    )
    if ids and message_enqueued.has_listeners(Message):
        message_enqueued.send(
            sender=Message, message_ids=ids, channels=[m.channel for m in messages]
        )
    return ids


def resolve_task(task: TaskRef) -> TaskSpec:
    if isinstance(task, FairTask):
        return task.spec
    if isinstance(task, TaskSpec):
        return task
    if isinstance(task, str):
        return registry.get(task)
    raise TypeError(f"task must be a task name or a registered task, got {type(task).__name__}")


def _prepare(
    request: EnqueueRequest, cfg: conf.FairQueueSettings, now: datetime
) -> store.NewMessage:
    spec = resolve_task(request.task)
    args = list(request.args)
    kwargs = dict(request.kwargs)
    channel = request.channel
    if channel is None and spec.channel_from is not None:
        channel = spec.channel_from(*args, **kwargs)
    if channel is None:
        channel = spec.channel or cfg.DEFAULT_CHANNEL
    priority = spec.priority if request.priority is None else request.priority
    return store.NewMessage(
        channel=validate_channel_name(channel),
        task_name=spec.name,
        payload=encode_payload(spec.name, args, kwargs, cfg.MAX_PAYLOAD_BYTES),
        priority=_check_priority(priority),
        run_at=_run_at(request.run_after, now),
        max_attempts=spec.effective_max_attempts,
        keep_result=spec.effective_keep_result,
    )


def validate_channel_name(name: Any) -> str:
    """A channel name is 1-200 characters of any text, without surrounding blanks or NUL."""
    if not isinstance(name, str):
        raise InvalidChannel(f"channel name must be a string, got {type(name).__name__}")
    if not name or not name.strip():
        raise InvalidChannel("channel name must not be empty")
    if name != name.strip():
        raise InvalidChannel(f"channel name must not start or end with blanks: {name!r}")
    if len(name) > CHANNEL_NAME_MAX_LENGTH:
        raise InvalidChannel(
            f"channel name is {len(name)} characters; the most is {CHANNEL_NAME_MAX_LENGTH}"
        )
    if "\x00" in name:
        raise InvalidChannel("channel name must not contain NUL characters")
    return name


# JSON's escape of U+0000: `\u0000` after an even number of backslashes (an odd number means
# the backslash itself is escaped and the text is a literal backslash followed by "u0000").
_ESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")

# One encoder for all calls: json.dumps() with options builds a new encoder every time.
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"), ensure_ascii=False)


class _Payload(str):
    """JSON text already checked; store.py passes it through without re-encoding."""


def encode_payload(
    task_name: str, args: list[Any], kwargs: dict[str, Any], max_bytes: int
) -> _Payload:
    """Encode call arguments as JSON, refusing anything that would not come back equal."""
    payload = {"args": args, "kwargs": kwargs}
    try:
        text = _ENCODER.encode(payload)
        size = len(text.encode())
    except UnicodeEncodeError as exc:  # a lone surrogate: not text PostgreSQL can store
        raise PayloadError(f"arguments of task {task_name!r} are not valid Unicode: {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise PayloadError(
            f"arguments of task {task_name!r} are not JSON serialisable: {exc}"
        ) from exc
    except RecursionError as exc:
        raise PayloadError(f"arguments of task {task_name!r} are nested too deeply") from exc
    if size > max_bytes:
        raise PayloadError(
            f"arguments of task {task_name!r} take {size} bytes as JSON; "
            f"FAIRQUEUE['MAX_PAYLOAD_BYTES'] is {max_bytes}"
        )
    if _ESCAPED_NUL.search(text):  # jsonb cannot store U+0000
        raise PayloadError(f"arguments of task {task_name!r} contain a NUL character")
    # Scalars come back from JSON exactly as they went in (NaN was refused above), so the
    # round trip is only needed for containers, where tuples or int dict keys would change.
    if not _all_scalars(args, kwargs) and json.loads(text) != payload:
        raise PayloadError(
            f"arguments of task {task_name!r} do not survive a JSON round trip unchanged "
            "(tuples, sets or non-string dict keys?); pass lists and dicts with string keys"
        )
    return _Payload(text)


_SCALARS = frozenset({str, int, float, bool, type(None)})


def _all_scalars(args: list[Any], kwargs: dict[str, Any]) -> bool:
    return all(type(a) in _SCALARS for a in args) and all(
        type(k) is str and type(v) in _SCALARS for k, v in kwargs.items()
    )


def _check_priority(priority: Any) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(
            f"priority must be between {MIN_PRIORITY} and {MAX_PRIORITY}, got {priority}"
        )
    return priority


def _run_at(run_after: datetime | timedelta | None, now: datetime) -> datetime | None:
    if run_after is None:
        return None
    if isinstance(run_after, timedelta):
        return now + run_after
    if isinstance(run_after, datetime):
        if timezone.is_naive(run_after):
            if settings.USE_TZ:
                raise ValueError("run_after must be an aware datetime (USE_TZ is on)")
            return timezone.make_aware(run_after)
        return run_after
    raise TypeError(f"run_after must be a datetime or timedelta, got {type(run_after).__name__}")

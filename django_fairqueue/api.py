"""Public enqueue API.

Enqueue runs on the Django connection, inside whatever transaction the caller has open: in a
view wrapped in ``transaction.atomic()`` a rollback enqueues nothing, and workers see the
messages exactly when the transaction commits. No ``on_commit`` is needed (or wanted).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from json.encoder import c_make_encoder, encode_basestring  # type: ignore[attr-defined]
from typing import TYPE_CHECKING, Any, TypeAlias, cast

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db.models import Model
from django.utils import timezone

from django_fairqueue import conf, limits
from django_fairqueue.db import channel_store, enqueue_store, message_store
from django_fairqueue.db.jsontext import has_nul, keep_big_floats
from django_fairqueue.exceptions import (
    DuplicateJob,
    FairQueueError,
    InvalidChannel,
    PayloadError,
)
from django_fairqueue.limits import (
    CHANNEL_NAME_MAX_LENGTH,
    GROUP_NAME_MAX_LENGTH,
    MAX_PRIORITY,
    MIN_PRIORITY,
    UNIQUE_KEY_MAX_LENGTH,
)
from django_fairqueue.models import Message
from django_fairqueue.observe import moments, tracing
from django_fairqueue.queues import DEFAULT_QUEUE, SEPARATOR, split_row_name, validate_queue_name
from django_fairqueue.signals import message_enqueued
from django_fairqueue.tasks.spec import TaskSpec, check_arguments, registry

if TYPE_CHECKING:
    from django_fairqueue.tasks import BoundTask, FairTask
    from django_fairqueue.tasks.django_compat import Task


TaskRef: TypeAlias = "str | FairTask[Any, Any] | TaskSpec"
#: A task whose messages to select (:func:`cancel`, :func:`abort`, ``testing.enqueued``): also a
#: copy made with ``.using(...)``, or a ``django.tasks`` task of a ``FairQueueBackend``.
TaskSelector: TypeAlias = "TaskRef | BoundTask | Task[Any, Any]"
#: A channel: its name, a saved model instance, or ``(group, channel)`` for a channel of a
#: channel group (the channel named ``"<group>/<channel>"``, its group created if missing).
ChannelRef: TypeAlias = "str | Model | tuple[str, str | Model]"


@dataclass(frozen=True)
class EnqueueRequest:
    """One call to queue, for :func:`enqueue_many`."""

    task: TaskRef
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    channel: ChannelRef | None = None
    run_after: datetime | timedelta | None = None
    priority: int | None = None
    #: unique jobs (see :func:`enqueue`)
    unique_key: str | None = None
    unique_scope: str | None = None
    on_conflict: str | None = None
    #: the queue (None: the task's, else ``"default"``; see :func:`enqueue`)
    queue: str | None = None


#: ``unique_scope`` values: how long a message keeps its ``unique_key`` from others.
UNIQUE_SCOPES = ("queued", "active")
#: ``on_conflict`` values: what an enqueue does when another message holds its key.
CONFLICT_POLICIES = ("keep", "replace", "raise")


def enqueue(
    task: TaskRef | BoundTask,
    /,
    *args: Any,
    channel: ChannelRef | None = None,
    run_after: datetime | timedelta | None = None,
    priority: int | None = None,
    unique_key: str | None = None,
    unique_scope: str | None = None,
    on_conflict: str | None = None,
    queue: str | None = None,
    **kwargs: Any,
) -> int:
    """Queue one call of a registered task; returns the message id.

    ``task`` is a task name, or the object ``@django_fairqueue.task`` returned.
    ``channel`` is the fairness key (a tenant); without it the task's own channel rule or
    ``FAIRQUEUE['DEFAULT_CHANNEL']`` applies. ``channel=("acme", "alice")`` queues to channel
    ``"acme/alice"`` of channel group ``"acme"`` (created if missing): the claim is fair across
    groups first, then across a group's channels. ``run_after`` (aware datetime or timedelta) delays
    the message; ``priority`` (-100..100, higher first) orders it within its channel.
    Raises :class:`~django_fairqueue.exceptions.ChannelFull` when the channel's backlog is at its
    ``max_backlog``.

    ``unique_key`` makes it a unique job: at most one message of the channel holds a key,
    while it is queued (``unique_scope="queued"``, the default) or also while it runs
    (``"active"``). When another message holds it, ``on_conflict`` decides: ``"keep"`` (the
    default) returns that message's id and stores nothing, ``"replace"`` gives a queued holder
    this call's arguments, run time and priority in place (a running one is kept) and returns
    its id, ``"raise"`` raises :class:`~django_fairqueue.exceptions.DuplicateJob`.

    ``queue`` overrides the task's queue (``@task(queue=...)``, else ``"default"``): workers
    started with ``--queues`` serve only theirs, fairly across the channels within each (see
    docs/howto/queues.md). A bad name raises :class:`~django_fairqueue.exceptions.InvalidQueue`.
    """
    if isinstance(getattr(getattr(task, "task", None), "spec", None), TaskSpec):
        # a BoundTask (task.using(...)): its queue options, then its task
        bound = cast("BoundTask", task)
        if channel is None:
            channel = bound.channel
        if run_after is None:
            run_after = bound.run_after
        if priority is None:
            priority = bound.priority
        if unique_key is None:
            unique_key = bound.unique_key
        if unique_scope is None:
            unique_scope = bound.unique_scope
        if on_conflict is None:
            on_conflict = bound.on_conflict
        if queue is None:
            queue = bound.queue
        spec = bound.task.spec
    else:
        spec = resolve_task(cast(TaskRef, task))
    cfg = conf.get()
    message = _prepare_one(spec, list(args), kwargs, channel, run_after, priority, cfg, queue)
    if unique_key is not None or unique_scope is not None or on_conflict is not None:
        message = dataclasses.replace(
            message, **_unique_options(unique_key, unique_scope, on_conflict)
        )
    message_id = enqueue_store.enqueue_message(
        message,
        defaults=cfg.CHANNEL_DEFAULTS,
        notify_channel=cfg.NOTIFY_CHANNEL if cfg.NOTIFY else None,
    )
    if message_enqueued.has_listeners(Message):
        _send_enqueued([message_id], [message.channel])
    return message_id


def enqueue_many(requests: Iterable[EnqueueRequest]) -> list[int]:
    """Queue many calls in one round trip; returns message ids in the same order.

    All or nothing: a bad request or a full channel raises before anything is stored.
    """
    cfg = conf.get()
    batch = _prepare_batch(requests, cfg)
    ids = enqueue_store.enqueue_messages(
        batch,
        defaults=cfg.CHANNEL_DEFAULTS,
        notify_channel=cfg.NOTIFY_CHANNEL if cfg.NOTIFY else None,
    )
    if ids and message_enqueued.has_listeners(Message):
        _send_enqueued(ids, batch.channels)
    return ids


def _send_enqueued(ids: Sequence[int], rows: Sequence[str]) -> None:
    """Send ``message_enqueued`` for the messages of ids ``ids`` (of channel rows ``rows``),
    each once: a later request of the call that met an earlier one's unique key got that
    message's id back, and a message stored once is counted once."""
    sent: dict[int, str] = {}
    for message_id, row in zip(ids, rows, strict=True):
        sent.setdefault(message_id, row)
    named = [split_row_name(row) for row in sent.values()]
    message_enqueued.send(
        sender=Message,
        message_ids=list(sent),
        channels=[channel for _, channel in named],
        queues=[queue for queue, _ in named],
    )


def cancel(
    ids: Iterable[int] | None = None,
    *,
    channel: str | Model | None = None,
    task: TaskSelector | None = None,
    queue: str | None = None,
) -> list[int]:
    """Cancel waiting (ready or scheduled) messages; returns the ids cancelled.

    Give message ``ids``, or a ``channel`` and/or a ``task`` (every waiting message of it),
    and/or a ``queue``. Running messages are left alone (see :func:`abort`), and so is a
    message a worker is claiming at that very moment: it runs. A cancelled message keeps its
    row, in state ``cancelled``, until the pruner removes it (``FAIRQUEUE['RESULT_RETENTION']``);
    its unique key, if it had one, is free at once. Part of the caller's transaction.

    ``queue`` narrows the selection to that queue: ``channel`` is then that queue's channel of
    that name, and ``task`` alone selects the task's messages in that queue only. Without it,
    ``channel`` is a channel of the default queue (as channel names given to the API are), and
    ``task`` alone selects the task's messages in every queue.
    """
    if ids is not None:
        if channel is not None or task is not None or queue is not None:
            raise ValueError("cancel() takes ids, or channel, task and/or queue, not both")
        return message_store.cancel_messages(_ids(ids))
    channel_id, task_name, queue_name = _selection(channel, task, "cancel", queue)
    if channel_id == -1:
        return []
    return message_store.cancel_matching_messages(
        channel_id=channel_id, task=task_name, queue=queue_name
    )


def abort(
    ids: Iterable[int] | None = None,
    *,
    channel: str | Model | None = None,
    task: TaskSelector | None = None,
    queue: str | None = None,
) -> dict[int, str]:
    """Stop messages wherever they are; returns ``{id: "cancelled" or "abort_requested"}``.

    Waiting messages are cancelled; running ones get an abort request, which their worker
    sees at its next heartbeat: the task's :func:`~django_fairqueue.abort_requested` turns
    True, and the attempt ends ``aborted`` when the task returns, or at
    ``FAIRQUEUE['ABORT_GRACE']`` if it does not. An aborted message is not retried. Give
    message ``ids``, or a ``channel`` and/or a ``task`` (its *running* messages; cancel the
    waiting ones with :func:`cancel`), and/or a ``queue``, which narrows the selection as
    for :func:`cancel` (without it, ``channel`` is a channel of the default queue and ``task``
    alone selects in every queue). Part of the caller's transaction.
    """
    if ids is not None:
        if channel is not None or task is not None or queue is not None:
            raise ValueError("abort() takes ids, or channel, task and/or queue, not both")
        return message_store.abort_messages(_ids(ids))
    channel_id, task_name, queue_name = _selection(channel, task, "abort", queue)
    if channel_id == -1:
        return {}
    return message_store.abort_messages(
        message_store.select_running_message_ids(
            channel_id=channel_id, task=task_name, queue=queue_name
        )
    )


def _ids(ids: Iterable[int]) -> list[int]:
    return limits.message_ids(ids)


def _selection(
    channel: str | Model | None, task: TaskSelector | None, verb: str, queue: str | None
) -> tuple[int | None, str | None, str | None]:
    """(channel id, task name, queue) of a selection by channel, task and/or queue; channel id
    -1 when the channel does not exist (nothing to select). The queue is returned only when it
    filters on its own (no channel: a channel row is in one queue already)."""
    if channel is None and task is None and queue is None:
        raise ValueError(f"{verb}() needs ids, a channel, a task or a queue")
    if queue is not None:
        validate_queue_name(queue)
    channel_id: int | None = None
    if channel is not None:
        name = validate_channel_name(channel)
        if queue is not None and queue != DEFAULT_QUEUE:
            name = f"{queue}{SEPARATOR}{name}"
        channel_id = channel_store.select_channel_ids([name]).get(name, -1)
    task_name = None if task is None else name_of_task(task)
    return channel_id, task_name, (queue if channel is None else None)


def name_of_task(task: TaskSelector) -> str:
    """The name the messages of ``task`` carry, to select them by: a task name, a task object
    (``@task``, ``.using(...)``) or a ``django.tasks`` task of a ``FairQueueBackend``. Anything
    else is refused, since a selection by it would find nothing."""
    if isinstance(task, str):
        return task
    if isinstance(task, TaskSpec):
        return task.name
    # a task object (@task), or a copy of one made with .using(...): the API imports neither
    for candidate in (task, getattr(task, "task", None)):
        spec = getattr(candidate, "spec", None)
        if isinstance(spec, TaskSpec):
            return spec.name
    try:
        from django_fairqueue.backend import FairQueueBackend
        from django_fairqueue.tasks.django_compat import Task
    except ImproperlyConfigured:  # no tasks framework here: ``task`` cannot be one of its tasks
        pass
    else:
        if isinstance(task, Task):
            if not isinstance(task.get_backend(), FairQueueBackend):
                raise ValueError(
                    f"task {task.module_path} is a task of backend {task.backend!r}, which is "
                    "not a FairQueueBackend: its calls are never queued here"
                )
            return task.module_path  # the name the backend registers it under
    raise TypeError(
        "task must be a task name, a fairqueue task or a django.tasks task, "
        f"got {type(task).__name__}: {task!r}"
    )


def resolve_task(task: TaskRef) -> TaskSpec:
    spec = getattr(task, "spec", None)  # a task object (@task); the API imports none
    if isinstance(spec, TaskSpec):
        return spec
    if isinstance(task, TaskSpec):
        return task
    if isinstance(task, str):
        return registry.get(task)
    raise TypeError(f"task must be a task name or a registered task, got {type(task).__name__}")


def _prepare_batch(
    requests: Iterable[EnqueueRequest], cfg: conf.FairQueueSettings
) -> enqueue_store.NewMessageBatch:
    """Validate and serialise every request into the columns the enqueue statement takes.

    This is the per-message hot path of every enqueue (a batch of 100 spent about as long
    here as in the database), so what is the same for many messages is worked out once per
    call: a task's spec and settings-derived values, and each distinct channel name's check.
    """
    batch = enqueue_store.NewMessageBatch()
    channels = batch.channels
    tasks = batch.task_names
    payloads = batch.payloads
    priorities = batch.priorities
    run_ats = batch.run_at
    attempts = batch.max_attempts
    keep = batch.keep_result
    # id(task) -> (task, spec, max_attempts, keep_result, default channel). The task object is
    # kept in the value so its id cannot be reused by another object during the call.
    specs: dict[int, tuple[object, TaskSpec, int, bool, str]] = {}
    checked: set[str] = set()
    fitted: set[tuple[int, int, tuple[str, ...]]] = set()  # (id(spec), positional, names)
    groups: set[str] = set()  # of channels given as (group, channel), as group row names
    queues: dict[str | None, str] = {None: DEFAULT_QUEUE}  # given -> checked
    keyed: dict[tuple[str, str], int] = {}  # (channel row, unique key) -> first position
    max_bytes = cfg.MAX_PAYLOAD_BYTES
    # A timedelta run_after travels as a delay and is added to the database's clock, the clock
    # the claim compares run_at with (an application server's clock may be off). The column
    # exists only once some message has a delay.
    delays: list[timedelta | None] | None = None
    traced = _trace_suffix()
    # A batch of one is named by its call alone (django.tasks enqueues through here).
    requests = requests if type(requests) is list else list(requests)
    position = 0
    try:
        for position, request in enumerate(requests):
            if type(request) is not EnqueueRequest and not isinstance(request, EnqueueRequest):
                raise TypeError(f"expected an EnqueueRequest, got {type(request).__name__}")
            task = request.task
            known = specs.get(id(task))
            if known is None:
                spec = resolve_task(task)
                known = (
                    task,
                    spec,
                    spec.effective_max_attempts,
                    spec.effective_keep_result,
                    spec.channel or cfg.DEFAULT_CHANNEL,
                )
                specs[id(task)] = known
            spec = known[1]
            args = request.args
            kwargs = request.kwargs
            # a cheap type check: list() or dict() would turn a string, set, mapping, bytes or
            # generator into something else without a word
            if (type(args) is not tuple and type(args) is not list) or type(kwargs) is not dict:
                _check_call_arguments(spec.name, args, kwargs)
            args = list(args)
            kwargs = dict(kwargs)
            if kwargs and not all(type(key) is str for key in kwargs):
                _check_call_arguments(spec.name, args, kwargs)
            # Whether arguments fit a signature depends only on how many are positional and which
            # names the others have: checked once per such shape and task in a batch.
            shape = (id(spec), len(args), tuple(kwargs) if kwargs else ())
            if shape not in fitted:
                check_arguments(spec, args, kwargs)
                fitted.add(shape)
            channel = request.channel
            if channel is None:
                if spec.channel_from is not None:
                    channel = spec.channel_from(*args, **kwargs)
                if channel is None:
                    channel = known[4]
            queue = request.queue
            if queue is None:
                queue = spec.queue
            if queue not in queues:
                queues[queue] = validate_queue_name(queue)
            queue = queues[queue]
            if queue != DEFAULT_QUEUE:
                group = _group_part(channel) if type(channel) is tuple else None
                channel = _queue_row(queue, validate_channel_name(channel), group, groups)
            elif type(channel) is not str or channel not in checked:  # (unhashable: not a str)
                if type(channel) is tuple:
                    groups.add(_group_part(channel))
                channel = validate_channel_name(channel)
                checked.add(channel)
            payload = encode_payload(spec.name, args, kwargs, max_bytes)
            if traced:
                payload = _Payload(payload[:-1] + traced)
            priority = request.priority
            if priority is None:
                priority = spec.priority
            if type(priority) is not int or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
                priority = check_priority(priority)  # raises unless an int subclass in range
            run_after = request.run_after
            run_at = delay = None
            if isinstance(run_after, timedelta):
                delay = run_after
                if delay > _LONGEST_DELAY:
                    # what adding it to any date from now on would say
                    raise OverflowError(f"run_after {delay} is past the last representable date")
                if delays is None:
                    delays = [None] * len(channels)
            elif run_after is not None:
                run_at = _run_at(run_after)
            if delays is not None:
                delays.append(delay)
            if (
                request.unique_key is not None
                or request.unique_scope is not None
                or request.on_conflict is not None
            ):
                unique = _unique_options(
                    request.unique_key, request.unique_scope, request.on_conflict
                )
                held_at = keyed.setdefault((channel, unique["unique_key"]), position)
                if held_at != position and unique["on_conflict"] == "raise":
                    # The database would find the earlier request's row as the holder and name
                    # its id, which the refusal itself rolls back.
                    raise DuplicateJob(channel, unique["unique_key"], None, None, in_batch=held_at)
                if batch.unique_keys is None:
                    batch.unique_keys = [None] * len(channels)
                    batch.unique_scopes = ["queued"] * len(channels)
                    batch.on_conflict = ["keep"] * len(channels)
                batch.unique_keys.append(unique["unique_key"])
                batch.unique_scopes.append(unique["unique_scope"])  # type: ignore[union-attr]
                batch.on_conflict.append(unique["on_conflict"])  # type: ignore[union-attr]
            elif batch.unique_keys is not None:
                batch.unique_keys.append(None)
                batch.unique_scopes.append("queued")  # type: ignore[union-attr]
                batch.on_conflict.append("keep")  # type: ignore[union-attr]
            channels.append(channel)
            tasks.append(spec.name)
            payloads.append(payload)
            priorities.append(priority)
            run_ats.append(run_at)
            attempts.append(known[2])
            keep.append(known[3])
    except (FairQueueError, ValueError, TypeError, LookupError, OverflowError) as exc:
        if len(requests) > 1:
            _name_request(exc, position)
        raise
    batch.delays = delays
    if groups:
        batch.groups = sorted(groups)
        channel_store.ensure_groups(batch.groups)
    return batch


def _name_request(exc: BaseException, position: int) -> None:
    """Say which request of an ``enqueue_many`` batch ``exc`` is about: its message starts with
    the position (in a note if the exception does not print its message as given)."""
    text = f"enqueue_many request {position}: {exc}"
    if len(exc.args) == 1 and str(exc) == str(exc.args[0]):
        exc.args = (text,)
    else:
        exc.add_note(text)


def _check_call_arguments(task_name: str, args: Any, kwargs: Any) -> None:
    """Raise :class:`PayloadError` unless a request's ``args`` is a list or tuple and its
    ``kwargs`` a mapping with string keys."""
    where = f"task {task_name!r}"
    if not isinstance(args, (list, tuple)):
        raise PayloadError(
            f"{where}: args must be a list or tuple of arguments, got {type(args).__name__} "
            "(a single argument is written (value,))"
        )
    if not isinstance(kwargs, Mapping):
        raise PayloadError(f"{where}: kwargs must be a dict, got {type(kwargs).__name__}")
    for key in kwargs:
        if not isinstance(key, str):
            raise PayloadError(
                f"{where}: kwargs keys must be strings (argument names), got {key!r}"
            )


def _prepare_one(
    spec: TaskSpec,
    args: list[Any],
    kwargs: dict[str, Any],
    channel: ChannelRef | None,
    run_after: datetime | timedelta | None,
    priority: int | None,
    cfg: conf.FairQueueSettings,
    queue: str | None = None,
) -> enqueue_store.NewMessage:
    """One message, checked and serialised as :func:`_prepare_batch` does it for each request
    (for :func:`enqueue`: no batch columns to build for a single message)."""
    check_arguments(spec, args, kwargs)
    if channel is None:
        if spec.channel_from is not None:
            channel = spec.channel_from(*args, **kwargs)
        if channel is None:
            channel = spec.channel or cfg.DEFAULT_CHANNEL
    if queue is None:
        queue = spec.queue
    channel, group = _channel_row(channel, queue)
    payload = encode_payload(spec.name, args, kwargs, cfg.MAX_PAYLOAD_BYTES)
    traced = _trace_suffix()
    if traced:
        payload = _Payload(payload[:-1] + traced)
    if priority is None:
        priority = spec.priority
    if type(priority) is not int or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        priority = check_priority(priority)  # raises unless an int subclass in range
    run_at = delay = None
    if isinstance(run_after, timedelta):
        delay = run_after
        if delay > _LONGEST_DELAY:
            raise OverflowError(f"run_after {delay} is past the last representable date")
    elif run_after is not None:
        run_at = _run_at(run_after)
    if group is not None:
        channel_store.ensure_groups([group])
    return enqueue_store.NewMessage(
        channel,
        spec.name,
        payload,
        priority,
        run_at,
        spec.effective_max_attempts,
        spec.effective_keep_result,
        delay,
        group=group,
    )


def _unique_options(unique_key: Any, unique_scope: Any, on_conflict: Any) -> dict[str, Any]:
    """The unique-job options of one call, checked (as NewMessage's fields)."""
    if unique_key is None:
        raise ValueError("unique_scope and on_conflict need a unique_key")
    if not isinstance(unique_key, str):
        raise ValueError(f"unique_key must be a string, got {type(unique_key).__name__}")
    if not unique_key or len(unique_key) > UNIQUE_KEY_MAX_LENGTH:
        raise ValueError(
            f"unique_key must be 1 to {UNIQUE_KEY_MAX_LENGTH} characters, got {len(unique_key)}"
        )
    if "\x00" in unique_key:
        raise ValueError("unique_key must not contain NUL characters")
    if not unique_key.isascii():
        try:
            unique_key.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"unique_key is not valid Unicode: {unique_key!r}") from None
    scope = "queued" if unique_scope is None else unique_scope
    if scope not in UNIQUE_SCOPES:
        raise ValueError(f"unique_scope must be one of {UNIQUE_SCOPES}, got {unique_scope!r}")
    policy = "keep" if on_conflict is None else on_conflict
    if policy not in CONFLICT_POLICIES:
        raise ValueError(f"on_conflict must be one of {CONFLICT_POLICIES}, got {on_conflict!r}")
    return {"unique_key": unique_key, "unique_scope": scope, "on_conflict": policy}


def _group_part(channel: tuple[Any, ...]) -> str:
    """The group of a channel given as ``(group, channel)``, checked (the pair is checked
    whole by :func:`validate_channel_name`)."""
    validate_channel_name(channel)
    return validate_group_name(channel[0])


def check_channel_in_queue(channel: ChannelRef, queue: str) -> None:
    """Check ``channel`` (a name, a saved model instance, a ``(group, channel)`` pair) as enqueue
    checks it in ``queue``: outside the default queue the queue's name is part of the channel's
    (and its group's) row name, which must fit too. Raises :class:`InvalidChannel`
    (:class:`InvalidQueue` for a bad queue name)."""
    _channel_row(channel, validate_queue_name(queue))


def _channel_row(channel: ChannelRef, queue: str) -> tuple[str, str | None]:
    """``channel`` checked as enqueue checks it in ``queue`` (checked here unless the default
    one): the channel row's name and its group row's (None: no group). Outside the default
    queue a row's name is ``<queue>\x1f<name>``."""
    group = _group_part(channel) if type(channel) is tuple else None
    name = validate_channel_name(channel)
    if queue == DEFAULT_QUEUE:
        return name, group
    rows: set[str] = set()
    row = _queue_row(validate_queue_name(queue), name, group, rows)
    return row, rows.pop() if rows else None


def _queue_row(queue: str, channel: str, group: str | None, groups: set[str]) -> str:
    """The row name of checked ``channel`` in ``queue`` (not the default one); adds the row
    name of its ``group``, if any, to ``groups``."""
    row = f"{queue}{SEPARATOR}{channel}"
    if len(row) > CHANNEL_NAME_MAX_LENGTH:
        raise InvalidChannel(
            f"channel name {channel!r} is too long for queue {queue!r}: queue and channel "
            f"names and the one character between them take {len(row)} of the "
            f"{CHANNEL_NAME_MAX_LENGTH} characters a channel row's name may have"
        )
    if group is not None:
        group_row = f"{queue}{SEPARATOR}{group}"
        if len(group_row) > GROUP_NAME_MAX_LENGTH:
            raise InvalidChannel(
                f"channel group name {group!r} is too long for queue {queue!r}: with the one "
                f"character between them they take {len(group_row)} of the "
                f"{GROUP_NAME_MAX_LENGTH} characters a group row's name may have"
            )
        groups.add(group_row)
    return row


def validate_group_name(name: Any) -> str:
    """A channel group's name is 1-100 characters without '/', surrounding blanks or NUL.
    Returns it."""
    if not isinstance(name, str):
        raise InvalidChannel(f"channel group name must be a string, got {type(name).__name__}")
    if not name:
        raise InvalidChannel("channel group name must not be empty")
    if not name.strip():
        raise InvalidChannel(f"channel group name must not be only blanks: {name!r}")
    if name != name.strip():
        raise InvalidChannel(f"channel group name must not start or end with blanks: {name!r}")
    if "/" in name:
        raise InvalidChannel(
            f"channel group name must not contain '/' (it separates the group from the "
            f"channel in the channel's name): {name!r}"
        )
    if len(name) > GROUP_NAME_MAX_LENGTH:
        raise InvalidChannel(
            f"channel group name is {len(name)} characters; the most is {GROUP_NAME_MAX_LENGTH}"
        )
    _check_text(name, "channel group name")
    return name


def validate_channel_name(name: Any) -> str:
    """A channel name is 1-200 characters of any text, without surrounding blanks or NUL.

    A saved model instance (a tenant, an account) stands for ``"<app_label>.<model>:<pk>"``,
    so ``channel=doc.tenant`` works and two models' ids never share a channel. A pair
    ``(group, channel)`` stands for ``"<group>/<channel>"``, a channel of that channel group
    (``channel`` a name or a saved model instance). Returns the name.
    """
    if type(name) is tuple:
        if len(name) != 2:
            raise InvalidChannel(
                f"a grouped channel is a pair (group, channel), got {len(name)} items: {name!r}"
            )
        group = validate_group_name(name[0])
        if isinstance(name[1], tuple):
            raise InvalidChannel(f"groups do not nest: the channel of {name!r} is a pair")
        member = validate_channel_name(name[1])
        name = f"{group}/{member}"
    elif isinstance(name, (list, tuple)):
        raise InvalidChannel(
            f"a grouped channel is a tuple (group, channel), got {type(name).__name__}"
        )
    if isinstance(name, Model):
        if name.pk is None:
            raise InvalidChannel(
                f"channel is an unsaved {type(name).__name__}: save it first (its primary key "
                "names the channel)"
            )
        name = f"{name._meta.label_lower}:{name.pk}"
    if not isinstance(name, str):
        raise InvalidChannel(f"channel name must be a string, got {type(name).__name__}")
    if not name:
        raise InvalidChannel("channel name must not be empty")
    if not name.strip():
        raise InvalidChannel(f"channel name must not be only blanks: {name!r}")
    if name != name.strip():
        raise InvalidChannel(f"channel name must not start or end with blanks: {name!r}")
    if len(name) > CHANNEL_NAME_MAX_LENGTH:
        raise InvalidChannel(
            f"channel name is {len(name)} characters; the most is {CHANNEL_NAME_MAX_LENGTH}"
        )
    _check_text(name, "channel name")
    return name


def _check_text(name: str, what: str) -> None:
    """Refuse a channel's or group's name (``what``) that PostgreSQL cannot store, or whose
    unit separator would pass for a queue's."""
    if "\x00" in name:
        raise InvalidChannel(f"{what} must not contain NUL characters")
    if SEPARATOR in name:
        raise InvalidChannel(
            f"{what} must not contain the unit separator U+001F (it separates a queue "
            f"from the channel in a channel row's name): {name!r}"
        )
    if not name.isascii():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: not text PostgreSQL can store
            raise InvalidChannel(
                f"{what} is not valid Unicode (a lone surrogate): {name!r}"
            ) from None


def _refuse(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# One C encoder for all calls, called directly: json.dumps() with options builds a new encoder
# every time, and JSONEncoder.encode() builds a new C encoder per call. Without a markers dict
# a self-containing argument is not detected as circular but recurses until RecursionError,
# which is reported like any too deeply nested payload.
_encode = c_make_encoder(
    None,  # markers
    _refuse,  # default
    encode_basestring,  # ensure_ascii=False
    None,  # indent
    ":",  # key separator
    ",",  # item separator
    False,  # sort_keys
    False,  # skipkeys
    False,  # allow_nan
)


class _Payload(str):
    """JSON text already checked; the enqueue statement takes it as is, without re-encoding."""


def _trace_suffix() -> str | None:
    """The end of a payload's JSON object that carries the current trace context (replacing
    its closing brace), or None when there is nothing to carry (see :mod:`tracing`)."""
    headers = tracing.carrier()
    if not headers:
        return None
    return f',"{tracing.CARRIER_KEY}":{json.dumps(headers, separators=(",", ":"))}}}'


def check_call(spec: TaskSpec, args: list[Any], kwargs: dict[str, Any], max_bytes: int) -> None:
    """Raise :class:`TypeError` (:class:`PayloadError` for what JSON cannot carry) unless an
    enqueue would take this call of the task: for what stores a call to enqueue later (a
    schedule), so that it is refused when it is written, not at each firing."""
    check_arguments(spec, args, kwargs)
    encode_payload(spec.name, args, kwargs, max_bytes)


def encode_payload(
    task_name: str, args: list[Any], kwargs: dict[str, Any], max_bytes: int
) -> _Payload:
    """Encode call arguments as JSON, refusing anything that would not come back equal."""
    payload = {"args": args, "kwargs": kwargs}
    try:
        text = "".join(_encode(payload, 0))
        if "e+" in text:
            text = keep_big_floats(text)
        # ASCII text has one byte per character; other text is measured (and a lone
        # surrogate, which PostgreSQL cannot store, raises here)
        size = len(text) if text.isascii() else len(text.encode())
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
    if has_nul(text):
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
    scalars = _SCALARS
    for value in args:
        if type(value) not in scalars:
            return False
    for key, value in kwargs.items():
        if type(key) is not str or type(value) not in scalars:
            return False
    return True


def check_priority(priority: Any) -> int:
    """``priority`` if it is an int within the priority range; ValueError otherwise."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(
            f"priority must be between {MIN_PRIORITY} and {MAX_PRIORITY}, got {priority}"
        )
    return priority


#: The longest delay whose run time a datetime can hold (from a few years from now on).
_LONGEST_DELAY = datetime.max - datetime(2100, 1, 1)


def _run_at(run_after: datetime) -> datetime:
    """An absolute run_after, checked (a timedelta one is sent as a delay instead)."""
    if isinstance(run_after, datetime):
        if timezone.is_naive(run_after):
            if settings.USE_TZ:
                raise ValueError("run_after must be an aware datetime (USE_TZ is on)")
            return moments.aware(run_after)  # a wall-clock time in TIME_ZONE, as Django has it
        return run_after
    raise TypeError(f"run_after must be a datetime or timedelta, got {type(run_after).__name__}")

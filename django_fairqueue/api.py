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
from json.encoder import c_make_encoder, encode_basestring  # type: ignore[attr-defined]
from typing import TYPE_CHECKING, Any, TypeAlias, cast

from django.conf import settings
from django.db.models import Model
from django.utils import timezone

from django_fairqueue import conf, store, tracing
from django_fairqueue.exceptions import InvalidChannel, PayloadError
from django_fairqueue.limits import CHANNEL_NAME_MAX_LENGTH
from django_fairqueue.models import Message
from django_fairqueue.signals import message_enqueued
from django_fairqueue.taskspec import TaskSpec, registry

if TYPE_CHECKING:
    from django_fairqueue.tasks import BoundTask, FairTask

#: Same range as django.tasks, so a task moves between backends unchanged.
MIN_PRIORITY = -100
MAX_PRIORITY = 100

TaskRef: TypeAlias = "str | FairTask[Any, Any] | TaskSpec"


@dataclass(frozen=True)
class EnqueueRequest:
    """One call to queue, for :func:`enqueue_many`."""

    task: TaskRef
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    channel: str | Model | None = None
    run_after: datetime | timedelta | None = None
    priority: int | None = None


def enqueue(
    task: TaskRef | BoundTask,
    *args: Any,
    channel: str | Model | None = None,
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
    if isinstance(getattr(getattr(task, "task", None), "spec", None), TaskSpec):
        # a BoundTask (task.using(...)): its queue options, then its task
        bound = cast("BoundTask", task)
        if channel is None:
            channel = bound.channel
        if run_after is None:
            run_after = bound.run_after
        if priority is None:
            priority = bound.priority
        spec = bound.task.spec
    else:
        spec = resolve_task(cast(TaskRef, task))
    cfg = conf.get()
    message = _prepare_one(spec, list(args), kwargs, channel, run_after, priority, cfg)
    message_id = store.enqueue_message(
        message,
        defaults=cfg.CHANNEL_DEFAULTS,
        notify_channel=cfg.NOTIFY_CHANNEL if cfg.NOTIFY else None,
    )
    if message_enqueued.has_listeners(Message):
        message_enqueued.send(sender=Message, message_ids=[message_id], channels=[message.channel])
    return message_id


def enqueue_many(requests: Iterable[EnqueueRequest]) -> list[int]:
    """Queue many calls in one round trip; returns message ids in the same order.

    All or nothing: a bad request or a full channel raises before anything is stored.
    """
    cfg = conf.get()
    batch = _prepare_batch(requests, cfg)
    ids = store.enqueue_messages(
        batch,
        defaults=cfg.CHANNEL_DEFAULTS,
        notify_channel=cfg.NOTIFY_CHANNEL if cfg.NOTIFY else None,
    )
    if ids and message_enqueued.has_listeners(Message):
        message_enqueued.send(sender=Message, message_ids=ids, channels=list(batch.channels))
    return ids


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
) -> store.NewMessageBatch:
    """Validate and serialise every request into the columns the enqueue statement takes.

    This is the per-message hot path of every enqueue (a batch of 100 spent about as long
    here as in the database), so what is the same for many messages is worked out once per
    call: a task's spec and settings-derived values, and each distinct channel name's check.
    """
    batch = store.NewMessageBatch()
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
    max_bytes = cfg.MAX_PAYLOAD_BYTES
    # A timedelta run_after travels as a delay and is added to the database's clock, the clock
    # the claim compares run_at with (an application server's clock may be off). The column
    # exists only once some message has a delay.
    delays: list[timedelta | None] | None = None
    traced = _trace_suffix()
    for request in requests:
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
        args = list(request.args)
        kwargs = dict(request.kwargs)
        channel = request.channel
        if channel is None:
            if spec.channel_from is not None:
                channel = spec.channel_from(*args, **kwargs)
            if channel is None:
                channel = known[4]
        if type(channel) is not str or channel not in checked:  # (unhashable: not a str)
            channel = validate_channel_name(channel)
            checked.add(channel)
        payload = encode_payload(spec.name, args, kwargs, max_bytes)
        if traced:
            payload = _Payload(payload[:-1] + traced)
        priority = request.priority
        if priority is None:
            priority = spec.priority
        if type(priority) is not int or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            priority = _check_priority(priority)  # raises unless an int subclass in range
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
        channels.append(channel)
        tasks.append(spec.name)
        payloads.append(payload)
        priorities.append(priority)
        run_ats.append(run_at)
        attempts.append(known[2])
        keep.append(known[3])
    batch.delays = delays
    return batch


def _prepare_one(
    spec: TaskSpec,
    args: list[Any],
    kwargs: dict[str, Any],
    channel: str | Model | None,
    run_after: datetime | timedelta | None,
    priority: int | None,
    cfg: conf.FairQueueSettings,
) -> store.NewMessage:
    """One message, checked and serialised as :func:`_prepare_batch` does it for each request
    (for :func:`enqueue`: no batch columns to build for a single message)."""
    if channel is None:
        if spec.channel_from is not None:
            channel = spec.channel_from(*args, **kwargs)
        if channel is None:
            channel = spec.channel or cfg.DEFAULT_CHANNEL
    channel = validate_channel_name(channel)
    payload = encode_payload(spec.name, args, kwargs, cfg.MAX_PAYLOAD_BYTES)
    traced = _trace_suffix()
    if traced:
        payload = _Payload(payload[:-1] + traced)
    if priority is None:
        priority = spec.priority
    if type(priority) is not int or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        priority = _check_priority(priority)  # raises unless an int subclass in range
    run_at = delay = None
    if isinstance(run_after, timedelta):
        delay = run_after
        if delay > _LONGEST_DELAY:
            raise OverflowError(f"run_after {delay} is past the last representable date")
    elif run_after is not None:
        run_at = _run_at(run_after)
    return store.NewMessage(
        channel,
        spec.name,
        payload,
        priority,
        run_at,
        spec.effective_max_attempts,
        spec.effective_keep_result,
        delay,
    )


def validate_channel_name(name: Any) -> str:
    """A channel name is 1-200 characters of any text, without surrounding blanks or NUL.

    A saved model instance (a tenant, an account) stands for ``"<app_label>.<model>:<pk>"``,
    so ``channel=doc.tenant`` works and two models' ids never share a channel. Returns the name.
    """
    if isinstance(name, Model):
        if name.pk is None:
            raise InvalidChannel(
                f"channel is an unsaved {type(name).__name__}: save it first (its primary key "
                "names the channel)"
            )
        name = f"{name._meta.label_lower}:{name.pk}"
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
    if not name.isascii():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: not text PostgreSQL can store
            raise InvalidChannel(
                f"channel name is not valid Unicode (a lone surrogate): {name!r}"
            ) from None
    return name


# JSON's escape of U+0000: `\u0000` after an even number of backslashes (an odd number means
# the backslash itself is escaped and the text is a literal backslash followed by "u0000").
_ESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


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


# A JSON string, or a number written with a positive exponent (Python writes 1e+20 for the
# float 1e20). jsonb keeps numbers as numeric and prints that one as 100000000000000000000,
# which reads back as an int; written as 100000000000000000000.0 it keeps its scale and reads
# back as the same float.
_STRING_OR_BIG_FLOAT = re.compile(r'"(?:[^"\\]|\\.)*"|(-?\d+(?:\.\d+)?e\+\d+)')


def _keep_big_floats(text: str) -> str:
    def fix(match: re.Match[str]) -> str:
        number = match.group(1)
        if number is None:
            return match.group(0)  # a string: left as it is
        return f"{int(float(number))}.0"  # exact: such a float is a whole number

    return _STRING_OR_BIG_FLOAT.sub(fix, text)


class _Payload(str):
    """JSON text already checked; store.py passes it through without re-encoding."""


def _trace_suffix() -> str | None:
    """The end of a payload's JSON object that carries the current trace context (replacing
    its closing brace), or None when there is nothing to carry (see :mod:`tracing`)."""
    headers = tracing.carrier()
    if not headers:
        return None
    return f',"{tracing.CARRIER_KEY}":{json.dumps(headers, separators=(",", ":"))}}}'


def encode_payload(
    task_name: str, args: list[Any], kwargs: dict[str, Any], max_bytes: int
) -> _Payload:
    """Encode call arguments as JSON, refusing anything that would not come back equal."""
    payload = {"args": args, "kwargs": kwargs}
    try:
        text = "".join(_encode(payload, 0))
        if "e+" in text:
            text = _keep_big_floats(text)
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
    if "\\u0000" in text and _ESCAPED_NUL.search(text):  # jsonb cannot store U+0000
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


def _check_priority(priority: Any) -> int:
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
            return timezone.make_aware(run_after)
        return run_after
    raise TypeError(f"run_after must be a datetime or timedelta, got {type(run_after).__name__}")

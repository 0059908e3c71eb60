"""The way into the queue: inserting messages (``fairqueue_enqueue_v1``, ``_one_v1`` for one).

:class:`NewMessage` and :class:`NewMessageBatch` are what ``api.enqueue`` and
``api.enqueue_many`` build; a channel missing on first use is created here (see
:func:`enqueue_messages` for when it is created apart from the caller's transaction).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connections

from django_fairqueue import conf
from django_fairqueue.db import channel_store, pg
from django_fairqueue.exceptions import ChannelFull, DuplicateJob, IsolationLevelError

queries = pg.StatementFile("django_fairqueue.db", "statements/enqueue.sql")
_run = queries.run


@dataclass(frozen=True, slots=True)
class NewMessage:
    """One message to insert, already validated and serialised."""

    channel: str
    task_name: str
    payload: str  # JSON text
    priority: int = 0
    run_at: datetime | None = None
    max_attempts: int = 1
    keep_result: bool = False
    #: a delay from now on the database clock (``run_at`` is absolute); at most one of the two
    delay: timedelta | None = None
    #: unique jobs: the key (None: none), its scope ("queued", "active") and what to do when
    #: another message of the channel holds it ("keep", "replace", "raise")
    unique_key: str | None = None
    unique_scope: str = "queued"
    on_conflict: str = "keep"
    #: the channel group the caller named, ``channel=(group, channel)``: a new channel is
    #: created only after its group is made sure of (see :func:`enqueue_messages`)
    group: str | None = None


@dataclass(slots=True)
class NewMessageBatch:
    """Messages to insert as parallel columns (one element per message), already validated
    and serialised: what ``api.enqueue_many`` builds, without an object per message."""

    channels: list[str] = field(default_factory=list)
    task_names: list[str] = field(default_factory=list)
    payloads: list[str] = field(default_factory=list)  # JSON text
    priorities: list[int] = field(default_factory=list)
    run_at: list[datetime | None] = field(default_factory=list)
    max_attempts: list[int] = field(default_factory=list)
    keep_result: list[bool] = field(default_factory=list)
    #: per-message delays from now on the database clock; None when no message has one
    delays: list[timedelta | None] | None = None
    #: unique jobs: per-message keys (None elements for messages without one), scopes and
    #: conflict policies; all three None when no message has a key
    unique_keys: list[str | None] | None = None
    unique_scopes: list[str] | None = None
    on_conflict: list[str] | None = None
    #: the channel groups the caller named (``channel=(group, channel)``), or None
    groups: list[str] | None = None

    @classmethod
    def of(cls, messages: Sequence[NewMessage]) -> NewMessageBatch:
        keyed = any(m.unique_key is not None for m in messages)
        return cls(
            [m.channel for m in messages],
            [m.task_name for m in messages],
            [m.payload for m in messages],
            [m.priority for m in messages],
            [m.run_at for m in messages],
            [m.max_attempts for m in messages],
            [m.keep_result for m in messages],
            [m.delay for m in messages] if any(m.delay is not None for m in messages) else None,
            [m.unique_key for m in messages] if keyed else None,
            [m.unique_scope for m in messages] if keyed else None,
            [m.on_conflict for m in messages] if keyed else None,
        )


def enqueue_messages(
    messages: Sequence[NewMessage] | NewMessageBatch,
    *,
    defaults: conf.ChannelDefaults,
    notify_channel: str | None,
    using: str | None = None,
) -> list[int]:
    """Insert messages in one round trip; returns their ids in input order.

    Raises :class:`ChannelFull` (and stores nothing) when a bounded channel has no room.

    Inside a transaction, channels that do not exist yet are created in a short transaction of
    their own first (a second round trip, once per new channel): a new channel's name is held
    by its creator until it commits, and two transactions creating channels in opposite orders
    would deadlock. In autocommit the statement creates them itself, except for a batch naming
    channel groups (``batch.groups``): a channel missing there is created only after its
    group is created or found (not trusting this process's memory of the group, which another
    process may have deleted), so a new channel of the tuple form always lands in its group.
    """
    batch = messages if isinstance(messages, NewMessageBatch) else NewMessageBatch.of(messages)
    if not batch.channels:
        return []
    wrapper = connections[using or conf.get().DATABASE]
    create_apart = channel_store.creates_channels_apart(wrapper)
    # Bound in binary (the statement's b placeholders): psycopg then sends arrays without quoting
    # and escaping each element in Python, which cost more than the rest of the call.
    # A column with one value for every message (one channel, one task: the usual batch) is
    # sent as that one value, which the function repeats: psycopg dumps array elements one
    # by one in Python.
    params = {
        "channels": _once(batch.channels),
        "tasks": _once(batch.task_names),
        # payloads arrive as checked JSON text (api.encode_payload): sent as text, as is
        "payloads": batch.payloads,
        "priorities": _once(batch.priorities),
        "run_at": _once(batch.run_at),
        "max_attempts": _once(batch.max_attempts),
        "keep_result": _once(batch.keep_result),
        "default_max_concurrency": defaults.max_concurrency,
        "default_release_interval": defaults.release_interval,
        "default_weight": defaults.weight,
        "default_max_backlog": defaults.max_backlog,
        "notify_channel": notify_channel,
        "delays": None if batch.delays is None else _once(batch.delays),
        "create": not create_apart and not batch.groups,
        "unique_keys": batch.unique_keys,
        "unique_scopes": None if batch.unique_scopes is None else _once(batch.unique_scopes),
        "on_conflict": None if batch.on_conflict is None else _once(batch.on_conflict),
    }
    try:
        rows = _run("enqueue_messages", params, using)
        if len(rows) < len(batch.channels):
            # Nothing was stored: a channel is missing. Its group first (if named), then the
            # channel apart, then store for real (creating inline now, should the apart
            # creation have given up on a lock).
            if batch.groups:
                channel_store.ensure_groups(batch.groups, using=using, verify=True)
            if create_apart:
                channel_store.create_channels(batch.channels, defaults=defaults, using=using)
            rows = _run("enqueue_messages", {**params, "create": True}, using)
    except Exception as exc:
        _raise_enqueue_error(exc)
        raise
    return [r[0] for r in rows]


def enqueue_message(
    message: NewMessage,
    *,
    defaults: conf.ChannelDefaults,
    notify_channel: str | None,
    using: str | None = None,
) -> int:
    """Insert one message; returns its id. :func:`enqueue_messages` for one message, with
    the same guarantees (channel creation apart inside a transaction, :class:`ChannelFull`),
    through a statement that takes scalars (``fairqueue_enqueue_one_v1``)."""
    wrapper = connections[using or conf.get().DATABASE]
    params = {
        "channel": message.channel,
        "task": message.task_name,
        "payload": message.payload,
        "priority": message.priority,
        "run_at": message.run_at,
        "max_attempts": message.max_attempts,
        "keep_result": message.keep_result,
        "default_max_concurrency": defaults.max_concurrency,
        "default_release_interval": defaults.release_interval,
        "default_weight": defaults.weight,
        "default_max_backlog": defaults.max_backlog,
        "notify_channel": notify_channel,
        "delay": message.delay,
        "create": message.group is None and not channel_store.creates_channels_apart(wrapper),
        "unique_key": message.unique_key,
        "unique_scope": None if message.unique_key is None else message.unique_scope,
        "on_conflict": None if message.unique_key is None else message.on_conflict,
    }
    statement = queries()["enqueue_message"]
    prepare = conf.get().PREPARED_STATEMENTS
    try:
        with pg.kept_cursor(using, wrapper=wrapper, values=False) as cur:
            cur.execute(statement, params, prepare=prepare, binary=True)
            row = cur.fetchone()
            if row is None or row[0] is None:
                # Nothing was stored: the channel is missing. Its group first (if named), then
                # the channel apart, then store for real (creating inline now, should the apart
                # creation have given up on a lock).
                if message.group is not None:
                    channel_store.ensure_groups([message.group], using=using, verify=True)
                if channel_store.creates_channels_apart(wrapper):
                    channel_store.create_channels([message.channel], defaults=defaults, using=using)
                cur.execute(statement, {**params, "create": True}, prepare=prepare, binary=True)
                row = cur.fetchone()
    except Exception as exc:
        _raise_enqueue_error(exc)
        raise
    assert row is not None and row[0] is not None
    return int(row[0])


def _raise_enqueue_error(exc: Exception) -> None:
    """Raise what an enqueue's error means to the caller (a full channel, an isolation level
    the bound cannot work at), from ``exc``; return for any other error."""
    full = ChannelFull.from_error(exc)
    if full is not None:
        raise full from exc
    duplicate = DuplicateJob.from_error(exc)
    if duplicate is not None:
        raise duplicate from exc
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    if getattr(cause, "sqlstate", None) == "FQ002":
        raise IsolationLevelError(cause.diag.message_primary) from exc  # type: ignore[attr-defined]


def _once(column: list[Any]) -> list[Any]:
    """``column``, or its one element when all of its elements are that one (fairqueue_enqueue_v1
    repeats a one-element array for every message)."""
    if len(column) > 1 and column.count(column[0]) == len(column):
        return column[:1]
    return column

"""The only module that runs queue SQL.

One function per named statement in ``sql/queries.sql``; each returns plain values or small
frozen dataclasses. Worker, API, admin actions and the pipeline call these, never SQL of their
own.

Statements run on the Django connection of ``FAIRQUEUE['DATABASE']``, so they join the caller's
transaction (``transaction.atomic()``) or autocommit like any ORM query. They use a psycopg
cursor with server-side binding and prepared statements (Django's default cursor binds on the
client), wrapped in Django's error translation so an error inside ``atomic()`` marks the
transaction for rollback exactly as an ORM error would.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cache
from importlib import resources
from typing import Any

import psycopg
from django.db import DatabaseError, IntegrityError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from psycopg import pq, sql
from psycopg.types.json import Jsonb, JsonbBinaryLoader

from django_fairqueue import conf
from django_fairqueue.exceptions import ChannelFull, DuplicateJob, IsolationLevelError
from django_fairqueue.queues import (
    DEFAULT_QUEUE,
    SEPARATOR,
    row_name,
    split_row_name,
    validate_queue_name,
)

logger = logging.getLogger("django_fairqueue.store")

_NEVER = 2**31
_NAME_RE = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def named_statements(package: str, resource: str) -> dict[str, str]:
    """The named statements of the SQL file ``resource`` of ``package``, by name.

    The format of sql/queries.sql: ``-- name: NAME`` starts a statement. The optional apps
    (``django_fairqueue.contrib``) keep their statements in files of their own, read with this
    and run with :func:`run_statement`.
    """
    text = resources.files(package).joinpath(resource).read_text("utf-8")
    parts = _NAME_RE.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    named = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in named:
            raise RuntimeError(f"{resource} names {name!r} twice")
        named[name] = body.strip()
    return named


@cache
def queries() -> dict[str, str]:
    """Named statements of sql/queries.sql, loaded once."""
    return named_statements("django_fairqueue", "sql/queries.sql")


def functions_sql(version: int = 1, *, part: str = "") -> str:
    """DDL of the server-side functions as the code calls them: the live ``sql/`` file.

    ``part`` names a separately versioned file: ``functions_batches_v1.sql`` for ``part="batches"``.
    Migrations never read it (each installs its own frozen copy, see ``migrations/_sql.py``);
    tests/test_migrations.py checks that a migrated database has exactly these functions.
    """
    stem = f"functions_{part}_v{version}" if part else f"functions_v{version}"
    return resources.files("django_fairqueue").joinpath(f"sql/{stem}.sql").read_text("utf-8")


@contextmanager
def _cursor(
    using: str | None = None, *, wrapper: BaseDatabaseWrapper | None = None, values: bool = True
) -> Iterator[psycopg.Cursor[Any]]:
    """A psycopg cursor on the Django connection (see the module's docstring). ``values=False``
    for statements whose results hold no jsonb: the cursor then shares the connection's
    adapters instead of copying them to register a loader (a measurable part of one enqueue)."""
    alias = using or conf.get().DATABASE
    if wrapper is None:
        wrapper = connections[alias]
    wrapper.validate_no_broken_transaction()
    with wrapper.wrap_database_errors:
        wrapper.ensure_connection()
        raw = wrapper.connection
        prepare = conf.get().PREPARED_STATEMENTS
        if prepare and raw.prepare_threshold is None:
            # Django turns psycopg's statement preparation off (threshold None), and then
            # psycopg ignores execute(prepare=True) too. A threshold no query reaches keeps
            # Django's own queries unprepared and lets ours be prepared explicitly: planning
            # a settle statement costs ~1 ms, about what executing it costs.
            raw.prepare_threshold = _NEVER
        # One cursor per connection and kind, kept for the next statement: a cursor's
        # transformer learns which dumper each parameter's type takes, and a new cursor per
        # statement learnt it again every time (about 25 us of a single enqueue's client CPU).
        # A statement run while the kept cursor is in use (a store function called inside
        # another's block) gets a cursor of its own, closed after it.
        kept: dict[bool, _KeptCursor] = wrapper.__dict__.setdefault(_KEPT_CURSORS, {})
        entry = kept.get(values)
        if entry is None or entry.connection is not raw or entry.cursor.closed:
            entry = kept[values] = _KeptCursor(raw, _new_cursor(raw, values))
        elif entry.busy:
            entry = None
        if entry is None:
            with _new_cursor(raw, values) as cur:
                yield cur
            return
        entry.busy = True
        try:
            yield entry.cursor
        finally:
            entry.busy = False


#: The attribute of a Django connection wrapper that holds its kept cursors (see _cursor).
_KEPT_CURSORS = "_fairqueue_kept_cursors"


@dataclass
class _KeptCursor:
    connection: psycopg.Connection[Any]
    cursor: psycopg.Cursor[Any]
    busy: bool = False


def _new_cursor(raw: psycopg.Connection[Any], values: bool) -> psycopg.Cursor[Any]:
    cur = psycopg.Cursor(raw)
    # Results come back in binary format: psycopg's C loaders then apply, where Django's
    # connection registers Python text loaders (timestamptz) that cost ~1.5 ms per 100
    # claimed rows. Django keeps jsonb as text for its JSONField; here we want values.
    if values:
        cur.adapters.register_loader("jsonb", JsonbBinaryLoader)
    return cur


def run_statement(
    statement: str, params: dict[str, Any], using: str | None = None
) -> list[tuple[Any, ...]]:
    """Run one statement as every function of this module runs its own (see the module's
    docstring) and return its rows ([] for a statement that returns none).

    For the named statements of the optional apps' SQL files (:func:`named_statements`); the
    queue's own statements run through the function of their name.
    """
    with _cursor(using) as cur:
        cur.execute(statement, params, prepare=conf.get().PREPARED_STATEMENTS, binary=True)
        # Not `cur.description`: it builds a Column object per result column on every call
        # (14 for a claim), a measurable share of a claim of one message's client time.
        result = cur.pgresult
        if result is None or result.status != pq.ExecStatus.TUPLES_OK:
            return []
        return cur.fetchall()


def is_lock_timeout(exc: BaseException) -> bool:
    """Whether a database error is a lock wait that ran out (SQLSTATE 55P03)."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return getattr(cause, "sqlstate", None) == "55P03"


def _run(name: str, params: dict[str, Any], using: str | None = None) -> list[tuple[Any, ...]]:
    return run_statement(queries()[name], params, using)


#: How often a statement that puts running messages back in the queue is run again after it
#: met a unique job's key taken meanwhile (see :func:`_run_back_to_queue`).
_KEY_TAKEN_RETRIES = 5


def _run_back_to_queue(
    name: str, params: dict[str, Any], using: str | None = None
) -> list[tuple[Any, ...]]:
    """Run a statement that moves messages back to the queue (fail with a retry, release,
    rescue, an operator's retry of failed ones), again if it met a unique key taken meanwhile.

    Such a statement first looks for a newer message holding a returning unique job's key
    (the returning one then ends cancelled, superseded). A holder enqueued after that look, in
    the instant before the write, makes the write fail with a unique violation of
    ``fq_message_unique_idx`` and the whole statement roll back; run again, its new snapshot
    sees the holder. Inside a transaction the statement runs in a savepoint, so the caller's
    transaction survives the first try.
    """
    alias = using or conf.get().DATABASE
    wrapper = connections[alias]
    for attempt in range(_KEY_TAKEN_RETRIES + 1):
        try:
            if wrapper.in_atomic_block:
                with transaction.atomic(using=alias):
                    return _run(name, params, using)
            return _run(name, params, using)
        except IntegrityError as exc:
            cause = exc.__cause__
            constraint = getattr(getattr(cause, "diag", None), "constraint_name", None)
            if constraint != "fq_message_unique_idx" or attempt == _KEY_TAKEN_RETRIES:
                raise
            logger.debug("%s met a unique key taken meanwhile; running it again", name)
    raise AssertionError("unreachable")  # pragma: no cover


# --------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True, slots=True)
class ClaimedMessage:
    id: int
    channel_id: int
    channel: str
    task_name: str
    payload: Any
    priority: int
    attempts: int
    max_attempts: int
    keep_result: bool
    lease_token: uuid.UUID
    lease_expires_at: datetime
    enqueued_at: datetime
    run_at: datetime
    #: the message's queue (``channel`` is the channel's name within it)
    queue: str = DEFAULT_QUEUE


def _claimed(row: tuple[Any, ...]) -> ClaimedMessage:
    """A claimed row; a channel row of another queue than the default is named
    ``<queue>\\x1f<channel>``, which becomes ``queue`` and ``channel``."""
    message = ClaimedMessage(*row)
    if SEPARATOR in message.channel:
        queue, name = split_row_name(message.channel)
        return dataclasses.replace(message, channel=name, queue=queue)
    return message


@dataclass(frozen=True, slots=True)
class RescuedMessage:
    id: int
    channel_id: int
    state: str
    task_name: str
    attempts: int
    worker_id: str


@dataclass(frozen=True, slots=True)
class ChannelCounters:
    id: int
    name: str
    ready: int
    scheduled: int
    running: int
    failed: int
    succeeded: int


@dataclass(frozen=True, slots=True)
class GroupState:
    """A channel group's limits and scheduler state (:func:`select_group_state`)."""

    id: int
    name: str
    weight: int
    max_concurrency: int | None
    release_interval: timedelta
    #: sums over the group's channels, with their counter changes not folded yet (as each
    #: channel's figures are shown)
    ready: int
    running: int
    #: channels claimable by those counters (ready messages, not paused, under their cap)
    claimable: int
    channels: int
    next_turn_at: datetime
    vtime: float
    last_claimed_at: datetime | None


def select_group_state(
    ids: Sequence[int] | None = None, *, using: str | None = None
) -> list[GroupState]:
    """The channel groups of ``ids`` (None: all), by name, with their scheduler state."""
    rows = _run("select_group_state", {"ids": None if ids is None else list(ids)}, using)
    return [GroupState(*row) for row in rows]


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


# --------------------------------------------------------------------------------------------
# Statements


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
    create_apart = _creates_channels_apart(wrapper)
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
                ensure_groups(batch.groups, using=using, verify=True)
            if create_apart:
                create_channels(batch.channels, defaults=defaults, using=using)
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
        "create": message.group is None and not _creates_channels_apart(wrapper),
        "unique_key": message.unique_key,
        "unique_scope": None if message.unique_key is None else message.unique_scope,
        "on_conflict": None if message.unique_key is None else message.on_conflict,
    }
    statement = queries()["enqueue_message"]
    prepare = conf.get().PREPARED_STATEMENTS
    try:
        with _cursor(using, wrapper=wrapper, values=False) as cur:
            cur.execute(statement, params, prepare=prepare, binary=True)
            row = cur.fetchone()
            if row is None or row[0] is None:
                # Nothing was stored: the channel is missing. Its group first (if named), then
                # the channel apart, then store for real (creating inline now, should the apart
                # creation have given up on a lock).
                if message.group is not None:
                    ensure_groups([message.group], using=using, verify=True)
                if _creates_channels_apart(wrapper):
                    create_channels([message.channel], defaults=defaults, using=using)
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


def _creates_channels_apart(wrapper: BaseDatabaseWrapper) -> bool:
    """Whether new channels must be created in a transaction of their own: inside any
    transaction, except one a Django test case opened (a test's rows roll back with it, and
    nothing else runs concurrently on its connection to deadlock with)."""
    if wrapper.get_autocommit() and not wrapper.in_atomic_block:
        return False
    blocks = wrapper.atomic_blocks
    return not (blocks and getattr(blocks[0], "_from_testcase", False))


#: Channel groups known to exist, per database alias: name -> when that was last seen (a
#: monotonic clock). A group seen less than GROUP_CACHE_SECONDS ago is not created again.
_known_groups: dict[tuple[str, str], float] = {}
GROUP_CACHE_SECONDS = 60.0


def ensure_groups(names: Sequence[str], *, using: str | None = None, verify: bool = False) -> None:
    """Create the channel groups of ``names`` that do not exist (a group takes in the existing
    channels its name declares, and every channel created later with a name
    ``"<group>/..."``). Committed at once, on a connection of its own inside a transaction,
    as new channels are: a channel created apart must see its group. Remembered for a minute
    per process, so an enqueue to a grouped channel pays this round trip about once a minute
    per group; ``verify`` makes sure of each group whatever this process remembers (before a
    channel of it is created: another process may have deleted the group meanwhile)."""
    alias = using or conf.get().DATABASE
    now = time.monotonic()
    wanted = sorted(
        n
        for n in set(names)
        if verify or now - _known_groups.get((alias, n), -1e18) > GROUP_CACHE_SECONDS
    )
    if not wanted:
        return
    wrapper = connections[alias]
    if _creates_channels_apart(wrapper):
        with _own_connection(using) as side, _cursor(side.alias, wrapper=side) as cur:
            cur.execute(queries()["ensure_groups"], {"names": wanted}, prepare=False)
    else:
        _run("ensure_groups", {"names": wanted}, using)
        if wrapper.in_atomic_block:
            return  # a test case's transaction: rolled back, so not remembered
    for n in wanted:
        _known_groups[(alias, n)] = now


def rearm_group(group_id: int, *, using: str | None = None) -> None:
    """After an operator edits a group's limits: a group waiting out a rate limit that was
    removed or shortened is due when the new limit says."""
    _run("rearm_group", {"group_id": group_id}, using)


def forget_groups() -> None:
    """Forget which channel groups exist (after one was deleted in this process)."""
    _known_groups.clear()


#: How long creating channels apart waits for a name another transaction is creating (and
#: holds until it commits) before leaving the creation to the caller's own transaction, where
#: PostgreSQL's deadlock detector sees any cycle. Without a bound, a wait on a transaction that
#: itself waits for the caller would hang both, unseen by the detector.
CREATE_CHANNELS_LOCK_TIMEOUT = "2s"


def create_channels(
    names: Sequence[str], *, defaults: conf.ChannelDefaults, using: str | None = None
) -> None:
    """Create the channels of ``names`` that do not exist, committed at once on a connection
    of its own (so no caller's transaction holds a new channel's name)."""
    params = {
        "names": sorted(set(names)),
        "default_max_concurrency": defaults.max_concurrency,
        "default_release_interval": defaults.release_interval,
        "default_weight": defaults.weight,
        "default_max_backlog": defaults.max_backlog,
        "lock_timeout": CREATE_CHANNELS_LOCK_TIMEOUT,
    }
    try:
        with _own_connection(using) as side, _cursor(side.alias, wrapper=side) as cur:
            cur.execute(queries()["create_channels"], params, prepare=False, binary=True)
    except DatabaseError as exc:
        if not is_lock_timeout(exc):
            raise


def claim_messages(
    limit: int,
    *,
    lease: timedelta,
    worker_id: str,
    only_channel_ids: Sequence[int] | None = None,
    exclude_channel_ids: Sequence[int] | None = None,
    quantum: int | None = None,
    maintain: bool = True,
    fairness: str | None = None,
    queues: Sequence[str] | None = None,
    using: str | None = None,
) -> list[ClaimedMessage]:
    """Claim up to ``limit`` messages fairly across channels, each under a fresh lease.

    A channel's turn is ``weight * quantum`` messages; ``quantum`` defaults to ``limit // 25``
    (at least 1), so a full batch spreads over about 25 channels. ``maintain=False`` skips the
    claim's housekeeping (see :func:`prepare_claims`). In a transaction of its own the claim
    may queue briefly behind a concurrent claim holding the only eligible channels (see
    :func:`_run_claim`). ``fairness`` (``"count"`` or ``"time"``) overrides the
    ``FAIRNESS`` setting: which channel comes next, by turns of messages or by worker time.
    ``queues`` limits the claim to those queues (None: every queue); several are served in
    turn, the one whose first channel has waited longest first (docs/howto/queues.md).
    """
    params = _claim_params(limit, lease, worker_id, only_channel_ids, exclude_channel_ids, quantum)
    params.update(
        maintain=maintain,
        by_time=_by_time(fairness),
        queues=None if queues is None else [validate_queue_name(q) for q in queues],
    )
    rows = _run_claim("claim_messages", params, using)
    return [_claimed(row) for row in rows]


def _claim_params(
    limit: int,
    lease: timedelta,
    worker_id: str,
    only_channel_ids: Sequence[int] | None,
    exclude_channel_ids: Sequence[int] | None,
    quantum: int | None,
) -> dict[str, Any]:
    """The claim statement's parameters."""
    return {
        "limit": limit,
        "lease": lease,
        "worker": worker_id,
        "only": list(only_channel_ids) if only_channel_ids is not None else None,
        "exclude": list(exclude_channel_ids) if exclude_channel_ids is not None else None,
        "quantum": quantum,
    }


def _by_time(fairness: str | None) -> bool:
    """Whether the claim orders channels by worker time (``fairness``, else the setting)."""
    mode = fairness if fairness is not None else conf.get().FAIRNESS
    if mode not in conf.FAIRNESS_MODES:
        raise ValueError(f"fairness must be one of {conf.FAIRNESS_MODES}, got {mode!r}")
    return mode == "time"


def _run_times(run_seconds: Sequence[float | None] | None, n: int) -> list[float | None]:
    """Run times parallel to ``n`` settled messages (None: not measured)."""
    if run_seconds is None:
        return [None] * n
    if len(run_seconds) != n:
        raise ValueError(f"run_seconds has {len(run_seconds)} entries for {n} messages")
    return [None if r is None else float(r) for r in run_seconds]


def _completion_params(
    done: Sequence[tuple[int, uuid.UUID, Any]],
    run_seconds: Sequence[float | None] | None = None,
) -> dict[str, Any]:
    """(id, lease_token, result) triples as the parallel arrays the completion takes."""
    return {
        "ids": [d[0] for d in done],
        "tokens": [d[1] for d in done],
        "results": [Jsonb(d[2]) for d in done],
        "runs": _run_times(run_seconds, len(done)),
    }


def _run_claim(name: str, params: dict[str, Any], using: str | None) -> list[tuple[Any, ...]]:
    """Run a claim statement, letting it wait for a channel when that is safe.

    A claim that finds every eligible channel locked by concurrent claims (one hot tenant,
    several claimers) queues behind the first of them for up to ``CLAIM_WAIT`` instead of
    coming back empty. Only a statement that is its own transaction may wait: a channel held
    longer than that fails the statement with SQLSTATE 55P03, which rolls its transaction back,
    and the result is no messages. Not the claim again: the channels were still held a moment ago,
    and a claim that outlasted the wait is slow already (a long transaction elsewhere bloats
    the channel index), so running another would mostly double the load. Inside a caller's
    transaction it never waits.
    """
    settings = conf.get()
    wrapper = connections[using or settings.DATABASE]
    wait_ms = math.ceil(settings.CLAIM_WAIT * 1000)
    if not (wait_ms and wrapper.get_autocommit() and not wrapper.in_atomic_block):
        return _run(name, {**params, "wait_ms": 0}, using)
    try:
        return _run(name, {**params, "wait_ms": wait_ms}, using)
    except DatabaseError as exc:
        if not is_lock_timeout(exc):
            raise
    return []


def prepare_claims(*, using: str | None = None) -> None:
    """Run the claim's housekeeping (promote due messages, fold waking deltas) and commit it.

    On a short-lived connection of its own, in autocommit: a caller about to claim inside a
    long transaction (exactly-once) does this first and then claims with ``maintain=False``, so
    its transaction never holds rows of channels it does not serve. (Opening the connection
    costs a few milliseconds; it is closed at once, so no session lingers.)
    """
    params = {"by_time": _by_time(None)}
    with _own_connection(using) as side, _cursor(side.alias, wrapper=side) as cur:
        cur.execute(queries()["prepare_claims"], params, prepare=False, binary=True)


@contextmanager
def _own_connection(using: str | None) -> Iterator[BaseDatabaseWrapper]:
    """A connection of its own, outside Django's handler, closed (its session ended) on exit."""
    wrapper = connections.create_connection(using or conf.get().DATABASE)
    try:
        yield wrapper
    finally:
        wrapper.close()


def heartbeat_messages(
    leases: Sequence[tuple[int, uuid.UUID]], *, lease: timedelta, using: str | None = None
) -> dict[int, bool]:
    """Extend leases; returns {id: abort requested} of the ids whose lease is still ours."""
    if not leases:
        return {}
    rows = _run(
        "heartbeat_messages",
        {"ids": [i for i, _ in leases], "tokens": [t for _, t in leases], "lease": lease},
        using,
    )
    return {r[0]: r[1] for r in rows}


def complete_messages(
    done: Sequence[tuple[int, uuid.UUID, Any]],
    *,
    run_seconds: Sequence[float | None] | None = None,
    using: str | None = None,
) -> set[int]:
    """Settle successes given as (id, lease_token, result); returns the ids actually settled.

    ``run_seconds``, parallel to ``done``: how long each ran (None: the time since its claim,
    on the database's clock), charged to its channel when fairness is by time.
    """
    if not done:
        return set()
    rows = _run("complete_messages", _completion_params(done, run_seconds), using)
    return {r[0] for r in rows}


def fail_messages(
    failed: Sequence[tuple[int, uuid.UUID, dict[str, Any], timedelta | None]],
    *,
    run_seconds: Sequence[float | None] | None = None,
    using: str | None = None,
) -> dict[int, str]:
    """Settle failures given as (id, token, error, retry_in); returns {id: new state}.

    ``retry_in`` is the backoff before the next attempt (None: no retry); the retry time is
    the database's clock plus it, the clock the claim compares it with.
    """
    if not failed:
        return {}
    rows = _run_back_to_queue(
        "fail_messages",
        {
            "ids": [f[0] for f in failed],
            "tokens": [f[1] for f in failed],
            "errors": [Jsonb(f[2]) for f in failed],
            "retry_in": [f[3] for f in failed],
            "runs": _run_times(run_seconds, len(failed)),
        },
        using,
    )
    return {r[0]: r[1] for r in rows}


def release_messages(
    leases: Sequence[tuple[int, uuid.UUID]], *, using: str | None = None
) -> set[int]:
    """Return unstarted claimed messages to the queue; the attempt is not counted."""
    if not leases:
        return set()
    rows = _run_back_to_queue(
        "release_messages",
        {"ids": [i for i, _ in leases], "tokens": [t for _, t in leases]},
        using,
    )
    return {r[0] for r in rows}


def rescue_expired_messages(limit: int = 1000, *, using: str | None = None) -> list[RescuedMessage]:
    """Requeue (or dead-letter) messages whose lease expired.

    For fairness by time each is charged the time since its claim, at most one lease
    (``LEASE_SECONDS``).
    """
    params = {"limit": limit, "max_charge": conf.get().LEASE_SECONDS}
    rows = _run_back_to_queue("rescue_expired_messages", params, using)
    return [RescuedMessage(*r) for r in rows]


def fold_channel_deltas(
    limit: int = 10_000, *, fairness: str | None = None, using: str | None = None
) -> int:
    params = {"limit": limit, "by_time": _by_time(fairness)}
    return int(_run("fold_channel_deltas", params, using)[0][0])


def retry_failed_messages(ids: Sequence[int], *, using: str | None = None) -> list[int]:
    """Make failed messages ready again; idempotent. Returns the ids retried now.

    A unique job whose key another message holds stays failed; a holder enqueued in the
    instant between the statement's look and its write makes it run again (see
    :func:`_run_back_to_queue`), and the second run sees the holder."""
    if not ids:
        return []
    return [r[0] for r in _run_back_to_queue("retry_failed_messages", {"ids": list(ids)}, using)]


def select_failed_message_ids(
    *,
    channel_id: int | None = None,
    after_id: int = 0,
    limit: int = 1000,
    using: str | None = None,
) -> list[int]:
    rows = _run(
        "select_failed_message_ids",
        {"channel_id": channel_id, "after_id": after_id, "limit": limit},
        using,
    )
    return [r[0] for r in rows]


def cancel_messages(ids: Sequence[int], *, using: str | None = None) -> list[int]:
    """Cancel waiting messages; returns the ids cancelled (running ones are left alone)."""
    if not ids:
        return []
    return [r[0] for r in _run("cancel_messages", {"ids": list(ids)}, using)]


def cancel_matching_messages(
    *,
    channel_id: int | None = None,
    task: str | None = None,
    queue: str | None = None,
    chunk: int = 10_000,
    using: str | None = None,
) -> list[int]:
    """Cancel the waiting messages of a channel and/or a task (within ``queue`` when given),
    ``chunk`` rows per statement (each its own statement, so a large backlog is not locked at
    once). Returns the ids."""
    cancelled: list[int] = []
    while True:
        rows = _run(
            "cancel_matching_messages",
            {"channel_id": channel_id, "task": task, "queue": queue, "limit": chunk},
            using,
        )
        cancelled.extend(r[0] for r in rows)
        if len(rows) < chunk:
            return cancelled


def select_running_message_ids(
    *,
    channel_id: int | None = None,
    task: str | None = None,
    queue: str | None = None,
    using: str | None = None,
) -> list[int]:
    """Ids of the running messages of a channel and/or a task (within ``queue`` when given)."""
    params = {"channel_id": channel_id, "task": task, "queue": queue}
    return [r[0] for r in _run("select_running_message_ids", params, using)]


def abort_messages(ids: Sequence[int], *, using: str | None = None) -> dict[int, str]:
    """Cancel the waiting messages of ``ids`` and request an abort of the running ones;
    returns {id: "cancelled" or "abort_requested"} (finished or unknown ids are left out)."""
    if not ids:
        return {}
    return {r[0]: r[1] for r in _run("abort_messages", {"ids": sorted(set(ids))}, using)}


def settle_aborted_messages(
    aborted: Sequence[tuple[int, uuid.UUID, dict[str, Any]]], *, using: str | None = None
) -> set[int]:
    """Settle attempts stopped by an abort, given as (id, token, error); returns the ids
    settled (a lost lease settles nothing)."""
    if not aborted:
        return set()
    rows = _run(
        "settle_aborted_messages",
        {
            "ids": [a[0] for a in aborted],
            "tokens": [a[1] for a in aborted],
            "errors": [Jsonb(a[2]) for a in aborted],
        },
        using,
    )
    return {r[0] for r in rows}


def delete_messages(ids: Sequence[int], *, using: str | None = None) -> list[int]:
    """Delete messages that are not running; returns the ids deleted."""
    if not ids:
        return []
    return [r[0] for r in _run("delete_messages", {"ids": list(ids)}, using)]


def purge_channel_backlog(channel_id: int, *, chunk: int = 10_000, using: str | None = None) -> int:
    """Delete every waiting message of a channel, in bounded chunks; returns how many."""
    total = 0
    while True:
        n = int(
            _run("purge_channel_backlog", {"channel_id": channel_id, "limit": chunk}, using)[0][0]
        )
        total += n
        if n < chunk:
            return total


def prune_finished_messages(
    before: datetime, *, limit: int = 10_000, using: str | None = None
) -> int:
    return len(_run("prune_finished_messages", {"before": before, "limit": limit}, using))


def prune_unique_holds(*, limit: int = 10_000, using: str | None = None) -> int:
    """Delete up to ``limit`` hold rows of unique keys whose message is gone or finished for
    good; returns how many."""
    return len(_run("prune_unique_holds", {"limit": limit}, using))


def select_channel_counters(
    ids: Sequence[int], *, using: str | None = None
) -> list[ChannelCounters]:
    if not ids:
        return []
    rows = _run("select_channel_counters", {"ids": list(ids)}, using)
    return [
        ChannelCounters(r[0], r[1], int(r[2]), int(r[3]), int(r[4]), int(r[5]), int(r[6]))
        for r in rows
    ]


@dataclass(frozen=True, slots=True)
class ChannelSummary:
    """A channel's configuration the listings show, and its exact counts."""

    id: int
    name: str
    weight: int
    paused: bool
    max_concurrency: int | None
    ready: int
    scheduled: int
    running: int
    failed: int
    succeeded: int


def select_all_channel_counts(*, using: str | None = None) -> list[ChannelSummary]:
    """Every channel with its counters plus pending deltas (one statement)."""
    return [ChannelSummary(*r) for r in _run("select_all_channel_counts", {}, using)]


@dataclass(frozen=True, slots=True)
class WindowStats:
    """A channel's statistics summed over a window of minutes."""

    channel_id: int
    claimed: int
    succeeded: int
    #: failed for good (dead letters)
    failed: int
    #: failed and will run again
    retried: int
    #: of ``failed`` and ``retried``, the attempts that ran out of time
    timed_out: int


def select_channel_window_stats(
    since: datetime, ids: Sequence[int] | None = None, *, using: str | None = None
) -> list[WindowStats]:
    """Per channel with statistics since ``since`` (of ``ids``, or all): the window's sums."""
    if ids is not None:
        return select_window_stats_of_channels(since, ids, using=using)
    return [WindowStats(*r) for r in _run("select_channel_window_stats", {"since": since}, using)]


def select_window_stats_of_channels(
    since: datetime, ids: Sequence[int], *, using: str | None = None
) -> list[WindowStats]:
    """:func:`select_channel_window_stats` for the channels of ``ids`` only."""
    if not ids:
        return []
    params = {"since": since, "ids": list(ids)}
    return [WindowStats(*r) for r in _run("select_window_stats_of_channels", params, using)]


@dataclass(frozen=True, slots=True)
class ChannelMinuteStats:
    """Tallies of one channel for one minute, as flushed by a worker."""

    channel_id: int
    minute: datetime
    claimed: int = 0
    succeeded: int = 0
    failed: int = 0
    retried: int = 0
    wait_ms_sum: int = 0
    wait_ms_max: int = 0
    wait_histogram: tuple[int, ...] = ()
    run_ms_sum: int = 0
    #: of ``failed`` and ``retried``, the attempts that ran out of time (time limit, or an
    #: expired lease rescued)
    timed_out: int = 0


def record_channel_stats(stats: Sequence[ChannelMinuteStats], *, using: str | None = None) -> None:
    """Add per-(channel, minute) tallies to the statistics table (one upsert), their sums
    per minute to the per-minute table (a second upsert), and their usage per channel and hour
    (:func:`record_usage`), in one transaction."""
    if not stats:
        return
    alias = using or conf.get().DATABASE
    with transaction.atomic(using=alias):
        _run(
            "record_channel_stats",
            {
                "channel_ids": [x.channel_id for x in stats],
                "minutes": [x.minute for x in stats],
                "claimed": [x.claimed for x in stats],
                "succeeded": [x.succeeded for x in stats],
                "failed": [x.failed for x in stats],
                "retried": [x.retried for x in stats],
                "wait_ms_sum": [x.wait_ms_sum for x in stats],
                "wait_ms_max": [x.wait_ms_max for x in stats],
                "histograms": [Jsonb(list(x.wait_histogram)) for x in stats],
                "run_ms_sum": [x.run_ms_sum for x in stats],
                "timed_out": [x.timed_out for x in stats],
            },
            alias,
        )
        record_minute_stats(stats, using=alias)
        record_usage(stats, using=alias)  # per tenant and hour, for billing (after: lock order)


def record_minute_stats(stats: Sequence[ChannelMinuteStats], *, using: str | None = None) -> None:
    """Add the sums per minute of these tallies (all their channels together) to the
    per-minute table. :func:`record_channel_stats` calls it in its transaction, after writing
    the channel rows (the lock order of the two statements)."""
    if not stats:
        return
    totals: dict[datetime, list[Any]] = {}
    for x in stats:
        t = totals.get(x.minute)
        if t is None:
            t = totals[x.minute] = [0, 0, 0, 0, 0, 0, 0, [], 0]
        for i, value in enumerate(
            (x.claimed, x.succeeded, x.failed, x.retried, x.timed_out, x.wait_ms_sum)
        ):
            t[i] += value
        t[6] = max(t[6], x.wait_ms_max)
        histogram = t[7]
        if len(histogram) < len(x.wait_histogram):
            histogram.extend([0] * (len(x.wait_histogram) - len(histogram)))
        for i, n in enumerate(x.wait_histogram):
            histogram[i] += n
        t[8] += x.run_ms_sum
    minutes = sorted(totals)
    columns = list(zip(*(totals[m] for m in minutes), strict=True))
    _run(
        "record_minute_stats",
        {
            "minutes": minutes,
            "claimed": list(columns[0]),
            "succeeded": list(columns[1]),
            "failed": list(columns[2]),
            "retried": list(columns[3]),
            "timed_out": list(columns[4]),
            "wait_ms_sum": list(columns[5]),
            "wait_ms_max": list(columns[6]),
            "histograms": [Jsonb(h) for h in columns[7]],
            "run_ms_sum": list(columns[8]),
        },
        using,
    )


def prune_channel_stats(before: datetime, *, using: str | None = None) -> None:
    _run("prune_channel_stats", {"before": before}, using)


def fold_deltas_of_channel(channel_id: int, *, using: str | None = None) -> int:
    """Fold one channel's pending counter deltas into its row now; returns how many.

    Waits for a claim holding the channel row (claims are short). Call it after changing a
    channel's limits: a cap added to a busy channel must count the completions not folded
    yet, or the channel looks full until the maintenance loop folds them; a rate limit
    removed must not leave its next turn in the future.
    """
    rows = _run("fold_deltas_of_channel", {"channel_id": channel_id}, using)
    return int(rows[0][0]) if rows else 0


@dataclass(frozen=True, slots=True)
class CounterDrift:
    """A channel counter that disagrees with the rows it counts (``kind`` "group": a channel
    group's sum that disagrees with its channels' counters; ``channel_id`` and ``channel`` are
    then the group's)."""

    channel_id: int
    channel: str
    counter: str
    recorded: int
    actual: int
    kind: str = "channel"


def verify_channel_counters(
    ids: Sequence[int] | None = None, *, using: str | None = None
) -> list[CounterDrift]:
    """Counters (of the channels of ``ids``, or of all) that disagree with their messages and
    work batches. Read-only and lock-free: one snapshot sees every writer's rows and counters
    together (a scan of the queue's waiting and running rows)."""
    rows = _run("verify_channel_counters", {"ids": list(ids) if ids is not None else None}, using)
    return [CounterDrift(*r) for r in rows]


def repair_channel_counters(ids: Sequence[int], *, using: str | None = None) -> list[CounterDrift]:
    """Recount the channels of ``ids`` from their rows, each under its row lock (waits for a
    claim holding it). Returns what was wrong at that moment."""
    if not ids:
        return []
    return [CounterDrift(*r) for r in _run("repair_channel_counters", {"ids": list(ids)}, using)]


def verify_group_counters(
    ids: Sequence[int] | None = None, *, using: str | None = None
) -> list[CounterDrift]:
    """Channel groups (of ``ids``, or all) whose sums (ready, running, claimable channels)
    disagree with their channels' counters. Read-only and lock-free, one snapshot."""
    rows = _run("verify_group_counters", {"ids": list(ids) if ids is not None else None}, using)
    return [CounterDrift(r[0], r[1], r[2], r[3], r[4], kind="group") for r in rows]


#: The sums of a group, as verify_group_counters names them, and set_group_sums' arrays.
_GROUP_SUMS = {"ready": "ready", "running": "running", "claimable channels": "claimable"}


def repair_group_counters(ids: Sequence[int], *, using: str | None = None) -> list[CounterDrift]:
    """Recount the sums of the groups of ``ids`` from their channels, under the groups' row
    locks (the recount is a statement after the lock, so it sees every channel change
    committed before it). Returns what was wrong at that moment."""
    if not ids:
        return []
    with transaction.atomic(using=using or conf.get().DATABASE):
        lock_groups(ids, using=using)
        drift = verify_group_counters(sorted(ids), using=using)
        fixed: dict[int, dict[str, int]] = {}
        for d in drift:
            fixed.setdefault(d.channel_id, {})[_GROUP_SUMS[d.counter]] = d.actual
        if fixed:
            set_group_sums(fixed, using=using)
    return drift


def set_group_sums(sums: Mapping[int, Mapping[str, int]], *, using: str | None = None) -> None:
    """Write recounted sums, {group id: {"ready"/"running"/"claimable": value}} (a sum left
    out stays), of groups this transaction has locked (:func:`lock_groups`)."""
    _run(
        "set_group_sums",
        {
            "ids": list(sums),
            **{a: [s.get(a) for s in sums.values()] for a in _GROUP_SUMS.values()},
        },
        using,
    )


def lock_groups(ids: Sequence[int], *, using: str | None = None) -> list[int]:
    """Lock the channel groups of ``ids`` until the transaction ends (in id order, waiting);
    returns the ids of those that exist."""
    return [r[0] for r in _run("lock_groups", {"ids": sorted(ids)}, using)]


def verify_unique_holds(*, using: str | None = None) -> list[CounterDrift]:
    """Channels whose unique jobs of scope ``active`` that hold their key (waiting or running)
    are not all named by their key's hold row (``recorded``: how many are, ``actual``: how many
    there are). Without its row, a running one would not keep its key. Read-only, lock-free."""
    return [CounterDrift(*r) for r in _run("verify_unique_holds", {}, using)]


def repair_unique_holds(ids: Sequence[int], *, using: str | None = None) -> list[int]:
    """Give the unnamed holders of the channels ``ids`` their keys' hold rows (unless another
    live holder is named: two messages hold the key, left to the operator). Returns the ids of
    the messages now named."""
    if not ids:
        return []
    return [int(r[0]) for r in _run("repair_unique_holds", {"ids": list(ids)}, using)]


def verify_orphans(*, using: str | None = None) -> dict[str, int]:
    """{table: rows whose channel no longer exists}."""
    return {table: int(n) for table, n in _run("verify_orphans", {}, using)}


def repair_orphans(*, using: str | None = None) -> dict[str, int]:
    """Delete the rows :func:`verify_orphans` counts; returns {table: rows deleted}."""
    return {table: int(n) for table, n in _run("repair_orphans", {}, using)}


def lock_channel_names(names: Sequence[str], *, using: str | None = None) -> None:
    """Hold channel names against enqueues until the current transaction ends: deleting a
    channel takes this first, so an enqueue in flight finishes (and its messages are deleted
    with the channel) and a later one creates the channel anew."""
    if names:
        _run("lock_channel_names", {"names": list(names)}, using)


def share_channel_name(name: str, *, using: str | None = None) -> None:
    """Take channel ``name``'s lock as an enqueue does, shared, until the transaction ends: a
    transaction that will enqueue to it takes it first when it locks other rows before its
    enqueue that deleting the channel locks too (the lock order's rank 1 comes first)."""
    _run("share_channel_name", {"name": name}, using)


def select_channel_ids(names: Sequence[str], *, using: str | None = None) -> dict[str, int]:
    if not names:
        return {}
    return {name: cid for cid, name in _run("select_channel_ids", {"names": list(names)}, using)}


def select_channel_ids_in_queues(
    names: Sequence[str], queues: Sequence[str] | None, *, using: str | None = None
) -> list[tuple[int, str, str]]:
    """``(id, queue, name)`` of the channel rows of ``names`` in ``queues`` (None: all)."""
    if not names:
        return []
    if queues is not None:  # the rows' names are known: index lookups
        rows = [row_name(q, n) for q in queues for n in names]
        return [
            (cid, *split_row_name(row))
            for row, cid in select_channel_ids(rows, using=using).items()
        ]
    params = {"names": list(names), "queues": None}
    return [(r[0], r[1], r[2]) for r in _run("select_channel_ids_in_queues", params, using)]


def delete_failed_messages(ids: Sequence[int], *, using: str | None = None) -> list[int]:
    """Delete failed messages (dead letters) only; returns the ids deleted."""
    if not ids:
        return []
    return [r[0] for r in _run("delete_failed_messages", {"ids": list(ids)}, using)]


def listen_wakeups(conn: psycopg.Connection[Any], channel: str) -> None:
    """LISTEN on ``channel`` with ``conn``: a dedicated autocommit connection, never Django's.

    The channel name is quoted as an identifier (it cannot be a bound parameter).
    """
    conn.execute(sql.SQL(queries()["listen_wakeups"]).format(channel=sql.Identifier(channel)))


def select_channel_oldest_ready(
    ids: Sequence[int], *, using: str | None = None
) -> dict[int, datetime]:
    """{channel id: since when its longest-waiting ready message is ready}, for the channels
    of ``ids`` that have ready messages (one index probe per priority level in use)."""
    if not ids:
        return {}
    return dict(_run("select_channel_oldest_ready", {"ids": list(ids)}, using))


def select_backlogged_oldest_ready(*, using: str | None = None) -> dict[int, datetime]:
    """:func:`select_channel_oldest_ready` of every channel with ready messages (found by its
    counters in the same statement)."""
    return dict(_run("select_backlogged_oldest_ready", {}, using))


def select_channel_retrying(ids: Sequence[int], *, using: str | None = None) -> dict[int, int]:
    """{channel id: messages waiting out a retry's backoff}, for the channels of ``ids`` that
    have any. Reads the retries of these channels only (``fq_message_retrying_idx``); pass those
    with scheduled > 0."""
    if not ids:
        return {}
    return {cid: int(n) for cid, n in _run("select_channel_retrying", {"ids": list(ids)}, using)}


def retry_failed_work_batches(ids: Sequence[int], *, using: str | None = None) -> list[int]:
    """Set failed work batches back to pending with attempts 0; idempotent. Returns the ids
    retried now."""
    if not ids:
        return []
    return [r[0] for r in _run("retry_failed_work_batches", {"ids": list(ids)}, using)]


def select_next_due(
    horizon: timedelta,
    *,
    only_channel_ids: Sequence[int] | None = None,
    exclude_channel_ids: Sequence[int] | None = None,
    queues: Sequence[str] | None = None,
    using: str | None = None,
) -> float | None:
    """Seconds until a claim with these channel filters could take a message that none can take
    now (a rate-limited channel's next turn, a scheduled message's run_at), if within
    ``horizon``; None if nothing is due by then. Negative when it is due already. No locks."""
    params = {
        "horizon": horizon,
        "only": list(only_channel_ids) if only_channel_ids is not None else None,
        "exclude": list(exclude_channel_ids) if exclude_channel_ids is not None else None,
        "queues": list(queues) if queues is not None else None,
    }
    due_in = _run("select_next_due", params, using)[0][0]
    return None if due_in is None else float(due_in)


# --------------------------------------------------------------------------------------------
# Work batches (django_fairqueue.batches)


@dataclass(frozen=True, slots=True)
class ClaimedBatch:
    """A work batch claimed under a lease. ``attempts`` counts this attempt (1-based)."""

    id: int
    channel_id: int
    channel: str
    job_name: str
    start_id: int
    end_id: int
    row_count: int
    attempts: int
    max_attempts: int
    lease_token: uuid.UUID
    lease_expires_at: datetime


@dataclass(frozen=True, slots=True)
class SourceColumn:
    """A source table's id column, as found in the catalog."""

    schema: str
    table: str
    type: str


@dataclass(frozen=True, slots=True)
class IdWindow:
    """One window of a walk over a source table's id index: how many ids, first and last."""

    count: int
    first_id: int
    last_id: int


@dataclass(frozen=True, slots=True)
class RescuedBatch:
    id: int
    job_name: str
    state: str
    worker_id: str
    attempts: int


@dataclass(frozen=True, slots=True)
class JobRow:
    """One job's batches and rows by state, straight from select_job_progress."""

    job_name: str
    channel: str | None
    batches_total: int
    pending: int
    running: int
    succeeded: int
    failed: int
    rows_total: int
    rows_done: int
    rows_written: int
    planned_at: datetime | None
    started_at: datetime | None
    last_finished_at: datetime | None
    now: datetime


def ensure_channel(name: str, *, defaults: conf.ChannelDefaults, using: str | None = None) -> int:
    """The id of channel ``name``, created with ``defaults`` if it does not exist."""
    params = {
        "name": name,
        "default_max_concurrency": defaults.max_concurrency,
        "default_release_interval": defaults.release_interval,
        "default_weight": defaults.weight,
        "default_max_backlog": defaults.max_backlog,
    }
    return int(_run("ensure_channel", params, using)[0][0])


def select_table_column(
    table: str, column: str, *, schema: str | None = None, using: str | None = None
) -> SourceColumn | None:
    """Where ``table``'s ``column`` lives and its type; None when the table or column is missing."""
    rows = _run("select_table_column", {"table": table, "column": column, "schema": schema}, using)
    return SourceColumn(*rows[0]) if rows else None


def lock_plan(job: str, *, using: str | None = None) -> None:
    """Take the job's planning lock until the end of the current transaction."""
    _run("lock_plan", {"job": job}, using)


def select_last_planned_batch(job: str, *, using: str | None = None) -> tuple[int, int] | None:
    """(channel id, end id) of the job's last planned batch, or None for a new job."""
    rows = _run("select_last_planned_batch", {"job": job}, using)
    return (int(rows[0][0]), int(rows[0][1])) if rows else None


def _source_sql(
    text: str, source: SourceColumn, column: str, filters: Sequence[str]
) -> sql.Composed:
    """A statement over a source table with its identifiers quoted and filter values bound."""
    conditions = sql.SQL("").join(
        sql.SQL(" AND t.{} = {}").format(sql.Identifier(f), sql.Placeholder(f"f{i}"))
        for i, f in enumerate(filters)
    )
    return sql.SQL(text).format(
        table=sql.Identifier(source.schema, source.table),
        id=sql.Identifier(column),
        filters=conditions,
    )


def _run_source(
    text: str,
    source: SourceColumn,
    column: str,
    filters: dict[str, Any],
    params: dict[str, Any],
    using: str | None,
) -> list[tuple[Any, ...]]:
    statement = _source_sql(text, source, column, list(filters))
    bound = {**params, **{f"f{i}": value for i, value in enumerate(filters.values())}}
    with _cursor(using) as cur:
        cur.execute(statement, bound, binary=True)
        return cur.fetchall()


def walk_id_index(
    source: SourceColumn,
    column: str,
    *,
    start: int,
    size: int,
    steps: int,
    filters: dict[str, Any],
    using: str | None = None,
) -> list[IdWindow]:
    """Up to ``steps`` consecutive windows of ``size`` ids from ``start`` (under ``filters``);
    only the last may be short, and an exhausted table gives fewer (or none)."""
    params = {"from": start, "size": size, "steps": steps}
    rows = _run_source(queries()["walk_id_index"], source, column, filters, params, using)
    return [IdWindow(*r) for r in rows]


def select_id_span(
    source: SourceColumn, column: str, *, filters: dict[str, Any], using: str | None = None
) -> tuple[int | None, int | None]:
    """Lowest and highest id of the source table under ``filters`` (None, None when empty)."""
    rows = _run_source(queries()["select_id_span"], source, column, filters, {}, using)
    return rows[0][0], rows[0][1]


def insert_planned_batches(
    *,
    channel_id: int,
    job: str,
    ranges: Sequence[tuple[int, int, int]],
    max_attempts: int,
    using: str | None = None,
) -> tuple[int, int]:
    """Insert planned (start, end, rows) ranges; ranges the job already has are skipped.
    Returns (batches added, rows they cover)."""
    params = {
        "channel_id": channel_id,
        "job": job,
        "starts": [r[0] for r in ranges],
        "ends": [r[1] for r in ranges],
        "counts": [r[2] for r in ranges],
        "max_attempts": max_attempts,
    }
    added, rows = _run("insert_planned_batches", params, using)[0]
    return int(added), int(rows)


def claim_work_batch(
    *,
    worker: str,
    lease: timedelta,
    jobs: Sequence[str] | None = None,
    job_prefixes: Sequence[str] | None = None,
    only: Sequence[int] | None = None,
    exclude: Sequence[int] | None = None,
    using: str | None = None,
) -> ClaimedBatch | None:
    """Claim one batch fairly across channels (fairqueue_claim_batch_v1); None if none can run."""
    params = {
        "worker": worker,
        "lease": lease,
        "jobs": list(jobs) if jobs is not None else None,
        "job_prefixes": list(job_prefixes) if job_prefixes is not None else None,
        "only": list(only) if only is not None else None,
        "exclude": list(exclude) if exclude is not None else None,
    }
    rows = _run("claim_work_batch", params, using)
    return ClaimedBatch(*rows[0]) if rows else None


def heartbeat_work_batch(
    batch_id: int, token: uuid.UUID, *, lease: timedelta, using: str | None = None
) -> datetime | None:
    """Extend the lease; returns the new expiry, or None when the lease is lost."""
    rows = _run("heartbeat_work_batch", {"id": batch_id, "token": token, "lease": lease}, using)
    return rows[0][0] if rows else None


def lock_leased_work_batch(batch_id: int, token: uuid.UUID, *, using: str | None = None) -> bool:
    """Lock the batch until commit if it still runs under ``token``."""
    return bool(_run("lock_leased_work_batch", {"id": batch_id, "token": token}, using))


def complete_work_batch(
    batch_id: int, token: uuid.UUID, *, rows: int, using: str | None = None
) -> bool:
    """Mark the batch succeeded under ``token``; False when the lease was lost."""
    return bool(_run("complete_work_batch", {"id": batch_id, "token": token, "rows": rows}, using))


def fail_work_batch(
    batch_id: int,
    token: uuid.UUID,
    *,
    error: dict[str, Any],
    retry_in: timedelta,
    final: bool = False,
    using: str | None = None,
) -> str | None:
    """Record a failed attempt; returns the new state, or None when the lease was lost."""
    params = {
        "id": batch_id,
        "token": token,
        "error": Jsonb(error),
        "retry_in": retry_in,
        "final": final,
    }
    rows = _run("fail_work_batch", params, using)
    return str(rows[0][0]) if rows else None


def release_work_batch(batch_id: int, token: uuid.UUID, *, using: str | None = None) -> bool:
    """Give the batch back without using an attempt; False when the lease was lost."""
    return bool(_run("release_work_batch", {"id": batch_id, "token": token}, using))


def rescue_expired_work_batches(
    *,
    backoff_base: timedelta,
    backoff_max: timedelta,
    limit: int = 1000,
    using: str | None = None,
) -> list[RescuedBatch]:
    """Return expired leases to pending (after a backoff) or failed (out of attempts)."""
    params = {"limit": limit, "backoff_base": backoff_base, "backoff_max": backoff_max}
    return [RescuedBatch(*r) for r in _run("rescue_expired_work_batches", params, using)]


def prune_finished_work_batches(before: datetime, *, using: str | None = None) -> int:
    """Delete the batches of jobs that fully succeeded before ``before``; returns the count."""
    with _cursor(using) as cur:
        cur.execute(queries()["prune_finished_work_batches"], {"before": before})
        return max(cur.rowcount, 0)


def delete_failed_work_batches(ids: Sequence[int], *, using: str | None = None) -> list[int]:
    """Delete failed batches; ids in other states are left alone. Returns the ids deleted."""
    if not ids:
        return []
    return [r[0] for r in _run("delete_failed_work_batches", {"ids": list(ids)}, using)]


def select_failed_work_batch_ids(job: str | None = None, *, using: str | None = None) -> list[int]:
    """Ids of failed batches of ``job`` (or of every job)."""
    return [r[0] for r in _run("select_failed_work_batch_ids", {"job": job}, using)]


def select_job_progress(
    *, job: str | None = None, prefix: str | None = None, using: str | None = None
) -> list[JobRow]:
    """Per-job batch and row tallies (one job, a name prefix, or all)."""
    rows = _run("select_job_progress", {"job": job, "prefix": prefix}, using)
    return [JobRow(*r) for r in rows]


# --------------------------------------------------------------------------------------------
# Worker registry (django_fairqueue.registry)


@dataclass(frozen=True, slots=True)
class DeadWorker:
    worker_id: str
    host: str
    pid: int
    silent_seconds: float
    leases_expired: int


def register_worker(
    worker_id: str,
    *,
    host: str,
    pid: int,
    version: str,
    concurrency: int,
    channels: Sequence[str],
    exclude_channels: Sequence[str],
    queues: Sequence[str] | None = None,
    using: str | None = None,
) -> int:
    """Record a worker as running; returns the leases of a predecessor with its id it expired.
    ``queues``: the queues it serves, None for every queue."""
    params = {
        "worker_id": worker_id,
        "host": host,
        "pid": pid,
        "version": version,
        "concurrency": concurrency,
        "channels": Jsonb(list(channels)),
        "exclude_channels": Jsonb(list(exclude_channels)),
        "queues": None if queues is None else Jsonb(list(queues)),
    }
    return int(_run("register_worker", params, using)[0][0])


def beat_worker(
    worker_id: str,
    *,
    running: int,
    handled: int,
    last_claim_at: datetime | None,
    using: str | None = None,
) -> None:
    params = {
        "worker_id": worker_id,
        "running": running,
        "handled": handled,
        "last_claim_at": last_claim_at,
    }
    _run("beat_worker", params, using)


def deregister_worker(worker_id: str, *, handled: int, using: str | None = None) -> None:
    _run("deregister_worker", {"worker_id": worker_id, "handled": handled}, using)


def expire_dead_workers(dead_after: float, *, using: str | None = None) -> list[DeadWorker]:
    """Mark workers silent for ``dead_after`` seconds dead and expire their leases."""
    rows = _run("expire_dead_workers", {"dead_after": timedelta(seconds=dead_after)}, using)
    return [DeadWorker(r[0], r[1], int(r[2]), float(r[3]), int(r[4])) for r in rows]


def prune_workers(before: datetime, *, using: str | None = None) -> None:
    _run("prune_workers", {"before": before}, using)


# --------------------------------------------------------------------------------------------
# Why something waits (django_fairqueue.waiting)


@dataclass(frozen=True, slots=True)
class ChannelWaitState:
    name: str
    paused: bool
    max_concurrency: int | None
    release_interval: timedelta
    next_turn_at: datetime
    ready: int
    running: int
    now: datetime
    ahead: int
    oldest_running_since: datetime | None
    claimed_recently: int
    #: its channel group (None: ungrouped) and the group's limits, as the claim checks them
    group: str | None = None
    group_max_concurrency: int | None = None
    group_running: int = 0
    group_release_interval: timedelta = timedelta(0)
    group_next_turn_at: datetime | None = None


def select_channel_wait_state(
    channel_id: int, *, using: str | None = None
) -> ChannelWaitState | None:
    params = {"channel_id": channel_id, "by_time": _by_time(None)}
    rows = _run("select_channel_wait_state", params, using)
    if not rows:
        return None
    r = rows[0]
    return ChannelWaitState(
        r[0],
        r[1],
        r[2],
        r[3],
        r[4],
        int(r[5]),
        int(r[6]),
        r[7],
        int(r[8]),
        r[9],
        int(r[10]),
        r[11],
        r[12],
        int(r[13] or 0),
        r[14] if r[14] is not None else timedelta(0),
        r[15],
    )


def select_messages_ahead(
    channel_id: int, priority: int, message_id: int, *, using: str | None = None
) -> int:
    params = {"channel_id": channel_id, "priority": priority, "id": message_id}
    return int(_run("select_messages_ahead", params, using)[0][0])


def select_clock(*, using: str | None = None) -> datetime:
    return _run("select_clock", {}, using)[0][0]  # type: ignore[no-any-return]


def select_abort_pending_count(*, using: str | None = None) -> int:
    """Running messages asked to abort that have not stopped yet."""
    return int(_run("select_abort_pending_count", {}, using)[0][0])


def select_stale_lease_count(*, using: str | None = None) -> int:
    return int(_run("select_stale_lease_count", {}, using)[0][0])


# --------------------------------------------------------------------------------------------
# Periodic schedules (django_fairqueue.schedules)


@dataclass(frozen=True, slots=True)
class DueSchedule:
    id: int
    name: str
    channel: str
    task_name: str
    args: Any
    kwargs: Any
    cron: str
    timezone: str
    missed: str
    catch_up_max: int
    jitter: timedelta
    priority: int | None
    enabled: bool
    spec: str
    fired_spec: str | None
    next_fire_at: datetime | None
    last_slot_at: datetime | None
    now: datetime


@dataclass(frozen=True, slots=True)
class ScheduleState:
    id: int
    next_fire_at: datetime | None
    last_slot_at: datetime | None
    last_fired_at: datetime | None
    last_message_id: int | None
    current: bool


def select_due_schedules(
    limit: int, *, skip_tasks: Sequence[str] = (), using: str | None = None
) -> list[DueSchedule]:
    rows = _run("select_due_schedules", {"limit": limit, "skip_tasks": list(skip_tasks)}, using)
    return [DueSchedule(*row) for row in rows]


def select_next_schedule_fire(
    *, skip_tasks: Sequence[str] = (), using: str | None = None
) -> float | None:
    """Seconds until a schedule is due (0: now), or None when no schedule is enabled."""
    value = _run("select_next_schedule_fire", {"skip_tasks": list(skip_tasks)}, using)[0][0]
    return None if value is None else float(value)


def claim_schedule_slots(
    schedule_id: int, slots: Sequence[datetime], *, using: str | None = None
) -> list[datetime]:
    params = {"schedule_id": schedule_id, "slots": list(slots)}
    return [row[0] for row in _run("claim_schedule_slots", params, using)]


def advance_schedule(
    schedule: DueSchedule,
    *,
    slots: Sequence[datetime],
    message_ids: Sequence[int],
    last_slot: datetime | None,
    next_fire_at: datetime | None,
    using: str | None = None,
) -> bool:
    """Record the messages of the ``slots`` this pass took, its ``last_slot`` (the newest it
    handled) and ``next_fire_at``, if the row is as ``schedule`` read it; False if not."""
    params = {
        "schedule_id": schedule.id,
        "slots": list(slots),
        "message_ids": list(message_ids),
        "next_fire_at": next_fire_at,
        "last_slot": last_slot,
        "last_message_id": message_ids[-1] if message_ids else None,
        "spec": schedule.spec,
        "seen_fired_spec": schedule.fired_spec,
        "seen_next": schedule.next_fire_at,
        "seen_last": schedule.last_slot_at,
    }
    return bool(_run("advance_schedule", params, using))


def advance_schedules_without_slots(
    rows: Sequence[tuple[DueSchedule, datetime | None]], *, using: str | None = None
) -> list[int]:
    """Write each schedule's next slot (no slot fired) if its row is as read and not held by
    another transaction; returns the ids written."""
    params = {
        "ids": [s.id for s, _ in rows],
        "next": [n for _, n in rows],
        "specs": [s.spec for s, _ in rows],
        "seen_fired": [s.fired_spec for s, _ in rows],
        "seen_next": [s.next_fire_at for s, _ in rows],
        "seen_last": [s.last_slot_at for s, _ in rows],
    }
    return [row[0] for row in _run("advance_schedules_without_slots", params, using)]


def select_schedule_states(
    ids: Sequence[int], *, using: str | None = None
) -> dict[int, ScheduleState]:
    rows = _run("select_schedule_states", {"ids": list(ids)}, using)
    return {row[0]: ScheduleState(*row) for row in rows}


#: Longest wait for the schedule sync's lock (another process syncing, or frozen mid-sync).
SCHEDULE_SYNC_LOCK_TIMEOUT = "5s"


def lock_schedule_sync(*, using: str | None = None) -> None:
    """Take the schedule sync's lock for this transaction; raises ``OperationalError``
    (SQLSTATE 55P03, see :func:`is_lock_timeout`) after ``SCHEDULE_SYNC_LOCK_TIMEOUT``."""
    _run("lock_schedule_sync", {"lock_timeout": SCHEDULE_SYNC_LOCK_TIMEOUT}, using)


def prune_schedule_fires(before: datetime, *, limit: int = 10_000, using: str | None = None) -> int:
    with _cursor(using, values=False) as cur:
        cur.execute(
            queries()["prune_schedule_fires"],
            {"before": before, "limit": limit},
            prepare=conf.get().PREPARED_STATEMENTS,
            binary=True,
        )
        return cur.rowcount


# --------------------------------------------------------------------------------------------
# Per-tenant usage (django_fairqueue.usage) and expired leases per channel (the admin)


def hour_of(moment: datetime) -> datetime:
    """``moment`` truncated to its hour, in UTC: the key of a usage row."""
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


#: The figures of a usage row, in the order of the record_usage_* statements' arrays.
USAGE_FIGURES = ("attempts", "succeeded", "failures", "timeouts", "worker_ms")


def _usage_sums(rows: Iterable[tuple[Any, Sequence[int]]]) -> dict[Any, list[int]]:
    """The figures of ``(key, figures)`` pairs summed per key."""
    sums: dict[Any, list[int]] = {}
    for key, figures in rows:
        total = sums.setdefault(key, [0] * len(USAGE_FIGURES))
        for i, value in enumerate(figures):
            total[i] += value
    return sums


def _usage_params(sums: dict[Any, list[int]], keys: list[Any]) -> dict[str, list[int]]:
    columns = list(zip(*(sums[k] for k in keys), strict=True))
    return {name: list(columns[i]) for i, name in enumerate(USAGE_FIGURES)}


def record_usage(stats: Sequence[ChannelMinuteStats], *, using: str | None = None) -> None:
    """Add the usage of a statistics flush per (channel, hour) and per channel: attempts
    settled, succeeded, failed (timeouts among them) and worker time. Called by
    :func:`record_channel_stats` in its transaction, after the minute rows (the lock order)."""
    hours = _usage_sums(
        (
            (hour_of(x.minute), x.channel_id),
            (
                x.succeeded + x.failed + x.retried,
                x.succeeded,
                x.failed + x.retried,
                x.timed_out,
                x.run_ms_sum,
            ),
        )
        for x in stats
        if x.succeeded + x.failed + x.retried or x.run_ms_sum  # claims alone: nothing settled
    )
    if not hours:
        return
    record_usage_hours(hours, using=using)
    record_usage_totals(
        _usage_sums((cid, figures) for (_, cid), figures in hours.items()), using=using
    )


def record_usage_hours(
    hours: dict[tuple[datetime, int], list[int]], *, using: str | None = None
) -> None:
    """Add {(hour, channel id): figures (USAGE_FIGURES)} to the usage hours, in key order."""
    keys = sorted(hours)
    params = {"hours": [h for h, _ in keys], "channel_ids": [c for _, c in keys]}
    _run("record_usage_hours", {**params, **_usage_params(hours, keys)}, using)


def record_usage_totals(totals: dict[int, list[int]], *, using: str | None = None) -> None:
    """Add {channel id: figures (USAGE_FIGURES)} to the channels' totals, in id order."""
    ids = sorted(totals)
    _run("record_usage_totals", {"channel_ids": ids, **_usage_params(totals, ids)}, using)


def prune_usage(before: datetime, *, using: str | None = None) -> None:
    _run("prune_usage", {"before": before}, using)


def select_expired_leases_by_channel(*, using: str | None = None) -> dict[int, int]:
    """{channel id: running messages whose lease expired}, for the channels with any."""
    return {int(cid): int(n) for cid, n in _run("select_expired_leases_by_channel", {}, using)}


def set_worker_supervisor(worker_id: str, supervisor: str, *, using: str | None = None) -> None:
    _run("set_worker_supervisor", {"worker_id": worker_id, "supervisor": supervisor}, using)

"""Messages from claim to settlement, and what operators and maintenance do to them.

The claim (:func:`claim_messages`, returning :class:`ClaimedMessage`), heartbeats, the
settlements (complete, fail, release, abort), the rescue of expired leases, wake-ups, and the
actions on waiting or failed messages (cancel, abort, retry, delete, purge, prune). Inserting
messages is :mod:`django_fairqueue.db.enqueue_store`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from django.db import DatabaseError, IntegrityError, connections, transaction
from psycopg import sql
from psycopg.types.json import Jsonb

from django_fairqueue import conf
from django_fairqueue.db import channel_store, jsontext, pg
from django_fairqueue.queues import (
    DEFAULT_QUEUE,
    SEPARATOR,
    split_row_name,
    validate_queue_name,
)

queries = pg.StatementFile("django_fairqueue.db", "statements/messages.sql")
_run = queries.run
logger = logging.getLogger("django_fairqueue.db.message_store")


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
    async_commit: bool = False,
    durable_tasks: Sequence[str] = (),
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
    ``async_commit``: a claim that is its own transaction commits without waiting for its WAL
    flush, unless it hands out a message of one of ``durable_tasks`` (at-most-once tasks, whose
    lost claim would run them twice); inside a caller's transaction it is ignored. See
    ``FAIRQUEUE['ASYNC_COMMIT']``.
    """
    params = _claim_params(limit, lease, worker_id, only_channel_ids, exclude_channel_ids, quantum)
    params.update(
        maintain=maintain,
        by_time=channel_store.fairness_by_time(fairness),
        queues=None if queues is None else [validate_queue_name(q) for q in queues],
        async_except=(
            list(durable_tasks) if async_commit and pg.statement_is_transaction(using) else None
        ),
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
        # one JSON array (see the statement); big floats written to come back as floats
        "results": Jsonb([d[2] for d in done], dumps=jsontext.dumps),
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
    wait_ms = math.ceil(conf.get().CLAIM_WAIT * 1000)
    if not (wait_ms and pg.statement_is_transaction(using)):
        return _run(name, {**params, "wait_ms": 0}, using)
    try:
        return _run(name, {**params, "wait_ms": wait_ms}, using)
    except DatabaseError as exc:
        if not pg.is_lock_timeout(exc):
            raise
    return []


def prepare_claims(*, using: str | None = None) -> None:
    """Run the claim's housekeeping (promote due messages, fold waking deltas) and commit it.

    On a short-lived connection of its own, in autocommit: a caller about to claim inside a
    long transaction (exactly-once) does this first and then claims with ``maintain=False``, so
    its transaction never holds rows of channels it does not serve. (Opening the connection
    costs a few milliseconds; it is closed at once, so no session lingers.)
    """
    params = {"by_time": channel_store.fairness_by_time(None)}
    with (
        pg.own_connection(using) as side,
        pg.kept_cursor(side.alias, wrapper=side) as cur,
    ):
        cur.execute(queries()["prepare_claims"], params, prepare=False, binary=True)


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
    async_commit: bool = False,
    using: str | None = None,
) -> set[int]:
    """Settle successes given as (id, lease_token, result); returns the ids actually settled.

    ``run_seconds``, parallel to ``done``: how long each ran (None: the time since its claim,
    on the database's clock), charged to its channel when fairness is by time.
    ``async_commit``: a completion that is its own transaction commits without waiting for its
    WAL flush (lost in a database crash, its message is rescued when its lease expires, as if
    its worker had crashed); inside a caller's transaction it is ignored.
    """
    if not done:
        return set()
    params = _completion_params(done, run_seconds)
    params["async_commit"] = async_commit and pg.statement_is_transaction(using)
    rows = _run("complete_messages", params, using)
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
    leases: Sequence[tuple[int, uuid.UUID]],
    *,
    delays: Sequence[timedelta | None] | None = None,
    using: str | None = None,
) -> set[int]:
    """Return claimed messages to the queue; the attempt is not counted. With ``delays``
    (one per lease, None: none), each waits that long before it can be claimed again."""
    if not leases:
        return set()
    params = {
        "ids": [i for i, _ in leases],
        "tokens": [t for _, t in leases],
        "delays": list(delays) if delays is not None else [None] * len(leases),
    }
    rows = _run_back_to_queue("release_messages", params, using)
    return {r[0] for r in rows}


def rescue_expired_messages(
    limit: int = 1000, *, at_most_once: Sequence[str] = (), using: str | None = None
) -> list[RescuedMessage]:
    """Requeue (or dead-letter) messages whose lease expired.

    For fairness by time each is charged the time since its claim, at most one lease
    (``LEASE_SECONDS``). A message of a task named in ``at_most_once`` is dead-lettered
    whatever attempts its row allows (the task's delivery now, not at its enqueue).
    """
    params = {
        "limit": limit,
        "max_charge": conf.get().LEASE_SECONDS,
        "at_most_once": list(at_most_once),
    }
    rows = _run_back_to_queue("rescue_expired_messages", params, using)
    return [RescuedMessage(*r) for r in rows]


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
    returns {id: "cancelled" or "abort_requested"} (finished or unknown ids are left out).
    With ``NOTIFY`` on, the workers holding the running ones are told at commit
    (:data:`ABORT_NOTICE` and the worker id), for their heartbeats to read the request."""
    if not ids:
        return {}
    cfg = conf.get()
    channel = cfg.NOTIFY_CHANNEL if cfg.NOTIFY else None
    params = {"ids": sorted(set(ids)), "channel": channel}
    return {r[0]: r[1] for r in _run("abort_messages", params, using)}


#: What starts the payload of an abort's notification; the worker id follows.
ABORT_NOTICE = "fairqueue abort "


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


def select_next_due(
    horizon: timedelta,
    *,
    only_channel_ids: Sequence[int] | None = None,
    exclude_channel_ids: Sequence[int] | None = None,
    queues: Sequence[str] | None = None,
    rescuing: bool = False,
    using: str | None = None,
) -> float | None:
    """Seconds until a claim with these channel filters could take a message that none can take
    now (a rate-limited channel's next turn, a scheduled message's run_at; ``rescuing``: a
    running message whose lease expired, which the caller's rescuer takes back), if within
    ``horizon``; None if nothing is due by then. Negative when it is due already. No locks."""
    params = {
        "horizon": horizon,
        "rescuing": rescuing,
        "only": list(only_channel_ids) if only_channel_ids is not None else None,
        "exclude": list(exclude_channel_ids) if exclude_channel_ids is not None else None,
        "queues": list(queues) if queues is not None else None,
    }
    due_in = _run("select_next_due", params, using)[0][0]
    return None if due_in is None else float(due_in)


def select_messages_ahead(
    channel_id: int, priority: int, message_id: int, *, using: str | None = None
) -> int:
    params = {"channel_id": channel_id, "priority": priority, "id": message_id}
    return int(_run("select_messages_ahead", params, using)[0][0])


def select_abort_pending_count(*, using: str | None = None) -> int:
    """Running messages asked to abort that have not stopped yet."""
    return int(_run("select_abort_pending_count", {}, using)[0][0])


def select_stale_lease_count(*, using: str | None = None) -> int:
    return int(_run("select_stale_lease_count", {}, using)[0][0])


def notify_probe(channel: str, payload: str, *, using: str | None = None) -> None:
    """Send ``payload`` on ``channel`` from Django's connection, as an enqueue notifies."""
    _run("notify_probe", {"channel": channel, "payload": payload}, using)


def select_expired_leases_by_channel(*, using: str | None = None) -> dict[int, int]:
    """{channel id: running messages whose lease expired}, for the channels with any."""
    return {int(cid): int(n) for cid, n in _run("select_expired_leases_by_channel", {}, using)}

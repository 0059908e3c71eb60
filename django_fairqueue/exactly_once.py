"""Exactly-once processing: claim messages inside your own transaction.

The claim, your writes and the completion commit together, or not at all::

    from django.db import transaction
    from django_fairqueue import exactly_once

    with transaction.atomic():
        with exactly_once.batch(limit=50, channels=["alice"]) as batch:
            for message in batch:
                Invoice.objects.create(order_id=message.payload["args"][0])
        # leaving the block completes every message not failed or released

If anything raises inside the ``batch`` block, its savepoint rolls back: the messages return to
the queue as they were (the claim, its attempt and its counters undone) and your writes inside
the block are undone with them. A later rollback of the outer transaction does the same.

Exactly once holds for effects *in this database, in this transaction*. A side effect outside
it (an e-mail, an HTTP call) can still happen twice if the transaction rolls back after it.

While the transaction is open it holds the row locks of the claimed messages and of the
channels the claim served; other claimers skip those channels (they never wait) until you
commit, so keep these transactions short. See docs/howto/exactly-once.md.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, transaction

from django_fairqueue import conf, limits
from django_fairqueue.db import channel_store, message_store, pg
from django_fairqueue.db.message_store import ClaimedMessage
from django_fairqueue.exceptions import FairQueueError, IsolationLevelError, LeaseLost
from django_fairqueue.queues import validate_queue_name
from django_fairqueue.runtime.attempts import error_info
from django_fairqueue.stats import StatsRecorder
from django_fairqueue.tasks.spec import check_result

__all__ = ["Batch", "TransactionRequired", "batch"]


class TransactionRequired(FairQueueError, RuntimeError):
    """``exactly_once.batch()`` was used outside ``transaction.atomic()``."""


class Batch:
    """The messages one :func:`batch` claimed, and what to do with each when the block ends.

    Iterate it for the :class:`~django_fairqueue.db.message_store.ClaimedMessage` objects (``id``,
    ``channel``, ``task_name``, ``payload``, ``attempts``, ...). Each message is completed when
    the block exits normally unless you :meth:`fail` or :meth:`release` it first;
    :meth:`complete` sets the result a ``keep_result`` message stores.
    """

    def __init__(
        self, messages: Sequence[ClaimedMessage], lease: timedelta, worker_id: str
    ) -> None:
        self.messages: tuple[ClaimedMessage, ...] = tuple(messages)
        self._lease = lease
        self._worker_id = worker_id
        self._claimed = time.monotonic()
        self._by_id = {m.id: m for m in self.messages}
        self._results: dict[int, Any] = {}
        self._failed: dict[int, tuple[dict[str, Any], timedelta | None]] = {}
        self._released: set[int] = set()
        self._open = True

    def __iter__(self) -> Iterator[ClaimedMessage]:
        return iter(self.messages)

    def __len__(self) -> int:
        return len(self.messages)

    def __bool__(self) -> bool:
        return bool(self.messages)

    def complete(self, message: ClaimedMessage, result: Any = None) -> None:
        """Complete ``message`` with ``result`` (JSON; stored only if it keeps results).

        A result to be stored that JSON cannot hold raises
        :class:`~django_fairqueue.exceptions.ResultNotStorable` (a ``TypeError``) here, and
        the message stays unmarked (left so, it completes with ``None`` when the block ends):
        complete it with a value JSON can hold, or :meth:`fail` it (an exception leaving the
        block rolls the claim back instead).
        """
        self._decide(message)
        if message.keep_result:
            check_result(
                message.task_name,
                result,
                then=f"message {message.id} is not marked (left so, it completes with None "
                "when the block ends; raised out of the block, this error rolls the claim "
                "back): complete it with a value JSON can hold, or fail it",
            )
        self._results[message.id] = result if message.keep_result else None

    def fail(
        self, message: ClaimedMessage, error: BaseException, *, retry_in: timedelta | None = None
    ) -> None:
        """Fail ``message`` with ``error`` (its type, message and traceback are recorded).

        Without ``retry_in`` it becomes a dead letter now (see :mod:`django_fairqueue.failures`).
        With it, it runs again after that delay while it has attempts left.
        """
        if not isinstance(error, BaseException):
            raise TypeError(f"error must be an exception, got {type(error).__name__}")
        if retry_in is not None:
            if not isinstance(retry_in, timedelta):
                raise TypeError(f"retry_in must be a timedelta or None, got {retry_in!r}")
            if retry_in < timedelta(0):
                raise ValueError(f"retry_in must not be negative, got {retry_in!r}")
        self._decide(message)
        # Recorded as a worker records a failed attempt, so that failures list and retry
        # treat both alike (and an exception whose __str__ raises cannot fail the batch).
        recorded = error_info(error, attempt=message.attempts, worker_id=self._worker_id)
        self._failed[message.id] = (recorded, retry_in)

    def release(self, message: ClaimedMessage) -> None:
        """Give ``message`` back unprocessed: ready again, the attempt not counted."""
        self._decide(message)
        self._released.add(message.id)

    def _decide(self, message: ClaimedMessage) -> None:
        if not self._open:
            raise RuntimeError("this batch is settled: its block has ended")
        if self._by_id.get(getattr(message, "id", -1)) is not message:
            raise ValueError(f"{message!r} is not a message of this batch")
        if (
            message.id in self._results
            or message.id in self._failed
            or message.id in self._released
        ):
            raise ValueError(f"message {message.id} was already completed, failed or released")

    def _settle(self, using: str) -> None:
        self._open = False
        released = [(m.id, m.lease_token) for m in self.messages if m.id in self._released]
        failed = [
            (m.id, m.lease_token, *self._failed[m.id])
            for m in self.messages
            if m.id in self._failed
        ]
        done = [
            (m.id, m.lease_token, self._results.get(m.id))
            for m in self.messages
            if m.id not in self._released and m.id not in self._failed
        ]
        settled = len(message_store.release_messages(released, using=using))
        failed_states = message_store.fail_messages(failed, using=using)
        settled += len(failed_states)
        settled += len(message_store.complete_messages(done, using=using))
        # This transaction holds the rows since the claim, so nobody can have taken them.
        # If it happens anyway, raising rolls the block back rather than commit half of it.
        if settled != len(self.messages):
            raise LeaseLost(
                f"settled {settled} of the {len(self.messages)} messages this batch claimed"
            )
        self._record_stats(using, done, failed_states)

    def _record_stats(
        self, using: str, done: Sequence[tuple[int, Any, Any]], failed_states: dict[int, str]
    ) -> None:
        """Count the claim and its outcomes in the statistics, as a worker's are, once the
        caller's transaction commits (a rollback undoes them, so nothing is counted). Written
        after the commit, in a statement of its own: the statistics rows of a minute are
        shared with the workers, whose writes must not wait for this transaction. A released
        message is counted as claimed only, as a worker's is. Each message is charged an equal
        share of the block's time (its run time is not measured)."""
        if not self.messages:
            return
        recorder = StatsRecorder(using=using)
        recorder.record_claimed(self.messages, self.messages[0].lease_expires_at - self._lease)
        run_ms = 1000.0 * (time.monotonic() - self._claimed) / len(self.messages)
        channel = {m.id: m.channel_id for m in self.messages}
        recorder.record_settled_many(
            [(channel[d[0]], "succeeded", run_ms, False) for d in done]
            + [
                (channel[i], "failed" if state == "failed" else "retried", run_ms, False)
                for i, state in failed_states.items()
            ]
        )
        transaction.on_commit(recorder.flush, using=using, robust=True)


@contextmanager
def batch(
    limit: int = 100,
    *,
    channels: Sequence[str] | None = None,
    exclude_channels: Sequence[str] | None = None,
    queues: Sequence[str] | None = None,
    worker_id: str | None = None,
    using: str | None = None,
) -> Iterator[Batch]:
    """Claim up to ``limit`` messages, fairly across channels, inside the open transaction.

    Must run inside ``transaction.atomic()`` (on ``FAIRQUEUE['DATABASE']``, or ``using``);
    raises :class:`TransactionRequired` otherwise, and
    :class:`~django_fairqueue.exceptions.IsolationLevelError` if that transaction is not at
    READ COMMITTED. ``queues`` limits the claim to those queues
    (None: every queue), as ``runfairworker --queues`` does. ``channels`` limits it to the
    channels of those names in those queues (unknown names match nothing),
    ``exclude_channels`` skips some. The block is a
    savepoint: an exception inside it rolls back the claim and your writes in it, even if you
    catch the exception outside the block. On normal exit every message is settled.

    The claim may return fewer than ``limit`` messages, or none: channels locked by another
    transaction are skipped, and channel limits (concurrency, rate) apply as for workers.
    """
    try:
        limits.limit(limit)
    except TypeError as exc:  # callers may pass anything; a ValueError as before
        raise ValueError(str(exc)) from None
    alias = using or conf.get().DATABASE
    if not connections[alias].in_atomic_block:
        raise TransactionRequired(_outside_atomic(alias))
    limits.not_one_name(channels, "channels", "channel")
    limits.not_one_name(exclude_channels, "exclude_channels", "channel")
    limits.not_one_name(queues, "queues", "queue")
    if queues is not None:
        queues = [validate_queue_name(q) for q in queues]
    if worker_id is not None:
        limits.worker_id(worker_id)
    worker_id = worker_id or _default_worker_id()
    _require_read_committed(alias)
    lease = conf.get().lease
    with transaction.atomic(using=alias):
        only = _channel_ids(channels, queues, alias) if channels is not None else None
        exclude = _channel_ids(exclude_channels, queues, alias) if exclude_channels else None
        if only == []:
            messages: list[ClaimedMessage] = []  # none of the channels exists: nothing to claim
        else:
            # Housekeeping in a short transaction of its own, then a claim without it: this
            # transaction must lock only the channels it serves (the claim would otherwise fold
            # other channels' counters and hold their rows until the caller commits).
            message_store.prepare_claims(using=alias)
            messages = message_store.claim_messages(
                limit,
                lease=lease,
                worker_id=worker_id,
                only_channel_ids=only,
                exclude_channel_ids=exclude,
                queues=queues,
                maintain=False,
                using=alias,
            )
        claimed = Batch(messages, lease, worker_id)
        try:
            yield claimed
        except BaseException:
            claimed._open = False  # rolled back: nothing of it is to be settled any more
            raise
        claimed._settle(alias)


_WHY_ATOMIC = (
    "the claim, your writes and the completion have to commit together (or roll back together)"
)


def _outside_atomic(alias: str) -> str:
    """What batch() says outside a transaction of ``alias``: with the queue in a database of its
    own, an atomic() on ``default`` is not the queue's, so the message names the one to open."""
    if alias == DEFAULT_DB_ALIAS:
        return f"exactly_once.batch() must run inside transaction.atomic(): {_WHY_ATOMIC}"
    return (
        f"exactly_once.batch() must run inside transaction.atomic(using={alias!r}): "
        f"{_WHY_ATOMIC}; the queue is in database {alias!r}, so only your writes to that "
        "database are in its transaction"
    )


def _require_read_committed(alias: str) -> None:
    """Refuse a transaction at another isolation level than READ COMMITTED: its snapshot
    cannot see what other claimers committed meanwhile, so the claim would come back empty
    or fail with a serialization error even with no other claimer about."""
    level = pg.select_isolation_level(using=alias)
    if level != "read committed":
        raise IsolationLevelError(
            f"exactly_once.batch() claims only in READ COMMITTED transactions; this one is "
            f"{level.upper()}: open it at READ COMMITTED (PostgreSQL's default)"
        )


def _channel_ids(names: Sequence[str], queues: Sequence[str] | None, alias: str) -> list[int]:
    """The ids of the channels of ``names`` in ``queues`` (None: in every queue)."""
    rows = channel_store.select_channel_ids_in_queues(list(names), queues, using=alias)
    return sorted(cid for cid, _queue, _name in rows)


def _default_worker_id() -> str:
    return f"exactly-once@{socket.gethostname()}:{os.getpid()}"[:200]

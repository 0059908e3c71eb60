"""The settler: writes outcomes back in batches, each fenced by its lease token.

It takes outcomes from the queue the pool and the timer put them on: every completion waiting
in one ``complete_messages``, every failure in one ``fail_messages``, releases and aborts
likewise; a database error on a value PostgreSQL refuses is isolated by writing the group one
by one. After a connection error it retries with backoff (the lease token fences a write that
reached the database twice); at shutdown, until its deadline (the end of the grace period), its
last try at the deadline itself; what is still unwritten then is counted in ``unwritten``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from collections.abc import Callable

from django.db import DatabaseError
from django.utils import timezone

from django_fairqueue import conf
from django_fairqueue.db import message_store
from django_fairqueue.runtime import (
    CONNECTION_ERRORS,
    Backoff,
    after_database_error,
    drop_broken_connection,
)
from django_fairqueue.runtime.attempts import RESCUED, error_info
from django_fairqueue.stats import StatsRecorder
from django_fairqueue.worker.config import (
    SETTLE_BATCH,
    STATS_FLUSH_SECONDS,
    STATS_OUTCOME,
    Outcome,
)
from django_fairqueue.worker.execution import log_extra, savepoints
from django_fairqueue.worker.ledger import Ledger
from django_fairqueue.worker.service import Service

logger = logging.getLogger("django_fairqueue.worker")


def _run_seconds(group: list[Outcome]) -> list[float | None]:
    """How long each attempt ran, on the handler's monotonic clock (a timed-out attempt: until
    the worker gave up on it, its time limit); None where nothing was measured (the database
    then charges the time since the claim). Fairness by time charges it to the channel."""
    return [o.duration if o.duration > 0 else None for o in group]


class Settler(Service):
    """Writes the outcomes put on ``outcomes`` (None: write what is left, then stop).

    ``on_settled(freed)`` is called after each write; ``freed`` when completions or failures
    were written: a freed slot can make a capped channel claimable again, and a retry without
    backoff is ready now.
    """

    name = "settler"

    def __init__(
        self,
        ledger: Ledger,
        outcomes: queue.SimpleQueue[Outcome | None],
        *,
        worker_id: str,
        on_settled: Callable[[bool], None] = lambda freed: None,
    ) -> None:
        super().__init__()
        self.ledger = ledger
        self.outcomes = outcomes
        self.worker_id = worker_id
        self.on_settled = on_settled
        #: per-channel statistics and usage, written by :meth:`flush_stats` (every few
        #: seconds while the worker runs, and at the end of each synchronous pass)
        self.stats: StatsRecorder | None = None
        #: once stopped: retry a write that fails for the database until this time
        #: (time.monotonic()), then give up; None: until it succeeds
        self.deadline: float | None = None
        #: outcomes given up at the deadline (never written: their leases recover them)
        self.unwritten = 0
        self._backlog: list[Outcome] = []
        self._closed = False

    def stop(self, deadline: float | None = None) -> None:
        """Write what is waiting, then stop, retrying through a database outage until
        ``deadline`` (time.monotonic(); None: until written)."""
        self.deadline = deadline
        self.stopping.set()  # (wakes a retry's sleep: from now on the deadline bounds it)
        self.outcomes.put(None)

    def run(self) -> None:
        backoff = Backoff()
        next_flush = time.monotonic() + STATS_FLUSH_SECONDS
        while self._backlog or not self._closed:
            try:
                self.run_once(timeout=max(0.01, next_flush - time.monotonic()))
            except CONNECTION_ERRORS as exc:
                what = after_database_error(exc)
                delay = self._retry_in(backoff)
                if delay is None:
                    self._give_up(what)
                    return
                logger.warning(
                    "writing %d outcomes failed: %s; retry in %.2fs",
                    len(self._backlog),
                    what,
                    delay,
                )
                if self.stopping.is_set():
                    time.sleep(delay)
                else:
                    self.stopping.wait(delay)
                continue
            backoff.reset()
            drop_broken_connection()
            if self._closed or time.monotonic() >= next_flush:
                self.flush_stats()
                next_flush = time.monotonic() + STATS_FLUSH_SECONDS

    def _retry_in(self, backoff: Backoff) -> float | None:
        """Seconds until the next try of a write that failed; None once stopped and past the
        deadline. The last sleep ends at the deadline itself, so a database back within the
        grace period still gets the outcomes."""
        delay = backoff.next()
        if not self.stopping.is_set() or self.deadline is None:
            return delay
        left = self.deadline - time.monotonic()
        return min(delay, left) if left > 0 else None

    def _give_up(self, what: str) -> None:
        """Count what is left (the backlog and what still waits on the queue), log it, drop it."""
        with contextlib.suppress(queue.Empty):
            while not self._closed:
                self._take(self.outcomes.get_nowait())
        self.unwritten += len(self._backlog)
        logger.error(
            "giving up writing %d outcomes at shutdown: the grace period ended (%s); their "
            "leases will expire and the rescuer will take them back (%s)",
            len(self._backlog),
            what,
            RESCUED,
            extra={"worker_id": self.worker_id, "outcome": "unwritten"},
        )
        self._backlog.clear()

    def run_once(self, timeout: float = 0.0) -> int:
        """Take the waiting outcomes (up to a batch; waiting up to ``timeout`` seconds for the
        first) and write them; returns how many were written. Connection errors propagate,
        the outcomes kept for the next call."""
        if not self._backlog and not self._closed and timeout > 0:
            with contextlib.suppress(queue.Empty):
                self._take(self.outcomes.get(timeout=timeout))
        while not self._closed and len(self._backlog) < SETTLE_BATCH:
            try:
                self._take(self.outcomes.get_nowait())
            except queue.Empty:
                break
        before = len(self._backlog)
        if self._backlog:
            self.settle(self._backlog)
        return before - len(self._backlog)

    def _take(self, item: Outcome | None) -> None:
        if item is None:
            self._closed = True
        else:
            self._backlog.append(item)

    def flush_stats(self) -> None:
        """Write the statistics tallied so far; a connection error keeps them for the next
        flush, another database error turns statistics off for this worker."""
        stats = self.stats
        if stats is None or not stats.pending():
            return
        try:
            stats.flush()  # on failure it keeps the tallies for the next flush
        except CONNECTION_ERRORS as exc:
            what = after_database_error(exc)
            logger.warning("writing statistics failed: %s; kept for the next try", what)
        except DatabaseError:
            logger.exception("writing statistics failed; statistics are off for this worker")
            self.stats = None

    def settle(self, outcomes: list[Outcome], *, savepoint: bool = False) -> None:
        """Write outcomes back: completions, failures and releases, one statement each.

        Outcomes written are removed from ``outcomes``; after a connection error the list holds
        exactly those still to write, so the caller can retry (the lease token fences a write
        that reached the database twice). Another database error (a value PostgreSQL refuses)
        is isolated by writing the group one by one.
        """
        groups: list[tuple[str, list[Outcome]]] = [
            ("complete", [o for o in outcomes if o.kind == "succeeded"]),
            ("fail", [o for o in outcomes if o.kind in ("retry", "failed")]),
            ("release", [o for o in outcomes if o.kind == "released"]),
            ("abort", [o for o in outcomes if o.kind == "aborted"]),
        ]
        for verb, group in groups:
            if not group:
                continue
            ids = {o.message.id for o in group}
            self.ledger.begin_write(ids)
            try:
                written = self._write(verb, group, savepoint)
                outcomes[:] = [o for o in outcomes if o.message.id not in ids]
                self._after_write(verb, group, written)
            finally:
                self.ledger.end_write(ids)

    def _write(self, verb: str, group: list[Outcome], savepoint: bool) -> dict[int, str]:
        """Write one kind of outcome; returns {id: new state} of the rows actually changed."""
        try:
            with savepoints() if savepoint else contextlib.nullcontext():
                return self._write_statement(verb, group)
        except CONNECTION_ERRORS:
            raise
        except DatabaseError as exc:
            if len(group) > 1:
                written: dict[int, str] = {}
                for outcome in group:
                    written.update(self._write(verb, [outcome], savepoint))
                return written
            outcome = group[0]
            if verb != "complete":
                logger.error(
                    "could not record the %s of message %s (%s); its lease will expire",
                    verb,
                    outcome.message.id,
                    exc,
                )
                return {}
            # The result is what PostgreSQL refused: record the attempt as failed instead.
            failed = Outcome(
                outcome.message,
                "failed",
                error=error_info(exc, attempt=outcome.message.attempts, worker_id=self.worker_id),
                duration=outcome.duration,
            )
            return self._write("fail", [failed], savepoint)

    def _write_statement(self, verb: str, group: list[Outcome]) -> dict[int, str]:
        if verb == "complete":
            done = message_store.complete_messages(
                [(o.message.id, o.message.lease_token, o.result) for o in group],
                run_seconds=_run_seconds(group),
                async_commit=conf.get().ASYNC_COMMIT,
            )
            return {i: "succeeded" for i in done}
        if verb == "fail":
            return message_store.fail_messages(
                [(o.message.id, o.message.lease_token, o.error or {}, o.retry_in) for o in group],
                run_seconds=_run_seconds(group),
            )
        if verb == "abort":
            aborted = message_store.settle_aborted_messages(
                [(o.message.id, o.message.lease_token, o.error or {}) for o in group]
            )
            return {i: "aborted" for i in aborted}
        released = message_store.release_messages(
            [(o.message.id, o.message.lease_token) for o in group],
            delays=[o.retry_in for o in group],  # given back after a database outage: a delay
        )
        return {i: "ready" for i in released}

    def _after_write(self, verb: str, group: list[Outcome], written: dict[int, str]) -> None:
        stats = self.stats
        if stats is not None and verb != "release":  # a release gives back an attempt not run
            stats.record_settled_many(
                [
                    (
                        o.message.channel_id,
                        # an aborted attempt counts for the worker time it used
                        "aborted" if o.kind == "aborted" else STATS_OUTCOME[o.kind],
                        o.duration * 1000.0,
                        o.timed_out,
                    )
                    for o in group
                    if o.message.id in written and (o.kind in STATS_OUTCOME or o.kind == "aborted")
                ],
                at=timezone.now(),  # one clock reading for the group
            )
        self.ledger.settled(group, count=verb != "release")
        self.on_settled(bool(written) and verb != "release")
        if verb == "fail":
            _log_not_retried(group, written)
        ignored = [o.message.id for o in group if o.message.id not in written]
        if ignored:
            logger.warning(
                "%s of %d messages changed nothing: their lease was lost (it expired and the "
                "rescuer took them back: %s; or an operator cancelled or deleted them, or "
                "their channel was deleted); ids %s",
                verb,
                len(ignored),
                RESCUED,
                ignored[:20],
                extra={"worker_id": self.worker_id, "outcome": "lease_lost"},
            )


#: why the database ended a failed attempt otherwise than the worker's log line said ("retry in")
_NOT_RETRIED = {
    "cancelled": "another message took its unique key while it ran, so it ends cancelled "
    "(superseded by that message)",
    "aborted": "an abort was requested while it ran, so it ends aborted",
}


def _log_not_retried(group: list[Outcome], written: dict[int, str]) -> None:
    for outcome in group:
        why = _NOT_RETRIED.get(written.get(outcome.message.id, ""))
        if outcome.kind == "retry" and why is not None:
            message = outcome.message
            logger.warning(
                "did not retry %s message %s channel %r: %s",
                message.task_name,
                message.id,
                message.channel,
                why,
                extra=log_extra(message, outcome=written[message.id]),
            )

"""The settler: writes outcomes back in batches, each fenced by its lease token."""

from __future__ import annotations

import contextlib
import logging
import queue
import time

from django.db import DatabaseError
from django.utils import timezone

from django_fairqueue._runtime import (
    CONNECTION_ERRORS,
    Backoff,
    after_database_error,
    drop_broken_connection,
)
from django_fairqueue.attempts import error_info
from django_fairqueue.db import message_store
from django_fairqueue.worker.base import WorkerBase
from django_fairqueue.worker.config import (
    _STATS_OUTCOME,
    SETTLE_BATCH,
    STATS_FLUSH_SECONDS,
    Outcome,
)
from django_fairqueue.worker.execution import (
    _savepoints,
)

logger = logging.getLogger("django_fairqueue.worker")


def _run_seconds(group: list[Outcome]) -> list[float | None]:
    """How long each attempt ran, on the handler's monotonic clock (a timed-out attempt: until
    the worker gave up on it, its time limit); None where nothing was measured (the database
    then charges the time since the claim). Fairness by time charges it to the channel."""
    return [o.duration if o.duration > 0 else None for o in group]


class Settler(WorkerBase):
    """The settler: writes outcomes back in batches, each fenced by its lease token."""

    def _settler_loop(self) -> None:
        backlog: list[Outcome] = []
        stopping = False
        backoff = Backoff()
        next_flush = time.monotonic() + STATS_FLUSH_SECONDS
        while backlog or not stopping:
            if not backlog:
                try:
                    item = self._outcomes.get(timeout=max(0.01, next_flush - time.monotonic()))
                except queue.Empty:
                    pass
                else:
                    if item is None:
                        stopping = True
                    else:
                        backlog.append(item)
            while not stopping and len(backlog) < SETTLE_BATCH:
                try:
                    item = self._outcomes.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                else:
                    backlog.append(item)
            if backlog:
                try:
                    self.settle(backlog)
                except CONNECTION_ERRORS as exc:
                    what = after_database_error(exc)
                    delay = backoff.next()
                    deadline = self._settle_deadline
                    if deadline is not None and time.monotonic() + delay > deadline:
                        logger.error(
                            "giving up writing %d outcomes at shutdown (%s); their leases "
                            "will expire and the rescuer will requeue them",
                            len(backlog),
                            what,
                        )
                        return
                    logger.warning(
                        "writing %d outcomes failed: %s; retry in %.2fs",
                        len(backlog),
                        what,
                        delay,
                    )
                    time.sleep(delay)
                    continue
                backoff.reset()
                drop_broken_connection()
            if stopping or time.monotonic() >= next_flush:
                self._flush_stats()
                next_flush = time.monotonic() + STATS_FLUSH_SECONDS

    def _flush_stats(self) -> None:
        stats = self._stats
        if stats is None or not stats.pending():
            return
        try:
            stats.flush()  # on failure it keeps the tallies for the next flush
        except CONNECTION_ERRORS as exc:
            what = after_database_error(exc)
            logger.warning("writing statistics failed: %s; kept for the next try", what)
        except DatabaseError:
            logger.exception("writing statistics failed; statistics are off for this worker")
            self._stats = None

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
            with self._cond:
                self._settling |= ids
            written = self._write(verb, group, savepoint)
            outcomes[:] = [o for o in outcomes if o.message.id not in ids]
            self._after_write(verb, group, written)

    def _write(self, verb: str, group: list[Outcome], savepoint: bool) -> dict[int, str]:
        """Write one kind of outcome; returns {id: new state} of the rows actually changed."""
        try:
            with _savepoints() if savepoint else contextlib.nullcontext():
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
        stats = self._stats
        if stats is not None and verb not in ("release", "abort"):
            settled_at = timezone.now()  # one clock reading for the group
            for outcome in group:
                if outcome.message.id in written and outcome.kind in _STATS_OUTCOME:
                    stats.record_settled(
                        outcome.message.channel_id,
                        _STATS_OUTCOME[outcome.kind],
                        outcome.duration * 1000.0,
                        at=settled_at,
                        timed_out=outcome.timed_out,
                    )
        with self._cond:
            for outcome in group:
                message_id = outcome.message.id
                self._settling.discard(message_id)
                if self._unsettled.get(message_id, outcome.message) is not outcome.message:
                    continue  # its retry, claimed again already (a timed-out attempt's, say)
                self._unsettled.pop(message_id, None)
                self._lost.discard(message_id)
                self._lease_deadlines.pop(message_id, None)
                self._abort_pending.discard(message_id)
            if verb != "release":
                self._handled += len(group)
            if written and verb != "release" and not self._more:
                # A freed slot can make a capped channel claimable again, and a retry without
                # backoff is ready now: neither sends a notification, so claim again (with a
                # backlog known, the claimer claims as slots free anyway).
                self._wake = True
            self._cond.notify_all()
        ignored = [o.message.id for o in group if o.message.id not in written]
        if ignored:
            logger.warning(
                "%s of %d messages changed nothing: their lease was lost (it expired and the "
                "rescuer requeued them, an operator cancelled or deleted them, or their channel "
                "was deleted); ids %s",
                verb,
                len(ignored),
                ignored[:20],
                extra={"worker_id": self.worker_id, "outcome": "lease_lost"},
            )

    # heartbeats

    def _release_queued(self) -> None:
        """Give back the claimed messages still waiting for a handler thread (prefetched), so a
        stop does not wait for the threads to reach them."""
        while True:
            try:
                message = self._work.get_nowait()
            except queue.Empty:
                return
            if message is None:  # not put before the handlers are told to stop; keep it
                self._work.put(None)
                return
            self._outcomes.put(Outcome(message, "released"))
            with self._cond:
                self._busy -= 1
                self._claimed -= 1
                self._cond.notify_all()

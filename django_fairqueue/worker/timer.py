"""The timer: time limits and aborts, enforced outside the task's own thread.

An attempt that outlives its task's time limit fails (``TaskTimeout``, retried while attempts
remain); one asked to abort that does not stop within ``ABORT_GRACE`` ends aborted. Python
cannot stop a thread: the stuck one leaves the pool and a new thread takes its place, so the
worker's other messages go on. The message stays claimed, its lease renewed, until the stuck
thread returns: only then is the outcome written (whatever the task returned is discarded and
logged), so the channel's cap counts the attempt for as long as its thread really runs, and
its retry never runs beside it. A thread stuck longer than ``STUCK_TASK_LIMIT`` past its limit,
or ``max_abandoned_threads`` stuck at once, recycles the worker: it claims nothing more, lets
its other messages finish (or gives them back) and exits, ending the stuck threads with the
process; their leases then expire and the rescuer settles them as timed out.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Callable

from django_fairqueue.exceptions import TaskTimeout
from django_fairqueue.runtime.attempts import MAX_TRACEBACK, error_info, storable
from django_fairqueue.worker.config import Attempt, Outcome
from django_fairqueue.worker.execution import (
    aborted_outcome,
    failed_outcome,
    finished,
    log_extra,
    stack_of,
)
from django_fairqueue.worker.ledger import Ledger
from django_fairqueue.worker.pool import Pool
from django_fairqueue.worker.service import Service

logger = logging.getLogger("django_fairqueue.worker")


class Timer(Service):
    """Fails attempts past their time limit or abort grace; recycles a worker whose stuck
    threads outlive ``stuck_limit`` or number ``max_stuck`` (``on_recycle(why)``)."""

    name = "timer"

    def __init__(
        self,
        ledger: Ledger,
        outcomes: queue.SimpleQueue[Outcome | None],
        pool: Pool,
        *,
        worker_id: str,
        max_stuck: int,
        stuck_limit: float,
        on_recycle: Callable[[str], None],
    ) -> None:
        super().__init__()
        self.ledger = ledger
        self.outcomes = outcomes
        self.pool = pool
        self.worker_id = worker_id
        self.max_stuck = max_stuck
        self.stuck_limit = stuck_limit
        self.on_recycle = on_recycle

    def stop(self) -> None:
        super().stop()
        with self.ledger.deadlines:
            self.ledger.deadlines.notify_all()

    def run(self) -> None:
        while not self.stopping.is_set():
            if not self.run_once():
                # the next deadline, checked again at least every second (the stop, the
                # stuck threads' limit)
                self.ledger.wait_for_deadline(time.monotonic(), 1.0)

    def run_once(self, now: float | None = None) -> int:
        """Fail the attempts past their deadline at ``now``; returns how many."""
        now = time.monotonic() if now is None else now
        expired = self.ledger.expire(now)
        for attempt in expired:
            self.pool.replace(attempt.thread)
            self._time_out(attempt, now)
        stuck = self.ledger.stuck
        since = self.ledger.stuck_since()
        if since is not None and now - since >= self.stuck_limit:
            self.on_recycle(
                f"a handler thread has been stuck for {now - since:.0f}s in a task past its "
                f"time limit (STUCK_TASK_LIMIT {self.stuck_limit:g}s)"
            )
        elif stuck >= self.max_stuck:
            self.on_recycle(
                f"{stuck} handler threads are stuck in tasks past their time limit "
                f"(max_abandoned_threads {self.max_stuck})"
            )
        return len(expired)

    def _time_out(self, attempt: Attempt, now: float) -> None:
        """Fail an attempt past its time limit (retried while attempts remain), or abort one
        past its abort's grace period; its outcome is written when its thread returns."""
        message = attempt.message
        worker_id = self.worker_id
        if attempt.abort_seen:  # its abort was requested: aborted, whichever limit came first
            outcome = aborted_outcome(
                message,
                f"and the task did not stop within ABORT_GRACE ({self.ledger.abort_grace:g} s)",
                now - attempt.started,
                worker_id=worker_id,
            )
            self._park(attempt, outcome)
            logger.error(
                "message %s (%s, channel %r) did not stop within %gs of its abort request: "
                "aborted; its handler thread was replaced (%d stuck in this worker) and it is "
                "settled when the thread returns",
                message.id,
                message.task_name,
                message.channel,
                self.ledger.abort_grace,
                self.ledger.stuck,
                extra=log_extra(message, worker_id=worker_id, outcome="aborted"),
            )
            finished(outcome, worker_id=worker_id)
            return
        exc = TaskTimeout(
            f"task {message.task_name} exceeded its time limit of {attempt.timeout:g} s "
            f"(attempt {message.attempts} of {message.max_attempts})"
        )
        error = error_info(exc, attempt=message.attempts, worker_id=worker_id)
        stack = stack_of(attempt.thread)
        if stack is not None:  # where the task was stuck, for the operator
            error["traceback"] = storable(
                "Stack of the handler thread at the time limit (most recent call last):\n"
                f"{stack}{error['type']}: {error['message']}\n",
                MAX_TRACEBACK,
                keep_end=True,
            )
        outcome = failed_outcome(
            message, attempt.spec, exc, attempt.started, retry=True, worker_id=worker_id
        )
        outcome = dataclasses.replace(outcome, error=error, timed_out=True)
        self._park(attempt, outcome)
        logger.error(
            "message %s (%s, channel %r) exceeded its time limit of %gs: attempt %s of %s "
            "failed; its handler thread was replaced (%d stuck in this worker); the attempt "
            "keeps its channel's slot until the thread returns",
            message.id,
            message.task_name,
            message.channel,
            attempt.timeout,
            message.attempts,
            message.max_attempts,
            self.ledger.stuck,
            extra=log_extra(message, worker_id=worker_id, outcome="timeout"),
        )
        finished(outcome, worker_id=worker_id)

    def _park(self, attempt: Attempt, outcome: Outcome) -> None:
        if self.ledger.park(attempt, outcome):  # its thread returned meanwhile
            self.outcomes.put(outcome)

"""Time limits: fail an attempt that outlives its task's limit, replace its stuck thread."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
import traceback

from django_fairqueue.attempts import MAX_TRACEBACK, error_info, storable
from django_fairqueue.exceptions import (
    TaskTimeout,
)
from django_fairqueue.worker.config import _Attempt
from django_fairqueue.worker.execution import (
    _log_extra,
)
from django_fairqueue.worker.handlers import Handlers

logger = logging.getLogger("django_fairqueue.worker")


class TimeLimits(Handlers):
    """Time limits: fail an attempt that outlives its task's limit, replace its stuck thread."""

    def _timer_loop(self) -> None:
        """Settle each attempt that outlives its time limit as a failed attempt, at once."""
        while not self._threads_stop.is_set():
            with self._cond:
                now = time.monotonic()
                expired = [a for a in self._timed if a.deadline <= now]
                for attempt in expired:
                    self._abandon(attempt)
                if not expired:
                    # the next deadline, checked again at least every second (the stop)
                    wait = min((a.deadline for a in self._timed), default=now + 1.0) - now
                    self._timer_cond.wait(min(max(wait, 0.001), 1.0))
            for attempt in expired:
                self._time_out(attempt)

    def _abandon(self, attempt: _Attempt) -> None:
        """Take a timed-out attempt's thread out of the pool (call with the lock held): the
        slot is free for the next claim, and a new handler thread takes the stuck one's place."""
        self._timed.discard(attempt)
        attempt.abandoned = True
        self._busy -= 1
        self._abandoned += 1
        if attempt.thread in self._handlers:
            self._handlers.remove(attempt.thread)
        if not self._handlers_closing:
            self._start_handler()
        self._cond.notify_all()

    def _time_out(self, attempt: _Attempt) -> None:
        """Settle an attempt past its time limit as failed (retried while attempts remain),
        or one past its abort's grace period as aborted."""
        message = attempt.message
        with self._cond:
            if self._attempts.get(message.id) is attempt:
                del self._attempts[message.id]
        if attempt.abort_seen:  # its abort was requested: aborted, whichever limit came first
            outcome = self._aborted(
                message,
                f"and the task did not stop within ABORT_GRACE ({self._abort_grace:g} s)",
                time.monotonic() - attempt.started,
            )
            self._outcomes.put(outcome)
            with self._cond:
                stuck = self._abandoned
            logger.error(
                "message %s (%s, channel %r) did not stop within %gs of its abort request: "
                "settled as aborted; its handler thread was replaced (%d stuck in this worker)",
                message.id,
                message.task_name,
                message.channel,
                self._abort_grace,
                stuck,
                extra=_log_extra(message, worker_id=self.worker_id, outcome="aborted"),
            )
            self._finished(outcome)
            self._maybe_recycle()
            return
        exc = TaskTimeout(
            f"task {message.task_name} exceeded its time limit of {attempt.timeout:g} s "
            f"(attempt {message.attempts} of {message.max_attempts})"
        )
        error = error_info(exc, attempt=message.attempts, worker_id=self.worker_id)
        frame = sys._current_frames().get(attempt.thread.ident or -1)
        if frame is not None:  # where the task was stuck, for the operator
            stack = "".join(traceback.format_stack(frame))
            error["traceback"] = storable(
                "Stack of the handler thread at the time limit (most recent call last):\n"
                f"{stack}{error['type']}: {error['message']}\n",
                MAX_TRACEBACK,
                keep_end=True,
            )
        outcome = self._failed(message, attempt.spec, exc, attempt.started, retry=True)
        outcome = dataclasses.replace(outcome, error=error, timed_out=True)
        self._outcomes.put(outcome)
        with self._cond:
            stuck = self._abandoned
        logger.error(
            "message %s (%s, channel %r) exceeded its time limit of %gs: attempt %s of %s "
            "failed; its handler thread was replaced (%d stuck in this worker)",
            message.id,
            message.task_name,
            message.channel,
            attempt.timeout,
            message.attempts,
            message.max_attempts,
            stuck,
            extra=_log_extra(message, worker_id=self.worker_id, outcome="timeout"),
        )
        self._finished(outcome)
        self._maybe_recycle()

    def _maybe_recycle(self) -> None:
        """Recycle the worker once max_abandoned_threads handler threads are stuck."""
        with self._cond:
            stuck = self._abandoned
            recycle = stuck >= self.config.max_abandoned_threads and not self._recycling
            if recycle:
                self._recycling = True
        if recycle:
            logger.warning(
                "worker %s recycling: %d handler threads are stuck in tasks past their time "
                "limit (max_abandoned_threads %d); claiming nothing more, finishing the running "
                "messages, then exiting for a fresh process to take over",
                self.worker_id,
                stuck,
                self.config.max_abandoned_threads,
                extra={"worker_id": self.worker_id, "outcome": "recycle"},
            )
            self.stop()

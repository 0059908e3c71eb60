"""The handler pool: threads that run claimed messages' tasks and record their outcomes."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from datetime import timedelta

from asgiref.sync import async_to_sync

from django_fairqueue import dbfaults, tracing
from django_fairqueue.attempts import error_info, retry_delay
from django_fairqueue.context import abort_flag, current_message, time_limit_passed
from django_fairqueue.db.message_store import ClaimedMessage
from django_fairqueue.exceptions import (
    PayloadError,
    ResultNotStorable,
    TaskAborted,
    UnknownTask,
)
from django_fairqueue.signals import message_finished, message_started
from django_fairqueue.taskspec import TaskSpec, check_result, registry
from django_fairqueue.worker.base import WorkerBase
from django_fairqueue.worker.config import (
    Outcome,
    _Attempt,
    _lease_clock,
)
from django_fairqueue.worker.execution import (
    _close_old_connections,
    _connected_here,
    _end_open_transactions,
    _is_async,
    _log_extra,
    _savepoints,
    _send_robust,
    check_arguments,
    decode_payload,
)

logger = logging.getLogger("django_fairqueue.worker")
#: One line per cause of unavailability every few seconds, however many tasks it cut short.
_given_back = dbfaults.RateLimitedWarnings(logger)


class Handlers(WorkerBase):
    """The handler pool: threads that run claimed messages' tasks and record their outcomes."""

    def _start_handler(self) -> None:
        """Start a handler thread and count it in the pool (call with the lock held)."""
        self._handlers_started += 1
        thread = self._start_thread(f"handler-{self._handlers_started}", self._handler_loop)
        self._handlers.append(thread)

    def _handler_loop(self) -> None:
        # Whether this thread has opened a database connection (a task used the database).
        # Until one has, the checks around each message have nothing to look at; they cost
        # about as much as running a short task, so they are skipped.
        has_connections = False
        while True:
            message = self._work.get()
            if message is None:
                return
            outcome: Outcome | None
            if message.id in self._abort_pending:  # aborted while it waited for a thread
                outcome = self._aborted(message, "before it started", 0.0)
                self._finished(outcome)
            elif self._release_unstarted:
                outcome = Outcome(message, "released")
            elif self._lease_gone(message):
                self._drop(message)
                outcome = None
            else:
                # Like a request: connections past CONN_MAX_AGE or broken are replaced.
                if has_connections:
                    _close_old_connections()
                try:
                    outcome = self._execute(message, timed=True)
                except BaseException as exc:  # a bug outside the task: never lose the slot
                    logger.exception("running message %s failed", message.id)
                    outcome = Outcome(
                        message,
                        "failed",
                        error=error_info(exc, attempt=message.attempts, worker_id=self.worker_id),
                    )
                finally:
                    if has_connections or _connected_here():
                        has_connections = True
                        _end_open_transactions(message)
                        _close_old_connections()
                if outcome is None:  # it ran past its time limit, and was settled then
                    self._retire()
                    return  # another thread has taken this one's place
            if outcome is not None:
                self._outcomes.put(outcome)
            with self._cond:
                self._busy -= 1
                if outcome is None or outcome.kind == "released":
                    self._claimed -= 1  # not run: max_messages does not count it
                # Wake the claimer only when a claim can become due: the first free slot,
                # half a batch free (it may be gathering), or nothing running (shutdown).
                free = self._capacity - self._busy
                if free == 1 or free == self._half_batch or self._busy == 0:
                    self._cond.notify_all()

    def _lease_gone(self, message: ClaimedMessage) -> bool:
        """Whether the lease of a message not started yet is known lost (a heartbeat found it
        gone) or expired by this process's clock: a worker that was frozen (SIGSTOP, a VM
        pause), or whose heartbeats could not reach the database, must not start what another
        worker may be running by now."""
        # Single lookups, safe without the lock (the GIL, or the objects' own locks): a
        # renewal racing with this check can only make it drop a message sooner.
        if message.id in self._lost:
            return True
        deadline = self._lease_deadlines.get(message.id)
        return deadline is not None and _lease_clock() >= deadline

    def _drop(self, message: ClaimedMessage) -> None:
        """Forget a claimed message without running it or writing anything, as a worker that
        died holding it would: the rescuer requeues it once its lease has expired (or did
        already, and another worker may hold it now). Heartbeats stop renewing it."""
        with self._cond:
            self._unsettled.pop(message.id, None)
            self._lost.discard(message.id)
            self._lease_deadlines.pop(message.id, None)
            self._abort_pending.discard(message.id)
        logger.warning(
            "not starting message %s (%s, channel %r): its lease expired or was lost while it "
            "waited for a handler thread; the rescuer requeues it",
            message.id,
            message.task_name,
            message.channel,
            extra=_log_extra(message, worker_id=self.worker_id, outcome="lease_lost"),
        )

    def execute(self, message: ClaimedMessage, *, savepoint: bool = False) -> Outcome:
        """Run one claimed message's task here and now; returns what to write back.

        Never raises for a task's error: a bad message (unknown task, unusable payload,
        arguments that do not fit) fails at once without retries; a task that raises is retried
        with backoff while attempts remain, then fails. The task's time limit is not enforced
        here (only the threaded loop can leave a stuck thread behind).
        """
        outcome = self._execute(message, savepoint=savepoint)
        assert outcome is not None  # only a timed attempt is abandoned
        return outcome

    def _execute(
        self, message: ClaimedMessage, *, savepoint: bool = False, timed: bool = False
    ) -> Outcome | None:
        """:meth:`execute`; with ``timed``, under the task's time limit: None when the limit
        passed first (the timer settled the attempt; this outcome is discarded)."""
        started = time.monotonic()
        try:
            spec = registry.get(message.task_name)
            args, kwargs = decode_payload(message.payload)
            check_arguments(spec, args, kwargs)
        except (UnknownTask, PayloadError, TypeError) as exc:
            outcome = Outcome(
                message,
                "failed",
                error=error_info(
                    exc, attempt=message.attempts, worker_id=self.worker_id, with_traceback=False
                ),
                duration=time.monotonic() - started,
            )
            self._finished(outcome)
            return outcome
        _send_robust(message_started, message=message, worker_id=self.worker_id)
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "start %s message %s channel %r attempt %s/%s",
                message.task_name,
                message.id,
                message.channel,
                message.attempts,
                message.max_attempts,
                extra=_log_extra(message),
            )
        attempt = self._start_attempt(message, spec) if timed else None
        token = current_message.set(message)
        limit_token = time_limit_passed.set(attempt.passed) if attempt is not None else None
        abort_token = abort_flag.set(attempt.aborting) if attempt is not None else None
        try:
            with (
                tracing.run_span(message),
                _savepoints() if savepoint else contextlib.nullcontext(),
            ):
                if _is_async(spec.func):
                    result = async_to_sync(spec.func)(*args, **kwargs)
                else:
                    result = spec.func(*args, **kwargs)
            if message.keep_result:
                check_result(message.task_name, result)
        except ResultNotStorable as exc:  # the task ran: running it again repeats its effects
            outcome = self._failed(message, spec, exc, started, retry=False)
        except (Exception, SystemExit) as exc:
            outcome = self._failed(message, spec, exc, started, retry=True)
        except BaseException:
            if attempt is not None and not self._end_attempt(attempt):
                return None  # settled as timed out already
            raise
        else:
            outcome = Outcome(
                message,
                "succeeded",
                result=result if message.keep_result else None,
                duration=time.monotonic() - started,
            )
        finally:
            current_message.reset(token)
            if limit_token is not None:
                time_limit_passed.reset(limit_token)
            if abort_token is not None:
                abort_flag.reset(abort_token)
        if attempt is not None and attempt.abort_seen and self._end_attempt(attempt):
            # Its abort was requested: it ends aborted, whatever it returned or raised.
            outcome = self._aborted(message, "and the task stopped", outcome.duration)
            self._finished(outcome)
            return outcome
        if attempt is not None and not self._end_attempt(attempt):
            limit = attempt.deadline - attempt.started
            what = "its abort's grace period" if attempt.abort_seen else "its time limit"
            logger.warning(
                "message %s (%s, channel %r) returned %.1fs after %s (%gs): discarded its "
                "outcome (%s); the attempt was settled at the limit",
                message.id,
                message.task_name,
                message.channel,
                outcome.duration - limit,
                what,
                limit,
                outcome.kind,
                extra=_log_extra(message, worker_id=self.worker_id, outcome="discarded"),
            )
            return None
        self._finished(outcome)
        return outcome

    # time limits

    def _start_attempt(self, message: ClaimedMessage, spec: TaskSpec) -> _Attempt:
        """Record a running attempt (abort requests find it), under its task's time limit
        when it has one."""
        timeout = spec.effective_timeout
        attempt = _Attempt(message, spec, threading.current_thread(), timeout, time.monotonic())
        with self._cond:
            self._attempts[message.id] = attempt
            if message.id in self._abort_pending:  # requested between its claim and now
                self._start_abort(attempt)
            elif timeout is not None:
                self._timed.add(attempt)
                self._timer_cond.notify()  # it may be the next deadline
        return attempt

    def _end_attempt(self, attempt: _Attempt) -> bool:
        """The attempt returned: whether its outcome is still this thread's to settle (False
        when the timer settled it as timed out or aborted first). Idempotent."""
        with self._cond:
            if self._attempts.get(attempt.message.id) is attempt:
                del self._attempts[attempt.message.id]
            if attempt.abandoned:
                return False
            self._timed.discard(attempt)
            return True

    def _aborted(self, message: ClaimedMessage, how: str, duration: float) -> Outcome:
        """The outcome of an attempt whose abort was requested."""
        exc = TaskAborted(f"message {message.id} aborted on request, {how}")
        return Outcome(
            message,
            "aborted",
            error=error_info(
                exc, attempt=message.attempts, worker_id=self.worker_id, with_traceback=False
            ),
            duration=duration,
        )

    def _retire(self) -> None:
        """A thread abandoned to a timed-out attempt got it back: it leaves the worker (its
        replacement is running), no longer counted as stuck."""
        with self._cond:
            self._abandoned -= 1

    def _finished(self, outcome: Outcome) -> None:
        self._log_finish(outcome)
        _send_robust(
            message_finished,
            message=outcome.message,
            worker_id=self.worker_id,
            outcome=outcome.kind,
            duration=outcome.duration,
            error=outcome.error,
        )

    def _failed(
        self,
        message: ClaimedMessage,
        spec: TaskSpec,
        exc: BaseException,
        started: float,
        *,
        retry: bool,
    ) -> Outcome:
        error = error_info(exc, attempt=message.attempts, worker_id=self.worker_id)
        cause = dbfaults.unavailable(exc)
        if cause is not None:  # not the task's fault: given back, the attempt not counted
            return Outcome(
                message,
                "released",
                error={**error, "unavailable": cause},
                retry_in=dbfaults.give_back_delay(),
                duration=time.monotonic() - started,
            )
        # at_most_once messages have max_attempts 1; the check also covers a task switched to
        # at_most_once after its messages were enqueued.
        if (
            retry
            and message.attempts < message.max_attempts
            and spec.effective_delivery != "at_most_once"
        ):
            return Outcome(
                message,
                "retry",
                error=error,
                retry_in=timedelta(seconds=retry_delay(message.attempts)),
                duration=time.monotonic() - started,
            )
        return Outcome(message, "failed", error=error, duration=time.monotonic() - started)

    def _log_finish(self, outcome: Outcome) -> None:
        message = outcome.message
        level = logging.INFO if outcome.kind == "succeeded" else logging.WARNING
        if not logger.isEnabledFor(level):
            return
        if outcome.kind == "released":  # given back: the database was unavailable
            error = outcome.error or {}
            _given_back.warning(
                str(error.get("unavailable")),
                "gave back %s message %s channel %r without using an attempt: the database is "
                "unavailable (%s: %s)",
                message.task_name,
                message.id,
                message.channel,
                error.get("type"),
                error.get("message"),
                extra=_log_extra(message, duration=outcome.duration, outcome="released"),
            )
            return
        if outcome.kind == "succeeded":
            what = "succeeded"
        elif outcome.kind == "aborted":
            what = "aborted"
        else:
            error = outcome.error or {}
            cause = f"{error.get('type')}: {error.get('message')}"
            if outcome.kind == "retry" and outcome.retry_in is not None:
                what = f"failed ({cause}); retry in {outcome.retry_in.total_seconds():.1f}s"
            else:
                what = f"failed for good ({cause})"
        logger.log(
            level,
            "%s %s message %s channel %r attempt %s/%s in %.3fs",
            what,
            message.task_name,
            message.id,
            message.channel,
            message.attempts,
            message.max_attempts,
            outcome.duration,
            extra=_log_extra(message, duration=outcome.duration, outcome=outcome.kind),
        )

    # settling

"""The pool: handler threads that run claimed messages' tasks and hand their outcomes on."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from django_fairqueue.context import (
    abort_flag,
    current_message,
    operator_interrupt,
    time_limit_passed,
)
from django_fairqueue.db.message_store import ClaimedMessage
from django_fairqueue.exceptions import PayloadError, ResultNotStorable, UnknownTask
from django_fairqueue.observe import tracing
from django_fairqueue.runtime.attempts import RESCUED, error_info
from django_fairqueue.signals import message_started
from django_fairqueue.tasks.spec import TaskSpec, check_arguments, check_result, registry
from django_fairqueue.worker.config import Attempt, Outcome
from django_fairqueue.worker.execution import (
    aborted_outcome,
    call_task,
    close_stale_connections,
    connected_here,
    decode_payload,
    end_open_transactions,
    failed_outcome,
    finished,
    log_extra,
    savepoints,
    send_robust,
)
from django_fairqueue.worker.ledger import Ledger
from django_fairqueue.worker.service import CrashHandler, spawn

logger = logging.getLogger("django_fairqueue.worker")
#: a reusable no-op block, for an attempt outside a test's transaction
_NO_SAVEPOINT: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


class Pool:
    """``concurrency`` handler threads taking claimed messages from ``work`` and putting their
    outcomes on ``outcomes``; a thread stuck past a time limit is replaced (:meth:`replace`).

    ``on_free(free)`` is called when a finished message freed a slot worth a claim.
    """

    name = "pool"

    def __init__(
        self,
        ledger: Ledger,
        work: queue.SimpleQueue[ClaimedMessage | None],
        outcomes: queue.SimpleQueue[Outcome | None],
        *,
        concurrency: int,
        worker_id: str,
        on_free: Callable[[int], None] = lambda free: None,
    ) -> None:
        self.ledger = ledger
        self.work = work
        self.outcomes = outcomes
        self.concurrency = concurrency
        self.worker_id = worker_id
        self.on_free = on_free
        self._lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self._started = 0  # for thread names
        self._closing = False  # told to stop: no more replacements
        self._on_crash: CrashHandler | None = None
        #: notified when a handler finishes the last running message (a stop waits for it)
        self.finished = threading.Condition()
        # A prefetched message whose abort a heartbeat reads is settled then, not once a
        # handler thread is free to take it (:meth:`Ledger.aborts_requested`).
        ledger.abort_unstarted = self.abort_unstarted

    # -- threads ---------------------------------------------------------------------------------

    def start(self, on_crash: CrashHandler) -> None:
        self._on_crash = on_crash
        for _ in range(self.concurrency):
            self._start_thread()

    def _start_thread(self) -> None:
        with self._lock:
            if self._closing or self._on_crash is None:  # stopped, or never started
                return
            self._started += 1
            thread = spawn(f"handler-{self._started}", self._loop, self._on_crash)
            self.threads.append(thread)

    def replace(self, stuck: threading.Thread) -> None:
        """Take a thread stuck in a timed-out attempt out of the pool and start another."""
        with self._lock:
            if stuck in self.threads:
                self.threads.remove(stuck)
        self._start_thread()

    def stop(self) -> list[threading.Thread]:
        """Let every handler thread end after its message; returns them (to join)."""
        with self._lock:
            self._closing = True
            threads = list(self.threads)
        for _ in threads:
            self.work.put(None)
        return threads

    def wait_idle(self, deadline: float | None, give_up: Callable[[], bool]) -> int:
        """Wait until no message runs (or ``deadline``, or ``give_up()``); returns how many
        still run."""
        with self.finished:
            while self.ledger.busy > 0 and not give_up():
                timeout = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                if timeout <= 0:
                    break
                self.finished.wait(timeout)
        return self.ledger.busy

    def release_queued(self) -> None:
        """Give back the claimed messages still waiting for a thread (prefetched), so a stop
        does not wait for the threads to reach them."""
        while True:
            try:
                message = self.work.get_nowait()
            except queue.Empty:
                return
            if message is None:  # not put before the handlers are told to stop; keep it
                self.work.put(None)
                return
            if not self.ledger.take(message):  # settled aborted while it waited
                self.ledger.not_started(ran=True)
                continue
            self.outcomes.put(Outcome(message, "released"))
            self.ledger.not_started(ran=False)

    # -- the handler loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        # Whether this thread has opened a database connection (a task used the database).
        # Until one has, the checks around each message have nothing to look at; they cost
        # about as much as running a short task, so they are skipped.
        has_connections = False
        while True:
            message = self.work.get()
            if message is None:
                return
            ran, has_connections, stuck = self._handle(message, has_connections)
            if stuck:
                return  # another thread has taken this one's place
            self._done(ran)

    def run_once(self) -> bool:
        """Run the next waiting message in the calling thread (no time limit: only a handler
        thread can be left behind); False when none waits."""
        try:
            message = self.work.get_nowait()
        except queue.Empty:
            return False
        if message is None:
            self.work.put(None)
            return False
        ran, _, _ = self._handle(message, True, timed=False)
        self._done(ran)
        return True

    def _done(self, ran: bool) -> None:
        free = self.ledger.not_started(ran=ran)
        if free == self.ledger.capacity:
            # Nothing runs now: what wait_idle() waits for. (The condition's lock makes this
            # wait for a waiter that checked the count to be waiting.)
            with self.finished:
                self.finished.notify_all()
        self.on_free(free)

    def _handle(
        self, message: ClaimedMessage, has_connections: bool, *, timed: bool = True
    ) -> tuple[bool, bool, bool]:
        """Run or give back one message: (whether it ran, whether this thread has database
        connections, whether its attempt timed out and this thread left the pool)."""
        outcome: Outcome | None
        if not self.ledger.take(message):
            # Settled aborted while it waited: only its slot is left to free. It counts as the
            # abort below does (max_messages counts it), as when a thread settled it.
            return True, has_connections, False
        if self.ledger.abort_pending(message.id):  # aborted as this thread took it
            self.abort_unstarted([message])
            return True, has_connections, False
        if self.ledger.release_unstarted:
            outcome = Outcome(message, "released")
        elif self.ledger.lease_gone(message):
            self.drop(message)
            return False, has_connections, False
        else:
            # Like a request: connections past CONN_MAX_AGE or broken are replaced.
            if has_connections:
                close_stale_connections()
            try:
                outcome = self._execute(message, timed=timed)
            except BaseException as exc:  # a bug outside the task: never lose the slot
                logger.exception("running message %s failed", message.id)
                outcome = Outcome(
                    message,
                    "failed",
                    error=error_info(exc, attempt=message.attempts, worker_id=self.worker_id),
                )
            finally:
                if has_connections or connected_here():
                    has_connections = True
                    end_open_transactions(message)
                    close_stale_connections()
            if outcome is None:  # it ran past its time limit: its outcome was parked
                return True, has_connections, True
        self.outcomes.put(outcome)
        return outcome.kind != "released", has_connections, False

    def abort_unstarted(self, messages: list[ClaimedMessage]) -> None:
        """Settle aborted messages no task ran for (from a handler thread, or the heartbeat's
        when no thread had taken them yet)."""
        for message in messages:
            outcome = aborted_outcome(message, "before it started", 0.0, worker_id=self.worker_id)
            finished(outcome, worker_id=self.worker_id)
            self.outcomes.put(outcome)

    def drop(self, message: ClaimedMessage) -> None:
        """Forget a claimed message without running it or writing anything, as a worker that
        died holding it would: the rescuer takes it back once its lease has expired (or did
        already, and another worker may hold it now). Heartbeats stop renewing it."""
        self.ledger.forget([message.id])
        logger.warning(
            "not starting message %s (%s, channel %r): its lease expired or was lost while it "
            "waited for a handler thread; the rescuer takes it back (%s)",
            message.id,
            message.task_name,
            message.channel,
            RESCUED,
            extra=log_extra(message, worker_id=self.worker_id, outcome="lease_lost"),
        )

    def execute(self, message: ClaimedMessage, *, savepoint: bool = False) -> Outcome:
        """Run one claimed message's task here and now; returns what to write back.

        Never raises for a task's error: a bad message (unknown task, unusable payload,
        arguments that do not fit) fails at once without retries; a task that raises is retried
        with backoff while attempts remain, then fails. The task's time limit is not enforced
        here (only a handler thread can be left behind).
        """
        outcome = self._execute(message, savepoint=savepoint)
        assert outcome is not None  # only a timed attempt is abandoned
        return outcome

    def _execute(
        self, message: ClaimedMessage, *, savepoint: bool = False, timed: bool = False
    ) -> Outcome | None:
        """:meth:`execute`; with ``timed``, under the task's time limit: None when the limit
        passed first (the timer failed the attempt, and its outcome is written now)."""
        worker_id = self.worker_id
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
                    exc, attempt=message.attempts, worker_id=worker_id, with_traceback=False
                ),
                duration=time.monotonic() - started,
            )
            finished(outcome, worker_id=worker_id)
            return outcome
        send_robust(message_started, message=message, worker_id=worker_id)
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "start %s message %s channel %r attempt %s/%s",
                message.task_name,
                message.id,
                message.channel,
                message.attempts,
                message.max_attempts,
                extra=log_extra(message),
            )
        attempt = (
            self.ledger.start_attempt(message, spec, spec.effective_timeout) if timed else None
        )
        token = current_message.set(message)
        limit_token = time_limit_passed.set(attempt.passed) if attempt is not None else None
        abort_token = abort_flag.set(attempt.aborting) if attempt is not None else None
        try:
            outcome = self._run(message, spec, args, kwargs, started, savepoint)
        except BaseException:
            # Not an outcome: the operator's Ctrl-C in a synchronous pass, or a bug here. The
            # attempt ends all the same: left recorded as running, the timer would fail it at
            # its time limit and take its slot out of the pool's count a second time.
            if attempt is not None and not self._end_attempt(attempt):
                return None  # failed as timed out already
            raise
        finally:
            current_message.reset(token)
            if limit_token is not None:
                time_limit_passed.reset(limit_token)
            if abort_token is not None:
                abort_flag.reset(abort_token)
        if attempt is not None and attempt.abort_seen and self._end_attempt(attempt):
            # Its abort was requested: it ends aborted, whatever it returned or raised.
            outcome = aborted_outcome(
                message, "and the task stopped", outcome.duration, worker_id=worker_id
            )
            finished(outcome, worker_id=worker_id)
            return outcome
        if attempt is not None and not self._end_attempt(attempt):
            limit = attempt.deadline - attempt.started
            if attempt.abort_seen:
                what, settled = "its abort's grace period ran out", "aborted"
            else:
                what, settled = f"its time limit ({limit:g}s)", "failed"
            # A result that arrives after the limit is discarded: the attempt ended then.
            logger.warning(
                "message %s (%s, channel %r) returned %.1fs after %s: discarded its outcome "
                "(%s); the attempt is settled as it was %s then",
                message.id,
                message.task_name,
                message.channel,
                outcome.duration - limit,
                what,
                outcome.kind,
                settled,
                extra=log_extra(message, worker_id=worker_id, outcome="discarded"),
            )
            return None
        finished(outcome, worker_id=worker_id, lease_expired=self.ledger.lease_gone(message))
        return outcome

    def _run(
        self,
        message: ClaimedMessage,
        spec: TaskSpec,
        args: list[Any],
        kwargs: dict[str, Any],
        started: float,
        savepoint: bool,
    ) -> Outcome:
        """Call the task: the outcome of whatever it returns or raises."""
        raised: BaseException | None = None
        try:
            with (
                tracing.run_span(message),
                savepoints() if savepoint else _NO_SAVEPOINT,
            ):
                try:
                    result = call_task(spec.func, *args, **kwargs)
                except BaseException as exc:
                    raised = exc
                    raise
            if message.keep_result:
                check_result(message.task_name, result)
        except ResultNotStorable as exc:  # the task ran: running it again repeats its effects
            return failed_outcome(
                message, spec, exc, started, retry=False, worker_id=self.worker_id
            )
        except BaseException as exc:
            if operator_interrupt(exc):
                raise
            # The task's own exception, even when leaving the span replaced it: OpenTelemetry
            # records an exception with str(), which fails for an exception whose __str__ raises.
            exc = raised if raised is not None else exc
            # Whatever the task raised (SystemExit, KeyboardInterrupt, GeneratorExit, a
            # CancelledError included) is its failure, retried while attempts remain: no
            # exception stops the worker from inside a task. (Time limits and aborts never
            # raise in the task's thread: the timer ends those attempts from outside.)
            return failed_outcome(message, spec, exc, started, retry=True, worker_id=self.worker_id)
        return Outcome(
            message,
            "succeeded",
            result=result if message.keep_result else None,
            duration=time.monotonic() - started,
        )

    def _end_attempt(self, attempt: Attempt) -> bool:
        """The attempt returned: whether its outcome is this thread's to write. When the timer
        failed it first, the outcome it parked is written now (its slot held until now)."""
        mine, parked = self.ledger.end_attempt(attempt)
        if parked is not None:
            self.outcomes.put(parked)
        return mine

"""The worker: claim messages fairly, run their tasks on a thread pool, settle the outcomes.

``manage.py runfairworker`` is a thin shell around :class:`Worker`. One worker process runs
these threads, each with its own database connection (Django's connections are per thread):

* the **claimer** (the thread that calls :meth:`Worker.run`) claims up to the number of free
  handler slots plus ``prefetch`` (at most ``batch_size``) in one ``claim_messages`` call,
  whenever a slot is free and work may be waiting: after a full claim, on a LISTEN wake-up,
  when a retry or a rescued message is ready, when the worker is idle in burst mode, or when
  the jittered poll interval has passed;
* ``concurrency`` **handler** threads run the task functions (a connection only if the task
  uses the database);
* the **timer** fails an attempt that outlives its task's time limit (``TaskTimeout``), frees
  its slot and starts a handler thread in place of the stuck one (Python cannot stop a
  thread; its eventual outcome is discarded); past ``max_abandoned_threads`` stuck threads the
  worker stops claiming, finishes what runs and exits, for a fresh process to replace it;
* the **settler** writes outcomes in batches: every completion waiting in one
  ``complete_messages``, every failure in one ``fail_messages``;
* the **heartbeat** thread renews the lease of every claimed, unsettled message in one
  statement, three times per lease period, also while handlers are busy;
* the **maintenance** thread runs the rescuer, the pruner and the delta folder
  (:mod:`django_fairqueue.maintenance`);
* the **listener** holds a psycopg connection of its own (not Django's) that LISTENs for the
  enqueue wake-ups.

Every write after the claim presents the claim's lease token, so a worker that lost its lease
(stalled past it, or cut off from the database) changes nothing when it comes back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import queue
import random
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

import psycopg
from asgiref.sync import async_to_sync
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, close_old_connections, connections, transaction
from django.db.backends.signals import connection_created
from django.utils import timezone

from django_fairqueue import conf, store
from django_fairqueue._runtime import (
    CONNECTION_ERRORS,
    Backoff,
    StopFlag,
    after_database_error,
    drop_broken_connection,
    stop_signals,
)
from django_fairqueue.api import validate_channel_name
from django_fairqueue.context import current_message, time_limit_passed
from django_fairqueue.exceptions import (
    FairQueueError,
    PayloadError,
    ResultNotStorable,
    TaskTimeout,
    UnknownTask,
)
from django_fairqueue.maintenance import MaintenanceRunner, Service, default_services
from django_fairqueue.models import Message
from django_fairqueue.registry import Beat, Registration, wall_clock
from django_fairqueue.signals import message_finished, message_started
from django_fairqueue.stats import StatsRecorder
from django_fairqueue.store import ClaimedMessage
from django_fairqueue.tasks import TaskSpec, check_result, registry

logger = logging.getLogger("django_fairqueue.worker")

#: Most outcomes written by one settle statement, and leases renewed by one heartbeat.
SETTLE_BATCH = 1000
HEARTBEAT_BATCH = 5000
#: Seconds between two writes of the per-channel statistics (django_fairqueue.stats).
STATS_FLUSH_SECONDS = 5.0
#: An empty claim right after a full one (or in burst mode) is retried this many times, after
#: a few milliseconds each, before the worker believes nothing is ready: concurrent claims skip
#: the channel rows they find locked, so two workers sharing few channels often see an empty
#: claim while a backlog waits.
EMPTY_CLAIM_RETRIES = 3
#: Retries of an empty claim made on a wake-up while the queue says work is claimable (a
#: channel row was locked for a moment): after 5-10 ms, doubling, about 0.3 s at most in all.
WOKEN_CLAIM_RETRIES = 5
#: An idle worker claims this long after the next work's due time (the database's figure), so
#: the claim's clock is past it; and the first wait when work is due yet none was claimed
#: (doubling, at most the poll interval).
DUE_SLACK = 0.002
DUE_RETRY_FIRST = 0.005
#: With a backlog, a claim waits up to this long (seconds) for half a batch of free slots
#: instead of claiming for each slot as it frees: one claim costs about as much for 1 message
#: as for 50, so short tasks would otherwise spend the database on tiny claims.
GATHER_SECONDS = 0.005
#: A burst worker is done once nothing is ready and nothing is due within this many seconds:
#: it waits for a rate-limited channel's next turn, and for retries and delayed messages due
#: that soon, rather than leave them behind (``WorkerConfig.burst_horizon``).
BURST_HORIZON = 5.0
MAX_BURST_HORIZON = 86_400.0
#: Stuck handler threads (tasks past their time limit) after which a worker recycles itself.
MAX_ABANDONED_THREADS = 10
#: Longest error message and traceback kept in ``last_error`` (characters). The traceback keeps
#: its end, where the exception was raised.
MAX_ERROR_MESSAGE = 8_000
MAX_TRACEBACK = 32_000

#: The clock leases are estimated with: monotonic, and on Linux counting time suspended too (a
#: machine that slept past a lease must see it expired). Never compared with the database's
#: clock: a lease's local deadline is this clock when the statement that set the lease was
#: sent, plus the lease (the database's expiry minus its time of that statement).
_lease_clock: Callable[[], float] = (
    functools.partial(time.clock_gettime, time.CLOCK_BOOTTIME)
    if hasattr(time, "CLOCK_BOOTTIME")
    else time.monotonic
)

OutcomeKind = Literal["succeeded", "retry", "failed", "released"]
_STATS_OUTCOME: dict[str, Literal["succeeded", "failed", "retried"]] = {
    "succeeded": "succeeded",
    "retry": "retried",
    "failed": "failed",
}


class WorkerCrashed(FairQueueError):
    """A thread of the worker failed unexpectedly; the worker stopped."""


def default_worker_id() -> str:
    """``host:pid:random``: unique per process, so a restarted worker never hides its orphans."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker runs. ``None`` fields fall back to the FAIRQUEUE settings."""

    #: Handler threads: how many messages run at once in this process.
    concurrency: int = 4
    #: Claim only from these channels (names; channels created later are picked up).
    channels: Sequence[str] = ()
    #: Never claim from these channels.
    exclude_channels: Sequence[str] = ()
    #: Most messages one claim takes (a claim never takes more than the free handler slots,
    #: plus ``prefetch``).
    batch_size: int = 100
    #: Messages to claim beyond the free handler threads, started as threads free up (opt-in).
    #: Claims then stay large when tasks are short: a claim costs the database about as much
    #: for 50 messages as for 5. Prefetched messages are leased (heartbeats renew them), count
    #: against their channel's ``max_concurrency`` and wait here rather than in the queue,
    #: where another worker could have started them; a graceful stop gives them back.
    prefetch: int = 0
    #: Seconds between claims when no wake-up arrives; None: FAIRQUEUE['POLL_INTERVAL'].
    poll_interval: float | None = None
    #: Stop once nothing is ready, nothing is running and nothing is due within
    #: ``burst_horizon`` seconds.
    burst: bool = False
    #: In burst mode, work due within this many seconds is waited for: a rate-limited
    #: channel's next turn (it has ready messages), a retry or a delayed message. 0: none.
    burst_horizon: float = BURST_HORIZON
    #: Stop after claiming this many messages (and finishing them).
    max_messages: int | None = None
    worker_id: str = field(default_factory=default_worker_id)
    #: Lease of each claim, renewed by heartbeats; None: FAIRQUEUE['LEASE_SECONDS'].
    lease: timedelta | None = None
    #: Seconds a graceful stop waits for running messages before leaving them to their leases.
    shutdown_grace: float = 30.0
    #: LISTEN for enqueue wake-ups (only when FAIRQUEUE['NOTIFY'] is on). Off behind a
    #: transaction-pooling proxy, where LISTEN does not work: polling alone then.
    listen: bool = True
    #: Run the rescuer, pruner and delta folder in this process.
    maintenance: bool = True
    #: Handler threads left stuck in tasks past their time limit (Python cannot stop a thread;
    #: each was replaced by a new one) at which the worker recycles itself: it claims nothing
    #: more, finishes the running messages and exits normally, for a process manager or
    #: ``runfairworker --processes`` to start a fresh process.
    max_abandoned_threads: int = MAX_ABANDONED_THREADS

    def __post_init__(self) -> None:
        _positive_int(self.concurrency, "concurrency")
        _positive_int(self.batch_size, "batch_size")
        _positive_int(self.prefetch, "prefetch", minimum=0)
        _positive_int(self.max_abandoned_threads, "max_abandoned_threads")
        if self.max_messages is not None:
            _positive_int(self.max_messages, "max_messages")
        if self.poll_interval is not None and not self.poll_interval > 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {self.poll_interval!r}")
        if self.lease is not None and self.lease <= timedelta(0):
            raise ValueError(f"lease must be positive, got {self.lease}")
        if not 0 <= self.burst_horizon <= MAX_BURST_HORIZON:
            raise ValueError(
                f"burst_horizon must be 0 to {MAX_BURST_HORIZON:g} seconds, "
                f"got {self.burst_horizon!r}"
            )
        if not self.shutdown_grace >= 0:
            raise ValueError(f"shutdown_grace must be >= 0 seconds, got {self.shutdown_grace!r}")
        if not self.worker_id.strip():
            raise ValueError("worker_id must be a non-empty string")
        if len(self.worker_id) > 200:
            raise ValueError("worker_id must be at most 200 characters")
        for attr in ("channels", "exclude_channels"):
            names = getattr(self, attr)
            if isinstance(names, str):
                raise ValueError(f"{attr} must be a list of channel names, not a string")
            object.__setattr__(self, attr, tuple(validate_channel_name(n) for n in names))
        both = sorted(set(self.channels) & set(self.exclude_channels))
        if both:
            raise ValueError(f"channels both included and excluded: {both}")


def _positive_int(value: Any, name: str, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one claimed message, waiting to be written."""

    message: ClaimedMessage
    kind: OutcomeKind
    result: Any = None
    error: dict[str, Any] | None = None
    #: backoff before the next attempt; the database adds it to its own clock
    retry_in: timedelta | None = None
    duration: float = 0.0


@dataclass(eq=False)
class _Attempt:
    """A running attempt with a time limit (compared by identity: a message id comes back
    with its retries)."""

    message: ClaimedMessage
    spec: TaskSpec
    thread: threading.Thread
    timeout: float
    started: float  # time.monotonic()
    #: Set by the timer (under the worker's lock) when the limit passed: the attempt was
    #: settled as timed out, and its thread no longer belongs to the pool.
    abandoned: bool = False

    @property
    def deadline(self) -> float:
        return self.started + self.timeout

    def passed(self) -> bool:
        """Whether the limit has passed (a read of one flag: no lock needed)."""
        return self.abandoned


# ------------------------------------------------------------------------------------------------
# Running one message (shared by the threaded loop and the synchronous pass)


def decode_payload(payload: Any) -> tuple[list[Any], dict[str, Any]]:
    """The call arguments of a message; :class:`PayloadError` if the payload is not usable."""
    if not isinstance(payload, dict):
        raise PayloadError(
            "payload must be a JSON object with 'args' (a list) and 'kwargs' (an object), "
            f"got {type(payload).__name__}"
        )
    args, kwargs = payload.get("args"), payload.get("kwargs")
    if not isinstance(args, list):
        raise PayloadError(f"payload 'args' must be a list, got {type(args).__name__}")
    if not isinstance(kwargs, dict):
        raise PayloadError(f"payload 'kwargs' must be an object, got {type(kwargs).__name__}")
    return args, kwargs


@functools.cache
def _signature(func: Callable[..., Any]) -> inspect.Signature | None:
    """The signature to check arguments against; None when any arguments fit (it has none,
    as some builtins, or it is only ``*args, **kwargs``): binding would then check nothing."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):  # some builtins have none: let the call itself check
        return None
    kinds = {p.kind for p in sig.parameters.values()}
    if kinds == {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
        return None
    return sig


@functools.cache
def _is_async(func: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(func)


def check_arguments(spec: TaskSpec, args: list[Any], kwargs: dict[str, Any]) -> None:
    """Raise TypeError (without calling the task) if the arguments do not fit its signature."""
    sig = _signature(spec.func)
    if sig is None:
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"arguments do not fit {spec.name}{sig}: {exc}") from None


def retry_delay(attempt: int) -> float:
    """Seconds before retrying after failed attempt ``attempt`` (1-based).

    ``RETRY_BACKOFF_BASE * 2**(attempt - 1)``, capped at ``RETRY_BACKOFF_MAX``, then scaled by a
    random factor in [0.5, 1] so that messages failing together do not retry together.
    """
    cfg = conf.get()
    step = min(cfg.RETRY_BACKOFF_BASE * 2.0 ** min(attempt - 1, 60), cfg.RETRY_BACKOFF_MAX)
    return step * random.uniform(0.5, 1.0)


def _qualified_name(cls: type) -> str:
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def _storable(text: str, limit: int, *, keep_end: bool = False) -> str:
    """Text jsonb accepts (no NUL, no lone surrogates), at most ``limit`` characters."""
    text = text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > limit:
        text = "[...]" + text[-limit:] if keep_end else text[:limit] + "[...]"
    return text


def error_info(
    exc: BaseException, *, attempt: int, worker_id: str, with_traceback: bool = True
) -> dict[str, Any]:
    """The ``last_error`` of a failed attempt."""
    tb = "".join(traceback.format_exception(exc)) if with_traceback else None
    return {
        "type": _qualified_name(type(exc)),
        "message": _storable(str(exc), MAX_ERROR_MESSAGE),
        "traceback": _storable(tb, MAX_TRACEBACK, keep_end=True) if tb is not None else None,
        "attempt": attempt,
        "worker": worker_id,
    }


def _claim_observer() -> Callable[[float], None] | None:
    """``metrics.observe_claim`` when the prometheus extra is installed, else None."""
    try:
        from django_fairqueue import metrics
    except (ImportError, ImproperlyConfigured):
        return None
    return metrics.observe_claim


def _send_robust(sig: Any, **kwargs: Any) -> None:
    """Send a django_fairqueue signal; a receiver's error is logged, never raised."""
    # `receivers` first: an empty list answers for the common case without has_listeners()
    # (about 2 us, twice per message)
    if not sig.receivers or not sig.has_listeners(Message):
        return
    for receiver, response in sig.send_robust(sender=Message, **kwargs):
        if isinstance(response, Exception):
            logger.error("signal receiver %r failed", receiver, exc_info=response)


def _log_extra(message: ClaimedMessage, **more: Any) -> dict[str, Any]:
    return {
        "channel": message.channel,
        "task": message.task_name,
        "message_id": message.id,
        "attempt": message.attempts,
        "max_attempts": message.max_attempts,
        **more,
    }


# ------------------------------------------------------------------------------------------------
# The worker


class Worker:
    """Claims messages fairly, runs them, and settles them. See the module docstring.

    :meth:`run` is the long-running, threaded loop (``runfairworker``); :meth:`run_once` is one
    synchronous claim -> run -> settle pass in the calling thread (tests, cron-like use).
    """

    def __init__(
        self,
        config: WorkerConfig | None = None,
        *,
        services: Sequence[Service] | None = None,
    ) -> None:
        self.config = config or WorkerConfig()
        cfg = conf.get()
        self.worker_id = self.config.worker_id
        self.lease = self.config.lease or timedelta(seconds=cfg.LEASE_SECONDS)
        self.poll_interval = self.config.poll_interval or cfg.POLL_INTERVAL
        self.listen = self.config.listen and cfg.NOTIFY
        self._services = services
        # Everything below is guarded by _cond (reentrant: stop() may run in a signal handler
        # while the claimer holds it). The timer waits on a condition of the same lock, so the
        # frequent notifications of _cond do not wake it.
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        self._timer_cond = threading.Condition(lock)
        # attempts running with a time limit, and the handler threads that are in the pool
        self._timed: set[_Attempt] = set()
        self._handlers: list[threading.Thread] = []
        self._handlers_started = 0  # for thread names
        self._handlers_closing = False  # told to stop: no more replacements
        self._abandoned = 0  # handler threads still stuck in a timed-out attempt
        self._recycling = False
        # messages this worker holds at most: running, plus waiting for a thread (prefetch)
        self._capacity = self.config.concurrency + self.config.prefetch
        # free slots worth a claim while a backlog is known (see GATHER_SECONDS)
        self._half_batch = max(1, min(self.config.batch_size, self._capacity) // 2)
        self._unsettled: dict[int, ClaimedMessage] = {}  # claimed, not yet written back
        self._lost: set[int] = set()  # unsettled, but a heartbeat found the lease gone
        # unsettled (or in a run_once pass): when the lease expires at the latest, on
        # _lease_clock (the claim or the last renewal, sent at that time, plus the lease)
        self._lease_deadlines: dict[int, float] = {}
        self._busy = 0  # handed to handler threads, not finished
        self._claimed = 0  # claimed and not given back (max_messages counts these)
        self._handled = 0  # settled: succeeded, retried or failed
        self._last_claim_at: datetime | None = None  # for the registry (operators' eyes only)
        self._wake = True  # claim as soon as a slot is free
        self._more = False  # the last claim was full: more may be ready
        self._next_poll = 0.0
        self._not_before = 0.0  # no claim before this (backoff, empty-claim retries)
        self._empty_claims = 0  # empty claims in a row
        # Set when the claim under way was asked for by a wake-up (LISTEN, a settlement, a
        # retry), not by the poll timer; and how many times an empty woken claim was retried.
        self._claim_woken = False
        self._woken_retries = 0
        self._due_misses = 0  # empty claims in a row while the database said work was due
        self._backlog_seen = False  # a full claim since the last empty-claim streak
        self._stop_requested = False
        self._release_unstarted = False
        self._signals = 0
        self._fatal: BaseException | None = None
        self._work: queue.SimpleQueue[ClaimedMessage | None] = queue.SimpleQueue()
        self._outcomes: queue.SimpleQueue[Outcome | None] = queue.SimpleQueue()
        self._threads_stop = StopFlag()
        self._settle_deadline: float | None = None
        #: Set once the listener's LISTEN is in place (and again after each reconnect).
        self.listening = threading.Event()
        self._discovered = False
        # statistics and claim latency: recorded by run() only (run_once is for tests and
        # one-off passes, whose tallies would never be flushed)
        self._stats: StatsRecorder | None = None
        self._observe_claim: Callable[[float], None] | None = None
        # channel filters, resolved from names to ids (channels may appear later)
        self._only_ids: list[int] | None = None
        self._exclude_ids: list[int] | None = None
        self._filters_resolved_at = -float("inf")
        self._filters_complete = False

    @property
    def handled(self) -> int:
        """Messages this worker ran and settled (succeeded, retried or failed)."""
        return self._handled

    # -- control ---------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop gracefully: claim nothing more, let running messages finish within the grace
        period, give back claimed messages that have not started. Safe from any thread and from
        a signal handler."""
        with self._cond:
            self._stop_requested = True
            self._release_unstarted = True
            self._cond.notify_all()

    def wake(self) -> None:
        """Claim as soon as a handler slot is free (work may be waiting)."""
        with self._cond:
            self._wake = True
            self._woken_retries = 0  # fresh news: its claim may be retried again
            self._cond.notify_all()

    def _on_signal(self, signum: int) -> None:
        self._signals += 1
        name = signal.Signals(signum).name
        if self._signals == 1:
            logger.warning(
                "%s received: claiming nothing more; waiting up to %ss for %d running messages "
                "(send it again to exit at once)",
                name,
                self.config.shutdown_grace,
                self._busy,
            )
            self.stop()
        else:
            logger.warning(
                "%s received again: exiting now; the leases of %d unfinished messages will "
                "expire and the rescuer will requeue them",
                name,
                len(self._unsettled),
            )
            os._exit(128 + signum)

    # -- the synchronous pass --------------------------------------------------------------------

    def run_once(self) -> int:
        """One pass in the calling thread: claim up to ``min(concurrency, batch_size)``
        messages, run them one after the other, settle them. Returns how many were handled
        (0 when nothing was ready).

        No heartbeats run: a pass must finish within the lease. Connection errors propagate.
        Inside ``transaction.atomic()`` (a test case), each task runs in a savepoint, so a task
        whose database error would break the transaction fails alone.
        """
        self._discover()
        limit = min(self.config.concurrency, self.config.batch_size, self._remaining())
        if limit <= 0:
            return 0
        alias = conf.get().DATABASE
        in_atomic = connections[alias].in_atomic_block
        if not in_atomic:
            close_old_connections()
        messages = self._claim(limit)
        outcomes = []
        for message in messages:
            if self._release_unstarted:
                outcomes.append(Outcome(message, "released"))
            elif self._lease_gone(message):
                self._drop(message)  # an earlier message of the pass outlasted the lease
            else:
                outcomes.append(self.execute(message, savepoint=in_atomic))
        handled = sum(o.kind != "released" for o in outcomes)
        with self._cond:
            self._claimed += handled
        self.settle(outcomes, savepoint=in_atomic)
        return handled

    # -- the threaded loop -----------------------------------------------------------------------

    def run(self) -> int:
        """Run until stopped; returns how many messages were handled.

        Stops on :meth:`stop` or the first SIGTERM/SIGINT (graceful), when ``burst`` finds
        nothing more to do, or after ``max_messages``. A second signal exits the process at
        once. Raises :class:`WorkerCrashed` if one of its threads failed unexpectedly.
        """
        self._discover()
        self._stats = StatsRecorder()
        self._observe_claim = _claim_observer()
        logger.info(
            "worker %s starting: %d threads, batch %d, lease %ss, poll %ss, listen %s%s",
            self.worker_id,
            self.config.concurrency,
            self.config.batch_size,
            self.lease.total_seconds(),
            self.poll_interval,
            "on" if self.listen else "off",
            ", burst" if self.config.burst else "",
            extra={"worker_id": self.worker_id},
        )
        # In the registry before the first claim (registering expires leases a previous
        # process with this worker id left behind, so none of this one's may exist yet).
        registration = Registration(
            self.worker_id,
            concurrency=self.config.concurrency,
            channels=self.config.channels,
            exclude_channels=self.config.exclude_channels,
        )
        registration.register()
        with stop_signals(self._on_signal):
            threads = self._start_threads(registration)
            try:
                self._claim_loop()
            except BaseException as exc:
                self._crashed("claimer", exc)
            finally:
                self._shutdown(threads)
        if self._fatal is None:
            registration.deregister(self._registry_beat())
        if self._fatal is not None:
            raise WorkerCrashed(f"worker {self.worker_id} stopped: {self._fatal!r}") from (
                self._fatal
            )
        logger.info(
            "worker %s stopped after %d messages",
            self.worker_id,
            self._handled,
            extra={"worker_id": self.worker_id},
        )
        return self._handled

    def _discover(self) -> None:
        # Import every task module once, before handler threads look tasks up concurrently.
        if not self._discovered:
            registry.autodiscover()
            self._discovered = True

    def _registry_beat(self) -> Beat:
        with self._cond:
            return Beat(self._busy, self._handled, self._last_claim_at)

    def _start_thread(self, name: str, target: Callable[[], None]) -> threading.Thread:
        thread = threading.Thread(
            target=self._guard, args=(name, target), name=f"fairqueue-{name}", daemon=True
        )
        thread.start()
        return thread

    def _start_handler(self) -> None:
        """Start a handler thread and count it in the pool (call with the lock held)."""
        self._handlers_started += 1
        thread = self._start_thread(f"handler-{self._handlers_started}", self._handler_loop)
        self._handlers.append(thread)

    def _start_threads(self, registration: Registration) -> dict[str, list[threading.Thread]]:
        start = self._start_thread
        with self._cond:
            for _ in range(self.config.concurrency):
                self._start_handler()
        threads: dict[str, list[threading.Thread]] = {
            "settler": [start("settler", self._settler_loop)],
            "heartbeat": [start("heartbeat", self._heartbeat_loop)],
            "timer": [start("timer", self._timer_loop)],
            "background": [
                start(
                    "registry",
                    lambda: registration.beat_until(self._threads_stop, self._registry_beat),
                )
            ],
        }
        if self.config.maintenance:
            threads["background"].append(start("maintenance", self._maintenance_loop))
        if self.listen:
            threads["background"].append(start("listener", self._listener_loop))
        return threads

    def _guard(self, name: str, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:
            self._crashed(name, exc)
        finally:
            connections.close_all()

    def _crashed(self, name: str, exc: BaseException) -> None:
        logger.critical("%s thread failed; stopping the worker", name, exc_info=exc)
        with self._cond:
            if self._fatal is None:
                self._fatal = exc
        self.stop()

    def _remaining(self) -> int:
        if self.config.max_messages is None:
            return self.config.batch_size
        return self.config.max_messages - self._claimed

    # claimer

    def _claim_loop(self) -> None:
        backoff = Backoff()
        while True:
            limit = self._wait_for_claim()
            if limit is None:
                return
            try:
                messages = self._claim(limit)
                drained = not messages and self._after_empty_claim()
            except CONNECTION_ERRORS as exc:
                what = after_database_error(exc)
                delay = backoff.next()
                logger.warning("claim failed: %s; retry in %.2fs", what, delay)
                with self._cond:
                    self._not_before = time.monotonic() + delay
                    self._wake = True
                continue
            backoff.reset()
            drop_broken_connection()
            if messages:
                self._last_claim_at = wall_clock()
            if messages and self._stats is not None:
                # the database's claim time: the lease runs from it
                self._stats.record_claimed(messages, messages[0].lease_expires_at - self.lease)
            self._dispatch(messages, limit)
            if drained:
                logger.info(
                    "burst: nothing left to claim, nor due within %gs", self.config.burst_horizon
                )
                return

    def _after_empty_claim(self) -> bool:
        """Decide what an empty claim means; returns True when a burst worker is done."""
        self._empty_claims += 1
        burst = self.config.burst
        if (self._backlog_seen or burst) and self._empty_claims <= EMPTY_CLAIM_RETRIES:
            # Right after a full claim this is probably contention, not an empty queue: try
            # again in a few milliseconds.
            self._retry_claim_in(random.uniform(0.002, 0.01) * self._empty_claims)
            return False
        self._backlog_seen = False
        if not burst:
            if self._claim_woken and self._woken_retries < WOKEN_CLAIM_RETRIES:
                # Woken for new work, yet the claim found none. The claim skips channel rows
                # other transactions hold (a concurrent claim, the maintenance thread folding
                # counters, an operator's edit), so the new message may sit behind a lock
                # held for a millisecond: a lock-free look tells that apart from a message
                # another worker already took, and a short retry then picks it up instead of
                # the next poll (a second later).
                only, exclude = self._filters()
                if store.select_claimable_exists(
                    only_channel_ids=only, exclude_channel_ids=exclude
                ):
                    delay = random.uniform(0.005, 0.01) * 2**self._woken_retries
                    self._woken_retries += 1
                    self._retry_claim_in(delay)
                    return False
            self._claim_when_due()
            return False  # wait for a wake-up, the poll, or the next work coming due
        with self._cond:
            if self._unsettled:
                return False  # running messages may retry; their settlement wakes us
        only, exclude = self._filters()
        if store.select_claimable_exists(only_channel_ids=only, exclude_channel_ids=exclude):
            self._retry_claim_in(random.uniform(0.01, 0.05))  # others hold it right now
            return False
        horizon = self.config.burst_horizon
        if horizon > 0:
            # Not done while work is due soon: a rate-limited channel's next turn, a retry or
            # a delayed message. The database tells how far off it is on its own clock.
            due_in = store.select_next_due(
                timedelta(seconds=horizon), only_channel_ids=only, exclude_channel_ids=exclude
            )
            if due_in is not None:
                logger.debug("burst: work due in %.3fs; waiting for it", due_in)
                self._retry_claim_in(max(due_in, 0.0) + random.uniform(0.002, 0.01))
                return False
        return True

    def _claim_when_due(self) -> None:
        """After an empty claim: claim again when the next work comes due (a rate-limited
        channel's next turn, a delayed message, a retry's backoff), if that is before the next
        poll. A wake-up still claims at once meanwhile: this only brings the poll forward.

        The database says how far off the work is, on its own clock (the one the claim compares
        due times with); the worker waits that long on its monotonic clock.
        """
        only, exclude = self._filters()
        if only == []:
            return
        due_in = store.select_next_due(
            timedelta(seconds=self.poll_interval * 1.2),
            only_channel_ids=only,
            exclude_channel_ids=exclude,
        )
        if due_in is None:
            self._due_misses = 0
            return
        if due_in <= 0:
            # Due already, yet the claim found nothing (it was taken, or something holds it):
            # back off so such work cannot make the worker spin.
            self._due_misses += 1
            wait = min(DUE_RETRY_FIRST * 2**self._due_misses, self.poll_interval)
        else:
            self._due_misses = 0
            wait = due_in + DUE_SLACK
        with self._cond:
            self._next_poll = min(self._next_poll, time.monotonic() + wait)

    def _retry_claim_in(self, seconds: float) -> None:
        with self._cond:
            self._not_before = time.monotonic() + seconds
            self._wake = True

    def _wait_for_claim(self) -> int | None:
        """Block until a claim is due; returns its size, or None to stop."""
        burst = self.config.burst
        # Outcomes waiting to be written: past this, claiming more would only pile up leases.
        settle_cap = 2 * max(self.config.batch_size, self._capacity)
        half_batch = self._half_batch
        gather_until: float | None = None
        with self._cond:
            while True:
                if self._stop_requested:
                    return None
                remaining = self._remaining()
                if remaining <= 0:
                    return None
                now = time.monotonic()
                if now < self._not_before:
                    self._cond.wait(self._not_before - now)
                    continue
                free = self._capacity - self._busy
                settling = len(self._unsettled) - self._busy
                if free > 0 and settling < settle_cap:
                    idle = not self._unsettled
                    if self._more and not self._wake and free < half_batch:
                        # a backlog, and only a few slots free yet: let more handlers finish
                        if gather_until is None:
                            gather_until = now + GATHER_SECONDS
                        if now < gather_until:
                            self._cond.wait(gather_until - now)
                            continue
                    if self._wake or self._more or now >= self._next_poll or (burst and idle):
                        self._claim_woken = self._wake
                        self._wake = False
                        # Poll again one (jittered) interval after the last claim of any kind.
                        self._next_poll = now + self.poll_interval * random.uniform(0.8, 1.2)
                        return min(free, self.config.batch_size, remaining)
                    timeout = self._next_poll - now
                else:
                    timeout = self.poll_interval
                self._cond.wait(timeout)

    def _dispatch(self, messages: list[ClaimedMessage], limit: int) -> None:
        if messages:
            self._empty_claims = 0
            self._due_misses = 0
        if len(messages) >= limit:
            self._backlog_seen = True
        with self._cond:
            self._more = len(messages) >= limit
            release = self._release_unstarted  # stopped while the claim was in flight
            for message in messages:
                self._unsettled[message.id] = message
            if not release:
                self._busy += len(messages)
                self._claimed += len(messages)
        for message in messages:
            if release:
                self._outcomes.put(Outcome(message, "released"))
            else:
                self._work.put(message)

    def _filters(self) -> tuple[list[int] | None, list[int] | None]:
        """Channel ids to claim from (None: all) and to leave alone (None: none)."""
        if not (self.config.channels or self.config.exclude_channels):
            return None, None
        self._resolve_channels()
        # no channel of the list exists yet: an empty list, which matches nothing
        only = (self._only_ids or []) if self.config.channels else None
        return only, self._exclude_ids

    def _claim(self, limit: int) -> list[ClaimedMessage]:
        """One claim honouring the channel filters."""
        only, exclude = self._filters()
        if only == []:
            return []  # none of the channels exists yet
        started = time.monotonic()
        sent = _lease_clock()  # the claim's database time is later than this
        messages = store.claim_messages(
            limit,
            lease=self.lease,
            worker_id=self.worker_id,
            only_channel_ids=only,
            exclude_channel_ids=exclude,
        )
        if self._observe_claim is not None:
            self._observe_claim(time.monotonic() - started)
        if self.config.channels or self.config.exclude_channels:
            # A channel deleted and re-created under a filtered name has a new id: a claim made
            # with stale ids may return it. Give such messages back untouched and re-resolve.
            wrong = [m for m in messages if not self._channel_allowed(m.channel)]
            if wrong:
                store.release_messages([(m.id, m.lease_token) for m in wrong])
                self._filters_resolved_at = -float("inf")
                messages = [m for m in messages if self._channel_allowed(m.channel)]
        if messages:
            deadline = sent + self.lease.total_seconds()
            with self._cond:
                for message in messages:
                    self._lease_deadlines[message.id] = deadline
        return messages

    def _channel_allowed(self, name: str) -> bool:
        if self.config.channels and name not in self.config.channels:
            return False
        return name not in self.config.exclude_channels

    def _resolve_channels(self) -> None:
        # Names that do not exist yet are looked up again every poll interval; once all exist,
        # every minute (a channel may be deleted and re-created with a new id).
        age = time.monotonic() - self._filters_resolved_at
        if age < (60.0 if self._filters_complete else self.poll_interval):
            return
        names = [*self.config.channels, *self.config.exclude_channels]
        ids = store.select_channel_ids(names)
        self._only_ids = [ids[n] for n in self.config.channels if n in ids] or None
        self._exclude_ids = [ids[n] for n in self.config.exclude_channels if n in ids] or None
        self._filters_complete = len(ids) == len(set(names))
        self._filters_resolved_at = time.monotonic()

    # handlers

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
            if self._release_unstarted:
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
        try:
            with _savepoints() if savepoint else contextlib.nullcontext():
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
        if attempt is not None and not self._end_attempt(attempt):
            logger.warning(
                "message %s (%s, channel %r) returned %.1fs after its time limit of %gs: "
                "discarded its outcome (%s); the attempt was settled as timed out at the limit",
                message.id,
                message.task_name,
                message.channel,
                outcome.duration - attempt.timeout,
                attempt.timeout,
                outcome.kind,
                extra=_log_extra(message, worker_id=self.worker_id, outcome="discarded"),
            )
            return None
        self._finished(outcome)
        return outcome

    # time limits

    def _start_attempt(self, message: ClaimedMessage, spec: TaskSpec) -> _Attempt | None:
        """Put an attempt under its task's time limit (None: the task has none)."""
        timeout = spec.effective_timeout
        if timeout is None:
            return None
        attempt = _Attempt(message, spec, threading.current_thread(), timeout, time.monotonic())
        with self._cond:
            self._timed.add(attempt)
            self._timer_cond.notify()  # it may be the next deadline
        return attempt

    def _end_attempt(self, attempt: _Attempt) -> bool:
        """The attempt returned: whether its outcome is still this thread's to settle (False
        when the timer settled it as timed out first)."""
        with self._cond:
            if attempt.abandoned:
                return False
            self._timed.discard(attempt)
            return True

    def _retire(self) -> None:
        """A thread abandoned to a timed-out attempt got it back: it leaves the worker (its
        replacement is running), no longer counted as stuck."""
        with self._cond:
            self._abandoned -= 1

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
        """Settle an attempt past its time limit as failed (retried while attempts remain)."""
        message = attempt.message
        exc = TaskTimeout(
            f"task {message.task_name} exceeded its time limit of {attempt.timeout:g} s "
            f"(attempt {message.attempts} of {message.max_attempts})"
        )
        error = error_info(exc, attempt=message.attempts, worker_id=self.worker_id)
        frame = sys._current_frames().get(attempt.thread.ident or -1)
        if frame is not None:  # where the task was stuck, for the operator
            stack = "".join(traceback.format_stack(frame))
            error["traceback"] = _storable(
                "Stack of the handler thread at the time limit (most recent call last):\n"
                f"{stack}{error['type']}: {error['message']}\n",
                MAX_TRACEBACK,
                keep_end=True,
            )
        outcome = self._failed(message, attempt.spec, exc, attempt.started, retry=True)
        outcome = dataclasses.replace(outcome, error=error)
        self._outcomes.put(outcome)
        with self._cond:
            stuck = self._abandoned
            recycle = stuck >= self.config.max_abandoned_threads and not self._recycling
            if recycle:
                self._recycling = True
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
        if outcome.kind == "succeeded":
            what = "succeeded"
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
        ]
        for verb, group in groups:
            if not group:
                continue
            written = self._write(verb, group, savepoint)
            ids = {o.message.id for o in group}
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
            )
            return self._write("fail", [failed], savepoint)

    def _write_statement(self, verb: str, group: list[Outcome]) -> dict[int, str]:
        if verb == "complete":
            done = store.complete_messages(
                [(o.message.id, o.message.lease_token, o.result) for o in group]
            )
            return {i: "succeeded" for i in done}
        if verb == "fail":
            return store.fail_messages(
                [(o.message.id, o.message.lease_token, o.error or {}, o.retry_in) for o in group]
            )
        released = store.release_messages([(o.message.id, o.message.lease_token) for o in group])
        return {i: "ready" for i in released}

    def _after_write(self, verb: str, group: list[Outcome], written: dict[int, str]) -> None:
        stats = self._stats
        if stats is not None and verb != "release":
            settled_at = timezone.now()  # one clock reading for the group
            for outcome in group:
                if outcome.message.id in written:
                    stats.record_settled(
                        outcome.message.channel_id,
                        _STATS_OUTCOME[outcome.kind],
                        outcome.duration * 1000.0,
                        at=settled_at,
                    )
        with self._cond:
            for outcome in group:
                message_id = outcome.message.id
                if self._unsettled.get(message_id, outcome.message) is not outcome.message:
                    continue  # its retry, claimed again already (a timed-out attempt's, say)
                self._unsettled.pop(message_id, None)
                self._lost.discard(message_id)
                self._lease_deadlines.pop(message_id, None)
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
                "rescuer requeued them, or an operator cancelled them); ids %s",
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

    def _heartbeat_loop(self) -> None:
        # Three renewals per lease period: one lost or late heartbeat never costs the lease.
        interval = self.lease.total_seconds() / 3
        backoff = Backoff()
        wait = interval
        while not self._threads_stop.wait(wait):
            wait = interval
            with self._cond:
                leases = [
                    (m.id, m.lease_token)
                    for m in self._unsettled.values()
                    if m.id not in self._lost
                ]
            if not leases:
                continue
            owned: set[int] = set()
            try:
                for start in range(0, len(leases), HEARTBEAT_BATCH):
                    chunk = leases[start : start + HEARTBEAT_BATCH]
                    sent = _lease_clock()  # the renewal's database time is later than this
                    renewed = store.heartbeat_messages(chunk, lease=self.lease)
                    owned |= renewed
                    deadline = sent + self.lease.total_seconds()
                    with self._cond:
                        for message_id in renewed:
                            if message_id in self._lease_deadlines:
                                self._lease_deadlines[message_id] = deadline
            except CONNECTION_ERRORS as exc:
                what = after_database_error(exc)
                wait = min(backoff.next(), interval)
                logger.warning("heartbeat failed: %s", what)
                continue
            backoff.reset()
            drop_broken_connection()
            with self._cond:
                lost = [i for i, _ in leases if i not in owned and i in self._unsettled]
                self._lost.update(lost)
            if lost:
                logger.warning(
                    "lost the lease of %d running messages (it expired, and another worker may "
                    "be running them); their outcome will not be recorded; ids %s",
                    len(lost),
                    lost[:20],
                    extra={"worker_id": self.worker_id, "outcome": "lease_lost"},
                )

    # maintenance and wake-ups

    def _maintenance_loop(self) -> None:
        def on_work(name: str, count: int) -> None:
            if name == "rescuer":
                self.wake()  # rescued messages are ready again

        MaintenanceRunner(
            self._services if self._services is not None else default_services(),
            stop=self._threads_stop,
            on_work=on_work,
        ).run()

    def _listener_loop(self) -> None:
        channel = conf.get().NOTIFY_CHANNEL
        backoff = Backoff(first=0.1, cap=5.0)
        connected_before = False
        while not self._threads_stop.is_set():
            conn: psycopg.Connection[Any] | None = None
            try:
                conn = psycopg.connect(**self._listener_params())
                store.listen_wakeups(conn, channel)
                logger.info(
                    "%s on %r for wake-ups",
                    "listening again" if connected_before else "listening",
                    channel,
                    extra={"worker_id": self.worker_id},
                )
                connected_before = True
                backoff.reset()
                self.listening.set()
                # Catch up on whatever was enqueued while we were not listening.
                self.wake()
                while not self._threads_stop.is_set():
                    for _ in conn.notifies(timeout=0.5):
                        self.wake()
            except psycopg.Error as exc:
                self.listening.clear()
                delay = backoff.next()
                logger.warning(
                    "wake-up listener lost its connection (%s); reconnecting in %.2fs "
                    "(polling continues)",
                    str(exc).strip(),
                    delay,
                )
                self._threads_stop.wait(delay)
            finally:
                if conn is not None:
                    conn.close()

    def _listener_params(self) -> dict[str, Any]:
        """psycopg.connect() arguments for the listener, from Django's settings of the database."""
        params = dict(connections[conf.get().DATABASE].get_connection_params())
        for django_only in ("cursor_factory", "context", "prepare_threshold"):
            params.pop(django_only, None)
        params["autocommit"] = True  # LISTEN takes effect at once, no transaction stays open
        params.setdefault("application_name", f"fairqueue listener {self.worker_id}"[:63])
        params.setdefault("connect_timeout", 10)
        # An idle connection whose peer vanished (network partition) is noticed within about a
        # minute instead of hanging until the OS gives up on TCP.
        params.setdefault("keepalives", 1)
        params.setdefault("keepalives_idle", 30)
        params.setdefault("keepalives_interval", 10)
        params.setdefault("keepalives_count", 3)
        return params

    # shutdown

    def _shutdown(self, threads: dict[str, list[threading.Thread]]) -> None:
        with self._cond:
            self._stop_requested = True
            graceful = self._release_unstarted
            self._cond.notify_all()
        # A graceful stop gives running messages the grace period; burst and max_messages
        # endings wait for them (they were claimed to be run).
        deadline = time.monotonic() + self.config.shutdown_grace if graceful else None
        if graceful:
            self._release_queued()
        with self._cond:
            while self._busy > 0 and self._fatal is None:
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    break
                self._cond.wait(timeout if timeout is not None else 1.0)
            abandoned = self._busy
        if abandoned:
            logger.warning(
                "%d messages still running after the %ss grace period: leaving them to their "
                "leases (the rescuer requeues them once they expire)",
                abandoned,
                self.config.shutdown_grace,
            )
        with self._cond:
            self._handlers_closing = True  # no more replacements: the pool is final
            handlers = list(self._handlers)
        for _ in handlers:
            self._work.put(None)
        # Write what is waiting, retrying through a database outage for at most the grace
        # period (at least a few seconds), then give up: the leases recover the rest.
        self._settle_deadline = time.monotonic() + max(self.config.shutdown_grace, 5.0)
        self._outcomes.put(None)
        for thread in threads["settler"]:
            thread.join()
        # Heartbeats run until everything is written, so no lease expires meanwhile.
        self._threads_stop.set()
        with self._timer_cond:
            self._timer_cond.notify()
        for thread in threads["heartbeat"] + threads["timer"] + threads["background"]:
            thread.join(timeout=10)
        if not abandoned:
            for thread in handlers:  # not those stuck past a time limit: they may never return
                thread.join(timeout=5)


_connections_made = threading.local()


def _note_connection(sender: Any, connection: Any, **kwargs: Any) -> None:
    _connections_made.any = True


# Which threads have connected to a database (connection_created is sent in the thread that
# connects, pooled connections included): a handler thread checks this flag instead of
# walking every configured database after each message.
connection_created.connect(_note_connection, dispatch_uid="django_fairqueue.worker")


def _connected_here() -> bool:
    """Whether the calling thread has ever opened a database connection."""
    return getattr(_connections_made, "any", False)


@contextlib.contextmanager
def _savepoints() -> Iterator[None]:
    """A savepoint on every connection of this thread that is inside ``atomic()``."""
    with contextlib.ExitStack() as stack:
        for wrapper in connections.all(initialized_only=True):
            if wrapper.in_atomic_block:
                stack.enter_context(transaction.atomic(using=wrapper.alias))
        yield


def _end_open_transactions(message: ClaimedMessage) -> None:
    """Roll back and drop any connection a task left inside a transaction.

    A task that enters ``atomic()`` without leaving it, or turns autocommit off, would leave its
    session idle in transaction (holding locks and the xmin horizon) until the thread's next
    message. Dropping the connection ends the transaction on the server.
    """
    for wrapper in connections.all(initialized_only=True):
        if wrapper.connection is None:
            continue
        if wrapper.in_atomic_block or not wrapper.get_autocommit():
            logger.error(
                "task %s (message %s) left a transaction open on database %r; rolled back",
                message.task_name,
                message.id,
                wrapper.alias,
            )
            # close() ends the session (or hands it back to the pool, which rolls it back);
            # a fresh wrapper then forgets the abandoned atomic() state.
            with contextlib.suppress(Exception):
                wrapper.close()
            del connections[wrapper.alias]


def _close_old_connections() -> None:
    try:
        close_old_connections()
    except Exception:  # closing a broken connection can fail; the next use reconnects
        logger.debug("closing an old connection failed", exc_info=True)

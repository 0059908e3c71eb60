"""The state every part of a worker shares, and what they all call: stop, wake, crash."""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

from django.db import connections

from django_fairqueue import conf
from django_fairqueue._runtime import (
    StopFlag,
)
from django_fairqueue.db.message_store import ClaimedMessage
from django_fairqueue.maintenance import Service
from django_fairqueue.registry import Beat
from django_fairqueue.stats import StatsRecorder
from django_fairqueue.taskspec import registry
from django_fairqueue.worker.config import (
    Outcome,
    WorkerConfig,
    _Attempt,
)

logger = logging.getLogger("django_fairqueue.worker")


class WorkerBase:
    """State shared by the worker's parts (see :class:`django_fairqueue.worker.Worker`)."""

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
        # every attempt running in a handler thread, by message id (abort requests find them)
        self._attempts: dict[int, _Attempt] = {}
        # unsettled messages whose abort was requested (seen by a heartbeat)
        self._abort_pending: set[int] = set()
        self._abort_grace = cfg.ABORT_GRACE
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
        # Outcomes being written by the settler: a renewal that no longer finds one running
        # met its settlement, not a lost lease (the settler reports a lease it finds lost).
        self._settling: set[int] = set()
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
        self._not_before = 0.0  # no claim before this (backoff, a burst's due work)
        self._due_misses = 0  # empty claims in a row while the database said work was claimable
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

    def _start_abort(self, attempt: _Attempt) -> None:
        """Put a running attempt on its abort's grace period (call with the lock held)."""
        if attempt.abort_seen or attempt.abandoned:
            return
        attempt.abort_seen = True
        attempt.abort_at = time.monotonic() + self._abort_grace
        self._timed.add(attempt)
        self._timer_cond.notify()  # it may be the next deadline

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

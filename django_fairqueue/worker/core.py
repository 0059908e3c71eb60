"""The worker: its services put together, started and stopped (see the package docstring)."""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

from django.db import close_old_connections, connections

from django_fairqueue import conf
from django_fairqueue.cli.terminal import printable
from django_fairqueue.db.message_store import ClaimedMessage
from django_fairqueue.maintenance import MaintenanceRunner, Service, default_services
from django_fairqueue.runtime import (
    CONNECTION_ERRORS,
    SAME_STOP_SECONDS,
    Backoff,
    after_database_error,
    stop_signals,
)
from django_fairqueue.runtime.attempts import RESCUED
from django_fairqueue.runtime.worker_registry import Beat, Registration
from django_fairqueue.stats import StatsRecorder
from django_fairqueue.tasks.spec import registry
from django_fairqueue.worker import service
from django_fairqueue.worker.claimer import Claimer
from django_fairqueue.worker.config import Outcome, WorkerConfig, WorkerCrashed
from django_fairqueue.worker.execution import claim_observer
from django_fairqueue.worker.heartbeat import Heartbeat
from django_fairqueue.worker.ledger import Ledger
from django_fairqueue.worker.listener import Listener
from django_fairqueue.worker.pool import Pool
from django_fairqueue.worker.settler import Settler
from django_fairqueue.worker.timer import Timer

logger = logging.getLogger("django_fairqueue.worker")


class Maintenance(service.Service):
    """The maintenance services (rescuer, pruner, delta folder, scheduler, ...) on their
    intervals (:class:`~django_fairqueue.maintenance.MaintenanceRunner`); ``on_rescued()``
    after the rescuer made messages ready again."""

    name = "maintenance"

    def __init__(self, services: Sequence[Service] | None, on_rescued: Callable[[], None]) -> None:
        super().__init__()

        def on_work(name: str, count: int) -> None:
            if name == "rescuer":
                on_rescued()

        self.runner = MaintenanceRunner(
            services if services is not None else default_services(),
            stop=self.stopping,
            on_work=on_work,
        )

    def run(self) -> None:
        self.runner.run()

    def run_once(self) -> dict[str, int]:
        return self.runner.run_once()


class RegistryBeat(service.Service):
    """Keeps this worker's row of the registry beating (operators' eyes, dead-worker checks)."""

    name = "registry"

    def __init__(self, registration: Registration, status: Callable[[], Beat]) -> None:
        super().__init__()
        self.registration = registration
        self.status = status

    def run(self) -> None:
        self.registration.beat_until(self.stopping, self.status)

    def run_once(self) -> None:
        self.registration.beat(self.status())


class Worker:
    """Claims messages fairly, runs them, and settles them. See the package docstring.

    :meth:`run` is the long-running, threaded loop (``runfairworker``); :meth:`run_once` is one
    synchronous claim -> run -> settle pass in the calling thread (tests, cron-like use).
    """

    def __init__(
        self,
        config: WorkerConfig | None = None,
        *,
        services: Sequence[Service] | None = None,
        before_register: Callable[[], None] | None = None,
    ) -> None:
        """``before_register``: a check of the database run once it answers, before the worker
        registers (``runfairworker``'s check that the migrations are applied, when the database
        was unavailable as it started); a connection error is waited out as registering's is."""
        self.config = config = config or WorkerConfig()
        self._before_register = before_register
        #: set by the first stop: ends a wait for the database at start-up
        self._stop_event = threading.Event()
        cfg = conf.get()
        self.worker_id = config.worker_id
        self.lease: timedelta = config.lease or cfg.lease
        self.poll_interval: float = config.poll_interval or cfg.POLL_INTERVAL
        self.listen = config.listen and cfg.NOTIFY
        self.ledger = Ledger(
            capacity=config.concurrency + config.prefetch, abort_grace=cfg.ABORT_GRACE
        )
        work: queue.SimpleQueue[ClaimedMessage | None] = queue.SimpleQueue()
        outcomes: queue.SimpleQueue[Outcome | None] = queue.SimpleQueue()
        self.claimer = Claimer(
            config, self.ledger, work, outcomes, lease=self.lease, poll_interval=self.poll_interval
        )
        self.pool = Pool(
            self.ledger,
            work,
            outcomes,
            concurrency=config.concurrency,
            worker_id=self.worker_id,
            on_free=self.claimer.slot_freed,
        )
        self.settler = Settler(
            self.ledger, outcomes, worker_id=self.worker_id, on_settled=self.claimer.settled
        )
        # Per-channel statistics and usage, from the threaded loop and the synchronous passes
        # alike: a message drained in a test or run by a cron-like pass counts as any other.
        self.settler.stats = self.claimer.stats = StatsRecorder()
        self.timer = Timer(
            self.ledger,
            outcomes,
            self.pool,
            worker_id=self.worker_id,
            max_stuck=config.max_abandoned_threads,
            stuck_limit=cfg.STUCK_TASK_LIMIT,
            on_recycle=self.recycle,
        )
        self.heartbeat = Heartbeat(self.ledger, lease=self.lease, worker_id=self.worker_id)
        self.listener = Listener(
            worker_id=self.worker_id, on_wake=self.claimer.wake, on_abort=self.heartbeat.poke
        )
        #: Set once the listener's LISTEN is in place (and again after each reconnect).
        self.listening = self.listener.listening
        self._services = services
        self._signals = 0
        #: when the first stop was asked (time.monotonic()); None: not asked
        self._stop_asked: float | None = None
        self._first_signal_at = 0.0
        self._recycling = False
        self._fatal: BaseException | None = None
        self._fatal_lock = threading.Lock()
        self._discovered = False

    @property
    def handled(self) -> int:
        """Messages this worker ran and settled (succeeded, retried or failed)."""
        return self.ledger.handled

    @property
    def unwritten(self) -> int:
        """Outcomes of messages it ran that it gave up writing at its stop (the database was
        unavailable until the grace period ended): the stop was not clean, and the rescuer takes
        those messages back once their leases expire."""
        return self.settler.unwritten

    @property
    def wants_replacing(self) -> bool:
        """Whether it stopped to be replaced by a fresh process: recycled (threads stuck in
        timed-out tasks), or ``max_messages`` claimed. Not a burst that ran the queue down."""
        limit = self.config.max_messages
        return self._recycling or (limit is not None and self.claimer.remaining() <= 0)

    # -- control ---------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop gracefully: claim nothing more, let running messages finish within the grace
        period, give back claimed messages that have not started. Safe from any thread and from
        a signal handler."""
        if self._stop_asked is None:
            self._stop_asked = time.monotonic()  # the grace period counts from here
        self._stop_event.set()
        self.ledger.give_back_unstarted()
        self.claimer.stop()

    def wake(self) -> None:
        """Claim as soon as a handler slot is free (work may be waiting)."""
        self.claimer.wake()

    def recycle(self, why: str) -> None:
        """Stop claiming, let the other messages finish (or give them back), then exit for a
        fresh process to take over: only the process's end stops a stuck thread. The stuck
        attempts are not written: their leases expire once the process is gone, and the
        rescuer settles them (a timeout, retried while attempts remain)."""
        if self._recycling:
            return
        self._recycling = True
        logger.warning(
            "worker %s recycling: %s; claiming nothing more, finishing the running messages, "
            "then exiting for a fresh process to take over",
            self.worker_id,
            why,
            extra={"worker_id": self.worker_id, "outcome": "recycle"},
        )
        self.stop()

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self._signals and now - self._first_signal_at < SAME_STOP_SECONDS:
            logger.info("%s received again within %gs: the same stop", name, SAME_STOP_SECONDS)
            return
        self._signals += 1
        if self._signals == 1:
            self._first_signal_at = now
            running = self.ledger.running
            logger.warning(
                "%s received: claiming nothing more; waiting up to %ss for %d running messages"
                "%s (send it again to exit at once)",
                name,
                self.config.shutdown_grace,
                running,
                # prefetched, waiting for a thread: given back at once
                f"; giving back {self.ledger.busy - running} not started"
                if self.ledger.busy > running
                else "",
            )
            self.stop()
        else:
            logger.warning(
                "%s received again: exiting now; the leases of %d unfinished messages will "
                "expire and the rescuer will take them back (%s)",
                name,
                len(self.ledger.unsettled_ids()),
                RESCUED,
            )
            os._exit(128 + signum)

    def _crashed(self, name: str, exc: BaseException) -> None:
        logger.critical("%s thread failed; stopping the worker", name, exc_info=exc)
        with self._fatal_lock:
            if self._fatal is None:
                self._fatal = exc
        self.stop()
        with self.pool.finished:
            self.pool.finished.notify_all()

    def _discover(self) -> None:
        # Import every task module once, before handler threads look tasks up concurrently.
        if not self._discovered:
            registry.autodiscover()
            self._discovered = True

    def _beat(self) -> Beat:
        return Beat(self.ledger.busy, self.ledger.handled, self.claimer.last_claim_at)

    # -- the synchronous pass --------------------------------------------------------------------

    def run_once(self) -> int:
        """One pass in the calling thread: claim up to ``min(concurrency, batch_size)``
        messages, run them one after the other, settle them and write their statistics and
        usage. Returns how many were handled (0 when nothing was ready).

        No heartbeats run: a pass must finish within the lease. Connection errors propagate.
        Inside ``transaction.atomic()`` (a test case), each task runs in a savepoint, so a task
        whose database error would break the transaction fails alone.
        """
        self._discover()
        limit = min(self.config.concurrency, self.config.batch_size, self.claimer.remaining())
        if limit <= 0:
            return 0
        in_atomic = connections[conf.get().DATABASE].in_atomic_block
        if not in_atomic:
            close_old_connections()
        messages, lease_deadline = self.claimer.claim(limit)
        self.ledger.claimed_now(messages, lease_deadline, running=False)
        outcomes = []
        for message in messages:
            if self.ledger.release_unstarted:
                outcomes.append(Outcome(message, "released"))
            elif self.ledger.lease_gone(message):
                self.pool.drop(message)  # an earlier message of the pass outlasted the lease
            else:
                outcomes.append(self.pool.execute(message, savepoint=in_atomic))
        ran = sum(o.kind != "released" for o in outcomes)
        self.ledger.counted(ran)
        self.settle(outcomes, savepoint=in_atomic)
        self.settler.flush_stats()  # no flushing thread runs: the pass writes its own
        return ran

    def execute(self, message: ClaimedMessage, *, savepoint: bool = False) -> Outcome:
        """Run one claimed message's task here and now (see :meth:`Pool.execute`)."""
        return self.pool.execute(message, savepoint=savepoint)

    def settle(self, outcomes: list[Outcome], *, savepoint: bool = False) -> None:
        """Write outcomes back (see :meth:`Settler.settle`)."""
        self.settler.settle(outcomes, savepoint=savepoint)

    # -- the threaded loop -----------------------------------------------------------------------

    def _register(self, registration: Registration) -> bool:
        """Register (after the ``before_register`` check), waiting out a database that is
        unavailable (starting, restarting, failing over: workers and database started together)
        as the claim would, instead of stopping. False when a stop came first."""
        backoff = Backoff(cap=5.0)
        while not self._stop_event.is_set():
            try:
                if self._before_register is not None:
                    self._before_register()
                    self._before_register = None  # passed: not again when registering fails
                registration.register()
                return True
            except CONNECTION_ERRORS as exc:
                delay = backoff.next()
                logger.warning(
                    "worker %s: registering failed: %s; retry in %.2fs",
                    printable(self.worker_id),
                    after_database_error(exc),
                    delay,
                )
                self._stop_event.wait(delay)
        return False

    def run(self) -> int:
        """Run until stopped; returns how many messages were handled.

        Stops on :meth:`stop` or the first SIGTERM/SIGINT (graceful), when ``burst`` finds
        nothing more to do, or after ``max_messages``. A second signal exits the process at
        once. Raises :class:`WorkerCrashed` if one of its threads failed unexpectedly. Outcomes
        it could not write by the end of the grace period are counted in :attr:`unwritten`.
        """
        self._discover()
        self.claimer.observe_claim = claim_observer()
        logger.info(
            "worker %s starting: %d threads, batch %d, lease %ss, poll %ss, listen %s, fair by "
            "%s%s",
            printable(self.worker_id),  # (anyone's to choose: escaped for any handler)
            self.config.concurrency,
            self.config.batch_size,
            self.lease.total_seconds(),
            self.poll_interval,
            "on" if self.listen else "off",
            conf.get().FAIRNESS,  # (a fleet runs one mode: the log shows each worker's)
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
            queues=self.config.queues,
        )
        # (under the stop signals: a SIGTERM while the database is unavailable is a graceful
        # stop of a worker that claimed nothing)
        with stop_signals(self._on_signal):
            if not self._register(registration):
                logger.info(
                    "worker %s stopped before it could register (the database was unavailable)",
                    printable(self.worker_id),
                    extra={"worker_id": self.worker_id},
                )
                return 0
            background: list[service.Service] = [
                self.timer,
                RegistryBeat(registration, self._beat),
            ]
            if self.config.maintenance:
                background.append(Maintenance(self._services, on_rescued=self.claimer.wake))
            if self.listen:
                background.append(self.listener)
            self.pool.start(self._crashed)
            for part in (self.settler, self.heartbeat, *background):
                part.start(self._crashed)
            try:
                self.claimer.run()
            except BaseException as exc:
                self._crashed("claimer", exc)
            finally:
                self._shutdown(background)
        if self._fatal is None:
            registration.deregister(self._beat())
        if self._fatal is not None:
            raise WorkerCrashed(f"worker {self.worker_id} stopped: {self._fatal!r}") from (
                self._fatal
            )
        if self.unwritten:
            logger.error(
                "worker %s stopped after %d messages; %d more ran but their outcomes were not "
                "written (the database was unavailable until the grace period ended): the "
                "rescuer takes them back once their leases expire (%s)",
                self.worker_id,
                self.handled,
                self.unwritten,
                RESCUED,
                extra={"worker_id": self.worker_id, "outcome": "unwritten"},
            )
            return self.handled
        logger.info(
            "worker %s stopped after %d messages",
            self.worker_id,
            self.handled,
            extra={"worker_id": self.worker_id},
        )
        return self.handled

    def _shutdown(self, background: list[service.Service]) -> None:
        self.claimer.stop()
        # A graceful stop gives running messages the grace period from the stop signal; burst
        # and max_messages endings wait for them (they were claimed to be run).
        asked = self._stop_asked
        deadline = asked + self.config.shutdown_grace if asked is not None else None
        if asked is not None:
            self.pool.release_queued()
        running = self.pool.wait_idle(deadline, give_up=lambda: self._fatal is not None)
        if running:
            logger.warning(
                "%d messages still running after the %ss grace period: left behind (their "
                "leases expire as the worker stops, and the rescuer takes them back: %s)",
                running,
                self.config.shutdown_grace,
                RESCUED,
            )
        stuck = self.ledger.stuck_messages()
        if stuck:
            logger.warning(
                "%d timed-out attempts still hold a handler thread: not written; their leases "
                "expire once this process is gone and the rescuer settles them; ids %s",
                len(stuck),
                stuck[:20],
                extra={"worker_id": self.worker_id, "outcome": "lease_lost"},
            )
        handlers = self.pool.stop()  # no more replacements: the pool is final
        # Write what is waiting, retrying through a database outage until the grace period
        # ends, then give up (the leases recover the rest; the exit status says so). A graceful
        # stop counts it from the stop signal, for the running messages and their outcomes
        # together: it is the budget the operator gives the whole stop, the process manager's
        # stop timeout set just above it, and a worker that waited the grace for its messages
        # and then as long again for the database would be killed mid-retry, saying nothing.
        # An ending of its own (burst, max_messages) has no such budget: from now.
        if deadline is None:
            deadline = time.monotonic() + self.config.shutdown_grace
        self.settler.stop(deadline)
        self.settler.join()
        # Heartbeats run until everything is written, so no lease expires meanwhile.
        for part in (self.heartbeat, *background):
            part.stop()
        for part in (self.heartbeat, *background):
            part.join(timeout=10)
        if not running:
            for thread in handlers:  # not those stuck past a time limit: they may never return
                thread.join(timeout=5)

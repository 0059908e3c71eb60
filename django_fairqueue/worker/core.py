"""The worker: its parts put together, started and stopped (see the package docstring)."""

from __future__ import annotations

import logging
import threading
import time

from django.db import close_old_connections, connections

from django_fairqueue import conf
from django_fairqueue._runtime import (
    stop_signals,
)
from django_fairqueue.maintenance import MaintenanceRunner, default_services
from django_fairqueue.registry import Registration
from django_fairqueue.stats import StatsRecorder
from django_fairqueue.worker.claimer import Claimer
from django_fairqueue.worker.config import (
    Outcome,
    WorkerCrashed,
)
from django_fairqueue.worker.execution import (
    _claim_observer,
)
from django_fairqueue.worker.heartbeat import Heartbeat
from django_fairqueue.worker.listener import Listener
from django_fairqueue.worker.settler import Settler
from django_fairqueue.worker.timeouts import TimeLimits

logger = logging.getLogger("django_fairqueue.worker")


class Worker(Claimer, TimeLimits, Settler, Heartbeat, Listener):
    """Claims messages fairly, runs them, and settles them. See the module docstring.

    :meth:`run` is the long-running, threaded loop (``runfairworker``); :meth:`run_once` is one
    synchronous claim -> run -> settle pass in the calling thread (tests, cron-like use).
    """

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
            queues=self.config.queues,
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

    def _maintenance_loop(self) -> None:
        def on_work(name: str, count: int) -> None:
            if name == "rescuer":
                self.wake()  # rescued messages are ready again

        MaintenanceRunner(
            self._services if self._services is not None else default_services(),
            stop=self._threads_stop,
            on_work=on_work,
        ).run()

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

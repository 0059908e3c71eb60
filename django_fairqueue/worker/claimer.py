"""The claimer: claims fairly when a slot is free and work may wait, and wakes when it is due.

It claims up to the free handler slots plus ``prefetch`` (at most ``batch_size``) in one
``claim_messages`` call, whenever a slot is free and work may be waiting: after a full claim, on
a wake-up (LISTEN, a settlement, a rescue), when a retry or a delayed message comes due (it asks
the database when after an empty claim), when a burst worker is idle, or when the jittered poll
interval has passed. Its own state (when to claim next) is its own; what it claimed goes into
the ledger and onto the pool's queue.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta

from django_fairqueue import conf
from django_fairqueue.db import channel_store, message_store
from django_fairqueue.db.message_store import ClaimedMessage
from django_fairqueue.runtime import (
    CONNECTION_ERRORS,
    Backoff,
    after_database_error,
    drop_broken_connection,
)
from django_fairqueue.runtime.worker_registry import wall_clock
from django_fairqueue.stats import StatsRecorder
from django_fairqueue.tasks.spec import registry
from django_fairqueue.worker.config import (
    DUE_RETRY_FIRST,
    DUE_SLACK,
    GATHER_SECONDS,
    Outcome,
    WorkerConfig,
    lease_clock,
)
from django_fairqueue.worker.ledger import Ledger
from django_fairqueue.worker.service import Service

logger = logging.getLogger("django_fairqueue.worker")


class Claimer(Service):
    """The claimer: claims when a slot is free and work may wait, and when work comes due."""

    name = "claimer"

    def __init__(
        self,
        config: WorkerConfig,
        ledger: Ledger,
        work: queue.SimpleQueue[ClaimedMessage | None],
        outcomes: queue.SimpleQueue[Outcome | None],
        *,
        lease: timedelta,
        poll_interval: float,
    ) -> None:
        super().__init__()
        self.config = config
        self.ledger = ledger
        self.work = work
        self.outcomes = outcomes
        self.lease = lease
        self.poll_interval = poll_interval
        self._cond = threading.Condition(threading.RLock())  # RLock: stop() from a signal
        self._stop = False
        self._wake = True  # claim as soon as a slot is free
        self._more = False  # the last claim was full: more may be ready
        self._next_poll = 0.0
        self._not_before = 0.0  # no claim before this (backoff, a burst's due work)
        #: empty claims in a row while the database said work was claimable
        self.due_misses = 0
        # free slots worth a claim while a backlog is known (see GATHER_SECONDS)
        capacity = ledger.capacity
        self._half_batch = max(1, min(config.batch_size, capacity) // 2)
        # Outcomes waiting to be written: past this, claiming more would only pile up leases.
        self._settle_cap = 2 * max(config.batch_size, capacity)
        #: when this worker last claimed something (for the registry: operators' eyes only)
        self.last_claim_at: datetime | None = None
        #: statistics (set by the worker); claim latency: a running worker's only
        self.stats: StatsRecorder | None = None
        self.observe_claim: Callable[[float], None] | None = None
        # channel filters, resolved from names to ids (channels may appear later)
        self._only_ids: list[int] | None = None
        self._exclude_ids: list[int] | None = None
        self._filters_resolved_at = -float("inf")
        self._filters_complete = False

    # -- what other services tell it ---------------------------------------------------------------

    def wake(self) -> None:
        """Claim as soon as a slot is free (work may be waiting)."""
        with self._cond:
            self._wake = True
            self._cond.notify_all()

    def stop(self) -> None:
        """Claim nothing more. Safe from a signal handler."""
        super().stop()
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def slot_freed(self, free: int) -> None:
        """A handler finished a message: claim again when that makes a claim due (the first
        free slot, half a batch free while gathering, or nothing running: a stop waits)."""
        if free == 1 or free == self._half_batch or free == self.ledger.capacity:
            with self._cond:
                self._cond.notify_all()

    def settled(self, freed: bool) -> None:
        """Outcomes were written. A freed slot can make a capped channel claimable again, and
        a retry without backoff is ready now: neither sends a notification, so claim again
        (with a backlog known, the claimer claims as slots free anyway)."""
        with self._cond:
            if freed and not self._more:
                self._wake = True
            self._cond.notify_all()

    def remaining(self) -> int:
        """Messages this worker may still claim (max_messages)."""
        if self.config.max_messages is None:
            return self.config.batch_size
        return self.config.max_messages - self.ledger.claimed

    # -- the loop ----------------------------------------------------------------------------------

    def run(self) -> None:
        """Claim until stopped, max_messages reached, or a burst is done."""
        backoff = Backoff()
        while True:
            limit = self._wait_for_claim()
            if limit is None:
                return
            try:
                drained = self.run_once(limit)
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
            if drained:
                logger.info(
                    "burst: nothing left to claim, nor due within %gs", self.config.burst_horizon
                )
                return

    def run_once(self, limit: int | None = None) -> bool:
        """One claim of up to ``limit`` messages (default: what is free), handed to the pool;
        after an empty one, when to claim next. Returns True when a burst worker is done.
        Connection errors propagate."""
        if limit is None:
            limit = min(self.ledger.free(), self.config.batch_size, self.remaining())
            if limit <= 0:
                return False
        messages, lease_deadline = self.claim(limit)
        drained = not messages and self._after_empty_claim()
        if messages:
            self.last_claim_at = wall_clock()
        self._dispatch(messages, limit, lease_deadline)
        return drained

    def _after_empty_claim(self) -> bool:
        """What an empty claim means, decided one way: ask the database when work this worker
        may claim comes (one lock-free statement, on its own clock), and claim then.

        The claim itself already waited (``CLAIM_WAIT``) for channels concurrent claims held,
        and for channels they had just folded. So what is left:

        * work claimable now (another transaction still holds it, or took it first): claim
          again after a short backoff, doubling up to the poll interval;
        * work due later (a rate-limited channel's next turn, a delayed message, a retry's
          backoff): claim when it is due;
        * a running message whose lease expired, when this worker runs the rescuer (its first
          pass runs beside the first claims): claim again after a short backoff, as above,
          until the rescuer has taken it back;
        * nothing within the horizon (the poll interval; ``burst_horizon`` in burst mode): wait
          for a wake-up or the poll. A burst worker is then done, once its own running
          messages are settled (they may retry, and their settlement wakes it).

        A wake-up (LISTEN, a settlement) still claims at once meanwhile. Returns True when a
        burst worker is done.
        """
        burst = self.config.burst
        only, exclude = self._filters()
        horizon = self.config.burst_horizon if burst else self.poll_interval * 1.2
        # Read before asking the database: a message settled after this reading may have been
        # requeued (a retry) after the question below was answered, so only a worker with
        # nothing unsettled before asking may call its burst done.
        settled_before_asking = self.ledger.idle()
        due_in = None
        if only != []:  # (no channel of --channels exists yet: nothing to ask about)
            due_in = message_store.select_next_due(
                timedelta(seconds=horizon),
                only_channel_ids=only,
                exclude_channel_ids=exclude,
                queues=self.config.queues,
                # a dead worker's expired lease: this worker's rescuer makes it ready (or a
                # dead letter) in a moment, so a burst worker waits for it
                rescuing=self.config.maintenance,
            )
        if due_in is None:
            self.due_misses = 0
            if not burst:
                return False
            # otherwise a settlement is still to come, and it wakes the claimer
            return settled_before_asking
        if due_in <= 0:
            self.due_misses += 1
            wait = min(DUE_RETRY_FIRST * 2**self.due_misses, self.poll_interval)
        else:
            self.due_misses = 0
            wait = due_in + DUE_SLACK
        if burst:
            logger.debug("burst: work due in %.3fs; claiming then", max(due_in, 0.0))
            self._retry_claim_in(wait)
        else:
            with self._cond:
                self._next_poll = min(self._next_poll, time.monotonic() + wait)
        return False

    def _retry_claim_in(self, seconds: float) -> None:
        with self._cond:
            self._not_before = time.monotonic() + seconds
            self._wake = True

    def _wait_for_claim(self) -> int | None:
        """Block until a claim is due; returns its size, or None to stop."""
        burst = self.config.burst
        half_batch = self._half_batch
        gather_until: float | None = None
        with self._cond:
            while True:
                if self._stop:
                    return None
                remaining = self.remaining()
                if remaining <= 0:
                    return None
                now = time.monotonic()
                if now < self._not_before:
                    self._cond.wait(self._not_before - now)
                    continue
                free = self.ledger.free()
                if free > 0 and self.ledger.settling() < self._settle_cap:
                    if self._more and not self._wake and free < half_batch:
                        # a backlog, and only a few slots free yet: let more handlers finish
                        if gather_until is None:
                            gather_until = now + GATHER_SECONDS
                        if now < gather_until:
                            self._cond.wait(gather_until - now)
                            continue
                    idle = self.ledger.idle()
                    if self._wake or self._more or now >= self._next_poll or (burst and idle):
                        self._wake = False
                        # Poll again one (jittered) interval after the last claim of any kind.
                        self._next_poll = now + self.poll_interval * random.uniform(0.8, 1.2)
                        return min(free, self.config.batch_size, remaining)
                    timeout = self._next_poll - now
                else:
                    timeout = self.poll_interval
                self._cond.wait(timeout)

    def _dispatch(self, messages: list[ClaimedMessage], limit: int, lease_deadline: float) -> None:
        if messages:
            self.due_misses = 0
        with self._cond:
            self._more = len(messages) >= limit
        if not messages:
            return
        if self.ledger.claimed_now(messages, lease_deadline):
            for message in messages:
                self.work.put(message)
        else:  # stopped while the claim was in flight
            for message in messages:
                self.outcomes.put(Outcome(message, "released"))

    def _filters(self) -> tuple[list[int] | None, list[int] | None]:
        """Channel ids to claim from (None: all) and to leave alone (None: none)."""
        if not (self.config.channels or self.config.exclude_channels):
            return None, None
        self._resolve_channels()
        # no channel of the list exists yet: an empty list, which matches nothing
        only = (self._only_ids or []) if self.config.channels else None
        return only, self._exclude_ids

    def claim(self, limit: int) -> tuple[list[ClaimedMessage], float]:
        """One claim honouring the channel filters, and when its leases expire at the latest
        on :func:`lease_clock` (recorded nowhere: see :meth:`run_once`)."""
        only, exclude = self._filters()
        if only == []:
            return [], 0.0  # none of the channels exists yet
        started = time.monotonic()
        sent = lease_clock()  # the claim's database time is later than this
        messages = message_store.claim_messages(
            limit,
            lease=self.lease,
            worker_id=self.config.worker_id,
            only_channel_ids=only,
            exclude_channel_ids=exclude,
            queues=self.config.queues,
            async_commit=conf.get().ASYNC_COMMIT,
            durable_tasks=registry.at_most_once_names(),
        )
        if self.observe_claim is not None:
            self.observe_claim(time.monotonic() - started)
        if self.config.channels or self.config.exclude_channels:
            # A channel deleted and re-created under a filtered name has a new id: a claim made
            # with stale ids may return it. Give such messages back untouched and re-resolve.
            wrong = [m for m in messages if not self._channel_allowed(m.channel)]
            if wrong:
                message_store.release_messages([(m.id, m.lease_token) for m in wrong])
                self._filters_resolved_at = -float("inf")
                messages = [m for m in messages if self._channel_allowed(m.channel)]
        if messages and self.stats is not None:  # the threaded loop's claims and run_once's
            # the database's claim time: the lease runs from it
            self.stats.record_claimed(messages, messages[0].lease_expires_at - self.lease)
        return messages, sent + self.lease.total_seconds()

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
        # (a name has a channel row in each queue it has work in: every one of the served
        # queues counts)
        rows = channel_store.select_channel_ids_in_queues(names, self.config.queues)
        only = set(self.config.channels)
        self._only_ids = [cid for cid, _queue, name in rows if name in only] or None
        self._exclude_ids = [cid for cid, _queue, name in rows if name not in only] or None
        self._filters_complete = {name for _cid, _queue, name in rows} == set(names)
        self._filters_resolved_at = time.monotonic()

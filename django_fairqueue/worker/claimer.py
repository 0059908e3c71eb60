"""The claimer: claims fairly when a slot is free and work may wait, and wakes when it is due."""

from __future__ import annotations

import logging
import random
import time
from datetime import timedelta

from django_fairqueue._runtime import (
    CONNECTION_ERRORS,
    Backoff,
    after_database_error,
    drop_broken_connection,
)
from django_fairqueue.db import channel_store, message_store
from django_fairqueue.db.message_store import ClaimedMessage
from django_fairqueue.registry import wall_clock
from django_fairqueue.worker.base import WorkerBase
from django_fairqueue.worker.config import (
    DUE_RETRY_FIRST,
    DUE_SLACK,
    GATHER_SECONDS,
    Outcome,
    _lease_clock,
)

logger = logging.getLogger("django_fairqueue.worker")


class Claimer(WorkerBase):
    """The claimer: claims when a slot is free and work may wait, and when work comes due."""

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
        """What an empty claim means, decided one way: ask the database when work this worker
        may claim comes (one lock-free statement, on its own clock), and claim then.

        The claim itself already waited (``CLAIM_WAIT``) for channels concurrent claims held,
        and for channels they had just folded. So what is left:

        * work claimable now (another transaction still holds it, or took it first): claim
          again after a short backoff, doubling up to the poll interval;
        * work due later (a rate-limited channel's next turn, a delayed message, a retry's
          backoff): claim when it is due;
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
        with self._cond:
            settled_before_asking = not self._unsettled
        due_in = None
        if only != []:  # (no channel of --channels exists yet: nothing to ask about)
            due_in = message_store.select_next_due(
                timedelta(seconds=horizon),
                only_channel_ids=only,
                exclude_channel_ids=exclude,
                queues=self.config.queues,
            )
        if due_in is None:
            self._due_misses = 0
            if not burst:
                return False
            # otherwise a settlement is still to come, and it wakes the claimer
            return settled_before_asking
        if due_in <= 0:
            self._due_misses += 1
            wait = min(DUE_RETRY_FIRST * 2**self._due_misses, self.poll_interval)
        else:
            self._due_misses = 0
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
            self._due_misses = 0
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
        messages = message_store.claim_messages(
            limit,
            lease=self.lease,
            worker_id=self.worker_id,
            only_channel_ids=only,
            exclude_channel_ids=exclude,
            queues=self.config.queues,
        )
        if self._observe_claim is not None:
            self._observe_claim(time.monotonic() - started)
        if self.config.channels or self.config.exclude_channels:
            # A channel deleted and re-created under a filtered name has a new id: a claim made
            # with stale ids may return it. Give such messages back untouched and re-resolve.
            wrong = [m for m in messages if not self._channel_allowed(m.channel)]
            if wrong:
                message_store.release_messages([(m.id, m.lease_token) for m in wrong])
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
        # (a name has a channel row in each queue it has work in: every one of the served
        # queues counts)
        rows = channel_store.select_channel_ids_in_queues(names, self.config.queues)
        only = set(self.config.channels)
        self._only_ids = [cid for cid, _queue, name in rows if name in only] or None
        self._exclude_ids = [cid for cid, _queue, name in rows if name not in only] or None
        self._filters_complete = {name for _cid, _queue, name in rows} == set(names)
        self._filters_resolved_at = time.monotonic()

    # handlers

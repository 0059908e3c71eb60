"""The in-flight ledger: what a worker holds between a claim and its settlement.

One object, one lock, a small API. The services (claimer, pool, timer, settler, heartbeat)
each keep their own state and meet only here: which messages are claimed and not yet written
back, when each lease expires by this process's clock, which of them lost their lease or were
asked to abort, which attempts run (and under which time limit), which timed-out attempts still
hold a stuck thread, and the counts a claim is sized by. No method calls out of the ledger while
holding its lock, so a service may call it under a lock of its own.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence

from django_fairqueue.db.message_store import ClaimedMessage
from django_fairqueue.tasks.spec import TaskSpec
from django_fairqueue.worker.config import Attempt, Outcome, lease_clock


class Ledger:
    """Claimed, unsettled messages and their running attempts (see the module docstring)."""

    def __init__(self, *, capacity: int, abort_grace: float) -> None:
        #: messages this worker holds at most: running, plus waiting for a thread (prefetch)
        self.capacity = capacity
        self.abort_grace = abort_grace
        self._lock = threading.Lock()
        #: notified when an attempt gets a deadline (a time limit, an abort's grace period):
        #: the timer waits on it
        self.deadlines = threading.Condition(self._lock)
        self._unsettled: dict[int, ClaimedMessage] = {}
        self._lost: set[int] = set()  # unsettled, but a heartbeat found the lease gone
        # Outcomes the settler is writing: a renewal that no longer finds one running met its
        # settlement, not a lost lease (the settler reports a lease it finds lost).
        self._writing: set[int] = set()
        # when each unsettled lease expires at the latest, on lease_clock
        self._lease_deadlines: dict[int, float] = {}
        self._abort_pending: set[int] = set()
        # handed to the pool and not taken by a handler thread yet (prefetched), by id; and
        # those of them an abort settled, until a thread takes them off the pool's queue
        self._waiting: dict[int, ClaimedMessage] = {}
        self._aborted_waiting: dict[int, ClaimedMessage] = {}
        #: settles the messages an abort took before a handler thread did (set by the pool)
        self.abort_unstarted: Callable[[list[ClaimedMessage]], None] | None = None
        self._attempts: dict[int, Attempt] = {}  # running in a handler thread, by message id
        self._timed: set[Attempt] = set()  # running with a deadline
        self._stuck: set[Attempt] = set()  # timed out; its thread has not returned yet
        self._busy = 0  # handed to handler threads (or waiting for one), not finished
        self._claimed = 0  # claimed and not given back (max_messages counts these)
        self._handled = 0  # settled: succeeded, retried or failed
        self._release_unstarted = False

    # -- counts ------------------------------------------------------------------------------------

    @property
    def handled(self) -> int:
        return self._handled

    @property
    def claimed(self) -> int:
        return self._claimed

    @property
    def busy(self) -> int:
        return self._busy

    @property
    def running(self) -> int:
        """Messages running in a handler thread now (``busy`` counts those waiting for one)."""
        return len(self._attempts)

    @property
    def stuck(self) -> int:
        """Timed-out attempts whose thread has not returned yet."""
        return len(self._stuck)

    def free(self) -> int:
        """Messages a claim may take now."""
        return self.capacity - self._busy

    def settling(self) -> int:
        """Claimed messages not running nor waiting for a thread: their outcome waits to be
        written (a timed-out attempt's, until its thread returns)."""
        with self._lock:
            return len(self._unsettled) - self._busy

    def idle(self) -> bool:
        """Nothing claimed and unsettled."""
        return not self._unsettled

    def unsettled_ids(self) -> list[int]:
        with self._lock:
            return list(self._unsettled)

    # -- giving back -------------------------------------------------------------------------------

    @property
    def release_unstarted(self) -> bool:
        """Set by a graceful stop: claimed messages not started yet go back to the queue."""
        return self._release_unstarted

    def give_back_unstarted(self) -> None:
        self._release_unstarted = True

    # -- claims ------------------------------------------------------------------------------------

    def claimed_now(
        self, messages: Sequence[ClaimedMessage], lease_deadline: float, *, running: bool = True
    ) -> bool:
        """Record a claim whose leases expire at ``lease_deadline`` (on ``lease_clock``), its
        messages handed to the pool (``running``; else run by the caller, who counts them with
        :meth:`counted`). Returns False when a stop came meanwhile: give them back (they are
        recorded, not counted as running)."""
        with self._lock:
            for message in messages:
                self._unsettled[message.id] = message
                self._lease_deadlines[message.id] = lease_deadline
            if self._release_unstarted or not running:
                return False
            self._waiting.update((message.id, message) for message in messages)
            self._busy += len(messages)
            self._claimed += len(messages)
            return True

    def counted(self, handled: int) -> None:
        """A synchronous pass ran ``handled`` messages (max_messages counts them)."""
        with self._lock:
            self._claimed += handled

    def take(self, message: ClaimedMessage) -> bool:
        """A handler thread takes ``message`` off the pool's queue: False when an abort took
        it first (settled aborted already: only its slot is left to free)."""
        with self._lock:
            if self._aborted_waiting.get(message.id) is message:
                del self._aborted_waiting[message.id]
                return False
            if self._waiting.get(message.id) is message:
                del self._waiting[message.id]
            return True

    def not_started(self, *, ran: bool) -> int:
        """A message handed to the pool left it (``ran``: it ran); returns the free slots."""
        with self._lock:
            self._busy -= 1
            if not ran:
                self._claimed -= 1  # not run: max_messages does not count it
            return self.capacity - self._busy

    # -- leases ------------------------------------------------------------------------------------

    def lease_gone(self, message: ClaimedMessage) -> bool:
        """Whether the lease of a message is known lost (a heartbeat found it gone) or expired
        by this process's clock."""
        # single lookups, safe without the lock (the GIL): a renewal racing with this check
        # can only make it drop a message sooner
        if message.id in self._lost:
            return True
        deadline = self._lease_deadlines.get(message.id)
        return deadline is not None and lease_clock() >= deadline

    def leases(self) -> list[tuple[int, uuid.UUID]]:
        """(id, lease token) of every unsettled message whose lease is not known lost."""
        with self._lock:
            held = self._unsettled.values()
            return [(m.id, m.lease_token) for m in held if m.id not in self._lost]

    def renewed(self, ids: Iterable[int], deadline: float) -> None:
        with self._lock:
            for message_id in ids:
                if message_id in self._lease_deadlines:
                    self._lease_deadlines[message_id] = deadline

    def lost(self, leases: Iterable[tuple[int, uuid.UUID]]) -> list[int]:
        """Mark leases a heartbeat did not renew as lost; returns their ids. Not lost: a
        message settled meanwhile (being written, or written and forgotten), or claimed again
        under a new token (a retry) since the renewal read its lease."""
        with self._lock:
            lost = [
                i
                for i, token in leases
                if i in self._unsettled
                and i not in self._writing
                and self._unsettled[i].lease_token == token
            ]
            self._lost.update(lost)
            return lost

    def begin_write(self, ids: Iterable[int]) -> None:
        """The settler starts writing these messages' outcomes (see :meth:`lost`)."""
        with self._lock:
            self._writing.update(ids)

    def end_write(self, ids: Iterable[int]) -> None:
        with self._lock:
            self._writing.difference_update(ids)

    def forget(self, message_ids: Iterable[int], outcomes: Sequence[Outcome] = ()) -> None:
        """Messages settled (their ``outcomes``) or dropped: no longer held."""
        with self._lock:
            by_id = {o.message.id: o.message for o in outcomes}
            for message_id in message_ids:
                held = self._unsettled.get(message_id)
                if message_id in by_id and held is not None and held is not by_id[message_id]:
                    continue  # its retry, claimed again already
                self._unsettled.pop(message_id, None)
                self._lost.discard(message_id)
                self._lease_deadlines.pop(message_id, None)
                self._abort_pending.discard(message_id)

    def settled(self, outcomes: Sequence[Outcome], *, count: bool) -> None:
        self.forget([o.message.id for o in outcomes], outcomes)
        if count:
            with self._lock:
                self._handled += len(outcomes)

    # -- attempts ----------------------------------------------------------------------------------

    def abort_pending(self, message_id: int) -> bool:
        return message_id in self._abort_pending

    def start_attempt(
        self, message: ClaimedMessage, spec: TaskSpec, timeout: float | None
    ) -> Attempt:
        """Record a running attempt (abort requests find it), under its time limit if any."""
        attempt = Attempt(message, spec, threading.current_thread(), timeout, time.monotonic())
        with self._lock:
            self._attempts[message.id] = attempt
            if message.id in self._abort_pending:  # requested between its claim and now
                self._start_abort(attempt)
            elif timeout is not None:
                self._timed.add(attempt)
                self.deadlines.notify()  # it may be the next deadline
        return attempt

    def end_attempt(self, attempt: Attempt) -> tuple[bool, Outcome | None]:
        """The attempt returned: whether its outcome is this thread's to settle, and (when the
        timer failed it first) the outcome the timer parked, to write now. Idempotent."""
        with self._lock:
            if self._attempts.get(attempt.message.id) is attempt:
                del self._attempts[attempt.message.id]
            if not attempt.abandoned:
                self._timed.discard(attempt)
                return True, None
            attempt.returned = True
            parked, attempt.parked = attempt.parked, None
            self._stuck.discard(attempt)
            return False, parked

    def aborts_requested(self, ids: Iterable[int]) -> list[int]:
        """Abort requests a heartbeat found: a running attempt gets its grace period; one no
        handler thread has taken yet is settled aborted now (:attr:`abort_unstarted`), one
        taken but not started yet when it starts. Returns the ids newly seen."""
        seen = []
        unstarted = []
        settle = self.abort_unstarted
        with self._lock:
            for message_id in ids:
                if message_id in self._abort_pending or message_id not in self._unsettled:
                    continue
                self._abort_pending.add(message_id)
                seen.append(message_id)
                attempt = self._attempts.get(message_id)
                if attempt is not None:
                    self._start_abort(attempt)
                elif settle is not None and message_id in self._waiting:
                    # Taken from the handler threads under the lock :meth:`take` holds: either
                    # a thread took it first (it sees the pending abort before it starts the
                    # task, or at start_attempt) or it is settled here and the thread that
                    # takes it later only frees its slot. Never both, never neither.
                    message = self._aborted_waiting[message_id] = self._waiting.pop(message_id)
                    unstarted.append(message)
        if settle is not None and unstarted:
            settle(unstarted)  # outside the lock: it logs and queues their outcomes
        return seen

    def _start_abort(self, attempt: Attempt) -> None:
        if attempt.abort_seen or attempt.abandoned:
            return
        attempt.abort_seen = True
        attempt.abort_at = time.monotonic() + self.abort_grace
        self._timed.add(attempt)
        self.deadlines.notify()

    def wait_for_deadline(self, now: float, most: float) -> None:
        """Wait until the next deadline, a new one, or ``most`` seconds."""
        with self._lock:
            wait = min((a.deadline for a in self._timed), default=now + most) - now
            self.deadlines.wait(min(max(wait, 0.001), most))

    def expire(self, now: float) -> list[Attempt]:
        """Take the attempts past their deadline out of the pool's count: each is stuck until
        its thread returns; its message stays held (its lease renewed, its slot taken)."""
        with self._lock:
            expired = [a for a in self._timed if a.deadline <= now]
            for attempt in expired:
                self._timed.discard(attempt)
                attempt.abandoned = True
                attempt.abandoned_at = now
                self._stuck.add(attempt)
                self._busy -= 1
                if self._attempts.get(attempt.message.id) is attempt:
                    del self._attempts[attempt.message.id]
            return expired

    def park(self, attempt: Attempt, outcome: Outcome) -> bool:
        """Keep a timed-out attempt's outcome until its thread returns; True when it returned
        meanwhile (write the outcome now)."""
        with self._lock:
            if attempt.returned:
                return True
            attempt.parked = outcome
            return False

    def stuck_since(self) -> float | None:
        """When the longest-stuck thread's attempt timed out (``time.monotonic()``)."""
        with self._lock:
            return min((a.abandoned_at for a in self._stuck), default=None)

    def stuck_messages(self) -> list[int]:
        with self._lock:
            return [a.message.id for a in self._stuck]

"""The heartbeat: renews the leases of every claimed, unsettled message."""

from __future__ import annotations

import logging

from django_fairqueue._runtime import (
    CONNECTION_ERRORS,
    Backoff,
    after_database_error,
    drop_broken_connection,
)
from django_fairqueue.db import message_store
from django_fairqueue.worker.base import WorkerBase
from django_fairqueue.worker.config import (
    HEARTBEAT_BATCH,
    _lease_clock,
)

logger = logging.getLogger("django_fairqueue.worker")


class Heartbeat(WorkerBase):
    """The heartbeat: renews the leases of every claimed, unsettled message."""

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
                    renewed = message_store.heartbeat_messages(chunk, lease=self.lease)
                    owned |= renewed.keys()
                    deadline = sent + self.lease.total_seconds()
                    with self._cond:
                        for message_id in renewed:
                            if message_id in self._lease_deadlines:
                                self._lease_deadlines[message_id] = deadline
                        self._note_aborts([i for i, asked in renewed.items() if asked])
            except CONNECTION_ERRORS as exc:
                what = after_database_error(exc)
                wait = min(backoff.next(), interval)
                logger.warning("heartbeat failed: %s", what)
                continue
            backoff.reset()
            drop_broken_connection()
            with self._cond:
                # Not lost: one settled meanwhile (being written, or written and forgotten),
                # or claimed again under a new token (a retry) since this renewal began.
                lost = [
                    i
                    for i, token in leases
                    if i not in owned
                    and i not in self._settling
                    and getattr(self._unsettled.get(i), "lease_token", None) == token
                ]
                self._lost.update(lost)
            if lost:
                logger.warning(
                    "lost the lease of %d running messages (it expired, and another worker may "
                    "be running them); their outcome will not be recorded; ids %s",
                    len(lost),
                    lost[:20],
                    extra={"worker_id": self.worker_id, "outcome": "lease_lost"},
                )

    def _note_aborts(self, ids: list[int]) -> None:
        """Abort requests found by a heartbeat (call with the lock held): a running attempt's
        task sees abort_requested() turn True and has ABORT_GRACE seconds to stop; one not
        started yet is settled as aborted without running."""
        for message_id in ids:
            if message_id in self._abort_pending or message_id not in self._unsettled:
                continue
            self._abort_pending.add(message_id)
            attempt = self._attempts.get(message_id)
            if attempt is not None:
                self._start_abort(attempt)
        if ids:
            logger.info(
                "abort requested for running messages %s",
                ids[:20],
                extra={"worker_id": self.worker_id, "outcome": "abort_requested"},
            )

    # maintenance and wake-ups

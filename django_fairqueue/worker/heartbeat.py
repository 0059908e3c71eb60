"""The heartbeat: renews the leases of every claimed, unsettled message, and finds aborts."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

from django_fairqueue.db import message_store
from django_fairqueue.runtime import (
    CONNECTION_ERRORS,
    Backoff,
    after_database_error,
    drop_broken_connection,
)
from django_fairqueue.worker.config import HEARTBEAT_BATCH, lease_clock
from django_fairqueue.worker.ledger import Ledger
from django_fairqueue.worker.service import Service

logger = logging.getLogger("django_fairqueue.worker")


class Heartbeat(Service):
    """Renews every lease the ledger holds three times per lease period (a lost or late
    heartbeat never costs the lease), also while handlers are busy and while a timed-out
    attempt's thread is stuck (its channel's cap counts it until the thread returns)."""

    name = "heartbeat"

    def __init__(self, ledger: Ledger, *, lease: timedelta, worker_id: str) -> None:
        super().__init__()
        self.ledger = ledger
        self.lease = lease
        self.worker_id = worker_id
        self._poked = threading.Event()

    def poke(self) -> None:
        """Beat now, not at the next interval: an abort of one of this worker's messages was
        requested (a prefetched one must not start)."""
        self._poked.set()

    def stop(self) -> None:
        super().stop()
        self._poked.set()

    def run(self) -> None:
        interval = self.lease.total_seconds() / 3
        backoff = Backoff()
        wait = interval
        while True:
            self._poked.wait(wait)
            self._poked.clear()
            if self.stopping.is_set():
                return
            wait = interval
            try:
                self.run_once()
            except CONNECTION_ERRORS as exc:
                what = after_database_error(exc)
                wait = min(backoff.next(), interval)
                logger.warning("heartbeat failed: %s", what)
                continue
            backoff.reset()
            drop_broken_connection()

    def run_once(self) -> int:
        """Renew every lease once; returns how many were renewed. Connection errors
        propagate."""
        leases = self.ledger.leases()
        if not leases:
            return 0
        owned: set[int] = set()
        for start in range(0, len(leases), HEARTBEAT_BATCH):
            chunk = leases[start : start + HEARTBEAT_BATCH]
            sent = lease_clock()  # the renewal's database time is later than this
            renewed = message_store.heartbeat_messages(chunk, lease=self.lease)
            owned |= renewed.keys()
            self.ledger.renewed(renewed, sent + self.lease.total_seconds())
            aborts = self.ledger.aborts_requested([i for i, asked in renewed.items() if asked])
            if aborts:
                # a running attempt's task sees abort_requested() turn True and has
                # ABORT_GRACE seconds to stop; one no handler thread had taken yet was
                # settled aborted just now ("before it started": its outcome is queued)
                logger.info(
                    "abort requested for running messages %s",
                    aborts[:20],
                    extra={"worker_id": self.worker_id, "outcome": "abort_requested"},
                )
        lost = self.ledger.lost((i, token) for i, token in leases if i not in owned)
        if lost:
            logger.warning(
                "lost the lease of %d running messages (it expired, and another worker may "
                "be running them); their outcome will not be recorded; ids %s",
                len(lost),
                lost[:20],
                extra={"worker_id": self.worker_id, "outcome": "lease_lost"},
            )
        return len(owned)

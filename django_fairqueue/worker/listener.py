"""The listener: a connection of its own that LISTENs for enqueue wake-ups."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import psycopg
from django.db import connections

from django_fairqueue import conf
from django_fairqueue.db import message_store
from django_fairqueue.runtime import Backoff
from django_fairqueue.worker import wakeups
from django_fairqueue.worker.service import Service

logger = logging.getLogger("django_fairqueue.worker")


class Listener(Service):
    """LISTENs on ``NOTIFY_CHANNEL`` with a psycopg connection of its own (not Django's) and
    calls ``on_wake()`` for each notification, and once after each (re)connection to catch up
    on what was enqueued meanwhile; ``on_abort()`` instead for an abort requested of one of
    this worker's messages (another worker's is no wake-up). A lost connection is retried with
    backoff; polling goes on meanwhile."""

    name = "listener"

    def __init__(
        self,
        *,
        worker_id: str,
        on_wake: Callable[[], None],
        on_abort: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.worker_id = worker_id
        self.on_wake = on_wake
        self.on_abort = on_abort
        self._abort_notice = message_store.ABORT_NOTICE + worker_id
        #: Set once the LISTEN is in place (and again after each reconnect).
        self.listening = threading.Event()
        self._conn: psycopg.Connection[Any] | None = None
        self._connected_before = False
        #: Set when LISTEN was seen not to deliver (a transaction pooler, say): the listener
        #: ends and the worker polls on purpose (logged and recorded by wakeups.confirm).
        self.polling_only = False

    def run(self) -> None:
        backoff = Backoff(first=0.1, cap=5.0)
        try:
            while not self.stopping.is_set() and not self.polling_only:
                try:
                    self.run_once()
                except psycopg.Error as exc:
                    self._close()
                    delay = backoff.next()
                    logger.warning(
                        "wake-up listener lost its connection (%s); reconnecting in %.2fs "
                        "(polling continues)",
                        str(exc).strip(),
                        delay,
                    )
                    self.stopping.wait(delay)
                else:
                    backoff.reset()
        finally:
            self._close()

    def run_once(self, timeout: float = 0.5) -> int:
        """Connect and LISTEN if not listening, then wait up to ``timeout`` seconds for
        notifications; returns how many came. ``psycopg.Error`` propagates (the connection
        is then closed by the caller's next :meth:`stop` or retry)."""
        if self._conn is None:
            self._connect()
            if self._conn is None:  # notifications do not arrive: polling only, on purpose
                return 0
        count = 0
        for notice in self._conn.notifies(timeout=timeout):
            count += 1
            if not notice.payload.startswith(message_store.ABORT_NOTICE):
                self.on_wake()
            elif notice.payload == self._abort_notice and self.on_abort is not None:
                self.on_abort()
        return count

    def _connect(self) -> None:
        channel = conf.get().NOTIFY_CHANNEL
        conn = psycopg.connect(**self.params())
        try:
            message_store.listen_wakeups(conn, channel)
            confirmed = wakeups.confirm(conn, channel, self.worker_id)
        except BaseException:
            conn.close()
            raise
        if not confirmed:
            conn.close()
            self.polling_only = True
            return
        self._conn = conn
        logger.info(
            "%s on %r for wake-ups",
            "listening again" if self._connected_before else "listening",
            channel,
            extra={"worker_id": self.worker_id},
        )
        self._connected_before = True
        self.listening.set()
        self.on_wake()  # catch up on whatever was enqueued while we were not listening

    def _close(self) -> None:
        self.listening.clear()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def params(self) -> dict[str, Any]:
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

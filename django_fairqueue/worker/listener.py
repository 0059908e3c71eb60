"""The listener: a connection of its own that LISTENs for enqueue wake-ups."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from django.db import connections

from django_fairqueue import conf, wakeups
from django_fairqueue._runtime import (
    Backoff,
)
from django_fairqueue.db import message_store
from django_fairqueue.worker.base import WorkerBase

logger = logging.getLogger("django_fairqueue.worker")


class Listener(WorkerBase):
    """The listener: a connection of its own that LISTENs for enqueue wake-ups."""

    def _listener_loop(self) -> None:
        channel = conf.get().NOTIFY_CHANNEL
        backoff = Backoff(first=0.1, cap=5.0)
        connected_before = False
        while not self._threads_stop.is_set():
            conn: psycopg.Connection[Any] | None = None
            try:
                conn = psycopg.connect(**self._listener_params())
                message_store.listen_wakeups(conn, channel)
                if not wakeups.confirm(conn, channel, self.worker_id):
                    return  # notifications do not arrive: polling only, on purpose (logged)
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

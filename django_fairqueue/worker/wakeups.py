"""A worker's wake-up listener checks that notifications reach it.

LISTEN succeeds behind a transaction pooler (PgBouncer in ``pool_mode = transaction``), but
the server connection that ran it goes back to the pool at once: notifications go to whatever
client holds that connection next, or nowhere, and the worker silently waits for its polling
instead (half a second at the median instead of milliseconds). So after LISTEN the listener
sends a notification of its own on its channel, from another connection (Django's, as an
enqueue does) with a payload only it knows, and waits :data:`PROBE_WAIT` seconds for it.

If it arrives, the worker records ``notify`` in the worker registry. If not, it says so in the
log, records ``polling: <why>`` (``fairqueue workers`` shows it), and stops listening: it polls
every ``POLL_INTERVAL`` on purpose. Point the listener at PostgreSQL directly, or start the
worker with ``--no-listen`` behind a pooler (docs/howto/deploy-workers.md).
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

import psycopg
from django.db import connections

from django_fairqueue import conf
from django_fairqueue.db import message_store, worker_store
from django_fairqueue.runtime import CONNECTION_ERRORS, after_database_error

logger = logging.getLogger("django_fairqueue.worker")

#: Seconds the listener waits for its own notification.
PROBE_WAIT = 2.0
#: What the registry records for a worker whose listener was seen to receive.
NOTIFY = "notify"


def confirm(
    conn: psycopg.Connection[Any], channel: str, worker_id: str, *, wait: float = PROBE_WAIT
) -> bool:
    """Whether a notification on ``channel`` reaches ``conn``, which has just LISTENed on it.

    Logs and records the answer in the worker registry. Other notifications that arrive
    meanwhile are consumed (the caller wakes its worker after the check anyway). Raises
    ``psycopg.Error`` if ``conn`` breaks (the caller reconnects and checks again).
    """
    alias = conf.get().DATABASE
    payload = f"fairqueue probe {worker_id} {secrets.token_hex(8)}"
    try:
        message_store.notify_probe(channel, payload, using=alias)
    except CONNECTION_ERRORS as exc:
        # The database is not reachable from this side: the listener's own loop notices it
        # soon enough; checking again after its reconnect is the sound thing to do.
        raise psycopg.OperationalError(after_database_error(exc, alias)) from exc
    finally:
        connections[alias].close()  # the listener thread keeps no Django connection
    received = _wait_for(conn, channel, payload, wait)
    if received:
        _record(worker_id, NOTIFY)
        return True
    why = (
        f"no notification arrived within {wait:g}s of one sent on {channel!r} (a transaction "
        "pooler between the worker and PostgreSQL, such as PgBouncer in transaction mode, "
        "does not deliver them)"
    )
    # Recorded before it is logged: whoever reads the log line finds the registry saying so.
    _record(worker_id, f"polling: {why}")
    logger.warning(
        "LISTEN does not work for this worker: %s; polling every %gs instead (connect the "
        "listener to PostgreSQL directly, or start the worker with --no-listen)",
        why,
        conf.get().POLL_INTERVAL,
        extra={"worker_id": worker_id, "outcome": "polling"},
    )
    return False


def _wait_for(conn: psycopg.Connection[Any], channel: str, payload: str, wait: float) -> bool:
    deadline = time.monotonic() + wait
    while (left := deadline - time.monotonic()) > 0:
        for notify in conn.notifies(timeout=left):
            if notify.channel == channel and notify.payload == payload:
                return True
    return False


def _record(worker_id: str, wakeups: str) -> None:
    """Note it in the registry; a failure is logged only (the worker's beat goes on)."""
    alias = conf.get().DATABASE
    try:
        worker_store.set_worker_wakeups(worker_id, wakeups, using=alias)
    except CONNECTION_ERRORS as exc:
        logger.warning("could not record the wake-up check: %s", after_database_error(exc, alias))
    finally:
        connections[alias].close()

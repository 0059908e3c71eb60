"""The worker registry (``django_fairqueue.runtime.worker_registry``): workers record themselves,
beat, deregister; a silent one is marked dead and its leases expired.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from psycopg.types.json import Jsonb

from django_fairqueue.db import pg

queries = pg.StatementFile("django_fairqueue.db", "statements/workers.sql")
_run = queries.run


@dataclass(frozen=True, slots=True)
class DeadWorker:
    worker_id: str
    host: str
    pid: int
    silent_seconds: float
    leases_expired: int


@dataclass(frozen=True, slots=True)
class Holder:
    """The live process a worker id is registered to."""

    host: str
    pid: int
    #: since its last beat, on the database's clock
    silent_seconds: float


def select_worker_holder(
    worker_id: str, dead_after: float, *, using: str | None = None
) -> Holder | None:
    """The process registered under ``worker_id`` if its row runs and beat within
    ``dead_after`` seconds; None if no process holds the id."""
    params = {"worker_id": worker_id, "dead_after": timedelta(seconds=dead_after)}
    rows = _run("select_worker_holder", params, using)
    return Holder(rows[0][0], int(rows[0][1]), float(rows[0][2])) if rows else None


def register_worker(
    worker_id: str,
    *,
    host: str,
    pid: int,
    version: str,
    concurrency: int,
    channels: Sequence[str],
    exclude_channels: Sequence[str],
    queues: Sequence[str] | None = None,
    dead_after: float,
    dead: Holder | None = None,
    using: str | None = None,
) -> int | None:
    """Record a worker as running; returns the leases of a predecessor with its id it expired.
    ``queues``: the queues it serves, None for every queue.

    None, and nothing written, when a live process holds the id: its row runs and beat
    within ``dead_after`` seconds, and it is not ``dead`` (a holder the caller proved gone)."""
    params = {
        "worker_id": worker_id,
        "host": host,
        "pid": pid,
        "version": version,
        "concurrency": concurrency,
        "channels": Jsonb(list(channels)),
        "exclude_channels": Jsonb(list(exclude_channels)),
        "queues": None if queues is None else Jsonb(list(queues)),
        "dead_after": timedelta(seconds=dead_after),
        "dead_host": dead.host if dead is not None else None,
        "dead_pid": dead.pid if dead is not None else None,
    }
    if not _run("register_worker", params, using):
        return None
    return expire_worker_leases(worker_id, using=using)


def beat_worker(
    worker_id: str,
    *,
    running: int,
    handled: int,
    last_claim_at: datetime | None,
    using: str | None = None,
) -> None:
    params = {
        "worker_id": worker_id,
        "running": running,
        "handled": handled,
        "last_claim_at": last_claim_at,
    }
    _run("beat_worker", params, using)


def deregister_worker(
    worker_id: str,
    *,
    handled: int,
    last_claim_at: datetime | None = None,
    using: str | None = None,
) -> int:
    """Mark the worker stopped; returns how many messages it still ran (their leases expired)."""
    params = {"worker_id": worker_id, "handled": handled, "last_claim_at": last_claim_at}
    _run("deregister_worker", params, using)
    return expire_worker_leases(worker_id, using=using)


def expire_worker_leases(worker_id: str, *, using: str | None = None) -> int:
    """Expire the leases of the messages running under ``worker_id`` (no live process holds
    it: it registers again, or stops); returns how many."""
    return int(_run("expire_worker_leases", {"worker_id": worker_id}, using)[0][0])


def expire_dead_workers(
    dead_after: float, *, alive: Sequence[str] = (), using: str | None = None
) -> list[DeadWorker]:
    """Mark workers silent for ``dead_after`` seconds dead and expire their leases; never
    those of ``alive`` (the caller's own)."""
    params = {"dead_after": timedelta(seconds=dead_after), "alive": list(alive)}
    rows = _run("expire_dead_workers", params, using)
    return [DeadWorker(r[0], r[1], int(r[2]), float(r[3]), int(r[4])) for r in rows]


def prune_workers(before: datetime, *, using: str | None = None) -> None:
    _run("prune_workers", {"before": before}, using)


def set_worker_wakeups(worker_id: str, wakeups: str, *, using: str | None = None) -> None:
    """Record how a worker learns of new messages: ``notify`` or ``polling: <why>``."""
    _run("set_worker_wakeups", {"worker_id": worker_id, "wakeups": wakeups}, using)


def set_worker_supervisor(worker_id: str, supervisor: str, *, using: str | None = None) -> None:
    _run("set_worker_supervisor", {"worker_id": worker_id, "supervisor": supervisor}, using)


def record_worker_supervision(
    worker_id: str, supervision: dict[str, Any], *, using: str | None = None
) -> None:
    """Record what a supervisor knew of a worker's slot when it started the process."""
    params = {"worker_id": worker_id, "supervision": Jsonb(supervision)}
    _run("record_worker_supervision", params, using)

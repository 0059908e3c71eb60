"""The interface each compared system implements (one module per system)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from multiprocessing.synchronize import Barrier

import psycopg

from benchmarks.compare.common import DSN_ENV, Backlog, WorkerConfig, spread_key

#: Messages per call in the batch enqueue cells (one tenant's upload).
BATCH = 100


class System:
    #: Short name, used on the command line, in tables and in the database's name.
    name = ""
    #: Fairness variants: the mechanism used to keep B from waiting behind A. The first is the
    #: plain configuration, also used for the throughput cells.
    variants: tuple[str, ...] = ("fifo",)
    #: The end-to-end sweep: processes x concurrency.
    configs: tuple[WorkerConfig, ...] = ()
    #: The workers of the fairness and sybil scenarios when the end-to-end sweep is left out:
    #: the system's best end-to-end configuration on the development machine (docs/
    #: performance.md); None: the sweep's first.
    fair_config: WorkerConfig | None = None
    #: What "concurrency" means for this system, for the tables.
    concurrency_unit = ""
    #: One idle worker for pickup latency.
    pickup_config = WorkerConfig(1, 1)
    #: How it finds new work when idle (for the pickup table).
    wakeup = ""
    #: The package and version measured.
    version = ""
    #: Whether it can weigh one tenant against another (the weights scenario); the others
    #: have no counterpart and are reported as n/a with what their users would have to do.
    weights = False

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    # -- schema and data ----------------------------------------------------------------------

    def setup(self) -> None:
        """Install the system's schema into the (fresh, empty) database."""
        raise NotImplementedError

    def reset(self) -> None:
        """Empty the system's job tables."""
        raise NotImplementedError

    def remaining(self) -> int:
        """Jobs not finished yet (waiting or running)."""
        raise NotImplementedError

    def load(self, tenant: str, count: int, variant: str) -> None:
        """Queue ``count`` no-op jobs of ``tenant`` as fast as the system allows (not timed)."""
        raise NotImplementedError

    def load_backlog(self, backlog: Backlog, variant: str) -> None:
        """Queue ``backlog`` (several tenants, alternating; keys per tenant) in bulk, with one
        ``INSERT ... SELECT`` of the system's own rows per slice of 100,000 (not timed)."""
        raise NotImplementedError

    def key(self, tenant: str, index: int | None = None) -> str:
        """What a burst of ``tenant`` is queued under: the tenant's own key, or its
        ``index``-th key of the sybil scenario (the names :meth:`load_backlog` uses)."""
        return tenant if index is None else spread_key(tenant, index)

    def set_weight(self, key: str, weight: int) -> None:
        """Weigh ``key`` against the others (systems with ``weights`` only)."""
        raise NotImplementedError

    # -- enqueue ------------------------------------------------------------------------------

    def enqueue_loop(self, mode: str, duration: float, start: Barrier) -> tuple[int, float, float]:
        """In a forked process: enqueue in a loop for ``duration`` seconds after ``start``.

        ``mode`` is ``single`` (one job per transaction) or ``batch`` (``BATCH`` jobs of one
        tenant per transaction, through the system's batch API where it has one). Returns
        (jobs, began, ended) on ``time.perf_counter()``'s clock.
        """
        raise NotImplementedError

    def burst(
        self, tenant: str, seqs: Sequence[int], variant: str, key: str | None = None
    ) -> float:
        """Enqueue one job per seq for ``tenant`` in one transaction (committed on return),
        under ``key`` (default: the tenant's own key) where the variant uses keys. Returns
        ``time.time()`` read as soon as the commit returned: waits run from it, so closing a
        connection or an event loop afterwards is not counted as the job's wait."""
        raise NotImplementedError

    # -- workers ------------------------------------------------------------------------------

    def worker_commands(self, config: WorkerConfig, variant: str) -> list[list[str]]:
        """One command line per worker process."""
        raise NotImplementedError

    def worker_env(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        pass

    def end_sessions(self) -> None:
        """Close this process's connections, then end every other session on the system's
        database: after its workers stopped, a query a worker started may still run (a fetch
        over a million locked jobs can take minutes) and would hold up the next reset."""
        self.close()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )


class DjangoSystem(System):
    """A system that is a Django app, run with ``benchmarks.compare.django_settings`` (Django is
    imported only when used: the other systems' processes never configure it)."""

    #: ``COMPARE_DJANGO_APP``: which app django_settings installs.
    django_app = ""

    def setup(self) -> None:
        from django.core.management import call_command

        call_command("migrate", verbosity=0, interactive=False)

    def worker_env(self) -> dict[str, str]:
        return {
            DSN_ENV: self.dsn,
            "DJANGO_SETTINGS_MODULE": "benchmarks.compare.django_settings",
            "COMPARE_DJANGO_APP": self.django_app,
        }

    def close(self) -> None:
        from django.db import connections

        connections.close_all()


def python(*args: str) -> list[str]:
    return [sys.executable, *args]

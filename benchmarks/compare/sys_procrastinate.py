"""procrastinate (PyPI ``procrastinate``): its async API, as its documentation recommends.

Tasks are ``async def`` (a worker runs ``concurrency`` of them at once on its event loop, which
suits a no-op far better than sync tasks on threads); ``PsycopgConnector`` (psycopg 3, a pool);
workers with the defaults otherwise: LISTEN/NOTIFY on, jobs kept after they finish
(``delete_jobs="never"``).

Fairness variant ``lock``: every job carries ``lock=<tenant>``. procrastinate runs at most one
job of a lock at a time, in order, so a worker's next fetch skips A's queued jobs while one of
A's runs and takes B's: tenants alternate, at the price of running one job per tenant at a time.
In the sybil scenario the lock is per key (A's 100 keys are 100 locks). (Queues per tenant
would need a worker per queue: a worker fetches across its queues by id, first in first out.)
Bulk backlogs are inserted as ``procrastinate_defer_jobs_v1`` inserts them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from multiprocessing.synchronize import Barrier
from typing import Any

import procrastinate
import psycopg

from benchmarks.compare.common import (
    DSN_ENV,
    SERIES_SQL,
    Backlog,
    WorkerConfig,
    astamp,
    series_slices,
    timed_calls_async,
)
from benchmarks.compare.system import BATCH, System, python

CHUNK = 1_000


def make_app(dsn: str, pool: int = 4) -> procrastinate.App:
    # procrastinate's concurrency guide: one pool connection per concurrent job, plus the
    # listener's and the worker's own.
    connector = procrastinate.PsycopgConnector(conninfo=dsn, min_size=1, max_size=pool)
    app = procrastinate.App(connector=connector)

    @app.task(name="noop", queue="default")
    async def noop(tenant: str, seq: int) -> None:
        await astamp(tenant, seq)

    return app


def _defer_args(key: str, variant: str) -> dict[str, Any]:
    return {"lock": key} if variant == "lock" else {}


class Procrastinate(System):
    name = "procrastinate"
    variants = ("fifo", "lock")
    configs = (
        WorkerConfig(1, 10),
        WorkerConfig(1, 50),
        WorkerConfig(2, 50),
        WorkerConfig(2, 100),
    )
    fair_config = WorkerConfig(1, 10)
    concurrency_unit = "async jobs per worker (concurrency=)"
    pickup_config = WorkerConfig(1, 1)
    wakeup = "LISTEN/NOTIFY (listen_notify=True, the default)"
    version = f"procrastinate {procrastinate.__version__}"

    def _run(self, coro: Any) -> Any:
        return asyncio.run(coro)

    async def _with_app(self, fn: Any) -> Any:
        app = make_app(self.dsn)
        async with app.open_async():
            return await fn(app)

    def setup(self) -> None:
        async def apply(app: procrastinate.App) -> None:
            await app.schema_manager.apply_schema_async()

        self._run(self._with_app(apply))

    def reset(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("TRUNCATE procrastinate_jobs RESTART IDENTITY CASCADE")

    def remaining(self) -> int:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')"
            ).fetchone()
        return int(row[0]) if row else 0

    def load(self, tenant: str, count: int, variant: str) -> None:
        async def go(app: procrastinate.App) -> None:
            task = app.tasks["noop"].configure(**_defer_args(tenant, variant))
            for low in range(0, count, CHUNK):
                n = min(CHUNK, count - low)
                await task.batch_defer_async(
                    *({"tenant": tenant, "seq": low + j} for j in range(n))
                )

        self._run(self._with_app(go))
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("ANALYZE procrastinate_jobs")

    def load_backlog(self, backlog: Backlog, variant: str) -> None:
        """The rows ``procrastinate_defer_jobs_v1`` inserts (its row triggers fire as for a
        defer), one ``INSERT ... SELECT`` per slice."""
        lock = "key" if variant == "lock" else "NULL"
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for params in series_slices(backlog):
                conn.execute(
                    "INSERT INTO procrastinate_jobs (queue_name, task_name, priority, lock, args) "
                    f"SELECT 'default', 'noop', 0, {lock}, "
                    "jsonb_build_object('tenant', tenant, 'seq', seq) "
                    f"FROM ({SERIES_SQL}) AS x ORDER BY i",
                    params,
                )
            conn.execute("ANALYZE procrastinate_jobs")

    def enqueue_loop(self, mode: str, duration: float, start: Barrier) -> tuple[int, float, float]:
        async def go(app: procrastinate.App) -> tuple[int, float, float]:
            task = app.tasks["noop"]
            seq = 0

            async def call() -> int:
                nonlocal seq
                if mode == "single":
                    seq += 1
                    await task.defer_async(tenant="E", seq=seq)
                    return 1
                await task.batch_defer_async(
                    *({"tenant": "E", "seq": seq + j} for j in range(BATCH))
                )
                seq += BATCH
                return BATCH

            return await timed_calls_async(call, start, duration)

        result: tuple[int, float, float] = self._run(self._with_app(go))
        return result

    def burst(
        self, tenant: str, seqs: Sequence[int], variant: str, key: str | None = None
    ) -> float:
        async def go(app: procrastinate.App) -> float:
            task = app.tasks["noop"].configure(**_defer_args(key or tenant, variant))
            await task.batch_defer_async(*({"tenant": tenant, "seq": s} for s in seqs))
            return time.time()  # committed; closing the app and the loop is not the wait

        committed: float = self._run(self._with_app(go))
        return committed

    def worker_commands(self, config: WorkerConfig, variant: str) -> list[list[str]]:
        argv = python("-m", "benchmarks.compare.sys_procrastinate", str(config.concurrency))
        return [argv] * config.processes

    def worker_env(self) -> dict[str, str]:
        return {DSN_ENV: self.dsn}


async def work(dsn: str, concurrency: int) -> None:
    app = make_app(dsn, pool=concurrency + 3)
    async with app.open_async():
        await app.run_worker_async(concurrency=concurrency, install_signal_handlers=True)


if __name__ == "__main__":
    import logging
    import os
    import sys

    logging.basicConfig(level=logging.WARNING)
    asyncio.run(work(os.environ[DSN_ENV], int(sys.argv[1])))

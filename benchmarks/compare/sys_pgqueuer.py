"""pgqueuer (PyPI ``pgqueuer``) on asyncpg, the driver its documentation leads with.

Workers are ``PgQueuer(...).run(batch_size=C)``: each dequeue takes up to C jobs and runs them as
asyncio tasks; the entrypoint is ``async def``. Enqueue uses ``Queries.enqueue`` with lists for
a batch (one statement). LISTEN/NOTIFY is built in. Finished jobs are deleted from the queue
table and logged (its defaults).

Fairness variant ``entrypoint``: one entrypoint per tenant (``noop-A``, ``noop-B``), each with
``concurrency_limit`` = half the fleet's nominal capacity (processes x batch size / 2), enforced
in SQL across workers: A cannot hold every slot, so B's jobs are picked at the next dequeue.
Every worker must register every tenant's entrypoint in advance (here: every key any scenario
uses, the sybil scenario's 100 keys of A and the bursts' tenants included). Bulk backlogs are
the rows ``Queries.enqueue`` writes (the job and its ``queued`` log row).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from multiprocessing.synchronize import Barrier
from typing import Any

import asyncpg
import pgqueuer
import psycopg
from pgqueuer import AsyncpgDriver, PgQueuer, Queries
from pgqueuer.models import Job

from benchmarks.compare.common import (
    DSN_ENV,
    SERIES_SQL,
    Backlog,
    WorkerConfig,
    astamp,
    dsn_url,
    series_slices,
    spread_key,
    timed_calls_async,
)
from benchmarks.compare.system import BATCH, System, python

CHUNK = 1_000
ENTRYPOINT = "noop"
TENANTS = ("A", "B", "E", "P")
#: Every key a job may be queued under (the entrypoint variant registers each in every worker):
#: the tenants, the sybil scenario's channels and the bursts scenario's tenants.
KEYS = (
    *TENANTS,
    *(spread_key("A", i) for i in range(100)),
    spread_key("B", 0),
    *(f"t{i:02d}" for i in range(100)),
)


def entrypoint(tenant: str, variant: str) -> str:
    return f"{ENTRYPOINT}-{tenant}" if variant == "entrypoint" else ENTRYPOINT


def payload(tenant: str, seq: int) -> bytes:
    return json.dumps({"tenant": tenant, "seq": seq}).encode()


class Pgqueuer(System):
    name = "pgqueuer"
    variants = ("fifo", "entrypoint")
    configs = (
        WorkerConfig(1, 10),
        WorkerConfig(1, 50),
        WorkerConfig(2, 50),
        WorkerConfig(2, 100),
    )
    fair_config = WorkerConfig(2, 100)
    concurrency_unit = "jobs per dequeue, run as asyncio tasks (batch_size=)"
    pickup_config = WorkerConfig(1, 1)
    wakeup = "LISTEN/NOTIFY (built in)"
    version = f"pgqueuer {pgqueuer.__version__}, asyncpg {asyncpg.__version__}"

    async def _queries(self) -> tuple[asyncpg.Connection, Queries]:
        conn = await asyncpg.connect(dsn_url(self.dsn))
        return conn, Queries(AsyncpgDriver(conn))

    def _sql(self, sql: str) -> Any:
        async def go() -> Any:
            conn = await asyncpg.connect(dsn_url(self.dsn))
            try:
                return await conn.fetchval(sql)
            finally:
                await conn.close()

        return asyncio.run(go())

    def setup(self) -> None:
        async def go() -> None:
            conn, queries = await self._queries()
            try:
                await queries.install()
            finally:
                await conn.close()

        asyncio.run(go())

    def reset(self) -> None:
        self._sql("TRUNCATE pgqueuer, pgqueuer_log RESTART IDENTITY")

    def remaining(self) -> int:
        return int(self._sql("SELECT count(*) FROM pgqueuer"))

    def load(self, tenant: str, count: int, variant: str) -> None:
        async def go() -> None:
            conn, queries = await self._queries()
            try:
                for low in range(0, count, CHUNK):
                    n = min(CHUNK, count - low)
                    await queries.enqueue(
                        [entrypoint(tenant, variant)] * n,
                        [payload(tenant, low + j) for j in range(n)],
                        [0] * n,
                    )
            finally:
                await conn.close()

        asyncio.run(go())
        self._sql("ANALYZE pgqueuer")

    def load_backlog(self, backlog: Backlog, variant: str) -> None:
        """The rows ``Queries.enqueue`` inserts (the job and its ``queued`` log row), one
        statement per slice."""
        ep = "'noop-' || key" if variant == "entrypoint" else f"'{ENTRYPOINT}'"
        sql = (
            "WITH jobs AS (INSERT INTO pgqueuer (priority, entrypoint, payload, execute_after, "
            f"status) SELECT 0, {ep}, convert_to(json_build_object('tenant', tenant, 'seq', seq)"
            f"::text, 'UTF8'), now(), 'queued' FROM ({SERIES_SQL}) AS x ORDER BY i "
            "RETURNING id, entrypoint, priority) INSERT INTO pgqueuer_log (job_id, status, "
            "entrypoint, priority) SELECT id, 'queued', entrypoint, priority FROM jobs"
        )
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for params in series_slices(backlog):
                conn.execute(sql, params)
            conn.execute("ANALYZE pgqueuer")

    def enqueue_loop(self, mode: str, duration: float, start: Barrier) -> tuple[int, float, float]:
        async def go() -> tuple[int, float, float]:
            conn, queries = await self._queries()
            seq = 0

            async def call() -> int:
                nonlocal seq
                if mode == "single":
                    seq += 1
                    await queries.enqueue(ENTRYPOINT, payload("E", seq), 0)
                    return 1
                await queries.enqueue(
                    [ENTRYPOINT] * BATCH, [payload("E", seq + j) for j in range(BATCH)], [0] * BATCH
                )
                seq += BATCH
                return BATCH

            try:
                return await timed_calls_async(call, start, duration)
            finally:
                await conn.close()

        result: tuple[int, float, float] = asyncio.run(go())
        return result

    def burst(
        self, tenant: str, seqs: Sequence[int], variant: str, key: str | None = None
    ) -> float:
        async def go() -> float:
            conn, queries = await self._queries()
            try:
                n = len(seqs)
                await queries.enqueue(
                    [entrypoint(key or tenant, variant)] * n,
                    [payload(tenant, s) for s in seqs],
                    [0] * n,
                )
                return time.time()  # committed; closing the connection and loop is not the wait
            finally:
                await conn.close()

        return asyncio.run(go())

    def worker_commands(self, config: WorkerConfig, variant: str) -> list[list[str]]:
        limit = max(1, config.processes * config.concurrency // 2)
        argv = python(
            "-m", "benchmarks.compare.sys_pgqueuer", str(config.concurrency), variant, str(limit)
        )
        return [argv] * config.processes

    def worker_env(self) -> dict[str, str]:
        return {DSN_ENV: self.dsn}


async def _noop(job: Job) -> None:
    data = json.loads(job.payload or b"{}")
    await astamp(data["tenant"], data["seq"])


async def work(dsn: str, batch_size: int, variant: str, limit: int) -> None:
    conn = await asyncpg.connect(dsn_url(dsn))
    pgq = PgQueuer(AsyncpgDriver(conn))
    if variant == "entrypoint":
        for key in KEYS:
            pgq.entrypoint(entrypoint(key, variant), concurrency_limit=limit)(_noop)
    else:
        pgq.entrypoint(ENTRYPOINT)(_noop)
    await pgq.run(batch_size=batch_size)


if __name__ == "__main__":
    import logging
    import os
    import sys

    logging.basicConfig(level=logging.WARNING)
    asyncio.run(work(os.environ[DSN_ENV], int(sys.argv[1]), sys.argv[2], int(sys.argv[3])))

"""The raw SQL floor: a bare table, ``INSERT ... SELECT unnest`` and a ``DELETE ... SKIP LOCKED``
loop. No retries, no leases, no results, no fairness: what PostgreSQL and psycopg cost on their
own, the physical limit every queue here pays on top of.

The enqueue cells time the bare statements (autocommit, no notification). B's burst and the
pickup jobs add a ``pg_notify`` to their transaction, so idle workers wake up as the LISTEN-based
queues' do.
"""

from __future__ import annotations

import select
import time
from collections.abc import Sequence
from multiprocessing.synchronize import Barrier

import psycopg
from psycopg.types.json import Jsonb

from benchmarks.compare.common import (
    DSN_ENV,
    SERIES_SQL,
    Backlog,
    WorkerConfig,
    series_slices,
    stamp,
    timed_calls,
)
from benchmarks.compare.system import BATCH, System, python

SCHEMA = """
CREATE TABLE raw_jobs (
    id bigserial PRIMARY KEY,
    tenant text NOT NULL,
    payload jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
"""
INSERT_ONE = "INSERT INTO raw_jobs (tenant, payload) VALUES (%s, %s)"
INSERT_MANY = "INSERT INTO raw_jobs (tenant, payload) SELECT * FROM unnest(%s::text[], %s::jsonb[])"
NOTIFY = "SELECT pg_notify('raw_jobs', '')"
DEQUEUE = (
    "DELETE FROM raw_jobs WHERE id IN ("
    " SELECT id FROM raw_jobs ORDER BY id FOR UPDATE SKIP LOCKED LIMIT %s"
    ") RETURNING id, payload"
)


class Raw(System):
    name = "raw-sql"
    configs = (WorkerConfig(1, 100), WorkerConfig(2, 100), WorkerConfig(4, 100))
    fair_config = WorkerConfig(4, 100)
    concurrency_unit = "rows per DELETE"
    pickup_config = WorkerConfig(1, 1)
    wakeup = "LISTEN/NOTIFY (pg_notify in the transaction of each burst or pickup job)"
    version = f"psycopg {psycopg.__version__}"

    def _connect(self) -> psycopg.Connection:
        return psycopg.connect(self.dsn, autocommit=True)

    def setup(self) -> None:
        with self._connect() as conn:
            conn.execute(SCHEMA)

    def reset(self) -> None:
        with self._connect() as conn:
            conn.execute("TRUNCATE raw_jobs RESTART IDENTITY")

    def remaining(self) -> int:
        with self._connect() as conn:
            row = conn.execute("SELECT count(*) FROM raw_jobs").fetchone()
        return int(row[0]) if row else 0

    def load(self, tenant: str, count: int, variant: str) -> None:
        with self._connect() as conn:
            conn.execute(
                "INSERT INTO raw_jobs (tenant, payload) SELECT %s, jsonb_build_object("
                "'tenant', %s::text, 'seq', i) FROM generate_series(1, %s) i",
                (tenant, tenant, count),
            )
            conn.execute("ANALYZE raw_jobs")

    def load_backlog(self, backlog: Backlog, variant: str) -> None:
        with self._connect() as conn:
            for params in series_slices(backlog):
                conn.execute(
                    "INSERT INTO raw_jobs (tenant, payload) SELECT tenant, jsonb_build_object("
                    f"'tenant', tenant, 'seq', seq) FROM ({SERIES_SQL}) AS x ORDER BY i",
                    params,
                )
            conn.execute("ANALYZE raw_jobs")

    def enqueue_loop(self, mode: str, duration: float, start: Barrier) -> tuple[int, float, float]:
        conn = self._connect()
        seq = 0

        def call() -> int:
            nonlocal seq
            if mode == "single":
                seq += 1
                conn.execute(INSERT_ONE, ("E", Jsonb({"tenant": "E", "seq": seq})))
                return 1
            payloads = [Jsonb({"tenant": "E", "seq": seq + j}) for j in range(BATCH)]
            seq += BATCH
            conn.execute(INSERT_MANY, (["E"] * BATCH, payloads))
            return BATCH

        try:
            return timed_calls(call, start, duration)
        finally:
            conn.close()

    def burst(
        self, tenant: str, seqs: Sequence[int], variant: str, key: str | None = None
    ) -> float:
        with self._connect() as conn:
            with conn.transaction():
                payloads = [Jsonb({"tenant": tenant, "seq": s}) for s in seqs]
                conn.execute(INSERT_MANY, ([tenant] * len(seqs), payloads))
                conn.execute(NOTIFY)
            return time.time()  # committed; the connection's close is not the jobs' wait

    def worker_commands(self, config: WorkerConfig, variant: str) -> list[list[str]]:
        argv = python("-m", "benchmarks.compare.sys_raw", str(config.concurrency))
        return [argv] * config.processes

    def worker_env(self) -> dict[str, str]:
        return {DSN_ENV: self.dsn}


def work(dsn: str, batch: int) -> None:
    """A worker: DELETE ... RETURNING a batch, run the no-op handler on each row; when the
    queue is empty, wait for a notification (or 1 s) and try again. Stops on SIGTERM."""
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("LISTEN raw_jobs")
    while True:
        rows = conn.execute(DEQUEUE, (batch,)).fetchall()
        for _id, payload in rows:
            stamp(payload["tenant"], payload["seq"])
        if not rows:
            # Wait on the socket itself: notifications arrive without a query.
            select.select([conn.pgconn.socket], [], [], 1.0)
            for _ in conn.notifies(timeout=0):
                pass


if __name__ == "__main__":
    import os
    import signal
    import sys

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    work(os.environ[DSN_ENV], int(sys.argv[1]))

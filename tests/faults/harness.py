"""What the fault scenarios share: sizes, the execution log, enqueueing, worker fleets, and the
checks, each a SQL query over the log and the queue tables.

Everything here talks to the database under test through its own psycopg connection (the URL
the workers get), so the same code serves the test database of the shared server and the
private server the restart scenario stops and starts.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from django_fairqueue.db import enqueue_store
from tests.workerkit import WorkerProcess

#: ``short`` (default: the normal test run, CI) or ``full`` (the ``faults`` tox environment).
SCALE = os.environ.get("FAIRQUEUE_FAULT_SCALE", "short")
if SCALE not in ("short", "full"):
    raise RuntimeError(f"FAIRQUEUE_FAULT_SCALE must be 'short' or 'full', got {SCALE!r}")
FULL = SCALE == "full"
#: Scenarios 5-7 run only when a scale is asked for explicitly (the ``faults`` tox environment).
EXPLICIT = "FAIRQUEUE_FAULT_SCALE" in os.environ

FINAL = ("succeeded", "failed")
TASK_MODULES = ["tests.fairtasks", "tests.faults.tasks"]

#: Figures of the scenarios run in this process, written as JSON by tests/faults/conftest.py.
FIGURES: dict[str, dict[str, Any]] = {}


def pick(short: Any, full: Any) -> Any:
    """The short size in the normal test run, the full one with FAIRQUEUE_FAULT_SCALE=full."""
    return full if FULL else short


def record(scenario: str, **figures: Any) -> None:
    FIGURES[scenario] = {"scale": SCALE, **figures}
    print(f"\n{scenario}: {json.dumps(figures, default=str)}")


LOG_TABLES = """
CREATE TABLE IF NOT EXISTS fault_exec_log (
    id bigserial PRIMARY KEY,
    message_id bigint NOT NULL,
    channel text NOT NULL,
    attempt integer NOT NULL,
    pid integer NOT NULL,
    claimed_at timestamptz NOT NULL,
    started_at timestamptz NOT NULL,
    finished_at timestamptz
);
CREATE INDEX IF NOT EXISTS fault_exec_log_message_idx ON fault_exec_log (message_id);
CREATE TABLE IF NOT EXISTS fault_enqueued (
    message_id bigint PRIMARY KEY,
    channel_id bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS fault_kills (pid integer NOT NULL, killed_at timestamptz NOT NULL);
TRUNCATE fault_exec_log, fault_enqueued, fault_kills;
"""


class Db:
    """An autocommit psycopg connection to the database under test."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn = psycopg.connect(url, autocommit=True)

    def rows(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        cur = self.conn.execute(sql, params)
        return cur.fetchall() if cur.description is not None else []

    def value(self, sql: str, params: Any = None) -> Any:
        (row,) = self.rows(sql, params)
        return row[0]

    def reconnect(self) -> None:
        self.conn.close()
        self.conn = psycopg.connect(self.url, autocommit=True)

    def close(self) -> None:
        self.conn.close()


def create_log_tables(db: Db) -> None:
    db.conn.execute(LOG_TABLES)


def enqueue(
    db: Db,
    channels: Sequence[str],
    *,
    task: str = "tests.faults.work",
    seconds: float = 0.0,
    max_attempts: int = 20,
    keep_result: bool | None = None,
    max_concurrency: int | None = None,
    release_interval: timedelta = timedelta(0),
    max_backlog: int | None = None,
    batch: int = 1000,
) -> list[int]:
    """Enqueue one message per entry of ``channels`` with the queue's own enqueue statement
    (channels created on first use with the given limits) and note their ids in
    ``fault_enqueued`` in the same transaction; returns the ids."""
    sql = enqueue_store.queries()["enqueue_messages"]
    if keep_result is None:
        keep_result = task == "tests.faults.kept"
    payload = json.dumps({"args": [seconds], "kwargs": {}})
    ids: list[int] = []
    for start in range(0, len(channels), batch):
        names = list(channels[start : start + batch])
        n = len(names)
        params = {
            "channels": names,
            "tasks": [task] * n,
            "payloads": [Jsonb(json.loads(payload))] * n,
            "priorities": [0] * n,
            "run_at": [None] * n,
            "max_attempts": [max_attempts] * n,
            "keep_result": [keep_result] * n,
            "default_max_concurrency": max_concurrency,
            "default_release_interval": release_interval,
            "default_weight": 1,
            "default_max_backlog": max_backlog,
            "notify_channel": "fairqueue",
            "delays": None,
            "create": True,  # one statement per transaction: it creates channels itself
            "unique_keys": None,
            "unique_scopes": None,
            "on_conflict": None,
        }
        with db.conn.transaction():
            got = [r[0] for r in db.conn.execute(sql, params).fetchall()]
            db.conn.execute(
                "INSERT INTO fault_enqueued (message_id, channel_id) "
                "SELECT id, channel_id FROM fairqueue_message WHERE id = ANY (%s::bigint[])",
                [got],
            )
        ids.extend(got)
    return ids


def set_caps(db: Db, caps: dict[str, int | None]) -> None:
    """Give channels their concurrency caps (before any worker runs: no claim holds a slot)."""
    for name, cap in caps.items():
        db.conn.execute(
            "UPDATE fairqueue_channel SET max_concurrency = %s WHERE name = %s", [cap, name]
        )


def spread(channels: Sequence[str], count: int, seed: int = 6) -> list[str]:
    """``count`` channel names, uneven (a few tenants have most of the work), shuffled."""
    rng = random.Random(seed)
    weights = [1.0 / (1 + i) ** 0.5 for i in range(len(channels))]
    names = list(channels)  # every channel gets at least one message
    names += rng.choices(channels, weights=weights, k=count - len(names))
    rng.shuffle(names)
    return names


# ------------------------------------------------------------------------------------------
# Worker fleets


@dataclass
class Fleet:
    """``runfairworker`` processes against ``url``; kills are noted in ``fault_kills``."""

    url: str
    overrides: dict[str, Any]
    args: Sequence[str] = ("--concurrency", "4", "--verbosity", "0")
    workers: list[WorkerProcess] = field(default_factory=list)
    retired: list[WorkerProcess] = field(default_factory=list)
    kills: int = 0
    _n: int = 0

    def start(self, count: int = 1, *extra: str) -> list[WorkerProcess]:
        started = []
        for _ in range(count):
            self._n += 1
            worker = WorkerProcess(
                self.url,
                f"fault-{self._n}",
                *self.args,
                *extra,
                overrides={"TASK_MODULES": TASK_MODULES, **self.overrides},
            )
            self.workers.append(worker)
            started.append(worker)
        return started

    def kill(self, db: Db, worker: WorkerProcess) -> None:
        """SIGKILL one worker and note when (database clock) in ``fault_kills``."""
        worker.signal(signal.SIGKILL)
        worker.wait(10)
        db.conn.execute(
            "INSERT INTO fault_kills (pid, killed_at) VALUES (%s, clock_timestamp())", [worker.pid]
        )
        self.kills += 1
        self.workers.remove(worker)
        self.retired.append(worker)

    def alive(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w.proc.poll() is None]

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM every worker and wait (graceful stop); kill what does not stop."""
        for worker in self.workers:
            if worker.proc.poll() is None:
                worker.signal(signal.SIGTERM)
        for worker in self.workers:
            try:
                worker.wait(timeout)
            except Exception:
                worker.close()

    def close(self) -> None:
        for worker in [*self.workers, *self.retired]:
            worker.close()

    def logs(self) -> str:
        return "\n".join(
            f"--- worker {w.worker_id} (pid {w.pid}) ---\n{w.output[-6000:]}"
            for w in [*self.retired, *self.workers]
        )


# ------------------------------------------------------------------------------------------
# Checks: each one query


def remaining(db: Db) -> int:
    """Enqueued messages not final yet (a deleted row is a success without a kept result)."""
    return int(
        db.value(
            "SELECT count(*) FROM fault_enqueued e JOIN fairqueue_message m ON m.id = e.message_id "
            "WHERE m.state <> ALL (%s::text[])",
            [list(FINAL)],
        )
    )


def wait_drained(
    db: Db,
    timeout: float,
    *,
    every: float = 0.5,
    tick: Callable[[], None] | None = None,
    fleet: Fleet | None = None,
) -> float:
    """Wait until every enqueued message is final, calling ``tick`` each round; returns the
    seconds it took."""
    began = time.monotonic()
    while True:
        left = remaining(db)
        if left == 0:
            return time.monotonic() - began
        if time.monotonic() - began > timeout:
            raise AssertionError(
                f"{left} messages still not final after {timeout}s\n"
                + (fleet.logs() if fleet is not None else "")
            )
        if tick is not None:
            tick()
        time.sleep(every)


@dataclass(frozen=True)
class Outcome:
    enqueued: int
    lost: int  # not final, or gone without a finished run
    failed: int
    executions: int  # rows of the execution log
    messages_run: int  # distinct messages with at least one run
    duplicates: int  # messages that ran more than once
    unexplained_duplicates: int  # earlier runs of a message by a worker that was never killed
    duplicate_pids: tuple[int, ...]


def outcome(db: Db) -> Outcome:
    (row,) = db.rows(
        """
        WITH per AS (
            SELECT message_id, count(*) AS runs FROM fault_exec_log GROUP BY message_id
        ), ranked AS (
            SELECT l.message_id, l.pid,
                   row_number() OVER (PARTITION BY l.message_id ORDER BY l.started_at DESC) AS rn
            FROM fault_exec_log l
        )
        SELECT
            (SELECT count(*) FROM fault_enqueued),
            (SELECT count(*) FROM fault_enqueued e
             LEFT JOIN fairqueue_message m ON m.id = e.message_id
             WHERE (m.id IS NOT NULL AND m.state <> ALL (%(final)s::text[]))
                OR (m.id IS NULL AND NOT EXISTS (
                    SELECT 1 FROM fault_exec_log l
                    WHERE l.message_id = e.message_id AND l.finished_at IS NOT NULL))),
            (SELECT count(*) FROM fault_enqueued e
             JOIN fairqueue_message m ON m.id = e.message_id WHERE m.state = 'failed'),
            (SELECT count(*) FROM fault_exec_log),
            (SELECT count(*) FROM per),
            (SELECT count(*) FROM per WHERE runs > 1),
            (SELECT count(*) FROM ranked
             WHERE rn > 1 AND pid NOT IN (SELECT pid FROM fault_kills)),
            (SELECT coalesce(array_agg(DISTINCT pid), '{}') FROM ranked WHERE rn > 1)
        """,
        {"final": list(FINAL)},
    )
    return Outcome(*row[:7], tuple(row[7]))


def max_concurrency(db: Db) -> dict[str, tuple[int, int | None]]:
    """{channel: (most runs of it at once in the log, its cap)}.

    Each run is the interval from its start to its end, or to its worker's kill when the kill
    cut it short. A sweep over start (+1) and end (-1) events, ends first at equal times.
    """
    rows = db.rows(
        """
        WITH iv AS (
            SELECT l.channel, l.started_at AS s,
                   coalesce(l.finished_at, k.killed_at, 'infinity') AS e
            FROM fault_exec_log l LEFT JOIN fault_kills k ON k.pid = l.pid
        ), ev AS (
            SELECT channel, s AS t, 1 AS d FROM iv
            UNION ALL
            SELECT channel, e AS t, -1 AS d FROM iv
        ), run AS (
            SELECT channel,
                   sum(d) OVER (PARTITION BY channel ORDER BY t, d ROWS UNBOUNDED PRECEDING) AS c
            FROM ev
        )
        SELECT run.channel, max(run.c), ch.max_concurrency
        FROM run JOIN fairqueue_channel ch ON ch.name = run.channel
        GROUP BY run.channel, ch.max_concurrency
        """
    )
    return {name: (int(most), cap) for name, most, cap in rows}


def cap_excess(db: Db) -> tuple[int, list[str]]:
    """(highest concurrency / cap seen, as a difference; channels over their cap)."""
    seen = max_concurrency(db)
    over = [f"{n}: {most} > {cap}" for n, (most, cap) in seen.items() if cap and most > cap]
    worst = max((most - cap for most, cap in seen.values() if cap), default=0)
    return worst, over


#: Channel counters (row + pending deltas) against the table, in one snapshot; a channel over
#: its cap by its exact running count counts too.
COUNTER_MISMATCHES = """
SELECT c.name,
       c.ready_count + coalesce(d.ready, 0), coalesce(t.ready, 0),
       c.scheduled_count + coalesce(d.scheduled, 0), coalesce(t.scheduled, 0),
       c.running_count + coalesce(d.running, 0), coalesce(t.running, 0),
       c.failed_count + coalesce(d.failed, 0), coalesce(t.failed, 0),
       c.max_concurrency
FROM fairqueue_channel c
LEFT JOIN LATERAL (
    SELECT sum(x.ready) AS ready, sum(x.scheduled) AS scheduled, sum(x.running) AS running,
           sum(x.failed) AS failed
    FROM fairqueue_channel_delta x WHERE x.channel_id = c.id
) d ON true
LEFT JOIN LATERAL (
    SELECT count(*) FILTER (WHERE m.state = 'ready') AS ready,
           count(*) FILTER (WHERE m.state = 'scheduled') AS scheduled,
           count(*) FILTER (WHERE m.state = 'running') AS running,
           count(*) FILTER (WHERE m.state = 'failed') AS failed
    FROM fairqueue_message m WHERE m.channel_id = c.id
) t ON true
WHERE c.ready_count + coalesce(d.ready, 0) <> coalesce(t.ready, 0)
   OR c.scheduled_count + coalesce(d.scheduled, 0) <> coalesce(t.scheduled, 0)
   OR c.running_count + coalesce(d.running, 0) <> coalesce(t.running, 0)
   OR c.failed_count + coalesce(d.failed, 0) <> coalesce(t.failed, 0)
   OR coalesce(t.running, 0) > c.max_concurrency
"""


def counter_mismatches(db: Db) -> list[tuple[Any, ...]]:
    return db.rows(COUNTER_MISMATCHES)


def succeeded_counter_mismatches(db: Db) -> list[tuple[Any, ...]]:
    """Channels whose succeeded counter differs from the messages that succeeded (rows
    deleted by a completion, or kept as succeeded)."""
    return db.rows(
        """
        SELECT c.name, c.succeeded_total + coalesce(d.succeeded, 0), coalesce(t.n, 0)
        FROM fairqueue_channel c
        LEFT JOIN LATERAL (
            SELECT sum(x.succeeded) AS succeeded FROM fairqueue_channel_delta x
            WHERE x.channel_id = c.id
        ) d ON true
        LEFT JOIN LATERAL (
            SELECT count(*) AS n FROM fault_enqueued e
            LEFT JOIN fairqueue_message m ON m.id = e.message_id
            WHERE e.channel_id = c.id AND (m.id IS NULL OR m.state = 'succeeded')
        ) t ON true
        WHERE c.succeeded_total + coalesce(d.succeeded, 0) <> coalesce(t.n, 0)
        """
    )


def wait_until_true(predicate: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.1)


def busy_pids(db: Db) -> set[int]:
    """Worker processes running a task right now (started, not finished)."""
    return {
        r[0] for r in db.rows("SELECT DISTINCT pid FROM fault_exec_log WHERE finished_at IS NULL")
    }


def wait_listening(db: Db, fleet: Fleet, timeout: float = 60.0) -> None:
    """Wait until every worker of ``fleet`` is up: its wake-up listener is connected."""
    names = [f"fairqueue listener {w.worker_id}" for w in fleet.workers]
    deadline = time.monotonic() + timeout
    while True:
        n = db.value(
            "SELECT count(DISTINCT application_name) FROM pg_stat_activity "
            "WHERE application_name = ANY (%s)",
            [names],
        )
        if n == len(names):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{n} of {len(names)} workers listening\n{fleet.logs()}")
        time.sleep(0.1)


def wait_running(db: Db, fleet: Fleet, count: int, timeout: float = 60.0) -> None:
    """Wait until ``count`` worker processes of ``fleet`` have run something (started up)."""
    pids = [w.pid for w in fleet.workers]
    deadline = time.monotonic() + timeout
    while True:
        n = db.value("SELECT count(DISTINCT pid) FROM fault_exec_log WHERE pid = ANY (%s)", [pids])
        if n >= count:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"only {n} of {count} workers ran anything\n{fleet.logs()}")
        time.sleep(0.1)


def throughput(db: Db, since: Any = None, until: Any = None) -> float:
    """Runs finished per second between two database times (default: the whole log)."""
    row = db.rows(
        """
        SELECT count(*), extract(epoch FROM max(finished_at) - min(started_at))
        FROM fault_exec_log
        WHERE finished_at IS NOT NULL
          AND (%(since)s::timestamptz IS NULL OR finished_at >= %(since)s)
          AND (%(until)s::timestamptz IS NULL OR finished_at < %(until)s)
        """,
        {"since": since, "until": until},
    )[0]
    count, seconds = row
    return float(count) / float(seconds) if count and seconds else 0.0


def finished_between(db: Db, since: Any, until: Any) -> int:
    return int(
        db.value(
            "SELECT count(*) FROM fault_exec_log WHERE finished_at >= %s AND finished_at < %s",
            [since, until],
        )
    )


def now(db: Db) -> Any:
    return db.value("SELECT clock_timestamp()")


def table_stats(db: Db, tables: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Live and dead tuples, size and last autovacuum of the queue tables."""
    rows = db.rows(
        """
        SELECT s.relname, s.n_live_tup, s.n_dead_tup, pg_total_relation_size(s.relid),
               s.last_autovacuum, s.autovacuum_count
        FROM pg_stat_user_tables s WHERE s.relname = ANY (%s::text[])
        """,
        [list(tables)],
    )
    return {
        name: {"live": live, "dead": dead, "bytes": size, "last_autovacuum": last, "vacuums": n}
        for name, live, dead, size, last, n in rows
    }

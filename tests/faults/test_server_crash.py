"""PostgreSQL crashes mid-run while workers claim and complete without waiting for the WAL flush.

``FAIRQUEUE['ASYNC_COMMIT']`` (the default) lets a worker's claims and completions commit before
their WAL is on disk. The private server is stopped in immediate mode with the fleet at work (no
shutdown checkpoint, no last WAL flush: what a power cut or a killed postmaster does), then
started again, which replays its WAL (crash recovery). Claims and completions of the last moments
may be lost: their messages run again. What must hold: a message of an at-most-once task never
runs twice (its claims wait for the flush), no message is lost, no at-least-once message fails,
the counters equal the rows, and the same worker processes go on without a restart.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from django_fairqueue import devdb
from tests.faults import harness
from tests.faults.harness import Fleet, pick

pytestmark = [pytest.mark.slow, pytest.mark.faults]

MESSAGES = pick(1200, 8000)  # per kind
CHANNELS = pick(8, 40)
PROCESSES = 2
THREADS = 4
#: Short, so completions lost in the crash are rescued (and their messages run again) soon.
LEASE = 5.0


def test_a_server_crash_loses_no_message_and_runs_no_at_most_once_message_twice(
    private_server: devdb.EmbeddedPostgres, fleets: Callable[..., Fleet]
) -> None:
    url = private_server.url("faults")
    db = harness.Db(url)
    harness.create_log_tables(db)
    names = [f"tenant-{i:02d}" for i in range(CHANNELS)]
    channels = harness.spread(names, MESSAGES)
    # Both kinds log their runs with synchronous commit: with the suite's asynchronous log, a
    # run whose end the crash took, completed by its worker after the restart, would look lost.
    harness.enqueue(db, channels, task="tests.faults.durable", seconds=0.002)
    once = harness.enqueue(db, channels, task="tests.faults.once", seconds=0.002, max_attempts=1)
    fleet = fleets(
        url,
        overrides={"LEASE_SECONDS": LEASE, "ASYNC_COMMIT": True},
        args=("--concurrency", str(THREADS), "--verbosity", "0"),
    )
    pids = [w.pid for w in fleet.start(PROCESSES)]
    harness.wait_until_true(
        lambda: db.value("SELECT count(*) FROM fault_exec_log") >= MESSAGES // 2,
        120,
        "a quarter of the messages running",
    )

    # -- the crash -----------------------------------------------------------------------------
    done_before = db.value("SELECT count(*) FROM fault_exec_log WHERE finished_at IS NOT NULL")
    db.close()
    private_server.stop("immediate")
    time.sleep(1.0)
    private_server.start()  # crash recovery
    db = harness.Db(url)
    seconds = harness.wait_drained(db, pick(180, 600), fleet=fleet)
    assert [w.pid for w in fleet.alive()] == pids, "a worker process exited\n" + fleet.logs()

    result = harness.outcome(db)
    twice = db.value(
        "SELECT count(*) FROM (SELECT message_id FROM fault_exec_log "
        "WHERE message_id = ANY (%s) GROUP BY message_id HAVING count(*) > 1) x",
        [once],
    )
    failed_at_least_once = db.value(
        "SELECT count(*) FROM fault_enqueued e JOIN fairqueue_message m ON m.id = e.message_id "
        "WHERE m.state = 'failed' AND NOT (m.id = ANY (%s))",
        [once],
    )
    drift = harness.counter_mismatches(db) + harness.succeeded_counter_mismatches(db)
    harness.record(
        "server crash, asynchronous claims and completions",
        messages=result.enqueued,
        at_most_once=len(once),
        channels=CHANNELS,
        processes=f"{PROCESSES} x {THREADS}",
        finished_before_crash=done_before,
        drain_after_crash_seconds=round(seconds, 1),
        ran_twice=result.duplicates,
        at_most_once_ran_twice=twice,
        at_most_once_failed=result.failed - failed_at_least_once,
        lost=result.lost,
        counter_mismatches=len(drift),
    )
    db.close()
    assert result.lost == 0
    assert twice == 0
    assert failed_at_least_once == 0
    assert drift == [], drift

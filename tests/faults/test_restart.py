"""Scenario 4: PostgreSQL restarts mid-run; then only the listeners' backends are terminated.

The server restarted is a private embedded one started for this test (its own data directory
and port), never the shared development server other test runs use. Workers must reconnect
without restarting their process, and the run must complete; with polling every 30 s, the
messages enqueued while the listeners were cut off are picked up only if the listeners
reconnect and catch up.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from django_fairqueue import devdb
from tests.faults import harness
from tests.faults.harness import Db, Fleet, pick

pytestmark = [pytest.mark.slow, pytest.mark.faults]

MESSAGES = pick(1500, 10_000)
CHANNELS = pick(8, 40)
PROCESSES = 2
THREADS = 4
#: Leases outlast the restart, so no message should run twice.
LEASE = 15.0
LISTENER = "fairqueue listener %"


def listeners(db: Db) -> int:
    return int(
        db.value("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s", [LISTENER])
    )


def test_workers_survive_a_database_restart_and_a_lost_listener(
    private_server: devdb.EmbeddedPostgres, fleets: Callable[..., Fleet]
) -> None:
    url = private_server.url("faults")
    db = Db(url)
    harness.create_log_tables(db)
    names = [f"tenant-{i:02d}" for i in range(CHANNELS)]
    harness.enqueue(db, harness.spread(names, MESSAGES), seconds=0.005)
    fleet = fleets(
        url,
        overrides={"LEASE_SECONDS": LEASE, "POLL_INTERVAL": 30.0},
        args=("--concurrency", str(THREADS), "--verbosity", "0"),
    )
    workers = fleet.start(PROCESSES)
    pids = [w.pid for w in workers]
    harness.wait_until_true(
        lambda: db.value("SELECT count(*) FROM fault_exec_log") >= MESSAGES // 4,
        120,
        "a quarter of the messages running",
    )

    # -- the restart --------------------------------------------------------------------------
    port = private_server.port
    began = time.monotonic()
    private_server.stop("fast")  # ends every session, as a failover or a restart does
    db.close()
    time.sleep(2.0)  # workers notice meanwhile: claims, settles and heartbeats fail
    private_server.start()
    down = time.monotonic() - began
    assert private_server.port == port, "the private server came back on another port"
    db = Db(url)
    restarted_at = harness.now(db)
    done_before = db.value("SELECT count(*) FROM fault_exec_log WHERE finished_at IS NOT NULL")
    seconds = harness.wait_drained(db, pick(180, 600), fleet=fleet)
    assert [w.pid for w in fleet.alive()] == pids, "a worker process exited\n" + fleet.logs()
    harness.wait_until_true(lambda: listeners(db) == PROCESSES, 60, "both listeners back")

    result = harness.outcome(db)
    # a message that ran twice must have started its first run before the restart ended
    late = db.value(
        """
        SELECT count(*) FROM (
            SELECT l.started_at,
                   row_number() OVER (PARTITION BY l.message_id ORDER BY l.started_at DESC) AS rn
            FROM fault_exec_log l
        ) r WHERE r.rn > 1 AND r.started_at >= %s
        """,
        [restarted_at],
    )
    drift = harness.counter_mismatches(db) + harness.succeeded_counter_mismatches(db)

    # -- only the listeners' backends die -------------------------------------------------------
    assert (
        db.value(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name LIKE %s",
            [LISTENER],
        )
        == PROCESSES
    )
    cut = time.monotonic()
    harness.enqueue(db, ["after-listener-loss"] * 20)  # while they reconnect
    harness.wait_drained(db, 20, every=0.1, fleet=fleet)  # polling alone would take ~30 s
    catch_up = time.monotonic() - cut
    harness.wait_until_true(lambda: listeners(db) == PROCESSES, 20, "listeners back")
    assert [w.pid for w in fleet.alive()] == pids

    harness.record(
        "4 database restart",
        messages=result.enqueued,
        channels=CHANNELS,
        processes=f"{PROCESSES} x {THREADS}",
        restarts=1,
        downtime_seconds=round(down, 1),
        finished_before_restart=done_before,
        drain_after_restart_seconds=round(seconds, 1),
        duplicates=result.duplicates,
        lost=result.lost,
        failed=result.failed,
        counter_mismatches=len(drift),
        worker_processes_restarted=0,
        catch_up_after_listener_loss_seconds=round(catch_up, 1),
    )
    db.close()
    assert (result.lost, result.failed) == (0, 0)
    assert late == 0
    assert drift == [], drift
    assert catch_up < 20

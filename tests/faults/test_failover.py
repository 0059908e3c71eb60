"""Failover to a synchronous standby under load: the primary is killed (SIGKILL) while workers
run and a producer enqueues, the standby is promoted, and then no acknowledged enqueue is
lost, every message reaches a final state, and the same worker processes claim again.

Both servers are private embedded ones started for this test from the binaries the
development server uses: the primary in .fairqueue/, the standby made from it with
``pg_basebackup`` and named in the primary's ``synchronous_standby_names``, so a commit is
acknowledged only once the standby has it. Workers and the producer connect with a libpq
multi-host URL (``target_session_attrs=read-write``): after the promotion they find the new
primary by themselves, as they would behind a DNS name or a virtual IP that moves.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator

import psycopg
import pytest

from django_fairqueue import devdb
from tests.faults import harness
from tests.faults.harness import Db, Fleet, pick
from tests.workerkit import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.faults]

MESSAGES = pick(800, 4000)
CHANNELS = [f"tenant-{i:02d}" for i in range(8)]
STANDBY_NAME = "fairqueue_standby"
LEASE = 10.0
TASK = "tests.faults.durable"


@pytest.fixture
def pair(
    private_server: devdb.EmbeddedPostgres,
) -> Iterator[tuple[devdb.EmbeddedPostgres, devdb.EmbeddedPostgres]]:
    """The private server as the primary, and its synchronous standby, both running."""
    primary = private_server
    standby = devdb.EmbeddedPostgres(
        ROOT / ".fairqueue" / f"pgdata-standby-{os.getpid()}", devdb.default_bindir()
    )
    try:
        standby.datadir.mkdir(parents=True, mode=0o700)
        standby._prepare_permissions()  # as root: the server's user owns it
        primary._run(
            [
                str(primary.bindir / "pg_basebackup"),
                *("-D", str(standby.datadir), "-h", devdb.HOST, "-p", str(primary.port)),
                *("-U", devdb.SUPERUSER, "-X", "stream", "-R", "-c", "fast"),
            ],
            timeout=300,
        )
        # -R wrote primary_conninfo; the name the primary's synchronous_standby_names expects
        with (standby.datadir / "postgresql.auto.conf").open("a") as auto:
            auto.write(
                f"primary_conninfo = 'host={devdb.HOST} port={primary.port} "
                f"user={devdb.SUPERUSER} application_name={STANDBY_NAME}'\n"
            )
        (standby.datadir / "postmaster.pid").unlink(missing_ok=True)
        standby.start()  # on a port of its own (the copied one is the primary's)
        with psycopg.connect(primary.url("faults"), autocommit=True) as conn:
            conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'")
            conn.execute("SELECT pg_reload_conf()")
            harness.wait_until_true(
                lambda: (
                    conn.execute(
                        "SELECT count(*) FROM pg_stat_replication "
                        "WHERE application_name = %s AND sync_state = 'sync'",
                        [STANDBY_NAME],
                    ).fetchone()[0]  # type: ignore[index]
                    == 1
                ),
                60,
                "the standby streaming synchronously",
            )
        yield primary, standby
    finally:
        with contextlib.suppress(devdb.DevDBError):
            standby.stop("immediate")
        shutil.rmtree(standby.datadir, ignore_errors=True)


def test_failover_to_a_synchronous_standby_under_load(
    pair: tuple[devdb.EmbeddedPostgres, devdb.EmbeddedPostgres], fleets: Callable[..., Fleet]
) -> None:
    primary, standby = pair
    url = (
        f"postgres://{devdb.SUPERUSER}@{devdb.HOST}:{primary.port},{devdb.HOST}:{standby.port}"
        "/faults?target_session_attrs=read-write&connect_timeout=2"
    )
    db = Db(url)
    harness.create_log_tables(db)
    harness.enqueue(db, harness.spread(CHANNELS, MESSAGES), task=TASK, seconds=0.003)

    acknowledged: list[int] = []
    refused = [0]
    stop = threading.Event()

    def produce() -> None:
        """Enqueue small batches without pause; an id counts once its commit returned."""
        conn: Db | None = None
        while not stop.is_set():
            try:
                if conn is None:
                    conn = Db(url)
                acknowledged.extend(harness.enqueue(conn, CHANNELS[:4], task=TASK, seconds=0.003))
            except psycopg.Error:
                refused[0] += 1
                if conn is not None:
                    with contextlib.suppress(psycopg.Error):
                        conn.close()
                conn = None
                time.sleep(0.1)
        if conn is not None:
            conn.close()

    fleet = fleets(url, overrides={"LEASE_SECONDS": LEASE})
    fleet.start(2)
    pids = sorted(w.pid for w in fleet.workers)
    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    try:
        harness.wait_until_true(
            lambda: db.value("SELECT count(*) FROM fault_exec_log") >= MESSAGES // 4,
            120,
            "a quarter of the messages running",
        )
        # -- the failover ----------------------------------------------------------------------
        primary_pid = primary.pid
        assert primary_pid is not None
        os.kill(primary_pid, signal.SIGKILL)
        killed = time.monotonic()
        db.conn.close()
        time.sleep(2.0)  # as an operator or a failover manager would take a moment
        standby._run([str(standby.bindir / "pg_ctl"), "-D", str(standby.datadir), "-w", "promote"])
        promoted = time.monotonic()
        db = Db(standby.url("faults"))
        promoted_at = harness.now(db)
        enqueued_before_promote = len(acknowledged)
        harness.wait_until_true(
            lambda: len(acknowledged) > enqueued_before_promote + 40, 60, "enqueues accepted again"
        )
    finally:
        stop.set()
        producer.join(30)

    drain = harness.wait_drained(db, pick(240, 900), fleet=fleet)
    first_claim = db.value(
        "SELECT extract(epoch FROM min(claimed_at) - %s) FROM fault_exec_log WHERE claimed_at > %s",
        [promoted_at, promoted_at],
    )
    missing = db.value(
        "SELECT count(*) FROM unnest(%s::bigint[]) AS a(id) "
        "WHERE NOT EXISTS (SELECT 1 FROM fault_enqueued e WHERE e.message_id = a.id)",
        [acknowledged],
    )
    result = harness.outcome(db)
    drift = harness.counter_mismatches(db)
    alive = sorted(w.pid for w in fleet.alive())
    harness.record(
        "failover to a synchronous standby",
        messages=result.enqueued,
        acknowledged_during_run=len(acknowledged),
        acknowledged_lost=missing,
        enqueues_refused_during_failover=refused[0],
        down_seconds=round(promoted - killed, 1),
        first_claim_after_promote_seconds=round(float(first_claim or 0), 2),
        drain_after_promote_seconds=round(drain, 1),
        lost=result.lost,
        failed=result.failed,
        duplicates=result.duplicates,
        counter_mismatches=len(drift),
        worker_processes_restarted=len(set(pids) - set(alive)),
    )
    fleet.stop()
    db.close()
    assert missing == 0, f"{missing} acknowledged enqueues lost"
    assert (result.lost, result.failed) == (0, 0), result
    assert alive == pids, "a worker process exited\n" + fleet.logs()
    assert first_claim is not None, "no claim after the promotion"
    assert drift == [], drift

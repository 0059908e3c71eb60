"""Scenario 5: a session holds an old snapshot (a REPEATABLE READ transaction) while the queue
runs with a backlog kept topped up. Throughput during it stays >= 70 % of the throughput
before it, table bloat is measured, and the backlog drains once it ends."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg
import pytest

from tests.faults import harness
from tests.faults.harness import Db, Fleet, pick

pytestmark = [
    pytest.mark.slow,
    pytest.mark.faults,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not harness.EXPLICIT, reason="set FAIRQUEUE_FAULT_SCALE (tox -e faults)"),
]

BASELINE = pick(20.0, 60.0)  # seconds without the long transaction
HELD = pick(40.0, 180.0)  # seconds with it
CHANNELS = [f"tenant-{i:02d}" for i in range(20)]
TABLES = ("fairqueue_message", "fairqueue_channel", "fairqueue_channel_delta")
BACKLOG = 2000  # the producer keeps at least this many messages waiting


def test_an_old_snapshot_keeps_throughput_and_the_backlog_drains_after(
    fault_db: Db, fleets: Callable[..., Fleet]
) -> None:
    harness.enqueue(fault_db, harness.spread(CHANNELS, 2 * BACKLOG), seconds=0.002)
    stop = threading.Event()
    produced = [0]

    def produce() -> None:
        db = Db(fault_db.url)
        try:
            while not stop.wait(0.25):
                waiting = db.value("SELECT count(*) FROM fairqueue_message WHERE state = 'ready'")
                if waiting < BACKLOG:
                    ids = harness.enqueue(db, harness.spread(CHANNELS, 500), seconds=0.002)
                    produced[0] += len(ids)
        finally:
            db.close()

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    fleet = fleets(fault_db.url, args=("--concurrency", "4", "--verbosity", "0"))
    fleet.start(2)
    try:
        harness.wait_listening(fault_db, fleet)
        t0 = harness.now(fault_db)
        time.sleep(BASELINE)
        t1 = harness.now(fault_db)
        before = harness.table_stats(fault_db, TABLES)

        old = psycopg.connect(fault_db.url, autocommit=False)
        old.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        old.execute("SELECT count(*) FROM fairqueue_message").fetchone()  # takes the snapshot
        held_xmin = fault_db.value(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_xmin IS NOT NULL "
            "AND state = 'idle in transaction' AND pid = %s",
            [old.info.backend_pid],
        )
        time.sleep(HELD)
        t2 = harness.now(fault_db)
        during = harness.table_stats(fault_db, TABLES)
        old.rollback()
        old.close()
    finally:
        stop.set()
        producer.join(30)
    t3 = harness.now(fault_db)
    drain = harness.wait_drained(fault_db, pick(300, 900), fleet=fleet)
    # autovacuum catches up once the snapshot is gone (its naptime is a minute)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        after = harness.table_stats(fault_db, TABLES)
        if after["fairqueue_message"]["dead"] < during["fairqueue_message"]["dead"] / 4:
            break
        time.sleep(5)
    fleet.stop()

    normal = harness.finished_between(fault_db, t0, t1) / BASELINE
    held = harness.finished_between(fault_db, t1, t2) / HELD
    ratio = held / normal if normal else 0.0
    result = harness.outcome(fault_db)

    def brief(stats: dict[str, dict[str, object]]) -> dict[str, str]:
        return {
            name.removeprefix("fairqueue_"): f"{s['dead']} dead / {s['live']} live, "
            f"{int(s['bytes']) // 1024} kB"  # type: ignore[call-overload]
            for name, s in stats.items()
        }

    harness.record(
        "5 long transaction",
        messages=result.enqueued,
        processes="2 x 4",
        held_seconds=HELD,
        normal_per_second=round(normal),
        held_per_second=round(held),
        throughput_ratio=round(ratio, 2),
        drain_after_seconds=round(drain, 1),
        lost=result.lost,
        duplicates=result.duplicates,
        tables_before=brief(before),
        tables_at_end_of_snapshot=brief(during),
        tables_after_autovacuum=brief(after),
        snapshot_started=str(t1),
        snapshot_ended=str(t3),
    )
    assert held_xmin == 1  # the session really held back the xmin horizon
    assert result.lost == 0 and result.failed == 0
    assert result.duplicates == 0
    # Loose in the short run (a shared 2-core machine); the documented bound in the full run.
    assert ratio >= pick(0.4, 0.7), (normal, held)

"""Behind PgBouncer in transaction mode (as docs/howto/deploy-workers.md sets it up): workers
run every message once, their listeners find that notifications do not arrive and poll on
purpose (saying so in the log and the registry), and the admin's pages answer.

PgBouncer is started for the test in front of the test PostgreSQL (tests/poolerkit.py); the
test skips, saying why, where it is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from tests import poolerkit
from tests.faults import harness
from tests.faults.harness import Db, Fleet, pick
from tests.workerkit import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.faults, pytest.mark.django_db(transaction=True)]

MESSAGES = pick(600, 2000)
CHANNELS = [f"tenant-{i:02d}" for i in range(8)]


@pytest.fixture
def pgbouncer(database_url: str) -> Iterator[poolerkit.PgBouncer]:
    workdir = ROOT / ".fairqueue" / f"pgbouncer-{os.getpid()}"
    try:
        bouncer = poolerkit.start_or_skip(database_url, workdir, pool_size=8)
        try:
            yield bouncer
        finally:
            bouncer.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_workers_and_admin_behind_pgbouncer_in_transaction_mode(
    fault_db: Db, fleets: Callable[..., Fleet], pgbouncer: poolerkit.PgBouncer
) -> None:
    harness.enqueue(fault_db, harness.spread(CHANNELS, MESSAGES), seconds=0.002)
    pooled = pgbouncer.url()
    # PgBouncer before 1.21 does not keep prepared statements across transactions
    fleet = fleets(pooled, overrides={"PREPARED_STATEMENTS": False})
    workers = fleet.start(2)
    seconds = harness.wait_drained(fault_db, pick(180, 600), fleet=fleet)
    result = harness.outcome(fault_db)
    harness.record(
        "pooler",
        messages=MESSAGES,
        seconds=round(seconds, 2),
        lost=result.lost,
        duplicates=result.duplicates,
        failed=result.failed,
    )
    assert result.lost == 0 and result.failed == 0, (result, fleet.logs())
    assert result.executions == MESSAGES and result.duplicates == 0, (result, fleet.logs())
    assert harness.counter_mismatches(fault_db) == []

    # each listener saw its own probe go missing and polls on purpose, saying why
    for worker in workers:
        worker.wait_for("LISTEN does not work for this worker", timeout=30)
    recorded = dict(
        fault_db.rows(
            "SELECT worker_id, wakeups FROM fairqueue_worker WHERE worker_id = ANY (%s)",
            [[w.worker_id for w in workers]],
        )
    )
    assert len(recorded) == 2, recorded
    assert all(v.startswith("polling: no notification arrived") for v in recorded.values())

    pages = subprocess.run(
        [sys.executable, "-m", "tests.faults.admin_probe"],
        cwd=ROOT,
        env={
            **os.environ,
            "DATABASE_URL": pooled,
            "FAIRQUEUE_TEST_OVERRIDES": json.dumps({"PREPARED_STATEMENTS": False}),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert pages.returncode == 0, pages.stderr[-3000:]
    statuses = json.loads(pages.stdout.strip().splitlines()[-1])
    assert set(statuses.values()) == {200}, statuses
    fleet.stop()

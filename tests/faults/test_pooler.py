"""Behind PgBouncer in transaction mode (as docs/howto/deploy-workers.md sets it up): workers
run every message once, their listeners find that notifications do not arrive and poll on
purpose (saying so in the log and the registry), and the admin's pages answer. A worker stopped
while PgBouncer is down writes its outcomes if it is back within the grace period, and exits 1
naming those it could not write if not.

PgBouncer is started for the test in front of the test PostgreSQL (tests/poolerkit.py); the
test skips, saying why, where it is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from django_fairqueue.models import Message, MessageState
from tests import fairtasks, poolerkit
from tests.faults import harness
from tests.faults.harness import Db, Fleet, pick
from tests.workerkit import ROOT, WorkerProcess, wait_until

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


@pytest.mark.parametrize("back", [True, False], ids=["back-within-the-grace", "gone-for-good"])
def test_a_worker_stopped_during_an_outage_writes_its_outcomes_until_the_grace_ends(
    pgbouncer: poolerkit.PgBouncer, started: list[WorkerProcess], tmp_path: Path, back: bool
) -> None:
    """PgBouncer is killed while four messages run, their outcomes fail to be written, then
    SIGTERM. Back a second before the grace period (counted from the signal) ends: the
    worker writes the outcomes and exits 0, nothing to run again. Gone for good: it tries until
    the grace period ends, then exits 1 saying the four outcomes were not written; the messages
    stay running for their leases to recover."""
    grace = 5.0 if back else 2.0
    markers = [tmp_path / f"m{i}" for i in range(4)]
    ids = [fairtasks.sleep.enqueue(1.5, str(m), channel="outage") for m in markers]
    worker = WorkerProcess(
        pgbouncer.url(),
        "outage",
        *("--concurrency", "4", "--no-listen", "--shutdown-grace", str(grace)),
        overrides={"PREPARED_STATEMENTS": False, "POLL_INTERVAL": 0.5},
    )
    started.append(worker)
    wait_until(lambda: all(m.exists() for m in markers), 30, "the four messages running")
    assert pgbouncer.proc is not None
    pgbouncer.proc.kill()  # the database unreachable, as for a crashed pooler
    pgbouncer.proc.wait(10)
    worker.wait_for("writing 4 outcomes failed: database unavailable", timeout=30)
    worker.signal(signal.SIGTERM)
    signalled = time.monotonic()
    if back:
        time.sleep(max(0.0, signalled + grace - 1.0 - time.monotonic()))
        program = poolerkit.binary()
        assert program is not None
        pgbouncer.start(program)
    code = worker.wait(grace + 20)
    stopped_after = time.monotonic() - signalled
    rows = {r.id: r for r in Message.objects.filter(pk__in=ids)}
    if back:
        assert code == 0, worker.output
        assert "worker outage: 4 messages handled" in worker.output
        assert {(r.state, r.attempts, r.result["pid"]) for r in rows.values()} == {
            (MessageState.SUCCEEDED, 1, worker.pid)
        }
    else:
        assert code == 1, worker.output
        assert stopped_after >= grace  # it kept trying until the grace period ended
        assert "giving up writing 4 outcomes at shutdown: the grace period ended" in worker.output
        assert (
            "worker outage did not stop cleanly: 4 messages ran but their outcomes were not written"
        ) in worker.output
        assert {(r.state, r.attempts) for r in rows.values()} == {(MessageState.RUNNING, 1)}

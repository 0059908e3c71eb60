"""Scenario 2: without faults, no message runs twice (4 processes x 4 threads at full size)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.faults import harness
from tests.faults.harness import Db, Fleet, pick

pytestmark = [pytest.mark.slow, pytest.mark.faults, pytest.mark.django_db(transaction=True)]

MESSAGES = pick(2000, 100_000)
CHANNELS = pick(20, 100)
PROCESSES = pick(2, 4)
THREADS = 4


def test_without_faults_no_message_runs_twice(fault_db: Db, fleets: Callable[..., Fleet]) -> None:
    names = [f"tenant-{i:03d}" for i in range(CHANNELS)]
    harness.enqueue(fault_db, harness.spread(names, MESSAGES), batch=5000)
    fleet = fleets(fault_db.url, args=("--concurrency", str(THREADS), "--verbosity", "0"))
    fleet.start(PROCESSES)
    seconds = harness.wait_drained(fault_db, pick(180, 1800), every=1.0, fleet=fleet)
    fleet.stop()

    result = harness.outcome(fault_db)
    drift = harness.counter_mismatches(fault_db) + harness.succeeded_counter_mismatches(fault_db)
    rate = harness.throughput(fault_db)
    harness.record(
        "2 no duplicates",
        messages=result.enqueued,
        channels=CHANNELS,
        processes=f"{PROCESSES} x {THREADS}",
        kills=0,
        runs=result.executions,
        duplicates=result.duplicates,
        lost=result.lost,
        failed=result.failed,
        counter_mismatches=len(drift),
        seconds=round(seconds, 1),
        messages_per_second=round(rate),
    )
    assert fleet.alive() == [] or all(w.proc.returncode in (0, None) for w in fleet.workers)
    assert (result.lost, result.failed) == (0, 0)
    assert result.executions == result.messages_run == result.enqueued
    assert result.duplicates == 0
    assert drift == [], drift[:10]

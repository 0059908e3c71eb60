"""Scenario 1: kill -9 random workers every few seconds and restart them.

Every message reaches a final state, none is lost, only killed workers' runs are repeated, no
channel ever runs more messages at once than its cap (an interval-overlap query over the
execution log), and every channel's counters equal the table, sampled during the run and at
the end.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest

from tests.faults import harness
from tests.faults.harness import Db, Fleet, pick

pytestmark = [pytest.mark.slow, pytest.mark.faults, pytest.mark.django_db(transaction=True)]

MESSAGES = pick(1500, 20_000)
CHANNELS = pick(10, 50)
PROCESSES = pick(3, 4)
THREADS = 8
KILLS = pick(3, 12)
KILL_EVERY = pick(1.5, 3.0)  # seconds, +-50 %
TASK_SECONDS = 0.01


def test_kill_9_every_few_seconds_loses_nothing_and_never_exceeds_a_cap(
    fault_db: Db, fleets: Callable[..., Fleet]
) -> None:
    rng = random.Random(1)
    names = [f"tenant-{i:02d}" for i in range(CHANNELS)]
    harness.enqueue(fault_db, harness.spread(names, MESSAGES), seconds=TASK_SECONDS)
    # Caps of 1 to 3 bind: the busiest tenants keep a backlog long after the others drained,
    # and the fleet has more threads than they have slots.
    caps = {name: 3 - i % 3 for i, name in enumerate(names)}
    harness.set_caps(fault_db, caps)

    fleet = fleets(fault_db.url, args=("--concurrency", str(THREADS), "--verbosity", "0"))
    fleet.start(PROCESSES)
    harness.wait_running(fault_db, fleet, PROCESSES)
    samples, drift = 0, []
    next_kill = time.monotonic() + KILL_EVERY * rng.uniform(0.5, 1.5)

    def tick() -> None:
        nonlocal samples, next_kill
        samples += 1
        drift.extend(harness.counter_mismatches(fault_db))
        if fleet.kills < KILLS and time.monotonic() >= next_kill:
            # a worker with a message in flight (not one still starting up)
            busy = harness.busy_pids(fault_db)
            victims = [w for w in fleet.alive() if w.pid in busy]
            if not victims:
                return
            fleet.kill(fault_db, rng.choice(victims))
            fleet.start(1)  # a fresh process (a new worker id), as a supervisor would
            next_kill = time.monotonic() + KILL_EVERY * rng.uniform(0.5, 1.5)

    seconds = harness.wait_drained(fault_db, pick(180, 900), tick=tick, fleet=fleet)
    fleet.stop()

    result = harness.outcome(fault_db)
    worst, over = harness.cap_excess(fault_db)
    final_drift = harness.counter_mismatches(fault_db)
    succeeded_drift = harness.succeeded_counter_mismatches(fault_db)
    seen = harness.max_concurrency(fault_db)
    harness.record(
        "1 crash (kill -9)",
        messages=result.enqueued,
        channels=CHANNELS,
        processes=f"{PROCESSES} x {THREADS}",
        kills=fleet.kills,
        runs=result.executions,
        duplicates=result.duplicates,
        unexplained_duplicates=result.unexplained_duplicates,
        lost=result.lost,
        failed=result.failed,
        max_concurrency_over_cap=worst,
        max_concurrency=max(most for most, _ in seen.values()),
        cap_max=max(caps.values()),
        counter_samples=samples,
        counter_mismatches=len(drift) + len(final_drift) + len(succeeded_drift),
        seconds=round(seconds, 1),
        messages_per_second=round(result.enqueued / seconds),
    )
    assert fleet.kills >= min(KILLS, 2), "the run ended before the workers were killed"
    assert (result.lost, result.failed) == (0, 0)
    assert result.messages_run == result.enqueued
    # Only a killed worker's messages run twice: every earlier run of a repeated message was
    # by a process that was killed.
    assert result.unexplained_duplicates == 0, result
    assert over == [], over
    assert drift == [], drift[:10]
    assert final_drift == [] and succeeded_drift == [], (final_drift, succeeded_drift)

"""Scenario 7: a fleet-wide rate limit. Four worker processes share channels with a release
interval; no channel is ever claimed more often than its interval allows, in any window."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest

from tests.faults import harness
from tests.faults.harness import Db, Fleet, pick

pytestmark = [
    pytest.mark.slow,
    pytest.mark.faults,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not harness.EXPLICIT, reason="set FAIRQUEUE_FAULT_SCALE (tox -e faults)"),
]

INTERVAL = 0.2  # seconds between two releases of one channel
CHANNELS = pick(3, 8)
PER_CHANNEL = pick(25, 100)
PROCESSES = 4
WINDOW = 1.0


def test_no_channel_starts_more_than_its_release_interval_allows(
    fault_db: Db, fleets: Callable[..., Fleet]
) -> None:
    names = [f"limited-{i}" for i in range(CHANNELS)]
    harness.enqueue(fault_db, names * PER_CHANNEL, release_interval=timedelta(seconds=INTERVAL))
    fleet = fleets(
        fault_db.url,
        overrides={"POLL_INTERVAL": 0.05},  # claim often: the limit, not the poll, must pace
        args=("--concurrency", "4", "--verbosity", "0"),
    )
    fleet.start(PROCESSES)
    seconds = harness.wait_drained(fault_db, pick(120, 300), fleet=fleet)
    fleet.stop()

    gaps = fault_db.rows(
        """
        SELECT channel, extract(epoch FROM min(gap)), count(*) + 1
        FROM (
            SELECT channel,
                   claimed_at - lag(claimed_at) OVER (PARTITION BY channel ORDER BY claimed_at)
                   AS gap
            FROM fault_exec_log
        ) x WHERE gap IS NOT NULL GROUP BY channel ORDER BY channel
        """
    )
    (most_in_window,) = fault_db.rows(
        """
        SELECT coalesce(max(n), 0) FROM (
            SELECT a.channel, a.claimed_at, count(*) AS n
            FROM fault_exec_log a JOIN fault_exec_log b
              ON b.channel = a.channel AND b.claimed_at >= a.claimed_at
             AND b.claimed_at < a.claimed_at + %s * interval '1 second'
            GROUP BY a.channel, a.claimed_at, a.id
        ) w
        """,
        [WINDOW],
    )[0]
    allowed = int(WINDOW / INTERVAL) + 1
    pids = fault_db.value("SELECT count(DISTINCT pid) FROM fault_exec_log")
    result = harness.outcome(fault_db)
    smallest = min(float(g) for _, g, _ in gaps)
    harness.record(
        "7 fleet-wide rate limit",
        messages=result.enqueued,
        channels=CHANNELS,
        processes=f"{PROCESSES} x 4",
        processes_that_claimed=pids,
        release_interval_seconds=INTERVAL,
        smallest_gap_seconds=round(smallest, 4),
        most_claims_in_1s=most_in_window,
        allowed_in_1s=allowed,
        achieved_per_channel_per_second=round(PER_CHANNEL * CHANNELS / seconds / CHANNELS, 2),
        lost=result.lost,
        duplicates=result.duplicates,
    )
    assert pids >= 2, "only one worker process claimed: the limit was not shared"
    assert (result.lost, result.duplicates) == (0, 0)
    assert smallest >= INTERVAL - 1e-6, gaps
    assert most_in_window <= allowed

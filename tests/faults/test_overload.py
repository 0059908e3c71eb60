"""Scenario 6: enqueue faster than the workers drain, one channel at its maximum backlog.

Enqueue to the full channel fails with ChannelFull (naming the channel and its limit) and
stores nothing of the batch; everything accepted is run; the workers keep a steady pace.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import pytest

from django_fairqueue.api import EnqueueRequest, enqueue_many
from django_fairqueue.db import channel_store
from django_fairqueue.exceptions import ChannelFull
from tests.faults import harness
from tests.faults import tasks as fault_tasks
from tests.faults.harness import Db, Fleet, pick

pytestmark = [
    pytest.mark.slow,
    pytest.mark.faults,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not harness.EXPLICIT, reason="set FAIRQUEUE_FAULT_SCALE (tox -e faults)"),
]

MAX_BACKLOG = 300
OVERLOAD = pick(20.0, 90.0)  # seconds of enqueueing as fast as one process can
OTHERS = [f"tenant-{i:02d}" for i in range(8)]
WINDOW = 2.0


def note(db: Db, ids: list[int], channel_id: int) -> None:
    db.conn.execute(
        "INSERT INTO fault_enqueued (message_id, channel_id) SELECT unnest(%s::bigint[]), %s",
        [ids, channel_id],
    )


def test_overload_refuses_clearly_and_loses_nothing_accepted(
    fault_db: Db, fleets: Callable[..., Fleet]
) -> None:
    harness.enqueue(fault_db, ["hot", *OTHERS], seconds=0.005)
    fault_db.conn.execute(
        "UPDATE fairqueue_channel SET max_backlog = %s WHERE name = 'hot'", [MAX_BACKLOG]
    )
    ids = channel_store.select_channel_ids(["hot", *OTHERS])
    fleet = fleets(fault_db.url, args=("--concurrency", "4", "--verbosity", "0"))
    fleet.start(2)
    harness.wait_listening(fault_db, fleet)

    refused, accepted, errors = 0, 0, set()
    backlog_seen = 0
    start = time.monotonic()
    t0 = harness.now(fault_db)
    i = 0
    while time.monotonic() - start < OVERLOAD:
        i += 1
        try:
            got = enqueue_many(
                EnqueueRequest(fault_tasks.work, [0.005], channel="hot") for _ in range(50)
            )
        except ChannelFull as exc:
            refused += 1
            errors.add(str(exc))
        else:
            accepted += len(got)
            note(fault_db, got, ids["hot"])
        other = OTHERS[i % len(OTHERS)]
        got = enqueue_many(
            EnqueueRequest(fault_tasks.work, [0.005], channel=other) for _ in range(20)
        )
        accepted += len(got)
        note(fault_db, got, ids[other])
        (hot,) = channel_store.select_channel_counters([ids["hot"]])
        backlog_seen = max(backlog_seen, hot.ready + hot.scheduled)
    t1 = harness.now(fault_db)
    drain = harness.wait_drained(fault_db, pick(300, 900), fleet=fleet)
    fleet.stop()

    windows = [
        r[0]
        for r in fault_db.rows(
            """
            SELECT count(l.id) FROM generate_series(%(t0)s::timestamptz,
                   %(t1)s::timestamptz - %(w)s * interval '1 second',
                   %(w)s * interval '1 second') AS w(s)
            LEFT JOIN fault_exec_log l
              ON l.finished_at >= w.s AND l.finished_at < w.s + %(w)s * interval '1 second'
            GROUP BY w.s ORDER BY w.s
            """,
            {"t0": t0, "t1": t1, "w": WINDOW},
        )
    ]
    median = statistics.median(windows)
    steadiness = min(windows) / median if median else 0.0
    result = harness.outcome(fault_db)
    harness.record(
        "6 overload",
        seconds=OVERLOAD,
        processes="2 x 4",
        accepted=accepted,
        refused_batches=refused,
        hot_backlog_max=backlog_seen,
        max_backlog=MAX_BACKLOG,
        lost=result.lost,
        duplicates=result.duplicates,
        per_second_median=round(median / WINDOW),
        per_second_min=round(min(windows) / WINDOW),
        steadiness_min_over_median=round(steadiness, 2),
        drain_after_seconds=round(drain, 1),
    )
    assert refused > 0, "the hot channel never filled: enqueue was not faster than the drain"
    assert errors and all("hot" in e and str(MAX_BACKLOG) in e for e in errors), errors
    assert backlog_seen <= MAX_BACKLOG
    assert result.enqueued == accepted + 1 + len(OTHERS)
    assert (result.lost, result.failed, result.duplicates) == (0, 0, 0)
    assert steadiness >= pick(0.2, 0.5), windows

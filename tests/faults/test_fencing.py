"""Scenario 3: a worker frozen (SIGSTOP) past its leases while another finishes its messages;
resumed (SIGCONT), its completions, failures and heartbeats change nothing and free no slot."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pytest

from tests.faults import harness
from tests.faults.harness import Db, Fleet, pick

pytestmark = [pytest.mark.slow, pytest.mark.faults, pytest.mark.django_db(transaction=True)]

#: Messages the stale worker holds when it freezes: a capped channel's two slots, and more of
#: an uncapped channel.
STALE_UNCAPPED = pick(6, 40)
LEASE = 2.0
ROW = """
SELECT id, state, attempts, result, finished_at, worker_id, last_error, lease_token,
       lease_expires_at
FROM fairqueue_message WHERE id = ANY (%s::bigint[]) ORDER BY id
"""


def test_a_frozen_worker_changes_nothing_when_it_resumes(
    fault_db: Db, fleets: Callable[..., Fleet]
) -> None:
    slow = harness.enqueue(fault_db, ["capped"] * 2, task="tests.faults.kept", seconds=3.0)
    harness.set_caps(fault_db, {"capped": 2})
    slow += harness.enqueue(
        fault_db, ["open"] * STALE_UNCAPPED, task="tests.faults.kept", seconds=3.0
    )
    # queued behind the capped channel's two slots
    behind = harness.enqueue(fault_db, ["capped"] * 4, task="tests.faults.kept")
    everything = slow + behind

    fleet = fleets(fault_db.url, overrides={"LEASE_SECONDS": LEASE})
    (stale,) = fleet.start(1, "--concurrency", str(2 + STALE_UNCAPPED))
    harness.wait_until_true(
        lambda: (
            fault_db.value(
                "SELECT count(*) FROM fault_exec_log WHERE pid = %s AND finished_at IS NULL",
                [stale.pid],
            )
            == len(slow)
        ),
        60,
        "the stale worker running all the slow messages",
    )
    stale.signal(signal.SIGSTOP)
    frozen_at = time.monotonic()

    (fresh,) = fleet.start(1, "--concurrency", "8")
    harness.wait_drained(fault_db, 90, fleet=fleet)
    assert time.monotonic() - frozen_at > LEASE  # the stale worker's leases expired
    before = fault_db.rows(ROW, [everything])
    counters_before = harness.counter_mismatches(fault_db)

    stale.signal(signal.SIGCONT)
    # its handlers finish the slow messages (3 s each) and it tries to record them
    stale.wait_for_sum(r"complete of (\d+) messages changed nothing", len(slow), 60)
    time.sleep(LEASE)  # a heartbeat round, and anything else it would write
    after = fault_db.rows(ROW, [everything])
    counters_after = harness.counter_mismatches(fault_db)
    running = fault_db.value(
        "SELECT c.running_count + coalesce((SELECT sum(d.running) FROM fairqueue_channel_delta d "
        "WHERE d.channel_id = c.id), 0) FROM fairqueue_channel c WHERE c.name = 'capped'"
    )
    result = harness.outcome(fault_db)
    stale_runs = fault_db.value(
        "SELECT count(*) FROM fault_exec_log WHERE pid = %s AND finished_at IS NOT NULL",
        [stale.pid],
    )
    fleet.stop()
    harness.record(
        "3 fencing (SIGSTOP past the lease)",
        messages=len(everything),
        processes=f"1 x {2 + STALE_UNCAPPED}, then 1 x 8",
        stale_messages=len(slow),
        runs=result.executions,
        duplicates=result.duplicates,
        stale_runs_finished=stale_runs,
        stale_writes_that_landed=sum(a != b for a, b in zip(before, after, strict=True)),
        lost=result.lost,
        capped_channel_running_after=running,
        counter_mismatches=len(counters_before) + len(counters_after),
    )
    assert {row[1] for row in before} == {"succeeded"}
    # every message's kept result names the fresh worker: it ran the slow ones again
    assert {row[3]["pid"] for row in before} == {fresh.pid}
    assert after == before  # no complete, fail or heartbeat of the stale worker landed
    assert stale_runs == len(slow)  # the stale worker did finish its runs...
    assert result.duplicates == len(slow)  # ...so exactly those ran twice (at-least-once)
    assert result.lost == 0
    assert running == 0  # the slots were freed once, by the fresh worker (never -2)
    assert counters_before == counters_after == []

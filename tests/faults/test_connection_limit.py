"""At the server's connection limit: tasks whose own connection is refused cost no attempt.

A private server with ``max_connections = 40`` runs two worker processes of four threads. The
tasks log their runs on their thread's Django connection, which the worker closes after each
task (``CONN_MAX_AGE = 0``): every task opens a connection. Twice, another client takes every
free connection for a few seconds, so the tasks' connections are refused ("sorry, too many
clients already") while the workers' own connections (claim, settle, heartbeat) stay up.

Checked: every message succeeds once, at its first attempt (none retried, none dead-lettered
with ``max_attempts = 5``); the workers gave messages back during the saturations and said
so in at most one log line per cause every 10 s.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable

import psycopg
import pytest

from django_fairqueue import devdb
from tests.faults import harness
from tests.faults.harness import Db, Fleet, pick

pytestmark = [pytest.mark.slow, pytest.mark.faults]

MESSAGES = pick(1200, 6000)
CHANNELS = [f"tenant-{i}" for i in range(8)]
MAX_CONNECTIONS = 40
SATURATIONS = 2
HOLD = pick(5.0, 15.0)  # seconds each saturation lasts
GAVE_BACK = re.compile(r"gave back .*?(?:\(and (\d+) more like it in the last \d+s\))?$")


def _saturate(url: str, hold: float) -> tuple[int, float]:
    """Open connections until the server refuses one, keep them ``hold`` seconds, close
    them; returns how many were taken and how long the server was full."""
    taken: list[psycopg.Connection] = []
    try:
        while len(taken) < MAX_CONNECTIONS:
            try:
                taken.append(psycopg.connect(url, autocommit=True, connect_timeout=5))
            except psycopg.OperationalError as exc:
                assert "too many clients" in str(exc), exc
                break
        full_since = time.monotonic()
        time.sleep(hold)
        return len(taken), time.monotonic() - full_since
    finally:
        for conn in taken:
            with contextlib.suppress(psycopg.Error):
                conn.close()


def test_tasks_refused_a_connection_are_given_back_without_an_attempt(
    private_server: devdb.EmbeddedPostgres, fleets: Callable[..., Fleet]
) -> None:
    url = private_server.url("faults")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"ALTER SYSTEM SET max_connections = {MAX_CONNECTIONS}")
    private_server.restart()
    db = Db(url)
    assert db.value("SHOW max_connections") == str(MAX_CONNECTIONS)
    harness.create_log_tables(db)
    harness.enqueue(db, harness.spread(CHANNELS, MESSAGES), seconds=0.01, max_attempts=5)
    fleet = fleets(url)
    workers = fleet.start(2)
    harness.wait_running(db, fleet, 2)

    full_seconds = 0.0
    for _ in range(SATURATIONS):
        db.close()  # our own connection must not be the one refused afterwards
        taken, seconds = _saturate(url, HOLD)
        assert taken > 0
        full_seconds += seconds
        db = Db(url)
        time.sleep(2.0)  # the given-back messages come back and run

    drain = harness.wait_drained(db, pick(240, 900), fleet=fleet)
    outcome = harness.outcome(db)
    attempts = dict(db.rows("SELECT attempt, count(*) FROM fault_exec_log GROUP BY attempt"))
    fleet.stop()
    lines = [line for w in workers for line in w.output.splitlines() if "gave back" in line]
    given_back = sum(1 + int(m.group(1) or 0) for m in map(GAVE_BACK.search, lines) if m)
    warnings = sum(1 for w in workers for line in w.output.splitlines() if " WARNING " in line)
    harness.record(
        "connection limit",
        messages=outcome.enqueued,
        max_connections=MAX_CONNECTIONS,
        saturations=SATURATIONS,
        full_seconds=round(full_seconds, 1),
        given_back=given_back,
        gave_back_log_lines=len(lines),
        warning_lines=warnings,
        warning_lines_per_full_second=round(warnings / full_seconds, 2),
        runs_by_attempt=attempts,
        lost=outcome.lost,
        failed=outcome.failed,
        duplicates=outcome.duplicates,
        drain_seconds=round(drain, 1),
    )
    db.close()
    assert (outcome.lost, outcome.failed) == (0, 0), (outcome, fleet.logs())
    assert given_back > 0, "no task was refused a connection: the scenario proved nothing\n" + (
        fleet.logs()
    )
    # given back, the attempt was not counted: every run is an attempt 1
    assert set(attempts) == {1}, attempts
    assert outcome.duplicates == 0
    # one line per cause every 10 s per process (plus the workers' own lines about the outage)
    assert len(lines) <= 2 * (int(full_seconds / 10) + 2) * SATURATIONS, lines

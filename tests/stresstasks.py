"""Tasks of the stress test (tests/test_stress.py). Worker subprocesses import this module
(``TASK_MODULES``); the stress clients import it to enqueue.

Every run writes one row of ``stress_exec_log`` when it starts and records how it ended, on the
task thread's own Django connection, so "ran twice" can be judged afterwards: a run killed with
its worker has no end, a run that raised ends ``raised``. At its start a run also notes the
message's ``last_error`` as the queue left it: a rescue after an expired lease writes
``LeaseExpired`` there, which is how a rerun explained by a lost lease is told from a duplicate.
"""

from __future__ import annotations

import os
import time

from django.db import connection

from django_fairqueue import task
from django_fairqueue.context import current_message

LOG_TABLES = """
CREATE TABLE IF NOT EXISTS stress_exec_log (
    id bigserial PRIMARY KEY,
    message_id bigint NOT NULL,
    channel text NOT NULL,
    queue text NOT NULL,
    attempt integer NOT NULL,
    pid integer NOT NULL,
    lease_token uuid,
    seen_error_type text,
    seen_error_message text,
    started_at timestamptz NOT NULL,
    finished_at timestamptz,
    outcome text
);
CREATE INDEX IF NOT EXISTS stress_exec_log_message_idx ON stress_exec_log (message_id);
CREATE TABLE IF NOT EXISTS stress_enqueued (
    message_id bigint PRIMARY KEY,
    channel text NOT NULL,
    client integer NOT NULL
);
CREATE TABLE IF NOT EXISTS stress_limit_edit (
    channel text NOT NULL,
    how text NOT NULL,
    at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS stress_limit_edit_channel_idx ON stress_limit_edit (channel, at);
TRUNCATE stress_exec_log, stress_enqueued, stress_limit_edit;
"""

# Asynchronous commit: the log is written at the rate tasks run; the server is never killed.
_START = """
INSERT INTO stress_exec_log (message_id, channel, queue, attempt, pid, lease_token,
                             seen_error_type, seen_error_message, started_at)
SELECT %s, %s, %s, %s, %s, %s, m.last_error ->> 'type', m.last_error ->> 'message',
       clock_timestamp()
FROM (SELECT set_config('synchronous_commit', 'off', false)) AS s
LEFT JOIN fairqueue_message m ON m.id = %s
RETURNING id
"""
_END = "UPDATE stress_exec_log SET finished_at = clock_timestamp(), outcome = %s WHERE id = %s"


class StressFailure(Exception):
    """Raised on purpose by a run that is told to fail."""


def _run(seconds: float, fail_attempts: int) -> None:
    message = current_message.get()
    if message is None:
        raise RuntimeError("stress tasks run only inside a worker")
    with connection.cursor() as cursor:
        cursor.execute(
            _START,
            [
                message.id,
                message.channel,
                message.queue,
                message.attempts,
                os.getpid(),
                message.lease_token,
                message.id,
            ],
        )
        (log_id,) = cursor.fetchone()
        outcome = "raised"
        try:
            if seconds > 0:
                time.sleep(seconds)
            if message.attempts <= fail_attempts:
                raise StressFailure(f"attempt {message.attempts} fails on purpose")
            outcome = "ok"
        finally:
            cursor.execute(_END, [outcome, log_id])


@task(name="tests.stress.work", max_attempts=3)
def work(seconds: float = 0.0, fail_attempts: int = 0) -> None:
    """Log the run, sleep ``seconds``, raise while ``attempts <= fail_attempts``; the row is
    deleted on success."""
    _run(seconds, fail_attempts)


@task(name="tests.stress.kept", max_attempts=3, keep_result=True)
def kept(seconds: float = 0.0, fail_attempts: int = 0) -> int:
    """Like ``work``, but the row stays ``succeeded``."""
    _run(seconds, fail_attempts)
    return os.getpid()

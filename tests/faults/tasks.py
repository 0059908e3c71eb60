"""Tasks of the fault suite. Worker subprocesses import this module (``TASK_MODULES``).

Each run writes one row of ``fault_exec_log`` when it starts and fills in ``finished_at`` when
it ends, on the task thread's own Django connection: a worker killed mid-task leaves a row
without an end, a task that ran twice leaves two rows. Times are the database server's clock
(``clock_timestamp()``), the same clock as the queue's ``claimed_at`` and lease times.
"""

from __future__ import annotations

import os
import time
from typing import Any

from django.db import connection

from django_fairqueue import conf, task
from django_fairqueue.context import current_message

# Asynchronous commit: the log is written at the rate tasks run. Worker processes are killed,
# never the server mid-write (a fast shutdown flushes the WAL), so no committed row is lost;
# the failover scenario kills the server itself, and logs with ``durable`` (commit waits).
_START = """
INSERT INTO fault_exec_log (message_id, channel, attempt, pid, claimed_at, started_at)
SELECT %s, %s, %s, %s, %s::timestamptz - %s * interval '1 second', clock_timestamp()
FROM (SELECT set_config('synchronous_commit', %s, false)) AS s
RETURNING id
"""
_END = "UPDATE fault_exec_log SET finished_at = clock_timestamp() WHERE id = %s"


def _logged(seconds: float, *, durable: bool = False) -> dict[str, Any]:
    message = current_message.get()
    if message is None:
        raise RuntimeError("fault tasks run only inside a worker")
    lease = conf.get().LEASE_SECONDS  # the worker runs with --lease unset: the claim's lease
    with connection.cursor() as cursor:
        cursor.execute(
            _START,
            [
                message.id,
                message.channel,
                message.attempts,
                os.getpid(),
                message.lease_expires_at,
                lease,
                "on" if durable else "off",
            ],
        )
        (log_id,) = cursor.fetchone()
        if seconds > 0:
            time.sleep(seconds)
        cursor.execute(_END, [log_id])
    return {"pid": os.getpid(), "attempt": message.attempts}


@task(name="tests.faults.work", max_attempts=20)
def work(seconds: float = 0.0) -> None:
    """Log the run, sleep ``seconds``; the row is deleted on success (no result kept)."""
    _logged(seconds)


@task(name="tests.faults.kept", max_attempts=20, keep_result=True)
def kept(seconds: float = 0.0) -> dict[str, Any]:
    """Like ``work``, but the row stays ``succeeded`` with the worker's pid as its result."""
    return _logged(seconds)


@task(name="tests.faults.durable", max_attempts=20)
def durable(seconds: float = 0.0) -> None:
    """Like ``work``, its log written with synchronous commit: a run that finished before the
    server was killed is in the log of the standby promoted after it."""
    _logged(seconds, durable=True)


@task(name="tests.faults.once", delivery="at_most_once")
def once(seconds: float = 0.0) -> None:
    """At most once, its log written with synchronous commit: every run it started is in the
    log after a server crash, so a second run cannot hide."""
    _logged(seconds, durable=True)

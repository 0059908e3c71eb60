"""Real ``runfairworker`` subprocesses running tasks that misbehave: one that holds the GIL (so
the worker's own threads stop too), and exceptions that are hard to describe or not
``Exception`` subclasses.

The worker subprocesses import this module's tasks (``TASK_MODULES`` in the overrides).
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
from django.conf import settings

from django_fairqueue.models import Message, MessageState
from django_fairqueue.tasks import task
from tests.workerkit import WorkerProcess, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

MODULES = [*settings.FAIRQUEUE["TASK_MODULES"], __name__]


@task(name="tests.held_up.hold_gil", max_attempts=3, keep_result=True)
def hold_gil(count: int) -> int:
    """One C call that never lets another thread of the process run (``sum`` over a range)."""
    return sum(range(count))


class StrFailsError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str of this exception fails")


@task(name="tests.held_up.str_fails", max_attempts=3, timeout=1)
def str_fails() -> None:
    raise StrFailsError()


@task(name="tests.held_up.interrupts", max_attempts=2)
def interrupts() -> None:
    raise KeyboardInterrupt()


def start(
    workers: list[WorkerProcess], database_url: str, worker_id: str, **overrides: Any
) -> WorkerProcess:
    base = {"POLL_INTERVAL": 0.3, "RESCUE_INTERVAL": 0.3, "TASK_MODULES": MODULES}
    worker = WorkerProcess(
        database_url, worker_id, "--concurrency", "2", overrides={**base, **overrides}
    )
    workers.append(worker)
    return worker


def gil_count(seconds: float) -> int:
    """How long a range to sum for the GIL to stay held about ``seconds`` on this machine."""
    began = time.perf_counter()
    sum(range(2_000_000))
    return int(2_000_000 * seconds / (time.perf_counter() - began))


def test_a_task_holding_the_gil_past_dead_after_does_not_make_its_worker_find_itself_dead(
    database_url: str, started: list[WorkerProcess]
) -> None:
    """Its beat and its maintenance pass stop while the task holds the GIL (3 s, four times
    WORKER_DEAD_AFTER). When they run again, the worker's own pass must not mark it dead and
    expire its own lease: the message succeeds at its first attempt. (Which of the two threads
    runs first is up to the interpreter; tests/test_registry.py forces the one that matters.)"""
    worker = start(
        started,
        database_url,
        "gil",
        WORKER_HEARTBEAT=0.25,
        WORKER_DEAD_AFTER=0.75,
        LEASE_SECONDS=60,
    )
    worker.wait_for("worker gil starting")
    mid = hold_gil.enqueue(gil_count(3.0), channel="gil")
    wait_until(lambda: Message.objects.get(pk=mid).state == MessageState.SUCCEEDED, 60, "the run")
    assert Message.objects.get(pk=mid).attempts == 1
    assert "worker gil (" not in worker.output  # "worker gil (host pid N) is dead: ..."
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0


def test_odd_exceptions_are_retried_failures_and_the_worker_goes_on(
    database_url: str, started: list[WorkerProcess]
) -> None:
    """An exception whose ``__str__`` raises, under a time limit, and a KeyboardInterrupt a
    task raises: each attempt fails and is retried until the last; no phantom timeout, no
    recycling (STUCK_TASK_LIMIT 2 s), and the worker stops cleanly with nothing running."""
    worker = start(started, database_url, "odd", RETRY_BACKOFF_BASE=0, STUCK_TASK_LIMIT=2)
    described = str_fails.enqueue(channel="odd")
    interrupted = interrupts.enqueue(channel="odd")
    wait_until(
        lambda: (
            {m.state for m in Message.objects.filter(pk__in=[described, interrupted])}
            == {MessageState.FAILED}
        ),
        60,
        "both messages failing for good",
    )
    first, second = Message.objects.get(pk=described), Message.objects.get(pk=interrupted)
    assert (first.attempts, first.last_error["type"]) == (
        3,
        "tests.test_worker_held_up.StrFailsError",
    )
    assert first.last_error["message"] == (
        "StrFailsError() (str() of the exception failed: RuntimeError)"
    )
    assert (second.attempts, second.last_error["type"]) == (2, "KeyboardInterrupt")
    time.sleep(3)  # past the time limit and STUCK_TASK_LIMIT of the last attempt
    assert worker.proc.poll() is None  # still running: not recycled
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    for wrong in ("exceeded its time limit", "recycling", "ERROR", "still running after"):
        assert wrong not in worker.output, wrong

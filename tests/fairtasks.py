"""Tasks the worker tests run, in the test process and in ``runfairworker`` subprocesses.

Listed in ``FAIRQUEUE['TASK_MODULES']`` of tests/settings.py, so a worker subprocess imports
them. Tasks that a test must watch from outside write a marker file when they start (``marker``:
a path), and return where and how they ran (kept: ``keep_result=True``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from django_fairqueue import task
from django_fairqueue.context import current_message


def _ran(**more: Any) -> dict[str, Any]:
    message = current_message.get()
    return {
        "pid": os.getpid(),
        "attempt": message.attempts if message is not None else None,
        **more,
    }


def _mark(marker: str | None) -> None:
    if marker:
        Path(marker).write_text(str(os.getpid()))


@task(name="tests.fair.record", keep_result=True)
def record(label: str = "") -> dict[str, Any]:
    """Return when it started (wall clock), to measure pick-up latency."""
    return _ran(started=time.time(), label=label)


@task(name="tests.fair.add", keep_result=True)
def add(a: int, b: int) -> int:
    return a + b


@task(name="tests.fair.takes_channel")
def takes_channel(channel: str) -> str:
    """A task whose own argument is named like a queue option (``using()`` is for it)."""
    return channel


@task(name="tests.fair.sleep", keep_result=True, max_attempts=5)
def sleep(
    seconds: float, marker: str | None = None, first_attempt_only: bool = False
) -> dict[str, Any]:
    """Sleep (only on the first attempt if asked), after writing ``marker``."""
    _mark(marker)
    message = current_message.get()
    if not first_attempt_only or (message is not None and message.attempts == 1):
        time.sleep(seconds)
    return _ran()


@task(name="tests.fair.fail_first", keep_result=True, max_attempts=3)
def fail_first(seconds: float = 0.0, marker: str | None = None) -> dict[str, Any]:
    """The first attempt writes ``marker``, sleeps, then raises; later ones succeed at once."""
    message = current_message.get()
    if message is not None and message.attempts == 1:
        _mark(marker)
        time.sleep(seconds)
        raise RuntimeError("first attempt fails")
    return _ran()


class BoomError(Exception):
    pass


@task(name="tests.fair.boom", max_attempts=2)
def boom(text: str = "boom") -> None:
    raise BoomError(text)


@task(name="tests.fair.exit", max_attempts=1)
def exit_process(code: int = 3) -> None:
    """Kill the worker process from inside a task, as a segfaulting extension would."""
    os._exit(code)


@task(name="tests.fair.at_most_once", delivery="at_most_once", keep_result=True)
def at_most_once(seconds: float = 0.0, marker: str | None = None) -> dict[str, Any]:
    _mark(marker)
    time.sleep(seconds)
    return _ran()


@task(name="tests.fair.hang", timeout=0.3, max_attempts=1)
def hang(marker: str | None = None) -> None:
    """Never returns in time (an hour): past its time limit of 0.3 s, its thread is abandoned."""
    _mark(marker)
    time.sleep(3600)


@task(name="tests.fair.until_aborted", keep_result=True, max_attempts=3)
def until_aborted(marker: str | None = None, seconds: float = 30.0) -> str:
    """Run until its abort is requested (checking every 10 ms), then stop; at most ``seconds``."""
    from django_fairqueue import abort_requested

    _mark(marker)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if abort_requested():
            return "stopped"
        time.sleep(0.01)
    return "ran out"


@task(name="tests.fair.ignores_abort", keep_result=True, max_attempts=3)
def ignores_abort(marker: str | None = None, seconds: float = 5.0) -> str:
    """Sleep ``seconds`` without ever looking at abort_requested()."""
    _mark(marker)
    time.sleep(seconds)
    return "finished"


@task(name="tests.fair.email", queue="emails", keep_result=True)
def email(to: str = "") -> dict[str, Any]:
    """A task of queue "emails"."""
    return _ran(to=to)


@task(name="tests.fair.report", queue="reports", keep_result=True)
def report(title: str = "") -> dict[str, Any]:
    """A task of queue "reports"."""
    return _ran(title=title)

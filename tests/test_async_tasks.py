"""``async def`` tasks, native and Django's: a worker that leaves one behind still exits, a
coroutine behind a plain wrapper runs, and a time limit's traceback shows the coroutine.

The worker subprocesses import this module too (``TASK_MODULES`` in their overrides).
"""

from __future__ import annotations

import asyncio
import functools
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.db import connections

from django_fairqueue.context import current_message
from django_fairqueue.models import Channel, Message, MessageState
from django_fairqueue.tasks import task
from django_fairqueue.tasks.django_compat import TaskResultStatus
from django_fairqueue.tasks.django_compat import task as django_task
from django_fairqueue.testing import drain
from django_fairqueue.worker import Worker, WorkerConfig
from django_fairqueue.worker.execution import stack_of
from tests.workerkit import WorkerProcess, wait_until

#: what worker subprocesses need to run this module's tasks, with short leases and intervals
OVERRIDES = {
    "TASK_MODULES": ["tests.fairtasks", "tests.test_async_tasks"],
    "LEASE_SECONDS": 1.5,
    "RESCUE_INTERVAL": 0.3,
    "POLL_INTERVAL": 0.5,
    "RETRY_BACKOFF_BASE": 0,
}


# -- tasks (module level, as Django requires) ---------------------------------------------------


def _mark(marker: str) -> None:
    Path(marker).write_text("started")


@task(name="tests.async.sleep", max_attempts=1)
async def native_sleep(seconds: float, marker: str) -> None:
    _mark(marker)
    await asyncio.sleep(seconds)


@django_task
async def django_sleep(seconds: float, marker: str) -> None:
    _mark(marker)
    await asyncio.sleep(seconds)


@task(name="tests.async.hang", timeout=0.3, max_attempts=1)
async def native_hang(marker: str) -> None:
    _mark(marker)
    await asyncio.sleep(3600)


def logged(func: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator that knows nothing of coroutines: its wrapper looks synchronous."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    return wrapper


@task(name="tests.async.wrapped", keep_result=True)
@logged
async def native_wrapped(n: int) -> int:
    await asyncio.sleep(0)
    return n * 2


@django_task
@logged
async def django_wrapped(n: int) -> int:
    await asyncio.sleep(0)
    return n * 2


@task(name="tests.async.orm_count", keep_result=True)
async def orm_count() -> dict[str, Any]:
    message = current_message.get()
    assert message is not None
    return {"message": message.id, "channels": await Channel.objects.acount()}


#: released by the test that starts async_stuck, so that its coroutine ends with the test
RELEASE = threading.Event()


@task(name="tests.async.stuck", timeout=0.3, max_attempts=1)
async def async_stuck() -> None:
    while not RELEASE.is_set():
        await asyncio.sleep(0.5)


# -- a worker that leaves a coroutine behind exits ----------------------------------------------


def start(
    workers: list[WorkerProcess], database_url: str, *args: str, **overrides: Any
) -> WorkerProcess:
    worker = WorkerProcess(
        database_url, "async", "--concurrency", "1", *args, overrides={**OVERRIDES, **overrides}
    )
    workers.append(worker)
    return worker


def exits_within(worker: WorkerProcess, seconds: float) -> int:
    began = time.monotonic()
    code = worker.wait(60)
    took = time.monotonic() - began
    assert took < seconds, f"the worker took {took:.1f}s to exit"
    return code


@pytest.mark.parametrize("supervised", [False, True], ids=["alone", "under-processes"])
@pytest.mark.parametrize("kind", ["native", "django"])
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_after_the_grace_period_a_worker_running_an_async_task_exits(
    started: list[WorkerProcess], database_url: str, tmp_path: Path, kind: str, supervised: bool
) -> None:
    marker = tmp_path / "started"
    if kind == "native":
        mid = native_sleep.enqueue(30, str(marker), channel="a")
    else:
        mid = int(django_sleep.using(channel="a").enqueue(30, str(marker)).id)
    # (--max-tasks-per-child puts a supervisor over even one process)
    more = ("--processes", "1", "--max-tasks-per-child", "100") if supervised else ()
    worker = start(started, database_url, "--shutdown-grace", "1", *more)
    wait_until(marker.exists, 30, "the async task starting")
    worker.signal(signal.SIGTERM)
    # the coroutine (30 s) ends with the process, as a sync task's thread does
    assert exits_within(worker, 10) == 0
    worker.wait_for("1 messages still running after the 1.0s grace period: left behind")
    assert Message.objects.get(pk=mid).state == MessageState.RUNNING  # left to its lease


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_recycled_for_a_stuck_async_task_exits(
    started: list[WorkerProcess], database_url: str, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    native_hang.enqueue(str(marker), channel="h")
    worker = start(started, database_url, STUCK_TASK_LIMIT=1)
    worker.wait_for("recycling: a handler thread has been stuck for")
    assert exits_within(worker, 10) == 0
    worker.wait_for("1 timed-out attempts still hold a handler thread: not written")


# -- a coroutine returned by a plain wrapper runs -----------------------------------------------


@pytest.mark.django_db
def test_a_native_async_task_behind_a_plain_wrapper_runs() -> None:
    mid = native_wrapped.enqueue(21, channel="w")
    assert drain() == 1
    row = Message.objects.get(pk=mid)
    assert (row.state, row.result) == (MessageState.SUCCEEDED, 42)


@pytest.mark.django_db
def test_a_django_async_task_behind_a_plain_wrapper_runs() -> None:
    result = django_wrapped.using(channel="w").enqueue(21)
    assert drain() == 1
    done = django_wrapped.get_result(result.id)
    assert (done.status, done.return_value) == (TaskResultStatus.SUCCESSFUL, 42)


@pytest.mark.django_db
def test_an_async_task_sees_its_message_and_uses_the_orm_on_the_workers_thread() -> None:
    # thread-sensitive sync_to_async (the ORM) runs in the thread that runs the message, in
    # its transaction: here the test's, whose rows it sees
    Channel.objects.create(name="seen-by-the-task")
    mid = orm_count.enqueue(channel="o")
    assert drain() == 1
    assert Message.objects.get(pk=mid).result == {"message": mid, "channels": 2}


# -- where a timed-out coroutine hangs ----------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_timed_out_async_tasks_stack_shows_where_its_coroutine_waits() -> None:
    RELEASE.clear()
    async_stuck.enqueue(channel="t")
    worker = Worker(
        WorkerConfig(concurrency=1, worker_id="async-stack", listen=False, maintenance=False)
    )
    thread = threading.Thread(target=_run, args=(worker,))
    thread.start()
    try:
        wait_until(lambda: worker.ledger.stuck == 1, 20, "the time limit")
        (stuck,) = [t for t in threading.enumerate() if t.name == "fairqueue-handler-1"]
        stack = stack_of(stuck)
    finally:
        RELEASE.set()
        worker.stop()
        thread.join(30)
    assert stack is not None
    # the handler thread's own frames, then the coroutine's in place of asgiref's wait
    assert "django_fairqueue/worker/pool.py" in stack
    assert "asgiref" not in stack.split("in run_coroutine")[-1]
    assert "in async_stuck\n    await asyncio.sleep(0.5)" in stack
    assert stack.rstrip().endswith("return await future")  # asyncio.sleep's own frame


def _run(worker: Worker) -> None:
    try:
        worker.run()
    finally:
        connections.close_all()


# (a limit of a second: the loop's thread must have started by then, even on a loaded machine)
@task(name="tests.async.overrun", timeout=1.0, max_attempts=1)
async def async_overrun() -> None:
    await asyncio.sleep(2.5)  # past its limit, then it returns: the failure is written


@pytest.mark.django_db(transaction=True)
def test_a_timed_out_async_tasks_traceback_shows_the_task_where_it_waits() -> None:
    mid = async_overrun.enqueue(channel="t")
    worker = Worker(
        WorkerConfig(concurrency=1, worker_id="async-tb", listen=False, maintenance=False)
    )
    thread = threading.Thread(target=_run, args=(worker,))
    thread.start()
    try:
        wait_until(
            lambda: Message.objects.get(pk=mid).state == MessageState.FAILED, 20, "the failure"
        )
    finally:
        worker.stop()
        thread.join(30)
    error = Message.objects.get(pk=mid).last_error
    assert error["type"] == "django_fairqueue.exceptions.TaskTimeout"
    assert "in async_overrun\n    await asyncio.sleep(2.5)" in error["traceback"]

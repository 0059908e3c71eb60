"""Helpers shared by the worker tests: raw enqueues, counters, polling, worker subprocesses."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from django_fairqueue import conf
from django_fairqueue.db import channel_store, enqueue_store

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def enqueue_raw(channel: str, task_name: str, payload: str, max_attempts: int = 3) -> int:
    """Insert a message the API would refuse to make (unknown task, broken payload)."""
    (mid,) = enqueue_store.enqueue_messages(
        [enqueue_store.NewMessage(channel, task_name, payload, max_attempts=max_attempts)],
        defaults=conf.get().CHANNEL_DEFAULTS,
        notify_channel=None,
    )
    return mid


def counters(channel: str) -> channel_store.ChannelCounters:
    cid = channel_store.select_channel_ids([channel])[channel]
    (row,) = channel_store.select_channel_counters([cid])
    return row


def wait_until(predicate: Callable[[], T], timeout: float = 20.0, what: str = "") -> T:
    """Poll ``predicate`` until it returns something true; return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'condition'} not met within {timeout}s")
        time.sleep(0.02)


def run_in_thread(worker: Any) -> threading.Thread:
    """Start ``worker.run()`` in a thread that closes its database connections at the end
    (a test database cannot be dropped while one is open)."""
    from django.db import connections

    def target() -> None:
        try:
            worker.run()
        finally:
            connections.close_all()

    thread = threading.Thread(target=target)
    thread.start()
    return thread


class WorkerProcess:
    """``manage.py runfairworker`` in a subprocess, its stderr collected line by line."""

    def __init__(
        self, database_url: str, worker_id: str, *args: str, overrides: dict[str, Any]
    ) -> None:
        self.worker_id = worker_id
        env = {
            **os.environ,
            "DATABASE_URL": database_url,
            "FAIRQUEUE_TEST_OVERRIDES": json.dumps(overrides),
            "PYTHONUNBUFFERED": "1",
        }
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "django",
                "runfairworker",
                "--settings",
                "tests.settings",
                # ("": the worker's own default id)
                *(["--worker-id", worker_id] if worker_id else []),
                *args,
            ],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.pid = self.proc.pid
        self._lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self._lines.append(line)
                self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "".join(self._lines)

    def wait_for(self, text: str, timeout: float = 20.0) -> str:
        """The first line of its log containing ``text``, waiting for it if need be."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self._lines:
                    if text in line:
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(
                        f"worker {self.worker_id} never logged {text!r}; its log:\n"
                        + "".join(self._lines)
                    )
                self._cond.wait(min(left, 0.1))

    def wait_for_sum(self, pattern: str, total: int, timeout: float = 20.0) -> int:
        """Wait until the numbers captured by ``pattern`` (one group) over all its log lines
        add up to ``total``: a worker may report one batch of settlements in several lines."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                seen = sum(int(m.group(1)) for m in map(regex.search, self._lines) if m)
                if seen >= total:
                    return seen
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(
                        f"worker {self.worker_id} logged {seen} of {total} for {pattern!r}; "
                        "its log:\n" + "".join(self._lines)
                    )
                self._cond.wait(min(left, 0.1))

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # works on a stopped process too
            self.proc.wait(10)
        self._reader.join(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()

"""Real ``runfairworker`` processes for the end-to-end scenarios (``e2e``, ``pickup``).

The benchmark runs under the user's settings and, with ``--scratch``, on a database those
settings do not name. So a worker is not started as ``manage.py runfairworker`` but as
``python -c BOOT ARGS``: the child sets Django up with the same settings module (before it
imports this package, whose modules need the app registry); :func:`main` then points
``FAIRQUEUE['DATABASE']``'s connection at the benchmark's database (``FAIRBENCH_DATABASE``: its
connection fields as JSON), imports the benchmark's tasks and runs ``runfairworker ARGS`` through
``execute_from_command_line``, as ``manage.py`` would. The worker, its threads, claims and
settlement are the real ones; nothing in ``django_fairqueue.worker`` knows about the benchmark.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import IO, Any

from django.db import connections

from django_fairqueue.contrib.bench.harness import BenchmarkError

#: Environment variable carrying the benchmark database's connection fields (JSON).
DATABASE_ENV = "FAIRBENCH_DATABASE"
#: The connection fields handed over; the rest (engine, options...) come from the settings.
FIELDS = ("NAME", "USER", "PASSWORD", "HOST", "PORT")
#: The child's program: Django first, then this module.
BOOT = (
    "import sys, django; django.setup(); "
    "from django_fairqueue.contrib.bench.workerproc import main; main(sys.argv[1:])"
)
#: Seconds a worker gets to exit after SIGTERM before it is killed.
STOP_TIMEOUT = 15.0


def _pythonpath() -> str:
    """The child's import path: where the settings module was found, then the inherited one."""
    first = sys.path[0] if sys.path and sys.path[0] else os.getcwd()
    parts = [first, os.getcwd(), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(dict.fromkeys(p for p in parts if p))


class WorkerProcess:
    """One ``runfairworker`` subprocess on database ``using``; stderr goes to a temporary file."""

    def __init__(self, using: str, args: Sequence[str]) -> None:
        settings_module = os.environ.get("DJANGO_SETTINGS_MODULE")
        if not settings_module:
            raise BenchmarkError(
                "the e2e and pickup scenarios start `runfairworker` processes: they need "
                "DJANGO_SETTINGS_MODULE (run fairbench through manage.py or --settings)"
            )
        db = connections[using].settings_dict
        env = {
            **os.environ,
            DATABASE_ENV: json.dumps({k: db.get(k) for k in FIELDS}),
            "DJANGO_SETTINGS_MODULE": settings_module,
            "PYTHONPATH": _pythonpath(),
        }
        self.args = list(args)
        # Closed by close(), which Fleet calls on leaving its block.
        self._stderr: IO[str] = tempfile.TemporaryFile(  # noqa: SIM115
            "w+", prefix="fairbench-worker-"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", BOOT, *self.args],
            env=env,
            cwd=os.getcwd(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
        )

    def exited(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise BenchmarkError(
                f"worker {' '.join(self.args)} did not exit within {timeout:.0f}s"
            ) from None

    def stop(self) -> int:
        """SIGTERM (a graceful stop), then SIGKILL if it does not exit in time; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # our own child, by its pid
                self.proc.wait(5)
        return self.proc.returncode

    def stderr_tail(self, lines: int = 20) -> str:
        self._stderr.seek(0)
        return "\n".join(self._stderr.read().splitlines()[-lines:])

    def check(self) -> None:
        """Raise BenchmarkError if the worker exited with an error."""
        code = self.proc.poll()
        if code not in (None, 0):
            raise BenchmarkError(
                f"worker `runfairworker {' '.join(self.args)}` exited with {code}:\n"
                + self.stderr_tail()
            )

    def close(self) -> None:
        self.stop()
        self._stderr.close()


class Fleet:
    """Several worker processes, stopped and reaped on leaving the ``with`` block."""

    def __init__(self, using: str, count: int, args: Sequence[str]) -> None:
        connections[using].close()  # nothing of ours is shared with the children
        self.workers: list[WorkerProcess] = []
        try:
            for i in range(count):
                self.workers.append(
                    WorkerProcess(using, [*args, "--worker-id", f"fairbench-{os.getpid()}-{i}"])
                )
        except BaseException:
            self.close()
            raise
        self.started = time.perf_counter()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def all_exited(self) -> bool:
        return all(w.exited() is not None for w in self.workers)

    def check(self) -> None:
        for worker in self.workers:
            worker.check()

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


def main(argv: Sequence[str]) -> None:
    """The child (Django set up): use the benchmark's database, then ``runfairworker argv``."""
    from django.conf import settings
    from django.core.management import execute_from_command_line

    from django_fairqueue import conf

    fields: dict[str, Any] = json.loads(os.environ[DATABASE_ENV])
    alias = conf.get().DATABASE
    # Before any connection exists: the wrapper reads this dict when it connects.
    settings.DATABASES[alias].update(fields)
    connections[alias].settings_dict.update(fields)
    import django_fairqueue.contrib.bench.tasks  # noqa: F401  (registers the benchmark's tasks)

    execute_from_command_line(["manage.py", "runfairworker", *argv])

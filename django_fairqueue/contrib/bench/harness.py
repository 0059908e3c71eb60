"""What every scenario shares: the database it runs on, bulk loads, forked processes, progress.

Processes, not threads: claimers must not share one GIL or one connection. They are forked
(start method ``fork``) so they inherit Django's configured state, settings overrides and the
registered benchmark task. Django's connections are closed in the parent *before* each fork; a
child must never close a connection it inherited, because closing sends PostgreSQL a Terminate
message on the parent's socket. Each child opens, and at the end closes, a connection of its own.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.context import ForkContext, ForkProcess
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier, Event
from typing import Any, TextIO

from django.db import connections

from django_fairqueue import conf
from django_fairqueue.cli import terminal
from django_fairqueue.contrib.bench import db
from django_fairqueue.contrib.bench.sizes import Sizes
from django_fairqueue.contrib.bench.tasks import NOOP_TASK_NAME
from django_fairqueue.db import channel_store, message_store
from django_fairqueue.tasks.spec import registry

#: Rows per bulk-load statement: progress moves, and no single transaction writes a gigabyte.
LOAD_CHUNK = 200_000
#: Seconds a process waits for its peers at a start line before the cell is abandoned.
START_TIMEOUT = 120.0
#: Payload of bulk-loaded messages: what ``enqueue(noop)`` stores for a call without arguments.
NOOP_PAYLOAD: dict[str, Any] = {"args": [], "kwargs": {}}


class BenchmarkError(RuntimeError):
    """The benchmark cannot run, or a cell failed; the message says why."""


# --------------------------------------------------------------------------------------------
# Progress


class Progress:
    """One line per cell on a stream (stderr); a live bar while a cell runs, if it is a terminal."""

    def __init__(self, total: int, stream: TextIO | None = None, *, enabled: bool = True) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.live = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.index = 0
        self.label = ""
        self._began = 0.0
        self._throttle = terminal.Throttle()

    def start(self, label: str) -> None:
        self.index += 1
        self.label = label
        self._began = time.monotonic()
        self.update("")

    def update(self, note: str, fraction: float | None = None) -> None:
        """Redraw the live line (at most 10 times a second); ``fraction`` draws a bar."""
        if not self.live or not self._throttle.due(final=fraction is None or fraction >= 1):
            return
        drawn = "" if fraction is None else terminal.bar(fraction) + " "
        line = f"{self._prefix()} {self.label}  {drawn}{note}"
        self.stream.write(terminal.CLEAR_LINE + line[:160])
        self.stream.flush()

    def done(self, summary: str) -> None:
        if not self.enabled:
            return
        took = time.monotonic() - self._began
        line = f"{self._prefix()} {self.label}: {summary} ({took:.1f}s)"
        self.stream.write((terminal.CLEAR_LINE if self.live else "") + line + "\n")
        self.stream.flush()

    def say(self, message: str) -> None:
        if self.enabled:
            self.stream.write(
                (terminal.CLEAR_LINE if self.live else "") + f"fairbench: {message}\n"
            )
            self.stream.flush()

    def _prefix(self) -> str:
        width = len(str(self.total))
        return f"[{self.index:>{width}}/{self.total}]"


# --------------------------------------------------------------------------------------------
# The run's context


@dataclass
class Bench:
    """What a scenario gets: where to run, how big, and where to report progress."""

    using: str
    sizes: Sizes
    progress: Progress
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    #: Scenario state that outlives one cell (e.g. calibrated rates), keyed by scenario.
    state: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        """Empty the queue tables (TRUNCATE ... RESTART IDENTITY)."""
        connections[self.using].close_if_unusable_or_obsolete()
        db.truncate_queue_tables(using=self.using)
        channel_store.forget_groups()  # the channel groups went with the tables

    def load(
        self, channels: Sequence[str], count: int, *, unique_scope: str | None = None
    ) -> float:
        """Bulk-load ``count`` ready no-op messages round-robin over ``channels`` (unique jobs
        of ``unique_scope``, if given), fold the counter deltas and ANALYZE; returns the
        seconds it took."""
        began = time.perf_counter()
        chunk = max(len(channels), LOAD_CHUNK // len(channels) * len(channels))
        done = 0
        while done < count:
            n = min(chunk, count - done)
            self.progress.update(f"loading {done:,}/{count:,} messages")
            done += db.load_ready_messages(
                channels,
                n,
                task_name=NOOP_TASK_NAME,
                payload=NOOP_PAYLOAD,
                defaults=conf.get().CHANNEL_DEFAULTS,
                unique_scope=unique_scope,
                using=self.using,
            )
        self.settle()
        return time.perf_counter() - began

    def settle(self) -> None:
        """Fold every pending counter delta and refresh statistics, as after a bulk load."""
        self.progress.update("folding counters, ANALYZE")
        while channel_store.fold_channel_deltas(10_000, using=self.using) > 0:
            pass
        db.analyze_queue_tables(using=self.using)

    def processes(self) -> ProcessGroup:
        return ProcessGroup(self.using)


# --------------------------------------------------------------------------------------------
# Forked processes


def _child_main(
    fn: Callable[..., Any], index: int, args: tuple[Any, ...], results: Queue[Any], using: str
) -> None:
    wrapper = connections[using]
    if wrapper.connection is not None:
        # Closing it here would close the parent's session; report instead.
        results.put((index, False, "forked with an open database connection (a harness bug)"))
        return
    try:
        outcome = (index, True, fn(index, *args))
    except BaseException:
        outcome = (index, False, traceback.format_exc())
    finally:
        wrapper.close()  # this child's own connection, opened after the fork
    results.put(outcome)


class ProcessGroup:
    """Forks workers that each run ``fn(index, *args)`` and collects what they return.

    Use it as a context manager: leaving it on an error breaks the start lines (barriers) and
    sets the events made here, so the workers stop, and reaps them.
    """

    def __init__(self, using: str) -> None:
        self.using = using
        self.ctx: ForkContext = multiprocessing.get_context("fork")
        self._procs: list[ForkProcess] = []
        self._results: Queue[Any] = self.ctx.Queue()
        self._barriers: list[Barrier] = []
        self._events: list[Event] = []

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            for barrier in self._barriers:
                barrier.abort()
            for event in self._events:
                event.set()
        self.stop()

    def barrier(self, parties: int) -> Barrier:
        """A start line for ``parties`` processes (the workers, plus one for the parent)."""
        barrier = self.ctx.Barrier(parties)
        self._barriers.append(barrier)
        return barrier

    def event(self) -> Event:
        """An event the workers poll to stop; set for them if the parent fails."""
        event = self.ctx.Event()
        self._events.append(event)
        return event

    def start(self, count: int, fn: Callable[..., Any], *args: Any) -> None:
        # Before forking: a child must never inherit an open connection (see module doc).
        connections.close_all()
        for index in range(count):
            proc = self.ctx.Process(
                target=_child_main,
                args=(fn, index, args, self._results, self.using),
                name=f"fairbench-{index}",
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)

    def collect(self, *, timeout: float, tick: Callable[[], None] | None = None) -> list[Any]:
        """Wait for every worker's result (in index order), calling ``tick`` while waiting."""
        deadline = time.monotonic() + timeout
        got: dict[int, Any] = {}
        errors: list[str] = []
        try:
            while len(got) + len(errors) < len(self._procs):
                if tick is not None:
                    tick()
                try:
                    index, ok, value = self._results.get(timeout=0.1)
                except Exception:  # queue.Empty
                    if time.monotonic() > deadline:
                        raise BenchmarkError(
                            f"benchmark processes did not finish within {timeout:.0f}s"
                        ) from None
                    dead = [p for p in self._procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise BenchmarkError(
                            f"benchmark process {dead[0].name} died (exit code {dead[0].exitcode})"
                        ) from None
                    continue
                if ok:
                    got[index] = value
                else:
                    errors.append(f"process {index}:\n{value}")
            if errors:
                raise BenchmarkError("a benchmark process failed:\n" + "\n".join(errors))
            return [got[i] for i in range(len(self._procs))]
        finally:
            self.stop()

    def stop(self) -> None:
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():  # only ever our own children, by their pid
                proc.kill()
                proc.join(timeout=5)
            proc.close()
        self._procs.clear()
        self._results.close()  # the parent only reads: no feeder thread to join


# --------------------------------------------------------------------------------------------
# Figures


def claim_and_complete(
    batch: int, lease: timedelta, worker_id: str, using: str
) -> list[message_store.ClaimedMessage]:
    """One claim of up to ``batch`` and the completion of what it got, two statements and two
    commits, as a worker's claimer and settler make them (their commit mode included)."""
    settings = conf.get()
    got = message_store.claim_messages(
        batch,
        lease=lease,
        worker_id=worker_id,
        async_commit=settings.ASYNC_COMMIT,
        durable_tasks=registry.at_most_once_names(),
        using=using,
    )
    if got:
        message_store.complete_messages(
            [(m.id, m.lease_token, None) for m in got],
            async_commit=settings.ASYNC_COMMIT,
            using=using,
        )
    return got


def backend_cpu(using: str) -> Callable[[], float] | None:
    """A clock of the CPU seconds the server backend of ``using``'s connection has used (user
    and system, from ``/proc``), or None where it cannot be read (a server on another host).

    Unlike time measured inside the server, it does not count the time the backend waited for
    a core: on a shared machine the figure to compare."""
    pid = db.select_backend_pid(using=using)
    path = f"/proc/{pid}/stat"
    ticks = os.sysconf("SC_CLK_TCK")

    def read() -> float:
        with open(path) as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks

    try:
        # the same pid on this host may be another process (a server in a container)
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            if b"postgres" not in cmdline.read():
                return None
        read()
    except OSError:
        return None
    return read


def load1() -> float:
    """The one-minute load average (how busy the shared machine was)."""
    return os.getloadavg()[0]


class CpuWatch:
    """CPU that processes other than the benchmark's used during a cell, in cores (Linux).

    The load average cannot tell: it counts the benchmark's own processes, and it lags by a
    minute. This reads ``/proc`` before and after a cell and sums the CPU time of every process
    except this one, its children, the PostgreSQL backends of the benchmark's database and the
    server's shared helpers (checkpointer, WAL writer, I/O workers...). Processes that both
    started and ended within the cell are missed, so it is a lower bound.
    """

    PROC = "/proc"

    def __init__(self, dbname: str) -> None:
        self.dbname = dbname
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._before: dict[tuple[int, int], int] | None = None
        self._began = 0.0

    def start(self) -> None:
        self._before = self._sample()
        self._began = time.monotonic()

    def stop(self) -> float | None:
        """Cores used by others since :meth:`start` (None where ``/proc`` is unreadable)."""
        if self._before is None:
            return None
        after = self._sample()
        wall = time.monotonic() - self._began
        if after is None or wall <= 0:
            return None
        ticks = sum(used - self._before.get(key, 0) for key, used in after.items())
        return round(max(ticks, 0) / self.tick / wall, 2)

    def _sample(self) -> dict[tuple[int, int], int] | None:
        try:
            pids = [int(name) for name in os.listdir(self.PROC) if name.isdigit()]
        except OSError:
            return None
        me = os.getpid()
        found: dict[tuple[int, int], int] = {}
        for pid in pids:
            try:
                with open(f"{self.PROC}/{pid}/stat", "rb") as handle:
                    stat = handle.read().decode(errors="replace")
                with open(f"{self.PROC}/{pid}/cmdline", "rb") as handle:
                    argv = handle.read().decode(errors="replace").split("\0")
            except OSError:  # gone meanwhile, or not ours to read
                continue
            fields = stat[stat.rfind(")") + 2 :].split()
            # fields[1] is the parent pid; [11], [12] user and system ticks; [19] start time
            if pid == me or int(fields[1]) == me or self._ours(argv):
                continue
            found[(pid, int(fields[19]))] = int(fields[11]) + int(fields[12])
        return found

    def _ours(self, argv: list[str]) -> bool:
        title = argv[0]
        if not title.startswith("postgres: "):
            return False
        # A backend shows "postgres: user dbname host(port) state", an autovacuum worker
        # "postgres: autovacuum worker dbname": ours if dbname is ours. The helpers without a
        # database (checkpointer, WAL writer, I/O workers...) serve everyone: not counted.
        words = title.split()
        if self.dbname in words[1:]:
            return True
        backend = any("(" in w or w == "[local]" for w in words[2:])
        return not (backend or title.startswith("postgres: autovacuum worker"))

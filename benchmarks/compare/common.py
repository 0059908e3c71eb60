"""What every system's adapter shares: the no-op handler's stamps, worker processes, figures.

Every system runs the same no-op task, ``noop(tenant, seq)``. It does nothing but, for jobs of
tenants other than ``A`` (and for every job when ``COMPARE_STAMP_ALL=1``), print one line
``@@stamp TENANT SEQ TIME`` on its worker's standard output: ``TIME`` is ``time.time()`` when
the handler started. The benchmark reads those lines from the workers' pipes, so B's wait
and the pickup latency are the difference of two readings of one machine's clock, taken the
same way for every system.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from typing import IO, Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo

STAMP = "@@stamp"
STAMP_ALL_ENV = "COMPARE_STAMP_ALL"
#: "A=0.2,B=0.005": seconds each tenant's job takes after its stamp (the timeshare scenario)
WORK_ENV = "COMPARE_WORK"
DSN_ENV = "COMPARE_DSN"
#: Seconds a worker gets to stop after SIGTERM before it is killed.
STOP_TIMEOUT = 15.0


def _line(tenant: str, seq: int) -> None:
    if tenant != "A" or _STAMP_ALL:
        # One write(2) of the whole line, not sys.stdout: its buffer has a lock, and without
        # PYTHONUNBUFFERED (tox does not pass it) 32 handler threads each writing and flushing
        # it queued on that lock, which took 70 us of a worker's CPU per job and a third of its
        # rate at 32 threads (about 4,100 jobs/s instead of 6,900). A line this short is written
        # whole to a pipe (under PIPE_BUF), so lines of concurrent handlers never interleave.
        os.write(1, f"{STAMP} {tenant} {seq} {time.time():.6f}\n".encode())


def stamp(tenant: str, seq: int) -> None:
    """The body of every system's no-op task (a thread's: it sleeps the tenant's work)."""
    _line(tenant, seq)
    if _WORK.get(tenant):
        time.sleep(_WORK[tenant])


async def astamp(tenant: str, seq: int) -> None:
    """The same, for a coroutine (it awaits the tenant's work instead of blocking its loop)."""
    _line(tenant, seq)
    if _WORK.get(tenant):
        await asyncio.sleep(_WORK[tenant])


def _work(spec: str) -> dict[str, float]:
    return {k: float(v) for k, _, v in (p.partition("=") for p in spec.split(",") if p)}


_STAMP_ALL = os.environ.get(STAMP_ALL_ENV) == "1"
_WORK = _work(os.environ.get(WORK_ENV, ""))


class BenchError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------
# Connections


def dsn_with(dsn: str, **changes: Any) -> str:
    return make_conninfo(dsn, **changes)


def dsn_fields(dsn: str) -> dict[str, Any]:
    return conninfo_to_dict(dsn)


def dsn_url(dsn: str) -> str:
    """``postgres://user:password@host:port/dbname`` (for Django settings and asyncpg)."""
    f = dsn_fields(dsn)
    auth = f.get("user", "postgres")
    if f.get("password"):
        auth += ":" + str(f["password"])
    return f"postgres://{auth}@{f.get('host', '127.0.0.1')}:{f.get('port', 5432)}/{f['dbname']}"


# --------------------------------------------------------------------------------------------
# Worker processes


@dataclass(frozen=True)
class WorkerConfig:
    """P processes, each with C-way concurrency (threads, coroutines or batch size)."""

    processes: int
    concurrency: int
    #: django-fairqueue only: ``runfairworker --prefetch``, messages claimed beyond free threads
    prefetch: int = 0

    @property
    def label(self) -> str:
        extra = f"+{self.prefetch}" if self.prefetch else ""
        return f"{self.processes}x{self.concurrency}{extra}"


class Stamps:
    """Stamp lines read from the workers' pipes: (tenant, seq) -> handler start time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.times: dict[tuple[str, int], float] = {}
        self.a_times: list[float] = []
        #: every stamp's time per tenant (with COMPARE_STAMP_ALL=1, A's too)
        self.starts: dict[str, list[float]] = {}
        self.changed = threading.Condition(self.lock)

    def read(self, pipe: IO[str]) -> None:
        for line in pipe:
            if not line.startswith(STAMP):
                continue
            _, tenant, seq, at = line.split()
            with self.changed:
                self.starts.setdefault(tenant, []).append(float(at))
                if tenant == "A":
                    self.a_times.append(float(at))
                else:
                    self.times[(tenant, int(seq))] = float(at)
                self.changed.notify_all()

    def wait_for(self, keys: Sequence[tuple[str, int]], timeout: float) -> list[float] | None:
        """The stamps of ``keys`` once all have arrived; None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                if all(k in self.times for k in keys):
                    return [self.times[k] for k in keys]
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.changed.wait(min(left, 0.05))


class Fleet:
    """Worker subprocesses started from ``argv`` lists; stamps collected from their stdout."""

    def __init__(self, commands: Sequence[Sequence[str]], env: dict[str, str]) -> None:
        self.stamps = Stamps()
        self.procs: list[subprocess.Popen[str]] = []
        self.logs: list[IO[str]] = []
        self.threads: list[threading.Thread] = []
        self.started = time.perf_counter()
        try:
            for argv in commands:
                log = tempfile.TemporaryFile("w+", prefix="compare-worker-")  # noqa: SIM115
                proc = subprocess.Popen(
                    list(argv),
                    env={**os.environ, **env},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    bufsize=1,
                )
                self.logs.append(log)
                self.procs.append(proc)
                assert proc.stdout is not None
                thread = threading.Thread(target=self.stamps.read, args=(proc.stdout,), daemon=True)
                thread.start()
                self.threads.append(thread)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check(self) -> None:
        for proc, log in zip(self.procs, self.logs, strict=True):
            code = proc.poll()
            if code not in (None, 0):
                log.seek(0)
                tail = "\n".join(log.read().splitlines()[-25:])
                raise BenchError(f"worker {' '.join(proc.args)} exited with {code}:\n{tail}")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()  # our own child, by its pid
                proc.wait(5)
        for thread in self.threads:
            thread.join(5)
        for log in self.logs:
            log.close()


# --------------------------------------------------------------------------------------------
# Backlogs loaded in one statement


@dataclass(frozen=True)
class Backlog:
    """``count`` jobs of each tenant, queued in alternating chunks of ``chunk`` (first in,
    first out serves them alternately too; one tenant: one run). ``keys[i]`` > 1 spreads
    tenant i's jobs round-robin over that many keys (the sybil scenario: channels, locks,
    entrypoints named :func:`spread_key`), 1 keeps one key, the tenant's name."""

    tenants: tuple[str, ...]
    count: int
    keys: tuple[int, ...] = ()
    chunk: int = 1_000

    @property
    def total(self) -> int:
        return self.count * len(self.tenants)

    def key_counts(self) -> tuple[int, ...]:
        return self.keys or (1,) * len(self.tenants)


def spread_key(tenant: str, index: int) -> str:
    """The name of a tenant's ``index``-th key (queue, lock, entrypoint) in the sybil scenario."""
    return f"{tenant}-c{index:02d}"


#: The jobs of a :class:`Backlog` as rows ``(i, tenant, key, seq)`` from ``generate_series``,
#: ``i`` in queueing order from ``lo`` to ``hi`` (a slice of the whole, for chunked loads).
#: Parameters: tenants, keys, chunk, lo, hi. A system wraps it in its own INSERT ... SELECT.
SERIES_SQL = """
SELECT s.i, t.tenant,
       CASE WHEN t.keys > 1
            THEN t.tenant || '-c' || lpad((s.seq %% t.keys)::text, 2, '0')
            ELSE t.tenant END AS key,
       s.seq
FROM (
    SELECT i,
           ((i - 1) / %(chunk)s) %% cardinality(%(tenants)s::text[]) + 1 AS p,
           ((i - 1) / (%(chunk)s * cardinality(%(tenants)s::text[]))) * %(chunk)s
               + (i - 1) %% %(chunk)s AS seq
    FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS i
) AS s
JOIN unnest(%(tenants)s::text[], %(keys)s::int[]) WITH ORDINALITY AS t(tenant, keys, p)
    USING (p)
"""
#: Rows per statement of a chunked load.
LOAD_SLICE = 100_000


def series_slices(backlog: Backlog) -> list[dict[str, Any]]:
    """The parameters of :data:`SERIES_SQL` for each slice of ``backlog`` in order."""
    return [
        {
            "tenants": list(backlog.tenants),
            "keys": list(backlog.key_counts()),
            "chunk": backlog.chunk,
            "lo": lo,
            "hi": min(lo + LOAD_SLICE - 1, backlog.total),
        }
        for lo in range(1, backlog.total + 1, LOAD_SLICE)
    ]


# --------------------------------------------------------------------------------------------
# Figures


#: Untimed enqueue calls before the start line (connections, prepared statements, caches).
WARMUP_CALLS = 3


def timed_calls(
    call: Callable[[], int], start: Barrier, duration: float
) -> tuple[int, float, float]:
    """The enqueue cell's loop: warm up, wait for every process at ``start``, then call
    ``call`` (returns jobs enqueued) for ``duration`` seconds. Returns (jobs, began, ended)."""
    for _ in range(WARMUP_CALLS):
        call()
    start.wait(120)
    began = time.perf_counter()
    jobs = 0
    while time.perf_counter() < began + duration:
        jobs += call()
    return jobs, began, time.perf_counter()


async def timed_calls_async(
    call: Callable[[], Awaitable[int]], start: Barrier, duration: float
) -> tuple[int, float, float]:
    """:func:`timed_calls` for an async ``call`` (the barrier wait blocks the loop on purpose:
    nothing else runs on it before the start)."""
    for _ in range(WARMUP_CALLS):
        await call()
    start.wait(120)
    began = time.perf_counter()
    jobs = 0
    while time.perf_counter() < began + duration:
        jobs += await call()
    return jobs, began, time.perf_counter()

"""Running on a Spark cluster: infrastructure errors, the executors' check, scheduler pools.

* :func:`infrastructure_error` tells an error of the infrastructure (the executors' Python is
  missing or wrong, the database is unreachable, executors were lost, the session stopped) from
  an error of the data or the formulas. The runner gives a batch that failed on the first kind
  back without using up an attempt and pauses; the second kind counts an attempt.
* :func:`check` runs before the runner claims (again): it waits for executors and runs one tiny
  Spark job whose tasks import what the pipeline's tasks need and connect to each database.
* :class:`Watchdog` watches a running batch's application: no executor for
  ``EXECUTOR_TIMEOUT`` seconds, or a standalone master gone, is an outage; the runner cancels
  the batch's Spark job, gives the batch back and rebuilds the session.
* :func:`ensure_pool` gives each channel a Spark FAIR scheduler pool, named after the channel,
  weighted like the channel, so tenants share a Spark application as they share the queue.

Spark tasks import this module (:func:`probe_task`): it imports nothing of Django at load time.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

logger = logging.getLogger("django_fairqueue.pipeline")

POOL_PROPERTY = "spark.scheduler.pool"


class InfrastructureError(RuntimeError):
    """Spark or the database cannot run batches right now; no batch is to blame."""

    def __init__(self, kind: str, detail: str, hint: str = "") -> None:
        self.kind = kind
        self.detail = detail
        self.hint = hint
        super().__init__(f"{kind}: {detail}" + (f" ({hint})" if hint else ""))


# --------------------------------------------------------------------------------------------
# Telling infrastructure errors from data errors

EXECUTOR_PYTHON = "the executors' Python cannot run the pipeline's tasks"
EXECUTOR_DATABASE = "the executors cannot reach the database"
DRIVER_DATABASE = "the driver cannot reach the database"
EXECUTORS_LOST = "Spark executors were lost"
NO_EXECUTORS = "no Spark executors"
SESSION_STOPPED = "the Spark session stopped"
MASTER_LOST = "the Spark master went away"
#: Errors after which the runner stops its session and builds a new one (a new application)
#: before it claims again: the old application cannot run tasks any more. A standalone master
#: that restarts forgets the applications it had (without its recovery mode) and kills their
#: executors when the workers register again, so only a new application gets executors back.
REBUILD_KINDS = frozenset({SESSION_STOPPED, MASTER_LOST, NO_EXECUTORS})

_HINTS = {
    EXECUTOR_PYTHON: (
        "set spark.pyspark.python (FAIRQUEUE_PIPELINE['SPARK']['CONF'] or spark-submit --conf) or "
        "PYSPARK_PYTHON to an interpreter present on every worker, of the driver's Python "
        "version, with django-fairqueue, psycopg and pyarrow installed"
    ),
    EXECUTOR_DATABASE: (
        "the tasks connect with the driver's database settings: make PostgreSQL reachable from "
        "the Spark workers, or set FAIRQUEUE_PIPELINE['SPARK']['EXECUTOR_DATABASE_URL']"
    ),
    DRIVER_DATABASE: "check that PostgreSQL is up and reachable from this process",
    EXECUTORS_LOST: "a worker died or was stopped, or the master dropped the application",
    SESSION_STOPPED: "the session is rebuilt when the runner resumes",
    MASTER_LOST: (
        "the application went with its master: the runner builds a new session once the "
        "master is back"
    ),
    NO_EXECUTORS: (
        "no worker is alive, or none has the free cores and memory asked for: other "
        "applications may hold every core (give each driver a spark.cores.max: "
        "FAIRQUEUE_PIPELINE['SPARK']['CORES_MAX']) or spark.executor.memory is more than a "
        "worker offers; see the master's web UI"
    ),
}

# SQLSTATE classes of a connection or server that is down, full or shutting down (08, 53, 57P,
# 58); not 57014 (query_canceled: a statement timeout may be the batch's own doing).
_INFRA_SQLSTATE = re.compile(r"^(08|53|57P|58)")
_PYTHON_PATTERNS = [
    re.compile(r'Cannot run program "[^"]*"[^\n]*'),
    re.compile(r"[^\n]*(PYTHON_VERSION_MISMATCH|Python in worker has different version)[^\n]*"),
    re.compile(r"(ModuleNotFoundError|ImportError): [^\n]*"),
    re.compile(r"[^\n]*Python worker (failed to connect back|exited unexpectedly)[^\n]*"),
]
_LOST_PATTERNS = [
    re.compile(
        r"[^\n]*(ExecutorLostFailure|Executor heartbeat timed out|Remote RPC client "
        r"disassociated|Master removed our application|All masters are unresponsive|has been "
        r"decommissioned|Worker lost|FetchFailed|Lost executor)[^\n]*"
    ),
]
_STOPPED_PATTERNS = [
    re.compile(
        r"[^\n]*(SparkContext was shut down|stopped SparkContext|SparkContext has been "
        r"shutdown|SparkContext is stopped)[^\n]*"
    ),
]


def _infra_psycopg_names() -> str:
    import psycopg

    names = ["OperationalError", "InterfaceError", r"errors\.ConnectionTimeout"]
    for name, value in vars(psycopg.errors).items():
        if (
            isinstance(value, type)
            and issubclass(value, psycopg.Error)
            and _INFRA_SQLSTATE.match(getattr(value, "sqlstate", None) or "")
        ):
            names.append(rf"errors\.{name}")
    return "|".join(sorted(set(names)))


_database_pattern: re.Pattern[str] | None = None


def _database_in_text() -> re.Pattern[str]:
    global _database_pattern
    if _database_pattern is None:
        _database_pattern = re.compile(rf"psycopg\.({_infra_psycopg_names()}): [^\n]*")
    return _database_pattern


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _database_down(exc: BaseException) -> bool:
    """A psycopg (or Django-wrapped) error of a connection that failed or a server down."""
    import psycopg

    if not isinstance(exc, psycopg.Error):
        return False
    if isinstance(exc, psycopg.errors.QueryCanceled):
        return False
    sqlstate = exc.sqlstate or ""
    if sqlstate:
        return bool(_INFRA_SQLSTATE.match(sqlstate))
    return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)


def infrastructure_error(exc: BaseException) -> InfrastructureError | None:
    """The :class:`InfrastructureError` ``exc`` comes down to, or None for a data error."""
    for one in _chain(exc):
        if isinstance(one, InfrastructureError):
            return one
        if _database_down(one):
            return InfrastructureError(DRIVER_DATABASE, _first_line(one), _HINTS[DRIVER_DATABASE])
        name = type(one).__name__
        if name in ("Py4JNetworkError", "SparkClusterError"):
            return InfrastructureError(SESSION_STOPPED, _first_line(one), _HINTS[SESSION_STOPPED])
    text = "\n".join(str(one) for one in _chain(exc))
    for kind, patterns in (
        (EXECUTOR_PYTHON, _PYTHON_PATTERNS),
        (EXECUTOR_DATABASE, [_database_in_text()]),
        (EXECUTORS_LOST, _LOST_PATTERNS),
        (SESSION_STOPPED, _STOPPED_PATTERNS),
    ):
        for pattern in patterns:
            match = pattern.search(text)
            if match is not None:
                return InfrastructureError(kind, match.group(0).strip()[:500], _HINTS[kind])
    return None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:500]


# --------------------------------------------------------------------------------------------
# Checking the executors


def probe_task(conninfos: tuple[str, ...], rows: Iterator[Any]) -> Iterator[tuple[str, str, str]]:
    """A Spark task: import what the pipeline's tasks import, connect to each database."""
    import socket
    import sys

    import psycopg
    import pyarrow  # noqa: F401

    import django_fairqueue.contrib.pipeline.datastore  # noqa: F401

    for _ in rows:
        pass
    for conninfo in conninfos:
        with psycopg.connect(conninfo, autocommit=True) as connection:
            connection.execute("SELECT 1")
    version = ".".join(str(part) for part in sys.version_info[:3])
    yield (socket.gethostname(), sys.executable, version)


@dataclass(frozen=True)
class CheckResult:
    executors: tuple[str, ...]
    pythons: tuple[str, ...]
    seconds: float


def _dynamic(context: Any) -> bool:
    value = context.getConf().get("spark.dynamicAllocation.enabled", "false")
    return str(value).lower() == "true"


def wait_for_executors(
    spark: Any, timeout: float, wait: Callable[[float], Any] = time.sleep
) -> list[str]:
    """The application's executor ids, once it has one; :class:`InfrastructureError` after
    ``timeout`` seconds without (local mode and dynamic allocation are not waited for).

    ``wait(seconds)`` sleeps between looks; if it returns True (the runner stops), the wait
    ends with the error at once."""
    from django_fairqueue.contrib.pipeline.spark import executor_ids

    context = spark.sparkContext
    if context.master.startswith("local") or _dynamic(context):
        return []
    deadline = time.monotonic() + timeout
    stopped = False
    while True:
        if context._jsc.sc().isStopped():
            raise InfrastructureError(
                SESSION_STOPPED, "the SparkContext stopped", _HINTS[SESSION_STOPPED]
            )
        ids = executor_ids(spark)
        if ids:
            return ids
        if time.monotonic() >= deadline or stopped:
            cores = context.getConf().get("spark.cores.max", "unlimited")
            raise InfrastructureError(
                NO_EXECUTORS,
                f"the master {context.master} gave application {context.applicationId} no "
                f"executor in {timeout:.0f} s (spark.cores.max {cores})",
                _HINTS[NO_EXECUTORS],
            )
        stopped = bool(wait(0.5))


#: How often a :class:`Watchdog` looks at the executors and tries the master; a master is gone
#: when it refused (or timed out) this many times in a row, so one lost packet is no outage.
WATCH_INTERVAL = 1.0
MASTER_PROBE_INTERVAL = 2.0
MASTER_MISSES = 2


class Watchdog:
    """Looks at a running batch's application from another thread (:meth:`look`).

    An outage is: the application had no executor for ``executor_timeout`` seconds (Spark keeps
    the job waiting for one forever), its standalone master (every address of a
    ``spark://h1,h2`` URL) refused connections :data:`MASTER_MISSES` times in a row, or its
    SparkContext stopped. Local mode has no executors to lose: only the last counts there.
    """

    def __init__(
        self,
        spark: Any,
        executor_timeout: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.context = spark.sparkContext
        self.spark = spark
        self.master = str(self.context.master)
        self.executor_timeout = executor_timeout
        self.clock = clock
        now = clock()
        self._seen_executors = now  # a batch starts the count afresh
        self._next_look = now
        self._next_probe = now + MASTER_PROBE_INTERVAL
        self._misses = 0

    def look(self) -> InfrastructureError | None:
        """The outage seen, or None (cheap: does its work once per :data:`WATCH_INTERVAL`)."""
        from django_fairqueue.contrib.pipeline.spark import (
            SparkClusterError,
            check_master,
            executor_ids,
        )

        now = self.clock()
        if now < self._next_look:
            return None
        self._next_look = now + WATCH_INTERVAL
        if self.context._jsc.sc().isStopped():
            return InfrastructureError(
                SESSION_STOPPED, "the SparkContext stopped", _HINTS[SESSION_STOPPED]
            )
        if self.master.startswith("local"):
            return None
        if executor_ids(self.spark):
            self._seen_executors = now
        elif now - self._seen_executors >= self.executor_timeout:
            return InfrastructureError(
                NO_EXECUTORS,
                f"application {self.context.applicationId} has had no executor for "
                f"{now - self._seen_executors:.0f} s (EXECUTOR_TIMEOUT "
                f"{self.executor_timeout:.0f} s)",
                _HINTS[NO_EXECUTORS],
            )
        if self.master.startswith("spark://") and now >= self._next_probe:
            try:
                check_master(self.master, timeout=MASTER_PROBE_INTERVAL)
            except SparkClusterError as exc:
                self._misses += 1
                if self._misses >= MASTER_MISSES:
                    return InfrastructureError(MASTER_LOST, str(exc), _HINTS[MASTER_LOST])
            else:
                self._misses = 0
            self._next_probe = self.clock() + MASTER_PROBE_INTERVAL
        return None


_healthy: set[tuple[str, tuple[str, ...]]] = set()
_healthy_lock = threading.Lock()


def check(
    spark: Any,
    conninfos: Sequence[str],
    *,
    executor_timeout: float,
    job_tag: str | None = None,
    wait: Callable[[float], Any] = time.sleep,
    force: bool = False,
) -> CheckResult | None:
    """Check that the executors can run the pipeline's tasks; :class:`InfrastructureError` if
    not. Remembered per application and databases until :func:`forget` (None: known good)."""
    context = spark.sparkContext
    key = (str(context.applicationId), tuple(conninfos))
    with _healthy_lock:
        if key in _healthy and not force:
            return None
    started = time.monotonic()
    executors = wait_for_executors(spark, executor_timeout, wait)
    parts = max(1, min(len(executors), 16))
    if job_tag is not None:
        context.addJobTag(job_tag)
    try:
        found = (
            context.parallelize(range(parts), parts)
            .mapPartitions(partial(probe_task, tuple(conninfos)))
            .collect()
        )
    except Exception as exc:
        error = infrastructure_error(exc)
        if error is None:  # a probe has no data to blame: whatever failed is infrastructure
            error = InfrastructureError(EXECUTOR_PYTHON, _first_line(exc), _HINTS[EXECUTOR_PYTHON])
        raise error from None
    finally:
        if job_tag is not None:
            context.removeJobTag(job_tag)
    with _healthy_lock:
        _healthy.add(key)
    return CheckResult(
        executors=tuple(executors),
        pythons=tuple(sorted({f"{host}: {python} ({version})" for host, python, version in found})),
        seconds=time.monotonic() - started,
    )


def forget(spark: Any = None) -> None:
    """Check again before the next claim (after an infrastructure error)."""
    with _healthy_lock:
        if spark is None:
            _healthy.clear()
            return
        try:
            app = str(spark.sparkContext.applicationId)
        except Exception:
            _healthy.clear()
            return
        for key in [k for k in _healthy if k[0] == app]:
            _healthy.discard(key)


# --------------------------------------------------------------------------------------------
# FAIR scheduler pools, one per channel

_POOL_UNSAFE = re.compile(r"[^A-Za-z0-9_.@:-]")
_pools_lock = threading.Lock()
#: (application id, pool) -> the weight we created it with.
_created: dict[tuple[str, str], int] = {}
_pool_warned = False


def pool_name(channel: str) -> str:
    """The Spark scheduler pool of a channel: its name, with characters other than letters,
    digits and ``_ . @ : -`` replaced by ``_`` and then a short hash (so two channels never
    share a pool)."""
    safe = _POOL_UNSAFE.sub("_", channel)[:100]
    if safe == channel:
        return channel
    return f"{safe}-{hashlib.sha256(channel.encode()).hexdigest()[:8]}"


def fair(spark: Any) -> bool:
    mode = spark.sparkContext.getConf().get("spark.scheduler.mode", "FIFO")
    return str(mode).upper() == "FAIR"


def ensure_pool(spark: Any, channel: str, weight: int) -> str | None:
    """Make sure the channel's FAIR pool exists with ``weight``; return its name (None when the
    session does not schedule FAIR).

    A pool the application already defines (its allocation file) is used as defined. A pool of
    ours whose channel's weight changed is replaced when it is idle.
    """
    global _pool_warned
    if not fair(spark):
        return None
    name = pool_name(channel)
    weight = max(1, int(weight))
    context = spark.sparkContext
    key = (str(context.applicationId), name)
    with _pools_lock:
        try:
            root = context._jsc.sc().taskScheduler().rootPool()
            existing = root.getSchedulableByName(name)
            if existing is not None:
                if _created.get(key) in (None, weight):
                    return name
                if existing.runningTasks() > 0 or not existing.schedulableQueue().isEmpty():
                    return name  # busy: its new weight applies once it is idle
                root.removeSchedulable(existing)
            jvm = context._jvm
            mode = jvm.org.apache.spark.scheduler.SchedulingMode.withName("FIFO")
            root.addSchedulable(jvm.org.apache.spark.scheduler.Pool(name, mode, 0, weight))
            _created[key] = weight
        except Exception as exc:  # Spark's scheduler internals changed: run in Spark's own
            if not _pool_warned:
                _pool_warned = True
                logger.warning(
                    "could not create Spark scheduler pool %s with weight %d (%s): Spark makes "
                    "it with weight 1",
                    name,
                    weight,
                    exc,
                )
    return name


def pool_weight(spark: Any, name: str) -> int | None:
    """The weight of the application's pool ``name`` (None if there is none)."""
    found = spark.sparkContext._jsc.sc().getPoolForName(name)
    return int(found.get().weight()) if found.isDefined() else None

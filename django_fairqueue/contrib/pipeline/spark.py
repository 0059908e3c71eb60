"""The worker's long-lived SparkSession, configured from ``FAIRQUEUE_PIPELINE['SPARK']``.

Starting a session costs seconds (5-6 s on a 2-core machine) and an idle one holds ~550 MB, so a
process builds one on first use and keeps it: never one per batch.

``FAIRQUEUE_PIPELINE['SPARK']`` keys (all optional):

``MASTER``
    Spark master URL; default ``local[2]``. ``spark://host:7077``, ``yarn``, ``k8s://...`` run
    the batches' tasks on a cluster. Under ``spark-submit``, spark-submit's master (its
    ``--master``, ``--conf spark.master=`` or ``spark-defaults.conf``) is used instead, with a
    warning if this one differs (see :func:`session_plan`).
``CONF``
    Extra Spark properties, e.g. ``{"spark.executor.memory": "4g"}``. Under ``spark-submit``,
    a property spark-submit set keeps spark-submit's value (a warning names each one that
    differs).
``APP_NAME``
    Default ``django-fairqueue``.
``PARTITIONS``
    Sub-ranges (Spark tasks) per batch; default: the session's default parallelism.
``CORES_MAX``
    ``spark.cores.max`` of this driver on a standalone cluster (``spark://``), so several
    drivers share one: default ``PARTITIONS``, else 2. ``None``: no limit of ours (the
    cluster's ``spark.deploy.defaultCores``, all cores by default).
``POOLS``
    Default True: Spark's FAIR scheduler, each channel's batches in a pool named after the
    channel with the channel's weight (:mod:`.cluster`). False: Spark's default FIFO.
``EXECUTOR_DATABASE_URL``
    How executors reach the database when that differs from the driver's settings (a libpq URL
    or connection string, used as given); default: the Django database's own parameters, every
    libpq option of them (:func:`executor_conninfo`).
``EXECUTOR_CONNECT_TIMEOUT``
    ``connect_timeout`` (seconds) of the executors' connections when their connection string
    has none; default 10, so an unreachable database fails a task fast.
``EXECUTOR_TIMEOUT``
    Seconds the runner waits for the cluster to give it an executor before it pauses, and the
    longest a running batch's application may have no executor before the batch's Spark job is
    cancelled, the batch given back (no attempt used) and the session rebuilt; default 60.
``PAUSE_SECONDS``, ``PAUSE_MAX_SECONDS``
    The runner's first pause after an infrastructure error and the longest (it doubles in
    between); default 5 and 300.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django_fairqueue.contrib.pipeline import appconf

logger = logging.getLogger("django_fairqueue.pipeline")

INSTALL_HINT = "pip install 'django-fairqueue[spark]'"
_KEYS = {
    "MASTER",
    "CONF",
    "APP_NAME",
    "PARTITIONS",
    "CORES_MAX",
    "POOLS",
    "EXECUTOR_DATABASE_URL",
    "EXECUTOR_CONNECT_TIMEOUT",
    "EXECUTOR_TIMEOUT",
    "PAUSE_SECONDS",
    "PAUSE_MAX_SECONDS",
}
DEFAULT_MASTER = "local[2]"
DEFAULT_CORES_MAX = 2
#: Seconds to wait for a TCP connection to a standalone master before calling it unreachable.
MASTER_CONNECT_TIMEOUT = 10.0
_UNSET: Any = object()


class SparkUnavailable(RuntimeError):
    """PySpark (or Java) is missing: the message says how to install it."""


class SparkClusterError(SparkUnavailable):
    """The configured Spark master cannot be used: unreachable, or it dropped the application.

    Raised when the session starts; never a silent fallback to local mode."""


@dataclass(frozen=True)
class SparkSettings:
    master: str = DEFAULT_MASTER
    conf: dict[str, str] = field(default_factory=dict)
    app_name: str = "django-fairqueue"
    partitions: int | None = None
    executor_database_url: str | None = None
    #: Whether ``MASTER`` was set in the settings (else ``master`` is the default).
    master_set: bool = False
    #: ``spark.cores.max`` for a standalone master; None: no limit of ours.
    cores_max: int | None = DEFAULT_CORES_MAX
    pools: bool = True
    executor_connect_timeout: float = 10.0
    executor_timeout: float = 60.0
    pause_seconds: float = 5.0
    pause_max_seconds: float = 300.0

    @property
    def local(self) -> bool:
        return self.master.startswith("local")


def _seconds(raw: Mapping[str, Any], key: str, default: float, minimum: float) -> float:
    value = raw.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not value >= minimum
        or value == float("inf")
    ):
        raise ValueError(
            f"FAIRQUEUE_PIPELINE['SPARK']['{key}'] must be a number of seconds >= {minimum}"
        )
    return float(value)


def spark_settings() -> SparkSettings:
    """``FAIRQUEUE_PIPELINE['SPARK']`` checked; ``ValueError`` names a bad entry."""
    raw = appconf.get()["SPARK"]
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ValueError(
            f"FAIRQUEUE_PIPELINE['SPARK'] has unknown keys {unknown}; known: {sorted(_KEYS)}"
        )
    master = raw.get("MASTER", DEFAULT_MASTER)
    if not isinstance(master, str) or not master.strip():
        raise ValueError("FAIRQUEUE_PIPELINE['SPARK']['MASTER'] must be a Spark master URL")
    extra = raw.get("CONF", {})
    if not isinstance(extra, dict):
        raise ValueError("FAIRQUEUE_PIPELINE['SPARK']['CONF'] must be a dict of Spark properties")
    if "spark.master" in extra:
        raise ValueError(
            "FAIRQUEUE_PIPELINE['SPARK']['CONF'] must not set spark.master: set "
            "FAIRQUEUE_PIPELINE['SPARK']['MASTER']"
        )
    partitions = raw.get("PARTITIONS")
    if partitions is not None and (
        isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1
    ):
        raise ValueError("FAIRQUEUE_PIPELINE['SPARK']['PARTITIONS'] must be an integer >= 1")
    cores_max = raw.get("CORES_MAX", _UNSET)
    if cores_max is _UNSET:
        cores_max = partitions or DEFAULT_CORES_MAX
    elif cores_max is not None and (
        isinstance(cores_max, bool) or not isinstance(cores_max, int) or cores_max < 1
    ):
        raise ValueError(
            "FAIRQUEUE_PIPELINE['SPARK']['CORES_MAX'] must be an integer >= 1, or None"
        )
    pools = raw.get("POOLS", True)
    if not isinstance(pools, bool):
        raise ValueError("FAIRQUEUE_PIPELINE['SPARK']['POOLS'] must be True or False")
    url = raw.get("EXECUTOR_DATABASE_URL")
    if url is not None and not isinstance(url, str):
        raise ValueError("FAIRQUEUE_PIPELINE['SPARK']['EXECUTOR_DATABASE_URL'] must be a string")
    pause = _seconds(raw, "PAUSE_SECONDS", 5.0, 0.0)
    pause_max = _seconds(raw, "PAUSE_MAX_SECONDS", max(300.0, pause), 0.0)
    if pause_max < pause:
        raise ValueError(
            "FAIRQUEUE_PIPELINE['SPARK']['PAUSE_MAX_SECONDS'] must be at least PAUSE_SECONDS"
        )
    return SparkSettings(
        master=master.strip(),
        conf={str(k): str(v) for k, v in extra.items()},
        app_name=str(raw.get("APP_NAME", "django-fairqueue")),
        partitions=partitions,
        executor_database_url=url,
        master_set="MASTER" in raw,
        cores_max=cores_max,
        pools=pools,
        executor_connect_timeout=_seconds(raw, "EXECUTOR_CONNECT_TIMEOUT", 10.0, 1.0),
        executor_timeout=_seconds(raw, "EXECUTOR_TIMEOUT", 60.0, 0.0),
        pause_seconds=pause,
        pause_max_seconds=pause_max,
    )


def require_pyspark() -> None:
    """Raise :class:`SparkUnavailable` (with how to install) unless PySpark and pyarrow import."""
    missing = []
    for module in ("pyspark", "pyarrow"):  # each tried: the message names all that are missing
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing.append(exc.name or module)  # a module of theirs may be what is missing
    if missing:
        raise SparkUnavailable(
            f"the Spark pipeline needs PySpark and pyarrow (not installed: "
            f"{', '.join(missing)}): {INSTALL_HINT}"
        )


def require_java() -> None:
    if os.environ.get("JAVA_HOME") or shutil.which("java"):
        return
    raise SparkUnavailable(
        "the Spark pipeline needs Java 17 or later (no `java` on PATH and no JAVA_HOME): "
        "install a JDK, e.g. apt-get install openjdk-17-jre-headless"
    )


# --------------------------------------------------------------------------------------------
# What the session is built with


@dataclass(frozen=True)
class SessionPlan:
    """The master, properties and executors' Python a session is built with, and why."""

    master: str
    master_source: str
    #: Properties to set on the builder (spark-submit's own are not repeated here).
    options: dict[str, str]
    python: str
    python_source: str
    submitted: bool = False
    warnings: tuple[str, ...] = ()

    @property
    def local(self) -> bool:
        return self.master.startswith("local")

    @property
    def standalone(self) -> bool:
        return self.master.startswith("spark://")


def session_plan(
    settings: SparkSettings,
    submitted: Mapping[str, str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    executable: str | None = None,
) -> SessionPlan:
    """Decide the master, the Spark properties and the executors' Python.

    ``submitted``: the properties spark-submit resolved when this process runs under
    ``spark-submit`` (None otherwise). Precedence, first wins:

    * master: spark-submit's (``--master``, ``--conf spark.master``, ``spark-defaults.conf``),
      then ``FAIRQUEUE_PIPELINE['SPARK']['MASTER']``, then ``local[2]``;
    * any other property: spark-submit's, then ``CONF``, then this module's defaults;
    * executors' Python: ``spark.pyspark.python`` (spark-submit's, then ``CONF``), then the
      ``PYSPARK_PYTHON`` environment variable, then this process's own interpreter.
    """
    environ = os.environ if environ is None else environ
    executable = executable or sys.executable
    notes: list[str] = []
    if submitted is not None:
        master = submitted.get("spark.master") or DEFAULT_MASTER
        source = "spark-submit"
        if settings.master_set and settings.master != master:
            notes.append(
                f"running under spark-submit with master {master}: "
                f"FAIRQUEUE_PIPELINE['SPARK']['MASTER'] ({settings.master}) is not used"
            )
    elif settings.master_set:
        master, source = settings.master, "FAIRQUEUE_PIPELINE['SPARK']['MASTER']"
    else:
        master, source = DEFAULT_MASTER, "the default"
    if master.startswith("spark://") and not master[len("spark://") :].strip(" ,"):
        raise ValueError(f"the Spark master URL {master!r} names no host")
    local = master.startswith("local")
    given = {**settings.conf, **(submitted or {})}

    python_key = "spark.pyspark.python"
    if submitted is not None and submitted.get(python_key):
        python, python_source = submitted[python_key], f"spark-submit's {python_key}"
    elif settings.conf.get(python_key):
        python, python_source = (
            settings.conf[python_key],
            f"FAIRQUEUE_PIPELINE['SPARK']['CONF'] {python_key}",
        )
    elif environ.get("PYSPARK_PYTHON"):
        python, python_source = environ["PYSPARK_PYTHON"], "PYSPARK_PYTHON"
    else:
        python, python_source = executable, "this process's interpreter (the default)"

    options = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.python.worker.reuse": "true",
        # Rows per Arrow batch from the JVM to the Python write tasks (default 10,000): fewer,
        # larger batches mean fewer CSV encodings and COPY writes per task.
        "spark.sql.execution.arrow.maxRecordsPerBatch": "100000",
        # PySpark records the Python call site of every DataFrame function it is given (six
        # round trips to the JVM and a walk of the stack each): built as Column objects, a
        # tenant's 200 formulas made ~32,000 such calls, seconds of CPU per tenant (formulas
        # now go to Spark as SQL text; a pipeline's own transform still builds Columns). The
        # pipeline reports formula errors itself: it needs no call sites in Spark's messages.
        "spark.python.sql.dataFrameDebugging.enabled": "false",
        python_key: python,
    }
    if local:
        options["spark.driver.host"] = "127.0.0.1"
        options["spark.driver.bindAddress"] = "127.0.0.1"
        java = " ".join(given.get(f"spark.driver.{k}JavaOptions", "") for k in ("extra", "default"))
        options.update(_local_java_options(java))
    if master.startswith("spark://") and settings.cores_max is not None:
        options["spark.cores.max"] = str(settings.cores_max)
    if settings.pools:
        options["spark.scheduler.mode"] = "FAIR"
    options.update(settings.conf)
    if given.get("spark.scheduler.mode", "FAIR").upper() != "FAIR" and settings.pools:
        notes.append(
            f"spark.scheduler.mode is {given['spark.scheduler.mode']}: channels get no Spark "
            "scheduler pools"
        )
    if submitted is not None:
        for key in list(options):
            if key in submitted:
                if key in settings.conf and settings.conf[key] != submitted[key]:
                    notes.append(
                        f"spark-submit sets {key}={submitted[key]}: "
                        f"FAIRQUEUE_PIPELINE['SPARK']['CONF'] ({settings.conf[key]}) is not used"
                    )
                del options[key]
    return SessionPlan(
        master=master,
        master_source=source,
        options=options,
        python=python,
        python_source=python_source,
        submitted=submitted is not None,
        warnings=tuple(notes),
    )


def _local_java_options(given: str) -> dict[str, str]:
    """The driver's Java options in local mode, where its JVM plans and runs the tasks; a
    collector the user's Java options (``given``) choose is left to them.

    The parallel collector: a batch job wants throughput, not short pauses; it used ~8% less
    CPU than G1 (the default) for the same formulas and JSON. Two collectors would stop the
    JVM from starting. The JIT is left as it is (C1, then C2 for hot code): limited to the
    client compiler (``-XX:TieredStopAtLevel=1``), a tenant of 250 realistic rules planned
    with about a tenth less CPU, but the rows ran Spark's generated code about 60% slower, and
    both a small run and a large one took longer (the performance page has the figures).
    """
    if re.search(r"-XX:\+Use\w*GC\b", given):
        return {}
    return {"spark.driver.defaultJavaOptions": "-XX:+UseParallelGC"}


def builder_options(settings: SparkSettings) -> dict[str, str]:
    """The Spark properties a session outside spark-submit is built with (CONF wins)."""
    return session_plan(settings).options


def check_master(master: str, timeout: float = MASTER_CONNECT_TIMEOUT) -> None:
    """Fail loudly unless a standalone master (``spark://h1:p1,h2:p2``) accepts connections.

    Other masters (``local``, ``yarn``, ``k8s://``) are left to Spark.
    """
    if not master.startswith("spark://"):
        return
    problems = []
    for address in master[len("spark://") :].split(","):
        address = address.strip().rstrip("/")
        host, sep, port_text = address.rpartition(":")
        if not sep or "]" in port_text:
            host, port_text = address, "7077"
        try:
            port = int(port_text)
        except ValueError:
            raise SparkClusterError(f"the Spark master URL {master!r} has a bad port") from None
        try:
            socket.create_connection((host.strip("[]"), port), timeout=timeout).close()
            return
        except OSError as exc:
            problems.append(f"{host}:{port}: {exc.strerror or exc}")
    raise SparkClusterError(
        f"cannot reach the Spark master {master} ({'; '.join(problems)}). Is it running? "
        "Start one, or fix the master URL (FAIRQUEUE_PIPELINE['SPARK']['MASTER'] or spark-submit's "
        "--master); the pipeline never falls back to local mode"
    )


def _submitted_properties() -> dict[str, str] | None:
    """spark-submit's resolved properties if this process runs under ``spark-submit``."""
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        return None  # PySpark starts its own gateway: no spark-submit around us
    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()
    return {str(k): str(v) for k, v in SparkConf().getAll()}


_ALLOCATION = """<?xml version="1.0"?>
<!-- django-fairqueue: each channel's batches get a pool of their own (named after the channel,
     with its weight) when their first batch runs; other jobs run in the default pool. -->
<allocations>
  <pool name="default">
    <schedulingMode>FIFO</schedulingMode>
    <weight>1</weight>
    <minShare>0</minShare>
  </pool>
</allocations>
"""


_lock = threading.Lock()
_session: Any = None
_plan: SessionPlan | None = None


def get_session() -> Any:
    """This process's SparkSession, built on first use and kept.

    Raises :class:`SparkClusterError` if the master cannot be reached or drops the
    application: never a session in local mode instead of the cluster asked for.
    """
    global _session, _plan
    with _lock:
        if _session is not None:
            return _session
        require_pyspark()
        require_java()
        from pyspark.sql import SparkSession

        settings = spark_settings()
        # pyspark 4 warns on each Arrow API call that it does not fully support pandas 3
        # (installed by pyspark[sql]); the pipeline's Arrow path uses no pandas.
        warnings.filterwarnings("ignore", "PySpark does not yet fully support pandas")
        submitted = _submitted_properties()
        plan = session_plan(settings, submitted)
        for note in plan.warnings:
            logger.warning("%s", note)
        check_master(plan.master)
        if plan.local and os.sep in plan.python and not os.access(plan.python, os.X_OK):
            raise SparkClusterError(
                f"the executors' Python {plan.python} (from {plan.python_source}) is not an "
                "executable file"
            )
        # PySpark hands its tasks the interpreter named by PYSPARK_PYTHON, whatever the Spark
        # properties say: set it from the plan (spark-submit does the same for its drivers).
        os.environ["PYSPARK_PYTHON"] = plan.python
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        builder = SparkSession.builder.appName(settings.app_name)
        if not plan.submitted:
            builder = builder.master(plan.master)
        allocation = None
        options = dict(plan.options)
        mode = options.get("spark.scheduler.mode") or (submitted or {}).get("spark.scheduler.mode")
        if mode == "FAIR" and "spark.scheduler.allocation.file" not in {
            **options,
            **(submitted or {}),
        }:
            fd, allocation = tempfile.mkstemp(prefix="fairqueue-pools-", suffix=".xml")
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(_ALLOCATION)
            options["spark.scheduler.allocation.file"] = allocation
        for key, value in options.items():
            builder = builder.config(key, value)
        try:
            session = builder.getOrCreate()
        finally:
            if allocation is not None:
                os.unlink(allocation)  # read once, when the scheduler starts
        session.sparkContext.setLogLevel("ERROR")
        if session.sparkContext._jsc.sc().isStopped():
            session.stop()
            raise SparkClusterError(
                f"the Spark master {plan.master} did not keep the application (it stopped while "
                "starting: see the log above for the master's reason)"
            )
        _session, _plan = session, plan
        logger.info("%s", describe_session(session))
        return _session


def current_session() -> Any:
    """This process's SparkSession if one was built or given, else None (never builds one)."""
    return _session


def use_session(session: Any) -> None:
    """Use an existing SparkSession (tests, notebooks, ``spark-submit`` drivers)."""
    global _session, _plan
    with _lock:
        _session = session
        _plan = None


def stop_session() -> None:
    global _session, _plan
    with _lock:
        if _session is not None:
            _session.stop()
            _session = None
            _plan = None


def executor_ids(session: Any) -> list[str]:
    """The ids of the session's executors (empty in local mode, where the driver runs tasks)."""
    try:
        text = str(session.sparkContext._jsc.sc().getExecutorIds().mkString(","))
    except Exception:
        return []
    return [part for part in text.split(",") if part]


def describe_session(session: Any) -> str:
    """One line: the effective master and where it came from, the application, the executors'
    Python, cores, scheduler mode."""
    context = session.sparkContext
    spark_conf = context.getConf()
    plan = _plan if session is _session else None
    source = f" (from {plan.master_source})" if plan is not None else ""
    python = str(getattr(context, "pythonExec", "?"))
    python_source = f" (from {plan.python_source})" if plan is not None else ""
    parts = [
        f"Spark master {context.master}{source}",
        f"application {context.applicationId}",
        f"executors' Python {python}{python_source}",
        f"scheduler {spark_conf.get('spark.scheduler.mode', 'FIFO')}",
    ]
    if context.master.startswith("spark://"):
        parts.append(f"spark.cores.max {spark_conf.get('spark.cores.max', 'unlimited')}")
        ids = executor_ids(session)
        parts.append(f"executors {', '.join(ids) if ids else 'none yet'}")
    return "; ".join(parts)


def jvm_peak_rss_bytes() -> int:
    """Peak resident memory of this process's JVM (local mode), 0 if unknown."""
    session = _session
    if session is None:
        return 0
    try:
        pid = int(session.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
    except Exception:
        return 0
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


# --------------------------------------------------------------------------------------------
# How executors reach the database


#: Connection parameters that name a file; made absolute (the executors' working directory is
#: not the driver's).
_FILE_PARAMETERS = ("sslcert", "sslkey", "sslrootcert", "sslcrl", "sslcrldir", "passfile")


@functools.cache
def _libpq_keywords() -> frozenset[str]:
    from psycopg import pq

    return frozenset(option.keyword.decode() for option in pq.Conninfo.get_defaults())


def conninfo_from_params(params: Mapping[str, Any], *, connect_timeout: float | None) -> str:
    """A libpq connection string keeping every libpq parameter of ``params`` (Django's
    ``get_connection_params()``: host, port, dbname, user, password and every OPTIONS entry that
    libpq knows, e.g. ``sslmode``, ``sslcert``, ``options``, ``application_name``,
    ``connect_timeout``); Python-only ones (``cursor_factory``, ``context``, ...) are dropped.
    """
    import psycopg

    keywords = _libpq_keywords()
    flat: dict[str, Any] = {}
    for key, value in params.items():
        if key not in keywords or value is None or value == "":
            continue
        if key in _FILE_PARAMETERS and isinstance(value, str) and value != "system":
            value = os.path.abspath(os.path.expanduser(value))
        flat[key] = value
    if connect_timeout is not None and "connect_timeout" not in flat:
        flat["connect_timeout"] = int(connect_timeout)
    return psycopg.conninfo.make_conninfo("", **flat)


def executor_conninfo(alias: str) -> str:
    """How Spark tasks connect to the database ``alias``.

    ``EXECUTOR_DATABASE_URL`` if set (as given), else the Django database's own parameters
    with every libpq option; either way with ``connect_timeout`` =
    ``EXECUTOR_CONNECT_TIMEOUT`` unless it names one.
    """
    import psycopg

    settings = spark_settings()
    timeout = settings.executor_connect_timeout
    if settings.executor_database_url:
        url = settings.executor_database_url
        if "connect_timeout" in psycopg.conninfo.conninfo_to_dict(url):
            return url
        return psycopg.conninfo.make_conninfo(url, connect_timeout=int(timeout))
    from django.db import connections

    return conninfo_from_params(connections[alias].get_connection_params(), connect_timeout=timeout)

"""The worker's long-lived SparkSession, configured from ``FAIRQUEUE['SPARK']``.

Starting a session costs seconds (5-6 s on a 2-core machine) and an idle one holds ~550 MB, so a
process builds one on first use and keeps it: never one per batch.

``FAIRQUEUE['SPARK']`` keys (all optional):

``MASTER``
    Spark master URL; default ``local[2]``. ``spark://host:7077``, ``yarn``, ``k8s://...`` run
    the batches' tasks on a cluster.
``CONF``
    Extra Spark properties, e.g. ``{"spark.executor.memory": "4g"}``.
``APP_NAME``
    Default ``django-fairqueue``.
``PARTITIONS``
    Sub-ranges (Spark tasks) per batch; default: the session's default parallelism.
``EXECUTOR_DATABASE_URL``
    How executors reach the database when that differs from the driver's settings (a libpq URL
    or connection string); default: the Django database's own parameters.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

from django_fairqueue import conf

INSTALL_HINT = "pip install 'django-fairqueue[spark]'"
_KEYS = {"MASTER", "CONF", "APP_NAME", "PARTITIONS", "EXECUTOR_DATABASE_URL"}


class SparkUnavailable(RuntimeError):
    """PySpark (or Java) is missing: the message says how to install it."""


@dataclass(frozen=True)
class SparkSettings:
    master: str = "local[2]"
    conf: dict[str, str] = field(default_factory=dict)
    app_name: str = "django-fairqueue"
    partitions: int | None = None
    executor_database_url: str | None = None

    @property
    def local(self) -> bool:
        return self.master.startswith("local")


def spark_settings() -> SparkSettings:
    """``FAIRQUEUE['SPARK']`` checked; ``ValueError`` names a bad entry."""
    raw = conf.get().SPARK
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ValueError(f"FAIRQUEUE['SPARK'] has unknown keys {unknown}; known: {sorted(_KEYS)}")
    master = raw.get("MASTER", "local[2]")
    if not isinstance(master, str) or not master.strip():
        raise ValueError("FAIRQUEUE['SPARK']['MASTER'] must be a Spark master URL")
    extra = raw.get("CONF", {})
    if not isinstance(extra, dict):
        raise ValueError("FAIRQUEUE['SPARK']['CONF'] must be a dict of Spark properties")
    partitions = raw.get("PARTITIONS")
    if partitions is not None and (
        isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1
    ):
        raise ValueError("FAIRQUEUE['SPARK']['PARTITIONS'] must be an integer >= 1")
    url = raw.get("EXECUTOR_DATABASE_URL")
    if url is not None and not isinstance(url, str):
        raise ValueError("FAIRQUEUE['SPARK']['EXECUTOR_DATABASE_URL'] must be a string")
    return SparkSettings(
        master=master,
        conf={str(k): str(v) for k, v in extra.items()},
        app_name=str(raw.get("APP_NAME", "django-fairqueue")),
        partitions=partitions,
        executor_database_url=url,
    )


def require_pyspark() -> None:
    """Raise :class:`SparkUnavailable` (with how to install) unless PySpark and pyarrow import."""
    try:
        import pyarrow  # noqa: F401
        import pyspark  # noqa: F401
    except ImportError as exc:
        raise SparkUnavailable(
            f"the Spark pipeline needs PySpark and pyarrow ({exc.name} is not installed): "
            f"{INSTALL_HINT}"
        ) from None


def require_java() -> None:
    if os.environ.get("JAVA_HOME") or shutil.which("java"):
        return
    raise SparkUnavailable(
        "the Spark pipeline needs Java 17 or later (no `java` on PATH and no JAVA_HOME): "
        "install a JDK, e.g. apt-get install openjdk-17-jre-headless"
    )


_lock = threading.Lock()
_session: Any = None


def builder_options(settings: SparkSettings) -> dict[str, str]:
    """The Spark properties the session is built with (settings' CONF wins)."""
    options = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.python.worker.reuse": "true",
        # Rows per Arrow batch from the JVM to the Python write tasks (default 10,000): fewer,
        # larger batches mean fewer CSV encodings and COPY writes per task.
        "spark.sql.execution.arrow.maxRecordsPerBatch": "100000",
    }
    if settings.local:
        options["spark.driver.host"] = "127.0.0.1"
        options["spark.driver.bindAddress"] = "127.0.0.1"
    options.update(settings.conf)
    return options


def get_session() -> Any:
    """This process's SparkSession, built on first use and kept."""
    global _session
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
        # Executors (and the local mode's Python workers) run this interpreter, with this
        # virtualenv's packages, not the system python3.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        builder = SparkSession.builder.master(settings.master).appName(settings.app_name)
        for key, value in builder_options(settings).items():
            builder = builder.config(key, value)
        _session = builder.getOrCreate()
        _session.sparkContext.setLogLevel("ERROR")
        return _session


def use_session(session: Any) -> None:
    """Use an existing SparkSession (tests, notebooks, ``spark-submit`` drivers)."""
    global _session
    with _lock:
        _session = session


def stop_session() -> None:
    global _session
    with _lock:
        if _session is not None:
            _session.stop()
            _session = None


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

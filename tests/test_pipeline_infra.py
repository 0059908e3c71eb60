"""The Spark pipeline's infrastructure: which master and Python, executors' connections,
infrastructure errors against data errors, and the FAIR scheduler pools.

Spark tests share the session of tests/test_pipeline.py (local[1]); the standalone cluster
test is tests/test_spark_standalone.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import connections

from django_fairqueue import batches
from django_fairqueue.contrib.pipeline import batch_run, cluster, execute
from django_fairqueue.contrib.pipeline import spark as spark_module
from django_fairqueue.contrib.pipeline.core import Pipeline, registry
from django_fairqueue.contrib.pipeline.runner import PipelineRunner, plan
from django_fairqueue.contrib.pipeline.spark import (
    SparkClusterError,
    SparkSettings,
    check_master,
    conninfo_from_params,
    session_plan,
)
from django_fairqueue.models import Channel, WorkBatch
from tests import test_pipeline as base
from tests.pipelineapp.models import DataRow, ResultRow
from tests.test_pipeline import (
    PIPELINE,
    SPARK_SETTINGS,
    make_rows,
    needs_spark,
    run_until_done,
)
from tests.workerkit import wait_until

# tests/test_pipeline.py's fixtures: its one SparkSession (a process has one SparkContext).
spark = base.spark
spark_settings = base.spark_settings
formulas = base.formulas
unregister = base.unregister


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------------------------
# Which master, which properties, which Python (no Spark needed)


def test_outside_spark_submit_the_settings_master_is_used_with_sane_defaults() -> None:
    default = session_plan(SparkSettings(), environ={}, executable="/venv/bin/python")
    assert (default.master, default.master_source) == ("local[2]", "the default")
    assert default.python == "/venv/bin/python"
    assert default.options["spark.pyspark.python"] == "/venv/bin/python"
    assert default.options["spark.scheduler.mode"] == "FAIR"
    assert "spark.cores.max" not in default.options  # local mode has no cores to share
    # the parallel collector; the JIT as the JVM has it (the client compiler alone slowed
    # the rows far more than it saved in planning)
    assert default.options["spark.driver.defaultJavaOptions"] == "-XX:+UseParallelGC"

    cluster_settings = SparkSettings(master="spark://m:7077", master_set=True)
    planned = session_plan(cluster_settings, environ={}, executable="/venv/bin/python")
    assert (planned.master, planned.master_source) == (
        "spark://m:7077",
        "FAIRQUEUE_PIPELINE['SPARK']['MASTER']",
    )
    assert planned.options["spark.cores.max"] == "2"  # a default, so drivers share a cluster
    assert "spark.driver.host" not in planned.options
    assert "spark.driver.defaultJavaOptions" not in planned.options  # the tasks run elsewhere
    assert not planned.warnings


def test_the_driver_s_java_options_chosen_by_the_user_win_over_the_local_defaults() -> None:
    def java(conf: dict[str, str]) -> str | None:
        return session_plan(SparkSettings(conf=conf), environ={}).options.get(
            "spark.driver.defaultJavaOptions"
        )

    # A collector chosen in the Java options wins: two would stop the JVM from starting.
    assert java({"spark.driver.extraJavaOptions": "-Xss4m -XX:+UseSerialGC"}) is None
    assert java({"spark.driver.extraJavaOptions": "-XX:+UseG1GC -XX:TieredStopAtLevel=1"}) is None
    # Other options, a choice of JIT compilers among them, keep the parallel collector.
    assert java({"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1"}) == (
        "-XX:+UseParallelGC"
    )
    # The user's own default Java options replace ours whole.
    assert java({"spark.driver.defaultJavaOptions": "-Xmx2g"}) == "-Xmx2g"


def test_spark_submit_s_master_and_properties_win_and_a_disagreement_is_a_warning() -> None:
    settings = SparkSettings(
        master="local[2]",
        master_set=True,
        conf={"spark.executor.memory": "4g", "spark.sql.shuffle.partitions": "3"},
    )
    submitted = {
        "spark.master": "spark://m:7077",
        "spark.executor.memory": "8g",
        "spark.pyspark.python": "/opt/venv/bin/python",
    }

    planned = session_plan(settings, submitted, environ={"PYSPARK_PYTHON": "/usr/bin/python3"})

    assert (planned.master, planned.master_source) == ("spark://m:7077", "spark-submit")
    assert planned.submitted
    # spark-submit's properties are not set again (the builder would override them).
    assert "spark.executor.memory" not in planned.options
    assert "spark.pyspark.python" not in planned.options
    assert planned.options["spark.sql.shuffle.partitions"] == "3"
    assert (planned.python, planned.python_source) == (
        "/opt/venv/bin/python",
        "spark-submit's spark.pyspark.python",
    )
    assert planned.warnings == (
        "running under spark-submit with master spark://m:7077: "
        "FAIRQUEUE_PIPELINE['SPARK']['MASTER'] (local[2]) is not used",
        "spark-submit sets spark.executor.memory=8g: "
        "FAIRQUEUE_PIPELINE['SPARK']['CONF'] (4g) is not used",
    )


def test_the_executors_python_is_chosen_in_a_documented_order() -> None:
    env = {"PYSPARK_PYTHON": "/env/python"}
    in_conf = SparkSettings(conf={"spark.pyspark.python": "/conf/python"})
    assert session_plan(in_conf, environ=env, executable="/me").python == "/conf/python"
    assert session_plan(SparkSettings(), environ=env, executable="/me").python == "/env/python"
    assert session_plan(SparkSettings(), environ={}, executable="/me").python == "/me"


@pytest.mark.parametrize(
    ("spark_conf", "message"),
    [
        ({"CONF": {"spark.master": "local"}}, "must not set spark.master"),
        ({"CORES_MAX": 0}, "CORES_MAX"),
        ({"POOLS": "yes"}, "POOLS"),
        ({"PAUSE_SECONDS": 10, "PAUSE_MAX_SECONDS": 5}, "PAUSE_MAX_SECONDS"),
        ({"EXECUTOR_TIMEOUT": -1}, "EXECUTOR_TIMEOUT"),
    ],
)
def test_bad_spark_settings_are_named(
    settings: Any, spark_conf: dict[str, Any], message: str
) -> None:
    settings.FAIRQUEUE_PIPELINE = {"SPARK": spark_conf}
    with pytest.raises(ValueError, match=message):
        spark_module.spark_settings()


def test_cores_max_defaults_to_the_partitions_and_can_be_lifted(settings: Any) -> None:
    settings.FAIRQUEUE_PIPELINE = {"SPARK": {"PARTITIONS": 3}}
    assert spark_module.spark_settings().cores_max == 3
    settings.FAIRQUEUE_PIPELINE = {"SPARK": {"CORES_MAX": None}}
    lifted = spark_module.spark_settings()
    assert lifted.cores_max is None
    assert (
        "spark.cores.max"
        not in session_plan(
            SparkSettings(master="spark://m:7077", master_set=True, cores_max=None)
        ).options
    )


def test_an_unreachable_master_fails_loudly_before_spark_starts() -> None:
    port = free_port()  # nothing listens there
    master = f"spark://127.0.0.1:{port}"
    with pytest.raises(SparkClusterError, match=rf"cannot reach the Spark master {master}"):
        check_master(master, timeout=2)


def test_the_run_command_refuses_an_unreachable_master(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The command checks that PySpark is installed first: without it, it says so instead.
    pytest.importorskip("pyspark")
    pytest.importorskip("pyarrow")
    master = f"spark://127.0.0.1:{free_port()}"
    settings.FAIRQUEUE_PIPELINE = {"SPARK": {"MASTER": master}}
    monkeypatch.setattr(spark_module, "_session", None)  # no session of this process in the way
    with pytest.raises(
        CommandError, match=r"cannot reach the Spark master .*never falls back to local"
    ):
        call_command("fairpipeline", "run", "--burst")


def test_a_master_on_any_of_its_addresses_is_reachable() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        check_master(f"spark://127.0.0.1:{free_port()},127.0.0.1:{port}", timeout=2)


# --------------------------------------------------------------------------------------------
# How executors connect


def test_executors_connections_keep_every_libpq_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # relative file paths resolve against the driver's directory
    dsn = conninfo_from_params(
        {
            "dbname": "app",
            "user": "u",
            "password": "p w",
            "host": "db.internal",
            "port": 6432,
            "connect_timeout": 7,
            "sslmode": "verify-full",
            "sslcert": "certs/client.crt",
            "sslkey": "/etc/keys/client.key",
            "sslrootcert": "system",
            "options": "-c statement_timeout=5000",
            "application_name": "reports",
            "target_session_attrs": "read-write",
            "client_encoding": "UTF8",
            # Django's Python-side parameters: not libpq's.
            "cursor_factory": object,
            "context": object(),
            "prepare_threshold": None,
        },
        connect_timeout=10,
    )

    assert psycopg.conninfo.conninfo_to_dict(dsn) == {
        "dbname": "app",
        "user": "u",
        "password": "p w",
        "host": "db.internal",
        "port": "6432",
        "connect_timeout": "7",  # the database's own, not the default
        "sslmode": "verify-full",
        "sslcert": str(tmp_path / "certs" / "client.crt"),  # absolute: executors' cwd differs
        "sslkey": "/etc/keys/client.key",
        "sslrootcert": "system",
        "options": "-c statement_timeout=5000",
        "application_name": "reports",
        "target_session_attrs": "read-write",
        "client_encoding": "UTF8",
    }
    without = conninfo_from_params({"dbname": "app"}, connect_timeout=10)
    assert psycopg.conninfo.conninfo_to_dict(without) == {"dbname": "app", "connect_timeout": "10"}


def _settings_seen_by_executor(conninfo: str, rows: Iterator[Any]) -> Iterator[tuple[str, str]]:
    import psycopg

    for _ in rows:
        pass
    with psycopg.connect(conninfo) as conn:
        for name in ("application_name", "statement_timeout"):
            (value,) = conn.execute(f"SELECT current_setting('{name}')").fetchone() or ("",)
            yield (name, value)


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_executors_connect_with_the_databases_options(
    spark: Any, spark_settings: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from functools import partial

    from pyspark import cloudpickle

    options = connections["default"].settings_dict["OPTIONS"]
    monkeypatch.setitem(options, "application_name", "fq-executors")
    monkeypatch.setitem(options, "options", "-c statement_timeout=4321")
    monkeypatch.setitem(options, "connect_timeout", 5)
    conninfo = execute.executor_conninfo("default")
    assert psycopg.conninfo.conninfo_to_dict(conninfo)["connect_timeout"] == "5"

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        seen = dict(
            spark.sparkContext.parallelize([0], 1)
            .mapPartitions(partial(_settings_seen_by_executor, conninfo))
            .collect()
        )
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert seen == {"application_name": "fq-executors", "statement_timeout": "4321ms"}


# --------------------------------------------------------------------------------------------
# Infrastructure errors against data errors


def test_errors_are_classified_from_what_spark_and_psycopg_raise() -> None:
    from django.db.utils import OperationalError

    port = free_port()
    with pytest.raises(psycopg.OperationalError) as refused:
        psycopg.connect(f"host=127.0.0.1 port={port} dbname=x connect_timeout=2")
    error = cluster.infrastructure_error(refused.value)
    assert error is not None
    assert error.kind == cluster.DRIVER_DATABASE
    try:
        raise OperationalError("wrapped") from refused.value  # as Django raises it
    except OperationalError as wrapped:
        assert cluster.infrastructure_error(wrapped) is not None

    executor_traceback = (
        "An exception was thrown from the Python worker:\nTraceback (most recent call last):\n"
        '  File "datastore.py", line 350, in read_sub_ranges\n'
        "psycopg.OperationalError: connection failed: connection to server at "
        '"10.0.0.5", port 5432 failed: Connection refused\n'
    )
    found = cluster.infrastructure_error(RuntimeError(executor_traceback))
    assert found is not None
    assert found.kind == cluster.EXECUTOR_DATABASE
    assert found.detail.startswith("psycopg.OperationalError: connection failed")
    admin = cluster.infrastructure_error(
        RuntimeError("psycopg.errors.AdminShutdown: terminating connection due to administrator")
    )
    assert admin is not None
    assert admin.kind == cluster.EXECUTOR_DATABASE
    lost = cluster.infrastructure_error(
        RuntimeError(
            "Job aborted due to stage failure: Task 1 in stage 7.0 failed 4 times, most recent "
            "failure: Lost task 1.3 in stage 7.0 (TID 31) (10.0.0.7 executor 2): "
            "ExecutorLostFailure (executor 2 exited caused by one of the running tasks) Reason: "
            "Remote RPC client disassociated."
        )
    )
    assert lost is not None
    assert lost.kind == cluster.EXECUTORS_LOST
    python = cluster.infrastructure_error(
        RuntimeError(
            "Lost task 0.3 in stage 2.0 (TID 11) (127.0.0.1 executor 0): java.io.IOException: "
            'Cannot run program "/opt/venv/bin/python": error=2, No such file or directory'
        )
    )
    assert python is not None
    assert python.kind == cluster.EXECUTOR_PYTHON
    assert "spark.pyspark.python" in str(python)

    # Data and formula errors are not the infrastructure's.
    for data_error in (
        "[DIVIDE_BY_ZERO] Division by zero. Use `try_divide` to tolerate divisor being 0",
        "ZeroDivisionError: division by zero",
        'psycopg.errors.UniqueViolation: duplicate key value violates unique constraint "k"',
        "psycopg.errors.NumericValueOutOfRange: numeric field overflow",
        "psycopg.errors.QueryCanceled: canceling statement due to statement timeout",
        "[CAST_INVALID_INPUT] The value 'x' of the type STRING cannot be cast to INT",
    ):
        assert cluster.infrastructure_error(RuntimeError(data_error)) is None, data_error
    assert cluster.infrastructure_error(psycopg.errors.QueryCanceled("timeout")) is None


class Proxy:
    """A TCP proxy to PostgreSQL that can be taken down and brought back on the same port."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self.accepted = 0
        self.allow: int | None = None  # connections accepted before going down by itself
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.up()

    def up(self, allow: int | None = None) -> None:
        with self._lock:
            self.allow = None if allow is None else self.accepted + allow
            if self._listener is not None:
                return
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(16)
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._sockets = self._sockets, []
        if listener is not None:
            listener.close()
        for sock in sockets:
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            with self._lock:
                self._sockets += [client, server]
                self.accepted += 1
                last = self.allow is not None and self.accepted >= self.allow
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()
            if last:
                with self._lock:
                    if self._listener is listener:
                        self._listener = None
                listener.close()  # later connections are refused
                return

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def _proxied_conninfo(proxy: Proxy) -> str:
    params = dict(connections["default"].get_connection_params())
    params.update(host="127.0.0.1", port=proxy.port)
    return conninfo_from_params(params, connect_timeout=3)


def _runner_thread(runner: PipelineRunner) -> threading.Thread:
    thread = threading.Thread(target=runner.run, name="test-pipeline-runner", daemon=True)
    thread.start()
    return thread


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_the_database_unreachable_from_executors_pauses_the_runner_and_uses_no_attempt(
    spark: Any,
    settings: Any,
    formulas: dict[str, list[str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    db = connections["default"].get_connection_params()
    proxy = Proxy((db.get("host") or "127.0.0.1", int(db.get("port") or 5432)))
    settings.FAIRQUEUE = {**settings.FAIRQUEUE, "RETRY_BACKOFF_BASE": 0.0, "LEASE_SECONDS": 30.0}
    settings.FAIRQUEUE_PIPELINE = {
        "SPARK": {
            **SPARK_SETTINGS,
            "EXECUTOR_DATABASE_URL": _proxied_conninfo(proxy),
            "PAUSE_SECONDS": 0.2,
            "PAUSE_MAX_SECONDS": 0.5,
        },
    }
    make_rows(10)
    plan(PIPELINE, tenants=["alice"])
    (batch_id,) = WorkBatch.objects.values_list("id", flat=True)
    cluster.forget()
    # The executors' check (one connection) passes; then the database is gone for the tasks.
    proxy.up(allow=1)
    runner = PipelineRunner(worker_id="infra", pipelines=[PIPELINE], spark=spark, poll_interval=0.1)
    caplog.set_level(logging.INFO, logger="django_fairqueue.contrib.pipeline")
    thread = _runner_thread(runner)
    try:
        wait_until(lambda: runner.stats.paused >= 3, timeout=120, what="three pauses")
        assert runner.stats.released == 1  # the batch, given back after its tasks failed
        assert runner.stats.failed == 0
        assert runner.paused_by is not None
        assert runner.paused_by.kind == cluster.EXECUTOR_DATABASE
        assert "Connection refused" in runner.paused_by.detail
        row = WorkBatch.objects.get(pk=batch_id)
        assert (row.state, row.attempts) == ("pending", 0)
        assert not ResultRow.objects.exists()
        logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any(
            "paused for" in m and "the executors cannot reach the database" in m for m in logged
        ), logged

        proxy.up()  # the database is back: the next check passes and the batch runs
        wait_until(
            lambda: WorkBatch.objects.get(pk=batch_id).state == "succeeded",
            timeout=120,
            what="the batch done once the database is back",
        )
    finally:
        runner.stop()
        thread.join(60)
        proxy.down()
    assert not thread.is_alive()
    row = WorkBatch.objects.get(pk=batch_id)
    assert row.attempts == 1  # the infrastructure's failures used none
    assert ResultRow.objects.count() == 10
    assert runner.paused_by is None
    assert any("resumed" in r.getMessage() for r in caplog.records)


def reads_waiting(watch: psycopg.Connection[Any], table: str) -> bool:
    """Whether a session waits on a lock with a statement naming ``table`` (a Spark task's
    read of the source, held by the test's lock). ``watch`` is in autocommit: in a
    transaction, pg_stat_activity would show the same snapshot every time."""
    found = watch.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND query ILIKE %s AND pid <> pg_backend_pid()",
        (f"%{table}%",),
    ).fetchone()
    return bool(found and found[0])


class _FakeSession:
    """What :class:`cluster.Watchdog` reads of a session: the master, whether the context
    stopped, the executors' ids (a test sets ``executors``)."""

    def __init__(self, master: str) -> None:
        self.executors: list[str] = ["0"]
        self.stopped = False
        jsc_sc = SimpleNamespace(
            isStopped=lambda: self.stopped,
            getExecutorIds=lambda: SimpleNamespace(mkString=lambda sep: sep.join(self.executors)),
        )
        self.sparkContext = SimpleNamespace(
            master=master, applicationId="app-test", _jsc=SimpleNamespace(sc=lambda: jsc_sc)
        )


def test_after_a_stop_the_watcher_also_cancels_a_spark_job_the_batch_starts_later() -> None:
    """The stop may come while the driver still plans the batch's job: the watcher cancels
    the runner's jobs at every look until the batch ends, not once."""
    cancelled: list[str] = []
    session = SimpleNamespace(sparkContext=SimpleNamespace(cancelJobsWithTag=cancelled.append))
    runner = PipelineRunner(worker_id="w", spark=session)
    runner.stop()
    watchdog = SimpleNamespace(look=lambda: None)
    batch = SimpleNamespace(id=1, job_name="j")
    watcher = threading.Thread(target=runner._watch, args=(batch, threading.Event(), watchdog))
    watcher.start()
    try:
        wait_until(lambda: len(cancelled) >= 3, timeout=10, what="a cancel at every look")
    finally:
        runner._finished.set()  # the batch ended
        watcher.join(10)
    assert not watcher.is_alive()
    assert set(cancelled) == {runner._tag}


def test_the_watchdog_sees_an_application_without_executors_and_a_master_gone() -> None:
    now = [0.0]
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        up = f"spark://127.0.0.1:{listener.getsockname()[1]}"
        session = _FakeSession(up)
        watchdog = cluster.Watchdog(session, executor_timeout=30, clock=lambda: now[0])

        def look_until(seconds: float) -> cluster.InfrastructureError | None:
            while now[0] < seconds:
                now[0] += 0.25
                seen = watchdog.look()
                if seen is not None:
                    return seen
            return None

        assert look_until(60) is None  # executors, and the master answers
        session.executors = []  # the executors are gone: the job would wait for ever
        assert look_until(89) is None
        seen = look_until(91)
        assert seen is not None and seen.kind == cluster.NO_EXECUTORS
        assert "app-test has had no executor for 30 s (EXECUTOR_TIMEOUT 30 s)" in seen.detail
        assert cluster.NO_EXECUTORS in cluster.REBUILD_KINDS
    finally:
        listener.close()

    # A master that refuses connections: gone at the second miss in a row (2 s apart).
    gone = _FakeSession(f"spark://127.0.0.1:{free_port()}")
    now[0] = 0.0
    watchdog = cluster.Watchdog(gone, executor_timeout=30, clock=lambda: now[0])
    found = []
    while not found and now[0] < 10:
        now[0] += 0.25
        found = [outage for outage in [watchdog.look()] if outage is not None]
    assert [o.kind for o in found] == [cluster.MASTER_LOST]
    assert 4 <= now[0] <= 5
    assert "cannot reach the Spark master" in found[0].detail
    assert cluster.MASTER_LOST in cluster.REBUILD_KINDS

    # Local mode has no executors to lose: only a stopped context is an outage.
    local = _FakeSession("local[2]")
    local.executors = []
    now[0] = 0.0
    watchdog = cluster.Watchdog(local, executor_timeout=1, clock=lambda: now[0])
    for _ in range(40):
        now[0] += 0.25
        assert watchdog.look() is None
    local.stopped = True
    now[0] += 1
    stopped = watchdog.look()
    assert stopped is not None and stopped.kind == cluster.SESSION_STOPPED


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_an_outage_under_a_running_batch_cancels_its_job_and_gives_it_back_without_an_attempt(
    spark: Any,
    settings: Any,
    formulas: dict[str, list[str]],
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The runner's side of an outage: the batch's Spark task is held mid-batch (its read of
    the source waits on a lock the test holds), the watchdog reports an outage, and the job is
    cancelled, the batch given back unspent, and run again after the pause.
    (tests/test_spark_outage.py kills a real standalone cluster.)"""
    settings.FAIRQUEUE = {**settings.FAIRQUEUE, "RETRY_BACKOFF_BASE": 0.0, "LEASE_SECONDS": 30.0}
    settings.FAIRQUEUE_PIPELINE = {
        "SPARK": {**SPARK_SETTINGS, "PAUSE_SECONDS": 0.2, "PAUSE_MAX_SECONDS": 0.5}
    }
    make_rows(10)
    plan(PIPELINE, tenants=["alice"])
    (batch_id,) = WorkBatch.objects.values_list("id", flat=True)
    table = DataRow._meta.db_table
    held = threading.Event()
    outages: list[cluster.InfrastructureError] = []

    def look(self: cluster.Watchdog) -> cluster.InfrastructureError | None:
        if not held.is_set() or outages:
            return None
        outages.append(
            cluster.InfrastructureError(cluster.NO_EXECUTORS, "application app-x has had none")
        )
        return outages[0]

    monkeypatch.setattr(cluster.Watchdog, "look", look)
    cluster.forget()
    runner = PipelineRunner(worker_id="infra", pipelines=[PIPELINE], spark=spark, poll_interval=0.1)
    caplog.set_level(logging.INFO, logger="django_fairqueue.pipeline")
    lock = psycopg.connect(database_url)
    thread = None
    try:
        lock.execute(f'LOCK TABLE "{table}" IN ACCESS EXCLUSIVE MODE')
        thread = _runner_thread(runner)
        with psycopg.connect(database_url, autocommit=True) as watch:
            wait_until(
                lambda: reads_waiting(watch, table),
                timeout=300,
                what="the batch's task waiting on the source",
            )
        held.set()
        wait_until(lambda: runner.stats.released == 1, timeout=120, what="the batch given back")
        row = WorkBatch.objects.get(pk=batch_id)
        assert (row.state, row.attempts) in {("pending", 0), ("running", 1)}  # maybe run again
        lock.commit()
        wait_until(
            lambda: WorkBatch.objects.get(pk=batch_id).state == "succeeded",
            timeout=300,
            what="the batch done after the pause",
        )
    finally:
        lock.close()
        runner.stop()
        if thread is not None:
            thread.join(60)
    row = WorkBatch.objects.get(pk=batch_id)
    assert (row.attempts, row.last_error) == (1, None)
    assert (runner.stats.failed, runner.stats.paused, runner.stats.succeeded) == (0, 1, 1)
    assert ResultRow.objects.count() == 10
    messages = [r.getMessage() for r in caplog.records]
    assert any("no Spark executors" in m and "cancelling its Spark job" in m for m in messages)
    assert any("given back, no attempt used: no Spark executors" in m for m in messages)
    assert any("resumed" in m for m in messages)


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_missing_executor_python_gives_the_batch_back_and_stops_a_burst_run(
    spark: Any,
    spark_settings: None,
    formulas: dict[str, list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    make_rows(10)
    plan(PIPELINE, tenants=["alice"])
    cluster.forget()
    runner = PipelineRunner(worker_id="infra", pipelines=[PIPELINE], spark=spark, burst=True)
    runner._check()  # the executors' check passes with the right Python
    # Then the executors' Python is gone (PySpark hands each job the interpreter it names;
    # a job's cached plan holds the one it was built with).
    monkeypatch.setattr(execute.plans, "_plans", {})
    monkeypatch.setattr(spark.sparkContext, "pythonExec", "/nonexistent/venv/bin/python3")

    with pytest.raises(cluster.InfrastructureError) as caught:
        runner.run()

    assert caught.value.kind == cluster.EXECUTOR_PYTHON
    assert 'Cannot run program "/nonexistent/venv/bin/python3"' in str(caught.value)
    assert "spark.pyspark.python" in str(caught.value)
    row = WorkBatch.objects.get()
    assert (row.state, row.attempts) == ("pending", 0)
    assert (runner.stats.released, runner.stats.failed, runner.stats.paused) == (1, 0, 1)

    # A run that starts with the wrong Python claims nothing: the check fails first.
    with pytest.raises(cluster.InfrastructureError, match="Cannot run program"):
        PipelineRunner(worker_id="infra", pipelines=[PIPELINE], spark=spark, burst=True).run()
    assert WorkBatch.objects.get().attempts == 0

    monkeypatch.undo()
    run_until_done(spark)
    assert WorkBatch.objects.get().attempts == 1


def _other_python() -> str | None:
    """An interpreter of another minor version than this one, if the machine has one."""
    import glob
    import shutil

    for minor in ("3.13", "3.12", "3.11", "3.10"):
        if minor == f"{sys.version_info[0]}.{sys.version_info[1]}":
            continue
        found = shutil.which(f"python{minor}")
        candidates = [found] if found else []
        candidates += sorted(
            glob.glob(os.path.expanduser(f"~/.pyenv/versions/{minor}.*/bin/python{minor}"))
        )
        for candidate in candidates:
            if candidate and os.access(candidate, os.X_OK):
                return candidate
    return None


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_an_executor_python_of_another_version_is_an_infrastructure_error(
    spark: Any,
    spark_settings: None,
    formulas: dict[str, list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    other = _other_python()
    if other is None:
        pytest.skip("no Python of another minor version on this machine")
    make_rows(5)
    plan(PIPELINE, tenants=["alice"])
    cluster.forget()
    monkeypatch.setattr(execute.plans, "_plans", {})  # cached plans hold the Python they named
    monkeypatch.setattr(spark.sparkContext, "pythonExec", other)

    with pytest.raises(cluster.InfrastructureError) as caught:
        PipelineRunner(worker_id="infra", pipelines=[PIPELINE], spark=spark, burst=True).run()

    assert caught.value.kind == cluster.EXECUTOR_PYTHON
    assert "PYTHON_VERSION_MISMATCH" in str(caught.value) or "version" in str(caught.value)
    assert WorkBatch.objects.get().attempts == 0


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_data_error_still_uses_up_attempts_and_does_not_pause(
    spark: Any, spark_settings: None, formulas: dict[str, list[str]]
) -> None:
    from django.db import connection

    make_rows(10)
    plan(PIPELINE, tenants=["bob"])
    runner = PipelineRunner(worker_id="data", pipelines=[PIPELINE], spark=spark, burst=True)
    # The sink refuses some of bob's rows (band 'N/A'): the data's error, every time.
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE pipelinetest_result ADD CONSTRAINT small CHECK (band <> 'N/A')")
    try:
        runner.run()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE pipelinetest_result DROP CONSTRAINT small")

    row = WorkBatch.objects.get()
    assert row.attempts == 3  # every attempt used (RETRY_BACKOFF_BASE is 0 here)
    assert row.state == "failed"
    assert "small" in str(row.last_error)
    assert (runner.stats.failed, runner.stats.paused, runner.stats.released) == (3, 0, 0)


def _needs_a_module(value: Any) -> Any:
    import no_such_module_on_the_executors  # type: ignore[import-not-found]  # noqa: F401

    return value


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_batch_that_keeps_failing_like_infrastructure_while_the_check_passes_is_charged(
    spark: Any, spark_settings: None, settings: Any, unregister: list[str]
) -> None:
    """The safety net: an error that looks like the infrastructure's but follows the batch
    (here a UDF importing a module the executors lack) cannot loop forever."""
    from pyspark import cloudpickle
    from pyspark.sql import functions as F

    settings.FAIRQUEUE_PIPELINE = {
        "SPARK": {**SPARK_SETTINGS, "PAUSE_SECONDS": 0.1, "PAUSE_MAX_SECONDS": 0.2},
    }
    base = registry.get(PIPELINE)
    udf = F.udf(_needs_a_module, "double", useArrow=False)

    def transform(df: Any, tenant: str) -> Any:
        return df.withColumn("total", udf(df["price"]))

    name = "test.needs-module"
    unregister.append(name)
    registry.register(Pipeline(name=name, source=base.source, sink=base.sink, transform=transform))
    make_rows(5)
    plan(name, tenants=["alice"])
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    runner = PipelineRunner(worker_id="strikes", pipelines=[name], spark=spark, poll_interval=0.1)
    thread = _runner_thread(runner)
    try:
        wait_until(lambda: runner.stats.failed >= 1, timeout=120, what="an attempt charged")
    finally:
        runner.stop()
        thread.join(60)
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert runner.stats.paused >= 2  # two strikes given back, then charged
    row = WorkBatch.objects.get(job_name=f"{name}:alice")
    assert row.attempts >= 1
    assert "no_such_module_on_the_executors" in str(row.last_error)


# --------------------------------------------------------------------------------------------
# FAIR scheduler pools, one per channel


def test_pool_names_are_the_channel_names_made_safe() -> None:
    assert cluster.pool_name("acme") == "acme"
    assert cluster.pool_name("tenant:42.eu-west") == "tenant:42.eu-west"
    odd = cluster.pool_name("acme corp/<eu>")
    assert odd.startswith("acme_corp__eu_-")
    assert odd != cluster.pool_name("acme corp/<eu)")  # no two channels share a pool


def _pool_seen_by_task(rows: Iterator[Any]) -> Iterator[str | None]:
    from pyspark import TaskContext

    for _ in rows:
        pass
    context = TaskContext.get()
    yield context.getLocalProperty(cluster.POOL_PROPERTY) if context is not None else None


def record_pools(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None]]:
    """(channel, pool) of each batch the runner executes, as a Spark task of the batch's thread
    sees it (the pool Spark schedules the batch's jobs in)."""
    from pyspark import cloudpickle

    seen: list[tuple[str, str | None]] = []
    real = batch_run.execute_batch

    def recording(session: Any, batch: Any, **kwargs: Any) -> Any:
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        try:
            (pool,) = (
                session.sparkContext.parallelize([0], 1).mapPartitions(_pool_seen_by_task).collect()
            )
        finally:
            cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        seen.append((batch.channel, pool))
        return real(session, batch, **kwargs)

    monkeypatch.setattr("django_fairqueue.contrib.pipeline.runner.execute_batch", recording)
    return seen


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_each_channels_batches_run_in_a_fair_pool_weighted_like_the_channel(
    spark: Any,
    spark_settings: None,
    formulas: dict[str, list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert spark.sparkContext.getConf().get("spark.scheduler.mode") == "FAIR"
    make_rows(150)  # 2 batches per tenant
    plan(PIPELINE)
    Channel.objects.filter(name="alice").update(weight=3)
    seen = record_pools(monkeypatch)

    run_until_done(spark)

    assert sorted(seen) == [("alice", "alice")] * 2 + [("bob", "bob")] * 2
    assert cluster.pool_weight(spark, "alice") == 3
    assert cluster.pool_weight(spark, "bob") == 1
    assert spark.sparkContext.getLocalProperty(cluster.POOL_PROPERTY) is None  # cleared after

    # A changed weight applies to the channel's next batch (its pool is idle in between).
    Channel.objects.filter(name="alice").update(weight=5)
    DataRow.objects.bulk_create([DataRow(tenant="alice", price=1, qty=1, discount=0)])
    plan(PIPELINE, tenants=["alice"])
    run_until_done(spark)
    assert cluster.pool_weight(spark, "alice") == 5


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_without_fair_scheduling_no_pool_is_set(
    spark: Any,
    spark_settings: None,
    formulas: dict[str, list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cluster, "fair", lambda session: False)
    make_rows(5)
    plan(PIPELINE, tenants=["bob"])
    seen = record_pools(monkeypatch)
    PipelineRunner(worker_id="fifo", pipelines=[PIPELINE], spark=spark, burst=True).run()
    assert seen == [("bob", None)]
    assert batches.progress(f"{PIPELINE}:bob").batches_by_state["succeeded"] == 1

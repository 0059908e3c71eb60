"""The pipeline on a real Spark standalone cluster, started from PySpark's own jars.

A master and two workers (one core each) run as ``$SPARK_HOME/bin/spark-class`` processes, with
SPARK_HOME the installed ``pyspark`` package; two drivers share the cluster at the same time:
``fairpipeline run`` with the master in the settings, and ``spark-submit --master`` (whose
master wins over the settings' ``local[1]``). Both get an executor (each asks for
``spark.cores.max`` 1), the job's rows are what SQL computes, and the master's JSON shows both
applications running at once with an executor on a worker.

The cluster takes minutes to start on a busy 2-core machine, so the default run skips this
module: ``python3 dev.py test -m cluster`` runs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from django_fairqueue import batches
from django_fairqueue.contrib.pipeline.runner import plan
from django_fairqueue.models import WorkBatch
from tests import test_pipeline as base
from tests.pipelineapp.models import ExpectedRow
from tests.test_pipeline import (
    PIPELINE,
    assert_same_rows,
    expected_with_sql,
    make_rows,
    needs_spark,
    sink_rows,
)

ROOT = Path(__file__).resolve().parent.parent
formulas = base.formulas

pytestmark = [
    needs_spark,
    pytest.mark.spark,
    pytest.mark.slow,
    pytest.mark.cluster,
    # Skipped before any fixture runs unless the run selects it (-m cluster).
    pytest.mark.skipif(
        "'cluster' not in (config.getoption('markexpr') or '')",
        reason="starts a Spark standalone cluster (minutes): python3 dev.py test -m cluster",
    ),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def wait_for(what: str, timeout: float, probe: Any) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ValueError):
            value = probe()
            if value:
                return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.5)


class Process:
    """A child process whose output (stdout and stderr) is collected line by line."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], cwd: Path) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        """Stop it and everything it started (a worker's executors), by process group."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):  # killed below
                self.proc.wait(30)
        self.kill()

    def kill(self) -> None:
        """SIGKILL it and everything it started, as a crash of its machine would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self._reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@dataclass
class Standalone:
    """A standalone cluster of this machine: a master and workers (one core each)."""

    work: Path
    port: int = field(default_factory=free_port)
    ui_port: int = field(default_factory=free_port)
    processes: list[Process] = field(default_factory=list)
    #: Processes stopped or killed, for their output.
    ended: list[Process] = field(default_factory=list)
    started_in: float = 0.0

    def __post_init__(self) -> None:
        import pyspark

        self.spark_home = Path(pyspark.__file__).resolve().parent
        self.url = f"spark://127.0.0.1:{self.port}"
        self.ui = f"http://127.0.0.1:{self.ui_port}"
        self.env = {
            **os.environ,
            "SPARK_HOME": str(self.spark_home),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_DAEMON_MEMORY": "256m",
            "SPARK_LOG_DIR": str(self.work / "logs"),
            "PYSPARK_PYTHON": sys.executable,
        }

    def status(self) -> Any:
        return get_json(f"{self.ui}/json/")

    def start(self, workers: int) -> None:
        """Start the master (on the same ports every time) and ``workers`` workers."""
        started = time.monotonic()
        spark_class = str(self.spark_home / "bin" / "spark-class")
        self.processes.append(
            Process(
                "master",
                [
                    spark_class,
                    "org.apache.spark.deploy.master.Master",
                    *("--host", "127.0.0.1", "--port", str(self.port)),
                    *("--webui-port", str(self.ui_port)),
                ],
                self.env,
                self.work,
            )
        )
        wait_for("the master is up", 180, lambda: self.status()["status"] == "ALIVE")
        for number in range(1, workers + 1):
            self.processes.append(
                Process(
                    f"worker{number}",
                    [
                        spark_class,
                        "org.apache.spark.deploy.worker.Worker",
                        *("--host", "127.0.0.1", "--cores", "1", "--memory", "1g"),
                        *("--webui-port", str(free_port())),
                        *("--work-dir", str(self.work / f"w{number}")),
                        self.url,
                    ],
                    self.env,
                    self.work,
                )
            )
        wait_for(
            f"{workers} workers are alive", 180, lambda: self.status()["aliveworkers"] == workers
        )
        self.started_in = time.monotonic() - started

    def kill(self) -> None:
        """Kill the master and the workers (with their executors) at once."""
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.proc.pid, signal.SIGKILL)
        self.stop()

    def stop(self) -> None:
        while self.processes:
            process = self.processes.pop()
            process.stop()
            self.ended.append(process)


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    cluster = Standalone(tmp_path_factory.mktemp("spark-standalone"))
    try:
        cluster.start(workers=2)
        yield cluster
    finally:
        cluster.stop()


def command_line(process: psutil.Process) -> list[str]:
    try:
        return list(process.cmdline())
    except psutil.Error:  # gone, or a zombie
        return []


def driver_env(database_url: str, master: str, **spark: Any) -> dict[str, str]:
    """A driver's environment; ``spark``: more FAIRQUEUE_PIPELINE['SPARK'] settings."""
    overrides = {
        "FAIRQUEUE_PIPELINE": {
            "SPARK": {
                "MASTER": master,
                "CORES_MAX": 1,
                "EXECUTOR_TIMEOUT": 240,
                **spark,
                "CONF": {
                    "spark.executor.memory": "512m",
                    "spark.driver.memory": "512m",
                    "spark.driver.host": "127.0.0.1",
                    "spark.sql.shuffle.partitions": "1",
                },
            },
        },
        "LEASE_SECONDS": 60,
        "RETRY_BACKOFF_BASE": 0.0,
        "POLL_INTERVAL": 0.5,
    }
    return {
        **os.environ,
        "DATABASE_URL": database_url,
        "FAIRQUEUE_TEST_OVERRIDES": json.dumps(overrides),
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }


@pytest.mark.django_db(transaction=True)
def test_a_job_runs_on_a_standalone_cluster_that_two_drivers_share(
    standalone: Standalone,
    database_url: str,
    formulas: dict[str, list[str]],
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    make_rows(150)  # 2 batches per tenant
    plan(PIPELINE)
    # Two drivers running until stopped, each holding its core all along. Driver A:
    # `fairpipeline run` with the cluster in its settings. Driver B: spark-submit --master; its
    # settings say local[1].
    driver_a = Process(
        "driver-a",
        [
            sys.executable,
            *("-m", "django", "fairpipeline", "--settings", "tests.settings", "run", PIPELINE),
            *("--tenant", "alice", "--worker-id", "driver-a"),
        ],
        driver_env(database_url, standalone.url),
        ROOT,
    )
    script = tmp_path / "manage.py"
    script.write_text(
        "import sys\n"
        "from django.core.management import execute_from_command_line\n"
        "execute_from_command_line(['manage.py', *sys.argv[1:]])\n"
    )
    driver_b = Process(
        "driver-b",
        [
            str(standalone.spark_home / "bin" / "spark-submit"),
            *("--master", standalone.url, "--conf", "spark.cores.max=1"),
            *("--conf", "spark.executor.memory=512m", "--conf", "spark.driver.host=127.0.0.1"),
            str(script),
            *("fairpipeline", "--settings", "tests.settings", "run", PIPELINE),
            *("--tenant", "bob", "--worker-id", "driver-b"),
        ],
        driver_env(database_url, "local[1]"),
        ROOT,
    )
    seen_together: dict[str, Any] = {}

    def both_running() -> bool:
        for driver in (driver_a, driver_b):
            if driver.proc.poll() is not None:
                raise AssertionError(f"{driver.name} exited with {driver.proc.returncode}")
        status = standalone.status()
        apps = [a for a in status["activeapps"] if a["state"] == "RUNNING"]
        executors = {}
        for worker in status["workers"]:
            for executor in get_json(f"{worker['webuiaddress']}/json/")["executors"]:
                executors.setdefault(executor["appid"], []).append(executor["id"])
        if len(apps) == 2 and all(a["id"] in executors for a in apps):
            seen_together.update(apps={a["id"]: a for a in apps}, executors=executors)
            return True
        return False

    try:
        wait_for("both drivers running on the cluster at once", 600, both_running)
        wait_for(
            "every batch done",
            600,
            lambda: all(job.state == "succeeded" for job in batches.jobs(prefix=f"{PIPELINE}:")),
        )
        # SIGTERM to each driver's Python (under spark-submit, the JVM's child): the running
        # batch would be given back, and the command exits 0.
        driver_a.proc.send_signal(signal.SIGTERM)
        python_b = [
            child
            for child in psutil.Process(driver_b.proc.pid).children(recursive=True)
            if str(script) in " ".join(command_line(child))
        ]
        assert len(python_b) == 1, python_b
        python_b[0].send_signal(signal.SIGTERM)
        for driver in (driver_a, driver_b):
            assert driver.proc.wait(120) == 0, driver.output[-6000:]
    except BaseException:
        for process in (driver_a, driver_b, *standalone.processes):
            print(f"\n----- {process.name} (exit {process.proc.poll()}):\n{process.output[-5000:]}")
        with contextlib.suppress(OSError, ValueError):
            print(json.dumps(standalone.status(), indent=1)[:4000])
        raise
    finally:
        driver_a.stop()
        driver_b.stop()
    took = time.monotonic() - started

    # The rows are SQL's; each driver ran its tenant's batches.
    expected_with_sql()
    assert_same_rows(sink_rows(), sink_rows(ExpectedRow))
    assert len(sink_rows()) == 300
    done_by = dict(WorkBatch.objects.values_list("job_name", "worker_id").distinct())
    assert done_by == {f"{PIPELINE}:alice": "driver-a", f"{PIPELINE}:bob": "driver-b"}

    # Each driver says which master it used and why; spark-submit's won over the settings.
    assert (
        f"Spark master {standalone.url} (from FAIRQUEUE_PIPELINE['SPARK']['MASTER'])"
        in driver_a.output
    )
    assert f"Spark master {standalone.url} (from spark-submit)" in driver_b.output
    assert (
        f"running under spark-submit with master {standalone.url}: "
        "FAIRQUEUE_PIPELINE['SPARK']['MASTER'] (local[1]) is not used"
    ) in driver_b.output
    assert "spark.cores.max 1" in driver_a.output

    # The master ran both applications at once, one core each, each with an executor.
    apps = seen_together["apps"]
    assert {app["name"] for app in apps.values()} == {"django-fairqueue"}
    assert [app["cores"] for app in apps.values()] == [1, 1]
    for driver in (driver_a, driver_b):
        app_id = next(
            line.split("application ")[1].split(";")[0]
            for line in driver.lines
            if "Spark master spark://" in line and "application " in line
        )
        assert app_id in apps, (app_id, apps)
        assert seen_together["executors"][app_id]
    finished = {app["id"] for app in standalone.status()["completedapps"]}
    assert set(apps) <= finished
    print(
        f"\nstandalone cluster (master + 2 workers) up in {standalone.started_in:.1f} s; "
        f"two drivers' job in {took:.1f} s"
    )


@pytest.mark.django_db(transaction=True)
def test_the_benchmark_runs_on_the_cluster_and_counts_its_executors_cpu(
    standalone: Standalone, database_url: str
) -> None:
    # The settings say local[1] with spark.cores.max 1; --master, --partitions and --conf
    # replace them for the run: two executors, one per worker.
    done = subprocess.run(
        [
            sys.executable,
            *("-m", "django", "fairpipeline", "--settings", "tests.settings", "bench"),
            *("--rows", "600", "--tenants", "2", "--rules", "5", "--no-direct"),
            *("--sql-connections", "1", "--json", "--master", standalone.url),
            *("--partitions", "2", "--conf", "spark.cores.max=2"),
        ],
        cwd=ROOT,
        env=driver_env(database_url, "local[1]"),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    (result,) = json.loads(done.stdout)
    assert result["results_match"]
    assert result["master"] == standalone.url
    # Both executors run on this machine: their JVMs' CPU (and their Python workers') is
    # counted, so the Spark CPU per row is measured.
    assert (result["executors"], result["executors_measured"]) == (2, 2)
    assert result["spark_cpu_us_per_row"] is not None and result["spark_cpu_us_per_row"] > 0
    assert sum(t[0] for t in result["batch_timings"]) == 600
    assert not WorkBatch.objects.exists()  # nothing of the run stays

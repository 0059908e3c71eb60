"""A Spark standalone cluster that dies under a running batch, and comes back.

The batch's Spark task is held mid-batch (the test locks the source table, so the task's read
waits on PostgreSQL while the executor runs it); then the master and the worker are killed
(SIGKILL, with the executor), the lock released, and the cluster started again on the same
ports. The runner must see the outage, cancel the job, give the batch back without using an
attempt, rebuild its session once the master is back, and finish the batch.

Like tests/test_spark_standalone.py, it runs only when selected: ``python3 dev.py test -m
cluster tests/test_spark_outage.py`` (two cluster starts: minutes on a busy 2-core machine).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import psycopg
import pytest

from django_fairqueue.contrib.pipeline.runner import plan
from django_fairqueue.models import WorkBatch
from tests.pipelineapp.models import DataRow, ExpectedRow
from tests.test_pipeline import (
    PIPELINE,
    assert_same_rows,
    expected_with_sql,
    make_rows,
    sink_rows,
)
from tests.test_pipeline_infra import reads_waiting
from tests.test_spark_standalone import ROOT, Process, Standalone, driver_env, wait_for
from tests.test_spark_standalone import formulas as formulas  # the fixture
from tests.test_spark_standalone import pytestmark as pytestmark

#: The driver's settings: an outage is seen within seconds (the master is probed every 2 s);
#: pauses stay short so the runner retries soon after the cluster is back.
OUTAGE_SETTINGS = {"EXECUTOR_TIMEOUT": 60, "PAUSE_SECONDS": 1, "PAUSE_MAX_SECONDS": 4}


@pytest.mark.django_db(transaction=True)
def test_a_batch_caught_in_a_cluster_outage_is_given_back_and_done_once_the_cluster_is_back(
    database_url: str, formulas: dict[str, list[str]], tmp_path: Path
) -> None:
    cluster = Standalone(tmp_path / "cluster")
    (tmp_path / "cluster").mkdir()
    table = DataRow._meta.db_table
    make_rows(40)
    plan(PIPELINE, tenants=["alice"])
    (batch,) = WorkBatch.objects.all()
    timeline: dict[str, float] = {}
    driver = None
    lock = psycopg.connect(database_url)
    try:
        cluster.start(workers=1)
        lock.execute(f'LOCK TABLE "{table}" IN ACCESS EXCLUSIVE MODE')  # a transaction opens
        driver = Process(
            "driver",
            [
                sys.executable,
                *("-m", "django", "fairpipeline", "--settings", "tests.settings", "run", PIPELINE),
                *("--worker-id", "driver"),
            ],
            driver_env(database_url, cluster.url, **OUTAGE_SETTINGS),
            ROOT,
        )
        # The executor's task reads the source: it waits on the lock, mid-batch.
        with psycopg.connect(database_url, autocommit=True) as watch:
            wait_for(
                "the batch's Spark task reading the source",
                300,
                lambda: reads_waiting(watch, table),
            )
        batch.refresh_from_db()
        assert (batch.state, batch.attempts) == ("running", 1)
        started = time.monotonic()
        cluster.kill()
        lock.commit()
        wait_for(
            "the batch given back", 120, lambda: "given back, no attempt used" in driver.output
        )
        timeline["given back"] = time.monotonic() - started
        batch.refresh_from_db()
        assert (batch.state, batch.attempts, batch.last_error) == ("pending", 0, None)
        # With the master down, the runner keeps pausing: it cannot start a new application.
        wait_for(
            "a rebuild refused while the master is down",
            120,
            lambda: "cannot reach the Spark master" in driver.output,
        )
        timeline["restart begun"] = time.monotonic() - started
        cluster.start(workers=1)
        timeline["cluster up"] = time.monotonic() - started
        wait_for("the batch done", 300, lambda: WorkBatch.objects.get().state == "succeeded")
        timeline["batch done"] = time.monotonic() - started
        driver.proc.send_signal(signal.SIGTERM)
        assert driver.proc.wait(120) == 0
    except BaseException:
        for process in (driver, *cluster.processes, *cluster.ended):
            if process is not None:
                print(f"\n----- {process.name} (exit {process.proc.poll()}):")
                print(process.output[-6000:])
        raise
    finally:
        lock.close()
        if driver is not None:
            driver.stop()
        cluster.stop()

    batch.refresh_from_db()
    assert (batch.attempts, batch.last_error, batch.worker_id) == (1, None, "driver")
    output = driver.output
    assert "the Spark master went away" in output
    assert "cancelling its Spark job" in output
    assert "resumed: the executors' check passes" in output
    expected_with_sql()
    alice = {k: v for k, v in sink_rows(ExpectedRow).items() if v[0] == "alice"}
    assert_same_rows(sink_rows(), alice)
    assert len(alice) == 40
    print(
        "\noutage timeline (seconds after the kill): "
        + ", ".join(f"{what} {at:.1f}" for what, at in timeline.items())
    )

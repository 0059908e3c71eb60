"""The Spark data pipeline (django_fairqueue.contrib.pipeline): formulas, batches, crashes,
fairness.

Spark tests share ONE SparkSession (local[1], small JVM settings) for the whole run and skip
with a clear reason without PySpark or Java. Data is small: the point is correctness.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from django_fairqueue import batches
from django_fairqueue.contrib.pipeline import batch_run, datastore, execute
from django_fairqueue.contrib.pipeline.core import Pipeline, Sink, registry
from django_fairqueue.contrib.pipeline.formulas import FormulaError, parse_formulas
from django_fairqueue.contrib.pipeline.management.commands.fairpipeline import Command
from django_fairqueue.contrib.pipeline.models import PipelineJob
from django_fairqueue.contrib.pipeline.runner import PipelineRunner, plan
from django_fairqueue.exceptions import LeaseLost
from django_fairqueue.models import WorkBatch
from tests.pipelineapp import pipelines
from tests.pipelineapp.models import DataRow, ExpectedRow, ResultRow
from tests.workerkit import WorkerProcess, wait_until

PIPELINE = "test.enrich"
SPARK_CONF = {
    "spark.sql.shuffle.partitions": "1",
    "spark.default.parallelism": "1",
    "spark.driver.memory": "1g",
    "spark.sql.codegen.wholeStage": "false",
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
}
SPARK_SETTINGS = {"MASTER": "local[1]", "CONF": SPARK_CONF}


def _spark_missing() -> str | None:
    try:
        import pyarrow  # noqa: F401
        import pyspark  # noqa: F401
    except ImportError:
        return "PySpark is not installed: pip install 'django-fairqueue[spark]'"
    if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
        return "Java is not installed (the Spark tests need a JRE 17+; .ci/run installs one)"
    return None


needs_spark = pytest.mark.skipif(_spark_missing() is not None, reason=str(_spark_missing()))


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    missing = _spark_missing()
    if missing:
        pytest.skip(missing)
    from pyspark.sql import SparkSession

    from django_fairqueue.contrib.pipeline import spark as spark_module

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.master("local[1]").appName("fairqueue-tests")
    options = spark_module.builder_options(spark_module.SparkSettings(conf=SPARK_CONF))
    for key, value in options.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    spark_module.use_session(session)
    yield session
    spark_module.use_session(None)
    session.stop()


@pytest.fixture
def spark_settings(settings: Any) -> None:
    settings.FAIRQUEUE = {**settings.FAIRQUEUE, "RETRY_BACKOFF_BASE": 0.0, "LEASE_SECONDS": 10.0}
    settings.FAIRQUEUE_PIPELINE = {"SPARK": SPARK_SETTINGS}


@pytest.fixture
def formulas(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """The test pipeline's formulas, restored after the test."""
    copy = {tenant: list(f) for tenant, f in pipelines.FORMULAS.items()}
    monkeypatch.setattr(pipelines, "FORMULAS", copy)
    return copy


def make_rows(per_tenant: int) -> None:
    rows = []
    for i in range(per_tenant):
        for tenant in ("alice", "bob"):
            rows.append(
                DataRow(
                    tenant=tenant,
                    price=round(1 + (i * 7.31) % 90, 2),
                    qty=1 + i % 7,
                    discount=(i % 4) * 0.05,
                    note=None if i % 3 == 0 else f"n{i % 5}",
                )
            )
    DataRow.objects.bulk_create(rows)


def expected_with_sql() -> None:
    """The test pipeline's formulas computed in Python (the data has no blank numbers)."""
    rows = []
    for row in DataRow.objects.all():
        if row.tenant == "alice":
            subtotal = row.price * row.qty
            total = float(Decimal(repr(subtotal * (1 - row.discount))).quantize(
                Decimal("0.01"), rounding=ROUND_HALF_UP))  # fmt: skip
            band = "high" if total >= 100 else ("none" if row.note is None else row.note)
        else:
            subtotal = row.price * row.qty - row.discount
            total = max(subtotal, 0) / 3 + 1.5
            band = (row.note if row.note is not None else "n/a").upper()
        rows.append(ExpectedRow(id=row.id, tenant=row.tenant, subtotal=subtotal, total=total,
                                band=band))  # fmt: skip
    ExpectedRow.objects.bulk_create(rows)


def sink_rows(model: Any = ResultRow) -> dict[int, tuple[Any, ...]]:
    return {
        row[0]: row[1:]
        for row in model.objects.values_list("id", "tenant", "subtotal", "total", "band")
    }


def assert_same_rows(got: dict[int, tuple[Any, ...]], want: dict[int, tuple[Any, ...]]) -> None:
    assert got.keys() == want.keys()
    for key, row in want.items():
        for a, b in zip(got[key], row, strict=True):
            if isinstance(b, float):
                assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12), (key, got[key], row)
            else:
                assert a == b, (key, got[key], row)


def run_until_done(spark: Any, timeout: float = 60.0, name: str = PIPELINE) -> None:
    def done() -> bool:
        PipelineRunner(worker_id="test", pipelines=[name], burst=True, spark=spark).run()
        return all(j.state == "succeeded" for j in batches.jobs(prefix=f"{name}:"))

    wait_until(done, timeout=timeout, what="every batch succeeded")


# --------------------------------------------------------------------------------------------
# Formulas, without Spark


@pytest.mark.parametrize(
    ("formula", "reason"),
    [
        ("total = price * quantity", "unknown name 'quantity'"),
        ("total = system('rm -rf /')", "function system is not allowed"),
        ("total = price * qty; DROP TABLE x", "unexpected character ';'"),
        ("total = (SELECT 1)", "unexpected 1"),
        ("total = price -- comment", "unknown name 'comment'"),
        ("total = price - -1 /* x */", "unexpected * at position 13"),
        ("total = note * 2", "* needs number, got text"),
        ("total = price *", "the expression ends too early"),
        ("secret = price", "'secret' is not a column of the sink"),
        ("price * qty", "a formula reads `name = expression`"),
    ],
)
def test_a_bad_formula_is_a_clear_error_naming_tenant_and_formula(
    formula: str, reason: str
) -> None:
    with pytest.raises(FormulaError) as caught:
        parse_formulas(
            "bob",
            ["subtotal = price * qty", formula],
            columns={"id": "int", "price": "float", "qty": "int", "note": "str"},
            targets=["subtotal", "total", "band"],
        )

    message = str(caught.value)
    assert message.startswith("tenant 'bob': invalid formula ")
    assert formula in message
    assert reason in message


# --------------------------------------------------------------------------------------------
# Planning and claiming, without Spark


@pytest.mark.django_db(transaction=True)
def test_a_bad_formula_is_rejected_before_the_job_starts(
    formulas: dict[str, list[str]],
) -> None:
    make_rows(5)
    formulas["bob"] = ["subtotal = price * qty", "total = subtotal * vat"]

    report = plan(PIPELINE)

    # bob's mistake blocks bob only: alice is planned.
    error = report.refused["bob"]
    assert isinstance(error, FormulaError)
    assert "'total = subtotal * vat'" in str(error)
    assert "unknown name 'vat'" in str(error)
    assert [r.job_name for r in report.planned] == ["test.enrich:alice"]
    assert not WorkBatch.objects.filter(job_name="test.enrich:bob").exists()
    with pytest.raises(CommandError, match="1 of 2 tenants not planned"):
        call_command("fairpipeline", "plan", PIPELINE)


@pytest.mark.django_db(transaction=True)
def test_batch_claims_are_fair_across_tenants(formulas: dict[str, list[str]]) -> None:
    DataRow.objects.bulk_create(
        [DataRow(tenant="alice", price=1, qty=1, discount=0) for _ in range(1000)]
        + [DataRow(tenant="bob", price=1, qty=1, discount=0) for _ in range(10)]
    )
    results = plan(PIPELINE, batch_size=1).planned
    assert {r.job_name: r.created for r in results} == {
        "test.enrich:alice": 1000,
        "test.enrich:bob": 10,
    }

    claimed = []
    for _ in range(20):
        batch = batches.claim(worker_id="w", jobs=[f"{PIPELINE}:*"], lease=timedelta(minutes=5))
        assert batch is not None
        claimed.append(batch.channel)

    # Tenants take turns: bob's 10 batches do not wait behind alice's 1,000.
    assert claimed.count("bob") == 10
    assert claimed.count("alice") == 10


@pytest.mark.django_db(transaction=True)
def test_status_shows_progress_per_job(
    formulas: dict[str, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    make_rows(150)
    plan(PIPELINE)

    call_command("fairpipeline", "status", "--json")
    import json

    jobs = {job["job"]: job for job in json.loads(capsys.readouterr().out)}
    assert jobs["test.enrich:alice"]["batches_total"] == 2
    assert jobs["test.enrich:alice"]["rows_total"] == 150
    assert jobs["test.enrich:bob"]["rows_done"] == 0
    call_command("fairpipeline", "status")
    assert "test.enrich:bob" in capsys.readouterr().out

    # Why a batch failed shows under its job, until the batch succeeds.
    claimed = batches.claim(worker_id="t", jobs=["test.enrich:alice"])
    assert claimed is not None
    batches.fail(claimed, ValueError("the sink refused a row\nmore detail"))
    call_command("fairpipeline", "status", PIPELINE)
    out = capsys.readouterr().out
    assert (f"  last error (batch {claimed.id}, pending, attempt 1): ValueError: the sink "
            "refused a row\n") in out  # fmt: skip
    call_command("fairpipeline", "status", "--json")
    shown = {job["job"]: job for job in json.loads(capsys.readouterr().out)}
    assert shown["test.enrich:alice"]["last_error"]["message"].startswith("the sink refused")
    assert shown["test.enrich:bob"]["last_error"] is None

    # A job cancelled before any batch ran keeps its line, as cancelled.
    call_command("fairpipeline", "cancel", PIPELINE, "--tenant", "bob")
    capsys.readouterr()
    call_command("fairpipeline", "status", PIPELINE)
    line = next(x for x in capsys.readouterr().out.splitlines() if "test.enrich:bob" in x)
    assert line.split()[1] == "cancelled"
    call_command("fairpipeline", "status", "--json")
    jobs = {job["job"]: job for job in json.loads(capsys.readouterr().out)}
    assert jobs["test.enrich:bob"]["cancelled"] and jobs["test.enrich:bob"]["batches_total"] == 0


@pytest.mark.django_db(transaction=True)
def test_a_pruned_job_is_still_listed_and_planned_again_as_a_new_run(
    formulas: dict[str, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    make_rows(5)
    plan(PIPELINE, tenants=["alice"])
    job_name = f"{PIPELINE}:alice"
    # what the run computed with and counted: its aggregates, its TODAY(), its error values
    PipelineJob.objects.filter(job_name=job_name).update(
        errors={"total": 2}, aggregates=[{"rows": 5}], today=dt.date(2020, 1, 1)
    )
    while (batch := batches.claim(worker_id="t", jobs=[job_name])) is not None:
        with batches.fenced(batch) as fence:
            fence.rows_processed = batch.row_count
    assert batches.prune(older_than=timedelta(0)) == 1

    call_command("fairpipeline", "status")
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(job_name))
    assert line.split()[1:3] == ["succeeded", "0/0"]  # its batches are gone, not the job
    call_command("fairpipeline", "status", PIPELINE, "--json")
    (shown,) = json.loads(capsys.readouterr().out)
    assert (shown["job"], shown["batches_total"], shown["errors"]) == (job_name, 0, {"total": 2})

    (planned,) = plan(PIPELINE, tenants=["alice"]).planned
    assert (planned.created, planned.rows_planned) == (1, 5)  # every row, from the first id
    job = PipelineJob.objects.get(job_name=job_name)
    assert (job.errors, job.aggregates) == ({}, None)
    assert job.today == execute.prepare(registry.get(PIPELINE), "alice").today


@pytest.mark.django_db(transaction=True)
def test_a_plan_that_planned_no_tenant_says_so(formulas: dict[str, list[str]]) -> None:
    formulas["nosuch"] = []  # a tenant without formulas: refused
    with pytest.raises(CommandError) as caught:
        call_command("fairpipeline", "plan", PIPELINE, "--tenant", "nosuch")
    assert str(caught.value) == "tenant 'nosuch' was not planned (above)"
    formulas["other"] = []
    with pytest.raises(CommandError) as caught:
        call_command("fairpipeline", "plan", PIPELINE, "--tenant", "nosuch", "--tenant", "other")
    assert str(caught.value) == "none of the 2 tenants was planned (above)"
    with pytest.raises(CommandError) as caught:
        call_command("fairpipeline", "recompute", PIPELINE, "--tenant", "nosuch")
    assert str(caught.value) == "tenant 'nosuch' was not recomputed (above)"


@pytest.mark.django_db(transaction=True)
def test_djangos_common_options_may_follow_the_action(
    formulas: dict[str, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    make_rows(5)
    call_command("fairpipeline", "plan", PIPELINE, "--tenant", "bob", "-v", "0", "--traceback")
    assert "test.enrich:bob (formulas " in capsys.readouterr().out
    for common in (["-v", "0"], ["--verbosity=2", "--no-color"], ["--force-color"]):
        call_command("fairpipeline", "status", "--json", *common)
        assert json.loads(capsys.readouterr().out)[0]["job"] == "test.enrich:bob"
    with pytest.raises(CommandError, match="--runners must be from 1 to 16"):  # parsed first
        call_command("fairpipeline", "run", "--tenant", "x", "--burst", "-v", "0", "--runners", "0")
    parser = Command().create_parser("manage.py", "fairpipeline")
    given = ["run", "--burst", "-v", "0", "--settings", "s", "--pythonpath", "p", "--skip-checks"]
    options = vars(parser.parse_args(given))
    assert {k: options[k] for k in ("verbosity", "settings", "pythonpath", "skip_checks")} == {
        "verbosity": 0,
        "settings": "s",
        "pythonpath": "p",
        "skip_checks": True,
    }
    # one given before the action is kept: the action's parser does not reset it
    assert parser.parse_args(["-v", "2", "run"]).verbosity == 2
    with pytest.raises(CommandError, match=r"--lease must be 5 to 86400 seconds, got 1\.0"):
        call_command("fairpipeline", "run", "--lease", "1")


def test_without_pyspark_the_error_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from django_fairqueue.contrib.pipeline.spark import SparkUnavailable, require_pyspark

    for module in ("pyspark", "pyarrow"):
        monkeypatch.setitem(sys.modules, module, None)  # import -> ImportError
    with pytest.raises(SparkUnavailable, match=r"\(not installed: pyspark, pyarrow\): pip"):
        require_pyspark()


def test_without_pyspark_the_commands_say_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pyspark", None)  # import pyspark -> ImportError

    importlib.import_module("django_fairqueue.contrib.pipeline")
    importlib.import_module("django_fairqueue.contrib.pipeline.runner")
    for args in (
        ["fairpipeline", "run"],
        ["fairpipeline", "bench"],
        ["runfairworker", "--pipelines"],
    ):
        with pytest.raises(CommandError, match=r"pip install 'django-fairqueue\[spark\]'"):
            call_command(*args)


@pytest.mark.django_db(transaction=True)
def test_names_the_commands_refuse(formulas: dict[str, list[str]]) -> None:
    with pytest.raises(CommandError, match="no pipeline named 'nosuch'"):
        call_command("fairpipeline", "status", "nosuch")
    for action in ("plan", "cancel", "retry"):
        with pytest.raises(CommandError, match="--tenant needs a tenant's name"):
            call_command("fairpipeline", action, PIPELINE, "--tenant", " ")
    with pytest.raises(CommandError, match="--batch-size must be at least 1"):
        call_command("fairpipeline", "bench", "--rows", "100", "--batch-size", "0")
    formulas["nosuch"] = []  # a tenant the lookup knows, without formulas
    report = plan(PIPELINE, tenants=["nosuch"])
    assert str(report.refused["nosuch"]) == "tenant 'nosuch': the tenant has no formulas"
    with pytest.raises(FormulaError, match="a name starts with a letter or _"):
        parse_formulas("bob", {"1abc": "price"}, columns={"price": "float"}, targets=None)


@pytest.mark.django_db(transaction=True)
def test_the_worker_checks_its_pipeline_runners_count() -> None:
    for bad in ("0", "17"):
        with pytest.raises(CommandError, match="--pipeline-runners must be from 1 to 16"):
            call_command("runfairworker", "--pipelines", "--pipeline-runners", bad, "--burst")
    for bad in ("0", "100000"):
        with pytest.raises(CommandError, match="--runners must be from 1 to 16"):
            call_command("fairpipeline", "run", "--runners", bad, "--burst")
    with pytest.raises(CommandError, match="--pipelines: an empty pipeline name in ','"):
        call_command("runfairworker", "--pipelines", ",", "--burst")
    with pytest.raises(CommandError, match="--pipeline-runners needs --pipelines"):
        call_command("runfairworker", "--pipeline-runners", "2", "--burst")


@pytest.mark.django_db(transaction=True)
def test_without_pyspark_planning_works(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "pyspark", None)  # import pyspark -> ImportError
    make_rows(5)

    call_command("fairpipeline", "plan", PIPELINE)

    assert "test.enrich:alice (formulas " in capsys.readouterr().out
    assert WorkBatch.objects.filter(job_name="test.enrich:alice").count() == 1


# --------------------------------------------------------------------------------------------
# Spark


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_formulas_are_applied_per_tenant_as_python_computes_them(
    spark: Any, spark_settings: None, formulas: dict[str, list[str]]
) -> None:
    make_rows(120)  # 2 batches per tenant
    plan(PIPELINE)

    run_until_done(spark)

    expected_with_sql()
    want = sink_rows(ExpectedRow)
    assert len(want) == 240
    assert_same_rows(sink_rows(), want)
    assert {row[3] for row in want.values()} >= {"high", "none", "N/A", "N1"}
    assert not datastore.staging_tables("default")


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_burst_runner_runs_batches_behind_other_channels_unfolded_deltas(
    spark: Any, spark_settings: None, formulas: dict[str, list[str]]
) -> None:
    """Messages queued with no worker running leave a counter delta each; a claim folds a
    bounded number of them, oldest first. The runner folds them all before giving up."""
    from django_fairqueue import enqueue
    from tests.factories import NOOP

    for _ in range(1_200):  # more than one claim folds, ahead of the batches' deltas
        enqueue(NOOP, channel="busy-tenant")
    make_rows(10)
    plan(PIPELINE)

    stats = PipelineRunner(worker_id="test", pipelines=[PIPELINE], burst=True, spark=spark).run()

    assert stats.succeeded == 2 and stats.failed == 0
    assert all(j.state == "succeeded" for j in batches.jobs(prefix=f"{PIPELINE}:"))


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_burst_worker_with_pipelines_runs_the_ready_batches_before_it_exits(
    spark: Any, spark_settings: None, formulas: dict[str, list[str]]
) -> None:
    make_rows(10)
    plan(PIPELINE)

    call_command("runfairworker", "--pipelines", PIPELINE, "--pipeline-runners", "2",
                 "--burst", "--no-listen", "--burst-horizon", "0")  # fmt: skip

    assert all(j.state == "succeeded" for j in batches.jobs(prefix=f"{PIPELINE}:"))
    assert len(sink_rows()) == 20


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_text_longer_than_a_varchar_column_is_an_error_value_not_a_failed_batch(
    spark: Any, spark_settings: None, formulas: dict[str, list[str]]
) -> None:
    from django.db import connection

    from django_fairqueue.contrib.pipeline.models import PipelineJob

    table = ResultRow._meta.db_table
    with connection.cursor() as cur:
        cur.execute(f"ALTER TABLE {table} ALTER COLUMN band TYPE varchar(3)")
    try:
        make_rows(30)
        plan(PIPELINE)
        stats = PipelineRunner(worker_id="t", pipelines=[PIPELINE], burst=True, spark=spark).run()
        expected_with_sql()
        want = sink_rows(ExpectedRow)
        got = sink_rows()
    finally:
        with connection.cursor() as cur:
            cur.execute(f"ALTER TABLE {table} ALTER COLUMN band TYPE text")

    assert (stats.succeeded, stats.failed) == (2, 0)
    too_long = {key for key, row in want.items() if len(row[3]) > 3}
    assert too_long and len(too_long) < len(want)  # "high", "none", "N/A" fit or not
    for key, row in want.items():
        assert got[key][3] == (None if key in too_long else row[3])
    counted = sum(job.errors.get("band", 0) for job in PipelineJob.objects.all())
    assert counted == len(too_long)


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_the_last_batch_of_a_run_records_it_as_the_last_successful_run(
    spark: Any,
    spark_settings: None,
    formulas: dict[str, list[str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    make_rows(150)
    plan(PIPELINE, tenants=["alice"])  # two batches

    def run(**options: Any) -> None:
        PipelineRunner(worker_id="t", pipelines=[PIPELINE], burst=True, spark=spark,
                       **options).run()  # fmt: skip

    def job() -> PipelineJob:
        return PipelineJob.objects.get(job_name=f"{PIPELINE}:alice")

    run(max_batches=1)
    assert job().succeeded_at is None  # one batch of two: the run is not complete
    run()
    done = job()
    assert done.succeeded_at is not None
    assert (done.succeeded_version, done.succeeded_output) == (done.version, "sink")
    call_command("fairpipeline", "status", PIPELINE, "--json")
    (shown,) = json.loads(capsys.readouterr().out)
    assert shown["last_success"]["version"] == done.version
    # ISO 8601 as every other time of --json (it read "2026-11-30 21:55:19+00:00")
    assert shown["last_success"]["at"] == done.succeeded_at.isoformat()


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_stop_before_the_batch_s_spark_job_starts_gives_the_batch_back(
    spark: Any,
    spark_settings: None,
    formulas: dict[str, list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    make_rows(5)
    plan(PIPELINE, tenants=["alice"])
    runner = PipelineRunner(worker_id="t", pipelines=[PIPELINE], spark=spark, poll_interval=0.1)
    prepare_batch = batch_run.prepare_batch

    def stopped_meanwhile(*args: Any, **kwargs: Any) -> Any:
        runner.stop()  # SIGTERM while the driver prepares the batch, before its Spark job
        time.sleep(0.6)  # the watcher saw the stop, and no Spark job yet to cancel
        return prepare_batch(*args, **kwargs)

    monkeypatch.setattr(batch_run, "prepare_batch", stopped_meanwhile)
    stats = runner.run()

    assert (stats.succeeded, stats.failed, stats.released) == (0, 0, 1)
    (row,) = WorkBatch.objects.filter(job_name=f"{PIPELINE}:alice")
    assert (row.state, row.attempts) == ("pending", 0)  # given back, no attempt used
    assert not ResultRow.objects.exists()


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_runners_sharing_a_session_run_every_batch_once(
    spark: Any, spark_settings: None, formulas: dict[str, list[str]]
) -> None:
    from django_fairqueue.contrib.pipeline.runner import RunnerGroup

    make_rows(120)  # 2 batches per tenant
    plan(PIPELINE)

    # max_batches counts over the group: two runners, one batch in all.
    one = RunnerGroup(2, worker_id="pair", pipelines=[PIPELINE], burst=True, spark=spark,
                      max_batches=1).run()  # fmt: skip
    assert (one.succeeded, one.failed) == (1, 0)

    group = RunnerGroup(2, worker_id="pair", pipelines=[PIPELINE], burst=True, spark=spark)
    stats = group.run()

    assert (stats.succeeded, stats.failed, stats.lost) == (3, 0, 0)
    assert set(WorkBatch.objects.values_list("worker_id", flat=True)) <= {"pair/1", "pair/2"}
    expected_with_sql()
    assert_same_rows(sink_rows(), sink_rows(ExpectedRow))
    with pytest.raises(ValueError, match="whole number from 1 to 16"):
        RunnerGroup(0, worker_id="pair")


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_tenants_plan_is_built_once_per_formula_version_not_per_batch_or_job(
    spark: Any, spark_settings: None, formulas: dict[str, list[str]], monkeypatch: Any
) -> None:
    plans = execute._Plans()
    monkeypatch.setattr(execute, "plans", plans)
    make_rows(250)  # 3 batches per tenant, claimed in turns: alice, bob, alice...
    plan(PIPELINE)
    run_until_done(spark)
    assert WorkBatch.objects.count() == 6
    assert plans.builds == 2  # the fixed cost: once per tenant, not per batch

    # The same formulas planned again from the start (a new job, planned at a new moment):
    # their rules read no TODAY() or NOW(), so the plans are the same.
    plan(PIPELINE, rerun=True)
    run_until_done(spark)
    assert plans.builds == 2

    formulas["bob"] = [*formulas["bob"][:2], "band = lower(coalesce(note, 'n/a'))"]
    plan(PIPELINE)  # bob's new version: a new plan for bob only
    run_until_done(spark)
    assert plans.builds == 3
    expected_with_sql()
    want = {k: (*row[:3], row[3].lower()) if row[0] == "bob" else row
            for k, row in sink_rows(ExpectedRow).items()}  # fmt: skip
    assert_same_rows(sink_rows(), want)


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_failed_batch_leaves_nothing_and_its_rerun_writes_each_row_once(
    spark: Any, spark_settings: None, formulas: dict[str, list[str]]
) -> None:
    from django.db import connection

    make_rows(30)
    # The sink refuses some of bob's rows: the batch's merge fails after Spark wrote staging.
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE pipelinetest_result ADD CONSTRAINT small CHECK (band <> 'N/A')")
    plan(PIPELINE)

    PipelineRunner(worker_id="test", pipelines=[PIPELINE], burst=True, spark=spark).run()

    bob = batches.progress(f"{PIPELINE}:bob")
    assert bob.batches_by_state["succeeded"] == 0
    assert not ResultRow.objects.filter(tenant="bob").exists()  # no partial batch visible
    assert ResultRow.objects.filter(tenant="alice").count() == 30
    assert not datastore.staging_tables("default")
    error = WorkBatch.objects.get(job_name=f"{PIPELINE}:bob").last_error
    assert "small" in str(error)

    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE pipelinetest_result DROP CONSTRAINT small")
    WorkBatch.objects.filter(job_name=f"{PIPELINE}:bob").update(run_at="2000-01-01T00:00:00Z")
    call_command("fairpipeline", "retry", PIPELINE)  # failed ones, if attempts ran out
    run_until_done(spark)
    first = sink_rows()
    assert len(first) == 60

    # Re-running a finished batch's range writes the same rows: nothing changes.
    pipeline = registry.get(PIPELINE)
    prepared = execute.prepare(pipeline, "bob")
    staging = "fq_stage_1_" + "0" * 32
    statements = datastore.create_staging(
        "default", staging=staging, sink=ResultRow._meta.db_table, columns=pipeline.sink.all_columns
    )
    low, high = DataRow.objects.order_by("id")[0].id, DataRow.objects.order_by("-id")[0].id
    written = execute.run_range(spark, prepared, low, high, staging=statements)
    assert written.rows == 30
    assert written.key_range is not None
    changed = datastore.merge_staging(
        "default",
        staging=staging,
        sink=ResultRow._meta.db_table,
        key=["id"],
        columns=pipeline.sink.all_columns,
        key_range=written.key_range,  # the sink has these keys: an upsert, not a plain INSERT
    )
    assert changed == 0
    assert sink_rows() == first
    # A staging table whose batch is not running is an orphan: the runner's cleanup drops it.
    assert batch_run.drop_orphaned_staging("default") == [staging]


@needs_spark
@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_killed_mid_batch_has_its_batch_redone_exactly_once(
    spark: Any, spark_settings: None, database_url: str, formulas: dict[str, list[str]]
) -> None:
    make_rows(300)
    plan(PIPELINE)  # 3 batches per tenant
    overrides = {
        "FAIRQUEUE_PIPELINE": {"SPARK": SPARK_SETTINGS},
        "LEASE_SECONDS": 3,
        "RETRY_BACKOFF_BASE": 0.0,
    }
    worker = WorkerProcess(
        database_url, "doomed", "--pipelines", PIPELINE, "--no-listen", overrides=overrides
    )
    try:
        # Kill -9 once Spark is working on a batch (its staging table exists).
        staging = wait_until(
            lambda: datastore.staging_tables("default"), timeout=120, what="a batch in Spark"
        )[0]
        worker.proc.kill()
        worker.wait(30)
    finally:
        worker.close()
    killed = WorkBatch.objects.get(lease_token__isnull=False, state="running")
    assert staging.startswith(f"fq_stage_{killed.id}_")

    run_until_done(spark)  # after the lease expires, the batch is rescued and redone

    killed.refresh_from_db()
    assert killed.state == "succeeded"
    assert killed.attempts == 2
    expected_with_sql()
    assert ResultRow.objects.count() == 600
    assert_same_rows(sink_rows(), sink_rows(ExpectedRow))
    assert not datastore.staging_tables("default")


@pytest.fixture
def unregister() -> Iterator[list[str]]:
    """Names of pipelines a test registers, unregistered after it."""
    names: list[str] = []
    yield names
    for name in names:
        registry.unregister(name)


def non_atomic(name: str, unregister: list[str]) -> Pipeline:
    """The test pipeline under another name, with ``Sink(atomic=False)``."""
    base = registry.get(PIPELINE)
    sink = Sink(ResultRow, key=base.sink.key, columns=base.sink.columns, atomic=False)
    unregister.append(name)
    # tenants as a list (a Pipeline holding a list is not hashable: the plan cache copes)
    return registry.register(
        dataclasses.replace(base, name=name, sink=sink, tenants=["alice", "bob"])
    )


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_non_atomic_sink_gets_the_same_rows_and_a_rerun_changes_nothing(
    spark: Any, spark_settings: None, formulas: dict[str, list[str]], unregister: list[str]
) -> None:
    make_rows(120)  # 2 batches per tenant
    plan(PIPELINE)
    run_until_done(spark)
    atomic = sink_rows()
    assert len(atomic) == 240
    ResultRow.objects.all().delete()

    direct = non_atomic("test.direct", unregister)
    plan(direct.name)
    run_until_done(spark, name=direct.name)

    assert_same_rows(sink_rows(), atomic)
    assert all(
        b.rows_processed > 0 for b in WorkBatch.objects.filter(job_name__startswith="test.direct:")
    )

    # Re-running every batch (as after a crash) writes the same rows: the tasks find their keys
    # in the sink and upsert; rows deleted meanwhile come back, changed rows are restored.
    ResultRow.objects.filter(id__in=sorted(atomic)[::7]).delete()
    ResultRow.objects.filter(id__in=sorted(atomic)[1::5]).update(total=-1.0, band="stale")
    again = non_atomic("test.direct-again", unregister)
    plan(again.name)
    run_until_done(spark, name=again.name)

    assert_same_rows(sink_rows(), atomic)


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_non_atomic_batch_whose_lease_was_lost_writes_nothing(
    spark: Any, spark_settings: None, formulas: dict[str, list[str]], unregister: list[str]
) -> None:
    from django.utils import timezone

    make_rows(40)
    direct = non_atomic("test.direct", unregister)
    plan(direct.name, tenants=["alice"])
    batch = batches.claim(
        worker_id="stalled", jobs=[f"{direct.name}:*"], lease=timedelta(minutes=5)
    )
    assert batch is not None
    # The worker stalls past its lease; the rescuer gives the batch back to the queue.
    WorkBatch.objects.filter(pk=batch.id).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert [r.id for r in batches.rescue_expired()] == [batch.id]

    # The stalled worker wakes up and runs its batch: every Spark task's fence refuses to write.
    prepared = execute.prepare(direct, "alice")
    spec = datastore.sink_write_spec(
        "default",
        conninfo=execute.executor_conninfo("default"),
        batch_id=batch.id,
        lease_token=str(batch.lease_token),
        sink=ResultRow._meta.db_table,
        key=direct.sink.key,
        columns=direct.sink.all_columns,
        integer_key=execute.integer_key(prepared),
    )
    with pytest.raises(Exception, match=datastore.LeaseLostInTask.MARKER):
        execute.run_range(spark, prepared, batch.start_id, batch.end_id, sink=spec)
    with pytest.raises(LeaseLost):
        batch_run.execute_batch(spark, batch)

    assert not ResultRow.objects.exists()
    row = WorkBatch.objects.get(pk=batch.id)
    assert row.state == "pending"
    assert row.rows_processed == 0


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_after_the_batch_settled_reports_no_lost_lease(
    formulas: dict[str, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    import logging
    import time

    from django.utils import timezone

    make_rows(20)
    plan(PIPELINE, batch_size=5, tenants=["alice"])
    caplog.set_level(logging.WARNING, logger="django_fairqueue.batches")
    settled = []
    for settle in ("complete", "fail", "release"):
        batch = batches.claim(worker_id="w", jobs=[f"{PIPELINE}:*"], lease=timedelta(minutes=5))
        assert batch is not None
        with batches.Heartbeat(batch, interval=0.05) as beat:
            if settle == "complete":
                with batches.fenced(batch):
                    pass
            elif settle == "fail":
                batches.fail(batch, RuntimeError("boom"), final=True)
            else:
                batches.release(batch)
            time.sleep(0.4)  # several beats after the settlement
        settled.append(beat.lost.is_set())
    assert settled == [False, False, False]
    assert "lease lost" not in caplog.text

    # A lease really lost (rescued elsewhere) is still reported.
    batch = batches.claim(worker_id="w", jobs=[f"{PIPELINE}:*"], lease=timedelta(minutes=5))
    assert batch is not None
    with batches.Heartbeat(batch, interval=0.05) as beat:
        from django.db import transaction

        with transaction.atomic():  # the row locked: no beat renews the lease in between
            WorkBatch.objects.select_for_update().get(pk=batch.id)
            WorkBatch.objects.filter(pk=batch.id).update(
                lease_expires_at=timezone.now() - timedelta(seconds=1)
            )
            assert [r.id for r in batches.rescue_expired()] == [batch.id]
        time.sleep(0.4)
    assert beat.lost.is_set()
    assert f"batch {batch.id}: lease lost" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_woken_by_the_settlement_commit_reports_no_lost_lease(
    formulas: dict[str, list[str]],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A heartbeat waits on the batch row's lock while the fence (or a failure, or a release)
    settles the batch, and wakes at its commit to find the row settled: it must know that
    this process settled it, however slowly the settling thread goes on after the commit."""
    import logging
    import time

    class SlowSettled(type(batches._settled)):  # type: ignore[misc]
        def add(self, batch: batches.ClaimedBatch) -> None:
            time.sleep(0.3)  # the settling thread, descheduled right after its commit
            super().add(batch)

    monkeypatch.setattr(batches, "_settled", SlowSettled())
    make_rows(20)
    plan(PIPELINE, batch_size=5, tenants=["alice"])
    caplog.set_level(logging.WARNING, logger="django_fairqueue.batches")
    lost = []
    for settle in ("complete", "fail", "release"):
        batch = batches.claim(worker_id="w", jobs=[f"{PIPELINE}:*"], lease=timedelta(minutes=5))
        assert batch is not None
        with batches.Heartbeat(batch, interval=0.05) as beat:
            if settle == "complete":
                with batches.fenced(batch):
                    time.sleep(0.2)  # heartbeats queue on the row lock the fence holds
            elif settle == "fail":
                batches.fail(batch, RuntimeError("boom"), final=True)
            else:
                batches.release(batch)
            time.sleep(0.4)
        assert beat.beats >= 1
        lost.append(beat.lost.is_set())
    assert lost == [False, False, False]
    assert "lease lost" not in caplog.text

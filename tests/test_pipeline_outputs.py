"""Per-tenant outputs and recomputes: the long sink (one row per source row and rule), exactly
once under re-runs; recomputing only what changed (rows by the source's changed column, every
row when a tenant's formulas change); the command and the admin's actions.

Tests that run batches need Spark (marked ``spark``); deciding and planning a recompute need
none: a successful run is simulated by completing the batches through the queue's fence.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.db.models import F
from django.test import Client

from django_fairqueue import batches
from django_fairqueue.contrib.pipeline import batch_run, datastore, execute
from django_fairqueue.contrib.pipeline.core import LongSink, Pipeline, Sink, Source, registry
from django_fairqueue.contrib.pipeline.models import PipelineJob
from django_fairqueue.contrib.pipeline.runner import PipelineRunner, cancel, plan, recompute
from django_fairqueue.models import WorkBatch
from tests.pipelineapp import pipelines
from tests.pipelineapp.models import DataRow, JsonResultRow, LongResultRow
from tests.test_pipeline import needs_spark, spark, spark_settings  # noqa: F401  (fixtures)
from tests.workerkit import wait_until

NAME = "test.json"


@pytest.fixture
def json_formulas(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    copy = {tenant: list(f) for tenant, f in pipelines.JSON_FORMULAS.items()}
    monkeypatch.setattr(pipelines, "JSON_FORMULAS", copy)
    return copy


def rows(count: int) -> None:
    made = []
    for i in range(count):
        for tenant in ("alice", "bob"):
            made.append(
                DataRow(
                    tenant=tenant,
                    price=float(1 + i % 9),
                    qty=1 + i % 5,
                    discount=0.1 if i % 2 else 0.0,
                    note=None if i % 4 == 0 else f"g{i % 3}",
                    ordered_on=dt.date(2026, 1, 1) + dt.timedelta(days=i),
                )
            )
    DataRow.objects.bulk_create(made)


def run_all(spark: Any) -> None:  # noqa: F811
    PipelineRunner(worker_id="test", pipelines=[NAME], burst=True, spark=spark).run()
    assert all(j.state == "succeeded" for j in batches.jobs(prefix=f"{NAME}:"))


def complete_without_spark(job_name: str) -> int:
    """Settle every batch of the job as succeeded (what a run does, minus the writing)."""
    done = 0
    while (
        batch := batches.claim(worker_id="t", jobs=[job_name], lease=timedelta(minutes=1))
    ) is not None:
        with batches.fenced(batch):
            pass
        done += 1
    return done


def long_rows(tenant: str) -> dict[int, dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    for row in LongResultRow.objects.filter(tenant=tenant):
        found.setdefault(row.row_id, {})[row.rule] = (row.value, row.number, row.text)
    return found


def change(tenant: str, ids: list[int], **values: Any) -> None:
    DataRow.objects.filter(tenant=tenant, pk__in=ids).update(version=F("version") + 1, **values)


# --------------------------------------------------------------------------------------------
# Declaring and checking the long sink


def test_a_long_sink_needs_a_value_column_and_source_columns() -> None:
    with pytest.raises(ValueError, match="LongSink needs a value column"):
        LongSink("t", value_column=None)
    with pytest.raises(ValueError, match="names a column twice"):
        LongSink("t", value_column="rule")
    with pytest.raises(ValueError, match=r"long sink columns \['nope'\] are not source columns"):
        Pipeline(
            name="x",
            source=Source("t", columns=["id"]),
            sink=Sink("s"),
            formulas=lambda tenant: [],
            long_sink=LongSink("l", columns=["nope"]),
        )
    pipeline = registry.get(NAME)
    with pytest.raises(ValueError, match="unknown output 'wide'"):
        pipeline.output("wide")
    assert pipeline.output("long") is pipeline.long_sink


@pytest.mark.django_db
def test_long_sink_columns_are_checked_for_their_role() -> None:
    pipeline = registry.get(NAME)
    assert pipeline.long_sink is not None
    wrong = Pipeline(
        name="test.long-wrong",
        source=pipeline.source,
        sink=pipeline.sink,
        formulas=lambda tenant: ["v = price"],
        long_sink=LongSink("pipelinetest_long_result", value_column="text"),
    )
    with pytest.raises(execute.PipelineError, match="'text' must be jsonb"):
        execute.prepare(wrong, "alice", output="long")
    prepared = execute.prepare(pipeline, "alice", output="long")
    assert [c.name for c in prepared.sink] == [
        "row_id",
        "rule",
        "value",
        "number",
        "text",
        "tenant",
    ]


# --------------------------------------------------------------------------------------------
# The long sink on Spark


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_the_long_sink_holds_what_the_json_sink_holds_one_row_per_rule(
    spark: Any,  # noqa: F811
    spark_settings: None,  # noqa: F811
    json_formulas: dict[str, list[str]],
) -> None:
    rows(100)  # 2 batches per tenant
    plan(NAME)
    run_all(spark)
    wide = {r.id: r.results for r in JsonResultRow.objects.filter(tenant="alice")}
    errors = PipelineJob.objects.get(job_name=f"{NAME}:alice").errors

    report = plan(NAME, output="long")  # a new output: the jobs are planned anew
    assert report.planned[0].created == 2
    run_all(spark)

    job = PipelineJob.objects.get(job_name=f"{NAME}:alice")
    assert job.output == "long"
    assert job.errors == errors == {"unit": 20}  # counted once per source row, as before
    # rows processed are source rows, not long rows
    processed = WorkBatch.objects.filter(job_name=f"{NAME}:alice").values_list(
        "rows_processed", flat=True
    )
    assert sum(processed) == 100
    long = long_rows("alice")
    assert long.keys() == wide.keys()
    for row_id, results in wide.items():
        got = long[row_id]
        assert set(got) == set(results)  # blanks and errors (unit when qty = 3): no row
        for rule, value in results.items():
            json_value, number, text = got[rule]
            if isinstance(value, float):
                assert json_value == pytest.approx(value)
                assert float(number) == pytest.approx(value, abs=1e-4)
                assert float(text) == pytest.approx(value)
                # as a spreadsheet shows it (2, not 2.0E0; 15 significant digits)
                assert "E" not in text and float(text) == pytest.approx(value, rel=1e-14)
                assert len(text.lstrip("-0.").replace(".", "")) <= 15
            elif isinstance(value, int):
                assert json_value == value
                assert number == Decimal(value)
                assert text == str(value)
            else:  # text and dates: no number
                assert json_value == value
                assert number is None
                assert text == value


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_the_long_sink_is_exactly_once_and_drops_rules_no_longer_computed(
    spark: Any,  # noqa: F811
    spark_settings: None,  # noqa: F811
    json_formulas: dict[str, list[str]],
) -> None:
    rows(60)
    json_formulas["bob"] = ["double = price * 2", "flag = qty > 2", "half = IF(qty > 3, price / 2)"]
    plan(NAME, tenants=["bob"], output="long")
    run_all(spark)
    first = long_rows("bob")
    assert len(first) == 60
    assert sum(len(rules) for rules in first.values()) == 60 * 2 + 24  # half: 24 rows only

    # Re-running a finished batch's range (a retry after a crash, a lost lease) changes nothing.
    batch = WorkBatch.objects.filter(job_name=f"{NAME}:bob").order_by("start_id").first()
    assert batch is not None
    prepared = batch_run.prepare_batch(registry.get(NAME), "bob", f"{NAME}:bob")
    target = prepared.target
    staging = "fq_stage_1_" + "0" * 32
    statements = datastore.create_staging(
        "default", staging=staging, sink=target.table_name, columns=target.all_columns
    )
    execute.run_range(spark, prepared, batch.start_id, batch.end_id, staging=statements)
    for _ in range(2):  # merged twice: the second merge finds nothing to do
        computed = datastore.merge_long_staging(
            "default",
            staging=staging,
            sink=target.table_name,
            id_column="row_id",
            rule_column="rule",
            columns=target.all_columns,
        )
        assert computed == batch.rows_processed
        assert long_rows("bob") == first
    datastore.drop_staging("default", staging)

    # A rule removed and a value now blank: their rows go, for every row computed again.
    json_formulas["bob"] = ["double = price * 2", "half = IF(qty > 4, price / 2)"]
    report = recompute(NAME, tenants=["bob"])
    assert report.tenants[0].scope == "all"
    run_all(spark)
    after = long_rows("bob")
    assert len(after) == 60
    assert all("flag" not in rules for rules in after.values())
    assert sum("half" in rules for rules in after.values()) == 12


# --------------------------------------------------------------------------------------------
# Recompute: deciding and planning, without Spark


@pytest.mark.django_db(transaction=True)
def test_recompute_plans_what_changed_since_the_last_successful_run(
    json_formulas: dict[str, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    rows(100)  # ids interleave alice and bob
    first = recompute(NAME)
    assert {d.tenant: (d.scope, d.reason) for d in first.tenants} == {
        "alice": ("all", "no successful run yet"),
        "bob": ("all", "no successful run yet"),
    }
    for tenant in ("alice", "bob"):
        job = PipelineJob.objects.get(job_name=f"{NAME}:{tenant}")
        assert job.watermark == "0" and job.changed_since is None and job.succeeded_at is None

    # The run is not finished: recompute refuses.
    again = recompute(NAME, tenants=["bob"])
    assert "still has 2 unfinished batches" in str(again.refused["bob"])
    assert complete_without_spark(f"{NAME}:alice") == 2
    assert complete_without_spark(f"{NAME}:bob") == 2

    # Nothing changed: nothing to do (and the runs are now the last successful ones).
    nothing = recompute(NAME)
    assert [(d.scope, d.reason) for d in nothing.tenants] == [
        ("none", "no row changed since 0"),
        ("none", "no row changed since 0"),
    ]
    assert PipelineJob.objects.get(job_name=f"{NAME}:bob").succeeded_version

    # Some rows change: only they are planned, in windows of the batch size.
    bob = list(DataRow.objects.filter(tenant="bob").order_by("id").values_list("id", flat=True))
    changed = [bob[3], bob[4], bob[40], bob[97]]
    change("bob", changed, price=100.0)
    change("alice", [DataRow.objects.filter(tenant="alice").first().pk])  # type: ignore[union-attr]
    dry = recompute(NAME, dry_run=True)
    assert {d.tenant: d.scope for d in dry.tenants} == {"alice": "all", "bob": "changed"}
    assert "tenant aggregates" in dry.tenants[0].reason  # alice's SUM(net BY note)
    assert not WorkBatch.objects.filter(state="pending").exists()  # a dry run plans nothing

    report = recompute(NAME, tenants=["bob"], batch_size=3)
    (decided,) = report.tenants
    assert (decided.scope, decided.reason) == ("changed", "rows changed since 0")
    assert decided.planned is not None and decided.planned.rows_planned == 4
    planned = WorkBatch.objects.filter(job_name=f"{NAME}:bob").order_by("start_id")
    assert [(b.start_id, b.end_id) for b in planned] == [(bob[3], bob[40]), (bob[97], bob[97])]
    job = PipelineJob.objects.get(job_name=f"{NAME}:bob")
    assert (job.changed_since, job.watermark) == ("0", "1")
    call_command("fairpipeline", "status", NAME, "--json")
    shown = {j["job"]: j for j in json.loads(capsys.readouterr().out)}
    assert shown[f"{NAME}:bob"]["changed_since"] == "0"
    assert shown[f"{NAME}:bob"]["last_success"]["watermark"] == "0"
    assert shown[f"{NAME}:alice"]["changed_since"] is None
    call_command("fairpipeline", "status", NAME)
    table = capsys.readouterr().out.splitlines()
    (bob_line,) = [line for line in table if line.startswith(f"{NAME}:bob")]
    assert bob_line.endswith("sink   changed since 0")
    complete_without_spark(f"{NAME}:bob")
    assert recompute(NAME, tenants=["bob"]).tenants[0].reason == "no row changed since 1"

    # Edited formulas: every row again, under the new version.
    json_formulas["bob"] = ["double = price * 3"]
    call_command("fairpipeline", "recompute", NAME, "--tenant", "bob")
    out = capsys.readouterr().out
    assert f"{NAME}:bob (formulas " in out
    assert "every row: formulas changed since the last successful run" in out
    assert "2 new batches (100 rows)" in out


@pytest.mark.django_db(transaction=True)
def test_cancelling_a_finished_job_keeps_its_run_as_the_last_successful_one(
    json_formulas: dict[str, list[str]],
) -> None:
    rows(20)
    recompute(NAME, tenants=["bob"])
    complete_without_spark(f"{NAME}:bob")  # finished, not yet recorded as the last success

    assert cancel(NAME, tenants=["bob"]) == {"bob": 0}

    job = PipelineJob.objects.get(job_name=f"{NAME}:bob")
    assert job.cancelled_at is not None and job.succeeded_version == job.version
    (decided,) = recompute(NAME, tenants=["bob"], dry_run=True).tenants
    assert (decided.scope, decided.reason) == ("none", "no row changed since 0")


@pytest.mark.django_db(transaction=True)
def test_a_dry_run_recompute_decides_as_a_recompute_and_writes_nothing(
    json_formulas: dict[str, list[str]],
) -> None:
    rows(20)
    recompute(NAME, tenants=["bob"])
    complete_without_spark(f"{NAME}:bob")  # finished, not yet recorded as the last success
    job = PipelineJob.objects.filter(job_name=f"{NAME}:bob")
    before = job.values().get()

    (decided,) = recompute(NAME, tenants=["bob"], dry_run=True).tenants

    # what a recompute decides, as if the finished run were recorded: it is not
    assert (decided.scope, decided.reason) == ("none", "no row changed since 0")
    assert job.values().get() == before
    assert before["succeeded_at"] is None


@pytest.mark.django_db(transaction=True)
def test_a_dry_run_recompute_with_a_refused_tenant_says_the_others_were_not_planned(
    json_formulas: dict[str, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    rows(10)
    plan(NAME, tenants=["bob"])  # bob's job is unfinished: refused; alice has none yet

    with pytest.raises(CommandError) as caught:
        call_command("fairpipeline", "recompute", NAME, "--dry-run")

    assert str(caught.value) == (
        "1 of 2 tenants not recomputed (above); the others would be (dry run)"
    )
    assert "every row: no successful run yet (dry run: nothing planned)" in capsys.readouterr().out
    assert not WorkBatch.objects.filter(job_name=f"{NAME}:alice").exists()
    with pytest.raises(CommandError, match=r"not recomputed \(above\); the others are$"):
        call_command("fairpipeline", "recompute", NAME)


def test_recompute_needs_a_known_pipeline() -> None:
    with pytest.raises(CommandError, match="no pipeline named 'nope'"):
        call_command("fairpipeline", "recompute", "nope")


@pytest.mark.django_db
def test_planning_id_ranges_is_checked() -> None:
    with pytest.raises(ValueError, match="in id order without overlap"):
        batches.plan_ranges("j", channel="c", ranges=[(5, 9, 2), (9, 12, 1)])
    with pytest.raises(ValueError, match="first <= last"):
        batches.plan_ranges("j", channel="c", ranges=[(5, 4, 1)])
    result = batches.plan_ranges("j", channel="c", ranges=[(5, 9, 2), (20, 20, 1)])
    assert (result.created, result.rows_planned, result.batches_total) == (2, 3, 2)
    with pytest.raises(ValueError, match="ranges must start after"):
        batches.plan_ranges("j", channel="c", ranges=[(15, 16, 1)])


# --------------------------------------------------------------------------------------------
# Recompute on Spark: changed rows only


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_recompute_of_changed_rows_writes_only_them(
    spark: Any,  # noqa: F811
    spark_settings: None,  # noqa: F811
    json_formulas: dict[str, list[str]],
) -> None:
    rows(100)
    plan(NAME, tenants=["bob"])
    run_all(spark)
    before = {r.id: r.results for r in JsonResultRow.objects.filter(tenant="bob")}
    ids = sorted(before)
    changed = ids[10:13]
    # Changed behind the pipeline's back: a row not marked changed keeps its old result.
    DataRow.objects.filter(pk=ids[50]).update(price=500.0)
    change("bob", changed, price=1000.0)

    report = recompute(NAME, tenants=["bob"])
    assert report.tenants[0].scope == "changed"
    run_all(spark)
    after = {r.id: r.results for r in JsonResultRow.objects.filter(tenant="bob")}
    assert {i for i in ids if after[i] != before[i]} == set(changed)
    assert all(after[i] == {"double": 2000.0} for i in changed)
    assert PipelineJob.objects.get(job_name=f"{NAME}:bob").changed_since == "0"


@contextmanager
def core_taken(spark: Any, release: Path) -> Iterator[None]:  # noqa: F811
    """The tests' one Spark core held by another job until the block ends: a job started
    meanwhile waits, active, for the core (so it can be cancelled at a known moment)."""

    def hold(batches: Iterator[Any]) -> Iterator[Any]:  # runs in a Spark Python worker
        import os
        import time

        deadline = time.monotonic() + 120
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.02)
        yield from batches

    tracker = spark.sparkContext.statusTracker()
    holder = threading.Thread(
        target=lambda: spark.range(0, 1, 1, 1).mapInArrow(hold, "id long").collect()
    )
    holder.start()
    wait_until(lambda: tracker.getActiveJobsIds(), what="the core taken")
    try:
        yield
    finally:
        release.touch()
        holder.join()


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", ["test.json", "test.lookup"])  # aggregates, lookups
def test_a_batch_cancelled_in_its_broadcast_leaves_no_broken_plan_to_the_next(
    spark: Any,  # noqa: F811
    spark_settings: None,  # noqa: F811
    json_formulas: dict[str, list[str]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    name: str,
) -> None:
    """A lost lease cancels the batch's Spark job by its tag; cancelled while it broadcast
    the tenant aggregates (or lookup rows) to the join, the job's DataFrame fails every later
    run the same way. The next batches of the job, in the same process, must still run."""
    from tests.pipelineapp.models import PriceRow

    plans = execute._Plans()
    monkeypatch.setattr(execute, "plans", plans)
    rows(100)  # alice's job: 2 batches
    PriceRow.objects.create(tenant="alice", code="g0", price=Decimal("1.50"), band="low")
    plan(name, tenants=["alice"])
    job_name = f"{name}:alice"
    prepared = batch_run.prepare_batch(registry.get(name), "alice", job_name)
    if prepared.formulas is not None and prepared.formulas.aggregates:
        batch_run.aggregate_cache.get(spark, prepared, job_name, None)  # phase one, done
    batch = batches.claim(worker_id="stalled", jobs=[job_name], lease=timedelta(minutes=5))
    assert batch is not None
    tag = "fairqueue-test-lost-lease"
    tracker = spark.sparkContext.statusTracker()

    def cancel_the_waiting_broadcast() -> None:
        # The batch's first Spark job is its broadcast's: cancel it as a lost lease does.
        wait_until(lambda: len(tracker.getActiveJobsIds()) > 1, what="the broadcast's job")
        spark.sparkContext.cancelJobsWithTag(tag)

    canceller = threading.Thread(target=cancel_the_waiting_broadcast)
    with core_taken(spark, tmp_path / "release"):
        canceller.start()
        with pytest.raises(Exception, match="SPARK_JOB_CANCELLED"):
            batch_run.execute_batch(spark, batch, job_group=tag)
        canceller.join()
    assert batches.release(batch)  # what the rescuer does once the lease expired

    stats = PipelineRunner(worker_id="t", pipelines=[name], burst=True, spark=spark).run()

    assert (stats.succeeded, stats.failed) == (2, 0)
    assert JsonResultRow.objects.filter(tenant="alice").count() == 100
    assert plans.builds == 2  # the cancelled run's plan was built anew


# --------------------------------------------------------------------------------------------
# The admin's actions


def messages(response: Any) -> str:
    """The page's messages, lower case (the admin capitalises their first letter)."""
    return " | ".join(str(m).lower() for m in response.context["messages"])


@pytest.mark.django_db(transaction=True)
def test_admin_actions_recompute_and_cancel_with_the_change_permission_only(
    json_formulas: dict[str, list[str]],
) -> None:
    rows(10)
    plan(NAME)
    job = PipelineJob.objects.get(job_name=f"{NAME}:bob")
    url = "/admin/fairqueue_pipeline/pipelinejob/"

    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_pipelinejob"))
    client = Client()
    client.force_login(viewer)
    page = client.get(url)
    assert page.status_code == 200 and b"cancel_jobs" not in page.content
    client.post(url, {"action": "cancel_jobs", "_selected_action": [job.pk]})
    job.refresh_from_db()
    assert job.cancelled_at is None  # a view-only user changes nothing
    assert client.get(f"{url}{job.pk}/change/").status_code == 200  # read-only page

    operator = User.objects.create_user("operator", password="pw", is_staff=True)
    operator.user_permissions.add(Permission.objects.get(codename="change_pipelinejob"))
    client.force_login(operator)
    assert b"recompute_jobs" in client.get(url).content
    response = client.post(
        url, {"action": "recompute_jobs", "_selected_action": [job.pk]}, follow=True
    )
    assert "still has 1 unfinished batches" in messages(response)
    response = client.post(
        url, {"action": "cancel_jobs", "_selected_action": [job.pk]}, follow=True
    )
    assert f"{NAME}:bob: cancelled, 1 pending batches dropped" in messages(response)
    job.refresh_from_db()
    assert job.cancelled_at is not None
    response = client.post(
        url, {"action": "recompute_jobs", "_selected_action": [job.pk]}, follow=True
    )
    assert f"{NAME}:bob: every row (no successful run yet), 1 batches planned" in (
        messages(response)
    )
    job.refresh_from_db()
    assert job.cancelled_at is None
    assert WorkBatch.objects.filter(job_name=f"{NAME}:bob", state="pending").count() == 1

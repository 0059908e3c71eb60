"""The pipeline as an app of its own: its model taken over from the queue without losing a row,
its settings, its admin. No Spark here: these run without the spark extra."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.core.checks import run_checks
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader
from django.test import Client
from django.utils import timezone

from django_fairqueue import conf
from django_fairqueue.contrib.pipeline import appconf
from django_fairqueue.contrib.pipeline.models import PipelineJob
from django_fairqueue.contrib.pipeline.spark import spark_settings
from django_fairqueue.models import WorkBatch
from tests.test_migrations import replaced_chain

APP = "fairqueue_pipeline"


def _move() -> tuple[tuple[str, str], tuple[str, str]]:
    """The queue's migration that gave the model up (the one the app's first migration
    follows), and the one before it, among those the squashed initial migration replaces."""
    graph = MigrationLoader(None, ignore_no_migrations=True, replace_migrations=False).graph
    (move,) = [p for p in graph.node_map[(APP, "0001_initial")].parents if p[0] == "fairqueue"]
    (before,) = [p for p in graph.node_map[move].parents if p[0] == "fairqueue"]
    return move.key, before.key


MOVE, BEFORE_THE_MOVE = _move()


def table_oid() -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT 'fairqueue_pipeline_job'::regclass::oid")
        return int(cur.fetchone()[0])


@pytest.mark.django_db(transaction=True)
def test_migrating_from_before_the_move_keeps_the_jobs_and_their_permissions() -> None:
    executor = replaced_chain()
    oid = table_oid()
    try:
        # A database as the previous release left it: the job model in the queue's app.
        executor.migrate([BEFORE_THE_MOVE, (APP, None)])
        old = executor.loader.project_state([BEFORE_THE_MOVE]).apps
        OldJob = old.get_model("fairqueue", "PipelineJob")
        job = OldJob.objects.create(
            job_name="analytics.enrich:acme",
            pipeline="analytics.enrich",
            tenant="acme",
            version="3f2a9c1d0b7e4411",
            formulas=[["total", "price * qty"]],
            today=dt.date(2026, 11, 25),
            errors={"total": 2},
        )
        # ... with an operator allowed to view jobs, through the old content type (unapplying
        # the app's migration gave the new one back to the queue).
        ContentType.objects.clear_cache()
        assert not ContentType.objects.filter(app_label=APP).exists()
        old_type, _ = ContentType.objects.get_or_create(app_label="fairqueue", model="pipelinejob")
        view, _ = Permission.objects.get_or_create(
            content_type=old_type,
            codename="view_pipelinejob",
            defaults={"name": "Can view pipeline job"},
        )
        operator = User.objects.create_user("operator", password="pw", is_staff=True)
        operator.user_permissions.add(view)

        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())

        ContentType.objects.clear_cache()
        moved = PipelineJob.objects.get()
        assert (moved.pk, moved.job_name, moved.version) == (job.pk, job.job_name, job.version)
        assert moved.formulas == [["total", "price * qty"]]
        assert moved.errors == {"total": 2}
        assert table_oid() == oid  # the same table: nothing dropped, nothing copied
        operator = User.objects.get(pk=operator.pk)
        assert operator.has_perm(f"{APP}.view_pipelinejob")
        assert not ContentType.objects.filter(app_label="fairqueue", model="pipelinejob").exists()

        # And back: the queue's state has the model again, the row still there.
        executor = replaced_chain()
        executor.migrate([BEFORE_THE_MOVE, (APP, None)])
        old = replaced_chain().loader.project_state([BEFORE_THE_MOVE]).apps
        assert old.get_model("fairqueue", "PipelineJob").objects.get().pk == job.pk
        assert ContentType.objects.filter(app_label="fairqueue", model="pipelinejob").exists()
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())


def test_the_queue_state_no_longer_has_the_model() -> None:
    assert MOVE[1].endswith("_pipeline_job_to_its_app")
    loader = MigrationLoader(None, ignore_no_migrations=True, replace_migrations=False)
    queue = loader.project_state([MOVE]).apps
    with pytest.raises(LookupError):
        queue.get_model("fairqueue", "PipelineJob")
    app = loader.project_state([(APP, "0001_initial")]).apps
    assert app.get_model(APP, "PipelineJob")._meta.db_table == "fairqueue_pipeline_job"


def test_the_old_spark_setting_is_refused_with_where_it_went(settings: Any) -> None:
    settings.FAIRQUEUE = {**settings.FAIRQUEUE, "SPARK": {"MASTER": "local[1]"}}
    with pytest.raises(ValueError, match=r"FAIRQUEUE\['SPARK'\] is now FAIRQUEUE_PIPELINE"):
        conf.get()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], r"FAIRQUEUE_PIPELINE must be a dict, got list"),
        ({"SPARKS": {}}, r"FAIRQUEUE_PIPELINE has unknown keys \['SPARKS'\]"),
        ({"SPARK": "local"}, r"FAIRQUEUE_PIPELINE\['SPARK'\] must be a dict, got str"),
        ({"SPARK": {"MASTER": ""}}, r"FAIRQUEUE_PIPELINE\['SPARK'\]\['MASTER'\] must be"),
        ({"TIME_ZONE": "Mars/Olympus"}, r"unknown time zone 'Mars/Olympus' \(an IANA name"),
    ],
)
def test_bad_pipeline_settings_fail_the_system_check(
    settings: Any, value: Any, message: str
) -> None:
    settings.FAIRQUEUE_PIPELINE = value
    with pytest.raises(ValueError, match=message) as raised:
        spark_settings()
    errors = [e for e in run_checks() if e.id == "fairqueue_pipeline.E001"]
    assert [e.msg for e in errors] == [str(raised.value)]  # the same words at start-up


def test_no_pipeline_setting_means_the_defaults(settings: Any) -> None:
    del settings.FAIRQUEUE_PIPELINE
    assert appconf.get() == {"SPARK": {}, "TIME_ZONE": "UTC"}  # not Django's TIME_ZONE
    assert spark_settings().master == "local[2]"
    assert [e for e in run_checks() if e.id.startswith("fairqueue_pipeline")] == []


@pytest.mark.django_db
def test_the_admin_lists_jobs_under_the_app(admin_client: Client) -> None:
    PipelineJob.objects.create(
        job_name="p:acme", pipeline="p", tenant="acme", version="v1", today=dt.date(2026, 1, 1)
    )
    response = admin_client.get("/admin/fairqueue_pipeline/pipelinejob/")
    assert response.status_code == 200
    assert b"p:acme" in response.content
    assert admin_client.get("/admin/fairqueue/pipelinejob/").status_code == 404


@pytest.mark.django_db
def test_each_complete_run_is_recorded_as_the_last_success_even_of_the_same_version() -> None:
    job = PipelineJob.objects.create(
        job_name="p:acme", pipeline="p", tenant="acme", version="v1", today=dt.date(2026, 1, 1)
    )
    no_batches = WorkBatch.objects.none()  # nothing left to succeed: the run is complete
    job.record_success(no_batches)
    first = PipelineJob.objects.get(pk=job.pk).succeeded_at
    assert first is not None and first >= job.created_at
    job.record_success(no_batches)  # the same run again: nothing written
    assert PipelineJob.objects.get(pk=job.pk).succeeded_at == first
    job.created_at = timezone.now()  # a new run of the same version, output and watermark
    job.save(update_fields=["created_at"])
    job.record_success(no_batches)
    assert PipelineJob.objects.get(pk=job.pk).succeeded_at >= job.created_at > first


def test_today_and_now_are_read_in_the_pipelines_zone_per_tenant(settings: Any) -> None:
    from django_fairqueue.contrib.pipeline import execute
    from django_fairqueue.contrib.pipeline.core import Pipeline, Sink, Source

    settings.TIME_ZONE = "America/Chicago"  # Django's zone plays no part
    zones = {"tokyo": "Asia/Tokyo", "bad": "Nope/Zone"}
    pipeline = Pipeline(name="tz.test", source=Source("t", columns=["id"]), sink=Sink("s"),
                        formulas=lambda tenant: [], time_zone=zones.get)  # fmt: skip
    moment = dt.datetime(2026, 11, 25, 20, 30, 15, 999, tzinfo=dt.UTC)
    assert execute.local_time(pipeline, "tokyo", moment) == dt.datetime(2026, 11, 26, 5, 30, 15)
    assert execute.local_time(pipeline, "other", moment) == dt.datetime(2026, 11, 25, 20, 30, 15)
    settings.FAIRQUEUE_PIPELINE = {"TIME_ZONE": "Europe/Paris"}
    assert execute.local_time(pipeline, "other", moment) == dt.datetime(2026, 11, 25, 21, 30, 15)
    with pytest.raises(execute.PipelineError, match="tenant 'bad': unknown time zone 'Nope/Zone'"):
        execute.local_time(pipeline, "bad", moment)


def test_names_given_as_one_string_are_refused_not_split_into_letters() -> None:
    """`channels="acme"` would claim for the channels a, c, m and e: a TypeError instead, as
    WorkerConfig and exactly_once.batch() refuse it."""
    from django_fairqueue.contrib.pipeline.core import Pipeline
    from django_fairqueue.contrib.pipeline.runner import PipelineRunner

    for kwargs in ({"channels": "acme"}, {"pipelines": "enrich"}):
        with pytest.raises(TypeError, match="must be a list of names, not a string"):
            PipelineRunner(worker_id="w", **kwargs)
    with pytest.raises(TypeError, match="functions must be function names"):
        Pipeline(name="p", source=None, sink=None, formulas=lambda t: {}, functions="SUM")  # type: ignore[arg-type]

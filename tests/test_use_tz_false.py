"""A project that keeps ``USE_TZ = False``: every admin page of the app and every
``manage.py fairqueue`` report work, and show their times in ``TIME_ZONE`` as Django would.

Django then reads naive wall-clock times in ``TIME_ZONE`` (the ORM, ``timezone.now()``) while
the queue's own statements read aware ones; each test runs with data written the way a worker
and the Python API write it under those settings, then reads it back through the views. The
zone is five hours behind UTC in January (the fixed moments below), so a time shown in UTC, or
a naive UTC time taken for a local one, is five hours off.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from typing import Any
from unittest import mock
from zoneinfo import ZoneInfo

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone

from django_fairqueue import api, schedules, stats
from django_fairqueue.db import message_store
from django_fairqueue.models import (
    Channel,
    ChannelGroup,
    Message,
    Schedule,
    WorkBatch,
    WorkerRecord,
)
from django_fairqueue.runtime import worker_registry
from django_fairqueue.tasks.django_compat import TaskContext, TaskResultStatus, task
from django_fairqueue.testing import drain
from tests.factories import NOOP, channel_ids, enqueue

pytestmark = pytest.mark.django_db

ZONE = "America/New_York"
NEW_YORK = ZoneInfo(ZONE)
LEASE = timedelta(minutes=5)
FAILURE = {"type": "builtins.ValueError", "message": "bad", "traceback": "Traceback ..."}

#: Fixed moments, in UTC, and as a page in New York shows them (UTC-5 in January).
ENQUEUED = datetime(2026, 1, 15, 14, 4, 5, tzinfo=UTC)
CLAIMED = datetime(2026, 1, 15, 15, 0, 0, tzinfo=UTC)
FINISHED = datetime(2026, 1, 15, 16, 30, 0, tzinfo=UTC)
STARTED = datetime(2026, 1, 15, 17, 45, 30, tzinfo=UTC)
SHOWN = {
    ENQUEUED: "2026-01-15 09:04:05",
    CLAIMED: "2026-01-15 10:00:00",
    FINISHED: "2026-01-15 11:30:00",
    STARTED: "2026-01-15 12:45:30",
}


@pytest.fixture
def naive() -> Iterator[None]:
    with override_settings(USE_TZ=False, TIME_ZONE=ZONE):
        assert timezone.is_naive(timezone.now())
        yield


def stamp(sql: str, params: list[Any]) -> None:
    with connection.cursor() as cur:
        cur.execute(sql, params)


def cid(name: str) -> int:
    return channel_ids([name])[name]


def flush(channel: str, at: datetime, *, ok: int, run_ms: float) -> None:
    """What a worker's recorder flushes after ``ok`` attempts settled at ``at``."""
    recorder = stats.StatsRecorder()
    for _ in range(ok):
        recorder.record_settled(cid(channel), "succeeded", run_ms / ok, at=at)
    recorder.flush()


def yesterday_in_new_york() -> date:
    return datetime.now(NEW_YORK).date() - timedelta(days=1)


@pytest.fixture
def queue(naive: None) -> dict[str, Any]:
    """Ready, running, succeeded and failed messages, a live worker, statistics, usage, a
    fired schedule, a group, a work batch: written under USE_TZ = False."""
    (oldest, *_) = enqueue("alpha", 3)
    stamp(
        "UPDATE fairqueue_message SET enqueued_at = %s, run_at = %s WHERE id = %s",
        [ENQUEUED, ENQUEUED, oldest],
    )
    enqueue(("tenant", "acme"), 2)
    assert drain("tenant/acme") == 2  # succeeded, counted in the statistics as a worker does
    enqueue("gamma", 1)
    (dead,) = message_store.claim_messages(
        1, lease=LEASE, worker_id="w-1", only_channel_ids=[cid("gamma")], quantum=1
    )
    assert message_store.fail_messages([(dead.id, dead.lease_token, FAILURE, None)]) == {
        dead.id: "failed"
    }
    stamp("UPDATE fairqueue_message SET finished_at = %s WHERE id = %s", [FINISHED, dead.id])
    worker_registry.Registration("w-1", concurrency=4).register()
    enqueue("beta", 2)
    (running,) = message_store.claim_messages(
        1, lease=LEASE, worker_id="w-1", only_channel_ids=[cid("beta")], quantum=1
    )
    stamp("UPDATE fairqueue_message SET claimed_at = %s WHERE id = %s", [CLAIMED, running.id])
    stamp(
        "UPDATE fairqueue_worker SET started_at = %s, last_claim_at = %s WHERE worker_id = %s",
        [STARTED, CLAIMED, "w-1"],
    )
    yesterday = yesterday_in_new_york()
    at = timezone.make_aware(datetime.combine(yesterday, datetime.min.time()), NEW_YORK)
    flush("alpha", at + timedelta(hours=9), ok=4, run_ms=7_200_000)
    acme = Channel.objects.get(name="tenant/acme")
    schedule = Schedule.objects.create(name="s", channel=acme, task_name=NOOP, cron="@daily")
    schedules.fire_due()  # the scheduler's pass (a worker's): the schedule's next fire time
    now = timezone.now()
    batch = WorkBatch.objects.create(
        job_name="j", channel=acme, start_id=1, end_id=9, row_count=9, state="succeeded",
        started_at=now, finished_at=now,
    )  # fmt: skip
    return {
        "oldest": oldest,
        "dead": dead.id,
        "running": running.id,
        "schedule": schedule,
        "batch": batch,
        "acme": acme,
        "yesterday": yesterday,
    }


def text_of(response: Any) -> str:
    assert response.status_code == 200
    return str(response.content.decode())


def test_every_admin_page_of_the_app_renders_with_its_times_in_time_zone(
    admin_client: Client, queue: dict[str, Any]
) -> None:
    from django_fairqueue.contrib.pipeline.models import PipelineJob

    job = PipelineJob.objects.create(
        job_name="p:acme", pipeline="p", tenant="acme", version="v1", today=date(2026, 1, 1)
    )
    job.record_success(WorkBatch.objects.none())
    worker = WorkerRecord.objects.get(worker_id="w-1")
    group = ChannelGroup.objects.get(name="tenant")
    channels = reverse("admin:fairqueue_channel_changelist")
    messages = reverse("admin:fairqueue_message_changelist")
    workers = reverse("admin:fairqueue_workerrecord_changelist")
    pages = {
        channels: [f"ready since {SHOWN[ENQUEUED]}"],
        f"{channels}?o=9": [],  # sorted by the oldest ready
        reverse("admin:fairqueue_channel_change", args=[cid("alpha")]): [SHOWN[ENQUEUED]],
        reverse("admin:fairqueue_channel_change", args=[queue["acme"].pk]): [],
        reverse("admin:fairqueue_channel_dashboard"): [],
        messages: [f"claimed at {SHOWN[CLAIMED]}"],
        f"{messages}?state__exact=failed": [SHOWN[FINISHED]],
        reverse("admin:fairqueue_message_change", args=[queue["running"]]): [SHOWN[CLAIMED]],
        reverse("admin:fairqueue_message_change", args=[queue["oldest"]]): [SHOWN[ENQUEUED]],
        reverse("admin:fairqueue_message_change", args=[queue["dead"]]): [SHOWN[FINISHED]],
        reverse("admin:fairqueue_workbatch_changelist"): [],
        reverse("admin:fairqueue_workbatch_change", args=[queue["batch"].pk]): [],
        reverse("admin:fairqueue_channelgroup_changelist"): [],
        reverse("admin:fairqueue_channelgroup_change", args=[group.pk]): [],
        reverse("admin:fairqueue_schedule_changelist"): ["(in "],
        reverse("admin:fairqueue_schedule_change", args=[queue["schedule"].pk]): ["(in "],
        reverse("admin:fairqueue_usagehour_changelist"): [">alpha<", "7,200.0 s"],
        workers: [SHOWN[STARTED], SHOWN[CLAIMED]],
        f"{workers}?state=alive": ["w-1"],
        reverse("admin:fairqueue_workerrecord_change", args=[worker.pk]): [SHOWN[STARTED]],
        reverse("admin:fairqueue_workerrecord_busy"): [SHOWN[CLAIMED], "w-1"],
        "/admin/fairqueue_pipeline/pipelinejob/": [],
        f"/admin/fairqueue_pipeline/pipelinejob/{job.pk}/change/": [],
    }
    for url, shown in pages.items():
        html = text_of(admin_client.get(url))
        for expected in shown:
            assert expected in html, (url, expected)
    html = text_of(admin_client.get(workers))
    assert re.search(r"\(\d+s ago\)", html)  # the beat, aged on the database's clock
    data = admin_client.get(reverse("admin:fairqueue_channel_dashboard_data")).json()
    # the two messages drained above, in the per-minute series
    assert sum(minute["claimed"] for minute in data["series"]) == 2
    (alpha,) = [t for t in data["tenants"] if t["name"] == "alpha"]
    assert alpha["oldest_ready_age_seconds"] > 86400 and alpha["ready"] == 3


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("fairqueue", *args, stdout=out)
    return out.getvalue()


def test_the_fairqueue_reports_run_with_their_times_in_time_zone(queue: dict[str, Any]) -> None:
    text = run("status")
    assert re.search(r"^alpha\s+default\s+3\s", text, re.MULTILINE)
    assert "1 live worker" in text
    status = json.loads(run("status", "--json"))
    (alpha,) = [c for c in status["channels"] if c["name"] == "alpha"]
    assert datetime.fromisoformat(alpha["oldest_ready_since"]) == ENQUEUED
    assert status["totals"]["succeeded"] == 2 and status["totals"]["failed"] == 1
    assert re.search(r"^alpha\s+default\s+3\s", run("status", "alpha"), re.MULTILINE)
    assert run("status", "--sort", "age").index("alpha") < run("status").index("beta")
    with mock.patch("django_fairqueue.cli.status.time.sleep", side_effect=KeyboardInterrupt):
        watched = run("status", "--watch", "5")
    shown = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) (\w+), every 5s", watched)
    assert shown is not None, watched
    now = datetime.now(NEW_YORK)
    assert shown.group(2) == f"{now:%Z}"  # EST or EDT, not UTC
    at = datetime.strptime(shown.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=NEW_YORK)
    assert abs((now - at).total_seconds()) < 5

    yesterday = queue["yesterday"]
    text = run("usage")
    assert f"Usage for {yesterday} ({ZONE})" in text and "7,200.0 s" in text
    usage = json.loads(run("usage", "--json"))
    midnight = datetime.combine(yesterday, datetime.min.time())
    assert datetime.fromisoformat(usage["from"]) == timezone.make_aware(midnight, NEW_YORK)
    assert [r["name"] for r in usage["rows"]] == ["alpha"]

    text = run("workers")
    assert re.search(r"^w-1\s+alive\s", text, re.MULTILINE) and "1 live of 1" in text
    (w,) = json.loads(run("workers", "--json"))
    assert datetime.fromisoformat(w["started_at"]) == STARTED
    assert datetime.fromisoformat(w["last_claim_at"]) == CLAIMED

    text = run("failures", "list")
    assert SHOWN[FINISHED] in text
    text = run("schedules")
    assert re.search(r"\bs\s+tests\.noop\s+@daily\s+UTC\s+in \d+h", text)


def test_a_naive_run_after_is_a_wall_clock_time_in_time_zone(
    naive: None, admin_client: Client
) -> None:
    at = datetime(2030, 1, 15, 9, 0)  # 14:00 UTC
    (mid,) = api.enqueue_many([api.EnqueueRequest(NOOP, (), channel="later", run_after=at)])
    with connection.cursor() as cur:
        cur.execute("SELECT run_at AT TIME ZONE 'UTC' FROM fairqueue_message WHERE id = %s", [mid])
        assert cur.fetchone()[0] == datetime(2030, 1, 15, 14, 0)
    assert Message.objects.get(pk=mid).run_at == at  # as Django reads it back
    html = text_of(admin_client.get(reverse("admin:fairqueue_message_change", args=[mid])))
    assert "delayed until 2030-01-15 09:00:00" in html


@task(takes_context=True)
def times(context: TaskContext) -> dict[str, Any]:
    result = context.task_result
    return {
        "naive": [timezone.is_naive(result.enqueued_at), timezone.is_naive(result.started_at)],
        "waited": (result.started_at - result.enqueued_at).total_seconds(),
    }


def test_a_django_task_sees_its_times_as_django_gives_them(naive: None) -> None:
    result = times.enqueue()
    assert drain() == 1
    done = times.get_result(result.id)
    assert done.status == TaskResultStatus.SUCCESSFUL, done.errors
    assert done.return_value["naive"] == [True, True]
    assert 0 <= done.return_value["waited"] < 60
    assert timezone.is_naive(done.enqueued_at) and timezone.is_naive(done.finished_at)

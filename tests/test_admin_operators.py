"""What a support engineer reads in an incident, checked page by page: no live worker is never
shown as work running, starvation under a real backlog is findable (last served, "served
nothing while backlogged", sortable recent figures), paused is visible beside the name, and
the workers page (second precision, filters matching the state column, what a dead worker ran
or lost, children under their supervisor, what each worker runs now)."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from django_fairqueue import stats
from django_fairqueue.admin import ChannelAdmin
from django_fairqueue.db import message_store, stats_store, worker_store
from django_fairqueue.models import Channel, Message, WorkerRecord
from django_fairqueue.runtime import worker_registry
from tests.factories import channel_ids, enqueue

pytestmark = pytest.mark.django_db

CHANNELS = reverse("admin:fairqueue_channel_changelist")
DASHBOARD = reverse("admin:fairqueue_channel_dashboard")
DASHBOARD_DATA = reverse("admin:fairqueue_channel_dashboard_data")
WORKERS = reverse("admin:fairqueue_workerrecord_changelist")
LEASE = timedelta(minutes=5)


def cid(name: str) -> int:
    return channel_ids([name])[name]


def names(response: Any) -> list[str]:
    assert response.status_code == 200
    return [obj.name for obj in response.context["cl"].result_list]


def column(name: str) -> int:
    return ["action_checkbox", *ChannelAdmin.list_display].index(name)


def running_cell(html: str, channel: str) -> str:
    row = html[html.index(f">{channel}</a>") :]
    found = re.search(r'<td class="field-running_display">(.*?)</td>', row)
    assert found is not None
    return found.group(1)


# ------------------------------------------------------------------------------------------
# no live worker


def test_with_every_worker_stopped_running_counts_do_not_look_alive(
    admin_client: Client,
) -> None:
    worker_registry.Registration("w-1", concurrency=4).register()
    enqueue("capped", 3)
    Channel.objects.filter(name="capped").update(max_concurrency=2)
    # (claimed by a consumer outside the registry, as exactly-once claims are: a registered
    # worker that stops expires the leases it leaves)
    assert len(message_store.claim_messages(5, lease=LEASE, worker_id="consumer")) == 2
    html = admin_client.get(CHANNELS).content.decode()
    assert running_cell(html, "capped") == '<span class="fq-at-cap" title="at cap">2 / 2</span>'
    assert admin_client.get(DASHBOARD_DATA).json()["workers"]["live"] == 1

    worker_store.deregister_worker("w-1", handled=0)  # every worker stopped; the leases still held
    html = admin_client.get(CHANNELS).content.decode()
    assert "no live worker" in running_cell(html, "capped")
    assert 'class="fq-stale"' in running_cell(html, "capped")
    data = admin_client.get(DASHBOARD_DATA).json()
    assert data["workers"]["live"] == 0 and data["workers"]["stopped"] == 1
    assert data["totals"]["running"] == 2
    page = admin_client.get(DASHBOARD).content.decode()
    assert "running: no live worker" in page and "fq-card-warn" in page
    change = admin_client.get(reverse("admin:fairqueue_channel_change", args=[cid("capped")]))
    assert "no live worker: nothing runs until one starts" in change.content.decode()

    # a live worker again, one lease expired and not rescued yet: said beside the count
    worker_registry.Registration("w-2", concurrency=4).register()
    first = Message.objects.filter(state="running").order_by("pk").first()
    assert first is not None
    Message.objects.filter(pk=first.pk).update(lease_expires_at=timezone.now() - LEASE)
    html = admin_client.get(CHANNELS).content.decode()
    assert "1 lease expired" in running_cell(html, "capped")
    data = admin_client.get(DASHBOARD_DATA).json()
    assert data["expired_leases"] == 1 and data["tenants"][0]["expired_leases"] == 1


# ------------------------------------------------------------------------------------------
# starvation under a backlog


def age_backlog(name: str, minutes: float) -> None:
    Message.objects.filter(channel__name=name).update(
        enqueued_at=timezone.now() - timedelta(minutes=minutes),
        run_at=timezone.now() - timedelta(minutes=minutes),
    )


def served_ago(name: str, minutes: float | None) -> None:
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE fairqueue_channel SET last_claimed_at = %s WHERE name = %s",
            [None if minutes is None else timezone.now() - timedelta(minutes=minutes), name],
        )


def test_served_nothing_while_backlogged_finds_the_starving_not_every_old_backlog(
    admin_client: Client,
) -> None:
    for name in ("served", "starved", "never", "paused", "fresh"):
        enqueue(name, 3)
    for name in ("served", "starved", "never", "paused"):
        age_backlog(name, 10)  # every oldest message is ten minutes old
    served_ago("served", 0.5)  # the round reaches it: not starving
    served_ago("starved", 8)
    served_ago("never", None)
    served_ago("paused", 30)
    Channel.objects.filter(name="paused").update(paused=True)
    served_ago("fresh", None)  # backlogged a moment ago: nobody passed it over yet
    assert set(names(admin_client.get(CHANNELS, {"starving": 60}))) == {
        "served",
        "starved",
        "never",
        "paused",
    }
    assert set(names(admin_client.get(CHANNELS, {"unserved": 5}))) == {"starved", "never"}
    assert set(names(admin_client.get(CHANNELS, {"unserved": 9}))) == {"never"}
    assert names(admin_client.get(CHANNELS, {"unserved": "x"})) == []
    html = admin_client.get(CHANNELS).content.decode()
    row = html[html.index(">starved</a>") :]
    assert re.search(r'<span title="[0-9-]+ [0-9:]+" class="fq-failed">8m 0\ds ago</span>', row)
    # paused beside the name, whatever the width of the screen
    assert 'paused <span class="fq-badge fq-paused">paused</span>' in html
    # the list sorts by when each was last served
    by_served = names(admin_client.get(CHANNELS, {"o": str(column("last_served_display"))}))
    assert by_served[:3] == ["paused", "starved", "served"]


@pytest.mark.parametrize("parameter", ["starving", "unserved"])
def test_a_wait_filter_past_the_calendar_or_not_a_number_lists_none(
    admin_client: Client, parameter: str
) -> None:
    for name in ("old", "new"):
        enqueue(name, 1)
    age_backlog("old", 10)
    for value in ("10000000000", "2147483647", "99999999999999999999", "1e300", "inf", "nan"):
        # a wait longer than the calendar goes back: nobody waited that long
        assert names(admin_client.get(CHANNELS, {parameter: value})) == [], value
    # a negative wait is none at all: every channel with a message ready
    for value in ("-inf", "-1e300", "-5"):
        assert set(names(admin_client.get(CHANNELS, {parameter: value}))) == {"old", "new"}, value
    assert set(names(admin_client.get(CHANNELS, {parameter: "5"}))) == {"old"}


def test_wait_served_and_finished_of_the_last_minutes_are_sortable(admin_client: Client) -> None:
    for name in ("a", "b", "c"):
        enqueue(name, 1)
    minute = stats.minute_of(timezone.now())
    hist = [0] * stats.N_BUCKETS
    rows = []
    for name, served, wait_ms in (("a", 5, 3000), ("b", 50, 10), ("c", 1, 700)):
        h = list(hist)
        h[stats.bucket_of(wait_ms)] = served
        rows.append(
            stats_store.ChannelMinuteStats(
                cid(name),
                minute,
                claimed=served,
                succeeded=served,
                wait_ms_sum=wait_ms * served,
                wait_ms_max=wait_ms,
                wait_histogram=tuple(h),
            )
        )
    stats_store.record_channel_stats(rows)
    enqueue("idle", 1)  # nothing in the window: last, whatever the direction

    def order(col: str, descending: bool = False) -> list[str]:
        index = column(col)
        return names(admin_client.get(CHANNELS, {"o": f"-{index}" if descending else index}))

    assert order("wait_display") == ["b", "c", "a", "idle"]
    assert order("wait_display", descending=True) == ["a", "c", "b", "idle"]
    assert order("served_display", descending=True) == ["b", "a", "c", "idle"]
    assert order("finished_display") == ["c", "a", "b", "idle"]


def test_the_admin_guide_lists_the_channel_lists_columns_in_their_order() -> None:
    """docs/howto/admin.md, "The channel list": one table row per column, in the list's order
    ("The columns come in that order")."""
    from pathlib import Path

    from django.contrib import admin
    from django.contrib.admin.utils import label_for_field

    channel_admin = admin.site._registry[Channel]
    headers = [
        str(label_for_field(name, Channel, channel_admin)).lower()
        for name in ChannelAdmin.list_display
    ]
    doc = (Path(__file__).parents[1] / "docs/howto/admin.md").read_text()
    section = doc.split("## The channel list", 1)[1].split("\n## ", 1)[0]
    table = section.split("| column | meaning |\n| --- | --- |\n", 1)[1].split("\n\n", 1)[0]
    assert [line.split("|")[1].strip() for line in table.splitlines()] == headers


# ------------------------------------------------------------------------------------------
# metrics


def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from django_fairqueue import metrics

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in metrics.REGISTRY.collect()
        for s in family.samples
    }


def series(samples: dict[Any, float], name: str) -> set[str]:
    return {dict(k[1])["channel"] for k in samples if k[0] == name}


def test_metrics_keep_every_channels_series_from_scrape_to_scrape(settings: Any) -> None:
    # the age series of a channel that waits, then is served, then waits again, stays; the
    # top-20 of before made it appear and vanish, resetting every `for: 5m` rule
    for i in range(30):
        enqueue(f"t{i:02}", 1)
    enqueue("idle", 1)
    message_store.claim_messages(1, lease=LEASE, worker_id="w", only_channel_ids=[cid("idle")])
    first = scrape()
    ages = series(first, "fairqueue_oldest_ready_age_seconds")
    assert ages == {f"t{i:02}" for i in range(30)} | {"idle", "(all)"}
    assert (
        first[("fairqueue_oldest_ready_age_seconds", (("channel", "idle"), ("queue", "default")))]
        == 0
    )
    assert series(scrape(), "fairqueue_oldest_ready_age_seconds") == ages
    settings.FAIRQUEUE_METRICS_MAX_CHANNELS = 5  # a bound, the first by queue and name
    assert series(scrape(), "fairqueue_oldest_ready_age_seconds") == {
        "idle",
        "t00",
        "t01",
        "t02",
        "t03",
        "(all)",
    }


def test_a_paused_tenant_has_a_paused_series_the_documented_alert_excludes() -> None:
    enqueue("asleep", 1)
    enqueue("awake", 1)
    Channel.objects.filter(name="asleep").update(paused=True)
    samples = scrape()
    paused = {
        dict(k[1])["channel"]: v for k, v in samples.items() if k[0] == "fairqueue_channel_paused"
    }
    assert paused == {"asleep": 1.0, "awake": 0.0}
    # the documented rule: ... unless on(channel, queue) fairqueue_channel_paused == 1
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs/howto/observability.md").read_text()
    assert "unless on(channel, queue) fairqueue_channel_paused == 1" in doc


def test_failures_retries_and_usage_carry_the_channel(queue_with_failures: None) -> None:
    samples = scrape()
    key = ("channel", "flaky"), ("kind", "raised"), ("queue", "default")
    assert samples[("fairqueue_channel_failures_last_5m", key)] == 2
    assert (
        samples[("fairqueue_channel_retrying", (("channel", "flaky"), ("queue", "default")))] == 2
    )
    flaky = (("channel", "flaky"), ("queue", "default"))
    assert samples[("fairqueue_channel_failures_total", flaky)] == 2
    assert samples[("fairqueue_channel_worker_seconds_total", flaky)] == 1.5
    calm = (("channel", "calm"), ("queue", "default"))
    assert samples[("fairqueue_channel_attempts_total", calm)] == 0


@pytest.fixture
def queue_with_failures() -> None:
    enqueue("calm", 1)
    enqueue("flaky", 2)
    claimed = message_store.claim_messages(
        2, lease=LEASE, worker_id="w", only_channel_ids=[cid("flaky")], quantum=2
    )
    error = {"type": "ValueError", "message": "boom"}
    message_store.fail_messages([(m.id, m.lease_token, error, timedelta(hours=1)) for m in claimed])
    recorder = stats.StatsRecorder()
    for _ in claimed:
        recorder.record_settled(cid("flaky"), "retried", 750.0)
    recorder.flush()


# ------------------------------------------------------------------------------------------
# the workers page


def register(worker_id: str, supervisor: str = "", concurrency: int = 4) -> None:
    import os
    from unittest import mock

    env = {worker_registry.SUPERVISOR_ENV: supervisor} if supervisor else {}
    with mock.patch.dict(os.environ, env, clear=False):
        if not supervisor:
            os.environ.pop(worker_registry.SUPERVISOR_ENV, None)
        worker_registry.Registration(worker_id, concurrency=concurrency).register()


def beat_ago(worker_id: str, seconds: float) -> None:
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE fairqueue_worker SET heartbeat_at = clock_timestamp() - %s * interval '1s' "
            "WHERE worker_id = %s",
            [seconds, worker_id],
        )


def worker_rows(response: Any) -> list[str]:
    assert response.status_code == 200
    return [w.worker_id for w in response.context["cl"].result_list]


def test_the_workers_page_filters_by_the_states_it_shows_to_the_second(
    admin_client: Client,
) -> None:
    for worker_id in ("alive-1", "silent-1", "dead-1", "gone-1", "stopped-1"):
        register(worker_id)
    beat_ago("silent-1", 20)  # 3 beats late (WORKER_HEARTBEAT 5 s)
    beat_ago("dead-1", 40)  # past WORKER_DEAD_AFTER, not marked yet
    beat_ago("gone-1", 40)
    worker_registry.rescue_dead_workers()  # marked dead by maintenance
    register("dead-1")
    beat_ago("dead-1", 40)
    worker_store.deregister_worker("stopped-1", handled=3)
    for state, expected in (
        ("alive", ["alive-1"]),
        ("silent", ["silent-1"]),
        ("dead", ["dead-1", "gone-1"]),
        ("stopped", ["stopped-1"]),
    ):
        page = admin_client.get(WORKERS, {"state": state})
        assert sorted(worker_rows(page)) == expected, state
        cells = re.findall(r'<td class="field-alive_display">(.*?)</td>', page.content.decode())
        assert [re.sub(r"<[^>]+>", "", c) for c in cells] == [state] * len(expected)
    html = admin_client.get(WORKERS).content.decode()
    # times to the second, with their age
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \(\d+s ago\)", html)
    assert re.search(r"\(20s ago\)|\(21s ago\)", html)


def test_a_dead_workers_messages_are_one_click_away(admin_client: Client) -> None:
    register("w-dead")
    enqueue("acme", 2)
    held = message_store.claim_messages(2, lease=LEASE, worker_id="w-dead")
    assert len(held) == 2
    beat_ago("w-dead", 60)
    worker_registry.rescue_dead_workers()  # its leases expired: the rescuer takes them back
    message_store.rescue_expired_messages()
    html = admin_client.get(WORKERS).content.decode()
    link = re.search(r'<a href="([^"]+\?worker=w-dead)" class="fq-failed">ran or lost</a>', html)
    assert link is not None
    lost = admin_client.get(link.group(1).replace("&amp;", "&"))
    assert sorted(m.pk for m in lost.context["cl"].result_list) == sorted(m.id for m in held)
    assert "LeaseExpired" in lost.content.decode()


def test_a_supervisors_processes_are_listed_together(admin_client: Client) -> None:
    register("solo")
    register("sup-1", supervisor="host-a:100")
    register("zeta", supervisor="host-a:100")
    register("alpha", supervisor="host-b:7")
    rows = worker_rows(admin_client.get(WORKERS))
    assert rows == ["solo", "sup-1", "zeta", "alpha"]  # unsupervised, then by supervisor
    html = admin_client.get(WORKERS).content.decode()
    assert '<span class="fq-child">└ zeta</span>' in html and "host-a:100" in html
    assert worker_registry.workers()[0].supervisor in ("", "host-a:100", "host-b:7")


def test_the_busy_page_shows_what_each_worker_runs_since_when(admin_client: Client) -> None:
    from django_fairqueue.worker import supervisor

    env = supervisor.environment()
    # given to children
    assert env[worker_registry.SUPERVISOR_ENV] == worker_registry.supervisor_name()
    register("busy-1", supervisor="host-a:100")
    register("idle-1")
    enqueue("acme", 2)
    held = message_store.claim_messages(2, lease=LEASE, worker_id="busy-1")
    page = admin_client.get(reverse("admin:fairqueue_workerrecord_busy"))
    assert page.status_code == 200
    html = page.content.decode()
    for m in held:
        assert reverse("admin:fairqueue_message_change", args=[m.id]) in html
    assert "busy-1" in html and "2 / 4" in html and "idle-1" in html and "Idle" in html
    assert re.search(r"\d\d:\d\d:\d\d \(\d+s ago\)", html) and "in 4m" in html
    assert "Busy: what each worker runs now" in admin_client.get(WORKERS).content.decode()


def test_one_time_format_to_the_second_on_a_message_page(admin_client: Client) -> None:
    # Django's default formatting ("Nov. 28, 2026, 9:04 p.m.": minutes) beside ISO strings
    # with offsets made three formats on one page.
    (mid,) = enqueue("acme", 1)
    message_store.claim_messages(1, lease=LEASE, worker_id="w")
    html = admin_client.get(reverse("admin:fairqueue_message_change", args=[mid])).content
    text = html.decode()
    assert "a.m." not in text and "p.m." not in text
    assert "+00:00" not in text and "T" not in re.findall(r"\d{4}-\d\d-\d\d.\d\d:\d\d", text)[0]
    stamps = re.findall(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", text)
    assert len(stamps) >= 4  # enqueued, run at, claimed, the lease


def test_one_time_format_on_every_page_of_the_app_that_shows_a_time(admin_client: Client) -> None:
    """The work-batch, group, schedule and pipeline-job pages read their times as the others
    do: `2026-11-28 21:04:05`, never Django's locale format (`Nov. 30, 2026, 9:53 p.m.`)."""
    import datetime as dt

    from django_fairqueue.contrib.pipeline.models import PipelineJob
    from django_fairqueue.models import ChannelGroup, Schedule, WorkBatch

    enqueue(("tenant", "acme"), 1)
    acme = Channel.objects.get(name="tenant/acme")
    now = timezone.now()
    batch = WorkBatch.objects.create(
        job_name="j", channel=acme, start_id=1, end_id=9, row_count=9, state="succeeded",
        started_at=now, finished_at=now,
    )  # fmt: skip
    schedule = Schedule.objects.create(
        name="s", channel=acme, task_name="tests.noop", cron="@daily"
    )
    job = PipelineJob.objects.create(
        job_name="p:acme", pipeline="p", tenant="acme", version="v1", today=dt.date(2026, 1, 1)
    )
    job.record_success(WorkBatch.objects.none())
    group = ChannelGroup.objects.get(name="tenant")
    register("w-1")
    worker_store.deregister_worker("w-1", handled=1, last_claim_at=now)  # every time set
    worker = WorkerRecord.objects.get(worker_id="w-1")
    pages = {
        reverse("admin:fairqueue_workerrecord_change", args=[worker.pk]): 4,
        reverse("admin:fairqueue_workbatch_changelist"): 2,  # started, finished
        reverse("admin:fairqueue_workbatch_change", args=[batch.pk]): 3,
        reverse("admin:fairqueue_channelgroup_change", args=[group.pk]): 1,
        reverse("admin:fairqueue_schedule_change", args=[schedule.pk]): 1,
        "/admin/fairqueue_pipeline/pipelinejob/": 2,
        f"/admin/fairqueue_pipeline/pipelinejob/{job.pk}/change/": 2,
    }
    for url, at_least in pages.items():
        text = admin_client.get(url).content.decode()
        assert not re.search(r"\b[A-Z][a-z]{2}\.? \d{1,2}, \d{4}|[ap]\.m\.", text), url
        assert len(re.findall(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", text)) >= at_least, url

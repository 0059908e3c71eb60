"""Failing now in the admin: per channel, the attempts that failed in the last minutes, as
failures (the task raised) and timeouts (time limits and expired leases) apart, the messages
waiting for a retry (apart from the plainly
delayed ones) and the dead letters; the dashboard's failing panel, which picks the failing
channels of the whole queue whatever order its other panels use; and the markup of our own
admin pages (breadcrumbs, the work-batch jobs table) on the running Django.

Queue data is made the way the queue makes it (enqueue, claim, fail through the store); the
statistics the way workers flush them (``stats_store.record_channel_stats``).
"""

from __future__ import annotations

import io
import json
import re
from datetime import timedelta
from typing import Any

import django
import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.messages import get_messages
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from django_fairqueue import stats
from django_fairqueue.db import message_store, stats_store
from django_fairqueue.maintenance import Rescuer
from django_fairqueue.models import BatchState, Channel, Message, MessageState, WorkBatch
from django_fairqueue.observe import overview
from tests.factories import channel_ids, enqueue
from tests.test_failures import make_held

pytestmark = pytest.mark.django_db

CHANNELS = reverse("admin:fairqueue_channel_changelist")
MESSAGES = reverse("admin:fairqueue_message_changelist")
BATCHES = reverse("admin:fairqueue_workbatch_changelist")
DASHBOARD = reverse("admin:fairqueue_channel_dashboard")
DASHBOARD_DATA = reverse("admin:fairqueue_channel_dashboard_data")
LEASE = timedelta(minutes=5)
ERROR = {"type": "builtins.ValueError", "message": "bad input", "traceback": None}


def cid(name: str) -> int:
    return channel_ids([name])[name]


def fail(name: str, n: int, retry_in: timedelta | None) -> list[int]:
    """Claim ``n`` messages of ``name`` and fail them: retried after ``retry_in``, or dead
    letters (None)."""
    claimed = message_store.claim_messages(
        n, lease=LEASE, worker_id="test-worker", only_channel_ids=[cid(name)], quantum=n
    )
    assert len(claimed) == n
    states = message_store.fail_messages([(m.id, m.lease_token, ERROR, retry_in) for m in claimed])
    assert set(states.values()) == {"scheduled" if retry_in else "failed"}
    return sorted(states)


def record_failures(
    name: str, failed: int = 0, retried: int = 0, minutes_ago: int = 0, timed_out: int = 0
) -> None:
    """Failed attempts in the statistics, as a worker flushes them; ``timed_out`` of them ran
    out of time."""
    at = stats.minute_of(timezone.now() - timedelta(minutes=minutes_ago))
    stats_store.record_channel_stats(
        [
            stats_store.ChannelMinuteStats(
                cid(name), at, failed=failed, retried=retried, timed_out=timed_out
            )
        ]
    )


def user_with(*perms: str, name: str) -> User:
    user = User.objects.create_user(name, password="pw", is_staff=True)
    for perm in perms:
        app, codename = perm.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app, codename=codename)
        )
    return User.objects.get(pk=user.pk)


def client_for(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def page_rows(response: Any) -> dict[str, overview.ChannelRow]:
    return {obj.name: obj._fq_row for obj in response.context["cl"].result_list}


@pytest.fixture
def flaky() -> dict[str, Any]:
    """``flaky``: 3 messages waiting for a retry, 2 dead letters, 2 plainly delayed, 1 ready,
    and 5 failed attempts in the statistics (3 retried, 2 for good; 1 of them timed out, so 4
    failures and 1 timeout); ``calm``: only delayed messages and a big backlog, nothing
    failing."""
    enqueue("flaky", 5)
    retrying = fail("flaky", 3, timedelta(hours=1))
    dead = fail("flaky", 2, None)
    enqueue("flaky", 2, run_after=timedelta(hours=1))
    enqueue("flaky", 1)
    record_failures("flaky", failed=2, retried=3, timed_out=1)
    enqueue("calm", 40)
    enqueue("calm", 4, run_after=timedelta(hours=1))
    return {"retrying": retrying, "dead": dead}


# ------------------------------------------------------------------------------------------
# the channel list and change page


def test_channel_list_separates_retrying_from_delayed(
    admin_client: Client, flaky: dict[str, Any]
) -> None:
    response = admin_client.get(CHANNELS)
    assert response.status_code == 200
    rows = page_rows(response)
    flaky_row, calm = rows["flaky"], rows["calm"]
    assert (flaky_row.scheduled, flaky_row.retrying, flaky_row.delayed) == (5, 3, 2)
    assert (flaky_row.failures_recent, flaky_row.timeouts_recent) == (4, 1)
    assert (flaky_row.failed, flaky_row.ready) == (2, 1)
    assert (calm.scheduled, calm.retrying, calm.delayed) == (4, 0, 4)
    assert (calm.failures_recent, calm.timeouts_recent) == (0, 0)
    html = response.content.decode()
    for header in ("Failures 5 min", "Timeouts 5 min", "Retrying", "Dead letters", "Delayed"):
        assert f">{header}</" in html, header
    # the retrying figure links to the channel's scheduled messages
    link = f"{MESSAGES}?channel__id__exact={cid('flaky')}&amp;state__exact=scheduled"
    assert f'<a href="{link}" class="fq-retrying">3</a>' in html
    assert '<span class="fq-failed">4</span>' in html  # failures
    assert '<span class="fq-failed">1</span>' in html  # timeouts


def test_channel_list_filters_channels_with_retries_waiting(
    admin_client: Client, flaky: dict[str, Any]
) -> None:
    def names(query: str) -> set[str]:
        return set(page_rows(admin_client.get(f"{CHANNELS}?{query}")))

    assert names("failing=retrying") == {"flaky"}
    assert names("failing=yes") == {"flaky"}
    assert names("failures=yes") == {"flaky"}  # dead letters
    Message.objects.filter(pk__in=flaky["retrying"]).update(attempts=0)  # as if never run
    assert names("failing=retrying") == set()


def test_change_page_shows_failing_now(admin_client: Client, flaky: dict[str, Any]) -> None:
    url = reverse("admin:fairqueue_channel_change", args=[cid("flaky")])
    html = admin_client.get(url).content.decode()
    assert "ready 1, delayed 2, retrying 3, running 0, dead letters 2" in html
    for label in ("Failures 5 min", "Timeouts 5 min", "Retrying", "Dead letters"):
        assert f"<label>{label}:</label>" in html, label


def test_the_page_stays_a_fixed_number_of_queries(admin_client: Client) -> None:
    """The retrying figure is one query for the whole page, whatever its size."""
    from django.test.utils import CaptureQueriesContext

    def measure() -> int:
        with CaptureQueriesContext(connection) as queries:
            assert admin_client.get(CHANNELS).status_code == 200
        return len(queries.captured_queries)

    for i in range(3):
        enqueue(f"t{i}", 2)
        fail(f"t{i}", 1, timedelta(hours=1))
    few = measure()
    for i in range(30):
        enqueue(f"u{i}", 2)
        fail(f"u{i}", 1, timedelta(hours=1))
    assert measure() == few


# ------------------------------------------------------------------------------------------
# the dashboard


def test_dashboard_failing_panel_ignores_the_chosen_order(admin_client: Client) -> None:
    # Ten busy tenants with big backlogs fill "top 3 by backlog"; the failing ones are small.
    for i in range(10):
        enqueue(f"busy-{i}", 50 + i)
    enqueue("dead-only", 2)
    fail("dead-only", 2, None)  # dead letters, nothing failing lately
    enqueue("retry-only", 4)
    fail("retry-only", 4, timedelta(hours=1))  # failed long ago, retries waiting
    enqueue("burning", 1)
    record_failures("burning", failed=1, retried=6, timed_out=2)  # failing right now
    record_failures("burning", failed=50, minutes_ago=20)  # outside the window: not counted
    for sort in overview.SORTS:
        data = admin_client.get(DASHBOARD_DATA, {"sort": sort, "limit": "3"}).json()
        failing = [
            (f["name"], f["failures_last_5m"], f["timeouts_last_5m"], f["retrying"], f["failed"])
            for f in data["failing"]
        ]
        assert failing == [
            ("burning", 5, 2, 0, 0),
            ("retry-only", 0, 0, 4, 0),
            ("dead-only", 0, 0, 0, 2),
        ], sort
    data = admin_client.get(DASHBOARD_DATA, {"sort": "backlog", "limit": "3"}).json()
    assert [t["name"] for t in data["tenants"]] == ["busy-9", "busy-8", "busy-7"]
    assert data["totals"]["retrying"] == 4
    assert data["totals"]["failures_last_5m"] == 5
    assert data["totals"]["timeouts_last_5m"] == 2
    assert data["totals"]["failed"] == 2
    # the limit bounds the panel too: the most failing first
    data = admin_client.get(DASHBOARD_DATA, {"limit": "1"}).json()
    assert [f["name"] for f in data["failing"]] == ["burning"]


def test_dashboard_page_shows_failing_now(admin_client: Client, flaky: dict[str, Any]) -> None:
    html = admin_client.get(DASHBOARD).content.decode()
    for label in ("failures, 5 min", "timeouts, 5 min", "retrying", "dead letters", "Failing now"):
        assert label in html, label
    data = admin_client.get(DASHBOARD_DATA).json()
    row = next(t for t in data["tenants"] if t["name"] == "flaky")
    assert (row["retrying"], row["delayed"], row["scheduled"]) == (3, 2, 5)
    assert (row["failures_last_5m"], row["timeouts_last_5m"], row["failed"]) == (4, 1, 2)
    assert [f["name"] for f in data["failing"]] == ["flaky"]


def test_a_healthy_queue_has_no_failing_channels(admin_client: Client) -> None:
    enqueue("fine", 3)
    enqueue("later", 2, run_after=timedelta(hours=1))
    data = admin_client.get(DASHBOARD_DATA).json()
    assert data["failing"] == []
    assert data["totals"]["retrying"] == 0


def test_failing_ids_order() -> None:
    def counts(name: str, cid: int, failed: int) -> overview.ChannelCounts:
        return overview.ChannelCounts(cid, name, 1, False, None, 0, 0, 0, failed, 0)

    all_counts = {
        1: counts("a", 1, 0),
        2: counts("b", 2, 9),
        3: counts("c", 3, 0),
        4: counts("d", 4, 1),
        5: counts("e", 5, 0),
    }
    # failures and timeouts rank together: 3 and 4 both failed 2 attempts
    failures = {3: stats.Failing(failures=2), 4: stats.Failing(failures=1, timeouts=1)}
    retrying = {1: 5, 3: 1}
    assert overview.failing_ids(all_counts, failures, retrying) == [3, 4, 1, 2]
    assert overview.failing_ids(all_counts, failures, retrying, limit=2) == [3, 4]
    failures[5] = stats.Failing(timeouts=3)  # only timeouts: failing, and the most
    assert overview.failing_ids(all_counts, failures, retrying) == [5, 3, 4, 1, 2]


# ------------------------------------------------------------------------------------------
# fairqueue status: the same figures


def test_status_shows_retrying_failures_and_timeouts(flaky: dict[str, Any]) -> None:
    out = io.StringIO()
    call_command("fairqueue", "status", "--sort", "name", stdout=out)
    lines = out.getvalue().splitlines()
    header = re.split(r"\s{2,}", lines[0])
    flaky_line = dict(zip(header, re.split(r"\s{2,}", lines[2]), strict=False))
    assert flaky_line["CHANNEL"] == "flaky"
    assert (flaky_line["READY"], flaky_line["DELAYED"], flaky_line["RETRYING"]) == ("1", "2", "3")
    failing = (flaky_line["FAILS 5M"], flaky_line["TIMEOUTS 5M"], flaky_line["DEAD"])
    assert failing == ("4", "1", "2")
    calm_line = dict(zip(header, re.split(r"\s{2,}", lines[1]), strict=False))
    assert (calm_line["DELAYED"], calm_line["RETRYING"], calm_line["FAILS 5M"]) == ("4", "0", "0")
    summary = out.getvalue()
    assert "6 delayed, 3 retrying" in summary
    assert "4 failures, 1 timeouts" in summary
    out = io.StringIO()
    call_command("fairqueue", "status", "flaky", "--json", stdout=out)
    row = json.loads(out.getvalue())
    assert (row["retrying"], row["delayed"], row["scheduled"]) == (3, 2, 5)
    assert (row["failures_last_5m"], row["timeouts_last_5m"], row["failed"]) == (4, 1, 2)
    out = io.StringIO()
    call_command("fairqueue", "status", "--json", stdout=out)
    totals = json.loads(out.getvalue())["totals"]
    assert (totals["retrying"], totals["failures_last_5m"], totals["timeouts_last_5m"]) == (3, 4, 1)


# ------------------------------------------------------------------------------------------
# permissions: seeing is not acting


def test_a_view_only_user_sees_failing_now_and_changes_nothing(flaky: dict[str, Any]) -> None:
    viewer = client_for(user_with("fairqueue.view_channel", "fairqueue.view_message", name="v"))
    response = viewer.get(CHANNELS)
    assert response.status_code == 200
    assert page_rows(response)["flaky"].retrying == 3
    html = response.content.decode()
    assert "retry_failed" not in html and "pause_channels" not in html
    data = viewer.get(DASHBOARD_DATA).json()
    assert [f["name"] for f in data["failing"]] == ["flaky"]
    assert viewer.get(DASHBOARD).status_code == 200
    # acting anyway: the retry of dead letters, a pause, a purge, an edit
    for name in ("retry_failed", "pause_channels", "purge_backlog"):
        viewer.post(
            CHANNELS,
            {"action": name, "_selected_action": [str(cid("flaky"))], "post": "yes"},
        )
    change = reverse("admin:fairqueue_channel_change", args=[cid("flaky")])
    assert viewer.post(change, {"name": "flaky", "weight": 5}).status_code == 403
    flaky_channel = Channel.objects.get(name="flaky")
    assert (flaky_channel.paused, flaky_channel.weight) == (False, 1)
    states = dict(Message.objects.filter(channel=flaky_channel).values_list("id", "state"))
    assert {states[i] for i in flaky["dead"]} == {MessageState.FAILED}
    assert {states[i] for i in flaky["retrying"]} == {MessageState.SCHEDULED}
    assert sum(1 for s in states.values() if s == MessageState.READY) == 1


def test_no_permission_no_failing_figures(flaky: dict[str, Any]) -> None:
    nobody = client_for(user_with(name="nobody"))
    assert nobody.get(DASHBOARD_DATA).status_code == 403
    assert nobody.get(CHANNELS).status_code == 403


# ------------------------------------------------------------------------------------------
# timeouts: an expired lease is a timed-out attempt in the statistics


def test_the_rescuer_counts_expired_leases_as_timeouts() -> None:
    enqueue("stuck", 3)
    claimed = message_store.claim_messages(
        3, lease=LEASE, worker_id="gone", only_channel_ids=[cid("stuck")], quantum=3
    )
    # one has no attempts left: dead-lettered; two go back to ready
    Message.objects.filter(pk=claimed[0].id).update(max_attempts=1)
    Message.objects.filter(pk__in=[m.id for m in claimed]).update(
        lease_expires_at=timezone.now() - timedelta(minutes=1)
    )
    assert stats.failing_counts(5) == {}
    assert Rescuer().run_once() == 3
    assert stats.failing_counts(5) == {cid("stuck"): stats.Failing(failures=0, timeouts=3)}
    totals = stats.outcome_totals(5)
    assert (totals["retried"], totals["failed"], totals["timed_out"]) == (2, 1, 3)


# ------------------------------------------------------------------------------------------
# our pages in the running Django's markup


def test_breadcrumbs_use_the_running_djangos_markup(
    admin_client: Client, flaky: dict[str, Any]
) -> None:
    purge = admin_client.post(
        CHANNELS, {"action": "purge_backlog", "_selected_action": [str(cid("flaky"))]}
    )
    for response in (admin_client.get(DASHBOARD), purge):
        assert response.status_code == 200
        html = response.content.decode()
        if django.VERSION >= (6, 0):  # Django 6 styles ol.breadcrumbs only
            assert '<ol class="breadcrumbs">' in html
            assert '<div class="breadcrumbs">' not in html
            assert f'<li><a href="{CHANNELS}">Channels</a></li>' in html
            assert '<li aria-current="page">' in html
        else:  # Django 5.2 styles div.breadcrumbs
            assert '<div class="breadcrumbs">' in html
            assert "<ol" not in html.split('<div class="breadcrumbs">')[1].split("</div>")[0]
            assert f'&rsaquo; <a href="{CHANNELS}">Channels</a>' in html


def test_purge_page_tells_delayed_from_retrying(
    admin_client: Client, flaky: dict[str, Any]
) -> None:
    response = admin_client.post(
        CHANNELS, {"action": "purge_backlog", "_selected_action": [str(cid("flaky"))]}
    )
    html = response.content.decode()
    assert "6 waiting messages will be deleted." in html  # 1 ready, 2 delayed, 3 retrying
    assert "<tr><td>flaky</td><td>default</td><td>1</td><td>2</td><td>3</td></tr>" in html


def test_jobs_table_headers_use_the_admins_header_markup(admin_client: Client) -> None:
    channel = Channel.objects.create(name="pipeline")
    WorkBatch.objects.create(
        channel=channel,
        job_name="export",
        start_id=0,
        end_id=99,
        row_count=100,
        state=BatchState.PENDING,
    )
    html = admin_client.get(BATCHES).content.decode()
    table = html.split('<table class="fq-jobs"', 1)[1].split("</thead>", 1)[0]
    # In a change list, the admin zeroes th padding and pads `th .text span` instead.
    headers = table.count("<th ")
    assert headers == 9
    assert table.count('<div class="text"><span') == headers


def test_retry_job_forms_are_not_inside_the_change_list_form(admin_client: Client) -> None:
    """A form inside another is dropped by the browser's parser: the button would submit the
    change list's action form instead."""
    channel = Channel.objects.create(name="pipeline")
    WorkBatch.objects.create(
        channel=channel,
        job_name="export",
        start_id=0,
        end_id=99,
        row_count=100,
        state=BatchState.FAILED,
        attempts=3,
    )
    html = admin_client.get(BATCHES).content.decode()
    retry = html.index(f'action="{reverse("admin:fairqueue_workbatch_retry_job")}"')
    changelist_form = html.index('<form id="changelist-form"')
    assert html.index('<table class="fq-jobs"') < retry < changelist_form


def test_metrics_export_the_retrying_total_and_timeouts(flaky: dict[str, Any]) -> None:
    pytest.importorskip("prometheus_client")
    from django_fairqueue import metrics

    samples = {
        s.name: s.value
        for family in metrics.REGISTRY.collect()
        for s in family.samples
        if not s.labels
    }
    assert samples["fairqueue_retrying"] == 3  # flaky's retries, not the delayed messages
    assert samples["fairqueue_retried_last_5m"] == 3
    assert samples["fairqueue_failed_last_5m"] == 2
    assert samples["fairqueue_timed_out_last_5m"] == 1  # of those 5 failed attempts


def test_retrying_a_channels_failed_unique_job_whose_key_another_holds_says_so(
    admin_client: Client,
) -> None:
    failed, _ = make_held("flaky", "job-1")
    response = admin_client.post(
        CHANNELS, {"action": "retry_failed", "_selected_action": [str(cid("flaky"))]}
    )
    assert [str(m) for m in get_messages(response.wsgi_request)] == [
        "Retried 0 failed messages of 0 channels.",
        "1 failed message stays failed: another message holds its unique key and does its work.",
    ]
    assert Message.objects.get(pk=failed).state == MessageState.FAILED

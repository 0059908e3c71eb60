"""Per-tenant usage (worker time, attempts, failures per channel and group and hour) and every
attempt's error kept on its message: written by the real paths (the statistics flush, the
fail and rescue statements), read by the report, the admin page, the CLI and the metrics."""

from __future__ import annotations

import csv
import io
import json
import re
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from django_fairqueue import abort, maintenance, stats
from django_fairqueue.db import message_store, stats_store
from django_fairqueue.models import ERROR_HISTORY, Channel, Message, UsageHour, UsageTotal
from django_fairqueue.observe import usage
from django_fairqueue.testing import drain
from django_fairqueue.worker import Worker, WorkerConfig
from tests import factories as f
from tests import fairtasks
from tests.workerkit import run_in_thread, wait_until

pytestmark = pytest.mark.django_db

LEASE = timedelta(minutes=5)
USAGE = reverse("admin:fairqueue_usagehour_changelist")


def flush(
    channel: str,
    at: datetime,
    *,
    ok: int = 0,
    failed: int = 0,
    retried: int = 0,
    timed_out: int = 0,
    run_ms: float = 0.0,
) -> None:
    """What a worker's recorder flushes after settling these attempts at ``at``."""
    recorder = stats.StatsRecorder()
    cid = f.channel_ids([channel])[channel]
    attempts = [("succeeded", False)] * ok + [("failed", False)] * failed
    attempts += [("retried", i < timed_out) for i in range(retried)]
    for outcome, late in attempts:
        recorder.record_settled(cid, outcome, run_ms / len(attempts), at=at, timed_out=late)
    recorder.flush()


def yesterday_at(hour: int) -> datetime:
    day = timezone.localdate() - timedelta(days=1)
    return timezone.make_aware(datetime(day.year, day.month, day.day, hour, 30))


def test_the_flush_writes_usage_per_channel_and_hour_and_totals_that_only_grow() -> None:
    f.enqueue_in_queue("default", ("acme", "eu"), 1)
    f.enqueue("solo", 1)
    at = datetime(2026, 11, 28, 10, 15, tzinfo=UTC)
    flush("acme/eu", at, ok=3, retried=2, timed_out=1, run_ms=5000)
    flush("acme/eu", at + timedelta(minutes=20), ok=1, failed=1, run_ms=1000)  # same hour
    flush("acme/eu", at + timedelta(hours=1), ok=1, run_ms=250)
    flush("solo", at, ok=2, run_ms=10)
    rows = {(u.channel_name, u.hour.hour): u for u in UsageHour.objects.all()}
    ten = rows[("acme/eu", 10)]
    assert (ten.attempts, ten.succeeded, ten.failures, ten.timeouts) == (7, 4, 3, 1)
    assert ten.worker_ms == 6000 and ten.group_name == "acme"
    assert rows[("acme/eu", 11)].worker_ms == 250 and rows[("solo", 10)].group_name == ""
    acme = f.channel_ids(["acme/eu"])["acme/eu"]
    total = UsageTotal.objects.get(channel_id=acme)
    assert (total.attempts, total.failures, total.worker_ms) == (8, 3, 6250)
    # pruning the hours keeps the totals (the counters never go back)
    stats_store.prune_usage(at + timedelta(days=1))
    assert not UsageHour.objects.exists()
    assert UsageTotal.objects.get(channel_id=acme).worker_ms == 6250


def test_claims_alone_write_no_usage_and_a_deleted_channel_none() -> None:
    f.enqueue("gone", 1)
    cid = f.channel_ids(["gone"])["gone"]
    recorder = stats.StatsRecorder()
    claimed = message_store.claim_messages(1, lease=LEASE, worker_id="w")
    recorder.record_claimed(claimed, timezone.now())
    recorder.flush()
    assert not UsageHour.objects.exists()
    recorder.record_settled(cid, "succeeded", 5.0)
    Channel.objects.filter(pk=cid).delete()
    recorder.flush()
    assert not UsageHour.objects.exists() and not UsageTotal.objects.exists()


def test_a_channel_deleted_and_created_again_is_one_line_of_the_report() -> None:
    """One tenant, one line: the report sums a channel's rows by its name and queue (the text
    and CSV forms carry no id to tell two lines apart), with the newest row's id."""
    f.enqueue("again", 1)
    flush("again", yesterday_at(9), ok=2, run_ms=1000)
    Channel.objects.filter(name="again").delete()
    f.enqueue("again", 1)
    flush("again", yesterday_at(10), ok=1, run_ms=500)
    day = timezone.localdate() - timedelta(days=1)
    (row,) = [r for r in usage.report(*usage.day_range(day, day)) if r.name == "again"]
    assert (row.attempts, row.worker_seconds, row.channel_id) == (
        3,
        1.5,
        f.channel_ids(["again"])["again"],
    )


def test_drained_messages_count_in_the_statistics_and_usage_as_a_workers_do(
    settings: Any,
) -> None:
    settings.FAIRQUEUE = {**settings.FAIRQUEUE, "RETRY_BACKOFF_BASE": 0}
    fairtasks.add.enqueue(1, 2, channel="paid")
    fairtasks.add.enqueue(3, 4, channel="paid")
    fairtasks.boom.enqueue(channel="flaky")  # two attempts: retried, then failed for good
    assert drain() == 4
    ids = f.channel_ids(["paid", "flaky"])
    paid, flaky = ids["paid"], ids["flaky"]
    # what `fairqueue status` shows (claimed, finished) and what `fairqueue usage` reports
    assert stats.served_counts() == {paid: 2, flaky: 2}
    assert stats.finished_counts() == {paid: 2, flaky: 1}
    assert stats.failing_counts()[flaky].failures == 2
    rows = {u.channel_id: u for u in UsageHour.objects.all()}
    assert (rows[paid].attempts, rows[paid].succeeded, rows[paid].failures) == (2, 2, 0)
    assert (rows[flaky].attempts, rows[flaky].succeeded, rows[flaky].failures) == (2, 0, 2)
    assert UsageTotal.objects.get(channel_id=paid).attempts == 2


@pytest.mark.django_db(transaction=True)
def test_an_aborted_attempt_is_billed_its_worker_time_but_is_no_attempt(tmp_path: Any) -> None:
    marker = tmp_path / "started"
    mid = fairtasks.until_aborted.enqueue(str(marker), 30.0, channel="stopped")
    worker = Worker(
        WorkerConfig(
            worker_id="usage-abort",
            concurrency=1,
            listen=False,
            maintenance=False,
            lease=timedelta(seconds=0.6),  # a heartbeat (which sees the abort) every 0.2 s
        )
    )
    thread = run_in_thread(worker)
    try:
        wait_until(marker.exists, what="the task started")
        time.sleep(0.3)
        assert abort([mid]) == {mid: "abort_requested"}
        wait_until(lambda: Message.objects.get(pk=mid).state == "aborted", what="aborted")
    finally:
        worker.stop()
        thread.join(30)
    cid = f.channel_ids(["stopped"])["stopped"]
    hour = UsageHour.objects.get(channel_id=cid)
    assert hour.worker_ms >= 300  # it ran until the abort was seen
    assert (hour.attempts, hour.succeeded, hour.failures, hour.timeouts) == (0, 0, 0, 0)
    assert UsageTotal.objects.get(channel_id=cid).worker_ms == hour.worker_ms
    # nor does it count as finished or failing in the per-minute statistics
    assert stats.finished_counts() == {} and stats.failing_counts() == {}


def test_the_report_sums_a_range_of_days_per_channel_or_group_in_any_order() -> None:
    f.enqueue_in_queue("default", ("acme", "eu"), 1)
    f.enqueue_in_queue("default", ("acme", "us"), 1)
    f.enqueue_in_queue("reports", "solo", 1)
    flush("acme/eu", yesterday_at(1), ok=10, run_ms=4000)
    flush("acme/us", yesterday_at(23), ok=1, failed=3, run_ms=9000)
    reports = f.channel_ids(["reports\x1fsolo"])["reports\x1fsolo"]
    recorder = stats.StatsRecorder()
    recorder.record_settled(reports, "succeeded", 500.0, at=yesterday_at(12))
    recorder.flush()
    flush("acme/eu", yesterday_at(12) + timedelta(days=1), ok=5, run_ms=99_000)  # today
    start, end = usage.day_range(*(usage.parse_day("yesterday"),) * 2)
    rows = usage.report(start, end)
    assert [(r.name, r.queue, r.worker_seconds) for r in rows] == [
        ("acme/us", "default", 9.0),
        ("acme/eu", "default", 4.0),
        ("solo", "reports", 0.5),
    ]
    assert usage.report(start, end, order="-failure_rate")[0].name == "acme/us"
    assert [r.name for r in usage.report(start, end, order="name")] == [
        "acme/eu",
        "acme/us",
        "solo",
    ]
    assert [r.name for r in usage.report(start, end, queue="reports")] == ["solo"]
    groups = usage.report(start, end, by="group")
    assert [(g.name, g.attempts, g.worker_seconds) for g in groups] == [
        ("acme", 14, 13.0),
        (usage.NO_GROUP, 1, 0.5),
    ]
    in_reports = usage.report(start, end, by="group", queue="reports")
    assert [(g.name, g.queue, g.worker_seconds) for g in in_reports] == [
        (usage.NO_GROUP, "reports", 0.5)
    ]
    assert [r.name for r in usage.report(start, end, by="group", queue="default")] == ["acme"]
    two_days = usage.report(start, end + timedelta(days=1))
    assert sum(r.worker_seconds for r in two_days) == 13.5 + 99.0
    lines = list(csv.reader(io.StringIO(usage.as_csv(rows, start=start, end=end, by="channel"))))
    assert lines[0][:4] == ["from", "to", "channel", "queue"] and len(lines) == 4
    assert lines[1][2:4] == ["acme/us", "default"] and lines[1][5] == "9.0"
    by_group = usage.as_csv(groups, start=start, end=end, by="group").splitlines()
    assert by_group[0].split(",")[2:5] == ["group", "queue", "worker_seconds"]  # once
    with pytest.raises(ValueError, match="order must be one of"):
        usage.report(start, end, order="bogus")
    with pytest.raises(ValueError, match="before the first"):
        usage.day_range(usage.parse_day("today"), usage.parse_day("yesterday"))
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        usage.parse_day("28/11/2026")


def test_maintenance_prunes_usage_older_than_its_retention(settings: object) -> None:
    f.enqueue("old", 1)
    flush("old", timezone.now() - timedelta(days=40), ok=1, run_ms=10)
    flush("old", timezone.now() - timedelta(days=2), ok=1, run_ms=10)
    maintenance.StatsPruner().run_once()
    assert UsageHour.objects.count() == 1  # 31 days by default
    settings.FAIRQUEUE = {"USAGE_RETENTION": timedelta(days=1)}  # type: ignore[attr-defined]
    maintenance.StatsPruner().run_once()
    assert not UsageHour.objects.exists()


def test_fairqueue_usage_command_answers_who_used_how_much_yesterday() -> None:
    f.enqueue("big", 1)
    f.enqueue("small", 1)
    flush("big", yesterday_at(9), ok=4, failed=1, run_ms=7_200_000)
    flush("small", yesterday_at(9), ok=1, run_ms=1500)
    out = io.StringIO()
    call_command("fairqueue", "usage", stdout=out)
    text = out.getvalue()
    assert text.index("big") < text.index("small")
    assert "7,200.0 s" in text and "7,201.5 s" in text  # a row and the total
    out = io.StringIO()
    call_command("fairqueue", "usage", "--json", "--sort", "name", stdout=out)
    data = json.loads(out.getvalue())
    assert [r["name"] for r in data["rows"]] == ["big", "small"]
    assert data["total"]["failures"] == 1
    out = io.StringIO()
    call_command("fairqueue", "usage", "--csv", "--from", "today", stdout=out)
    assert out.getvalue().splitlines() == [
        "from,to,channel,queue,group,worker_seconds,"
        "attempts,succeeded,failures,timeouts,failure_rate"
    ]


def test_the_admin_usage_page_sorts_filters_by_dates_and_exports_csv(
    admin_client: Client,
) -> None:
    f.enqueue("big", 1)
    f.enqueue("small", 1)
    flush("big", yesterday_at(9), ok=4, failed=4, run_ms=60_000)
    flush("small", yesterday_at(9), ok=1, run_ms=1500)
    page = admin_client.get(USAGE)
    assert page.status_code == 200
    html = page.content.decode()
    assert html.index(">big<") < html.index(">small<")
    assert "60.0 s" in html and "50.0 %" in html
    html = admin_client.get(USAGE, {"o": "name"}).content.decode()
    assert html.index(">big<") < html.index(">small<")
    html = admin_client.get(USAGE, {"o": "-name"}).content.decode()
    assert html.index(">small<") < html.index(">big<")
    today = timezone.localdate().isoformat()
    assert "No usage recorded" in admin_client.get(USAGE, {"from": today}).content.decode()
    bad = admin_client.get(USAGE, {"from": "yesterday-ish"}).content.decode()
    assert "YYYY-MM-DD" in bad and ">big<" in bad  # the default range, and what was wrong
    response = admin_client.get(USAGE, {"format": "csv", "by": "group"})
    assert response["Content-Type"].startswith("text/csv")
    assert "attachment" in response["Content-Disposition"]
    lines = response.content.decode().splitlines()
    assert lines[0].split(",")[2] == "group" and lines[1].split(",")[2] == "(no group)"


def test_the_last_day_a_report_reaches_is_9999_12_30_and_a_later_one_is_a_bad_day(
    admin_client: Client,
) -> None:
    # a report runs to the midnight after its last day: 9999-12-31 has none a datetime holds
    f.enqueue("big", 1)
    flush("big", yesterday_at(9), ok=1, run_ms=60_000)
    refused = "a day is YYYY-MM-DD up to 9999-12-30, 'today' or 'yesterday', got '9999-12-31'"
    page = admin_client.get(USAGE, {"from": "9999-12-31", "to": "9999-12-31"})
    assert page.status_code == 200
    html = page.content.decode()
    assert refused.replace("'", "&#x27;") in html and ">big<" in html  # the default range
    csv_file = admin_client.get(USAGE, {"from": "9999-12-31", "format": "csv"})
    assert csv_file.status_code == 200 and "big" in csv_file.content.decode()
    one_day = admin_client.get(USAGE, {"from": "2026-11-30", "to": "9999-12-31"})
    assert one_day.status_code == 200 and refused.replace("'", "&#x27;") in one_day.content.decode()
    assert one_day.context["params"]["last"].isoformat() == "2026-11-30"
    last = admin_client.get(USAGE, {"from": "9999-12-30", "to": "9999-12-30", "format": "csv"})
    assert last.content.decode().splitlines()[1:] == []  # a report of that day: empty
    with pytest.raises(CommandError, match=re.escape(refused)):
        call_command("fairqueue", "usage", "--from", "9999-12-31")
    out = io.StringIO()
    call_command("fairqueue", "usage", "--from", "9999-12-30", stdout=out)
    assert out.getvalue().strip() == "No usage recorded for 9999-12-30."


@pytest.mark.parametrize("text", ["20261130", "2026-W48-1", "2026-11-30T00:00", "2026-1-30"])
def test_a_day_is_written_as_documented_only(text: str) -> None:
    # Python's date.fromisoformat reads more forms than YYYY-MM-DD, which a typo could hit
    with pytest.raises(CommandError, match=re.escape("a day is YYYY-MM-DD up to 9999-12-30")):
        call_command("fairqueue", "usage", "--from", text)


@pytest.mark.parametrize("form", [{}, {"format": "csv"}])
def test_a_nul_in_the_usage_page_filter_is_a_clear_400(
    admin_client: Client, form: dict[str, str]
) -> None:
    response = admin_client.get(USAGE, {"queue": "\x00", **form})
    assert response.status_code == 400
    assert response.content.decode() == (
        "The filter 'queue' contains a NUL character, which no stored value has."
    )


def test_the_usage_page_needs_its_view_permission(client: Client) -> None:
    user = User.objects.create_user("support", password="pw", is_staff=True)
    client.force_login(user)
    assert client.get(USAGE).status_code == 403
    user.user_permissions.add(Permission.objects.get(codename="view_usagehour"))
    assert client.get(USAGE).status_code == 200


# ------------------------------------------------------------------------------------------
# every attempt's error


def fail_once(message_id: int, text: str) -> None:
    (claimed,) = [
        m
        for m in message_store.claim_messages(10, lease=LEASE, worker_id="w-1")
        if m.id == message_id
    ]
    error = {
        "type": "ValueError",
        "message": text,
        "traceback": "x" * 5000,
        "attempt": claimed.attempts,
        "worker": "w-1",
    }
    message_store.fail_messages([(claimed.id, claimed.lease_token, error, timedelta(0))])


def test_every_failed_attempt_keeps_its_error_in_order_bounded() -> None:
    (mid,) = f.enqueue("flaky", 1)
    Message.objects.filter(pk=mid).update(max_attempts=ERROR_HISTORY + 5)
    fail_once(mid, "first")
    fail_once(mid, "second")
    errors = Message.objects.get(pk=mid).errors
    assert [(e["attempt"], e["message"], e["worker"]) for e in errors] == [
        (1, "first", "w-1"),
        (2, "second", "w-1"),
    ]
    assert len(errors[0]["traceback"]) < 2100 and errors[0]["at"]  # cut; last_error keeps it
    assert len(Message.objects.get(pk=mid).last_error["traceback"]) == 5000
    # an expired lease: the rescuer's error joins the history too
    assert len(message_store.claim_messages(1, lease=LEASE, worker_id="w-2")) == 1
    Message.objects.filter(pk=mid).update(lease_expires_at=timezone.now() - timedelta(1))
    message_store.rescue_expired_messages()
    last = Message.objects.get(pk=mid).errors[-1]
    assert last["type"] == "LeaseExpired" and last["attempt"] == 3 and last["worker"] == "w-2"
    for i in range(ERROR_HISTORY):
        fail_once(mid, f"again {i}")
    errors = Message.objects.get(pk=mid).errors
    assert len(errors) == ERROR_HISTORY
    assert errors[-1]["message"] == f"again {ERROR_HISTORY - 1}"
    assert errors[0]["attempt"] == 4  # the three oldest dropped


def test_a_claim_and_a_release_write_no_error_history() -> None:
    (mid,) = f.enqueue("fine", 1)
    (claimed,) = message_store.claim_messages(1, lease=LEASE, worker_id="w")
    assert Message.objects.get(pk=mid).errors is None
    message_store.release_messages([(claimed.id, claimed.lease_token)])
    assert Message.objects.get(pk=mid).errors is None


def test_a_tenant_name_read_as_a_formula_is_text_in_the_csv() -> None:
    row = usage.UsageRow("=HYPERLINK(1)", "default", 1, 1, 0, 0, 1000, channel_id=1)
    start, end = usage.day_range(*(usage.parse_day("yesterday"),) * 2)
    line = usage.as_csv([row], start=start, end=end, by="channel").splitlines()[1]
    assert line.split(",")[2] == "'=HYPERLINK(1)" and line.split(",")[5] == "1.0"

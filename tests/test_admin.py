"""The admin and observability (issue 4): channel list, edits, actions and their permissions,
message and work batch actions, the dashboard and its JSON, ``fairqueue status``, Prometheus
metrics, the statistics recorder and its math, signals and structured logging.

Queue data is made the way the queue makes it (enqueue, claim, fail through the store), so the
counters and their pending deltas are real; tests then check that the admin shows exactly what
the table holds, and that its actions keep counters and table in agreement.
"""

from __future__ import annotations

import builtins
import importlib
import io
import json
import logging
import re
import sys
import uuid
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from typing import Any
from unittest import mock

import pytest
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.auth.models import Permission, User
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import connection
from django.test import Client, RequestFactory
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_fairqueue import stats
from django_fairqueue.admin import ChannelAdmin
from django_fairqueue.api import EnqueueRequest, enqueue_many
from django_fairqueue.context import current_message
from django_fairqueue.db import batch_store, channel_store, message_store, stats_store
from django_fairqueue.logging import JsonFormatter, MessageContextFilter, message_logger
from django_fairqueue.models import (
    WAIT_BUCKETS_MS,
    BatchState,
    Channel,
    ChannelDelta,
    ChannelGroup,
    ChannelStat,
    Message,
    MessageState,
    MinuteStat,
    WorkBatch,
)
from django_fairqueue.observe import overview
from django_fairqueue.signals import message_enqueued
from tests.factories import (
    NOOP,
    assert_counters_match_table,
    channel_ids,
    channel_state,
    enqueue,
    enqueue_in_queue,
    fold_all,
)

pytestmark = pytest.mark.django_db

CHANNELS = reverse("admin:fairqueue_channel_changelist")
MESSAGES = reverse("admin:fairqueue_message_changelist")
BATCHES = reverse("admin:fairqueue_workbatch_changelist")
DASHBOARD = reverse("admin:fairqueue_channel_dashboard")
DASHBOARD_DATA = reverse("admin:fairqueue_channel_dashboard_data")
LEASE = timedelta(minutes=5)
FAILURE = {
    "type": "builtins.ValueError",
    "message": "bad <input>",
    "traceback": 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad',
}


# ------------------------------------------------------------------------------------------
# helpers


def cid(name: str) -> int:
    return channel_ids([name])[name]


def claim(name: str, n: int) -> list[message_store.ClaimedMessage]:
    got = message_store.claim_messages(
        n, lease=LEASE, worker_id="test-worker", only_channel_ids=[cid(name)], quantum=n
    )
    assert len(got) == n
    return got


def make_failed(name: str, n: int) -> list[int]:
    """``n`` dead letters of channel ``name``, failed the way a worker fails them."""
    enqueue(name, n)
    claimed = claim(name, n)
    states = message_store.fail_messages([(m.id, m.lease_token, FAILURE, None) for m in claimed])
    assert set(states.values()) == {"failed"}
    return sorted(states)


def counters(name: str) -> channel_store.ChannelCounters:
    (c,) = channel_store.select_channel_counters([cid(name)])
    return c


def user_with(*perms: str, staff: bool = True, name: str = "operator") -> User:
    user = User.objects.create_user(name, password="pw", is_staff=staff)
    for perm in perms:
        app, codename = perm.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app, codename=codename)
        )
    return User.objects.get(pk=user.pk)  # fresh permission cache


def client_for(user: User) -> Client:
    c = Client()
    c.force_login(user)
    return c


def action(client: Client, url: str, name: str, ids: list[int], **extra: str) -> Any:
    return client.post(url, {"action": name, "_selected_action": [str(i) for i in ids], **extra})


def page_rows(response: Any) -> dict[str, overview.ChannelRow]:
    return {obj.name: obj._fq_row for obj in response.context["cl"].result_list}


def page_names(response: Any) -> list[str]:
    return [obj.name for obj in response.context["cl"].result_list]


def column(name: str) -> int:
    """The ``o=`` index of a column of the channel list (0 is the action checkbox)."""
    return ["action_checkbox", *ChannelAdmin.list_display].index(name)


def log_messages(flag: int) -> list[str]:
    return list(
        LogEntry.objects.filter(action_flag=flag)
        .order_by("pk")
        .values_list("change_message", flat=True)
    )


@pytest.fixture
def queue() -> dict[str, Any]:
    """Three tenants: alpha with a backlog (unfolded deltas), beta with failures and a running
    message, gamma delayed only and paused."""
    enqueue("alpha", 5)
    failed = make_failed("beta", 3)
    enqueue("beta", 2)
    running = claim("beta", 1)
    enqueue("gamma", 2, run_after=timedelta(hours=1))
    Channel.objects.filter(name="gamma").update(paused=True)
    assert ChannelDelta.objects.exists()  # the list must add pending deltas itself
    return {"failed": failed, "running": running}


# ------------------------------------------------------------------------------------------
# channel list


def test_channel_list_shows_exact_counts_including_pending_deltas(
    admin_client: Client, queue: dict[str, Any]
) -> None:
    response = admin_client.get(CHANNELS)
    assert response.status_code == 200
    rows = page_rows(response)
    assert (rows["alpha"].ready, rows["alpha"].scheduled, rows["alpha"].running) == (5, 0, 0)
    assert (rows["beta"].ready, rows["beta"].running, rows["beta"].failed) == (1, 1, 3)
    assert (rows["gamma"].ready, rows["gamma"].scheduled, rows["gamma"].paused) == (0, 2, True)
    assert rows["alpha"].oldest_ready_since is not None
    assert rows["gamma"].oldest_ready_since is None
    html = response.content.decode()
    failed_link = f"{MESSAGES}?channel__id__exact={cid('beta')}&amp;state__exact=failed"
    assert failed_link in html  # failed messages one click away
    assert "1 / ∞" in html  # beta: running / max
    assert reverse("admin:fairqueue_channel_dashboard") in html


def test_channel_list_queries_do_not_grow_with_the_page(admin_client: Client) -> None:
    def measure() -> tuple[int, int]:
        calls = 0
        real = channel_store.select_channel_counters

        def counting(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return real(*args, **kwargs)

        with (
            mock.patch.object(channel_store, "select_channel_counters", counting),
            CaptureQueriesContext(connection) as queries,
        ):
            assert admin_client.get(CHANNELS).status_code == 200
        return len(queries.captured_queries), calls

    enqueue_many(EnqueueRequest(NOOP, channel=f"t{i}") for i in range(3))
    few = measure()
    enqueue_many(EnqueueRequest(NOOP, channel=f"u{i}") for i in range(40))
    many = measure()
    assert few == many
    assert many[1] == 1  # the page's counters in one store call


def test_sort_by_backlog_and_by_oldest_age(admin_client: Client) -> None:
    enqueue("small", 1)
    enqueue("big", 7)
    enqueue("middle", 3)
    now = timezone.now()
    for name, minutes in (("small", 30), ("big", 5), ("middle", 90)):
        Message.objects.filter(channel_id=cid(name)).update(
            enqueued_at=now - timedelta(minutes=minutes), run_at=now - timedelta(minutes=minutes)
        )
    message_store.cancel_messages(enqueue("idle", 1))  # a channel with nothing ready

    by_backlog = admin_client.get(CHANNELS, {"o": f"-{column('ready_display')}"})
    assert page_names(by_backlog) == ["big", "middle", "small", "idle"]
    oldest_first = admin_client.get(CHANNELS, {"o": f"-{column('oldest_ready_display')}"})
    assert page_names(oldest_first) == ["middle", "small", "big", "idle"]
    youngest_first = admin_client.get(CHANNELS, {"o": str(column("oldest_ready_display"))})
    assert page_names(youngest_first) == ["big", "small", "middle", "idle"]
    ages = page_rows(oldest_first)
    assert ages["middle"].oldest_age(now) == pytest.approx(90 * 60, abs=5)
    assert "1h 30m" in oldest_first.content.decode()


def test_sort_by_age_pages_through_the_filtered_channels(admin_client: Client) -> None:
    names = [f"p{i:03d}" for i in range(105)]
    enqueue_many(EnqueueRequest(NOOP, channel=name) for name in names)
    now = timezone.now()
    for i, name in enumerate(names):  # p000 oldest
        Message.objects.filter(channel_id=cid(name)).update(
            enqueued_at=now - timedelta(minutes=200 - i), run_at=now - timedelta(minutes=200 - i)
        )
    o = f"-{column('oldest_ready_display')}"
    first = admin_client.get(CHANNELS, {"o": o})
    second = admin_client.get(CHANNELS, {"o": o, "p": "2"})
    assert page_names(first) == names[:100]
    assert page_names(second) == names[100:]
    searched = admin_client.get(CHANNELS, {"o": o, "q": "p10"})
    assert page_names(searched) == ["p100", "p101", "p102", "p103", "p104"]


def test_oldest_ready_looks_past_the_highest_priority() -> None:
    """The head of the line is the highest priority; an older low-priority message still
    counts as the oldest ready one (one probe per priority level)."""
    enqueue("mixed", 2, priority=-5)
    enqueue("mixed", 2, priority=0)
    enqueue("mixed", 1, priority=9)
    now = timezone.now()
    low = list(Message.objects.filter(channel_id=cid("mixed"), priority=-5))
    Message.objects.filter(pk=low[0].pk).update(enqueued_at=now - timedelta(hours=2))
    Message.objects.filter(priority=-5, pk=low[0].pk).update(run_at=now - timedelta(hours=2))
    since = channel_store.select_channel_oldest_ready([cid("mixed")])[cid("mixed")]
    assert abs((since - (now - timedelta(hours=2))).total_seconds()) < 1
    # a delayed message that became due counts from its run_at, not its enqueue time
    enqueue("late", 1)
    Message.objects.filter(channel_id=cid("late")).update(
        enqueued_at=now - timedelta(days=1), run_at=now - timedelta(minutes=1)
    )
    since = channel_store.select_channel_oldest_ready([cid("late")])[cid("late")]
    assert abs((since - (now - timedelta(minutes=1))).total_seconds()) < 1


def test_filters_and_search(admin_client: Client, queue: dict[str, Any]) -> None:
    assert page_names(admin_client.get(CHANNELS, {"paused__exact": "1"})) == ["gamma"]
    assert page_names(admin_client.get(CHANNELS, {"failures": "yes"})) == ["beta"]
    assert page_names(admin_client.get(CHANNELS, {"failures": "no"})) == ["alpha", "gamma"]
    assert page_names(admin_client.get(CHANNELS, {"backlog_over": "1"})) == ["alpha"]
    assert page_names(admin_client.get(CHANNELS, {"backlog_over": "0"})) == ["alpha", "beta"]
    assert page_names(admin_client.get(CHANNELS, {"q": "lph"})) == ["alpha"]


def test_finished_last_five_minutes_comes_from_the_stats(admin_client: Client) -> None:
    enqueue("done", 1)
    now = timezone.now()
    stats_store.record_channel_stats(
        [
            stats_store.ChannelMinuteStats(
                cid("done"), stats.minute_of(now), succeeded=4, failed=1
            ),
            stats_store.ChannelMinuteStats(
                cid("done"), stats.minute_of(now - timedelta(minutes=10)), succeeded=100
            ),
        ]
    )
    assert page_rows(admin_client.get(CHANNELS))["done"].finished_recent == 5


# ------------------------------------------------------------------------------------------
# editing a channel


def change_url(name: str) -> str:
    return reverse("admin:fairqueue_channel_change", args=[cid(name)])


def form_as_shown(html: str) -> dict[str, str]:
    """What a browser posts back from a change page left as it is: every named input (checked
    boxes only), select and textarea of the page's form, with the values it shows."""
    values: dict[str, str] = {}

    class Reader(HTMLParser):
        select: str | None = None
        textarea: str | None = None

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            a = {k: v or "" for k, v in attrs}
            name = a.get("name")
            if tag == "input" and name and a.get("type") not in ("submit", "button"):
                if a.get("type") != "checkbox" or "checked" in a:
                    values[name] = a.get("value", "on" if a.get("type") == "checkbox" else "")
            elif tag == "select" and name:
                self.select = name
            elif tag == "option" and self.select and "selected" in a:
                values[self.select] = a.get("value", "")
            elif tag == "textarea" and name:
                self.textarea = name
                values[name] = ""

        def handle_endtag(self, tag: str) -> None:
            if tag == "select":
                self.select = None
            elif tag == "textarea":
                self.textarea = None

        def handle_data(self, data: str) -> None:
            if self.textarea:
                values[self.textarea] += data.removeprefix("\n")

    Reader().feed(html)
    return values


def limits(**values: Any) -> dict[str, Any]:
    data = {
        "max_concurrency": "",
        "release_interval": "0",
        "weight": "1",
        "max_backlog": "",
    }
    data.update({k: str(v) for k, v in values.items()})
    return data


def test_change_form_saves_limits(admin_client: Client) -> None:
    enqueue("edit", 2)
    response = admin_client.post(
        change_url("edit"),
        limits(max_concurrency=3, release_interval="00:00:02", weight=4, max_backlog=50),
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    channel = Channel.objects.get(name="edit")
    assert (channel.max_concurrency, channel.weight, channel.max_backlog) == (3, 4, 50)
    assert channel.release_interval == timedelta(seconds=2)
    assert LogEntry.objects.filter(object_id=str(channel.pk), action_flag=CHANGE).exists()
    assert counters("edit").ready == 2


@pytest.mark.parametrize(
    ("values", "field", "message"),
    [
        ({"weight": 0}, "weight", "Weight must be an integer >= 1, got 0"),
        ({"weight": 5000}, "weight", "Weight must be at most 1000, got 5000"),
        (
            {"max_concurrency": 0},
            "max_concurrency",
            "Max concurrency must be an integer >= 1, got 0",
        ),
        ({"max_concurrency": -2}, "max_concurrency", "must be an integer >= 1, got -2"),
        (
            {"max_concurrency": 2_000_000},
            "max_concurrency",
            "Max concurrency must be at most 1000000, got 2000000",
        ),
        (
            {"release_interval": "2 00:00:00"},
            "release_interval",
            "Release interval must be from 0 to 86400 seconds (1 day), got 172800 seconds",
        ),
        ({"release_interval": "-00:00:01"}, "release_interval", "got -1 seconds"),
        ({"max_backlog": 0}, "max_backlog", "Max backlog must be an integer >= 1, got 0"),
    ],
)
def test_change_form_refuses_bad_limits(
    admin_client: Client, values: dict[str, Any], field: str, message: str
) -> None:
    enqueue("strict", 1)
    before = Channel.objects.values().get(name="strict")
    response = admin_client.post(change_url("strict"), limits(**values))
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert field in errors, errors
    assert any(message in e for e in errors[field]), errors[field]
    assert Channel.objects.values().get(name="strict") == before


def test_saving_limits_never_writes_the_counters() -> None:
    """A change saved with a channel read before a claim must not undo that claim."""
    enqueue("racy", 4)
    fold_all()
    stale = Channel.objects.get(name="racy")  # what the admin form was built from
    claim("racy", 3)  # a worker claims meanwhile: ready 1, running 3 on the row
    fold_all()
    request = RequestFactory().post("/")
    request.user = User.objects.create_superuser("root", password="pw")
    model_admin = ChannelAdmin(Channel, mock.Mock())
    stale.weight = 7
    form = mock.Mock(changed_data=["weight"])
    model_admin.save_model(request, stale, form, change=True)
    row = Channel.objects.get(name="racy")
    assert row.weight == 7
    state = channel_state("racy")
    assert (state["ready_count"], state["running_count"]) == (1, 3)
    assert_counters_match_table()


def test_a_change_page_saves_only_what_was_changed_on_it_not_what_changed_meanwhile(
    admin_client: Client,
) -> None:
    enqueue("steered", 2)
    page = admin_client.get(change_url("steered"))
    assert b'name="initial-paused"' in page.content  # the values shown travel with the form
    shown = form_as_shown(page.content.decode())
    # meanwhile another operator (or an action, or code) caps, rate-limits and pauses it
    Channel.objects.filter(name="steered").update(
        max_concurrency=5, release_interval=timedelta(seconds=2), paused=True
    )
    response = admin_client.post(change_url("steered"), {**shown, "weight": "2"})
    assert response.status_code == 302
    row = Channel.objects.values("max_concurrency", "release_interval", "paused", "weight").get(
        name="steered"
    )
    assert row == {
        "max_concurrency": 5,
        "release_interval": timedelta(seconds=2),
        "paused": True,
        "weight": 2,
    }
    # a limit changed on the page is written, even back to the value the page was loaded with
    page = admin_client.get(change_url("steered"))
    Channel.objects.filter(name="steered").update(weight=9)
    response = admin_client.post(change_url("steered"), {**form_as_shown(page.content.decode()),
                                                         "max_concurrency": "1"})  # fmt: skip
    assert response.status_code == 302
    assert Channel.objects.values_list("max_concurrency", "weight").get(name="steered") == (1, 9)


def test_a_group_change_page_saves_only_what_was_changed_on_it(admin_client: Client) -> None:
    group = ChannelGroup.objects.create(name="acme", weight=1, max_concurrency=3)
    url = reverse("admin:fairqueue_channelgroup_change", args=[group.pk])
    shown = form_as_shown(admin_client.get(url).content.decode())
    ChannelGroup.objects.filter(pk=group.pk).update(max_concurrency=10)
    assert admin_client.post(url, {**shown, "weight": "2"}).status_code == 302
    assert ChannelGroup.objects.values_list("max_concurrency", "weight").get(pk=group.pk) == (
        10,
        2,
    )


def test_the_add_form_starts_from_the_channel_defaults(admin_client: Client, settings: Any) -> None:
    settings.FAIRQUEUE = {
        **settings.FAIRQUEUE,
        "CHANNEL_DEFAULTS": {"max_concurrency": 4, "weight": 2},
    }
    form = admin_client.get(reverse("admin:fairqueue_channel_add")).context["adminform"].form
    assert (form["max_concurrency"].value(), form["weight"].value()) == (4, 2)
    assert form["max_backlog"].value() is None


def test_adding_a_channel(admin_client: Client) -> None:
    add = reverse("admin:fairqueue_channel_add")
    response = admin_client.post(add, {"name": "fresh", **limits(weight=3, max_concurrency=2)})
    assert response.status_code == 302
    channel = Channel.objects.get(name="fresh")
    assert (channel.weight, channel.max_concurrency) == (3, 2)
    assert channel_state("fresh")["ready_count"] == 0
    enqueue("fresh", 2)  # enqueue finds the channel by name
    assert counters("fresh").ready == 2
    blank = admin_client.post(add, {"name": "   ", **limits()})
    assert "name" in blank.context["adminform"].form.errors
    # a control character Python counts as a blank is refused, never stripped away
    for name in ("\x1fx", "x\x1f", "reports\x1fx", " padded"):
        refused = admin_client.post(add, {"name": name, **limits()})
        assert refused.status_code == 200, name
        assert "name" in refused.context["adminform"].form.errors, name
    assert not Channel.objects.filter(name__in=["x", "padded"]).exists()
    assert not Channel.objects.filter(name__contains="\x1f").exists()
    group_add = reverse("admin:fairqueue_channelgroup_add")
    refused = admin_client.post(group_add, {"name": "\x1fteam", "weight": 1})
    assert refused.status_code == 200 and "name" in refused.context["adminform"].form.errors
    assert not ChannelGroup.objects.filter(name="team").exists()


def test_a_group_name_refused_for_a_unit_separator_says_group_name(admin_client: Client) -> None:
    group_add = reverse("admin:fairqueue_channelgroup_add")
    refused = admin_client.post(group_add, {"name": "te\x1fam", "weight": 1})
    (error,) = refused.context["adminform"].form.errors["name"]
    assert error.startswith("channel group name must not contain the unit separator"), error
    assert not ChannelGroup.objects.exists()


def test_a_new_cap_counts_completions_not_folded_yet(admin_client: Client) -> None:
    enqueue("busy", 6)
    fold_all()
    done = claim("busy", 5)
    message_store.complete_messages([(m.id, m.lease_token, None) for m in done[:4]])
    fold_all()  # uncapped: these completion deltas do not wake the claim...
    message_store.complete_messages([(m.id, m.lease_token, None) for m in done[4:]])
    assert ChannelDelta.objects.filter(channel_id=cid("busy")).exists()  # ...this one waits
    response = admin_client.post(change_url("busy"), limits(max_concurrency=1))
    assert response.status_code == 302
    row = Channel.objects.get(name="busy")
    state = channel_state("busy")
    assert (row.max_concurrency, state["running_count"], state["ready_count"]) == (1, 0, 1)
    assert not ChannelDelta.objects.filter(channel_id=row.pk).exists()
    # the cap of 1 has its free slot at once
    assert (
        len(message_store.claim_messages(5, lease=LEASE, worker_id="w", only_channel_ids=[row.pk]))
        == 1
    )


def test_channel_name_is_read_only_and_channels_cannot_be_deleted(admin_client: Client) -> None:
    enqueue("keep", 1)
    response = admin_client.post(change_url("keep"), {**limits(weight=2), "name": "renamed"})
    assert response.status_code == 302
    assert Channel.objects.filter(name="keep", weight=2).exists()
    delete = reverse("admin:fairqueue_channel_delete", args=[cid("keep")])
    assert admin_client.post(delete, {"post": "yes"}).status_code == 403
    assert Channel.objects.filter(name="keep").exists()


# ------------------------------------------------------------------------------------------
# channel actions


def test_pause_and_resume(admin_client: Client, queue: dict[str, Any]) -> None:
    ids = [cid("alpha"), cid("beta")]
    action(admin_client, CHANNELS, "pause_channels", ids)
    assert set(Channel.objects.filter(paused=True).values_list("name", flat=True)) == {
        "alpha",
        "beta",
        "gamma",
    }
    # a paused channel is not claimed
    assert message_store.claim_messages(10, lease=LEASE, worker_id="w", only_channel_ids=ids) == []
    action(admin_client, CHANNELS, "resume_channels", [*ids, cid("gamma")])
    assert not Channel.objects.filter(paused=True).exists()
    assert log_messages(CHANGE).count("Paused (admin action).") == 2
    assert log_messages(CHANGE).count("Resumed (admin action).") == 3
    assert_counters_match_table()


def test_retry_failed_is_bulk_and_idempotent(admin_client: Client, queue: dict[str, Any]) -> None:
    response = action(admin_client, CHANNELS, "retry_failed", [cid("beta"), cid("alpha")])
    assert response.status_code == 302
    assert counters("beta").failed == 0
    assert counters("beta").ready == 1 + 3
    assert set(Message.objects.filter(pk__in=queue["failed"]).values_list("state", flat=True)) == {
        MessageState.READY
    }
    again = action(
        admin_client,
        CHANNELS,
        "retry_failed",
        [cid("beta")],
    )
    assert again.status_code == 302
    assert counters("beta").ready == 4  # nothing retried twice
    assert log_messages(CHANGE) == ["Retried 3 failed messages (admin action)."]
    assert_counters_match_table()


def test_purge_backlog_asks_first_then_deletes_waiting_messages(
    admin_client: Client, queue: dict[str, Any]
) -> None:
    ids = [cid("beta"), cid("gamma")]
    confirm = action(admin_client, CHANNELS, "purge_backlog", ids)
    assert confirm.status_code == 200
    text = confirm.content.decode()
    assert "3 waiting messages will be deleted." in text  # beta 1 ready, gamma 2 delayed
    assert Message.objects.count() == 5 + 3 + 1 + 1 + 2  # nothing deleted yet
    done = action(admin_client, CHANNELS, "purge_backlog", ids, post="yes")
    assert done.status_code == 302
    assert (counters("beta").ready, counters("gamma").scheduled) == (0, 0)
    # running and failed messages survive; the other tenant is untouched
    assert counters("beta").running == 1
    assert counters("beta").failed == 3
    assert counters("alpha").ready == 5
    assert sorted(log_messages(CHANGE)) == [
        "Purged the backlog: 1 waiting messages deleted.",
        "Purged the backlog: 2 waiting messages deleted.",
    ]
    assert_counters_match_table()


def test_the_purge_page_names_each_channel_within_its_queue_beside_its_queue(
    admin_client: Client,
) -> None:
    enqueue("c0005", 1)
    enqueue_in_queue("reports", "c0005", 2)
    ids = [cid("c0005"), cid("reports\x1fc0005")]
    html = action(admin_client, CHANNELS, "purge_backlog", ids).content.decode()
    table = html.split('<table class="fq-purge-lines">', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td>", table)
    assert rows == [("c0005", "default", "1"), ("c0005", "reports", "2")]
    assert "\x1f" not in table


def test_channel_actions_need_change_permission(queue: dict[str, Any]) -> None:
    viewer = client_for(user_with("fairqueue.view_channel"))
    response = viewer.get(CHANNELS)
    assert response.status_code == 200
    assert "pause_channels" not in response.content.decode()
    action(viewer, CHANNELS, "pause_channels", [cid("alpha")])
    action(viewer, CHANNELS, "retry_failed", [cid("beta")])
    action(viewer, CHANNELS, "purge_backlog", [cid("alpha")], post="yes")
    assert not Channel.objects.filter(name="alpha", paused=True).exists()
    assert counters("beta").failed == 3
    assert counters("alpha").ready == 5
    assert viewer.post(change_url("alpha"), limits(weight=9)).status_code == 403
    assert Channel.objects.get(name="alpha").weight == 1
    assert not LogEntry.objects.exists()


def test_purge_needs_delete_message_permission(queue: dict[str, Any]) -> None:
    editor = client_for(user_with("fairqueue.view_channel", "fairqueue.change_channel"))
    assert "purge_backlog" not in editor.get(CHANNELS).content.decode()
    action(editor, CHANNELS, "purge_backlog", [cid("alpha")], post="yes")
    assert counters("alpha").ready == 5
    action(editor, CHANNELS, "pause_channels", [cid("alpha")])  # change is enough for this
    assert Channel.objects.get(name="alpha").paused
    purger = client_for(
        user_with("fairqueue.change_channel", "fairqueue.delete_message", name="purger")
    )
    assert "purge_backlog" in purger.get(CHANNELS).content.decode()
    action(purger, CHANNELS, "purge_backlog", [cid("alpha")], post="yes")
    assert counters("alpha").ready == 0


def test_non_staff_and_anonymous_get_nothing(queue: dict[str, Any]) -> None:
    outsider = client_for(user_with("fairqueue.view_channel", staff=False, name="outsider"))
    for client in (Client(), outsider):
        for url in (CHANNELS, MESSAGES, BATCHES, DASHBOARD, DASHBOARD_DATA):
            response = client.get(url)
            assert response.status_code == 302, url
            assert response["Location"].startswith(reverse("admin:login")), url
            assert b"alpha" not in response.content
        action(client, CHANNELS, "pause_channels", [cid("alpha")])
    assert not Channel.objects.filter(name="alpha", paused=True).exists()


# ------------------------------------------------------------------------------------------
# messages


def test_message_list_and_detail(admin_client: Client, queue: dict[str, Any]) -> None:
    listing = admin_client.get(MESSAGES, {"state__exact": "failed"})
    assert listing.status_code == 200
    shown = {m.pk for m in listing.context["cl"].result_list}
    assert shown == set(queue["failed"])
    assert "builtins.ValueError: bad &lt;input&gt;" in listing.content.decode()
    by_channel = admin_client.get(MESSAGES, {"channel__id__exact": cid("alpha")})
    assert len(by_channel.context["cl"].result_list) == 5
    detail = admin_client.get(reverse("admin:fairqueue_message_change", args=[queue["failed"][0]]))
    html = detail.content.decode()
    assert detail.status_code == 200
    assert '<pre class="fq-traceback">Traceback (most recent call last):' in html
    assert "&quot;args&quot;" in html  # the payload, pretty-printed and escaped
    assert 'name="_save"' not in html  # read-only
    running = admin_client.get(
        reverse("admin:fairqueue_message_change", args=[queue["running"][0].id])
    )
    assert str(queue["running"][0].lease_token) in running.content.decode()


def test_message_actions_go_through_the_store(admin_client: Client, queue: dict[str, Any]) -> None:
    alpha = list(Message.objects.filter(channel_id=cid("alpha")).values_list("pk", flat=True))
    running = queue["running"][0].id
    # retry: only failed ones
    action(admin_client, MESSAGES, "retry_messages", [*queue["failed"][:2], alpha[0]])
    assert counters("beta").failed == 1
    # cancel: waiting ones only; the running one is left alone
    action(admin_client, MESSAGES, "cancel_messages", [alpha[0], alpha[1], running])
    assert Message.objects.get(pk=running).state == MessageState.RUNNING
    assert Message.objects.get(pk=alpha[0]).state == MessageState.CANCELLED
    assert counters("alpha").ready == 3
    # delete: anything not running
    action(admin_client, MESSAGES, "delete_messages", [alpha[2], queue["failed"][2], running])
    assert not Message.objects.filter(pk__in=[alpha[2], queue["failed"][2]]).exists()
    assert Message.objects.filter(pk=running).exists()
    assert counters("beta").failed == 0
    assert_counters_match_table()
    assert log_messages(CHANGE).count("Retried (admin action).") == 2
    assert log_messages(CHANGE).count("Cancelled (admin action).") == 2
    assert LogEntry.objects.filter(action_flag=DELETION).count() == 2
    # abort: a waiting message is cancelled, the running one asked to stop
    action(admin_client, MESSAGES, "abort_messages", [alpha[3], running])
    assert Message.objects.get(pk=alpha[3]).state == MessageState.CANCELLED
    aborting = Message.objects.get(pk=running)
    assert aborting.state == MessageState.RUNNING and aborting.abort_requested_at is not None
    assert log_messages(CHANGE).count("Aborted (cancelled if it was waiting) (admin action).") == 2
    assert_counters_match_table()


def test_message_actions_need_their_permissions(queue: dict[str, Any]) -> None:
    viewer = client_for(user_with("fairqueue.view_message"))
    assert viewer.get(MESSAGES).status_code == 200
    action(viewer, MESSAGES, "retry_messages", queue["failed"])
    action(viewer, MESSAGES, "delete_messages", queue["failed"])
    assert counters("beta").failed == 3
    running = queue["running"][0].id
    action(viewer, MESSAGES, "abort_messages", [running])
    ready = list(Message.objects.filter(state="ready").values_list("pk", flat=True))
    action(viewer, MESSAGES, "cancel_messages", ready)
    assert Message.objects.get(pk=running).abort_requested_at is None
    assert not Message.objects.filter(state="cancelled").exists()
    changer = client_for(user_with("fairqueue.change_message", name="changer"))
    action(changer, MESSAGES, "delete_messages", queue["failed"])
    assert counters("beta").failed == 3
    action(changer, MESSAGES, "retry_messages", queue["failed"][:1])
    assert counters("beta").failed == 2
    url = reverse("admin:fairqueue_message_delete", args=[queue["failed"][1]])
    assert changer.post(url, {"post": "yes"}).status_code == 403
    add = reverse("admin:fairqueue_message_add")
    assert changer.get(add).status_code == 403


# ------------------------------------------------------------------------------------------
# work batches


@pytest.fixture
def batches() -> dict[str, list[WorkBatch]]:
    channel = Channel.objects.create(name="pipeline")
    now = timezone.now()

    def batch(job: str, start: int, state: str, **more: Any) -> WorkBatch:
        return WorkBatch.objects.create(
            channel=channel,
            job_name=job,
            start_id=start,
            end_id=start + 99,
            row_count=100,
            state=state,
            **more,
        )

    failed = dict(attempts=3, last_error=FAILURE, finished_at=now, rows_processed=40)
    return {
        "export": [
            batch("export", 0, BatchState.SUCCEEDED, rows_processed=100, finished_at=now),
            batch(
                "export",
                100,
                BatchState.RUNNING,
                attempts=1,
                started_at=now,
                lease_token=uuid.uuid4(),
            ),
            batch("export", 200, BatchState.FAILED, **failed),
            batch("export", 300, BatchState.PENDING),
        ],
        "reindex": [
            batch("reindex", 0, BatchState.FAILED, **failed),
            batch("reindex", 100, BatchState.FAILED, **failed),
        ],
    }


def test_work_batch_progress_per_job(admin_client: Client, batches: Any) -> None:
    response = admin_client.get(BATCHES)
    assert response.status_code == 200
    jobs = {j["job_name"]: j for j in response.context["jobs"]}
    export = jobs["export"]
    assert (export["done"], export["total"], export["running"], export["failed"]) == (1, 4, 1, 1)
    assert (export["rows_done"], export["rows"], export["percent"]) == (100, 400, 25.0)
    assert export["state"] == "running" and export["eta"] is None  # no rate measured yet
    assert jobs["reindex"]["failed"] == 2 and jobs["reindex"]["state"] == "failed"
    assert "Retry failed" in response.content.decode()


def test_work_batch_retry_action_and_per_job(admin_client: Client, batches: Any) -> None:
    export = batches["export"]
    action(admin_client, BATCHES, "retry_batches", [b.pk for b in export])
    states = dict(WorkBatch.objects.filter(job_name="export").values_list("start_id", "state"))
    assert states == {0: "succeeded", 100: "running", 200: "pending", 300: "pending"}
    retried = WorkBatch.objects.get(job_name="export", start_id=200)
    assert (retried.attempts, retried.rows_processed, retried.finished_at) == (0, 0, None)
    assert retried.last_error == FAILURE  # kept for the record
    assert batch_store.retry_failed_work_batches([retried.pk]) == []  # idempotent
    url = reverse("admin:fairqueue_workbatch_retry_job")
    assert admin_client.post(url, {"job": "reindex"}).status_code == 302
    assert set(WorkBatch.objects.filter(job_name="reindex").values_list("state", flat=True)) == {
        "pending"
    }
    assert (
        log_messages(CHANGE).count("Retried: back to pending with attempts 0 (admin action).") == 3
    )


def test_work_batch_retry_needs_change_permission(batches: Any) -> None:
    viewer = client_for(user_with("fairqueue.view_workbatch"))
    response = viewer.get(BATCHES)
    assert response.status_code == 200
    assert "Retry failed" not in response.content.decode()
    action(viewer, BATCHES, "retry_batches", [b.pk for b in batches["reindex"]])
    assert (
        viewer.post(reverse("admin:fairqueue_workbatch_retry_job"), {"job": "reindex"}).status_code
        == 403
    )
    assert WorkBatch.objects.filter(state=BatchState.FAILED).count() == 3


def test_retrying_a_job_with_a_nul_in_its_name_is_a_clear_400_and_an_unknown_one_retries_none(
    admin_client: Client, batches: Any
) -> None:
    url = reverse("admin:fairqueue_workbatch_retry_job")
    refused = admin_client.post(url, {"job": "re\x00index"})
    assert refused.status_code == 400
    assert refused.content.decode() == (
        "The job name contains a NUL character, which no stored value has."
    )
    unknown = admin_client.post(url, {"job": "nosuch"}, follow=True)
    assert "Retried 0 failed batches of job nosuch." in unknown.content.decode()
    assert WorkBatch.objects.filter(state=BatchState.FAILED).count() == 3  # nothing changed
    assert not LogEntry.objects.exists()


# ------------------------------------------------------------------------------------------
# dashboard


def record_minute(name: str, minute: datetime, claimed: int, waits_ms: list[float]) -> None:
    hist = [0] * (len(WAIT_BUCKETS_MS) + 1)
    for w in waits_ms:
        hist[stats.bucket_of(w)] += 1
    stats_store.record_channel_stats(
        [
            stats_store.ChannelMinuteStats(
                cid(name),
                stats.minute_of(minute),
                claimed=claimed,
                succeeded=claimed,
                wait_ms_sum=int(sum(waits_ms)),
                wait_ms_max=int(max(waits_ms)),
                wait_histogram=tuple(hist),
            )
        ]
    )


def test_dashboard_page_and_json(admin_client: Client, queue: dict[str, Any]) -> None:
    now = timezone.now()
    record_minute("alpha", now, 6, [3.0] * 6)
    record_minute("beta", now, 2, [700.0, 800.0])
    page = admin_client.get(DASHBOARD)
    assert page.status_code == 200
    html = page.content.decode()
    assert "django_fairqueue/dashboard.js" in html
    assert 'id="fq-initial"' in html
    assert "alpha" in html and "beta" in html
    data = admin_client.get(DASHBOARD_DATA, {"sort": "failed", "limit": "2"}).json()
    assert data["totals"]["ready"] == 5 + 1
    assert data["totals"]["failed"] == 3
    assert data["totals"]["backlogged"] == 2
    assert [t["name"] for t in data["tenants"]] == ["beta", "alpha"]
    beta = data["tenants"][0]
    assert (beta["running"], beta["failed"], beta["served"]) == (1, 3, 2)
    assert beta["served_share"] == 0.25
    assert 500 <= beta["wait"]["p50_ms"] <= 1000
    # backlogged and not paused: alpha (6 served) and beta (2): J = 64 / (2 * 40) = 0.8
    assert data["fairness"]["index"] == 0.8
    assert len(data["series"]) == 30
    assert data["series"][-1]["claimed"] == 8


def test_the_dashboards_first_render_formats_ages_and_waits_as_its_refresh_does(
    admin_client: Client,
) -> None:
    enqueue("old", 1)
    enqueue("unserved", 1)
    now = timezone.now()
    Message.objects.filter(channel_id=cid("old")).update(
        enqueued_at=now - timedelta(minutes=90), run_at=now - timedelta(minutes=90)
    )
    record_minute("old", now, 2, [700.0, 800.0])
    page = admin_client.get(DASHBOARD)
    (old,) = [t for t in page.context["data"]["tenants"] if t["name"] == "old"]
    tbody = page.content.decode().split('<table id="fq-table"', 1)[1].split("</tbody>", 1)[0]

    def cells(name: str) -> list[str]:
        row = tbody.split(f"<tr><td>{name}</td>", 1)[1].split("</tr>", 1)[0]
        return re.findall(r"<td>(.*?)</td>", row)[-4:-1]  # wait p50, wait p95, oldest ready

    # as dashboard.js's fmtMs and fmtAge, and the channel list's ages
    waits = [overview.format_ms(old["wait"]["p50_ms"]), overview.format_ms(old["wait"]["p95_ms"])]
    assert waits[0].endswith(" ms") and cells("old") == [*waits, "1h 30m"]
    assert cells("unserved")[:2] == ["-", "-"] and re.fullmatch(r"\d+s", cells("unserved")[2])


def test_dashboard_needs_view_permission(queue: dict[str, Any]) -> None:
    nobody = client_for(user_with())
    assert nobody.get(DASHBOARD).status_code == 403
    assert nobody.get(DASHBOARD_DATA).status_code == 403
    viewer = client_for(user_with("fairqueue.view_channel", name="viewer"))
    assert viewer.get(DASHBOARD_DATA).status_code == 200


# ------------------------------------------------------------------------------------------
# fairqueue status


def test_status_table_and_json(queue: dict[str, Any]) -> None:
    out = io.StringIO()
    call_command("fairqueue", "status", "--sort", "failed", stdout=out)
    lines = out.getvalue().splitlines()
    assert re.split(r"\s{2,}", lines[0]) == [
        "CHANNEL",
        "QUEUE",
        "READY",
        "DELAYED",
        "RETRYING",
        "RUNNING",
        "FAILS 5M",
        "TIMEOUTS 5M",
        "DEAD",
        "OLDEST",
        "DONE 5M",
        "WEIGHT",
        "INTERVAL",
        "PAUSED",
    ]
    assert lines[1].split()[:9] == ["beta", "default", "1", "0", "0", "1/-", "0", "0", "3"]
    assert lines[3].split()[-1] == "yes"  # gamma paused
    assert "3 channels (3 shown, sorted by failed; 2 with ready messages, 1 paused)" in lines[5]
    assert lines[6].startswith("0 live workers")  # then the warning: work waits, no worker
    assert lines[-1].startswith("WARNING: no live worker")
    out = io.StringIO()
    call_command("fairqueue", "status", "--json", "--limit", "1", stdout=out)
    data = json.loads(out.getvalue())
    assert [(c["name"], c["queue"]) for c in data["channels"]] == [("alpha", "default")]
    assert data["channels"][0]["ready"] == 5
    assert data["queues"] == {
        "default": {"channels": 3, "ready": 6, "running": 1, "live_workers": 0}
    }
    assert data["totals"] == {
        "channels": 3,
        "backlogged": 2,
        "paused": 1,
        "ready": 6,
        "scheduled": 2,
        "running": 1,
        "failed": 3,
        "succeeded": 0,
        "retrying": 0,
        "failures_last_5m": 0,
        "timeouts_last_5m": 0,
    }


def test_status_watch_redraws_until_interrupted(queue: dict[str, Any]) -> None:
    sleeps: list[float] = []

    def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    out = io.StringIO()
    with mock.patch("django_fairqueue.cli.status.time.sleep", fake_sleep):
        call_command("fairqueue", "status", "--json", "--watch", "0.5", stdout=out)
    documents = [json.loads(line) for line in out.getvalue().splitlines() if line]
    assert len(documents) == 2
    assert sleeps == [0.5, 0.5]


# ------------------------------------------------------------------------------------------
# metrics


def test_metrics_exposition(queue: dict[str, Any]) -> None:
    from django_fairqueue import metrics

    Channel.objects.filter(name="beta").update(max_concurrency=4)
    process = metrics.PROCESS_REGISTRY
    before = process.get_sample_value("fairqueue_claim_duration_seconds_count") or 0
    metrics.observe_claim(0.003)
    metrics.observe_claim(0.2)
    request = RequestFactory().get("/metrics")
    request.user = User.objects.create_superuser("root", password="pw")
    response = metrics.metrics_view(request)
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    text = response.content.decode()
    for line in (
        'fairqueue_channel_ready{channel="alpha",queue="default"} 5.0',
        'fairqueue_channel_ready{channel="beta",queue="default"} 1.0',
        'fairqueue_channel_running{channel="beta",queue="default"} 1.0',
        'fairqueue_channel_failed{channel="beta",queue="default"} 3.0',
        'fairqueue_channel_scheduled{channel="gamma",queue="default"} 2.0',
        'fairqueue_channel_max_concurrency{channel="beta",queue="default"} 4.0',
        'fairqueue_channel_succeeded_total{channel="alpha",queue="default"} 0.0',
    ):
        assert line in text.splitlines(), line
    assert 'fairqueue_channel_max_concurrency{channel="alpha"' not in text
    after = process.get_sample_value("fairqueue_claim_duration_seconds_count")
    assert after == before + 2
    # a web process claims nothing: its view exports no (always empty) claim histogram
    assert "fairqueue_claim_duration_seconds" not in text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in metrics.REGISTRY.collect()
        for s in family.samples
    }
    ages = {dict(k[1])["channel"]: v for k, v in samples.items() if k[0].endswith("age_seconds")}
    assert set(ages) >= {"alpha", "(all)"} and ages["(all)"] >= ages["alpha"] >= 0
    assert ("fairqueue_stale_leases", ()) in samples
    assert ("fairqueue_aborts_pending", ()) in samples
    assert ("fairqueue_retried_last_5m", ()) in samples
    assert samples[("fairqueue_workers", (("state", "alive"),))] == 0


def test_metrics_view_is_not_public(settings: Any) -> None:
    from django.contrib.auth.models import AnonymousUser

    from django_fairqueue import metrics

    def get(user: Any = None, auth: str | None = None) -> int:
        headers = {"HTTP_AUTHORIZATION": auth} if auth else {}
        request = RequestFactory().get("/metrics", **headers)
        request.user = user or AnonymousUser()
        return metrics.metrics_view(request).status_code

    assert get() == 403
    assert get(user_with("fairqueue.view_channel", staff=False, name="notstaff")) == 403
    assert get(user_with(name="noperm")) == 403
    assert get(user_with("fairqueue.view_channel", name="staffer")) == 200
    settings.FAIRQUEUE_METRICS_TOKEN = "s3cret"
    assert get() == 401
    assert get(auth="Bearer wrong") == 403
    assert get(auth="Bearer s3cret") == 200
    assert get(auth="Basic s3cret") == 403


def test_metrics_without_prometheus_client_says_what_to_install() -> None:
    real_import = builtins.__import__

    def hiding(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "prometheus_client" or name.startswith("prometheus_client."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    saved = sys.modules.pop("django_fairqueue.metrics", None)
    try:
        with (
            mock.patch("builtins.__import__", hiding),
            pytest.raises(
                ImproperlyConfigured, match=re.escape("pip install django-fairqueue[prometheus]")
            ),
        ):
            importlib.import_module("django_fairqueue.metrics")
    finally:
        sys.modules.pop("django_fairqueue.metrics", None)
        if saved is not None:
            sys.modules["django_fairqueue.metrics"] = saved


# ------------------------------------------------------------------------------------------
# statistics


def claimed_message(
    channel_id: int, enqueued: datetime, run_at: datetime
) -> message_store.ClaimedMessage:
    return message_store.ClaimedMessage(
        id=1,
        channel_id=channel_id,
        channel="c",
        task_name=NOOP,
        payload={},
        priority=0,
        attempts=1,
        max_attempts=1,
        keep_result=False,
        lease_token=mock.sentinel.token,  # type: ignore[arg-type]
        lease_expires_at=enqueued,
        enqueued_at=enqueued,
        run_at=run_at,
    )


def test_recorder_tallies_waits_and_outcomes_per_minute() -> None:
    enqueue("s", 1)
    channel = cid("s")
    claimed_at = datetime(2030, 1, 1, 12, 30, 45, tzinfo=UTC)
    t0 = claimed_at - timedelta(milliseconds=3)
    recorder = stats.StatsRecorder()
    recorder.record_claimed(
        [
            claimed_message(channel, t0, t0),  # waited 3 ms
            # a retry: ready from its run_at, 250 ms before the claim
            claimed_message(
                channel, claimed_at - timedelta(hours=1), claimed_at - timedelta(milliseconds=250)
            ),
            # run_at after the claim (clock skew): counts as 0
            claimed_message(channel, t0, claimed_at + timedelta(seconds=1)),
        ],
        claimed_at,
    )
    later = claimed_at + timedelta(minutes=1)
    recorder.record_settled(channel, "succeeded", 12.4, at=later)
    recorder.record_settled(channel, "retried", 5, at=later)
    recorder.record_settled(channel, "failed", 1, at=later)
    with pytest.raises(ValueError, match="outcome"):
        recorder.record_settled(channel, "released", 1)  # type: ignore[arg-type]
    assert recorder.pending() == 2
    assert recorder.flush() == 2
    assert recorder.pending() == 0
    first = ChannelStat.objects.get(channel_id=channel, minute=stats.minute_of(claimed_at))
    assert first.minute == datetime(2030, 1, 1, 12, 30, tzinfo=UTC)
    assert (first.claimed, first.wait_ms_sum, first.wait_ms_max) == (3, 253, 250)
    expected = [0] * (len(WAIT_BUCKETS_MS) + 1)
    expected[0] += 1  # 0 ms
    expected[WAIT_BUCKETS_MS.index(5)] += 1  # 3 ms: (2, 5]
    expected[WAIT_BUCKETS_MS.index(500)] += 1  # 250 ms: (200, 500]
    assert first.wait_histogram == expected
    second = ChannelStat.objects.get(channel_id=channel, minute=stats.minute_of(later))
    assert (second.succeeded, second.retried, second.failed, second.run_ms_sum) == (1, 1, 1, 18)
    # a second flush adds to the same rows
    recorder.record_claimed([claimed_message(channel, t0, t0)], claimed_at)
    recorder.flush()
    first.refresh_from_db()
    assert first.claimed == 4
    assert first.wait_histogram[WAIT_BUCKETS_MS.index(5)] == 2


def test_recorder_counts_a_claim_of_several_channels_as_its_messages_one_by_one() -> None:
    claimed_at = datetime(2030, 1, 1, 12, 30, 45, tzinfo=UTC)
    ready = [(7, 3), (8, 1200), (7, 0.4), (9, -2), (8, 70_000), (7, 250)]  # ms before the claim
    messages = [
        claimed_message(
            channel,
            claimed_at - timedelta(milliseconds=ms),
            claimed_at - timedelta(milliseconds=ms),
        )
        for channel, ms in ready
    ]
    whole, one_by_one = stats.StatsRecorder(), stats.StatsRecorder()
    whole.record_claimed(messages, claimed_at)
    for message in messages:
        one_by_one.record_claimed([message], claimed_at)
    assert whole._tallies == one_by_one._tallies
    seven = whole._tallies[(7, stats.minute_of(claimed_at))]
    assert (seven.claimed, seven.wait_ms_sum, seven.wait_ms_max) == (3, 253, 250)


def test_recorder_counts_a_settled_batch_as_its_attempts_one_by_one() -> None:
    now = timezone.now()
    attempts: list[tuple[int, stats.Outcome, float, bool]] = [
        (7, "succeeded", 12.4, False),
        (7, "failed", 3.0, True),
        (8, "retried", 0.4, False),
        (7, "succeeded", -1.0, False),  # a clock step back: counts as 0 ms
        (8, "failed", 2.6, False),
    ]
    one_by_one, batched = stats.StatsRecorder(), stats.StatsRecorder()
    for channel, outcome, run_ms, timed_out in attempts:
        one_by_one.record_settled(channel, outcome, run_ms, at=now, timed_out=timed_out)
    batched.record_settled_many(attempts, at=now)
    assert batched._tallies == one_by_one._tallies
    seven = batched._tallies[(7, stats.minute_of(now))]
    assert (seven.succeeded, seven.failed, seven.timed_out, seven.run_ms_sum) == (2, 1, 1, 15)
    # a bad entry counts nothing of its batch
    for bad in [(7, "released", 1.0, False), (7, "succeeded", 1.0, True)]:
        with pytest.raises(ValueError):
            batched.record_settled_many([(7, "succeeded", 1.0, False), bad], at=now)  # type: ignore[list-item]
    assert batched._tallies == one_by_one._tallies


def test_recorder_keeps_tallies_when_a_flush_fails() -> None:
    enqueue("s", 1)
    channel = cid("s")
    recorder = stats.StatsRecorder()
    now = timezone.now()
    recorder.record_settled(channel, "succeeded", 10, at=now)
    with (
        mock.patch.object(stats_store, "record_channel_stats", side_effect=RuntimeError("db down")),
        pytest.raises(RuntimeError),
    ):
        recorder.flush()
    recorder.record_settled(channel, "succeeded", 5, at=now)
    assert recorder.flush() == 1
    row = ChannelStat.objects.get(channel_id=channel)
    assert (row.succeeded, row.run_ms_sum) == (2, 15)


def test_recorder_is_thread_safe() -> None:
    import threading

    recorder = stats.StatsRecorder()
    now = timezone.now()

    def work() -> None:
        for _ in range(2000):
            recorder.record_settled(7, "succeeded", 1, at=now)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tally = recorder._tallies[(7, stats.minute_of(now))]
    assert (tally.succeeded, tally.run_ms_sum) == (8000, 8000)


def test_percentiles_from_histograms() -> None:
    n = len(WAIT_BUCKETS_MS) + 1
    hist = [0] * n
    hist[WAIT_BUCKETS_MS.index(10)] = 100  # 100 waits in (5, 10] ms
    assert stats.percentile_from_histogram(hist, 50) == pytest.approx(7.5)
    assert stats.percentile_from_histogram(hist, 95) == pytest.approx(9.75)
    assert stats.percentile_from_histogram(hist, 100) == pytest.approx(10)
    # the largest wait seen closes the bucket: all 100 waits are at most 8 ms
    assert stats.percentile_from_histogram(hist, 100, max_ms=8) == pytest.approx(8)
    two = [0] * n
    two[0] = 50  # [0, 1]
    two[WAIT_BUCKETS_MS.index(1000)] = 50  # (500, 1000]
    assert stats.percentile_from_histogram(two, 50) == pytest.approx(1.0)
    assert stats.percentile_from_histogram(two, 95) == pytest.approx(500 + 500 * 45 / 50)
    # the open last bucket ends at the maximum
    top = [0] * n
    top[-1] = 10
    assert stats.percentile_from_histogram(top, 50, max_ms=90_000) == pytest.approx(75_000)
    assert stats.percentile_from_histogram([0] * n, 50) is None
    with pytest.raises(ValueError):
        stats.percentile_from_histogram([1], 50)
    summary = stats.WaitSummary.of(two, wait_sum=50 * 1 + 50 * 700, wait_max=900)
    assert (summary.count, summary.mean_ms, summary.max_ms) == (100, 350.5, 900)
    assert summary.p95_ms == pytest.approx(500 + 400 * 45 / 50)


def test_jain_index() -> None:
    assert stats.jain_index([5, 5, 5, 5]) == 1.0
    assert stats.jain_index([10, 0, 0, 0]) == 0.25
    assert stats.jain_index([1, 2, 3]) == pytest.approx(36 / (3 * 14))
    assert stats.jain_index([]) is None
    assert stats.jain_index([0, 0]) is None
    with pytest.raises(ValueError):
        stats.jain_index([-1, 2])


def test_fairness_weights_shares_and_counts_the_starved() -> None:
    # weights 1, 2, 1: served 10, 20, 0 (the third starved) -> x = 10, 10, 0
    fair = stats.fairness({1: 1, 2: 2, 3: 1}, 5, served={1: 10, 2: 20, 9: 99})
    assert fair.index == pytest.approx(400 / (3 * 200))
    assert (fair.channels, fair.served) == (3, 30)
    assert fair.shares == {1: pytest.approx(1 / 3), 2: pytest.approx(2 / 3), 3: 0.0}


def test_stats_queries_over_a_window() -> None:
    enqueue("w1", 1)
    enqueue("w2", 1)
    now = datetime(2030, 6, 1, 10, 4, 30, tzinfo=UTC)
    record_minute("w1", now, 4, [3, 3, 3, 3])
    record_minute("w2", now - timedelta(minutes=2), 2, [700, 900])
    record_minute("w1", now - timedelta(minutes=10), 50, [1])
    assert stats.window_start(5, now) == datetime(2030, 6, 1, 10, 0, tzinfo=UTC)
    assert stats.served_counts(5, now=now) == {cid("w1"): 4, cid("w2"): 2}
    assert stats.finished_counts(5, now=now, channel_ids=[cid("w2")]) == {cid("w2"): 2}
    overall = stats.wait_summary(5, now=now)
    assert (overall.count, overall.max_ms) == (6, 900)
    waits = stats.wait_by_channel(5, [cid("w1"), cid("w2")], now=now)
    assert waits[cid("w1")].p95_ms is not None and waits[cid("w1")].p95_ms <= 5
    series = stats.minute_series(5, now=now)
    assert [m.claimed for m in series] == [0, 0, 2, 0, 4]
    assert series[0].wait.p50_ms is None
    # the per-minute sums, written by the same flushes, hold the same totals
    minutes = {m.minute: m for m in MinuteStat.objects.all()}
    assert {m: row.claimed for m, row in minutes.items()} == {
        stats.minute_of(now): 4,
        stats.minute_of(now - timedelta(minutes=2)): 2,
        stats.minute_of(now - timedelta(minutes=10)): 50,
    }
    assert sum(minutes[stats.minute_of(now)].wait_histogram) == 4
    stats.prune(timedelta(days=1))  # these rows are in 2030: nothing is old
    assert (ChannelStat.objects.count(), MinuteStat.objects.count()) == (3, 3)
    stats_store.prune_channel_stats(now - timedelta(minutes=5))
    assert (ChannelStat.objects.count(), MinuteStat.objects.count()) == (2, 2)


def test_the_minute_sums_add_up_over_channels_and_flushes() -> None:
    """Several channels in one flush and the same minute in several flushes: each minute row
    holds the sums, the histograms summed element by element, the largest wait the largest."""
    for name in ("s1", "s2", "s3"):
        enqueue(name, 1)
    channels = [cid(name) for name in ("s1", "s2", "s3")]
    minute = stats.minute_of(timezone.now())
    n = len(WAIT_BUCKETS_MS) + 1

    def tally(
        channel: int, claimed: int, bucket: int, wait_max: int
    ) -> stats_store.ChannelMinuteStats:
        hist = [0] * n
        hist[bucket] = claimed
        return stats_store.ChannelMinuteStats(
            channel,
            minute,
            claimed=claimed,
            succeeded=claimed - 1,
            retried=1,
            timed_out=1,
            wait_ms_sum=claimed * 10,
            wait_ms_max=wait_max,
            wait_histogram=tuple(hist),
            run_ms_sum=claimed,
        )

    stats_store.record_channel_stats([tally(channels[0], 5, 2, 40), tally(channels[1], 3, 4, 900)])
    stats_store.record_channel_stats([tally(channels[1], 2, 4, 20), tally(channels[2], 4, 0, 1)])
    row = MinuteStat.objects.get(minute=minute)
    assert (row.claimed, row.succeeded, row.retried, row.timed_out) == (14, 10, 4, 4)
    assert (row.wait_ms_sum, row.wait_ms_max, row.run_ms_sum) == (140, 900, 14)
    expected = [0] * n
    expected[0], expected[2], expected[4] = 4, 5, 5
    assert row.wait_histogram == expected
    # what the dashboard reads from it is what the channel rows say
    overall = stats.wait_summary(1)
    assert (overall.count, overall.max_ms) == (14, 900)
    assert stats.outcome_totals(1)["claimed"] == sum(
        ChannelStat.objects.values_list("claimed", flat=True)
    )


@pytest.mark.django_db(transaction=True)
def test_concurrent_flushes_neither_deadlock_nor_lose_counts() -> None:
    """Workers flush at the same time, over the same channels and minutes, each in its own
    order: the channel rows and then the shared minute rows are locked in sorted order, so
    every flush completes and every count arrives once."""
    import threading

    from django.db import connections

    names = [f"c{i}" for i in range(20)]
    for name in names:
        enqueue(name, 1)
    channels = [cid(name) for name in names]
    now = timezone.now()
    minutes = [stats.minute_of(now - timedelta(minutes=k)) for k in range(3)]
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def flush(seed: int) -> None:
        try:
            start.wait()
            for round_ in range(15):
                order = channels[::-1] if (seed + round_) % 2 else channels
                stats_store.record_channel_stats(
                    [
                        stats_store.ChannelMinuteStats(c, m, claimed=1, succeeded=1)
                        for c in order
                        for m in (minutes[::-1] if seed % 2 else minutes)
                    ]
                )
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=flush, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    per_minute = 4 * 15 * len(channels)
    assert {m.minute: m.claimed for m in MinuteStat.objects.all()} == dict.fromkeys(
        minutes, per_minute
    )
    assert set(ChannelStat.objects.values_list("claimed", flat=True)) == {4 * 15}


# ------------------------------------------------------------------------------------------
# signals and logging


def test_message_enqueued_signal() -> None:
    got: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        got.append({"sender": sender, **kwargs})

    message_enqueued.connect(receiver)
    try:
        ids = enqueue_many(
            [
                EnqueueRequest(NOOP, channel="one"),
                EnqueueRequest(NOOP, channel="two"),
                EnqueueRequest(NOOP, channel="one"),
            ]
        )
        enqueue_many([])  # nothing enqueued, nothing sent
    finally:
        message_enqueued.disconnect(receiver)
    assert got == [
        {
            "sender": Message,
            "signal": message_enqueued,
            "message_ids": ids,
            "channels": ["one", "two", "one"],
            "queues": ["default", "default", "default"],
        }
    ]
    enqueue("three", 1)
    assert len(got) == 1  # disconnected: not sent


def test_logging_filter_adapter_and_json_formatter() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(MessageContextFilter())
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("tests.fairqueue.logging")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    message = claimed_message(3, timezone.now(), timezone.now())
    try:
        log.info("outside")
        token = current_message.set(message)
        try:
            log.info("inside %s", "task", extra={"duration": 0.5})
            try:
                raise ValueError("boom")
            except ValueError:
                log.exception("failed")
        finally:
            current_message.reset(token)
        message_logger(log, message).warning("settled", extra={"outcome": "succeeded"})
        log.info("explicit", extra={"channel": "other", "message_id": 99})
    finally:
        log.removeHandler(handler)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines[0]["message"] == "outside"
    assert "channel" not in lines[0]
    assert lines[1]["message"] == "inside task"
    fields = ("channel", "task", "message_id", "attempt")
    assert [lines[1][k] for k in fields] == ["c", NOOP, 1, 1]
    assert lines[1]["duration"] == 0.5
    assert "ValueError: boom" in lines[2]["exc_info"]
    assert (lines[3]["channel"], lines[3]["outcome"], lines[3]["level"]) == (
        "c",
        "succeeded",
        "WARNING",
    )
    assert (lines[4]["channel"], lines[4]["message_id"]) == ("other", 99)
    # with a plain format string the fields exist even outside a message
    record = logging.LogRecord("x", logging.INFO, "x", 1, "m", None, None)
    MessageContextFilter().filter(record)
    assert logging.Formatter("%(channel)s %(message_id)s %(message)s").format(record) == (
        "None None m"
    )


def test_channel_list_puts_starvation_and_failure_first_and_filters_by_them(
    admin_client: Client, queue: dict[str, Any]
) -> None:
    from django_fairqueue.runtime import worker_registry

    worker_registry.Registration("live-worker", concurrency=4).register()  # its leases are renewed
    # beta runs 1 under a cap lowered to... 1 (at cap), then a second running one: over cap
    Channel.objects.filter(name="beta").update(max_concurrency=1)
    html = admin_client.get(CHANNELS).content.decode()
    columns = (
        "ready",
        "running",
        "oldest_ready",
        "wait",
        "failures",
        "timeouts",
        "failed",
        "group",
        "weight",
    )
    order = [
        html.index(f'class="sortable column-{c}')
        if f"sortable column-{c}" in html
        else html.index(f'class="column-{c}')
        for c in columns
    ]
    assert order == sorted(order), "the columns that matter come before the limits"
    assert '<span class="fq-at-cap"' in html
    with connection.cursor() as cur:  # a cap lowered below what runs (an operator's edit)
        cur.execute("UPDATE fairqueue_channel SET running_count = 2 WHERE name = 'beta'")
    html = admin_client.get(CHANNELS).content.decode()
    assert '<span class="fq-over-cap" title="over cap">2 / 1</span>' in html

    def names(query: str) -> set[str]:
        return set(page_rows(admin_client.get(f"{CHANNELS}?{query}")))

    assert names("cap=at") == names("cap=over") == {"beta"}
    assert names("o=3") and names("o=-3")  # sortable by running
    assert names("starving=0") == {"alpha", "beta"}
    assert names("starving=3600") == set()
    stats_store.record_channel_stats(
        [stats_store.ChannelMinuteStats(cid("beta"), timezone.now().replace(second=0), failed=2)]
    )
    assert names("failing=yes") == {"beta"}
    html = admin_client.get(CHANNELS).content.decode()
    assert '<span class="fq-failed">2</span>' in html
    # the recent wait: the median of what the channel claimed in the window
    record_minute("alpha", timezone.now(), 3, [700.0, 800.0, 2500.0])
    html = admin_client.get(CHANNELS).content.decode()
    row = html[html.index(">alpha</a>") :]
    wait = re.search(r'<td class="field-wait_display">([^<]*)</td>', row)
    assert wait is not None and wait.group(1).endswith(" ms"), wait
    assert 500 <= int(wait.group(1).split()[0]) <= 1000

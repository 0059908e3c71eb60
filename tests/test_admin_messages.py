"""The message admin at scale: cursor pages, the estimated count, the filters (state, task name,
channel by autocomplete), the search, the running columns, and who may do what.

The speed itself is measured by ``manage.py fairbench --scenario admin`` (docs/performance.md);
here a small run of it checks that it times every page.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.messages import get_messages
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from django_fairqueue.admin import MessageAdmin, lists
from django_fairqueue.contrib.bench import admin_render
from django_fairqueue.db import message_store, pg
from django_fairqueue.models import Channel, Message, MessageState
from tests.factories import NOOP, channel_ids, enqueue, enqueue_spread
from tests.test_failures import make_held

pytestmark = pytest.mark.django_db

MESSAGES = reverse("admin:fairqueue_message_changelist")
AUTOCOMPLETE = reverse("admin:autocomplete")
LEASE = timedelta(minutes=5)


def column(name: str) -> int:
    """The ``o=`` index of a message list column (0 is the action checkbox)."""
    return ["action_checkbox", *MessageAdmin.list_display].index(name)


def shown(response: Any) -> list[int]:
    assert response.status_code == 200
    return [m.pk for m in response.context["cl"].result_list]


def links(response: Any) -> dict[str, str | None]:
    return response.context["cl"].page_links()  # type: ignore[no-any-return]


def user_with(*perms: str, name: str = "viewer") -> User:
    user = User.objects.create_user(name, password="pw", is_staff=True)
    for perm in perms:
        app, codename = perm.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app, codename=codename)
        )
    return User.objects.get(pk=user.pk)


def client_for(user: User) -> Client:
    c = Client()
    c.force_login(user)
    return c


@pytest.fixture
def spread() -> list[int]:
    """250 ready messages interleaved over three channels; their ids, ascending."""
    return sorted(enqueue_spread({"alpha": 120, "beta": 80, "gamma": 50}))


# ------------------------------------------------------------------------------------------
# paging


def test_next_links_walk_every_message_once_newest_first(
    admin_client: Client, spread: list[int]
) -> None:
    seen: list[int] = []
    url: str | None = ""
    pages = 0
    while url is not None:
        with CaptureQueriesContext(connection) as queries:
            response = admin_client.get(MESSAGES + url)
        assert not any("OFFSET" in q["sql"].upper() for q in queries.captured_queries)
        seen += shown(response)
        url = links(response)["next"]
        pages += 1
    assert pages == 3
    assert seen == sorted(spread, reverse=True)


def test_previous_and_last_pages(admin_client: Client, spread: list[int]) -> None:
    first = admin_client.get(MESSAGES)
    assert links(first)["previous"] is None and links(first)["first"] is None
    second = admin_client.get(MESSAGES + str(links(first)["next"]))
    back = admin_client.get(MESSAGES + str(links(second)["previous"]))
    assert shown(back) == shown(first)
    last = admin_client.get(MESSAGES + str(links(first)["last"]))
    assert shown(last) == sorted(spread, reverse=True)[-100:]
    assert links(last)["next"] is None and links(last)["previous"] is not None
    html = last.content.decode()
    assert "fq-page-first" in html and "fq-page-next" not in html


def test_a_deep_cursor_shows_the_rows_after_it(admin_client: Client, spread: list[int]) -> None:
    pivot = spread[180]
    response = admin_client.get(MESSAGES, {lists.CURSOR_VAR: f"a{pivot}"})
    assert shown(response) == sorted((i for i in spread if i < pivot), reverse=True)[:100]
    oldest_first = admin_client.get(
        MESSAGES, {"o": str(column("id")), lists.CURSOR_VAR: f"a{pivot}"}
    )
    assert shown(oldest_first) == [i for i in spread if i > pivot][:100]
    # a cursor that is not one: the first page, not an error
    assert shown(admin_client.get(MESSAGES, {lists.CURSOR_VAR: "x1"})) == shown(
        admin_client.get(MESSAGES)
    )


def test_a_deep_cursor_within_a_state(admin_client: Client, spread: list[int]) -> None:
    cancelled = spread[::3]  # every third message, old and new alike
    message_store.cancel_messages(cancelled)
    pivot = spread[200]
    response = admin_client.get(MESSAGES, {"state__exact": "ready", lists.CURSOR_VAR: f"a{pivot}"})
    ready = [i for i in spread if i not in cancelled]
    assert shown(response) == sorted((i for i in ready if i < pivot), reverse=True)[:100]
    back = admin_client.get(MESSAGES + str(links(response)["previous"]))
    assert shown(back) == sorted((i for i in ready if i >= pivot), reverse=True)[-100:]


def test_sort_by_channel_pages_by_channel_then_id(admin_client: Client, spread: list[int]) -> None:
    rows = list(Message.objects.order_by("channel_id", "id").values_list("channel_id", "id"))
    order = [pk for _, pk in rows]
    first = admin_client.get(MESSAGES, {"o": str(column("channel_link"))})
    assert shown(first) == order[:100]
    second = admin_client.get(MESSAGES + str(links(first)["next"]))
    assert shown(second) == order[100:200]
    assert "o=2" in str(links(first)["next"])  # the sort is kept, the cursor carries the key
    channel, pk = rows[150]
    deep = admin_client.get(
        MESSAGES, {"o": f"-{column('channel_link')}", lists.CURSOR_VAR: f"a{channel}.{pk}"}
    )
    assert shown(deep) == order[:150][::-1][:100]
    # columns no index serves are not offered, and asking for them sorts newest first
    assert shown(admin_client.get(MESSAGES, {"o": str(column("task_name"))})) == shown(
        admin_client.get(MESSAGES)
    )
    assert f'href="?o={column("task_name")}' not in first.content.decode()


def test_filter_links_drop_the_cursor(admin_client: Client, spread: list[int]) -> None:
    response = admin_client.get(MESSAGES, {lists.CURSOR_VAR: f"a{spread[100]}"})
    html = response.content.decode()
    assert "?state__exact=ready" in html
    assert f"cursor=a{spread[100]}&amp;state" not in html
    assert f"state__exact=ready&amp;cursor=a{spread[100]}" not in html


# ------------------------------------------------------------------------------------------
# counts


def test_small_counts_are_exact_and_large_ones_estimated(
    admin_client: Client, spread: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    with connection.cursor() as cur:
        cur.execute("ANALYZE fairqueue_message")
    monkeypatch.setattr(lists, "EXACT_COUNT_UP_TO", 200)
    with CaptureQueriesContext(connection) as queries:
        estimated = admin_client.get(MESSAGES)
    count = estimated.context["cl"].count
    assert not count.exact and count.value == 250  # the planner's figure after ANALYZE
    assert "about 250 messages" in estimated.content.decode()
    assert not any("COUNT(" in q["sql"].upper() for q in queries.captured_queries)
    # under the bound: counted exactly, with a LIMIT
    ids = channel_ids(["alpha", "gamma"])
    with CaptureQueriesContext(connection) as queries:
        alpha = admin_client.get(MESSAGES, {lists.CHANNEL_VAR: ids["alpha"]})
    assert alpha.context["cl"].count == lists.ResultCount(120, exact=True)
    assert "120 messages" in alpha.content.decode()
    counts = [q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]
    assert len(counts) == 1 and "LIMIT 201" in counts[0]
    # a list that fits on its page is counted by the page itself
    with CaptureQueriesContext(connection) as queries:
        gamma = admin_client.get(MESSAGES, {lists.CHANNEL_VAR: ids["gamma"]})
    assert gamma.context["cl"].count == lists.ResultCount(50, exact=True)
    assert not any("COUNT(" in q["sql"].upper() for q in queries.captured_queries)


def test_select_all_offers_about_the_paginators_figure_when_the_count_is_an_estimate(
    admin_client: Client, spread: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    enqueue("alpha", 7)  # 257 rows: the estimate rounds to 260
    with connection.cursor() as cur:
        cur.execute("ANALYZE fairqueue_message")
    monkeypatch.setattr(lists, "EXACT_COUNT_UP_TO", 200)
    response = admin_client.get(MESSAGES)
    count = response.context["cl"].count
    assert (count.value, count.exact) == (257, False)
    html = response.content.decode()
    assert '<span class="fq-result-count">about 260 messages</span>' in html  # the paginator
    assert ">Select all about 260 messages</a>" in html
    assert '<span class="all hidden">All about 260 selected</span>' in html
    assert "257" not in html.split('<div class="actions">', 1)[1].split("</div>", 1)[0]
    # an exact count: Django's own bar
    exact = admin_client.get(MESSAGES, {lists.CHANNEL_VAR: channel_ids(["alpha"])["alpha"]})
    assert exact.context["cl"].count == lists.ResultCount(127, exact=True)
    assert ">Select all 127 messages</a>" in exact.content.decode()
    assert '<span class="all hidden">All 127 selected</span>' in exact.content.decode()


def test_a_low_estimate_says_at_least() -> None:
    enqueue("alpha", 30)
    with connection.cursor() as cur:
        cur.execute("ANALYZE fairqueue_message")
    enqueue("alpha", 30)  # the planner still thinks 30
    count = lists.count_rows(Message.objects.all(), exact_up_to=40)
    assert count == lists.ResultCount(41, exact=False)
    assert str(lists.ResultCount(1_234_567, exact=False)) == "about 1,200,000"
    assert str(lists.ResultCount(1_234, exact=True)) == "1,234"


# ------------------------------------------------------------------------------------------
# filters and search


def test_filter_by_state_task_name_and_channel(admin_client: Client, spread: list[int]) -> None:
    ids = channel_ids(["alpha", "beta"])
    claimed = message_store.claim_messages(
        3, lease=LEASE, worker_id="w-1", only_channel_ids=[ids["beta"]]
    )
    running = admin_client.get(MESSAGES, {"state__exact": "running"})
    assert sorted(shown(running)) == sorted(m.id for m in claimed)

    listing = admin_client.get(MESSAGES)
    html = listing.content.decode()
    assert f'href="?task_name={NOOP}"' in html  # registered task names are the choices
    assert shown(admin_client.get(MESSAGES, {"task_name": NOOP})) == sorted(spread)[::-1][:100]
    assert shown(admin_client.get(MESSAGES, {"task_name": "no.such.task"})) == []

    # the channel is picked with the admin's autocomplete, not from a list of every channel
    assert 'data-field-name="channel"' in html and "admin-autocomplete" in html
    assert "admin/js/autocomplete.js" in html and "django_fairqueue/channel_filter.js" in html
    assert "gamma" not in html.split('id="changelist-filter"')[1].split("</details>")[2]
    alpha = admin_client.get(MESSAGES, {lists.CHANNEL_VAR: ids["alpha"]})
    assert len(shown(alpha)) == 100
    assert set(
        Message.objects.filter(pk__in=shown(alpha)).values_list("channel_id", flat=True)
    ) == {ids["alpha"]}
    assert f'<option value="{ids["alpha"]}" selected>alpha</option>' in alpha.content.decode()
    both = admin_client.get(MESSAGES, {lists.CHANNEL_VAR: ids["beta"], "state__exact": "running"})
    assert sorted(shown(both)) == sorted(m.id for m in claimed)
    assert shown(admin_client.get(MESSAGES, {lists.CHANNEL_VAR: "nope"})) == []
    assert shown(admin_client.get(MESSAGES, {lists.CHANNEL_VAR: 999_999})) == []


def test_autocomplete_finds_channels_by_name(admin_client: Client) -> None:
    for name in ("acme-eu", "acme-us", "globex"):
        Channel.objects.create(name=name)
    query = {"app_label": "fairqueue", "model_name": "message", "field_name": "channel"}
    response = admin_client.get(AUTOCOMPLETE, {**query, "term": "acme"})
    assert response.status_code == 200
    found = {r["text"] for r in json.loads(response.content)["results"]}
    assert found == {"acme-eu", "acme-us"}
    viewer = client_for(user_with("fairqueue.view_message", "fairqueue.view_channel"))
    assert viewer.get(AUTOCOMPLETE, {**query, "term": "glo"}).status_code == 200
    blind = client_for(user_with("fairqueue.view_message", name="blind"))
    assert blind.get(AUTOCOMPLETE, {**query, "term": "glo"}).status_code == 403
    assert Client().get(AUTOCOMPLETE, {**query, "term": "glo"}).status_code == 302


def test_search_by_id_and_task_name_prefix(admin_client: Client, spread: list[int]) -> None:
    assert shown(admin_client.get(MESSAGES, {"q": str(spread[7])})) == [spread[7]]
    assert len(shown(admin_client.get(MESSAGES, {"q": NOOP}))) == 100
    assert len(shown(admin_client.get(MESSAGES, {"q": NOOP[:4]}))) == 100  # a prefix
    assert shown(admin_client.get(MESSAGES, {"q": NOOP.upper()})) == []  # case-sensitive
    assert shown(admin_client.get(MESSAGES, {"q": NOOP[1:]})) == []  # not a substring
    assert shown(admin_client.get(MESSAGES, {"q": "tests.no%"})) == []  # no wildcards
    html = admin_client.get(MESSAGES, {"q": NOOP}).content.decode()
    assert "250 results" in html


# ------------------------------------------------------------------------------------------
# running messages


def test_running_messages_show_worker_claim_and_lease(admin_client: Client) -> None:
    enqueue("alpha", 2)
    (fresh,) = message_store.claim_messages(1, lease=LEASE, worker_id="host-1:123")
    (stale,) = message_store.claim_messages(1, lease=timedelta(seconds=1), worker_id="host-2:9")
    Message.objects.filter(pk=stale.id).update(
        lease_expires_at=pg.select_clock() - timedelta(minutes=3)
    )
    html = admin_client.get(MESSAGES).content.decode()
    workers = reverse("admin:fairqueue_workerrecord_changelist")
    assert f'<a href="{workers}?worker_id__exact=host-1%3A123">host-1:123</a>' in html
    assert "claimed at " in html
    assert "in 4m " in html  # the lease of the fresh claim: under five minutes left
    assert "expired 3m 0" in html
    detail = admin_client.get(reverse("admin:fairqueue_message_change", args=[fresh.id]))
    text = detail.content.decode()
    for label in ("Claimed at", "Running for", "Worker", "Lease expires"):
        assert label in text
    assert "host-1:123" in text and str(fresh.lease_token) in text


# ------------------------------------------------------------------------------------------
# permissions


def test_a_view_only_user_sees_but_cannot_act_or_change(spread: list[int]) -> None:
    viewer = client_for(user_with("fairqueue.view_message", "fairqueue.view_channel"))
    listing = viewer.get(MESSAGES)
    assert listing.status_code == 200
    html = listing.content.decode()
    assert 'name="action"' not in html and "action-select" not in html
    target = spread[0]
    for name in ("retry_messages", "cancel_messages", "delete_messages"):
        viewer.post(MESSAGES, {"action": name, "_selected_action": [str(target)]})
    assert Message.objects.get(pk=target).state == MessageState.READY
    change = reverse("admin:fairqueue_message_change", args=[target])
    page = viewer.get(change)
    assert page.status_code == 200 and 'name="_save"' not in page.content.decode()
    assert viewer.post(change, {"task_name": "x"}).status_code == 403
    delete = reverse("admin:fairqueue_message_delete", args=[target])
    assert viewer.post(delete, {"post": "yes"}).status_code == 403
    assert Message.objects.get(pk=target).task_name == NOOP


def test_anonymous_users_are_sent_to_the_login(spread: list[int]) -> None:
    anonymous = Client()
    for url in (
        MESSAGES,
        MESSAGES + f"?{lists.CURSOR_VAR}=a{spread[100]}",
        reverse("admin:fairqueue_message_change", args=[spread[0]]),
    ):
        response = anonymous.get(url)
        assert response.status_code == 302
        assert response["Location"].startswith(reverse("admin:login"))
    anonymous.post(MESSAGES, {"action": "delete_messages", "_selected_action": [str(spread[0])]})
    assert Message.objects.filter(pk=spread[0]).exists()


# ------------------------------------------------------------------------------------------
# the benchmark


@pytest.fixture
def users_saved() -> Iterator[list[Any]]:
    """Every user saved while the test runs."""
    from django.contrib.auth import get_user_model
    from django.db.models.signals import post_save

    saved: list[Any] = []

    def record(instance: Any, **kwargs: Any) -> None:
        saved.append(instance)

    post_save.connect(record, sender=get_user_model(), weak=False)
    yield saved
    post_save.disconnect(record, sender=get_user_model())


@pytest.mark.django_db(transaction=True)
def test_admin_benchmark_times_every_page(tmp_path: Path, users_saved: list[Any]) -> None:
    path = tmp_path / "admin.json"
    out = StringIO()
    call_command(
        "fairbench",
        "--scenario",
        "admin",
        "--sizes",
        "tiny",
        "--messages",
        "2000",
        "--channels",
        "20",
        "--no-progress",
        "--json",
        str(path),
        stdout=out,
        stderr=out,
    )
    doc = json.loads(path.read_text())
    cells = doc["scenarios"]["admin"]["cells"]
    assert [c["page"] for c in cells] == [p.name for p in admin_render.pages()]
    assert all(c["messages"] == 2000 and c["channels"] == 20 for c in cells)
    assert all(c["median_ms"] > 0 and c["kib"] > 0 for c in cells)
    bad = [c for c in cells if not (0 < c["sql_ms"] < c["max_ms"] and c["queries"] > 0)]
    assert not bad, [(c["page"], c["sql_ms"], c["max_ms"], c["queries"]) for c in bad]
    names = {c["page"] for c in cells}
    assert {"messages half-way down", "messages by channel", "messages one channel"} <= names
    assert {"message running", "dashboard", "workers", "work batches"} <= names
    output = out.getvalue()
    assert "Admin server time" in output and "every admin page, 2,000 messages" in output
    # it leaves nothing behind: queue tables empty, no benchmark workers registered
    assert not Message.objects.exists() and not Channel.objects.exists()
    from django_fairqueue.models import WorkerRecord

    assert not WorkerRecord.objects.filter(worker_id__startswith="fairbench-admin-").exists()
    # its signed-in user has no password: nothing hashed per page (PBKDF2 costs ~0.4 s a page)
    assert users_saved and not any(user.has_usable_password() for user in users_saved)


@pytest.mark.parametrize(
    "url",
    [
        "/admin/fairqueue/message/?task_name=%00",
        "/admin/fairqueue/message/?task_name=a%00b",
        "/admin/fairqueue/message/?q=%00",
        "/admin/fairqueue/channel/?q=%00",
        "/admin/fairqueue/channelgroup/?q=%00",
        "/admin/fairqueue/schedule/?q=%00",
        "/admin/fairqueue/workbatch/?q=%00",
        "/admin/fairqueue/workbatch/?job_name=%00",
        "/admin/fairqueue/workerrecord/?q=%00",
        "/admin/fairqueue/workerrecord/?host=%00",
        "/admin/autocomplete/?app_label=fairqueue&model_name=message&field_name=channel&term=%00",
        "/admin/autocomplete/?app_label=fairqueue&model_name=message&field_name=channel&term=a%00",
    ],
)
def test_a_nul_character_in_a_filter_or_search_is_no_server_error(
    admin_client: Client, url: str
) -> None:
    Channel.objects.create(name="acme")
    response = admin_client.get(url)
    if url.startswith("/admin/autocomplete/"):  # matches nothing
        assert response.status_code == 200 and response.json()["results"] == []
    elif "?q=" in url:  # a search: matches nothing
        assert response.status_code == 200
    else:  # a filter: a clear 400
        assert response.status_code == 400
        assert "contains a NUL character" in response.content.decode()


@pytest.mark.parametrize(
    "url",
    [
        "/admin/fairqueue/message/?q=a%00",
        "/admin/fairqueue/message/?q=%00",
        "/admin/fairqueue/channel/?q=acme%00",
        "/admin/fairqueue/channelgroup/?q=%00",
    ],
)
def test_a_search_with_a_nul_character_lists_no_row(admin_client: Client, url: str) -> None:
    # Django's list refuses a NUL in ?q= (its banner) and then searches for "": every row.
    from django_fairqueue.models import ChannelGroup

    ChannelGroup.objects.create(name="acme", weight=1)
    enqueue("acme", 2)
    response = admin_client.get(url)
    assert response.status_code == 200
    cl = response.context["cl"]
    assert list(cl.result_list) == [] and cl.result_count == 0
    assert "Null characters are not allowed." in response.content.decode()
    # without the NUL, the same list has rows: the search is what empties it
    assert list(admin_client.get(url.split("?")[0]).context["cl"].result_list)


# ------------------------------------------------------------------------------------------
# one message's page: its own clock, its buttons, every attempt's error


def test_each_page_reads_the_database_clock_of_its_own_request(admin_client: Client) -> None:
    # The clock was kept on the admin (shared by every request and user): a detail page after
    # a list showed the list's time ("running for 0s" beside a lease 40 s older).
    enqueue("alpha", 1)
    (running,) = message_store.claim_messages(1, lease=LEASE, worker_id="w")
    real = pg.select_clock
    with mock.patch.object(pg, "select_clock", side_effect=real):
        assert "running" in admin_client.get(MESSAGES).content.decode()
    later = real() + timedelta(seconds=40)
    with mock.patch.object(pg, "select_clock", return_value=later):
        page = admin_client.get(reverse("admin:fairqueue_message_change", args=[running.id]))
    assert "running" in page.content.decode()
    assert ">40s<" in page.content.decode() or ">41s<" in page.content.decode()
    assert not hasattr(admin_site_message_admin(), "_now")


def admin_site_message_admin() -> MessageAdmin:
    from django.contrib import admin

    found = admin.site._registry[Message]
    assert isinstance(found, MessageAdmin)
    return found


def test_a_message_page_has_retry_cancel_and_abort_buttons_for_its_state(
    admin_client: Client,
) -> None:
    waiting, failing, running = enqueue("alpha", 3)
    change = lambda pk: reverse("admin:fairqueue_message_change", args=[pk])  # noqa: E731
    act = lambda pk, verb: reverse("admin:fairqueue_message_act", args=[pk, verb])  # noqa: E731
    html = admin_client.get(change(waiting)).content.decode()
    assert act(waiting, "cancel") in html and act(waiting, "retry") not in html
    assert act(waiting, "abort") not in html
    response = admin_client.post(act(waiting, "cancel"), follow=True)
    assert "Cancelled." in response.content.decode()
    assert Message.objects.get(pk=waiting).state == MessageState.CANCELLED
    # a failed one: Retry
    Message.objects.filter(pk=failing).update(max_attempts=1)
    claimed = {m.id: m for m in message_store.claim_messages(2, lease=LEASE, worker_id="w")}
    error = {"type": "ValueError", "message": "boom"}
    message_store.fail_messages([(failing, claimed[failing].lease_token, error, None)])
    html = admin_client.get(change(failing)).content.decode()
    assert act(failing, "retry") in html and act(failing, "cancel") not in html
    assert 'id="fq-errors"' in html and "ValueError: boom" in html  # the attempt history
    admin_client.post(act(failing, "retry"))
    assert Message.objects.get(pk=failing).state == MessageState.READY
    # a running one: Abort, then no second button
    assert act(running, "abort") in admin_client.get(change(running)).content.decode()
    admin_client.post(act(running, "abort"))
    assert Message.objects.get(pk=running).abort_requested_at is not None
    assert act(running, "abort") not in admin_client.get(change(running)).content.decode()
    # a state that moved on: nothing done, and the page says so
    response = admin_client.post(act(waiting, "cancel"), follow=True)
    assert (
        "Nothing done: cancel needs a message that is ready or scheduled; this one is cancelled."
        in response.content.decode()
    )
    assert admin_client.get(act(waiting, "cancel")).status_code == 405  # POST only
    assert admin_client.post(act(waiting, "explode")).status_code == 404


def said(response: Any) -> list[str]:
    """What the page a followed redirect landed on told the user (and consumed)."""
    return [str(m) for m in get_messages(response.wsgi_request)]


def test_retrying_a_failed_unique_job_whose_key_another_holds_says_so(
    admin_client: Client,
) -> None:
    failed, holder = make_held("alpha", "job-1")
    button = reverse("admin:fairqueue_message_act", args=[failed, "retry"])
    assert said(admin_client.post(button, follow=True)) == [
        "Nothing done: another message holds this one's unique key and does its work; "
        "this one stays failed."
    ]
    bulk = {"action": "retry_messages", "_selected_action": [str(failed), str(holder)]}
    assert said(admin_client.post(MESSAGES, bulk, follow=True)) == [
        "Retried 0 messages.",
        "Only failed messages are retried.",
        "1 failed message stays failed: another message holds its unique key and does its work.",
    ]
    assert Message.objects.get(pk=failed).state == MessageState.FAILED


def test_the_buttons_need_change_message(spread: list[int]) -> None:
    viewer = client_for(user_with("fairqueue.view_message"))
    target = spread[0]
    html = viewer.get(reverse("admin:fairqueue_message_change", args=[target])).content.decode()
    assert "fq-message-actions" not in html
    act = reverse("admin:fairqueue_message_act", args=[target, "cancel"])
    assert viewer.post(act).status_code == 403
    assert Message.objects.get(pk=target).state == MessageState.READY


def test_the_worker_filter_lists_what_a_worker_ran_or_lost(admin_client: Client) -> None:
    enqueue("alpha", 3)
    (lost,) = message_store.claim_messages(1, lease=LEASE, worker_id="dead-1")
    message_store.claim_messages(1, lease=LEASE, worker_id="other")
    Message.objects.filter(pk=lost.id).update(lease_expires_at=pg.select_clock())
    message_store.rescue_expired_messages()
    response = admin_client.get(MESSAGES, {"worker": "dead-1"})
    assert shown(response) == [lost.id]
    assert "LeaseExpired" in response.content.decode()

"""Queues as operators meet them: which queues each worker serves (``fairqueue workers``, the
admin), channels of any queue added in the admin, and the claim of every queue (the default
worker's) on the paths it takes without reading the queues one by one."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client
from django.urls import reverse

from django_fairqueue.db import channel_store, message_store
from django_fairqueue.models import Channel, ChannelGroup, WorkerRecord
from django_fairqueue.queues import SEPARATOR, row_name
from django_fairqueue.runtime import worker_registry
from django_fairqueue.worker import Worker, WorkerConfig
from tests import factories as f
from tests.test_integrity import in_thread

LEASE = timedelta(minutes=5)
ADD_URL = "/admin/fairqueue/channel/add/"


def claim(limit: int, queues: list[str] | None) -> list[message_store.ClaimedMessage]:
    return message_store.claim_messages(limit, lease=LEASE, worker_id="ops", queues=queues)


# ------------------------------------------------------------------------------------------
# The claim of every queue


@pytest.mark.django_db
def test_a_claim_of_every_queue_serves_a_group_when_it_is_the_only_work() -> None:
    # Grouped channels are not in the channel turn index: a claim that skipped the group
    # probe would come back empty.
    f.enqueue_in_queue("default", ("acme", "alice"), 3)
    assert ChannelGroup.objects.filter(name="acme").exists()
    got = claim(10, None)
    assert sorted(m.channel for m in got) == ["acme/alice"] * 3
    f.enqueue_in_queue("reports", ("acme", "bob"), 2)
    got = claim(10, None)
    assert [(m.queue, m.channel) for m in got] == [("reports", "acme/bob")] * 2


@pytest.mark.django_db
def test_a_claim_of_every_queue_serves_groups_and_channels_of_several_queues() -> None:
    f.enqueue_in_queue("reports", ("acme", "alice"), 2)
    f.enqueue_in_queue("emails", "bolt", 2)
    f.enqueue("plain", 2)
    got = claim(10, None)
    assert sorted((m.queue, m.channel) for m in got) == [
        ("default", "plain"),
        ("default", "plain"),
        ("emails", "bolt"),
        ("emails", "bolt"),
        ("reports", "acme/alice"),
        ("reports", "acme/alice"),
    ]
    assert claim(10, None) == []


@pytest.mark.django_db
def test_a_claim_of_every_queue_passes_over_a_group_not_due_and_serves_the_channels() -> None:
    f.enqueue_in_queue("reports", ("acme", "alice"), 2)
    f.enqueue_in_queue("reports", "solo", 2)
    channel_store.fold_channel_deltas(1000)
    # the group is rate limited and its next turn an hour away: claimable, not due
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE fairqueue_channel_group SET release_interval = interval '1 hour', "
            "next_turn_at = clock_timestamp() + interval '1 hour' WHERE name = %s",
            [row_name("reports", "acme")],
        )
    got = claim(10, None)
    assert [m.channel for m in got] == ["solo", "solo"]
    assert claim(10, None) == []


@pytest.fixture
def side(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A second session, outside Django, with a transaction the test drives by hand."""
    with psycopg.connect(database_url) as conn:
        yield conn


@pytest.mark.django_db(transaction=True)
def test_an_idle_claim_of_every_queue_waits_for_a_channel_a_concurrent_claim_only_folded(
    side: Any, settings: Any
) -> None:
    """Nothing is claimable in any queue in the claim's snapshot, but a concurrent claim (in a
    transaction still open) has folded a new message of queue ``reports`` and serves nothing:
    the claim of every queue waits for it and claims that message, in its queue."""
    settings.FAIRQUEUE = {"CLAIM_WAIT": 2.0}
    f.enqueue("empty", 1)
    assert len(claim(1, None)) == 1  # "empty" has a channel row and nothing ready
    f.enqueue_in_queue("reports", "folded", 1)  # a waking delta, not folded yet
    empty = f.channel_ids(["empty"])["empty"]
    rows = side.execute(
        "SELECT channel_name FROM fairqueue_claim_v1(5, interval '5 minutes', 'other', %s)",
        [[empty]],
    ).fetchall()
    assert rows == []  # it folded every waking delta, served nothing
    got, out = in_thread(lambda: claim(5, None))
    time.sleep(0.3)
    assert got.is_alive()  # waiting for the channel the other claim folded
    side.commit()
    got.join(10)
    assert [(m.queue, m.channel) for m in out["result"]] == [("reports", "folded")], out


@pytest.mark.django_db
def test_a_claim_of_every_queue_without_a_wait_folds_first_and_then_finds_nothing(
    settings: Any,
) -> None:
    settings.FAIRQUEUE = {"CLAIM_WAIT": 0}
    assert claim(5, None) == []
    f.enqueue_in_queue("reports", "acme", 1)  # a waking delta: the claim folds it first
    assert [(m.queue, m.channel) for m in claim(5, None)] == [("reports", "acme")]
    assert claim(5, None) == []


# ------------------------------------------------------------------------------------------
# Which queues a worker serves


@pytest.mark.django_db
def test_fairqueue_workers_shows_the_queues_each_worker_serves() -> None:
    worker_registry.Registration(
        "w-reports", concurrency=2, queues=["reports", "exports"]
    ).register()
    worker_registry.Registration("w-all", concurrency=2).register()
    out = io.StringIO()
    call_command("fairqueue", "workers", stdout=out)
    lines = {line.split()[0]: line for line in out.getvalue().splitlines() if line.startswith("w-")}
    header = out.getvalue().splitlines()[0]
    assert "QUEUES" in header.split()
    assert "reports, exports" in lines["w-reports"]
    assert " all " in lines["w-all"]
    out = io.StringIO()
    call_command("fairqueue", "workers", "--json", stdout=out)
    rows = {w["worker_id"]: w for w in json.loads(out.getvalue())}
    assert rows["w-reports"]["queues"] == ["reports", "exports"]
    assert rows["w-all"]["queues"] is None
    # registering again under the same id records the new process's queues
    worker_registry.Registration("w-reports", concurrency=2).register()
    assert WorkerRecord.objects.get(worker_id="w-reports").queues is None


@pytest.mark.django_db(transaction=True)
def test_a_worker_records_its_queues_in_the_registry() -> None:
    config = WorkerConfig(
        worker_id="queued", queues=["reports"], burst=True, listen=False, maintenance=False
    )
    assert Worker(config).run() == 0
    assert WorkerRecord.objects.get(worker_id="queued").queues == ["reports"]
    assert Worker(WorkerConfig(worker_id="every", burst=True, listen=False)).run() == 0
    assert WorkerRecord.objects.get(worker_id="every").queues is None


@pytest.mark.django_db
def test_status_counts_each_queues_live_workers_and_warns_of_a_queue_none_serves() -> None:
    f.enqueue_in_queue("reports", "acme", 2)
    f.enqueue("plain", 1)
    worker_registry.Registration("w-emails", concurrency=2, queues=["emails"]).register()
    out = io.StringIO()
    call_command("fairqueue", "status", "--json", stdout=out)
    queues = json.loads(out.getvalue())["queues"]
    assert queues["reports"]["live_workers"] == queues["default"]["live_workers"] == 0
    out = io.StringIO()
    call_command("fairqueue", "status", stdout=out)
    assert "reports 1 channel, 2 ready, 0 running, 0 live workers" in out.getvalue()
    assert "WARNING: no live worker serves queues default, reports:" in out.getvalue()
    worker_registry.Registration(
        "w-reports", concurrency=2, queues=["reports", "emails"]
    ).register()
    out = io.StringIO()
    call_command("fairqueue", "status", stdout=out)
    assert "WARNING: no live worker serves queue default:" in out.getvalue()
    worker_registry.Registration("w-all", concurrency=2).register()
    out = io.StringIO()
    call_command("fairqueue", "status", "--json", stdout=out)
    queues = json.loads(out.getvalue())["queues"]
    assert (queues["reports"]["live_workers"], queues["default"]["live_workers"]) == (2, 1)
    out = io.StringIO()
    call_command("fairqueue", "status", stdout=out)
    assert "no live worker serves" not in out.getvalue()


@pytest.mark.django_db
def test_status_aligns_names_left_and_figures_right() -> None:
    f.enqueue_in_queue("reports", "acme", 2)
    f.enqueue("a-much-longer-channel", 1)
    out = io.StringIO()
    call_command("fairqueue", "status", stdout=out)
    header, *rows = out.getvalue().splitlines()[:3]
    at = header.index("QUEUE")
    assert sorted(row[at:].split()[0] for row in rows) == ["default", "reports"]  # left
    assert {row[: header.index("READY") + len("READY")][-1] for row in rows} == {"1", "2"}


@pytest.mark.django_db
def test_status_of_a_queue_nothing_knows_is_an_error_naming_the_queues() -> None:
    """A queue named wrong (`--queue reprots`) must not look like an idle, healthy one; the
    default queue, and one a live worker serves, may be empty."""
    f.enqueue_in_queue("reports", "acme", 2)
    worker_registry.Registration("w-emails", concurrency=2, queues=["emails"]).register()
    for queue, ready in (("reports", 2), ("default", 0), ("emails", 0)):
        out = io.StringIO()
        call_command("fairqueue", "status", "--queue", queue, "--json", stdout=out)
        shown = json.loads(out.getvalue())
        assert shown["totals"]["ready"] == ready, queue
        assert shown["queues"][queue]["ready"] == ready  # listed, even without a channel
    assert json.loads(out.getvalue())["queues"]["emails"]["live_workers"] == 1
    # a watch checks the name at its first redraw only: the worker serving an empty queue
    # may restart meanwhile
    from django_fairqueue.cli.status import snapshot

    assert snapshot(queue="reprots", check_queue=False)["channels"] == []
    for json_too in ([], ["--json"]):
        with pytest.raises(CommandError) as raised:
            call_command("fairqueue", "status", "--queue", "reprots", *json_too, stdout=out)
        assert str(raised.value) == (
            "no channel in queue 'reprots', and no live worker serves it; the queues: default, "
            "emails, reports"
        )


@pytest.mark.django_db
def test_why_waiting_knows_which_queues_the_live_workers_serve() -> None:
    from django_fairqueue.observe import waiting

    f.enqueue_in_queue("reports", "acme", 1)
    reports_acme = Channel.objects.get(queue="reports").pk
    worker_registry.Registration("w-emails", concurrency=2, queues=["emails"]).register()
    why = waiting.channel(reports_acme)
    assert why.cause == "no_worker_for_channel" and "--queues" in why.text
    # a worker of "reports" limited to channel "acme" (the name within the queue) serves it
    worker_registry.Registration(
        "w-reports", concurrency=2, queues=["reports"], channels=["acme"]
    ).register()
    assert waiting.channel(reports_acme).cause == "next"


@pytest.mark.django_db
def test_the_workers_admin_page_shows_each_workers_queues(admin_client: Client) -> None:
    worker_registry.Registration("w-reports", concurrency=2, queues=["reports"]).register()
    worker_registry.Registration("w-all", concurrency=2).register()
    page = admin_client.get(reverse("admin:fairqueue_workerrecord_changelist"))
    text = page.content.decode()
    assert "column-queues_display" in text
    assert '<td class="field-queues_display">reports</td>' in text
    assert '<td class="field-queues_display">all</td>' in text


# ------------------------------------------------------------------------------------------
# Adding a channel of any queue in the admin


def _add(client: Client, name: str, queue: str, **limits: str) -> Any:
    data = {"name": name, "queue_name": queue, "weight": "1", "release_interval": "0", **limits}
    return client.post(ADD_URL, data)


@pytest.mark.django_db
def test_the_admin_adds_a_channel_of_any_queue_named_as_enqueue_names_it(
    admin_client: Client,
) -> None:
    form = admin_client.get(ADD_URL).content.decode()
    assert 'name="queue_name"' in form and 'value="default"' in form
    assert _add(admin_client, "acme", "reports", max_concurrency="3").status_code == 302
    assert _add(admin_client, "acme", "default").status_code == 302
    row = Channel.objects.get(name=f"reports{SEPARATOR}acme")
    assert (row.queue, row.short_name, row.max_concurrency) == ("reports", "acme", 3)
    assert Channel.objects.get(name="acme").queue == "default"
    # enqueue finds the channel the admin made: no second row
    f.enqueue_in_queue("reports", "acme", 2)
    assert Channel.objects.filter(queue="reports").count() == 1
    got = claim(10, ["reports"])
    assert [m.channel for m in got] == ["acme", "acme"]
    # the list shows it in its queue, and links to the list of that queue's channels
    page = admin_client.get("/admin/fairqueue/channel/?queue=reports").content.decode()
    assert 'href="?queue=reports"' in page and "\x1f" not in page
    rows = page.split("<tbody>")[1]
    assert rows.count("<tr") == 1 and ">acme<" in rows


@pytest.mark.django_db
def test_the_admin_refuses_bad_queue_and_channel_names_with_a_form_error(
    admin_client: Client,
) -> None:
    def errors(name: str, queue: str) -> str:
        response = _add(admin_client, name, queue)
        assert response.status_code == 200, (name, queue)
        form_errors = response.context["adminform"].form.errors
        return " ".join(text for texts in form_errors.values() for text in texts)

    assert "queue name must not be empty" in errors("acme", "").lower()
    assert "queue name must not be empty" in errors("acme", "   ").lower()
    assert "null characters are not allowed" in errors("acme", "rep\x00orts").lower()
    assert "the most is 64" in errors("acme", "q" * 65)
    assert "may hold only letters, digits" in errors("acme", "bad queue")
    assert "may hold only letters, digits" in errors("acme", f"a{SEPARATOR}b")
    assert "too long for queue 'reports'" in errors("x" * 195, "reports")
    assert "nul" in errors("ac\x00me", "reports").lower()
    f.enqueue_in_queue("reports", "taken", 1)
    assert "already exists" in errors("taken", "reports")
    assert Channel.objects.filter(queue="reports").count() == 1
    assert not Channel.objects.filter(name__contains="acme").exists()


@pytest.mark.django_db
def test_adding_a_channel_needs_the_add_permission() -> None:
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_channel"))
    client = Client()
    client.force_login(viewer)
    assert client.get(ADD_URL).status_code == 403
    assert _add(client, "acme", "reports").status_code == 403
    assert not Channel.objects.exists()
    adder = User.objects.create_user("adder", password="pw", is_staff=True)
    for codename in ("view_channel", "add_channel"):
        adder.user_permissions.add(Permission.objects.get(codename=codename))
    client.force_login(User.objects.get(pk=adder.pk))
    assert _add(client, "acme", "reports").status_code == 302
    assert Channel.objects.get().queue == "reports"


@pytest.mark.django_db
def test_a_channels_change_form_keeps_its_queue(admin_client: Client) -> None:
    f.enqueue_in_queue("reports", "acme", 1)
    row = Channel.objects.get(queue="reports")
    url = f"/admin/fairqueue/channel/{row.pk}/change/"
    assert 'name="queue_name"' not in admin_client.get(url).content.decode()
    response = admin_client.post(
        url, {"weight": "3", "release_interval": "0", "queue_name": "emails"}
    )
    assert response.status_code == 302
    row.refresh_from_db()
    assert (row.queue, row.name, row.weight) == ("reports", f"reports{SEPARATOR}acme", 3)

"""Queues: named pools of work, orthogonal to channels (docs/howto/queues.md).

Routing (a worker of one queue never runs another's task), tenant fairness within a queue,
caps holding fleet-wide, and claimers of different queues running concurrently, each with its
own connection.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from django_fairqueue import InvalidQueue, enqueue
from django_fairqueue.api import EnqueueRequest, enqueue_many
from django_fairqueue.db import message_store
from django_fairqueue.models import Channel, ChannelGroup, Message, MessageState
from django_fairqueue.queues import row_name, split_row_name
from django_fairqueue.worker import Worker, WorkerConfig
from tests import factories as f
from tests import fairtasks
from tests.test_claim_concurrency import DEADLINE, max_overlap, run_threads

LEASE = timedelta(minutes=5)


def claim(
    limit: int, queues: list[str] | None, worker: str = "w"
) -> list[message_store.ClaimedMessage]:
    return message_store.claim_messages(limit, lease=LEASE, worker_id=worker, queues=queues)


def burst_worker(**config: Any) -> Worker:
    config.setdefault("worker_id", "queues-worker")
    config.setdefault("listen", False)
    config.setdefault("maintenance", False)
    return Worker(WorkerConfig(burst=True, burst_horizon=0, **config))


def states() -> dict[str, set[str]]:
    """Task name -> the states of its messages."""
    out: dict[str, set[str]] = {}
    for task, state in Message.objects.values_list("task_name", "state"):
        out.setdefault(task, set()).add(state)
    return out


# ------------------------------------------------------------------------------------------
# Declaring and overriding a queue


@pytest.mark.django_db
def test_a_task_declares_its_queue_and_enqueue_overrides_it() -> None:
    mid = fairtasks.report.enqueue(title="q3", channel="acme")
    channel = Message.objects.get(pk=mid).channel
    assert (channel.queue, channel.short_name, str(channel)) == (
        "reports",
        "acme",
        "acme [reports]",
    )
    assert channel.name == row_name("reports", "acme") == "reports\x1facme"

    moved = enqueue(fairtasks.report, title="x", channel="acme", queue="exports")
    assert Message.objects.get(pk=moved).channel.queue == "exports"
    bound = fairtasks.report.using(channel="acme", queue="exports").enqueue(title="y")
    assert Message.objects.get(pk=bound).channel_id == Message.objects.get(pk=moved).channel_id
    plain = enqueue(fairtasks.record, channel="acme")
    assert Message.objects.get(pk=plain).channel.name == "acme"  # the default queue: as before

    ids = enqueue_many(
        [
            EnqueueRequest(fairtasks.email, channel="acme"),
            EnqueueRequest(fairtasks.email, channel="acme", queue="reports"),
            EnqueueRequest(fairtasks.record, channel="acme"),
        ]
    )
    queues = [Message.objects.get(pk=i).channel.queue for i in ids]
    assert queues == ["emails", "reports", "default"]
    # one channel row per (queue, tenant): acme in four queues
    assert sorted(
        Channel.objects.filter(name__endswith="acme").values_list("queue", flat=True)
    ) == [
        "default",
        "emails",
        "exports",
        "reports",
    ]


def test_a_task_with_a_bad_queue_is_refused_at_registration() -> None:
    from django_fairqueue import task

    with pytest.raises(InvalidQueue, match=r"'tests\.queues\.bad': queue name 'no spaces'"):

        @task(name="tests.queues.bad", queue="no spaces")
        def bad() -> None:  # pragma: no cover - never registered
            pass


@pytest.mark.django_db
def test_a_group_is_per_queue() -> None:
    enqueue(fairtasks.record, channel=("acme", "alice"))
    enqueue(fairtasks.report, channel=("acme", "alice"))
    groups = {g.queue: g for g in ChannelGroup.objects.all()}
    assert set(groups) == {"default", "reports"}
    assert groups["reports"].short_name == "acme"
    members = {c.name: c.group_id for c in Channel.objects.all()}
    assert members == {
        "acme/alice": groups["default"].id,
        "reports\x1facme/alice": groups["reports"].id,
    }


def test_row_names_round_trip() -> None:
    for queue, name in [("default", "acme"), ("reports", "acme/alice"), ("a.b-c_d", "x y")]:
        assert split_row_name(row_name(queue, name)) == (queue, name)


# ------------------------------------------------------------------------------------------
# Routing and fairness


@pytest.mark.django_db
def test_a_claim_of_one_queue_takes_only_its_queues_messages() -> None:
    f.enqueue_in_queue("emails", "acme", 5)
    f.enqueue_in_queue("reports", "acme", 3)
    f.enqueue("acme", 2)
    assert {m.queue for m in claim(100, ["reports"])} == {"reports"}
    assert claim(100, ["reports"]) == []
    got = claim(100, ["emails", "default"])
    assert Counter(m.queue for m in got) == {"emails": 5, "default": 2}
    assert {m.channel for m in got} == {"acme"}  # the name within the queue


@pytest.mark.django_db
def test_tenants_take_turns_within_a_queue_whatever_other_queues_hold() -> None:
    # Queue "reports": a big tenant and a small one; another queue holds a far bigger backlog.
    f.enqueue_in_queue("reports", "big", 40)
    f.enqueue_in_queue("reports", "small", 4)
    f.enqueue_in_queue("emails", "huge", 200)
    order = [m.channel for _ in range(8) for m in claim(1, ["reports"])]
    # one each in turn while both have work: the small tenant is not behind the big backlog
    assert order == ["big", "small"] * 4 or order == ["small", "big"] * 4


@pytest.mark.django_db(transaction=True)
def test_a_worker_serves_only_its_queues() -> None:
    emails = [fairtasks.email.enqueue(to=str(i), channel=f"t{i % 3}") for i in range(6)]
    reports = [fairtasks.report.enqueue(title=str(i), channel=f"t{i % 3}") for i in range(6)]

    assert burst_worker(queues=["reports"]).run() == 6
    ran = dict(Message.objects.values_list("id", "state"))
    assert {ran[i] for i in reports} == {MessageState.SUCCEEDED}
    assert {ran[i] for i in emails} == {MessageState.READY}

    assert burst_worker().run() == 6  # every queue
    assert states() == {"tests.fair.email": {"succeeded"}, "tests.fair.report": {"succeeded"}}


@pytest.mark.django_db(transaction=True)
def test_channel_filters_apply_within_the_queues_served() -> None:
    for tenant in ("acme", "bolt"):
        fairtasks.report.enqueue(channel=tenant)
        fairtasks.email.enqueue(channel=tenant)
    worker = burst_worker(queues=["reports"], channels=["acme"])
    assert worker.run() == 1
    done = Message.objects.filter(state=MessageState.SUCCEEDED).select_related("channel")
    assert [(m.channel.queue, m.channel.short_name) for m in done] == [("reports", "acme")]
    # every queue, one tenant excluded: acme's email, not bolt's anything
    assert burst_worker(exclude_channels=["bolt"]).run() == 1
    left = Message.objects.filter(state=MessageState.READY).select_related("channel")
    assert {m.channel.short_name for m in left} == {"bolt"}


def test_worker_queues_are_checked() -> None:
    with pytest.raises(InvalidQueue):
        WorkerConfig(queues=["bad name"])
    with pytest.raises(ValueError, match="at least one queue"):
        WorkerConfig(queues=[])
    assert WorkerConfig(queues=["a", "b", "a"]).queues == ("a", "b")
    with pytest.raises(CommandError, match="--queues"):
        call_command("runfairworker", "--queues", "reports,,exports", "--burst")


# ------------------------------------------------------------------------------------------
# Concurrency: caps fleet-wide, claimers of different queues side by side


@pytest.mark.django_db(transaction=True)
def test_claimers_of_different_queues_each_get_exactly_their_queues_messages() -> None:
    queues = ["emails", "reports", "exports"]
    per = 60
    for q in queues:
        enqueue_many(
            EnqueueRequest(fairtasks.record, channel=f"tenant-{i % 7}", queue=q) for i in range(per)
        )
    f.enqueue_spread({"plain": 30})  # the default queue: nobody below serves it
    lock = threading.Lock()
    seen: dict[str, list[tuple[int, str]]] = {q: [] for q in queues}
    deadline = time.monotonic() + DEADLINE

    def claimer(i: int) -> None:
        queue = queues[i % len(queues)]
        while True:
            assert time.monotonic() < deadline, "claimers did not finish in time"
            got = claim(1 + i % 4, [queue], worker=f"claimer-{i}")
            if not got:
                with lock:
                    if len(seen[queue]) >= per:
                        return
                time.sleep(0.002)
                continue
            with lock:
                seen[queue].extend((m.id, m.queue) for m in got)
            assert message_store.complete_messages([(m.id, m.lease_token, None) for m in got])

    run_threads(6, claimer)  # two claimers per queue

    for q in queues:
        ids = [mid for mid, _ in seen[q]]
        assert len(ids) == len(set(ids)) == per  # each message once
        assert {queue for _, queue in seen[q]} == {q}
    assert Message.objects.filter(state=MessageState.READY).count() == 30
    f.fold_all()
    f.assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
def test_a_cap_holds_across_claimers_of_a_queue_and_claimers_of_every_queue() -> None:
    # acme's channel in "reports" is capped at 2; claimers of "reports" and of every queue
    # (which serve "reports" too) race for it, with another queue's work beside it.
    f.enqueue_in_queue("reports", "acme", 80)
    f.enqueue_in_queue("emails", "acme", 40)
    capped = Channel.objects.get(name=row_name("reports", "acme"))
    Channel.objects.filter(pk=capped.pk).update(max_concurrency=2)
    lock = threading.Lock()
    intervals: list[tuple[float, float]] = []
    done: list[int] = []
    over: list[int] = []
    deadline = time.monotonic() + DEADLINE

    def claimer(i: int) -> None:
        queues = ["reports"] if i % 2 else None
        while True:
            with lock:
                if len(done) >= 120:
                    return
            assert time.monotonic() < deadline, "claimers did not finish in time"
            got = claim(3, queues, worker=f"c{i}")
            start = time.monotonic()
            with connection.cursor() as cur:
                cur.execute(
                    "SELECT count(*) FROM fairqueue_message WHERE state = 'running' "
                    "AND channel_id = %s",
                    [capped.pk],
                )
                (running,) = cur.fetchone()
            if running > 2:
                over.append(running)
            if not got:
                time.sleep(0.002)
                continue
            time.sleep(0.002)
            end = time.monotonic()
            with lock:
                intervals.extend((start, end) for m in got if m.channel_id == capped.pk)
            message_store.complete_messages([(m.id, m.lease_token, None) for m in got])
            with lock:
                done.extend(m.id for m in got)

    run_threads(4, claimer)

    assert not over, f"running over the cap: {over[:5]}"
    assert max_overlap(intervals) <= 2
    assert sorted(done) == sorted(set(done)) and len(done) == 120


# ------------------------------------------------------------------------------------------
# Where people see queues: status, the admin


@pytest.mark.django_db
def test_status_shows_each_channels_queue_and_the_queues_totals() -> None:
    import io
    import json

    f.enqueue("acme", 2)
    f.enqueue_in_queue("reports", "acme", 3)
    f.enqueue_in_queue("reports", ("g", "x"), 1)
    out = io.StringIO()
    call_command("fairqueue", "status", stdout=out)
    text = out.getvalue()
    rows = {tuple(line.split()[:3]) for line in text.splitlines()}
    assert ("acme", "reports", "3") in rows and ("acme", "default", "2") in rows
    assert (
        "Queues: default 1 channel, 2 ready, 0 running, 0 live workers; reports 2 channels, "
        "4 ready, 0 running, 0 live workers." in text
    )
    out = io.StringIO()
    call_command("fairqueue", "status", "--json", stdout=out)
    data = json.loads(out.getvalue())
    assert data["queues"]["reports"] == {"channels": 2, "ready": 4, "running": 0, "live_workers": 0}
    assert {"name": "g", "queue": "reports"}.items() <= data["groups"][0].items()
    out = io.StringIO()
    call_command("fairqueue", "status", "acme", "--queue", "reports", "--json", stdout=out)
    assert json.loads(out.getvalue())["ready"] == 3
    with pytest.raises(CommandError, match="no channel named 'acme' in queue 'exports'"):
        call_command("fairqueue", "status", "acme", "--queue", "exports")
    # --queue without a channel: that queue's channels, groups and totals only
    out = io.StringIO()
    call_command("fairqueue", "status", "--queue", "reports", "--json", stdout=out)
    data = json.loads(out.getvalue())
    assert {(c["name"], c["queue"]) for c in data["channels"]} == {
        ("acme", "reports"),
        ("g/x", "reports"),
    }
    assert (data["totals"]["ready"], list(data["queues"]), data["groups_total"]) == (
        4,
        ["reports"],
        1,
    )
    out = io.StringIO()
    call_command("fairqueue", "status", "--queue", "default", stdout=out)
    assert "reports" not in out.getvalue()


@pytest.mark.django_db
def test_the_admin_lists_and_filters_by_queue(admin_client: Any) -> None:
    f.enqueue("acme", 1)
    f.enqueue_in_queue("reports", "bolt", 1)
    page = admin_client.get("/admin/fairqueue/channel/?queue=reports").content.decode()
    assert "bolt" in page and "acme" not in page.split("<tbody>")[1]
    page = admin_client.get("/admin/fairqueue/channel/").content.decode()
    # the filter offers the registered tasks' queues
    assert 'href="?queue=reports"' in page.split('id="changelist-filter"')[1]
    page = admin_client.get("/admin/fairqueue/message/?queue=reports").content.decode()
    assert "bolt [reports]" in page and ">acme<" not in page
    bolt = Channel.objects.get(queue="reports")
    page = admin_client.get(f"/admin/fairqueue/channel/{bolt.pk}/change/").content.decode()
    assert "reports" in page and "\x1f" not in page


@pytest.mark.django_db
def test_a_schedule_fires_into_its_tasks_queue_or_its_channels() -> None:
    from django_fairqueue import schedules
    from django_fairqueue.models import Schedule
    from django_fairqueue.schedules import ScheduleSpec

    def spec(name: str, task: str, **more: Any) -> ScheduleSpec:
        return ScheduleSpec.build(name, {"task": task, "cron": "* * * * *", **more}, name)

    schedules.sync([spec("r", "tests.fair.report", channel="acme")])
    # a code schedule of a task of queue "reports" is on that queue's channel row
    assert Schedule.objects.get(name="r").channel.name == row_name("reports", "acme")
    assert not Channel.objects.filter(name="acme").exists()
    # an operator's schedule on the channel row of queue "exports"
    exports = Channel.objects.create(name=row_name("exports", "acme"))
    Schedule.objects.create(
        name="x", channel=exports, task_name="tests.fair.record", cron="* * * * *"
    )
    assert schedules.fire_due() == 0  # the first pass sets the next slots
    with connection.cursor() as cur:
        cur.execute(  # the next slot a minute ago (as tests/test_schedules.py backdates)
            "UPDATE fairqueue_schedule "
            "SET next_fire_at = date_trunc('minute', now()) - interval '1 minute'"
        )
    assert schedules.fire_due() == 2
    fired = Message.objects.select_related("channel").order_by("task_name")
    assert [(m.task_name, m.channel.queue, m.channel.short_name) for m in fired] == [
        ("tests.fair.record", "exports", "acme"),
        ("tests.fair.report", "reports", "acme"),
    ]


@pytest.mark.django_db
def test_metrics_label_each_channel_series_with_its_queue() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry

    from django_fairqueue.metrics import QueueCollector

    f.enqueue("acme", 2)
    f.enqueue_in_queue("reports", "acme", 3)
    # a default-queue channel whose name reads like another queue's: a series of its own
    f.enqueue("acme [reports]", 1)
    registry = CollectorRegistry()
    registry.register(QueueCollector())
    text = generate_latest(registry).decode()
    lines = text.splitlines()
    assert 'fairqueue_channel_ready{channel="acme",queue="default"} 2.0' in lines
    assert 'fairqueue_channel_ready{channel="acme",queue="reports"} 3.0' in lines
    assert 'fairqueue_channel_ready{channel="acme [reports]",queue="default"} 1.0' in lines
    assert "\x1f" not in text
    series = [line.rsplit(" ", 1)[0] for line in lines if not line.startswith("#")]
    assert len(series) == len(set(series))  # every series once: Prometheus refuses duplicates
    ages = [line for line in lines if line.startswith("fairqueue_oldest_ready_age_seconds{")]
    assert {line.split("{")[1].split("}")[0] for line in ages} == {
        'channel="acme",queue="default"',
        'channel="acme",queue="reports"',
        'channel="acme [reports]",queue="default"',
        'channel="(all)",queue="(all)"',
    }


@pytest.mark.django_db
def test_cancel_by_channel_takes_the_queue() -> None:
    from django_fairqueue import cancel

    plain = f.enqueue("acme", 2)
    reports = f.enqueue_in_queue("reports", "acme", 3)
    assert sorted(cancel(channel="acme", queue="reports")) == sorted(reports)
    assert sorted(cancel(channel="acme")) == sorted(plain)  # the default queue
    with pytest.raises(InvalidQueue):
        cancel(channel="acme", queue="no such")
    f.enqueue_in_queue("exports", "acme", 1)
    out = __import__("io").StringIO()
    call_command("fairqueue", "cancel", "--channel", "acme", "--queue", "exports", stdout=out)
    assert out.getvalue().startswith("Cancelled 1 message.")
    out = __import__("io").StringIO()
    call_command("fairqueue", "cancel", "--task", "tests.noop", "--queue", "exports", stdout=out)
    assert out.getvalue().startswith("Cancelled 0 messages.")
    with pytest.raises(CommandError, match="queue name"):
        call_command("fairqueue", "abort", "--channel", "acme", "--queue", "a b")


@pytest.mark.django_db
def test_a_queue_without_a_channel_narrows_cancel_and_abort_to_that_queue() -> None:
    import io

    from django_fairqueue import abort, cancel

    plain = f.enqueue("acme", 2)
    reports = f.enqueue_in_queue("reports", "acme", 2) + f.enqueue_in_queue("reports", "bolt", 1)
    exports = f.enqueue_in_queue("exports", "acme", 1)
    assert sorted(cancel(task="tests.noop", queue="reports")) == sorted(reports)
    assert sorted(cancel(task="tests.noop", queue="default")) == sorted(plain)
    assert cancel(queue="reports") == []  # nothing waits there any more
    out = io.StringIO()
    call_command("fairqueue", "cancel", "--queue", "exports", "--json", stdout=out)
    assert __import__("json").loads(out.getvalue())["ids"] == exports
    with pytest.raises(ValueError, match="not both"):
        cancel([1], queue="reports")
    with pytest.raises(InvalidQueue):
        cancel(task="tests.noop", queue="a b")

    # abort: the running messages of the task in that queue only
    running_reports = f.enqueue_in_queue("reports", "acme", 1)
    running_plain = f.enqueue("acme", 1)
    assert len(claim(10, None)) == 2
    assert abort(task="tests.noop", queue="reports") == {running_reports[0]: "abort_requested"}
    out = io.StringIO()
    call_command("fairqueue", "abort", "--task", "tests.noop", "--queue", "default", stdout=out)
    # (a selection's waiting messages are left: it says so, not "cancelled 0 waiting")
    assert out.getvalue() == "Requested the abort of 1 running; waiting messages are left.\n"
    assert abort(task="tests.noop") == {
        running_reports[0]: "abort_requested",
        running_plain[0]: "abort_requested",
    }


def test_the_running_message_is_importable_from_the_package() -> None:
    import django_fairqueue
    from django_fairqueue import current_message
    from django_fairqueue.context import current_message as in_context

    assert current_message is in_context and "current_message" in django_fairqueue.__all__
    assert current_message.get() is None  # outside a worker


@pytest.mark.django_db
def test_schedules_are_listed_and_selected_by_channel_and_queue() -> None:
    import io
    import json

    from django_fairqueue import schedules
    from django_fairqueue.schedules import ScheduleSpec

    def spec(name: str, task: str, **more: Any) -> ScheduleSpec:
        return ScheduleSpec.build(name, {"task": task, "cron": "0 3 * * *", **more}, name)

    schedules.sync(
        [
            spec("r", "tests.fair.report", channel="acme"),
            spec("p", "tests.fair.record", channel="acme"),
        ]
    )

    def listed(*argv: str) -> list[dict[str, Any]]:
        out = io.StringIO()
        call_command("fairqueue", "schedules", "--json", *argv, stdout=out)
        return [
            {k: row[k] for k in ("name", "channel", "queue")} for row in json.loads(out.getvalue())
        ]

    assert listed() == [
        {"name": "p", "channel": "acme", "queue": "default"},
        {"name": "r", "channel": "acme", "queue": "reports"},
    ]
    assert listed("--channel", "acme") == [{"name": "p", "channel": "acme", "queue": "default"}]
    assert [r["name"] for r in listed("--channel", "acme", "--queue", "reports")] == ["r"]
    assert [r["name"] for r in listed("--queue", "reports")] == ["r"]
    out = io.StringIO()
    call_command("fairqueue", "schedules", stdout=out)
    text = out.getvalue()
    assert "\\x1f" not in text
    lines = {tuple(line.split()[:3]) for line in text.splitlines()}
    assert ("acme", "reports", "r") in lines and ("acme", "default", "p") in lines
    with pytest.raises(CommandError, match="queue name"):
        call_command("fairqueue", "schedules", "--queue", "a b")


@pytest.mark.django_db
def test_the_dashboard_names_channels_within_their_queue_and_filters_by_queue(
    admin_client: Any,
) -> None:
    f.enqueue("acme", 2)
    f.enqueue_in_queue("reports", "acme", 3)
    url = "/admin/fairqueue/channel/dashboard/data/"
    data = admin_client.get(url).json()
    assert "\x1f" not in str(data)
    assert sorted((t["name"], t["queue"], t["ready"]) for t in data["tenants"]) == [
        ("acme", "default", 2),
        ("acme", "reports", 3),
    ]
    data = admin_client.get(url + "?queue=reports").json()
    assert [(t["name"], t["queue"]) for t in data["tenants"]] == [("acme", "reports")]
    assert (data["queue"], data["totals"]["ready"], data["totals"]["channels"]) == ("reports", 3, 1)
    assert len(admin_client.get(url + "?queue=a%20b").json()["tenants"]) == 2  # ignored
    page = admin_client.get("/admin/fairqueue/channel/dashboard/?queue=reports").content.decode()
    assert '<option value="reports" selected>' in page and "\x1f" not in page


@pytest.mark.django_db
def test_verify_and_the_enqueue_signal_name_channels_within_their_queue(caplog: Any) -> None:
    import io

    from django_fairqueue.maintenance import CounterVerifier
    from django_fairqueue.signals import message_enqueued

    got: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        got.append(kwargs)

    message_enqueued.connect(receiver)
    try:
        f.enqueue_in_queue("reports", "acme", 2)
        enqueue(fairtasks.report, title="t", channel="bolt")
    finally:
        message_enqueued.disconnect(receiver)
    assert [(g["channels"], g["queues"]) for g in got] == [
        (["acme", "acme"], ["reports", "reports"]),
        (["bolt"], ["reports"]),
    ]
    f.fold_all()
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE fairqueue_channel SET ready_count = 0 WHERE name = %s",
            [row_name("reports", "acme")],
        )
    out = io.StringIO()
    with pytest.raises(CommandError, match="disagree"):
        call_command("fairqueue", "verify", stdout=out)
    assert "channel 'acme [reports]': ready recorded 0, counted 2" in out.getvalue()
    assert CounterVerifier().run_once() == 1
    assert "channel 'acme [reports]' ready recorded 0, counted 2" in caplog.text
    assert "\\x1f" not in out.getvalue() + caplog.text


@pytest.mark.django_db
def test_the_testing_helper_lists_a_channel_of_a_queue() -> None:
    from django_fairqueue.testing import enqueued

    plain = f.enqueue("acme", 1)
    reports = f.enqueue_in_queue("reports", "acme", 2)
    assert [m.id for m in enqueued(channel="acme")] == plain
    assert [m.id for m in enqueued(channel="acme", queue="reports")] == reports
    assert [m.id for m in enqueued(queue="reports")] == reports

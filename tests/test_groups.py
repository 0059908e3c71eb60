"""Channel groups: fairness across groups first, then across a group's channels; group caps
and rate limits; the group's sums kept exact; grouping declared at enqueue.

Claims run against real PostgreSQL; the cap test uses several threads with a connection each.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.core.exceptions import FieldError
from django.db import connection, transaction

from django_fairqueue.api import EnqueueRequest, enqueue, enqueue_many
from django_fairqueue.db import channel_store, integrity_store, message_store
from django_fairqueue.exceptions import InvalidChannel
from django_fairqueue.models import Channel, ChannelGroup
from tests import factories as f
from tests.stresskit import GROUP_SUMS_WRONG
from tests.test_claim_concurrency import run_threads

LEASE = timedelta(minutes=5)


@pytest.fixture(autouse=True)
def _async_commit() -> Iterator[None]:
    with connection.cursor() as cur:
        cur.execute("SET synchronous_commit = off")
    channel_store.forget_groups()
    yield
    channel_store.forget_groups()


@pytest.fixture(params=["count", "time"])
def fairness(request: Any, settings: Any) -> str:
    settings.FAIRQUEUE = {**settings.FAIRQUEUE, "FAIRNESS": request.param}
    return str(request.param)


def claim(limit: int = 1, worker: str = "test-worker") -> list[message_store.ClaimedMessage]:
    return message_store.claim_messages(limit, lease=LEASE, worker_id=worker)


def complete(messages: list[message_store.ClaimedMessage]) -> None:
    message_store.complete_messages(
        [(m.id, m.lease_token, None) for m in messages], run_seconds=None
    )


def spread(group: str, channels: int, per_channel: int) -> None:
    """``per_channel`` messages in each of ``channels`` channels of ``group`` (one batch)."""
    enqueue_many(
        EnqueueRequest(f.NOOP, (i,), channel=(group, f"c{c:03d}"))
        for i in range(per_channel)
        for c in range(channels)
    )


def group_of(message: message_store.ClaimedMessage) -> str:
    return message.channel.split("/", 1)[0] if "/" in message.channel else message.channel


def assert_group_sums_exact() -> None:
    """Each group's ready/running/claimable equal the sums over its channels' rows (the stress
    test's check, run on the test's connection)."""
    with connection.cursor() as cur:
        cur.execute(GROUP_SUMS_WRONG)
        wrong = cur.fetchall()
    assert not wrong, wrong


# ------------------------------------------------------------------------------------------------
# Declaring groups


@pytest.mark.django_db(transaction=True)
def test_tuple_channel_creates_the_group_and_a_channel_named_group_slash_channel() -> None:
    enqueue(f.NOOP, channel=("acme", "alice"))
    group = ChannelGroup.objects.get(name="acme")
    channel = Channel.objects.get(name="acme/alice")
    assert channel.group_id == group.pk
    # the string form names the same channel; a new one joins the existing group
    enqueue(f.NOOP, channel="acme/alice")
    enqueue(f.NOOP, channel="acme/bob")
    assert Channel.objects.get(name="acme/bob").group_id == group.pk
    assert Channel.objects.filter(name="acme/alice").count() == 1
    (state,) = channel_store.select_group_state([group.pk])
    # the figures shown count the changes not folded yet, as each channel's do
    assert (state.channels, state.claimable, state.ready) == (2, 2, 3)
    f.fold_all()
    (state,) = channel_store.select_group_state([group.pk])
    assert (state.channels, state.claimable, state.ready) == (2, 2, 3)


@pytest.mark.django_db(transaction=True)
def test_a_slash_in_a_name_groups_nothing_until_the_group_exists() -> None:
    f.enqueue("user/42", 2)
    assert Channel.objects.get(name="user/42").group_id is None
    # creating the group (here in the admin's way, through the ORM) takes the channel in,
    # with its counters
    f.fold_all()
    group = ChannelGroup.objects.create(name="user", max_concurrency=3)
    assert Channel.objects.get(name="user/42").group_id == group.pk
    (state,) = channel_store.select_group_state([group.pk])
    assert (state.ready, state.claimable) == (2, 1)
    assert_group_sums_exact()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("channel", "message"),
    [
        (("acme",), "pair"),
        (("acme", "a", "b"), "pair"),
        (("", "alice"), "must not be empty"),
        (("  ", "alice"), "must not be only blanks"),
        (("ac/me", "alice"), "must not contain '/'"),
        ((" acme", "alice"), "blanks"),
        (("acme", ""), "must not be empty"),
        (("acme", ("x", "y")), "do not nest"),
        ((1, "alice"), "must be a string"),
        (("a" * 101, "alice"), "the most is 100"),
        (("acme", "a" * 200), "the most is 200"),
        (["acme", "alice"], "tuple"),
    ],
)
def test_bad_grouped_channels_are_refused_with_a_clear_error_and_store_nothing(
    channel: Any, message: str
) -> None:
    with pytest.raises(InvalidChannel, match=message):
        enqueue(f.NOOP, channel=channel)
    with pytest.raises(InvalidChannel, match=message):
        enqueue_many(
            [EnqueueRequest(f.NOOP, channel=("ok", "x")), EnqueueRequest(f.NOOP, channel=channel)]
        )
    assert not Channel.objects.exists()


# ------------------------------------------------------------------------------------------------
# Fairness across groups, then within


@pytest.mark.django_db(transaction=True)
def test_a_tenant_with_a_hundred_channels_gets_one_turn_like_a_tenant_with_one(
    fairness: str,
) -> None:
    spread("bob", 100, 5)  # 500 messages over 100 channels
    enqueue_many(EnqueueRequest(f.NOOP, (i,), channel=("alice", "inbox")) for i in range(10))
    f.enqueue("carol", 10)  # an ungrouped channel is a flow of its own
    f.fold_all()
    served: list[str] = []
    for _ in range(30):
        got = claim(1)
        assert len(got) == 1
        served.append(group_of(got[0]))
        # Equal run times: by time the flows' tags then move in step (each group corrected
        # to what its channels ran, as each channel is), as turns do by count.
        message_store.complete_messages(
            [(m.id, m.lease_token, None) for m in got], run_seconds=[1e-6]
        )
    counts = Counter(served)
    # three flows, one message each per round
    assert counts["alice"] == 10 and counts["carol"] == 10 and counts["bob"] == 10, counts
    assert_group_sums_exact()


@pytest.mark.django_db(transaction=True)
def test_within_a_group_channels_take_turns(fairness: str) -> None:
    spread("bob", 4, 10)
    f.fold_all()
    served = []
    for _ in range(8):
        got = claim(1)
        served.append(got[0].channel)
        # every message ran 10 ms (by time, a channel's first settlement is folded by the
        # next claim: equal run times keep equal tags, as equal turns do by count)
        with connection.cursor() as cur:
            cur.execute(
                "UPDATE fairqueue_message SET claimed_at = claimed_at - interval '10 ms' "
                "WHERE id = %s",
                [got[0].id],
            )
        message_store.complete_messages([(got[0].id, got[0].lease_token, None)], run_seconds=[0.01])
    assert Counter(served) == {f"bob/c{c:03d}": 2 for c in range(4)}


@pytest.mark.django_db(transaction=True)
def test_batch_claims_share_by_group_weight(fairness: str) -> None:
    spread("big", 20, 30)
    spread("small", 1, 600)
    ChannelGroup.objects.filter(name="big").update(weight=3)
    f.fold_all()
    f.measured()  # (by time: not slow-starting)
    served: Counter[str] = Counter()
    for _ in range(8):
        got = claim(100)
        assert len(got) == 100
        served.update(group_of(m) for m in got)
        complete(got)
    share = served["big"] / (served["big"] + served["small"])
    assert 0.70 <= share <= 0.80, served


@pytest.mark.django_db(transaction=True)
def test_a_single_group_fills_the_whole_batch_from_its_channels(fairness: str) -> None:
    spread("solo", 30, 10)
    f.fold_all()
    f.measured()  # (by time: not slow-starting)
    got = claim(100)
    assert len(got) == 100
    assert len({m.channel for m in got}) >= 25  # spread over its channels by turns
    assert_group_sums_exact()


# ------------------------------------------------------------------------------------------------
# Group caps and rate limits


@pytest.mark.django_db(transaction=True)
def test_group_cap_holds_across_its_channels_and_a_completion_frees_one_slot(
    fairness: str,
) -> None:
    spread("capped", 10, 5)
    ChannelGroup.objects.filter(name="capped").update(max_concurrency=3)
    f.enqueue("free", 5)
    f.fold_all()
    f.measured()  # (by time: not slow-starting)
    got = claim(100)
    in_group = [m for m in got if group_of(m) == "capped"]
    assert len(in_group) == 3 and len(got) == 8
    assert claim(100) == []
    complete(in_group[:1])
    again = claim(100)
    assert len(again) == 1 and group_of(again[0]) == "capped"
    assert_group_sums_exact()


@pytest.mark.django_db(transaction=True)
def test_group_rate_limit_releases_one_message_per_interval(fairness: str) -> None:
    spread("metered", 5, 4)
    ChannelGroup.objects.filter(name="metered").update(release_interval=timedelta(seconds=0.3))
    f.fold_all()
    assert len(claim(100)) == 1
    assert claim(100) == []
    time.sleep(0.35)
    assert len(claim(100)) == 1


@pytest.mark.django_db
def test_a_group_rate_limit_removed_through_the_orm_takes_effect_at_once(fairness: str) -> None:
    spread("metered", 5, 4)
    ChannelGroup.objects.filter(name="metered").update(release_interval=timedelta(hours=1))
    f.fold_all()
    f.measured()  # (by time: not slow-starting)
    assert len(claim(100)) == 1 and claim(100) == []
    ChannelGroup.objects.filter(name="metered").update(release_interval=timedelta(0))
    assert len(claim(100)) == 4 * 5 - 1


@pytest.mark.django_db(transaction=True)
def test_a_group_whose_channels_are_all_rate_limited_is_parked_then_served(
    fairness: str,
) -> None:
    spread("slow", 3, 3)
    Channel.objects.filter(group__name="slow").update(release_interval=timedelta(seconds=0.3))
    f.fold_all()
    f.measured()  # (by time: not slow-starting)
    assert len(claim(100)) == 3  # one per channel
    assert claim(100) == []
    with connection.cursor() as cur:
        cur.execute("SELECT next_turn_at > now() FROM fairqueue_channel_group WHERE name = 'slow'")
        assert cur.fetchone() == (True,)  # parked until the first channel is due
    time.sleep(0.35)
    assert len(claim(100)) == 3


@pytest.mark.django_db(transaction=True)
def test_paused_channels_of_a_group_are_not_claimable_and_counted_out() -> None:
    spread("p", 2, 3)
    f.fold_all()
    Channel.objects.filter(name="p/c000").update(paused=True)
    (state,) = channel_store.select_group_state(
        list(ChannelGroup.objects.values_list("pk", flat=True))
    )
    assert state.claimable == 1
    got = claim(100)
    assert {m.channel for m in got} == {"p/c001"}
    Channel.objects.filter(name="p/c000").update(paused=False)
    assert {m.channel for m in claim(100)} == {"p/c000"}
    assert_group_sums_exact()


@pytest.mark.django_db(transaction=True)
def test_six_claimers_never_exceed_a_group_cap_across_its_channels() -> None:
    cap = 4
    spread("tenant", 12, 15)  # 180 messages
    f.enqueue("other", 60)
    ChannelGroup.objects.filter(name="tenant").update(max_concurrency=cap)
    f.fold_all()
    total = 12 * 15 + 60
    lock = threading.Lock()
    done: list[int] = []
    over: list[int] = []
    seen_at_cap: list[bool] = []
    deadline = time.monotonic() + 60

    def claimer(i: int) -> None:
        rng = random.Random(i)
        while True:
            with lock:
                if len(done) >= total:
                    return
            assert time.monotonic() < deadline, "claimers did not finish in time"
            got = claim(rng.randint(1, 6), f"w{i}")
            with connection.cursor() as cur:
                cur.execute(
                    "SELECT count(*) FROM fairqueue_message m "
                    "JOIN fairqueue_channel c ON c.id = m.channel_id "
                    "WHERE m.state = 'running' AND starts_with(c.name, 'tenant/')"
                )
                (running,) = cur.fetchone()  # type: ignore[misc]
            with lock:
                if running > cap:
                    over.append(running)
                if running == cap:
                    seen_at_cap.append(True)
            if not got:
                time.sleep(0.002)
                continue
            time.sleep(rng.uniform(0, 0.004))
            complete(got)
            with lock:
                done.extend(m.id for m in got)

    run_threads(6, claimer)
    assert len(done) == total == len(set(done))
    assert not over, f"group cap {cap} exceeded: {over[:5]}"
    assert seen_at_cap, "the cap was never reached: the test proved nothing"
    f.fold_all()
    assert_group_sums_exact()
    f.assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
def test_group_sums_follow_rescues_releases_and_deleted_channels() -> None:
    spread("g", 3, 4)
    f.fold_all()
    got = claim(6)
    message_store.release_messages([(m.id, m.lease_token) for m in got[:2]])
    complete(got[2:4])
    f.fold_all()
    assert_group_sums_exact()
    Channel.objects.filter(name="g/c000").delete()
    assert_group_sums_exact()
    ChannelGroup.objects.filter(name="g").delete()
    assert Channel.objects.filter(group__isnull=True).count() == 2


# ------------------------------------------------------------------------------------------------
# Operators: status, admin


@pytest.mark.django_db(transaction=True)
def test_status_shows_groups_beside_channels() -> None:
    import io
    import json

    from django.core.management import call_command

    spread("acme", 3, 2)
    ChannelGroup.objects.filter(name="acme").update(max_concurrency=5, weight=2)
    f.enqueue("plain", 1)
    f.fold_all()
    out = io.StringIO()
    call_command("fairqueue", "status", stdout=out)
    text = out.getvalue()
    assert "acme/c000" in text and "plain" in text
    group_line = next(line for line in text.splitlines() if line.startswith("acme "))
    assert group_line.split() == ["acme", "default", "3", "6", "0/5", "2", "-"]
    assert "1 channel group " in text
    out = io.StringIO()
    call_command("fairqueue", "status", "--json", stdout=out)
    data = json.loads(out.getvalue())
    assert data["groups"] == [
        {
            "name": "acme",
            "queue": "default",
            "channels": 3,
            "claimable_channels": 3,
            "ready": 6,
            "running": 0,
            "max_concurrency": 5,
            "weight": 2,
            "release_interval_seconds": 0.0,
        }
    ]


@pytest.mark.django_db(transaction=True)
def test_status_shows_a_groups_sums_agreeing_with_its_channels_before_any_fold(
    admin_client: Any,
) -> None:
    import io
    import json

    from django.core.management import call_command
    from django.urls import reverse

    enqueue(f.NOOP, 1, channel=("gx", "a"))
    enqueue(f.NOOP, 2, channel=("gx", "a"))  # not folded: no worker, no maintenance
    out = io.StringIO()
    call_command("fairqueue", "status", "--json", stdout=out)
    data = json.loads(out.getvalue())
    (group,) = data["groups"]
    (channel,) = [c for c in data["channels"] if c["name"] == "gx/a"]
    assert channel["ready"] == 2
    assert (group["ready"], group["claimable_channels"]) == (2, 1)
    out = io.StringIO()
    call_command("fairqueue", "status", stdout=out)
    group_line = next(line for line in out.getvalue().splitlines() if line.startswith("gx "))
    assert group_line.split()[:4] == ["gx", "default", "1", "2"]
    page = admin_client.get(reverse("admin:fairqueue_channelgroup_changelist"))
    assert page.status_code == 200
    assert channel_store.select_group_state()[0].ready == 2


@pytest.mark.django_db(transaction=True)
def test_group_admin_edits_limits_only_and_view_only_users_change_nothing(
    admin_client: Any, django_user_model: Any, client: Any
) -> None:
    from django.contrib.auth.models import Permission

    spread("acme", 2, 3)
    f.fold_all()
    group = ChannelGroup.objects.get(name="acme")
    url = f"/admin/fairqueue/channelgroup/{group.pk}/change/"
    page = admin_client.get(url)
    assert page.status_code == 200 and b"6 ready" in page.content
    listing = admin_client.get("/admin/fairqueue/channelgroup/")
    assert listing.status_code == 200 and b"acme" in listing.content
    channels = admin_client.get(f"/admin/fairqueue/channel/?group__id__exact={group.pk}")
    assert channels.status_code == 200 and b"acme/c001" in channels.content
    channel = Channel.objects.get(name="acme/c000")
    page = admin_client.get(f"/admin/fairqueue/channel/{channel.pk}/change/")
    assert page.status_code == 200 and b"acme" in page.content
    # a bad cap is refused with a message; a good one is saved, the state stays
    bad = admin_client.post(url, {"weight": 1, "max_concurrency": 0, "release_interval": "0"})
    assert bad.status_code == 200 and b"Max concurrency" in bad.content
    ok = admin_client.post(url, {"weight": 4, "max_concurrency": 2, "release_interval": "0"})
    assert ok.status_code == 302
    group.refresh_from_db()
    assert (group.weight, group.max_concurrency) == (4, 2)
    (state,) = channel_store.select_group_state([group.pk])
    assert (state.ready, state.claimable, state.channels) == (6, 2, 2)
    # a view-only user sees the group and can change nothing
    viewer = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_channelgroup"))
    client.force_login(viewer)
    assert client.get(url).status_code == 200
    client.post(url, {"weight": 9, "max_concurrency": 9, "release_interval": "0"})
    group.refresh_from_db()
    assert group.weight == 4


# ------------------------------------------------------------------------------------------------
# Work batches under a group's cap


@pytest.mark.django_db(transaction=True)
def test_a_group_cap_covers_its_channels_work_batches_and_messages_together() -> None:
    from django_fairqueue import batches
    from tests.test_batches import LEASE as BATCH_LEASE
    from tests.test_batches import drop_source, plan_job

    ChannelGroup.objects.create(name="bg", max_concurrency=2)
    try:
        enqueue(f.NOOP, channel=("bg", "a"))
        for name in ("a", "b", "c"):
            plan_job(f"job-{name}", f"bg/{name}", 4)
        assert set(Channel.objects.filter(group__name="bg").values_list("name", flat=True)) == {
            "bg/a",
            "bg/b",
            "bg/c",
        }
        f.fold_all()
        (message,) = claim(1)
        first = batches.claim(worker_id="w", lease=BATCH_LEASE)
        assert first is not None
        # one message and one batch run: the group is at its cap of 2
        assert batches.claim(worker_id="w", lease=BATCH_LEASE) is None
        complete([message])
        second = batches.claim(worker_id="w", lease=BATCH_LEASE)
        assert second is not None
        assert batches.claim(worker_id="w", lease=BATCH_LEASE) is None
        with batches.fenced(first) as fence:
            fence.rows_processed = first.row_count
        assert batches.claim(worker_id="w", lease=BATCH_LEASE) is not None
        f.fold_all()
        assert_group_sums_exact()
    finally:
        drop_source()


@pytest.mark.django_db(transaction=True)
def test_concurrent_batch_claimers_never_exceed_a_group_cap() -> None:
    from django_fairqueue import batches
    from django_fairqueue.models import WorkBatch
    from tests.test_batches import LEASE as BATCH_LEASE
    from tests.test_batches import drop_source, plan_job

    cap = 2
    ChannelGroup.objects.create(name="bg", max_concurrency=cap)
    try:
        for name in ("a", "b", "c"):
            plan_job(f"job-{name}", f"bg/{name}", 12, size=5)
        lock = threading.Lock()
        running = 0
        peak = 0
        claimed: list[int] = []

        def worker(i: int) -> None:
            nonlocal running, peak
            deadline = time.monotonic() + 60
            while True:
                assert time.monotonic() < deadline, "batch claimers did not finish in time"
                b = batches.claim(worker_id=f"w{i}", lease=BATCH_LEASE)
                if b is None:
                    if not WorkBatch.objects.filter(state="pending").exists():
                        return
                    time.sleep(0.002)
                    continue
                with lock:
                    running += 1
                    peak = max(peak, running)
                    claimed.append(b.id)
                time.sleep(0.003)
                with lock:  # leave before the slot is freed, as a real worker does
                    running -= 1
                with batches.fenced(b) as fence:
                    fence.rows_processed = b.row_count

        run_threads(6, worker)
        assert len(claimed) == len(set(claimed)) == 36
        assert peak <= cap, f"group cap {cap} exceeded: {peak} batches ran at once"
        assert peak == cap, "the claimers never filled the cap: the test proved nothing"
        f.fold_all()
        assert_group_sums_exact()
    finally:
        drop_source()


# ------------------------------------------------------------------------------------------------
# fairqueue verify: the groups' sums


@pytest.mark.django_db(transaction=True)
def test_verify_reports_and_repairs_a_groups_sums() -> None:
    from io import StringIO

    from django.core.management import CommandError, call_command

    spread("acme", 3, 4)
    f.fold_all()
    claim(2)
    with connection.cursor() as cur:  # what no supported path writes: drift made by hand
        cur.execute(
            "UPDATE fairqueue_channel_group SET ready_count = ready_count + 5, "
            "running_count = 0, claimable = 0 WHERE name = 'acme'"
        )
    out = StringIO()
    with pytest.raises(CommandError, match="3 counter"):
        call_command("fairqueue", "verify", stdout=out)
    assert "group 'acme': ready recorded 15, counted 10" in out.getvalue()
    assert "group 'acme': running recorded 0, counted 2" in out.getvalue()
    out = StringIO()
    call_command("fairqueue", "verify", "--repair", stdout=out)
    assert "group 'acme': claimable channels recorded 0, counted 3 (repaired)" in out.getvalue()
    assert_group_sums_exact()
    out = StringIO()
    call_command("fairqueue", "verify", stdout=out)
    assert "every channel's counters match its rows" in out.getvalue()


@pytest.mark.django_db(transaction=True)
def test_repairing_group_sums_while_claims_and_settlements_run_keeps_them_exact() -> None:
    spread("busy", 6, 30)
    f.fold_all()
    stop = threading.Event()
    repairs: list[int] = []

    def work(i: int) -> None:
        if i == 0:  # the repairer: recounts the group over and over (nothing is wrong)
            gid = ChannelGroup.objects.get(name="busy").pk
            while not stop.is_set():
                assert integrity_store.repair_group_counters([gid]) == []
                repairs.append(1)
            return
        try:
            while got := claim(3, f"w{i}"):
                complete(got)
                f.fold_all()
        finally:
            stop.set()

    run_threads(4, work)
    assert repairs, "the repairer never ran"
    f.fold_all()
    assert_group_sums_exact()
    assert integrity_store.verify_group_counters() == []


def _group_of_channel(name: str) -> str | None:
    channel = Channel.objects.select_related("group").get(name=name)
    return channel.group.name if channel.group is not None else None


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", ["instance", "queryset"])
def test_deleting_a_group_here_makes_the_next_tuple_enqueue_create_it_again(how: str) -> None:
    enqueue(f.NOOP, channel=("delgrp", "a"))
    if how == "instance":
        ChannelGroup.objects.get(name="delgrp").delete()
    else:
        ChannelGroup.objects.filter(name="delgrp").delete()
    assert _group_of_channel("delgrp/a") is None  # deleting a group leaves its channels
    enqueue(f.NOOP, channel=("delgrp", "b"))
    assert _group_of_channel("delgrp/b") == "delgrp"
    assert _group_of_channel("delgrp/a") == "delgrp"  # the new group takes its channels in


def _delete_group_elsewhere(database_url: str, name: str) -> None:
    """Delete a group as another process would (on a connection of its own, as Django's
    delete does it: its channels ungrouped, then the group), so this process still
    remembers the group as existing."""
    with psycopg.connect(database_url, autocommit=True) as other, other.transaction():
        row = other.execute(
            "SELECT id FROM fairqueue_channel_group WHERE name = %s", [name]
        ).fetchone()
        assert row is not None
        other.execute("UPDATE fairqueue_channel SET group_id = NULL WHERE group_id = %s", row)
        other.execute("DELETE FROM fairqueue_channel_group WHERE id = %s", row)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("in_transaction", [False, True])
@pytest.mark.parametrize("batch", [False, True])
def test_a_new_channel_of_a_group_another_process_deleted_lands_in_the_group_again(
    database_url: str, in_transaction: bool, batch: bool
) -> None:
    enqueue(f.NOOP, channel=("delgrp", "a"))  # this process now remembers the group
    _delete_group_elsewhere(database_url, "delgrp")
    assert not ChannelGroup.objects.filter(name="delgrp").exists()

    def go() -> None:
        if batch:
            enqueue_many([EnqueueRequest(f.NOOP, (), channel=("delgrp", "b"))])
        else:
            enqueue(f.NOOP, channel=("delgrp", "b"))

    if in_transaction:
        with transaction.atomic():
            go()
    else:
        go()
    assert _group_of_channel("delgrp/b") == "delgrp"
    assert Channel.objects.get(name="delgrp/b").messages.count() == 1
    assert_group_sums_exact_after_fold()


def assert_group_sums_exact_after_fold() -> None:
    f.fold_all()
    assert_group_sums_exact()


# ------------------------------------------------------------------------------------------------
# A channel's group and queue follow from its name


@pytest.mark.django_db(transaction=True)
def test_no_orm_write_moves_a_channel_to_another_group_or_queue() -> None:
    """A channel's group and queue are its name's: an ORM write that names them is refused
    with what to do instead, and a full save() writes neither, so a channel's running and
    waiting messages never leave its group's cap."""
    enqueue(f.NOOP, channel=("src", "a"))
    enqueue(f.NOOP, channel=("dst", "b"))
    src = ChannelGroup.objects.get(name="src")
    dst = ChannelGroup.objects.get(name="dst")
    channel = Channel.objects.get(name="src/a")
    writes: list[Callable[[], Any]] = [
        lambda: Channel.objects.filter(name="src/a").update(group=dst),
        lambda: Channel.objects.filter(name="src/a").update(group_id=dst.pk),
        lambda: Channel.objects.filter(name="src/a").update(group=None),
        lambda: Channel.objects.filter(name="src/a").update(queue="exports"),
        lambda: Channel.objects.bulk_update([Channel(pk=channel.pk)], ["group"]),
        lambda: Channel.objects.bulk_update([Channel(pk=channel.pk)], ["queue"]),
        lambda: channel.save(update_fields=["weight", "group"]),
        lambda: src.channels.update(weight=2, group=dst),
        # the related managers: add() writes through the base manager, the rest through these
        # (each is given the channel afresh: add() sets its group on the instance first)
        lambda: dst.channels.add(Channel.objects.get(name="src/a")),
        lambda: dst.channels.set([Channel.objects.get(name="src/a")]),
        lambda: src.channels.remove(Channel.objects.get(name="src/a")),
        lambda: src.channels.clear(),
    ]
    for write in writes:
        with pytest.raises(FieldError, match=r"follows from its name.*channel of the new name"):
            write()
    channel.group, channel.queue, channel.weight = dst, "exports", 2
    channel.save()
    assert Channel.objects.filter(name="src/a").values_list("group", "queue", "weight").get() == (
        src.pk,
        "default",
        2,
    )
    # the limits still go through update() and bulk_update()
    assert Channel.objects.filter(name="src/a").update(weight=3) == 1
    channel.weight = 4
    assert Channel.objects.bulk_update([channel], ["weight"]) == 1
    assert_group_sums_exact_after_fold()


@pytest.mark.django_db(transaction=True)
def test_saving_a_channel_loaded_before_its_group_existed_keeps_it_in_the_group() -> None:
    f.enqueue("acme/x", 2)
    stale = Channel.objects.get(name="acme/x")
    assert stale.group_id is None
    group = ChannelGroup.objects.create(name="acme")  # takes the channel in
    stale.max_concurrency = 1
    stale.save()
    saved = Channel.objects.get(name="acme/x")
    assert (saved.group_id, saved.max_concurrency) == (group.pk, 1)
    assert_group_sums_exact_after_fold()

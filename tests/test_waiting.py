"""Why is this waiting: one test per cause, for channels and for messages."""

from __future__ import annotations

import io
import json
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.urls import reverse

from django_fairqueue.api import cancel
from django_fairqueue.db import message_store, stats_store, worker_store
from django_fairqueue.models import Channel, Message
from django_fairqueue.observe import waiting
from django_fairqueue.runtime import worker_registry
from tests import factories as f

pytestmark = pytest.mark.django_db

LEASE = timedelta(minutes=5)


def cid(name: str) -> int:
    return f.channel_ids([name])[name]


def alive(*, channels: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> None:
    worker_registry.Registration(
        "w", concurrency=4, channels=channels, exclude_channels=exclude
    ).register()


def why(name: str) -> waiting.Why:
    return waiting.channel(cid(name))


def test_a_channel_whose_messages_are_all_delayed_or_retrying_says_so() -> None:
    """Not "nothing waits" while 3 messages wait for their time."""
    from django_fairqueue.api import enqueue

    alive()
    for _ in range(2):
        enqueue(f.NOOP, channel="later", run_after=timedelta(minutes=10))
    later = why("later")
    assert (later.cause, later.text) == (
        "delayed",
        "no message is ready yet: 2 delayed (sent to run later); each becomes ready at its time",
    )
    f.enqueue("flaky", 1)
    (m,) = message_store.claim_messages(
        1, lease=LEASE, worker_id="w", only_channel_ids=[cid("flaky")]
    )
    message_store.fail_messages([(m.id, m.lease_token, {"error": "x"}, timedelta(minutes=5))])
    assert why("flaky").cause == "retry"
    enqueue(f.NOOP, channel="flaky", run_after=timedelta(minutes=10))
    assert why("flaky").text == (
        "no message is ready yet: 1 delayed (sent to run later) and 1 waiting to retry after a "
        "failed attempt; each becomes ready at its time"
    )


def test_empty_paused_capped_and_rate_limited_channels() -> None:
    alive()
    f.enqueue("empty", 1)
    message_store.claim_messages(1, lease=LEASE, worker_id="w")
    assert why("empty").cause == "empty"

    f.enqueue("p", 2)
    f.set_limits(["p"], paused=True)
    assert why("p").cause == "paused"

    f.enqueue("capped", 3)
    f.set_limits(["capped"], max_concurrency=2)
    assert len(message_store.claim_messages(5, lease=LEASE, worker_id="w")) == 2
    capped = why("capped")
    assert capped.cause == "at_cap" and "2 of 2 running, the oldest since" in capped.text

    f.enqueue("metered", 3)
    f.set_limits(["metered"], release_interval=timedelta(hours=1))
    assert len(message_store.claim_messages(5, lease=LEASE, worker_id="w")) == 1
    metered = why("metered")
    assert metered.cause == "rate_limited" and "one message every 3600s" in metered.text


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("folded", [True, False])
def test_a_channel_held_back_by_its_groups_cap_or_rate_limit_says_so(folded: bool) -> None:
    from django_fairqueue.models import ChannelGroup

    alive()
    # a group at its cap: 2 of 2 running in tg/u0, while tg/u1 has ready messages
    f.enqueue_in_queue("default", ("tg", "u0"), 2)
    f.enqueue_in_queue("default", ("tg", "u1"), 2)
    ChannelGroup.objects.filter(name="tg").update(max_concurrency=2)
    f.fold_all()
    held = message_store.claim_messages(
        2, lease=LEASE, worker_id="w", only_channel_ids=[cid("tg/u0")]
    )
    assert len(held) == 2
    capped = why("tg/u1")
    assert capped.cause == "group_at_cap", capped
    assert "'tg'" in capped.text and "2 of 2 running" in capped.text
    # one finishes: the slot is free at once, folded or not
    message_store.complete_messages([(held[0].id, held[0].lease_token, None)], run_seconds=None)
    if folded:
        f.fold_all()
    assert why("tg/u1").cause in ("next", "in_round")

    # a group releasing one message every 10 minutes, just after a release
    f.enqueue_in_queue("default", ("wg", "r1"), 2)
    f.enqueue_in_queue("default", ("wg", "r2"), 2)
    ChannelGroup.objects.filter(name="wg").update(release_interval=timedelta(minutes=10))
    f.fold_all()
    got = message_store.claim_messages(
        5, lease=LEASE, worker_id="w", only_channel_ids=[cid("wg/r1"), cid("wg/r2")]
    )
    assert len(got) == 1
    if folded:
        f.fold_all()
    for name in ("wg/r1", "wg/r2"):
        metered = why(name)
        assert metered.cause == "group_rate_limited", metered
        assert "'wg'" in metered.text and "one message every 600s" in metered.text
        assert "(in 9m" in metered.text or "(in 10m" in metered.text, metered.text


def test_no_live_worker_at_all_or_none_for_this_channel() -> None:
    f.enqueue("lonely", 1)
    assert why("lonely").cause == "no_worker"
    alive(channels=("other",))
    assert why("lonely").cause == "no_worker_for_channel"
    worker_registry.Registration("w2", concurrency=1, exclude_channels=["lonely"]).register()
    assert why("lonely").cause == "no_worker_for_channel"
    worker_registry.Registration("w3", concurrency=1).register()
    assert why("lonely").cause == "next"


def test_a_capped_channel_whose_workers_all_stopped_says_no_live_worker_not_at_cap() -> None:
    # The cap holds nothing back while no worker claims: "the next starts when one finishes"
    # would promise what cannot happen (the running messages belong to a stopped worker).
    alive()
    f.enqueue("capped", 3)
    f.set_limits(["capped"], max_concurrency=2)
    assert len(message_store.claim_messages(5, lease=LEASE, worker_id="w")) == 2
    assert why("capped").cause == "at_cap"
    worker_store.deregister_worker("w", handled=0)
    stopped = why("capped")
    assert stopped.cause == "no_worker", stopped
    assert "no live worker" in stopped.text and "cap" not in stopped.text
    # none ready, two running of the stopped worker: not "nothing waits"
    assert len(cancel(channel="capped")) == 1
    emptied = why("capped")
    assert emptied.cause == "no_worker", emptied
    assert "its 2 running messages belong to a stopped worker" in emptied.text


def test_channels_ahead_in_the_round_with_an_estimate() -> None:
    alive()
    f.enqueue_spread({"a": 1, "b": 1, "c": 1})
    f.fold_all()
    last = why("c")
    assert last.cause == "in_round" and last.text.startswith("2 channels ahead of it")
    assert why("a").cause == "next"
    stats_store.record_channel_stats(
        [stats_store.ChannelMinuteStats(cid("a"), f.timezone.now().replace(second=0), claimed=600)]
    )
    assert "at the recent rate of 2.0 messages/s, about 1s" in why("c").text


def test_a_messages_own_causes() -> None:
    alive()
    (delayed,) = f.enqueue("m", 1, run_after=timedelta(hours=1))
    assert waiting.message(Message.objects.get(pk=delayed)).cause == "delayed"

    _first, second = f.enqueue("m2", 2)
    f.fold_all()
    ahead = waiting.message(Message.objects.get(pk=second))
    assert ahead.text.startswith("1 message of its channel ahead of it")

    (m,) = message_store.claim_messages(1, lease=LEASE, worker_id="w", only_channel_ids=[cid("m2")])
    assert waiting.message(Message.objects.get(pk=m.id)).cause == "running"
    message_store.fail_messages([(m.id, m.lease_token, {"type": "Boom", "message": "x"}, LEASE)])
    retry = waiting.message(Message.objects.get(pk=m.id))
    assert retry.cause == "retry" and "attempt 1 of" in retry.text and "Boom: x" in retry.text

    (n,) = message_store.claim_messages(
        1, lease=LEASE, worker_id="gone", only_channel_ids=[cid("m2")]
    )
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE fairqueue_message SET lease_expires_at = now() - interval '1 minute' "
            "WHERE id = %s",
            [n.id],
        )
    expired = waiting.message(Message.objects.get(pk=n.id))
    assert expired.cause == "lease_expired" and "worker gone" in expired.text


def test_status_of_one_channel_and_the_admin_pages_say_it(admin_client: Client) -> None:
    f.enqueue("solo", 2)
    out = io.StringIO()
    call_command("fairqueue", "status", "solo", stdout=out)
    assert "solo" in out.getvalue()
    assert "Why it waits: no live worker" in out.getvalue()
    out = io.StringIO()
    call_command("fairqueue", "status", "solo", "--json", stdout=out)
    assert json.loads(out.getvalue())["cause"] == "no_worker"
    page = admin_client.get(
        reverse("admin:fairqueue_channel_change", args=[Channel.objects.get(name="solo").pk])
    )
    assert "no live worker" in page.content.decode()
    mid = Message.objects.filter(channel__name="solo").order_by("id").first()
    assert mid is not None
    page = admin_client.get(reverse("admin:fairqueue_message_change", args=[mid.pk]))
    assert "no live worker" in page.content.decode()


def test_status_of_an_unknown_channel_is_a_clear_error(capsys: Any) -> None:
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="no channel named 'nope'"):
        call_command("fairqueue", "status", "nope")

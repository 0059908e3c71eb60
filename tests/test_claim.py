"""The fair claim, one claimer at a time: round-robin, weights, caps, rate limit, pause, delay,
priority, leases.

Every message here is created through ``enqueue_many`` (tests/factories.py), so the channel
counters the claim trusts are right; most tests end by checking them against the table.
Concurrent claimers are in test_claim_concurrency.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import DataError, connection, transaction
from django.utils import timezone

from django_fairqueue.db import channel_store, message_store
from django_fairqueue.models import Channel, Message, MessageState
from tests import factories as f

LEASE = timedelta(minutes=5)


@pytest.fixture(autouse=True)
def _async_commit() -> Iterator[None]:
    """Commit without waiting for the WAL flush: these tests commit thousands of times, and
    durability is not what they check (visibility and locking are unchanged)."""
    with connection.cursor() as cur:
        cur.execute("SET synchronous_commit = off")
    yield


def claim(limit: int = 1, **kwargs: Any) -> list[message_store.ClaimedMessage]:
    return message_store.claim_messages(limit, lease=LEASE, worker_id="test-worker", **kwargs)


def complete(messages: list[message_store.ClaimedMessage]) -> set[int]:
    return message_store.complete_messages([(m.id, m.lease_token, None) for m in messages])


def claim_one_by_one(n: int, *, settle: bool = True) -> list[str]:
    """``n`` claims of limit 1; returns the channel of each (fails if one comes back empty)."""
    order = []
    for _ in range(n):
        got = claim(1)
        assert len(got) == 1, f"claim {len(order) + 1} came back with {len(got)} messages"
        order.append(got[0].channel)
        if settle:
            assert complete(got) == {got[0].id}
    return order


def counters(name: str) -> channel_store.ChannelCounters:
    (found,) = channel_store.select_channel_counters([f.channel_ids([name])[name]])
    return found


# ------------------------------------------------------------------------------------------------
# Fairness: round-robin across channels


@pytest.mark.django_db(transaction=True)
def test_one_message_behind_a_backlog_of_ten_thousand_is_served_within_one_round() -> None:
    f.enqueue("bob", 10_000)
    claim_one_by_one(25)  # bob has been served for a while
    (alice,) = f.enqueue("alice", 1)

    # Two active channels: alice's message is among the next two claims of one message.
    served = [m.id for _ in range(2) for m in claim(1)]
    assert alice in served
    assert counters("bob").ready == 10_000 - 25 - (2 - 1)


@pytest.mark.django_db(transaction=True)
def test_new_channel_waits_at_most_one_claim_per_active_channel() -> None:
    f.enqueue_spread({"bob": 10_000, "carol": 50, "dave": 50, "erin": 50})
    claim_one_by_one(30)
    (alice,) = f.enqueue("alice", 1)

    active = 5
    served = [m.id for _ in range(active) for m in claim(1)]
    assert alice in served


@pytest.mark.django_db(transaction=True)
def test_batch_claim_serves_the_small_channel_in_its_first_claim() -> None:
    f.enqueue("bob", 10_000)
    complete(claim(100))
    (alice,) = f.enqueue("alice", 1)

    got = claim(100)

    assert alice in {m.id for m in got}
    assert len(got) == 100  # and bob's backlog fills the rest of the batch


@pytest.mark.django_db
def test_claims_of_one_visit_every_channel_once_per_round_in_a_fixed_order() -> None:
    names = ["delta", "alpha", "echo", "charlie", "bravo", "foxtrot"]
    f.enqueue_spread(dict.fromkeys(names, 20))
    rounds = 6

    order = claim_one_by_one(len(names) * rounds, settle=False)

    first = order[: len(names)]
    # Channels created by one batch share their first turn time; ties go by id, and ids follow
    # the names (channels are created in name order).
    assert first == sorted(names)
    assert order == first * rounds
    f.assert_counters_match_table()


@pytest.mark.django_db
@pytest.mark.usefixtures("by_count")
def test_a_new_channel_joins_at_the_back_but_an_idle_one_returns_at_the_front() -> None:
    # By count only: by time an idle channel comes back level with the others, not ahead
    # (tests/test_fairness_time.py).
    f.enqueue_spread({"alice": 30, "bob": 30, "carol": 30})
    claim_one_by_one(6)
    f.enqueue("dave", 1)
    # new: behind everyone served before it was created
    assert claim_one_by_one(4) == ["alice", "bob", "carol", "dave"]
    claim_one_by_one(9)  # dave is idle while the others take three more rounds

    f.enqueue("dave", 1)

    # dave's turn time is older than that of everyone served since: he goes first.
    assert claim_one_by_one(1) == ["dave"]


@pytest.mark.django_db
def test_only_and_exclude_restrict_the_channels_a_claim_may_take() -> None:
    f.enqueue_spread({"alice": 5, "bob": 5, "carol": 5})
    ids = f.channel_ids(["alice", "bob", "carol"])

    assert {m.channel for m in claim(10, only_channel_ids=[ids["bob"]])} == {"bob"}
    assert {m.channel for m in claim(10, exclude_channel_ids=[ids["alice"]])} == {"carol"}
    assert {m.channel for m in claim(10)} == {"alice"}


# ------------------------------------------------------------------------------------------------
# Weights


def _weighted_channels(per_channel: int) -> dict[str, int]:
    weights = {"w1": 1, "w2": 2, "w3": 3}
    f.enqueue_spread(dict.fromkeys(weights, per_channel))
    for name, weight in weights.items():
        f.set_limits([name], weight=weight)
    return weights


def assert_shares(served: Counter[str], weights: dict[str, int], tolerance: float = 0.10) -> None:
    total = sum(served.values())
    for name, weight in weights.items():
        expected = total * weight / sum(weights.values())
        assert abs(served[name] - expected) <= tolerance * expected, (
            f"{name} (weight {weight}) got {served[name]} of {total}, expected {expected:.0f} "
            f"+-{tolerance:.0%}: {dict(served)}"
        )


@pytest.mark.usefixtures("by_count")
@pytest.mark.django_db(transaction=True)
def test_weights_1_2_3_share_3000_single_claims_1_2_3() -> None:
    weights = _weighted_channels(2_000)

    served = Counter(claim_one_by_one(3_000))

    assert_shares(served, weights)
    f.assert_counters_match_table()


# Claims of 100 over channels that all fit into one batch: the served channels must go to the
# back in the order they were served, or ties by id hand the lowest ids the remainder of every
# partial round (seen before the fix: 12 vs 8 messages per claim, 600:960:1440 for 1:2:3).
@pytest.mark.django_db(transaction=True)
def test_weights_1_2_3_share_batch_claims_1_2_3() -> None:
    weights = _weighted_channels(2_000)

    served: Counter[str] = Counter()
    for _ in range(30):
        got = claim(100)
        assert len(got) == 100
        assert {m.channel for m in got} == set(weights)  # every batch spreads over all three
        served.update(m.channel for m in got)
        complete(got)

    assert_shares(served, weights)


@pytest.mark.django_db
def test_equal_channels_share_batch_claims_equally() -> None:
    names = [f"tenant-{i}" for i in range(10)]
    f.enqueue_spread(dict.fromkeys(names, 300))

    served: Counter[str] = Counter()
    for _ in range(20):
        got = claim(100)
        assert len(got) == 100
        served.update(m.channel for m in got)

    assert_shares(served, dict.fromkeys(names, 1))


@pytest.mark.usefixtures("by_count")
@pytest.mark.django_db
def test_batch_claim_with_many_channels_spreads_over_about_25() -> None:
    names = [f"tenant-{i:02d}" for i in range(60)]
    f.enqueue_spread(dict.fromkeys(names, 10))

    got = claim(100)  # quantum 100 // 25 = 4: a turn is 4 messages

    per_channel = Counter(m.channel for m in got)
    assert len(got) == 100
    assert len(per_channel) == 25
    assert set(per_channel.values()) == {4}
    # the next claim continues the round with channels not yet served
    assert not {m.channel for m in claim(100)} & set(per_channel)


@pytest.mark.django_db
def test_single_hot_channel_fills_the_whole_batch() -> None:
    f.enqueue("bob", 500)

    assert len(claim(100)) == 100
    assert len(claim(100, quantum=1)) == 100


@pytest.mark.django_db
def test_explicit_quantum_sets_the_turn() -> None:
    f.enqueue_spread({"alice": 20, "bob": 20})
    f.set_limits(["bob"], weight=3)

    order = claim_one_by_one(8, settle=False)  # quantum 1: turns of 1 and 3

    assert order == ["alice", "bob", "bob", "bob"] * 2
    got = claim(8, quantum=2)  # turns of 2 and 6
    assert Counter(m.channel for m in got) == {"alice": 2, "bob": 6}


# ------------------------------------------------------------------------------------------------
# Caps, rate limit, pause, delay, priority


@pytest.mark.django_db
def test_max_concurrency_caps_a_channel_and_a_completion_frees_one_slot() -> None:
    f.enqueue_spread({"capped": 10, "free": 10})
    f.set_limits(["capped"], max_concurrency=2)

    first = claim(20)
    capped = [m for m in first if m.channel == "capped"]
    assert len(capped) == 2
    assert [m.channel for m in claim(20)] == []  # free is drained, capped is full

    assert complete(capped[:1]) == {capped[0].id}
    again = claim(20)
    assert [m.channel for m in again] == ["capped"]  # exactly the one freed slot
    assert counters("capped").running == 2
    f.assert_counters_match_table()


@pytest.mark.django_db
def test_rate_limited_channel_releases_one_message_per_interval() -> None:
    f.enqueue_spread({"metered": 10, "free": 3})
    f.set_limits(["metered"], release_interval=timedelta(hours=1))

    got = claim(20)
    assert Counter(m.channel for m in got) == {"metered": 1, "free": 3}
    assert claim(20) == []  # the next release is an hour away

    # An hour later (moved back rather than waited for), it releases one more.
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE fairqueue_channel SET next_turn_at = now() WHERE name = %s", ["metered"]
        )
    assert [m.channel for m in claim(20)] == ["metered"]


@pytest.mark.django_db
def test_a_rate_limit_removed_or_shortened_takes_effect_at_once_however_it_is_written() -> None:
    """Through update(), save() or SQL: the channel waiting for its next release is due when
    the new interval says (counted from its last release), not when the old one said."""
    f.enqueue_spread({"metered": 10})
    f.set_limits(["metered"], release_interval=timedelta(hours=6))
    assert len(claim(5)) == 1 and claim(5) == []
    Channel.objects.filter(name="metered").update(release_interval=timedelta(hours=1))
    assert claim(5) == []  # an hour from its last release, not six
    with connection.cursor() as cur:
        cur.execute("SELECT next_turn_at - now() FROM fairqueue_channel WHERE name = 'metered'")
        (due,) = cur.fetchone()
    assert timedelta(minutes=59) < due < timedelta(minutes=61)  # (now(): the test's start)
    channel = Channel.objects.get(name="metered")
    channel.release_interval = timedelta(0)
    channel.save()
    assert [m.channel for m in claim(5)] == ["metered"] * 5  # no limit: one turn, at once
    f.set_limits(["metered"], release_interval=timedelta(hours=1))  # raised: nothing moves
    assert len(claim(5)) == 1 and claim(5) == []
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE fairqueue_channel SET release_interval = interval '0' WHERE name = %s",
            ["metered"],
        )
    assert len(claim(5)) == 3


@pytest.mark.django_db
def test_paused_channel_is_skipped_until_unpaused() -> None:
    f.enqueue_spread({"alice": 3, "bob": 3})
    f.set_limits(["alice"], paused=True)

    assert {m.channel for m in claim(10)} == {"bob"}
    assert claim(10) == []

    f.set_limits(["alice"], paused=False)
    assert Counter(m.channel for m in claim(10)) == {"alice": 3}
    f.assert_counters_match_table()


@pytest.mark.django_db
def test_delayed_message_is_claimed_only_once_due() -> None:
    (later,) = f.enqueue("alice", 1, run_after=timedelta(hours=1))
    (now,) = f.enqueue("alice", 1)

    assert [m.id for m in claim(10)] == [now]
    assert claim(10) == []
    assert counters("alice").scheduled == 1

    # The hour passes (run_at moved back rather than waited for): the claim promotes it.
    Message.objects.filter(id=later).update(run_at=timezone.now() - timedelta(seconds=1))
    assert [m.id for m in claim(10)] == [later]
    assert counters("alice").scheduled == 0
    f.assert_counters_match_table()


@pytest.mark.django_db
def test_within_a_channel_higher_priority_first_then_fifo() -> None:
    ids = {}
    for label, priority in [("a", 0), ("b", 5), ("c", -1), ("d", 5), ("e", 10), ("f", 0)]:
        (ids[label],) = f.enqueue("alice", 1, priority=priority)
    by_id = {v: k for k, v in ids.items()}

    order = [by_id[claim(1)[0].id] for _ in range(6)]

    assert order == ["e", "b", "d", "a", "f", "c"]


@pytest.mark.django_db
def test_batch_claim_takes_the_highest_priorities_of_a_channel() -> None:
    low = f.enqueue("alice", 5, priority=-5)
    high = f.enqueue("alice", 3, priority=7)

    got = claim(3)

    assert {m.id for m in got} == set(high)
    assert {m.id for m in claim(10)} == set(low)


@pytest.mark.django_db
def test_claim_limit_must_be_positive() -> None:
    f.enqueue("alice", 1)
    with pytest.raises(DataError, match="claim limit must be >= 1"), transaction.atomic():
        claim(0)
    with pytest.raises(DataError, match="quantum must be >= 1"), transaction.atomic():
        claim(5, quantum=0)
    assert len(claim(1)) == 1


@pytest.mark.django_db
def test_claimed_row_carries_its_lease() -> None:
    (mid,) = f.enqueue("alice", 1)

    (got,) = claim(1)

    row = Message.objects.get(id=mid)
    assert row.state == MessageState.RUNNING
    assert row.lease_token == got.lease_token
    assert row.lease_expires_at == got.lease_expires_at
    assert row.lease_expires_at - row.claimed_at == LEASE
    assert row.attempts == got.attempts == 1
    assert row.worker_id == "test-worker"
    assert got.payload == {"args": [0], "kwargs": {}}
    assert got.task_name == f.NOOP


@pytest.mark.django_db
def test_the_messages_of_one_claim_share_its_fresh_lease_token() -> None:
    f.enqueue("alice", 2)
    f.enqueue("bob", 2)
    first = claim(3)
    assert len(first) == 3 and {m.channel for m in first} == {"alice", "bob"}
    assert len({m.lease_token for m in first}) == 1
    rows = Message.objects.filter(id__in=[m.id for m in first])
    assert set(rows.values_list("lease_token", flat=True)) == {first[0].lease_token}
    (second,) = claim(3)
    assert second.lease_token != first[0].lease_token  # a token per claim, not per worker
    # each message settles on its own under the shared token
    assert complete(first[:1]) == {first[0].id}
    assert message_store.release_messages([(m.id, m.lease_token) for m in first[1:]]) == {
        m.id for m in first[1:]
    }
    assert complete([second]) == {second.id}
    f.assert_counters_match_table()


# ------------------------------------------------------------------------------------------------
# Settling under lease tokens


def _expire_and_rescue(message: message_store.ClaimedMessage) -> None:
    Message.objects.filter(id=message.id).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert [r.id for r in message_store.rescue_expired_messages()] == [message.id]


@pytest.mark.django_db
def test_stale_lease_token_changes_nothing_and_frees_no_slot() -> None:
    f.enqueue("alice", 2)
    f.set_limits(["alice"], max_concurrency=1)
    (first,) = claim(1)
    _expire_and_rescue(first)
    (second,) = claim(1)  # another worker takes the same message back
    assert second.id == first.id and second.lease_token != first.lease_token
    assert second.attempts == 2
    stale = (first.id, first.lease_token)

    assert message_store.complete_messages([(*stale, "late result")]) == set()
    assert message_store.fail_messages([(*stale, {"type": "X"}, None)]) == {}
    assert message_store.heartbeat_messages([stale], lease=LEASE) == {}
    assert message_store.release_messages([stale]) == set()

    row = Message.objects.get(id=first.id)
    assert (row.state, row.lease_token, row.attempts) == (
        MessageState.RUNNING,
        second.lease_token,
        2,
    )
    assert row.lease_expires_at == second.lease_expires_at
    assert (counters("alice").running, counters("alice").ready) == (1, 1)
    assert claim(1) == []  # no slot was freed: alice (max_concurrency 1) is still full
    f.assert_counters_match_table()

    # The current holder settles it once; a second completion is a no-op.
    assert complete([second]) == {second.id}
    assert complete([second]) == set()
    assert (counters("alice").running, counters("alice").succeeded) == (0, 1)
    assert len(claim(1)) == 1  # exactly one slot came back
    f.assert_counters_match_table()


@pytest.mark.django_db
def test_heartbeat_extends_only_the_leases_still_held() -> None:
    f.enqueue("alice", 2)
    a, b = claim(2)
    complete([b])

    assert message_store.heartbeat_messages(
        [(a.id, a.lease_token), (b.id, b.lease_token)], lease=timedelta(hours=2)
    ) == {a.id: False}
    assert Message.objects.get(id=a.id).lease_expires_at > a.lease_expires_at


@pytest.mark.django_db
def test_fail_retries_or_dead_letters_and_keeps_counters() -> None:
    f.enqueue("alice", 3)
    f.set_limits(["alice"], max_concurrency=3)
    now_retry, later_retry, no_retry = claim(3)
    error = {"type": "RuntimeError", "message": "boom", "traceback": None}

    states = message_store.fail_messages(
        [
            (now_retry.id, now_retry.lease_token, error, timedelta(0)),
            (later_retry.id, later_retry.lease_token, error, timedelta(hours=1)),
            (no_retry.id, no_retry.lease_token, error, None),
        ]
    )

    assert states == {now_retry.id: "ready", later_retry.id: "scheduled", no_retry.id: "failed"}
    assert message_store.fail_messages([(no_retry.id, no_retry.lease_token, error, None)]) == {}
    c = counters("alice")
    assert (c.ready, c.scheduled, c.running, c.failed) == (1, 1, 0, 1)
    assert Message.objects.get(id=later_retry.id).last_error == error
    assert [m.id for m in claim(3)] == [now_retry.id]
    f.assert_counters_match_table()


@pytest.mark.django_db
def test_release_returns_the_message_and_its_slot_without_counting_the_attempt() -> None:
    f.enqueue("alice", 1)
    f.set_limits(["alice"], max_concurrency=1)
    (got,) = claim(1)

    assert message_store.release_messages([(got.id, got.lease_token)]) == {got.id}
    assert message_store.release_messages([(got.id, got.lease_token)]) == set()

    (again,) = claim(1)
    assert again.id == got.id and again.attempts == 1
    f.assert_counters_match_table()


@pytest.mark.django_db
def test_rescue_dead_letters_a_message_out_of_attempts() -> None:
    f.enqueue("alice", 1)
    Message.objects.update(max_attempts=1)
    (got,) = claim(1)

    _expire_and_rescue(got)

    row = Message.objects.get(id=got.id)
    assert row.state == MessageState.FAILED
    assert row.last_error["type"] == "LeaseExpired"
    assert claim(1) == []
    f.assert_counters_match_table()


# ------------------------------------------------------------------------------------------------
# Read-side helpers on factory rows (these bypass the counters, so no counter checks here)


@pytest.mark.django_db
def test_factory_rows_follow_their_state() -> None:
    running = f.MessageFactory(state=MessageState.RUNNING)
    scheduled = f.MessageFactory(state=MessageState.SCHEDULED)
    failed = f.MessageFactory(state=MessageState.FAILED)
    ready = f.MessageFactory()

    assert running.lease_token and running.claimed_at and running.lease_expires_at
    assert running.attempts == 1 and running.worker_id
    assert scheduled.run_at > timezone.now()
    assert scheduled.lease_token is None and scheduled.claimed_at is None
    assert failed.finished_at and failed.last_error and failed.lease_token is None
    assert ready.state == MessageState.READY and ready.lease_token is None
    assert ready.attempts == 0


@pytest.mark.django_db
def test_select_failed_message_ids_pages_by_id() -> None:
    alice = f.ChannelFactory(name="alice")
    failed = [f.MessageFactory(channel=alice, state=MessageState.FAILED).id for _ in range(5)]
    f.MessageFactory(channel=alice, state=MessageState.READY)
    other = f.MessageFactory(state=MessageState.FAILED).id

    first = message_store.select_failed_message_ids(channel_id=alice.id, limit=3)
    rest = message_store.select_failed_message_ids(channel_id=alice.id, after_id=first[-1], limit=3)

    assert first + rest == failed
    assert message_store.select_failed_message_ids() == sorted([*failed, other])


@pytest.mark.django_db
def test_rescue_finds_only_expired_leases() -> None:
    expired = f.MessageFactory(
        state=MessageState.RUNNING, enqueued_at=timezone.now() - timedelta(hours=1)
    )
    f.MessageFactory(state=MessageState.RUNNING)  # lease still valid for a minute

    rescued = message_store.rescue_expired_messages()

    assert [(r.id, r.state, r.worker_id) for r in rescued] == [
        (expired.id, MessageState.READY, "factory-worker")
    ]


@pytest.mark.django_db
def test_prune_deletes_only_old_finished_rows() -> None:
    old = timezone.now() - timedelta(days=2)
    f.MessageFactory(state=MessageState.SUCCEEDED, enqueued_at=old)
    f.MessageFactory(state=MessageState.CANCELLED, enqueued_at=old)
    f.MessageFactory(state=MessageState.FAILED, enqueued_at=old)
    recent = f.MessageFactory(state=MessageState.SUCCEEDED)

    assert message_store.prune_finished_messages(timezone.now() - timedelta(days=1)) == 2
    assert set(Message.objects.values_list("state", flat=True)) == {"failed", "succeeded"}
    assert Message.objects.filter(id=recent.id).exists()

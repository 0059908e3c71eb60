"""``store.complete_and_claim_messages``: complete, then claim, in one transaction.

The pair must keep every guarantee of the two statements alone: only the caller's leases
settle, a slot is freed once, caps hold, and the claim stays fair.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest

from django_fairqueue import store
from django_fairqueue.models import Message, MessageState
from tests import factories as f
from tests.workerkit import counters

pytestmark = pytest.mark.django_db

LEASE = timedelta(minutes=5)


def claim(limit: int = 1) -> list[store.ClaimedMessage]:
    return store.claim_messages(limit, lease=LEASE, worker_id="w")


def done(messages: list[store.ClaimedMessage]) -> list[tuple[int, uuid.UUID, None]]:
    return [(m.id, m.lease_token, None) for m in messages]


def test_it_completes_the_given_messages_and_claims_the_next() -> None:
    ids = f.enqueue("alice", 3)
    first = claim()
    assert [m.id for m in first] == ids[:1]

    completed, claimed = store.complete_and_claim_messages(
        done(first), 1, lease=LEASE, worker_id="w"
    )

    assert completed == {ids[0]}
    assert [m.id for m in claimed] == [ids[1]]
    assert claimed[0].channel == "alice" and claimed[0].lease_token is not None
    assert not Message.objects.filter(pk=ids[0]).exists()  # completed, not kept
    assert Message.objects.get(pk=ids[1]).state == MessageState.RUNNING
    f.assert_counters_match_table()


def test_a_slot_freed_by_the_completion_is_claimable_by_the_same_call() -> None:
    ids = f.enqueue("alice", 2)
    f.set_limits(["alice"], max_concurrency=1)
    first = claim()
    assert claim() == []  # the cap: one running at most

    completed, claimed = store.complete_and_claim_messages(
        done(first), 1, lease=LEASE, worker_id="w"
    )

    assert completed == {ids[0]}
    assert [m.id for m in claimed] == [ids[1]]
    assert counters("alice").running == 1
    f.assert_counters_match_table()


def test_a_stale_lease_completes_nothing_and_frees_no_slot() -> None:
    ids = f.enqueue("alice", 2)
    f.set_limits(["alice"], max_concurrency=1)
    (first,) = claim()
    stale = [(first.id, uuid.uuid4(), None)]  # not the token of the current attempt

    completed, claimed = store.complete_and_claim_messages(stale, 1, lease=LEASE, worker_id="w")

    assert completed == set()
    assert claimed == []  # the slot is still taken
    assert Message.objects.get(pk=ids[0]).state == MessageState.RUNNING
    f.assert_counters_match_table()


def test_without_messages_to_complete_it_is_a_claim() -> None:
    f.enqueue_spread({"alice": 3, "bob": 3})

    completed, claimed = store.complete_and_claim_messages([], 2, lease=LEASE, worker_id="w")

    assert completed == set()
    assert sorted(m.channel for m in claimed) == ["alice", "bob"]  # fair: one turn each
    f.assert_counters_match_table()


def test_results_are_kept_for_messages_that_keep_them() -> None:
    from django_fairqueue.api import EnqueueRequest, enqueue_many
    from tests import fairtasks

    (mid,) = enqueue_many([EnqueueRequest(fairtasks.add, (1, 2), channel="alice")])
    (first,) = claim()
    assert first.keep_result

    completed, claimed = store.complete_and_claim_messages(
        [(first.id, first.lease_token, {"sum": 3})], 1, lease=LEASE, worker_id="w"
    )

    assert completed == {mid} and claimed == []
    row = Message.objects.get(pk=mid)
    assert (row.state, row.result) == (MessageState.SUCCEEDED, {"sum": 3})
    f.assert_counters_match_table()

"""Unique jobs: one message per (channel, unique key) while it holds the key.

Every rule is checked against the table and the counters (the channel row plus its pending
deltas must equal the rows per state). The concurrency tests commit (``transaction=True``) and
run several connections at once: duplicate keys must be impossible whatever the interleaving.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction

from django_fairqueue import ChannelFull, DuplicateJob, enqueue, enqueue_many
from django_fairqueue.api import EnqueueRequest
from django_fairqueue.db import message_store
from django_fairqueue.models import Channel, Message
from django_fairqueue.worker import Worker, WorkerConfig
from tests import fairtasks
from tests.factories import assert_counters_match_table
from tests.test_claim_concurrency import run_threads
from tests.workerkit import run_in_thread, wait_until

LEASE = timedelta(minutes=5)


def claim(limit: int = 100) -> list[message_store.ClaimedMessage]:
    return message_store.claim_messages(limit, lease=LEASE, worker_id="w")


def holders(channel: str, key: str) -> list[Message]:
    return list(Message.objects.filter(channel__name=channel, unique_key=key).order_by("id"))


@pytest.mark.django_db
def test_keep_returns_the_holders_id_and_stores_nothing() -> None:
    first = fairtasks.add.enqueue(1, 2, channel="acme", unique_key="report")
    again = fairtasks.add.enqueue(3, 4, channel="acme", unique_key="report")
    other_channel = fairtasks.add.enqueue(3, 4, channel="beta", unique_key="report")
    other_key = fairtasks.add.enqueue(3, 4, channel="acme", unique_key="report-2")

    assert again == first
    assert len({first, other_channel, other_key}) == 3
    row = Message.objects.get(pk=first)
    assert (row.payload, row.unique_key, row.unique_scope) == (
        {"args": [1, 2], "kwargs": {}},
        "report",
        "queued",
    )
    assert Message.objects.count() == 3
    assert_counters_match_table()


@pytest.mark.django_db
def test_scope_queued_frees_the_key_when_the_holder_starts_and_active_when_it_ends() -> None:
    queued = enqueue(fairtasks.add, 1, 1, channel="acme", unique_key="q")
    active = enqueue(fairtasks.add, 1, 1, channel="acme", unique_key="a", unique_scope="active")
    (a, b) = claim()
    assert {a.id, b.id} == {queued, active}

    # queued scope: a running holder no longer holds the key
    assert enqueue(fairtasks.add, 2, 2, channel="acme", unique_key="q") != queued
    # active scope: it holds it until it finishes
    assert (
        enqueue(fairtasks.add, 2, 2, channel="acme", unique_key="a", unique_scope="active")
        == active
    )
    message_store.complete_messages([(active, (a if a.id == active else b).lease_token, None)])
    assert enqueue(fairtasks.add, 3, 3, channel="acme", unique_key="a") != active
    assert_counters_match_table()


@pytest.mark.django_db
def test_replace_rewrites_a_queued_holder_in_place_and_keeps_a_running_one() -> None:
    held = fairtasks.add.enqueue(1, 1, channel="acme", unique_key="k")
    later = timedelta(hours=1)
    replaced = enqueue(
        fairtasks.add,
        5,
        6,
        channel="acme",
        unique_key="k",
        on_conflict="replace",
        run_after=later,
        priority=7,
    )
    assert replaced == held
    row = Message.objects.get(pk=held)
    assert (row.payload["args"], row.state, row.priority) == ([5, 6], "scheduled", 7)
    assert_counters_match_table()  # ready -1, scheduled +1

    enqueue(fairtasks.add, 8, 9, channel="acme", unique_key="k", on_conflict="replace")
    row.refresh_from_db()
    assert (row.payload["args"], row.state) == ([8, 9], "ready")
    assert_counters_match_table()

    running = enqueue(fairtasks.add, 1, 1, channel="acme", unique_key="r", unique_scope="active")
    claimed = {m.id for m in claim()}
    assert running in claimed
    assert (
        enqueue(fairtasks.add, 2, 2, channel="acme", unique_key="r", on_conflict="replace")
        == running
    )
    assert Message.objects.get(pk=running).payload["args"] == [1, 1]  # a running task's stay
    assert_counters_match_table()


@pytest.mark.django_db
def test_raise_names_the_holder_and_stores_nothing_of_the_batch() -> None:
    held = fairtasks.add.enqueue(1, 1, channel="acme", unique_key="k")
    before = Message.objects.count()
    with pytest.raises(DuplicateJob) as caught, transaction.atomic():
        enqueue_many(
            [
                EnqueueRequest(fairtasks.add, (1, 2), channel="acme"),
                EnqueueRequest(
                    fairtasks.add, (3, 4), channel="acme", unique_key="k", on_conflict="raise"
                ),
            ]
        )
    assert (caught.value.message_id, caught.value.unique_key, caught.value.state) == (
        held,
        "k",
        "ready",
    )
    assert caught.value.channel == "acme"
    assert Message.objects.count() == before


@pytest.mark.django_db
def test_a_key_twice_in_a_batch_raises_naming_the_earlier_request_not_a_rolled_back_id() -> None:
    before = Message.objects.count()
    requests = [
        EnqueueRequest(fairtasks.add, (1, 2), channel="acme", unique_key="k"),
        EnqueueRequest(fairtasks.add, (1, 2), channel="bob", unique_key="k", on_conflict="raise"),
        EnqueueRequest(fairtasks.add, (3, 4), channel="acme", unique_key="k", on_conflict="raise"),
    ]
    with pytest.raises(DuplicateJob) as caught:
        enqueue_many(requests)
    duplicate = caught.value
    assert (duplicate.channel, duplicate.unique_key, duplicate.in_batch) == ("acme", "k", 0)
    assert (caught.value.message_id, caught.value.state) == (None, None)
    assert "twice in one batch (request 0 carries it first)" in str(caught.value)
    assert Message.objects.count() == before
    # a later request that keeps (the default) gets the earlier one's id, as documented
    kept = enqueue_many([requests[0], dataclasses.replace(requests[2], on_conflict="keep")])
    assert kept[0] == kept[1] and Message.objects.count() == before + 1
    # in another queue the same channel name is another channel, and is named as the API does
    other = dataclasses.replace(requests[2], queue="reports")
    assert len(set(enqueue_many([requests[0], other]))) == 2
    with pytest.raises(DuplicateJob) as caught:
        enqueue_many([other])
    assert (caught.value.channel, caught.value.queue) == ("acme", "reports")
    assert str(caught.value).startswith("channel 'acme' of queue 'reports' already has message")


@pytest.mark.django_db
def test_enqueue_many_mixes_keys_and_plain_messages_in_input_order() -> None:
    held = fairtasks.add.enqueue(0, 0, channel="acme", unique_key="k1")
    ids = enqueue_many(
        [
            EnqueueRequest(fairtasks.add, (1, 1), channel="acme"),
            EnqueueRequest(fairtasks.add, (2, 2), channel="acme", unique_key="k1"),
            EnqueueRequest(fairtasks.add, (3, 3), channel="acme", unique_key="k2"),
            EnqueueRequest(fairtasks.add, (4, 4), channel="beta"),
            EnqueueRequest(fairtasks.add, (5, 5), channel="acme", unique_key="k2"),
            EnqueueRequest(
                fairtasks.add, (6, 6), channel="acme", unique_key="k3", on_conflict="replace"
            ),
            EnqueueRequest(
                fairtasks.add, (7, 7), channel="acme", unique_key="k3", on_conflict="replace"
            ),
        ]
    )
    assert ids[1] == held
    assert ids[4] == ids[2]  # the same key twice in a batch: the first holds it
    assert ids[6] == ids[5]  # ... and a later replace rewrites it
    rows = Message.objects.in_bulk(ids)
    assert rows[ids[0]].payload["args"] == [1, 1]
    assert rows[ids[2]].payload["args"] == [3, 3]
    assert rows[ids[3]].payload["args"] == [4, 4]
    assert rows[ids[5]].payload["args"] == [7, 7]
    assert ids[0] < ids[3]  # plain messages' ids follow the input (keyed ones: key order)
    assert Message.objects.count() == 5
    assert_counters_match_table()


@pytest.mark.django_db
def test_a_retrying_message_keeps_its_key() -> None:
    mid = fairtasks.add.enqueue(1, 1, channel="acme", unique_key="k")
    (m,) = claim()
    states = message_store.fail_messages([(m.id, m.lease_token, {"type": "E"}, timedelta(hours=1))])
    assert states == {mid: "scheduled"}
    assert fairtasks.add.enqueue(2, 2, channel="acme", unique_key="k") == mid
    assert_counters_match_table()


@pytest.mark.django_db
@pytest.mark.parametrize("how", ["fail", "release", "rescue"])
@pytest.mark.parametrize("newer_state", ["ready", "running"])
def test_a_returning_message_whose_key_was_taken_meanwhile_is_superseded(
    how: str, newer_state: str
) -> None:
    """The newer message stands for the job whether it waits or already runs (a free thread
    claimed it before the holder's failure was settled: of scope queued, it holds nothing)."""
    first = fairtasks.add.enqueue(1, 1, channel="acme", unique_key="k")
    (m,) = claim()
    newer = fairtasks.add.enqueue(2, 2, channel="acme", unique_key="k")  # scope queued
    assert newer != first
    if newer_state == "running":
        (n,) = claim()
        assert n.id == newer
    if how == "fail":
        out = message_store.fail_messages([(m.id, m.lease_token, {"type": "E"}, timedelta(0))])
        assert out == {first: "cancelled"}
    elif how == "release":
        assert message_store.release_messages([(m.id, m.lease_token)]) == {first}
    else:
        Message.objects.filter(pk=first).update(lease_expires_at="2000-01-01T00:00:00Z")
        assert [r.state for r in message_store.rescue_expired_messages()] == ["cancelled"]
    row = Message.objects.get(pk=first)
    assert (row.state, row.lease_token) == ("cancelled", None)
    assert Message.objects.get(pk=newer).state == newer_state
    assert_counters_match_table()


@pytest.mark.django_db
def test_an_older_running_or_a_finished_newer_message_does_not_supersede_a_retry() -> None:
    """Only a newer message stands for the job: an older one started before its request, and
    a newer one that finished may be gone without a trace (no kept result), so the retry runs."""
    older = fairtasks.add.enqueue(1, 1, channel="acme", unique_key="k")
    (o,) = claim()
    mid = fairtasks.add.enqueue(2, 2, channel="acme", unique_key="k")
    (m,) = claim()
    out = message_store.fail_messages([(m.id, m.lease_token, {"type": "E"}, timedelta(0))])
    assert out == {mid: "ready"}  # the older one still runs: not a newer one
    message_store.complete_messages([(o.id, o.lease_token, None)])
    (m,) = claim()
    newest = fairtasks.add.enqueue(3, 3, channel="acme", unique_key="k")
    (n,) = claim()
    message_store.complete_messages([(n.id, n.lease_token, None)])  # newer, finished
    out = message_store.fail_messages([(m.id, m.lease_token, {"type": "E"}, timedelta(0))])
    assert (out, newest != mid, older != mid) == ({mid: "ready"}, True, True)
    assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
def test_the_worker_logs_that_a_superseded_failure_is_not_retried(
    tmp_path: Any, caplog: Any
) -> None:
    marker = tmp_path / "started"
    first = fairtasks.fail_first.using(channel="acme", unique_key="k").enqueue(1.0, str(marker))
    worker = Worker(WorkerConfig(concurrency=1, poll_interval=0.05, listen=False))
    thread = run_in_thread(worker)
    try:
        wait_until(marker.exists, what="the first attempt started")
        bound = fairtasks.fail_first.using(
            channel="acme", unique_key="k", run_after=timedelta(hours=1)
        )
        newer = bound.enqueue(0.0, None)  # scheduled: it holds the key, no worker takes it
        assert newer != first  # scope 'queued': a running message does not hold its key
        wait_until(lambda: Message.objects.get(pk=first).state == "cancelled", what="superseded")
    finally:
        worker.stop()
        thread.join(30)
    assert (
        f"did not retry tests.fair.fail_first message {first} channel 'acme': another message "
        "took its unique key while it ran, so it ends cancelled (superseded by that message)"
    ) in caplog.text


@pytest.mark.django_db(transaction=True)
def test_retrying_a_failed_unique_job_while_a_holder_commits_leaves_it_failed() -> None:
    """A holder of the key enqueued by another transaction that commits while the retry is
    writing: the retry's write meets the unique index, runs again, sees the holder and leaves
    the failed job failed (it used to raise IntegrityError to the operator)."""
    import threading

    from django.db import connections

    first = fairtasks.add.enqueue(1, 1, channel="acme", unique_key="k")
    (m,) = claim()
    message_store.fail_messages([(m.id, m.lease_token, {"type": "E"}, None)])
    inserted, release = threading.Event(), threading.Event()
    out: dict[str, Any] = {}

    def holder() -> None:
        try:
            with transaction.atomic():
                out["newer"] = fairtasks.add.enqueue(2, 2, channel="acme", unique_key="k")
                inserted.set()
                release.wait(10)
        finally:
            connections.close_all()

    thread = threading.Thread(target=holder)
    thread.start()
    assert inserted.wait(10)
    # The retry's snapshot does not see the uncommitted holder; its write waits on the index
    # entry until the holder commits (released a moment after the retry started).
    threading.Timer(0.3, release.set).start()
    assert message_store.retry_failed_messages([first]) == []
    thread.join(10)
    assert Message.objects.get(pk=first).state == "failed"
    assert Message.objects.get(pk=out["newer"]).state == "ready"
    assert_counters_match_table()


@pytest.mark.django_db
def test_retrying_a_failed_unique_job_leaves_it_failed_while_another_holds_the_key() -> None:
    first = fairtasks.add.enqueue(1, 1, channel="acme", unique_key="k")
    (m,) = claim()
    message_store.fail_messages([(m.id, m.lease_token, {"type": "E"}, None)])
    newer = fairtasks.add.enqueue(2, 2, channel="acme", unique_key="k")
    assert message_store.retry_failed_messages([first]) == []
    message_store.cancel_messages([newer])
    assert message_store.retry_failed_messages([first]) == [first]
    assert_counters_match_table()


def check_backlog_at_commit() -> None:
    """Run the bounded-backlog check that waits for the commit now (a deferred trigger)."""
    with connection.cursor() as cur:
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")


@pytest.mark.django_db
@pytest.mark.parametrize("policy", ["keep", "replace", "raise"])
def test_a_held_key_on_a_full_channel_is_kept_replaced_or_raised_not_refused(policy: str) -> None:
    """A keep or replace adds no waiting message, so max_backlog does not refuse it."""
    holder = fairtasks.add.enqueue(1, 1, channel="acme", unique_key="k")
    Channel.objects.filter(name="acme").update(max_backlog=1)
    options = {"channel": "acme", "unique_key": "k", "on_conflict": policy}
    if policy == "raise":
        with pytest.raises(DuplicateJob) as caught, transaction.atomic():
            enqueue(fairtasks.add, 2, 2, **options)
        assert caught.value.message_id == holder
    else:
        assert enqueue(fairtasks.add, 2, 2, **options) == holder
        check_backlog_at_commit()
    args = [2, 2] if policy == "replace" else [1, 1]
    assert Message.objects.get().payload["args"] == args
    with pytest.raises(ChannelFull), transaction.atomic():  # a free key adds one: full
        enqueue(fairtasks.add, 3, 3, channel="acme", unique_key="free")
    assert_counters_match_table()


@pytest.mark.django_db
def test_a_batch_counts_only_the_messages_it_adds_against_max_backlog() -> None:
    holder = fairtasks.add.enqueue(1, 1, channel="acme", unique_key="k")
    Channel.objects.filter(name="acme").update(max_backlog=2)  # room for exactly one
    kept = EnqueueRequest(fairtasks.add, (2, 2), channel="acme", unique_key="k")
    new = EnqueueRequest(fairtasks.add, (3, 3), channel="acme")
    with pytest.raises(ChannelFull) as caught, transaction.atomic():
        enqueue_many([kept, new, new])
    assert (caught.value.backlog, caught.value.batch) == (1, 2)
    ids = enqueue_many([kept, new])
    check_backlog_at_commit()
    assert ids[0] == holder and ids[1] != holder
    assert Message.objects.count() == 2
    assert_counters_match_table()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"unique_key": ""}, "1 to 200"),
        ({"unique_key": "x" * 201}, "1 to 200"),
        ({"unique_key": 5}, "must be a string"),
        ({"unique_key": "a\x00b"}, "NUL"),
        ({"unique_key": "k", "unique_scope": "forever"}, "unique_scope"),
        ({"unique_key": "k", "on_conflict": "merge"}, "on_conflict"),
        ({"on_conflict": "replace"}, "need a unique_key"),
    ],
)
def test_bad_unique_options_are_refused_before_anything_is_stored(
    options: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        enqueue(fairtasks.add, 1, 1, channel="acme", **options)
    with pytest.raises(ValueError, match=error):
        enqueue_many([EnqueueRequest(fairtasks.add, (1, 1), channel="acme", **options)])
    assert not Message.objects.exists()


# ------------------------------------------------------------------------------------------------
# concurrency


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("policy", ["keep", "replace"])
def test_concurrent_enqueuers_of_one_key_make_exactly_one_message(policy: str) -> None:
    n = 8

    def target(i: int) -> list[int]:
        ids = []
        for round_ in range(20):
            with transaction.atomic():
                ids.append(
                    enqueue(
                        fairtasks.add,
                        i,
                        round_,
                        channel="acme",
                        unique_key=f"k{round_}",
                        on_conflict=policy,
                    )
                )
        return ids

    results = run_threads(n, target)
    for round_ in range(20):
        assert len({ids[round_] for ids in results}) == 1, round_
        assert len(holders("acme", f"k{round_}")) == 1
    assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
def test_concurrent_enqueuers_and_claimers_never_hold_a_key_twice() -> None:
    """Enqueuers of a handful of keys (single and batched, every policy and scope) race claimers
    that complete or fail (retry) what they take: at every moment at most one message holds a
    key, and the counters stay exact."""
    keys = [f"k{i}" for i in range(4)]

    def target(i: int) -> int:
        done = 0
        for round_ in range(40):
            key = keys[(i + round_) % len(keys)]
            if i < 4:
                scope = "active" if i % 2 else "queued"
                policy = ("keep", "replace", "raise")[round_ % 3]
                try:
                    if round_ % 2:
                        enqueue(
                            fairtasks.add,
                            i,
                            round_,
                            channel="acme",
                            unique_key=key,
                            unique_scope=scope,
                            on_conflict=policy,
                        )
                    else:
                        enqueue_many(
                            [
                                EnqueueRequest(
                                    fairtasks.add,
                                    (i, round_),
                                    channel="acme",
                                    unique_key=key,
                                    unique_scope=scope,
                                    on_conflict=policy,
                                ),
                                EnqueueRequest(fairtasks.add, (i, -1), channel="acme"),
                            ]
                        )
                except DuplicateJob:
                    pass
            else:
                claimed = message_store.claim_messages(3, lease=LEASE, worker_id=f"w{i}")
                half = len(claimed) // 2
                message_store.complete_messages(
                    [(m.id, m.lease_token, None) for m in claimed[:half]]
                )
                message_store.fail_messages(
                    [(m.id, m.lease_token, {"type": "E"}, timedelta(0)) for m in claimed[half:]]
                )
                done += len(claimed)
            with connection.cursor() as cur:
                cur.execute(
                    "SELECT unique_key, count(*) FROM fairqueue_message "
                    "WHERE unique_key IS NOT NULL AND (state IN ('ready', 'scheduled') "
                    "OR (state = 'running' AND unique_scope = 'active')) "
                    "GROUP BY unique_key HAVING count(*) > 1"
                )
                assert cur.fetchall() == []
        return done

    assert sum(run_threads(8, target)) > 0
    assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
def test_concurrent_raise_lets_exactly_one_enqueuer_through() -> None:
    def target(i: int) -> str:
        try:
            with transaction.atomic():
                enqueue(fairtasks.add, i, i, channel="acme", unique_key="once", on_conflict="raise")
        except DuplicateJob:
            return "refused"
        return "stored"

    outcomes = run_threads(8, target)
    assert sorted(outcomes).count("stored") == 1
    assert len(holders("acme", "once")) == 1
    assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
def test_an_uncommitted_holder_makes_a_concurrent_enqueue_wait_then_see_it() -> None:
    """ON CONFLICT waits for a concurrent inserter of the same key: keep then returns the id
    the other transaction committed, although it was not in the statement's snapshot."""
    import threading

    inserted = threading.Event()
    release = threading.Event()
    got: dict[str, int] = {}

    def holder() -> None:
        try:
            with transaction.atomic():
                got["holder"] = fairtasks.add.enqueue(1, 1, channel="acme", unique_key="k")
                inserted.set()
                release.wait(10)
        finally:
            connection.close()

    fairtasks.add.enqueue(0, 0, channel="acme")  # the channel exists: no creation apart
    thread = threading.Thread(target=holder)
    thread.start()
    assert inserted.wait(10)
    timer = threading.Timer(0.3, release.set)
    timer.start()
    got["waiter"] = fairtasks.add.enqueue(2, 2, channel="acme", unique_key="k")
    thread.join(10)
    assert got["waiter"] == got["holder"]
    assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
def test_batches_of_the_same_keys_in_opposite_orders_do_not_deadlock() -> None:
    """Keys are inserted in (channel, key) order whatever the batch's order: two batches
    naming the same keys in opposite orders queue behind each other instead of deadlocking."""
    keys = [f"k{i}" for i in range(20)]

    def target(i: int) -> int:
        done = 0
        for round_ in range(15):
            order = keys if (i + round_) % 2 else keys[::-1]
            policy = ("keep", "replace")[round_ % 2]
            with transaction.atomic():
                enqueue_many(
                    [
                        EnqueueRequest(
                            fairtasks.add,
                            (i, round_),
                            channel="acme",
                            unique_key=key,
                            on_conflict=policy,
                        )
                        for key in order
                    ]
                )
            if round_ % 5 == 4:
                message_store.cancel_matching_messages(
                    channel_id=holders("acme", "k0")[0].channel_id
                )
            done += 1
        return done

    assert sum(run_threads(6, target)) == 90
    assert_counters_match_table()

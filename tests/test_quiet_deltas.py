"""Quiet enqueue deltas: an enqueue to a channel that counts ready messages already cannot make
it claimable, so its counter delta does not wake the claim (which would fold it first); the
maintenance loop folds it. What that must not cost: a message left unclaimable when a channel's
count runs out (a claim takes all it counts, a fold of removals, the repair), whatever is in
flight; a short claim where more is ready; a deadlock; a claim that stops folding.

Every test commits (``transaction=True``): the enqueues in flight run on other connections."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import override_settings

from django_fairqueue.api import EnqueueRequest, enqueue, enqueue_many
from django_fairqueue.db import channel_store, integrity_store, message_store
from django_fairqueue.maintenance import DeltaFolder
from django_fairqueue.models import Channel, ChannelGroup
from tests import factories as f

pytestmark = pytest.mark.django_db(transaction=True)

LEASE = timedelta(minutes=5)


def claim(limit: int) -> list[message_store.ClaimedMessage]:
    return message_store.claim_messages(limit, lease=LEASE, worker_id="quiet")


def deltas(channel: str) -> list[tuple[int, bool, bool]]:
    """(ready, wake, drained) of the channel's pending deltas, oldest first."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT d.ready, d.wake, d.drained FROM fairqueue_channel_delta d "
            "JOIN fairqueue_channel c ON c.id = d.channel_id WHERE c.name = %s ORDER BY d.id",
            [channel],
        )
        return cur.fetchall()


def counted(channel: str) -> int:
    """The channel row's folded ready_count (without its pending deltas)."""
    with connection.cursor() as cur:
        cur.execute("SELECT ready_count FROM fairqueue_channel WHERE name = %s", [channel])
        (row,) = cur.fetchall()
    return row[0]


def backlogged(channel: str, n: int = 3) -> None:
    """``n`` ready messages of which a claim took one, so the channel counts ``n - 1``."""
    enqueue_many(EnqueueRequest(f.NOOP, (i,), channel=channel) for i in range(n))
    assert len(claim(1)) == 1
    assert counted(channel) == n - 1 and deltas(channel) == []


@pytest.mark.usefixtures("by_count")
def test_an_enqueue_to_a_channel_that_counts_ready_messages_does_not_wake_the_claim() -> None:
    backlogged("alice")
    enqueue(f.NOOP, 1, channel="alice")  # one message
    enqueue_many([EnqueueRequest(f.NOOP, (i,), channel="alice") for i in range(2)])  # a batch
    enqueue_many([EnqueueRequest(f.NOOP, (1,), channel=c) for c in ("alice", "bob")])  # mixed
    enqueue(f.NOOP, 1, channel="alice", run_after=timedelta(hours=1))  # scheduled: wakes
    assert deltas("alice") == [(1, False, False), (2, False, False), (1, False, False),
                               (0, True, False)]  # fmt: skip
    assert deltas("bob") == [(1, True, False)]  # counts nothing yet: wakes
    # the claim's fold leaves the quiet ones to the maintenance loop, which folds every kind
    assert len(claim(1)) == 1
    assert counted("alice") == 1 and [d[1] for d in deltas("alice")] == [False] * 3
    channel_store.fold_channel_deltas()
    assert deltas("alice") == [] and counted("alice") == 5


def test_a_claim_that_takes_all_a_channel_counts_takes_its_quiet_messages_too() -> None:
    backlogged("alice")
    for i in range(3):
        enqueue(f.NOOP, i, channel="alice")
    assert counted("alice") == 2
    # Counted 2, ready 5: one claim takes them all, and leaves no marker (nothing is left).
    assert len(claim(10)) == 5
    assert counted("alice") == 0 and deltas("alice") == []
    enqueue(f.NOOP, 0, channel="alice")
    assert deltas("alice") == [(1, True, False)]  # counts none: wakes again


def test_a_short_claim_leaves_the_rest_counted() -> None:
    backlogged("alice")
    for i in range(3):
        enqueue(f.NOOP, i, channel="alice")
    assert len(claim(3)) == 3  # its share was all two counted: the quiet three counted first
    assert counted("alice") == 2 and deltas("alice") == []
    assert len(claim(10)) == 2


def enqueue_held_open(channel: str) -> tuple[threading.Thread, threading.Event, list[int]]:
    """An enqueue on another connection whose transaction stays open until the event is set."""
    enqueued, commit, ids = threading.Event(), threading.Event(), []

    def run() -> None:
        try:
            with transaction.atomic():
                ids.append(enqueue(f.NOOP, "late", channel=channel))
                enqueued.set()
                assert commit.wait(30)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    assert enqueued.wait(30)
    return thread, commit, ids


MARKER = (0, False, True)


def markers() -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM fairqueue_channel_delta WHERE drained")
        return cur.fetchone()[0]


def ready_ids(channel: str) -> list[int]:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT m.id FROM fairqueue_message m JOIN fairqueue_channel c ON c.id = m.channel_id"
            " WHERE c.name = %s AND m.state = 'ready' ORDER BY m.id",
            [channel],
        )
        return [r[0] for r in cur.fetchall()]


def test_an_enqueue_in_flight_while_a_claim_drains_its_channel_is_not_left_behind() -> None:
    """The race the marker closes: the enqueue found the channel counting messages (its delta
    is quiet), a claim took all it counted before the enqueue committed. No maintenance runs
    here: only the claims fold."""
    backlogged("alice")
    thread, commit, (late,) = enqueue_held_open("alice")
    try:
        assert len(claim(10)) == 2  # the late message is not committed
        assert deltas("alice") == [MARKER]  # (the quiet delta is not committed either)
        # while the enqueue is still open, a claim's fold keeps the marker for a later claim
        assert claim(10) == [] and deltas("alice") == [MARKER]
    finally:
        commit.set()
        thread.join(30)
    assert deltas("alice") == [(1, False, False), MARKER]  # (its id is the older)
    (got,) = claim(10)
    assert got.id == late
    assert deltas("alice") == [] and counted("alice") == 0


def test_a_claim_in_a_callers_transaction_leaves_a_marker_for_the_next_claim() -> None:
    """Exactly-once: the claim counts the quiet messages committed, but cannot hold channel
    names to the end of the caller's transaction, so draining a channel leaves a marker."""
    backlogged("alice")
    for i in range(2):
        enqueue(f.NOOP, i, channel="alice")
    with transaction.atomic():
        assert len(claim(10)) == 4
    assert deltas("alice") == [MARKER]
    assert claim(10) == [] and deltas("alice") == []  # its fold took the marker


def test_the_maintenance_fold_counts_quiet_deltas_and_takes_markers() -> None:
    backlogged("alice")
    thread, commit, _ = enqueue_held_open("alice")
    try:
        assert len(claim(10)) == 2
    finally:
        commit.set()
        thread.join(30)
    assert DeltaFolder().run_once() == 2  # the maintenance loop: the quiet delta, the marker
    assert deltas("alice") == [] and counted("alice") == 1
    assert len(claim(10)) == 1


def test_a_recount_to_zero_leaves_a_marker() -> None:
    """The counter repair counts the rows it sees: an enqueue in flight that found the old
    count wrote a quiet delta, which a count of zero must not leave behind."""
    backlogged("alice")
    thread, commit, _ = enqueue_held_open("alice")
    try:
        message_store.cancel_messages(ready_ids("alice"))
        integrity_store.repair_channel_counters([f.channel_ids(["alice"])["alice"]])
        assert counted("alice") == 0 and deltas("alice") == [MARKER]
    finally:
        commit.set()
        thread.join(30)
    assert len(claim(10)) == 1 and deltas("alice") == []


def test_a_fold_of_removals_that_empties_the_count_leaves_no_quiet_message_behind() -> None:
    backlogged("alice")  # counts 2
    counted_ids = ready_ids("alice")
    quiet = enqueue(f.NOOP, 9, channel="alice")
    assert deltas("alice") == [(1, False, False)]
    assert message_store.cancel_messages(counted_ids) == counted_ids
    # The claim's fold takes the count to zero, leaves a marker and takes it up at once.
    assert [m.id for m in claim(10)] == [quiet]
    assert deltas("alice") == [] and counted("alice") == 0


def test_cancelling_everything_leaves_the_count_at_zero_not_below() -> None:
    backlogged("alice")  # counts 2
    for i in range(2):
        enqueue(f.NOOP, i, channel="alice")  # quiet
    assert len(message_store.cancel_messages(ready_ids("alice"))) == 4
    assert claim(10) == []
    assert counted("alice") == 0 and deltas("alice") == []
    enqueue(f.NOOP, 3, channel="alice")  # counts none: wakes
    assert len(claim(10)) == 1


def test_an_enqueue_above_read_committed_wakes() -> None:
    """Its snapshot may be older than its name lock, and read a count a claim has taken."""
    backlogged("alice")
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        enqueue(f.NOOP, 1, channel="alice")
        enqueue_many([EnqueueRequest(f.NOOP, (2,), channel="alice")])
    assert deltas("alice") == [(1, True, False), (1, True, False)]


SQL_CLAIM = "SELECT count(*) FROM fairqueue_claim_v1(%s, '5 min', 'w', NULL, NULL, NULL, true, 0)"


def test_claims_that_hold_no_names_leave_one_marker_a_channel_and_keep_folding() -> None:
    """A claim that is not its own transaction (here from SQL without CLAIM_WAIT nor
    asynchronous commits) leaves a marker each time it drains a channel: one per channel, and
    the next claim takes them up, so waking deltas of other channels are still folded."""
    with connection.cursor() as cur:
        for i in range(40):
            enqueue(f.NOOP, i, channel=f"t{i % 4}")
            cur.execute(SQL_CLAIM, [10])
            assert cur.fetchone() == (1,)
            assert markers() <= 4
        enqueue(f.NOOP, 0, channel="fresh")
        cur.execute(SQL_CLAIM, [10])
        assert cur.fetchone() == (1,)  # (it leaves a marker of its own)
        cur.execute(SQL_CLAIM, [10])
        assert cur.fetchone() == (0,)
    assert markers() == 0


@override_settings(FAIRQUEUE={"CLAIM_WAIT": 0, "ASYNC_COMMIT": False})
def test_without_claim_wait_nor_asynchronous_commits_nothing_is_left_behind() -> None:
    backlogged("alice")
    for i in range(3):
        enqueue(f.NOOP, i, channel="alice")
    assert len(claim(10)) == 5
    assert deltas("alice") == [MARKER]  # (no names held: a marker, though none was needed)
    thread, commit, (late,) = enqueue_held_open("alice")
    commit.set()
    thread.join(30)
    assert [m.id for m in claim(10)] == [late]


def test_a_claim_waiting_for_a_held_channel_holds_no_name() -> None:
    """A transaction holds channel B (its own claim, exactly-once) and then enqueues to A,
    whose marker a claim's fold takes up just before it queues for B (CLAIM_WAIT): the fold
    let go of A's name at once, so neither waits for the other."""
    enqueue(f.NOOP, 0, channel="A")
    with connection.cursor() as cur:
        cur.execute(SQL_CLAIM, [10])  # drains A without holding its name: a marker
        assert cur.fetchone() == (1,)
    assert deltas("A") == [MARKER]
    enqueue_many(EnqueueRequest(f.NOOP, (i,), channel="B") for i in range(2))
    channel_store.fold_deltas_of_channel(f.channel_ids(["B"])["B"])  # (A's marker stays)
    assert deltas("A") == [MARKER]
    held, go, out = threading.Event(), threading.Event(), {}

    def holder() -> None:
        try:
            with transaction.atomic():
                # B's row, held to the commit (without housekeeping, as exactly-once claims)
                got = message_store.claim_messages(1, lease=LEASE, worker_id="t", maintain=False)
                assert len(got) == 1
                held.set()
                assert go.wait(30)
                out["enqueued"] = enqueue(f.NOOP, "followup", channel="A")
        finally:
            connection.close()

    def waiter() -> None:
        try:
            with connection.cursor() as cur:
                cur.execute(
                    "SELECT count(*) FROM fairqueue_claim_v1(10, '5 min', 'c', NULL, NULL, NULL,"
                    " true, 1500)"
                )
                out["claimed"] = cur.fetchone()[0]
        finally:
            connection.close()

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(30)
    c = threading.Thread(target=waiter)
    c.start()
    time.sleep(0.2)  # the claim has folded A's marker and queues for B
    go.set()
    t.join(30)
    c.join(30)
    assert "enqueued" in out and out["claimed"] >= 1


@pytest.mark.usefixtures("by_count")
def test_a_claim_of_the_grouped_walk_takes_the_quiet_messages_too() -> None:
    """With a group claimable in the queue, the grouped walk's claim gives an ungrouped
    channel it drains what it counts besides."""
    backlogged("alice")  # counts 2
    for i in range(3):
        enqueue(f.NOOP, i, channel="alice")  # quiet
    ChannelGroup.objects.create(name="acme")
    enqueue(f.NOOP, 1, channel=("acme", "user"))
    assert sorted(m.channel for m in claim(10)) == ["acme/user"] + ["alice"] * 5
    assert deltas("alice") == []


def test_an_enqueue_to_a_grouped_channel_wakes_whatever_it_counts() -> None:
    """A claim of a group's channels does not count quiet deltas before it drains one, so
    they would make its claims short: a grouped channel's enqueues always wake."""
    ChannelGroup.objects.create(name="acme")
    for i in range(3):
        enqueue(f.NOOP, i, channel=("acme", "user"))
    assert len(claim(1)) == 1
    assert counted("acme/user") == 2
    enqueue(f.NOOP, 1, channel=("acme", "user"))
    enqueue_many([EnqueueRequest(f.NOOP, (1,), channel=("acme", "user"))])
    assert deltas("acme/user") == [(1, True, False), (1, True, False)]
    assert len(claim(10)) == 4


def test_a_name_held_elsewhere_keeps_the_marker_not_the_committed_messages() -> None:
    """A claim in a caller's transaction drains alice; an enqueue that read the count before
    commits a quiet delta; an unrelated transaction that enqueued to alice is still open. The
    marker stays (the open enqueue may write another), but the committed message is counted
    and claimed at once."""
    backlogged("alice")
    thread, commit, (late,) = enqueue_held_open("alice")
    try:
        quiet: list[int] = []
        with transaction.atomic():
            assert len(claim(10)) == 2  # drains alice: a marker

            def reads_the_old_count() -> None:
                try:
                    quiet.append(enqueue(f.NOOP, "e2", channel="alice"))
                finally:
                    connection.close()

            t = threading.Thread(target=reads_the_old_count)
            t.start()
            t.join(30)
        assert deltas("alice") == [MARKER, (1, False, False)]
        assert [m.id for m in claim(10)] == quiet
        assert deltas("alice") == [MARKER]
    finally:
        commit.set()
        thread.join(30)
    assert [m.id for m in claim(10)] == [late]


def test_a_claim_holds_at_most_128_names() -> None:
    """PostgreSQL's lock table is shared by every session: a claim draining hundreds of
    channels takes the names of 128 of them, and marks the others."""
    names = [f"c{i:03d}" for i in range(200)]
    enqueue_many(EnqueueRequest(f.NOOP, (1,), channel=n) for n in names)
    ids = list(f.channel_ids(names).values())
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SELECT cardinality(fairqueue_free_names_v1(%s::bigint[], true))", [ids])
        assert cur.fetchone() == (128,)
        cur.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
            " AND mode = 'ExclusiveLock'"
        )
        assert cur.fetchone() == (128,)


def test_a_marker_whose_name_is_held_locks_nothing() -> None:
    """While an enqueue holds a marked channel's name and nothing quiet is committed, the
    claims' housekeeping leaves the channel's row alone: its claimers are not kept out."""
    for i in range(3):
        enqueue(f.NOOP, i, channel="X")
    channel_store.fold_channel_deltas()
    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO fairqueue_channel_delta (channel_id, wake, drained)"
            " VALUES (%s, false, true)",
            [f.channel_ids(["X"])["X"]],
        )
    thread, commit, _ = enqueue_held_open("X")
    try:
        with transaction.atomic():
            # another queue's claim, its transaction still open
            got = message_store.claim_messages(
                10, lease=LEASE, worker_id="elsewhere", queues=["elsewhere"]
            )
            assert got == []

            def claims_x() -> None:
                try:
                    assert len(claim(10)) == 3
                finally:
                    connection.close()

            t = threading.Thread(target=claims_x)
            t.start()
            t.join(30)
            assert not t.is_alive()
        assert ready_ids("X") == []
    finally:
        commit.set()
        thread.join(30)


def test_the_shares_are_made_from_what_waits() -> None:
    """B counts one message and has 99 quiet ones, A counts a hundred: the claim counts B's
    quiet ones before it shares itself out, by weight (1 and 3)."""
    enqueue(f.NOOP, 0, channel="B")
    Channel.objects.filter(name="B").update(weight=3)
    channel_store.fold_channel_deltas()
    enqueue_many(EnqueueRequest(f.NOOP, (i,), channel="A") for i in range(100))
    enqueue_many(EnqueueRequest(f.NOOP, (i,), channel="B") for i in range(99))
    assert deltas("A") == [(100, True, False)] and deltas("B") == [(99, False, False)]
    got = [m.channel for m in claim(40)]
    assert (got.count("A"), got.count("B")) == (10, 30)


def test_a_group_that_takes_channels_in_counts_their_quiet_messages() -> None:
    """A group's claims do not count quiet deltas before they drain a channel: the group's
    creation, which takes in the channels its name declares, counts them."""
    backlogged("acme/user")  # ungrouped, counts 2
    enqueue(f.NOOP, 9, channel="acme/user")  # quiet
    assert deltas("acme/user") == [(1, False, False)]
    ChannelGroup.objects.create(name="acme")
    assert deltas("acme/user") == [] and counted("acme/user") == 3
    assert len(claim(10)) == 3


#: fairqueue_free_names_v1 as it is, slowed (a session setting) where a drained fold calls it,
#: so a test can act between its reading of the names and its locking of their channels.
SLOW_NAMES = """
ALTER FUNCTION fairqueue_free_names_v1(bigint[], boolean) RENAME TO fq_free_names_as_it_is;
CREATE FUNCTION fairqueue_free_names_v1(p_ids bigint[], p_hold boolean) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE r bigint[];
BEGIN
    r := fq_free_names_as_it_is(p_ids, p_hold);
    IF NOT p_hold AND current_setting('fq.pause', true) = 'on' THEN
        PERFORM pg_sleep(1.5);
    END IF;
    RETURN r;
END $$;
"""
AS_IT_IS = """
DROP FUNCTION fairqueue_free_names_v1(bigint[], boolean);
ALTER FUNCTION fq_free_names_as_it_is(bigint[], boolean) RENAME TO fairqueue_free_names_v1;
"""


def test_a_marker_a_later_drain_takes_over_is_kept() -> None:
    """A drained fold reads a channel's name free; before it locks the channel, an enqueue
    takes the name and a claim drains the channel, whose marker (one a channel) is the one
    the fold is about to take up. It looks at the name again under the lock, and keeps it."""
    enqueue(f.NOOP, 0, channel="X")
    assert len(claim(10)) == 1
    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO fairqueue_channel_delta (channel_id, wake, drained)"
            " VALUES (%s, false, true)",
            [f.channel_ids(["X"])["X"]],
        )
        cur.execute(SLOW_NAMES)
    try:

        def drained_fold() -> None:
            try:
                with connection.cursor() as cur:
                    cur.execute("SET fq.pause = 'on'")
                    cur.execute("SELECT fairqueue_fold_deltas_v1(128, true, false, true)")
            finally:
                connection.close()

        t = threading.Thread(target=drained_fold)
        t.start()
        time.sleep(0.5)  # it read X's name free and sleeps before locking X
        enqueue(f.NOOP, "e1", channel="X")  # counts 0: wakes
        channel_store.fold_deltas_of_channel(f.channel_ids(["X"])["X"])  # counts 1, marker stays
        thread, commit, (late,) = enqueue_held_open("X")  # reads 1: quiet, in flight
        assert len(claim(10)) == 1  # drains X, name held: its marker is the one there
        t.join(30)
        commit.set()
        thread.join(30)
    finally:
        with connection.cursor() as cur:
            cur.execute(AS_IT_IS)
    assert [m.id for m in claim(10)] == [late]

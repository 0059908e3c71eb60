"""A worker plans each statement of the enqueue, the claims and the completion once, from the
statistics of that moment, and keeps the plan until the table's next ANALYZE. A plan made while
a table was small (a fresh deployment; the delta table just after a fold, as autovacuum often
finds it) must not scan it sequentially once it holds thousands of rows: the claim's probe for
waking deltas read every pending completion's delta on every claim, the completion read the
whole channel table once per channel it settled, and the enqueue read it on every call. Nor may
a plan read one table once per row of another: an idle worker's question of when to claim again
read the delta table once per channel, and the admin's reads of channels and groups the delta
or message table once per channel. Nor may the statements that settle or act on claimed
messages (heartbeat, release, fail, retry, abort, rescue, cancel, delete): prepared from the
empty tables, each scanned the whole message table.

Its own module: the test needs a session whose plans were made while the queue tables were
small, and it empties them (``transactional_db``), which ``test_explain.py``'s shared backlog
must not see.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

import pytest
from django.db import connection

from django_fairqueue import batches
from django_fairqueue.api import EnqueueRequest, enqueue, enqueue_many
from django_fairqueue.db import channel_store, message_store, worker_store
from django_fairqueue.models import Channel, ChannelDelta, ChannelGroup, Message
from tests import factories as f
from tests.test_explain import assert_small_and_indexed, start_auto_explain, touched

LEASE = timedelta(minutes=5)
QUEUE_TABLES = {"fairqueue_message", "fairqueue_channel", "fairqueue_channel_delta"}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("fairness", ["count", "time"])
def test_plans_made_while_the_tables_were_small_still_read_by_index_once_they_grow(
    fairness: str,
) -> None:
    connection.close()  # a session of its own: no plan made by an earlier test
    try:
        grown(fairness)
    finally:
        connection.close()  # nor its session settings (auto_explain) for a later one


def grown(fairness: str) -> None:
    auto_explain = start_auto_explain()
    with connection.cursor() as cur:
        # Empty tables of no pages, as a fresh deployment's (and the delta table's whenever
        # autovacuum finds it just folded), and every statement planned once, generically, on
        # first use: the plan cache's worst choice, which it may make at any later use.
        cur.execute("VACUUM ANALYZE fairqueue_message, fairqueue_channel, fairqueue_channel_delta")
        cur.execute("SET plan_cache_mode = force_generic_plan")
    # A worker polls before anything is enqueued.
    assert message_store.claim_messages(1, lease=LEASE, worker_id="small", fairness=fairness) == []
    assert batches.claim(worker_id="small") is None
    message_store.select_next_due(timedelta(seconds=5), rescuing=True)
    operator_reads()
    # A first enqueue, claim and completion while the deployment is new: one channel, one
    # page of deltas. These make the session's plans.
    for i in range(6):  # past PL/pgSQL's switch to a generic plan, where it makes one
        f.enqueue("first", 1)  # a batch
        enqueue(f.NOOP, i, channel="first")  # one message
    for _ in range(6):
        first = message_store.claim_messages(1, lease=LEASE, worker_id="small", fairness=fairness)
        message_store.complete_messages([(m.id, m.lease_token, None) for m in first])
        assert batches.claim(worker_id="small") is None  # no work batch: every probe runs
    f.enqueue(("tenant", "doc-0"), 1)
    for _ in range(6):
        operator_reads()
    f.enqueue("first", 12)
    settle_every_way("small", fairness)
    auto_explain.take()

    # The deployment grows, with no ANALYZE in between: 2,000 channels, and 5,000 completions
    # of uncapped channels waiting for the maintenance fold (not waking).
    channel_ids = f.bulk_load_ready(2_000, 2)
    add_pending_completions(channel_ids[i % 100] for i in range(5_000))

    auto_explain.take()
    f.enqueue_spread({f"woken-{i}": 1 for i in range(4)})  # new channels: waking deltas
    f.enqueue_spread({f"bulk-{i:05d}": 1 for i in range(0, 2_000, 20)})  # channels that exist
    enqueue(f.NOOP, 0, channel="bulk-01999")
    claimed = message_store.claim_messages(100, lease=LEASE, worker_id="grown", fairness=fairness)
    message_store.complete_messages([(m.id, m.lease_token, None) for m in claimed])
    assert batches.claim(worker_id="grown") is None
    settle_every_way("grown", fairness)
    plans = auto_explain.take()

    assert len(claimed) == 100
    assert_small_and_indexed(plans, budget=300, tables=QUEUE_TABLES)
    deltas_read = max(
        touched(node)
        for plan in plans
        for node in plan.nodes()
        if node.get("Relation Name") == "fairqueue_channel_delta"
    )
    # the 104 waking deltas the claim folds, never the 5,000 left for maintenance
    assert deltas_read <= 150, "\n".join(p.describe() for p in plans)

    # When its next claim is due, an idle worker asks; an operator reads the channels and the
    # groups (a group of 300 channels now, each with a completion to fold). These read every
    # channel, or every pending delta, by design, but none reads a table once per row of
    # another: plans kept from the empty tables read the delta table once per channel (10
    # million rows), a group's channels once per channel of the group, the message table
    # once per backlogged channel.
    message_store.select_next_due(timedelta(seconds=5), rescuing=True)
    enqueue_many(EnqueueRequest(f.NOOP, (), channel=("tenant", f"doc-{i}")) for i in range(300))
    ChannelGroup.objects.filter(name="tenant").update(max_concurrency=1_000)  # its slots count
    add_pending_completions(
        Channel.objects.filter(group__isnull=False).values_list("id", flat=True)
    )
    message_store.select_next_due(timedelta(seconds=5), rescuing=True)
    operator_reads()
    plans = auto_explain.take()
    rows = {
        "fairqueue_message": Message.objects.count(),
        "fairqueue_channel": Channel.objects.count(),
        "fairqueue_channel_delta": ChannelDelta.objects.count(),
    }
    assert rows["fairqueue_channel_delta"] > 5_000
    for plan in plans:
        # A statement may read a table in a few places, or look a row up per row of another
        # (a channel per pending delta): a few times the rows there are, never their product.
        read = sum(touched(n) for n in plan.nodes() if n.get("Relation Name") in rows)
        assert read <= 3 * sum(rows.values()), f"{read:.0f} rows read of {rows}\n{plan.describe()}"


def add_pending_completions(channel_ids: Iterable[int]) -> None:
    """A completion's delta per id, not waking, as the maintenance fold finds them. Written in
    SQL: the ORM's writes of deltas recount (and so fold) their channels."""
    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO fairqueue_channel_delta (channel_id, running, succeeded, wake)"
            " SELECT c, -1, 1, false FROM unnest(%s::bigint[]) AS c",
            [list(channel_ids)],
        )


def settle_every_way(worker: str, fairness: str) -> None:
    """Claim 10 messages and end or extend their attempts every way a worker, maintenance or
    an operator does: each of these statements is planned once too."""
    got = message_store.claim_messages(10, lease=LEASE, worker_id=worker, fairness=fairness)
    assert len(got) == 10
    leases = [(m.id, m.lease_token) for m in got]
    assert message_store.heartbeat_messages(leases, lease=LEASE).keys() == {m.id for m in got}
    released, delayed, retried, dead, aborted, expired, *rest = got
    message_store.release_messages([(released.id, released.lease_token)])
    message_store.release_messages(
        [(delayed.id, delayed.lease_token)], delays=[timedelta(minutes=1)]
    )
    message_store.fail_messages(
        [(retried.id, retried.lease_token, {"error": "x"}, timedelta(minutes=1))]
    )
    assert message_store.fail_messages([(dead.id, dead.lease_token, {"error": "x"}, None)]) == {
        dead.id: "failed"
    }
    assert message_store.retry_failed_messages([dead.id]) == [dead.id]
    assert message_store.abort_messages([aborted.id]) == {aborted.id: "abort_requested"}
    message_store.settle_aborted_messages([(aborted.id, aborted.lease_token, {"error": "x"})])
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE fairqueue_message SET lease_expires_at = now() - interval '1 second'"
            " WHERE id = %s",
            [expired.id],
        )
    assert [r.id for r in message_store.rescue_expired_messages()] == [expired.id]
    assert worker_store.expire_worker_leases(worker) == len(rest)  # a worker found dead
    assert sorted(r.id for r in message_store.rescue_expired_messages()) == [m.id for m in rest]
    waiting = [released.id, retried.id, dead.id, expired.id]
    assert sorted(message_store.cancel_messages(waiting[:2])) == sorted(waiting[:2])
    assert sorted(message_store.delete_messages(waiting[2:])) == sorted(waiting[2:])


def operator_reads() -> None:
    """What the admin's lists and `fairqueue status` read of the channels and groups."""
    ids = list(Channel.objects.order_by("id").values_list("id", flat=True)[:100])
    grouped = Channel.objects.filter(group__isnull=False).values_list("id", flat=True)[:1]
    channel_store.select_channel_counters(ids)
    channel_store.select_group_state()
    channel_store.select_all_channel_counts()
    channel_store.select_backlogged_oldest_ready()
    for channel_id in [*ids[:1], *grouped]:
        channel_store.select_channel_wait_state(channel_id)

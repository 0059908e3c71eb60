"""A worker plans each statement of the enqueue, the claims and the completion once, from the
statistics of that moment, and keeps the plan until the table's next ANALYZE. A plan made while
a table was small (a fresh deployment; the delta table just after a fold, as autovacuum often
finds it) must not scan it sequentially once it holds thousands of rows: the claim's probe for
waking deltas read every pending completion's delta on every claim, the completion read the
whole channel table once per channel it settled, and the enqueue read it on every call; an idle
worker's question of when to claim again read the delta table once per channel.

Its own module: the test needs a session whose plans were made while the queue tables were
small, and it empties them (``transactional_db``), which ``test_explain.py``'s shared backlog
must not see.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection

from django_fairqueue import batches
from django_fairqueue.api import enqueue
from django_fairqueue.db import message_store
from django_fairqueue.models import Channel, ChannelDelta, Message
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
    # A first enqueue, claim and completion while the deployment is new: one channel, one
    # page of deltas. These make the session's plans.
    for i in range(6):  # past PL/pgSQL's switch to a generic plan, where it makes one
        f.enqueue("first", 1)  # a batch
        enqueue(f.NOOP, i, channel="first")  # one message
    for _ in range(6):
        first = message_store.claim_messages(1, lease=LEASE, worker_id="small", fairness=fairness)
        message_store.complete_messages([(m.id, m.lease_token, None) for m in first])
        assert batches.claim(worker_id="small") is None  # no work batch: every probe runs
    auto_explain.take()

    # The deployment grows, with no ANALYZE in between: 2,000 channels, and 5,000 completions
    # of uncapped channels waiting for the maintenance fold (not waking).
    channel_ids = f.bulk_load_ready(2_000, 2)
    ChannelDelta.objects.bulk_create(
        ChannelDelta(channel_id=channel_ids[i % 100], succeeded=1, wake=False) for i in range(5_000)
    )

    auto_explain.take()
    f.enqueue_spread({f"woken-{i}": 1 for i in range(4)})  # new channels: waking deltas
    f.enqueue_spread({f"bulk-{i:05d}": 1 for i in range(0, 2_000, 20)})  # channels that exist
    enqueue(f.NOOP, 0, channel="bulk-01999")
    claimed = message_store.claim_messages(100, lease=LEASE, worker_id="grown", fairness=fairness)
    message_store.complete_messages([(m.id, m.lease_token, None) for m in claimed])
    assert batches.claim(worker_id="grown") is None
    plans = auto_explain.take()
    message_store.select_next_due(timedelta(seconds=5), rescuing=True)
    next_due = auto_explain.take()

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

    # When its next claim is due, an idle worker asks, reading every channel with ready
    # messages by design, but each table at most once: a plan kept from the empty tables read
    # the delta table once per channel (10 million rows).
    sizes = {
        "fairqueue_message": Message.objects.count(),
        "fairqueue_channel": Channel.objects.count(),
        "fairqueue_channel_delta": ChannelDelta.objects.count(),
    }
    for table, size in sizes.items():
        read = sum(
            touched(node)
            for plan in next_due
            for node in plan.nodes()
            if node.get("Relation Name") == table
        )
        assert read <= size, f"{table}: {read:.0f} rows read of {size}\n" + "\n".join(
            p.describe() for p in next_due
        )

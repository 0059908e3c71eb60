"""The queue on Django's psycopg connection pool (``DATABASES[...]["OPTIONS"]["pool"]``).

django_fairqueue.db runs statements on the raw psycopg connection Django hands out; with a pool that
is a pooled connection, returned to the pool when Django closes it. Every statement kind must work
there, and a connection must come back to the pool clean (not idle in a transaction).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import connections
from django.test import override_settings

from django_fairqueue import EnqueueRequest, enqueue_many
from django_fairqueue.db import channel_store, message_store
from django_fairqueue.tasks import task

pytest.importorskip("psycopg_pool", reason="needs psycopg-pool (the dev extra installs it)")

TASK = "tests.pool.noop"
ALIAS = "pooled"


@task(name=TASK)
def noop(n: int) -> None:
    """Never run: the test claims and settles by hand."""


@pytest.fixture
def pooled() -> Iterator[str]:
    """Route the queue through the "pooled" alias (tests/settings.py: a pool on the test DB)."""
    try:
        with override_settings(
            FAIRQUEUE={"DATABASE": ALIAS}, DATABASE_ROUTERS=["django_fairqueue.routers.QueueRouter"]
        ):
            yield ALIAS
    finally:
        connections[ALIAS].close()
        connections[ALIAS].close_pool()  # or its idle connections keep the test DB in use


@pytest.mark.django_db(transaction=True, databases=["default", ALIAS])
def test_enqueue_claim_settle_on_pooled_connections(pooled: str) -> None:
    wrapper = connections[pooled]
    ids = enqueue_many(EnqueueRequest(TASK, [i], channel=f"pool-{i % 2}") for i in range(6))
    assert wrapper.pool is not None  # the statements really went through the pool

    claimed = message_store.claim_messages(6, lease=timedelta(minutes=1), worker_id="pool")
    assert sorted(m.id for m in claimed) == ids
    leases = [(m.id, m.lease_token) for m in claimed]
    assert message_store.heartbeat_messages(leases, lease=timedelta(minutes=1)) == dict.fromkeys(
        ids, False
    )

    # Give the connection back between statements, as a worker does between passes: the next
    # statement gets a pooled connection again (maybe another one), prepared statements and all.
    wrapper.close()
    done = message_store.complete_messages([(i, token, None) for i, token in leases[:4]])
    wrapper.close()
    failed = message_store.fail_messages(
        [(i, token, {"type": "E", "message": "x"}, None) for i, token in leases[4:]]
    )
    assert done == set(ids[:4]) and set(failed) == set(ids[4:])

    channel_store.fold_channel_deltas()
    counters = channel_store.select_channel_counters(
        sorted(channel_store.select_channel_ids(["pool-0", "pool-1"]).values())
    )
    assert sum(c.succeeded for c in counters) == 4
    assert sum(c.failed for c in counters) == 2
    assert sum(c.running + c.ready for c in counters) == 0
    assert not wrapper.in_atomic_block
    assert wrapper.connection is None or wrapper.connection.info.transaction_status == 0  # idle

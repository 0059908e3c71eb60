"""Test data: factory_boy factories and helpers that keep the channel counters right.

Two ways to make messages, for two kinds of test:

* ``enqueue(...)`` / ``bulk_load_ready(...)`` go through ``fairqueue_enqueue_v1`` (or keep the
  counters right by hand), so the channel counters match the table. Use them whenever a claim
  runs: the claim trusts ``ready_count`` and ``running_count``.
* ``MessageFactory`` inserts rows directly, bypassing the counters. Its defaults follow the
  state (a running message has its claim time, lease token and lease expiry; a scheduled one a
  future ``run_at``; a finished one its ``finished_at``), so the rows satisfy the CHECK
  constraints. Use it only for read-side tests (listing, rescue, pruning) that do not check
  counters.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import factory
from django.db import connection
from django.db.models import Count
from django.utils import timezone
from factory.django import DjangoModelFactory

from django_fairqueue.api import EnqueueRequest, enqueue_many
from django_fairqueue.db import channel_store
from django_fairqueue.models import Channel, Message, MessageState
from django_fairqueue.tasks import task

NOOP = "tests.noop"


@task(name=NOOP)
def noop(*args: Any, **kwargs: Any) -> None:
    """The task every queue test enqueues; the tests here never run it."""


# ------------------------------------------------------------------------------------------------
# Factories (read-side tests only: they bypass the counters)

_CLAIMED = {MessageState.RUNNING}
_FINISHED = {MessageState.SUCCEEDED, MessageState.FAILED, MessageState.CANCELLED}
_ATTEMPTED = {MessageState.RUNNING, MessageState.SUCCEEDED, MessageState.FAILED}


class ChannelFactory(DjangoModelFactory):
    class Meta:
        model = Channel
        django_get_or_create = ("name",)

    name = factory.Sequence(lambda n: f"tenant-{n:04d}")
    weight = 1


class MessageFactory(DjangoModelFactory):
    """A message row whose fields agree with its ``state`` (default ``ready``)."""

    class Meta:
        model = Message

    channel = factory.SubFactory(ChannelFactory)
    task_name = NOOP
    payload = factory.LazyFunction(lambda: {"args": [], "kwargs": {}})
    state = MessageState.READY
    enqueued_at = factory.LazyFunction(timezone.now)
    run_at = factory.LazyAttribute(
        lambda o: (
            o.enqueued_at + timedelta(hours=1)
            if o.state == MessageState.SCHEDULED
            else o.enqueued_at
        )
    )
    attempts = factory.LazyAttribute(lambda o: 1 if o.state in _ATTEMPTED else 0)
    max_attempts = 5
    claimed_at = factory.LazyAttribute(lambda o: o.enqueued_at if o.state in _ATTEMPTED else None)
    lease_token = factory.LazyAttribute(lambda o: uuid.uuid4() if o.state in _CLAIMED else None)
    lease_expires_at = factory.LazyAttribute(
        lambda o: o.claimed_at + timedelta(minutes=1) if o.state in _CLAIMED else None
    )
    worker_id = factory.LazyAttribute(lambda o: "factory-worker" if o.claimed_at else "")
    finished_at = factory.LazyAttribute(
        lambda o: o.enqueued_at + timedelta(seconds=1) if o.state in _FINISHED else None
    )
    last_error = factory.LazyAttribute(
        lambda o: (
            {"type": "RuntimeError", "message": "boom", "traceback": None}
            if o.state == MessageState.FAILED
            else None
        )
    )


# ------------------------------------------------------------------------------------------------
# Counter-keeping helpers (for claim tests)


def enqueue(
    channel: str,
    n: int = 1,
    *,
    priority: int | None = None,
    run_after: timedelta | None = None,
) -> list[int]:
    """Enqueue ``n`` no-op messages to ``channel`` in one round trip; returns their ids."""
    return enqueue_many(
        EnqueueRequest(NOOP, (i,), channel=channel, priority=priority, run_after=run_after)
        for i in range(n)
    )


def enqueue_in_queue(queue: str, channel: Any, n: int = 1) -> list[int]:
    """Enqueue ``n`` no-op messages to ``channel`` (a name or a (group, channel) pair) of
    ``queue`` in one round trip; returns their ids."""
    return enqueue_many(EnqueueRequest(NOOP, (i,), channel=channel, queue=queue) for i in range(n))


def enqueue_spread(counts: dict[str, int]) -> list[int]:
    """One batch: ``counts[name]`` messages per channel (channels interleaved)."""
    requests = []
    left = dict(counts)
    while any(left.values()):
        for name in counts:
            if left[name]:
                left[name] -= 1
                requests.append(EnqueueRequest(NOOP, (left[name],), channel=name))
    return enqueue_many(requests)


def channel_ids(names: Iterable[str]) -> dict[str, int]:
    names = list(names)
    found = channel_store.select_channel_ids(names)
    assert set(found) == set(names), f"missing channels {set(names) - set(found)}"
    return found


def set_limits(names: Sequence[str], **limits: Any) -> None:
    """An operator's edit of channel limits (the admin does the same through the ORM)."""
    updated = Channel.objects.filter(name__in=names).update(**limits)
    assert updated == len(names)


def bulk_load_ready(n_channels: int, per_channel: int, *, prefix: str = "bulk") -> list[int]:
    """Insert ``n_channels * per_channel`` ready messages fast, counters kept right.

    Channels are created through ``enqueue_many`` (one message each, so they are real channels
    with the configured defaults); the rest is one INSERT ... SELECT generate_series plus one
    counter delta per channel, folded at the end. Returns the channel ids.
    """
    names = [f"{prefix}-{i:05d}" for i in range(n_channels)]
    enqueue_many(EnqueueRequest(NOOP, (), channel=name) for name in names)
    ids = sorted(channel_ids(names).values())
    extra = per_channel - 1
    if extra > 0:
        with connection.cursor() as cur:
            cur.execute(
                """
                WITH ins AS (
                    INSERT INTO fairqueue_message (
                        channel_id, task_name, payload, priority, state, run_at, enqueued_at,
                        attempts, max_attempts, keep_result, worker_id)
                    SELECT c.id, %s, '{"args": [], "kwargs": {}}'::jsonb, 0, 'ready',
                           now(), now(), 0, 5, false, ''
                    FROM unnest(%s::bigint[]) AS c(id), generate_series(1, %s) AS g(i)
                    ORDER BY g.i, c.id
                    RETURNING channel_id
                )
                INSERT INTO fairqueue_channel_delta (channel_id, ready, scheduled, running,
                                                     failed, succeeded, wake)
                SELECT channel_id, count(*), 0, 0, 0, 0, true FROM ins GROUP BY channel_id
                """,
                [NOOP, ids, extra],
            )
    fold_all()
    return ids


def fold_all() -> None:
    """Fold every pending counter delta (the maintenance loop's job)."""
    while channel_store.fold_channel_deltas() > 0:
        pass


def measured(seconds: float = 0.01) -> None:
    """Give every channel without one a measured run time (the default estimate's 10 ms).
    By time, a channel with none is slow-starting, one message at a time until its first
    settlement folds: for tests of something else that claim several from new channels."""
    with connection.cursor() as cur:
        cur.execute("UPDATE fairqueue_channel SET mean_run = %s WHERE mean_run IS NULL", [seconds])


def table_counts() -> dict[int, Counter[str]]:
    """Messages per channel and state, counted in the table."""
    counts: dict[int, Counter[str]] = {}
    for channel_id, state, n in (
        Message.objects.values_list("channel_id", "state").order_by().annotate(n=Count("id"))
    ):
        counts.setdefault(channel_id, Counter())[state] = n
    return counts


def channel_state(name: str) -> dict[str, Any]:
    """The scheduler's columns of a channel row (no model fields: read with SQL)."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT ready_count, scheduled_count, running_count, failed_count, succeeded_total, "
            "next_turn_at, turn_used, last_claimed_at, batch_pending, batch_turn_at "
            "FROM fairqueue_channel WHERE name = %s",
            [name],
        )
        row = cur.fetchone()
        assert row is not None, f"no channel {name!r}"
        names = [d.name for d in cur.description]
    return dict(zip(names, row, strict=True))


def assert_counters_match_table(*, fold: bool = True) -> None:
    """Every channel's counters (row + pending deltas, and the row alone after folding) equal
    the number of its messages per state in the table."""
    counts = table_counts()
    ids = list(Channel.objects.values_list("id", flat=True))
    exact = {c.id: c for c in channel_store.select_channel_counters(ids)}

    def expected(cid: int) -> tuple[int, int, int, int]:
        c = counts.get(cid, Counter())
        return (c["ready"], c["scheduled"], c["running"], c["failed"])

    for cid in ids:
        got = exact[cid]
        assert (got.ready, got.scheduled, got.running, got.failed) == expected(cid), (
            f"channel {got.name}: counters (ready, scheduled, running, failed) = "
            f"{(got.ready, got.scheduled, got.running, got.failed)}, table {expected(cid)}"
        )
    if fold:
        fold_all()
        with connection.cursor() as cur:
            cur.execute(
                "SELECT id, name, ready_count, scheduled_count, running_count, failed_count "
                "FROM fairqueue_channel"
            )
            rows = cur.fetchall()
        for cid, name, *row in rows:
            assert tuple(row) == expected(cid), (
                f"channel {name} after folding: row {tuple(row)}, table {expected(cid)}"
            )

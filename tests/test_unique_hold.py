"""Unique jobs of scope ``active`` hold their key while running through ``fairqueue_unique_hold``.

The unique index covers waiting messages only, so the claim writes nothing for a key; the hold
row, written at enqueue, keeps other messages out while the holder runs. These tests check the
cases only the hold row decides: a holder claimed between an enqueue's snapshot and its insert,
a message returning to the queue meanwhile, stale rows taken over, the scope given by a
replace, an operator's retry, the pruner, REPEATABLE READ, and ``fairqueue verify``.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction

from django_fairqueue import enqueue, enqueue_many, maintenance
from django_fairqueue.api import EnqueueRequest
from django_fairqueue.db import message_store
from django_fairqueue.models import Message, UniqueHold
from tests import fairtasks
from tests.factories import assert_counters_match_table

LEASE = timedelta(minutes=5)


def claim(limit: int = 100) -> list[message_store.ClaimedMessage]:
    return message_store.claim_messages(limit, lease=LEASE, worker_id="w")


def holding(channel: str, key: str) -> list[int]:
    """Ids of the messages holding a key by the documented rule (waiting, or running with
    scope 'active'), read from the table."""
    return list(
        Message.objects.filter(channel__name=channel, unique_key=key)
        .filter(state__in=("ready", "scheduled", "running"))
        .exclude(state="running", unique_scope="queued")
        .order_by("id")
        .values_list("id", flat=True)
    )


def hold_of(channel: str, key: str) -> int | None:
    row = UniqueHold.objects.filter(channel_id=channel_id(channel), unique_key=key).first()
    return None if row is None else row.message_id


def channel_id(name: str) -> int:
    return Message.objects.filter(channel__name=name).values_list("channel_id", flat=True)[0]


@pytest.mark.django_db
def test_the_unique_index_covers_waiting_messages_only() -> None:
    """The claim's ready -> running update leaves the index's predicate whatever the scope, so
    it writes no entry of it (a running row of scope 'active' used to get one)."""
    with connection.cursor() as cur:
        cur.execute("SELECT pg_get_indexdef('fq_message_unique_idx'::regclass)")
        (definition,) = cur.fetchone()
    assert "running" not in definition and "ready" in definition


@pytest.mark.django_db
def test_a_running_holder_of_scope_active_keeps_every_scope_out_until_it_ends() -> None:
    first = enqueue(fairtasks.add, 1, 1, channel="acme", unique_key="k", unique_scope="active")
    assert hold_of("acme", "k") == first
    (m,) = claim()
    for scope in ("queued", "active"):
        assert (
            enqueue(fairtasks.add, 2, 2, channel="acme", unique_key="k", unique_scope=scope)
            == first
        )
        got = enqueue_many(
            [
                EnqueueRequest(
                    fairtasks.add, (3, 3), channel="acme", unique_key="k", unique_scope=scope
                )
            ]
        )
        assert got == [first]
    assert holding("acme", "k") == [first]
    message_store.complete_messages([(m.id, m.lease_token, None)])
    # the stale row is taken over by the next message of scope 'active'
    second = enqueue(fairtasks.add, 4, 4, channel="acme", unique_key="k", unique_scope="active")
    assert second != first and hold_of("acme", "k") == second
    claim()
    assert enqueue(fairtasks.add, 5, 5, channel="acme", unique_key="k") == second
    assert holding("acme", "k") == [second]
    assert_counters_match_table()


@pytest.mark.django_db
def test_a_replace_that_gives_the_scope_active_takes_the_hold() -> None:
    first = enqueue(fairtasks.add, 1, 1, channel="acme", unique_key="k")
    assert UniqueHold.objects.count() == 0  # scope 'queued' writes no hold row
    again = enqueue(
        fairtasks.add,
        2,
        2,
        channel="acme",
        unique_key="k",
        unique_scope="active",
        on_conflict="replace",
    )
    assert again == first and hold_of("acme", "k") == first
    claim()
    assert enqueue(fairtasks.add, 3, 3, channel="acme", unique_key="k") == first
    assert holding("acme", "k") == [first]
    assert_counters_match_table()


@pytest.mark.django_db
def test_an_operators_retry_takes_the_hold_back() -> None:
    """A dead letter of scope 'active' retried after another message held (and released) its
    key: the retry makes the hold row name it again, so it keeps the key while it runs."""
    first = enqueue(fairtasks.add, 1, 1, channel="acme", unique_key="k", unique_scope="active")
    (m,) = claim()
    message_store.fail_messages([(m.id, m.lease_token, {"type": "E"}, None)])
    second = enqueue(fairtasks.add, 2, 2, channel="acme", unique_key="k", unique_scope="active")
    (m2,) = claim()
    message_store.complete_messages([(m2.id, m2.lease_token, None)])
    assert hold_of("acme", "k") == second
    assert message_store.retry_failed_messages([first]) == [first]
    assert hold_of("acme", "k") == first
    claim()
    assert enqueue(fairtasks.add, 3, 3, channel="acme", unique_key="k") == first
    assert holding("acme", "k") == [first]
    assert_counters_match_table()


@pytest.mark.django_db
def test_retries_releases_and_rescues_keep_the_hold() -> None:
    first = enqueue(fairtasks.add, 1, 1, channel="acme", unique_key="k", unique_scope="active")
    (m,) = claim()
    message_store.fail_messages([(m.id, m.lease_token, {"type": "E"}, timedelta(0))])  # retried
    assert holding("acme", "k") == [first] and hold_of("acme", "k") == first
    (m,) = claim()
    message_store.release_messages([(m.id, m.lease_token)])
    (m,) = claim()
    Message.objects.filter(pk=first).update(lease_expires_at="2000-01-01T00:00:00Z")
    assert [r.id for r in message_store.rescue_expired_messages()] == [first]
    claim()
    assert enqueue(fairtasks.add, 2, 2, channel="acme", unique_key="k") == first
    assert holding("acme", "k") == [first] and hold_of("acme", "k") == first
    assert_counters_match_table()


def _holder_claimed_in_flight(
    key: str, ready: threading.Event, release: threading.Event, out: dict[str, Any]
) -> None:
    """Enqueue a message of scope 'active' and claim it in one transaction, left open until
    ``release``: a concurrent insert of the key waits for this transaction, and when it ends
    the holder is already running (out of the unique index)."""
    try:
        with transaction.atomic():
            out["holder"] = enqueue(
                fairtasks.add, 0, 0, channel="acme", unique_key=key, unique_scope="active"
            )
            out["claimed"] = [m.id for m in claim()]
            ready.set()
            release.wait(10)
    finally:
        connections.close_all()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", ["enqueue", "enqueue_many"])
@pytest.mark.parametrize("scope", ["queued", "active"])
def test_an_enqueue_that_passes_the_index_as_the_holder_starts_is_kept_out(
    how: str, scope: str
) -> None:
    """The race a check before the insert would lose: the enqueue's snapshot does not see the
    holder, its insert waits for the holder's transaction, which commits the holder already
    running, so the insert passes the index. The check after the insert sees the holder: the
    enqueue gets its id (keep) and stores nothing."""
    enqueue(fairtasks.add, 9, 9, channel="acme")  # the channel exists and commits first
    (plain,) = claim()
    message_store.complete_messages([(plain.id, plain.lease_token, None)])
    ready, release, out = threading.Event(), threading.Event(), {}
    thread = threading.Thread(target=_holder_claimed_in_flight, args=("k", ready, release, out))
    thread.start()
    assert ready.wait(10)
    threading.Timer(0.3, release.set).start()
    if how == "enqueue":
        got = enqueue(fairtasks.add, 1, 1, channel="acme", unique_key="k", unique_scope=scope)
    else:
        got, _ = enqueue_many(
            [
                EnqueueRequest(
                    fairtasks.add, (1, 1), channel="acme", unique_key="k", unique_scope=scope
                ),
                EnqueueRequest(fairtasks.add, (2, 2), channel="acme"),
            ]
        )
    thread.join(10)
    assert out["claimed"] == [out["holder"]]
    assert got == out["holder"]
    assert holding("acme", "k") == [out["holder"]]
    assert hold_of("acme", "k") == out["holder"]
    assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", ["retry", "release", "operator"])
def test_a_message_returning_as_the_holder_starts_is_superseded(how: str) -> None:
    """The same race for a message going back to the queue: its write passes the index once
    the holder's transaction commits it running; the check after the write makes the
    statement run again, and its fresh snapshot supersedes the message."""
    returning = enqueue(fairtasks.add, 1, 1, channel="acme", unique_key="k")  # scope 'queued'
    (m,) = claim()
    if how == "operator":
        message_store.fail_messages([(m.id, m.lease_token, {"type": "E"}, None)])
    ready, release, out = threading.Event(), threading.Event(), {}
    thread = threading.Thread(target=_holder_claimed_in_flight, args=("k", ready, release, out))
    thread.start()
    assert ready.wait(10)
    threading.Timer(0.3, release.set).start()
    if how == "retry":
        message_store.fail_messages([(m.id, m.lease_token, {"type": "E"}, timedelta(0))])
        want = "cancelled"
    elif how == "release":
        message_store.release_messages([(m.id, m.lease_token)])
        want = "cancelled"
    else:
        assert message_store.retry_failed_messages([returning]) == []
        want = "failed"
    thread.join(10)
    assert Message.objects.get(pk=returning).state == want
    assert holding("acme", "k") == [out["holder"]]
    assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
def test_repeatable_read_fails_to_serialize_rather_than_hold_a_key_twice() -> None:
    """Under REPEATABLE READ the enqueue's snapshot predates a holder enqueued and started
    since: the check cannot trust it, so it locks the hold row, and a row written after the
    snapshot is a serialization failure (the caller retries), never a second holder."""
    enqueue(fairtasks.add, 9, 9, channel="acme")
    (plain,) = claim()
    message_store.complete_messages([(plain.id, plain.lease_token, None)])
    out: dict[str, Any] = {}

    def holder() -> None:
        try:
            out["holder"] = enqueue(
                fairtasks.add, 0, 0, channel="acme", unique_key="k", unique_scope="active"
            )
            out["claimed"] = [m.id for m in claim()]
        finally:
            connections.close_all()

    with pytest.raises(OperationalError, match="serialize"), transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cur.execute("SELECT count(*) FROM fairqueue_message")  # the snapshot
        thread = threading.Thread(target=holder)
        thread.start()
        thread.join(10)
        assert out["claimed"] == [out["holder"]]
        enqueue(fairtasks.add, 1, 1, channel="acme", unique_key="k")
    assert holding("acme", "k") == [out["holder"]]
    # at READ COMMITTED the same enqueue sees the holder
    assert enqueue(fairtasks.add, 1, 1, channel="acme", unique_key="k") == out["holder"]
    assert_counters_match_table()


@pytest.mark.django_db
def test_the_pruner_deletes_the_rows_of_messages_gone_or_finished_for_good() -> None:
    ids = {}
    for key, end in [("done", "complete"), ("dead", "fail"), ("gone", "delete"), ("live", None)]:
        ids[key] = enqueue(
            fairtasks.add, 1, 1, channel="acme", unique_key=key, unique_scope="active"
        )
        (m,) = claim(1)
        if end == "complete":
            message_store.complete_messages([(m.id, m.lease_token, None)])
        elif end == "fail":
            message_store.fail_messages([(m.id, m.lease_token, {"type": "E"}, None)])
        elif end == "delete":
            message_store.complete_messages([(m.id, m.lease_token, None)])
            Message.objects.filter(pk=m.id).delete()
    assert UniqueHold.objects.count() == 4
    maintenance.Pruner().run_once()
    # a dead letter may be retried and hold its key again: its row stays
    assert sorted(UniqueHold.objects.values_list("unique_key", flat=True)) == ["dead", "live"]
    assert hold_of("acme", "live") == ids["live"]


@pytest.mark.django_db
def test_verify_reports_and_repairs_a_running_holder_its_row_does_not_name() -> None:
    """Rows written by hand can leave a running holder of scope 'active' unnamed (it would not
    keep its key): verify reports the channel, and --repair writes the row."""
    first = enqueue(fairtasks.add, 1, 1, channel="acme", unique_key="k", unique_scope="active")
    claim()
    assert maintenance.verify(repair=False) == []
    UniqueHold.objects.all().delete()
    (drift,) = maintenance.verify(repair=False)
    assert (drift.channel, drift.counter, drift.recorded, drift.actual) == (
        "acme",
        "unique holds",
        0,
        1,
    )
    assert [d.counter for d in maintenance.verify(repair=True)] == ["unique holds"]
    assert maintenance.verify(repair=False) == []
    assert hold_of("acme", "k") == first
    assert enqueue(fairtasks.add, 2, 2, channel="acme", unique_key="k") == first

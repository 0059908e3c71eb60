"""Enqueue: channels created on first use, one statement per batch, overflow, validation.

Concurrent enqueuers (advisory locks, no deadlock) are in test_claim_concurrency.py.
"""

from __future__ import annotations

import math
import time
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from django.db import IntegrityError, connection, transaction
from django.test.utils import CaptureQueriesContext, override_settings
from django.utils import timezone

from django_fairqueue import ChannelFull, InvalidChannel, PayloadError, UnknownTask, conf
from django_fairqueue.api import (
    EnqueueRequest,
    abort,
    cancel,
    enqueue,
    enqueue_many,
    validate_channel_name,
)
from django_fairqueue.db import channel_store, message_store
from django_fairqueue.models import Channel, ChannelGroup, Message, MessageState
from django_fairqueue.tasks import task
from tests import factories as f

LEASE = timedelta(minutes=5)


def claim(limit: int) -> list[message_store.ClaimedMessage]:
    return message_store.claim_messages(limit, lease=LEASE, worker_id="test-worker")


def counters(name: str) -> channel_store.ChannelCounters:
    (found,) = channel_store.select_channel_counters([f.channel_ids([name])[name]])
    return found


# ------------------------------------------------------------------------------------------------
# Channels on first use


@pytest.mark.django_db
def test_first_enqueue_creates_the_channel_with_the_configured_defaults() -> None:
    defaults = {"max_concurrency": 3, "release_interval": 0.5, "weight": 2, "max_backlog": 100}
    with override_settings(FAIRQUEUE={"CHANNEL_DEFAULTS": defaults}):
        f.enqueue("alice", 2)

    alice = Channel.objects.get(name="alice")
    assert (alice.max_concurrency, alice.release_interval, alice.weight, alice.max_backlog) == (
        3,
        timedelta(milliseconds=500),
        2,
        100,
    )
    assert not alice.paused
    assert counters("alice").ready == 2

    # An existing channel keeps its own limits whatever the defaults say now.
    with override_settings(FAIRQUEUE={"CHANNEL_DEFAULTS": {"weight": 7}}):
        f.enqueue("alice", 1)
    assert Channel.objects.get(name="alice").weight == 2
    assert Channel.objects.filter(name="alice").count() == 1


@pytest.mark.django_db
def test_without_settings_a_channel_has_no_limits() -> None:
    f.enqueue("alice")

    alice = Channel.objects.get(name="alice")
    assert (alice.max_concurrency, alice.release_interval, alice.weight, alice.max_backlog) == (
        None,
        timedelta(0),
        1,
        None,
    )


@pytest.mark.django_db
def test_new_channels_of_a_batch_are_created_in_name_order() -> None:
    names = ["mike", "alpha", "zulu", "kilo", "bravo"]
    f.enqueue_spread(dict.fromkeys(names, 2))

    by_id = list(Channel.objects.order_by("id").values_list("name", flat=True))
    assert by_id == sorted(names)


@pytest.mark.django_db
def test_enqueue_many_is_one_statement_whatever_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    f.enqueue_spread({"old-bounded": 1, "old-free": 1})
    f.set_limits(["old-bounded"], max_backlog=10_000)
    connection.ensure_connection()
    executed: list[object] = []
    real_execute = psycopg.Cursor.execute

    def counting_execute(self: psycopg.Cursor[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        executed.append(query)
        return real_execute(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", counting_execute)
    names = ["old-bounded", "old-free", "new-1", "new-2", "new-3"]
    requests = [EnqueueRequest(f.NOOP, (i,), channel=names[i % 5]) for i in range(500)]

    with (
        override_settings(FAIRQUEUE={"CHANNEL_DEFAULTS": {"max_backlog": 1000}}),
        CaptureQueriesContext(connection) as orm_queries,
    ):
        ids = enqueue_many(requests)

    assert len(executed) == 1, executed
    assert len(orm_queries) == 0
    assert len(ids) == 500
    assert Channel.objects.filter(name__startswith="new-", max_backlog=1000).count() == 3


@pytest.mark.django_db
def test_ids_come_back_in_input_order_with_their_payloads() -> None:
    requests = [
        EnqueueRequest(f.NOOP, (i,), {"n": i}, channel=["b", "a", "c"][i % 3], priority=i % 4)
        for i in range(30)
    ]

    ids = enqueue_many(requests)

    assert ids == sorted(ids)
    rows = {m.id: m for m in Message.objects.filter(id__in=ids).select_related("channel")}
    for i, mid in enumerate(ids):
        assert rows[mid].payload == {"args": [i], "kwargs": {"n": i}}
        assert rows[mid].channel.name == requests[i].channel
        assert rows[mid].priority == i % 4
        assert rows[mid].state == MessageState.READY
    f.assert_counters_match_table()


@pytest.mark.django_db
def test_a_batch_of_one_channel_and_one_task_stores_every_column_per_message() -> None:
    """Columns with one value for the whole batch travel once and are repeated by the
    function; a column that differs anywhere travels whole."""
    run_at = timezone.now() + timedelta(hours=1)
    same = [EnqueueRequest(f.NOOP, (i,), channel="one", priority=7) for i in range(20)]
    later = [EnqueueRequest(f.NOOP, (i,), channel="one", run_after=run_at) for i in range(3)]
    delayed = [EnqueueRequest(f.NOOP, (i,), channel="one", run_after=LEASE) for i in range(3)]
    mixed = [EnqueueRequest(f.NOOP, (i,), channel="one", priority=i - 1) for i in range(3)]

    ids = [enqueue_many(batch) for batch in (same, later, delayed, mixed)]

    rows = {m.id: m for m in Message.objects.select_related("channel")}
    assert [rows[i].priority for i in ids[0]] == [7] * 20
    assert [rows[i].payload["args"] for i in ids[0]] == [[i] for i in range(20)]
    assert {rows[i].run_at for i in ids[1]} == {run_at}
    assert {rows[i].state for i in ids[1] + ids[2]} == {MessageState.SCHEDULED}
    assert [rows[i].priority for i in ids[3]] == [-1, 0, 1]
    assert {rows[i].channel.name for i in rows} == {"one"}
    f.assert_counters_match_table()


@pytest.mark.django_db
def test_enqueue_of_one_message_takes_one_statement_and_stores_what_a_batch_would() -> None:
    f.enqueue("alice", 1)  # the channel exists
    connection.ensure_connection()
    run_at = timezone.now() + timedelta(minutes=3)
    with CaptureQueriesContext(connection) as orm_queries:
        first = enqueue(f.NOOP, 1, channel="alice", priority=5, run_after=run_at)
        second = enqueue(f.NOOP, 2, x=[1, {"y": None}], channel="alice", run_after=LEASE)
        third = enqueue(f.NOOP, 3, channel="bob")  # a new channel
    assert len(orm_queries) == 0
    one, two, three = (
        Message.objects.select_related("channel").get(id=i) for i in (first, second, third)
    )
    assert (one.priority, one.run_at, one.state) == (5, run_at, MessageState.SCHEDULED)
    assert two.payload == {"args": [2], "kwargs": {"x": [1, {"y": None}]}}
    assert two.state == MessageState.SCHEDULED and two.run_at > timezone.now() + LEASE / 2
    assert (three.channel.name, three.state) == ("bob", MessageState.READY)
    f.assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
def test_one_message_wakes_workers_unless_a_stale_head_still_comes_first(
    database_url: str,
) -> None:
    """The wake-up rule of fairqueue_enqueue_v1 (no NOTIFY when the channel's head became ready
    over 50 ms ago and nobody took it), as enqueue() of one message applies it."""
    listener = psycopg.connect(database_url, autocommit=True)
    try:
        message_store.listen_wakeups(listener, conf.get().NOTIFY_CHANNEL)

        def notified(**kwargs: Any) -> bool:
            enqueue(f.NOOP, 0, channel="alice", **kwargs)
            return any(True for _ in listener.notifies(timeout=0.5, stop_after=1))

        assert notified()  # an empty channel: this message is the head
        time.sleep(0.1)  # the head is now stale
        assert not notified()  # behind the stale head, same priority
        assert not notified(priority=-1)
        assert not notified(run_after=timedelta(hours=1))  # scheduled: the head stays first
        assert notified(priority=1)  # this message is the new head, fresh
    finally:
        listener.close()


@pytest.mark.django_db(transaction=True)
def test_a_channel_a_claim_left_backlogged_does_not_wake_workers(database_url: str) -> None:
    """A claim that leaves ready messages behind counts them (ready_count above zero): the
    channel's claimers come back as they settle, so no enqueue to it notifies, whatever its
    head, and the head is not read. A claim that takes the rest sets the count to zero, and
    the wake-ups resume."""
    listener = psycopg.connect(database_url, autocommit=True)
    try:
        message_store.listen_wakeups(listener, conf.get().NOTIFY_CHANNEL)

        def notified() -> bool:
            return any(True for _ in listener.notifies(timeout=0.5, stop_after=1))

        enqueue_many(EnqueueRequest(f.NOOP, (i,), channel="alice") for i in range(3))
        assert notified()
        assert len(claim(1)) == 1  # leaves two: the claim counted them
        assert counters("alice").ready == 2
        # A fresh head of higher priority notified while nothing counted the backlog (the
        # rule of the stale head); a counted backlog does not.
        enqueue(f.NOOP, 0, channel="alice", priority=1)
        assert not notified()
        enqueue_many([EnqueueRequest(f.NOOP, (1,), channel="alice", priority=2)])
        assert not notified()
        assert len(claim(10)) == 4  # takes the rest: the count is zero again
        assert counters("alice").ready == 0
        enqueue(f.NOOP, 0, channel="alice")
        assert notified()
    finally:
        listener.close()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("form", ["one", "batch"])
@pytest.mark.parametrize("how", ["cancel", "purge", "delete", "abort"])
def test_a_backlog_taken_out_by_an_operator_does_not_silence_the_next_wake_up(
    database_url: str, how: str, form: str
) -> None:
    """A claim left two messages counted (ready_count 2); an operator then takes them out
    (cancel, purge, delete, abort), which writes deltas that no claim has folded yet: the
    channel is empty and its workers idle. The next enqueue must wake them: the count it
    trusts is the claimed-and-left one less what was taken out since."""
    listener = psycopg.connect(database_url, autocommit=True)
    try:
        message_store.listen_wakeups(listener, conf.get().NOTIFY_CHANNEL)

        def notified() -> bool:
            return any(True for _ in listener.notifies(timeout=0.5, stop_after=1))

        left = enqueue_many(EnqueueRequest(f.NOOP, (i,), channel="alice") for i in range(3))
        assert notified()
        (taken,) = claim(1)
        message_store.complete_messages([(taken.id, taken.lease_token, None)])
        waiting = [i for i in left if i != taken.id]
        assert counters("alice").ready == 2
        if how == "cancel":
            assert sorted(cancel(waiting)) == waiting
        elif how == "purge":
            assert message_store.purge_channel_backlog(f.channel_ids(["alice"])["alice"]) == 2
        elif how == "delete":
            assert sorted(message_store.delete_messages(waiting)) == waiting
        else:
            assert abort(waiting) == {i: "cancelled" for i in waiting}
        assert counters("alice").ready == 0
        assert f.channel_state("alice")["ready_count"] == 2  # not folded yet
        if form == "one":
            enqueue(f.NOOP, 0, channel="alice")
        else:
            enqueue_many(EnqueueRequest(f.NOOP, (i,), channel="alice") for i in range(2))
        assert notified(), "an idle worker would sleep until its poll"
    finally:
        listener.close()


@pytest.mark.django_db
def test_enqueue_joins_the_callers_transaction() -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        f.enqueue("alice", 3)
        raise RuntimeError("the view failed")

    assert not Message.objects.exists()
    assert not Channel.objects.exists()


@pytest.mark.django_db
def test_delayed_messages_are_scheduled_and_counted() -> None:
    f.enqueue("alice", 2, run_after=timedelta(minutes=5))
    enqueue(f.NOOP, channel="alice", run_after=timezone.now() + timedelta(hours=1))
    f.enqueue("alice", 1)

    c = counters("alice")
    assert (c.ready, c.scheduled) == (1, 3)
    assert Message.objects.filter(state=MessageState.SCHEDULED).count() == 3
    f.assert_counters_match_table()


@pytest.mark.django_db
def test_payload_round_trips_through_the_claim() -> None:
    args = ("Zoë", 2**70, 0.1, None, True, [1, [2, {"x": "y"}]], 'quote " and \\ and \u2028')
    kwargs = {"nested": {"ключ": ["значение"]}, "empty": {}}
    enqueue(f.NOOP, *args, channel="alice", **kwargs)

    (got,) = claim(1)

    assert got.payload == {"args": list(args), "kwargs": kwargs}


def advisory_locks_held() -> dict[int, int]:
    """How many advisory locks this session holds, by namespace (the first key)."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT classid::integer, count(*) FROM pg_locks "
            "WHERE locktype = 'advisory' AND pid = pg_backend_pid() GROUP BY 1"
        )
        return dict(cur.fetchall())


CHANNEL_NAMES, CHANNEL_STRIPES, BACKLOG_STRIPES = 26227, 26228, 26225


@pytest.mark.django_db
@pytest.mark.parametrize(("channels", "locks"), [(100, {CHANNEL_NAMES: 100}), (2000, None)])
def test_a_batch_holds_at_most_128_advisory_locks_however_many_channels_it_names(
    channels: int, locks: dict[int, int] | None
) -> None:
    """PostgreSQL's lock table is one pool for every session: a lock per channel filled it."""
    requests = [EnqueueRequest(f.NOOP, (i,), channel=f"many-{i}") for i in range(channels)]
    with transaction.atomic():
        enqueue_many(requests)
        held = advisory_locks_held()
    if locks is not None:  # a few names: each its own lock
        assert held == locks
    else:  # many names: their stripes
        assert set(held) == {CHANNEL_STRIPES}
        assert 120 <= held[CHANNEL_STRIPES] <= 128
    assert Channel.objects.filter(name__startswith="many-").count() == channels


@pytest.mark.django_db
def test_the_bounded_backlog_check_holds_at_most_128_advisory_locks() -> None:
    names = [f"bounded-{i}" for i in range(1000)]
    with override_settings(FAIRQUEUE={"CHANNEL_DEFAULTS": {"max_backlog": 5}}):
        with transaction.atomic():
            enqueue_many(EnqueueRequest(f.NOOP, (i,), channel=n) for i, n in enumerate(names))
            with connection.cursor() as cur:
                cur.execute("SET CONSTRAINTS ALL IMMEDIATE")  # the check at commit, now
            held = advisory_locks_held()
        assert 120 <= held[BACKLOG_STRIPES] <= 128
        # the bound still holds, checked under the stripes
        with pytest.raises(ChannelFull), transaction.atomic():
            enqueue_many([EnqueueRequest(f.NOOP, (i,), channel="bounded-7") for i in range(5)])
    assert Message.objects.filter(channel__name="bounded-7").count() == 1


@pytest.mark.django_db
def test_a_batch_to_more_channels_than_the_lock_table_holds_is_stored() -> None:
    """Four times as many new channels in one batch as the lock table's entries (it borrows
    some spare memory besides): one lock per channel overflowed it, "out of shared memory"."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT current_setting('max_locks_per_transaction')::integer"
            " * (current_setting('max_connections')::integer"
            "    + current_setting('max_prepared_transactions')::integer)"
        )
        (slots,) = cur.fetchone()
    channels = slots * 4
    ids = enqueue_many(EnqueueRequest(f.NOOP, (i,), channel=f"wide-{i}") for i in range(channels))
    assert len(ids) == channels
    assert Channel.objects.filter(name__startswith="wide-").count() == channels


# ------------------------------------------------------------------------------------------------
# Overflow


@pytest.mark.django_db
def test_full_channel_raises_with_the_numbers_and_stores_nothing_of_the_batch() -> None:
    f.enqueue_spread({"alice": 3, "bob": 1})
    f.set_limits(["alice"], max_backlog=5)
    before = set(Message.objects.values_list("id", flat=True))
    batch = [
        EnqueueRequest(f.NOOP, channel="bob"),
        EnqueueRequest(f.NOOP, channel="alice"),
        EnqueueRequest(f.NOOP, channel="carol"),  # new
        EnqueueRequest(f.NOOP, channel="alice"),
        EnqueueRequest(f.NOOP, channel="alice"),
    ]

    with pytest.raises(ChannelFull) as caught, transaction.atomic():
        enqueue_many(batch)

    full = caught.value
    assert (full.channel, full.backlog, full.max_backlog, full.batch) == ("alice", 3, 5, 3)
    assert "alice" in str(full) and "max_backlog 5" in str(full)
    assert set(Message.objects.values_list("id", flat=True)) == before
    assert not Channel.objects.filter(name="carol").exists()
    # two more fit exactly
    assert len(enqueue_many(batch[1:2] * 2)) == 2
    with pytest.raises(ChannelFull), transaction.atomic():
        f.enqueue("alice", 1)
    f.assert_counters_match_table()


@pytest.mark.django_db
def test_a_full_channel_of_another_queue_is_named_as_the_api_names_it() -> None:
    with override_settings(FAIRQUEUE={"CHANNEL_DEFAULTS": {"max_backlog": 1}}):
        enqueue(f.NOOP, channel="acme", queue="reports")
        with pytest.raises(ChannelFull) as caught, transaction.atomic():
            enqueue(f.NOOP, channel="acme", queue="reports")
        full = caught.value
        assert (full.channel, full.queue) == ("acme", "reports")
        assert str(full).startswith("channel 'acme' of queue 'reports' is full: 1 waiting")
        enqueue(f.NOOP, channel="acme")  # the default queue's acme is another channel
        with pytest.raises(ChannelFull) as caught, transaction.atomic():
            enqueue(f.NOOP, channel="acme")
        assert (caught.value.channel, caught.value.queue) == ("acme", "default")
        assert str(caught.value).startswith("channel 'acme' is full")


@pytest.mark.django_db
def test_a_batch_larger_than_max_backlog_is_refused_whole() -> None:
    with override_settings(FAIRQUEUE={"CHANNEL_DEFAULTS": {"max_backlog": 5}}):
        with pytest.raises(ChannelFull) as caught, transaction.atomic():
            f.enqueue("alice", 6)
        assert (caught.value.backlog, caught.value.batch) == (0, 6)
        assert f.enqueue("alice", 5)
    assert Message.objects.count() == 5


@pytest.mark.django_db
def test_scheduled_messages_count_towards_the_backlog_and_running_ones_do_not() -> None:
    f.enqueue("alice", 2, run_after=timedelta(hours=1))
    f.enqueue("alice", 2)
    f.set_limits(["alice"], max_backlog=4)

    with pytest.raises(ChannelFull) as caught, transaction.atomic():
        f.enqueue("alice", 1)
    assert caught.value.backlog == 4

    claimed = claim(1)  # a claim makes room: running is not backlog
    assert len(claimed) == 1
    assert len(f.enqueue("alice", 1)) == 1
    with pytest.raises(ChannelFull), transaction.atomic():
        f.enqueue("alice", 1)

    # completing frees no backlog room (it was running), cancelling a waiting one does
    message_store.complete_messages([(claimed[0].id, claimed[0].lease_token, None)])
    with pytest.raises(ChannelFull), transaction.atomic():
        f.enqueue("alice", 1)
    waiting = Message.objects.filter(state=MessageState.SCHEDULED).values_list("id", flat=True)
    assert len(message_store.cancel_messages(list(waiting)[:1])) == 1
    assert len(f.enqueue("alice", 1)) == 1
    f.assert_counters_match_table()


@pytest.mark.django_db
def test_full_channel_rolls_back_the_callers_transaction() -> None:
    f.enqueue("alice", 1)
    f.set_limits(["alice"], max_backlog=1)

    with pytest.raises(ChannelFull), transaction.atomic():
        f.enqueue("bob", 1)
        f.enqueue("alice", 1)

    assert not Channel.objects.filter(name="bob").exists()
    assert Message.objects.count() == 1


# ------------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    "name",
    ["", "   ", " alice", "alice ", "\talice", "alice\n", "\u00a0alice", "a" * 201, "a\x00b"],
    ids=["empty", "blanks", "leading", "trailing", "tab", "newline", "nbsp", "201", "nul"],
)
@pytest.mark.django_db
def test_bad_channel_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidChannel):
        f.enqueue(name)
    assert not Channel.objects.exists()


@pytest.mark.parametrize("name", [None, 42, b"alice"])
def test_channel_name_must_be_a_string(name: Any) -> None:
    with pytest.raises(InvalidChannel, match="must be a string"):
        validate_channel_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "a",
        "a" * 200,
        "Zoë & Søn",
        "租户-7",
        "tenant 🎉",
        "O'Brien",
        '"quoted"',
        "x; DROP TABLE fairqueue_channel; --",
        "%s %(limit)s %%",
        "back\\slash",
        "in ner",
        "\u200bzero-width",
    ],
)
@pytest.mark.django_db
def test_any_other_text_is_a_channel_name(name: str) -> None:
    (mid,) = f.enqueue(name)

    assert Message.objects.get(id=mid).channel.name == name
    assert channel_store.select_channel_ids([name]) == {
        name: Message.objects.get(id=mid).channel_id
    }
    (got,) = claim(1)
    assert got.channel == name


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((object(),), {}),
        ((float("nan"),), {}),
        ((math.inf,), {}),
        ((b"bytes",), {}),
        (("a\x00b",), {}),
        ((), {"k\x00": 1}),
        (((1, 2),), {}),
        (({1, 2},), {}),
        (({1: "x"},), {}),
        (({"a": {2: "y"}},), {}),
        ((datetime(2024, 1, 1),), {}),
    ],
    ids=[
        "object",
        "nan",
        "inf",
        "bytes",
        "nul",
        "nul-in-key",
        "tuple",
        "set",
        "int-key",
        "nested-int-key",
        "datetime",
    ],
)
@pytest.mark.django_db
def test_unstorable_arguments_raise_payload_error(args: tuple[Any, ...], kwargs: Any) -> None:
    with pytest.raises(PayloadError):
        enqueue(f.NOOP, *args, channel="alice", **kwargs)
    assert not Message.objects.exists()


@pytest.mark.django_db
def test_deeply_nested_arguments_raise_payload_error() -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(PayloadError, match="nested too deeply"):
        enqueue(f.NOOP, deep, channel="alice")


@pytest.mark.django_db
def test_payload_over_max_payload_bytes_is_refused() -> None:
    with override_settings(FAIRQUEUE={"MAX_PAYLOAD_BYTES": 200}):
        enqueue(f.NOOP, "x" * 150, channel="alice")
        with pytest.raises(PayloadError, match="MAX_PAYLOAD_BYTES"):
            enqueue(f.NOOP, "x" * 200, channel="alice")
        with pytest.raises(PayloadError):  # bytes, not characters
            enqueue(f.NOOP, "é" * 100, channel="alice")
    assert Message.objects.count() == 1


@pytest.mark.django_db
def test_a_backslash_u0000_text_is_not_a_nul() -> None:
    enqueue(f.NOOP, "C:\\u0000\\file", channel="alice")
    (got,) = claim(1)
    assert got.payload["args"] == ["C:\\u0000\\file"]


@pytest.mark.django_db
def test_lone_surrogate_raises_payload_error() -> None:
    with pytest.raises(PayloadError):
        enqueue(f.NOOP, "a\ud800b", channel="alice")


@pytest.mark.django_db
def test_unknown_task_raises_and_stores_nothing() -> None:
    with pytest.raises(UnknownTask) as caught:
        enqueue_many(
            [
                EnqueueRequest(f.NOOP, channel="alice"),
                EnqueueRequest("tests.no_such_task", channel="alice"),
            ]
        )
    assert caught.value.name == "tests.no_such_task"
    assert not Message.objects.exists()


@pytest.mark.parametrize("priority", [101, -101, True, 1.5, "1"])
@pytest.mark.django_db
def test_priority_must_be_an_integer_in_range(priority: Any) -> None:
    with pytest.raises(ValueError, match="priority"):
        enqueue(f.NOOP, channel="alice", priority=priority)
    assert not Message.objects.exists()


@pytest.mark.django_db
def test_run_after_must_be_aware() -> None:
    with pytest.raises(ValueError, match="aware"):
        enqueue(f.NOOP, channel="alice", run_after=datetime(2030, 1, 1))


# ------------------------------------------------------------------------------------------------
# Channel limits: Python validation and the database's CHECK constraints


@pytest.mark.parametrize(
    "limits",
    [
        {"max_concurrency": 0},
        {"max_concurrency": -1},
        {"max_concurrency": 1_000_001},
        {"max_concurrency": 2.5},
        {"max_concurrency": True},
        {"release_interval": -1},
        {"release_interval": timedelta(days=2)},
        {"release_interval": "1s"},
        {"weight": 0},
        {"weight": 1001},
        {"weight": None},
        {"weight": True},
        {"max_backlog": 0},
        {"max_backlog": 2**31},
        {"max_backlog": "10"},
    ],
    ids=lambda limits: "-".join(f"{k}={v!r}" for k, v in limits.items()),
)
def test_validate_channel_limits_rejects_bad_values(limits: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(limits))):
        conf.validate_channel_limits(**limits)
    with pytest.raises(ValueError, match=next(iter(limits))):
        conf.load({"CHANNEL_DEFAULTS": limits})


def test_validate_channel_limits_accepts_the_edges() -> None:
    assert conf.validate_channel_limits(
        max_concurrency=1_000_000, release_interval=86_400, weight=1000, max_backlog=2**31 - 1
    ) == conf.ChannelDefaults(1_000_000, timedelta(days=1), 1000, 2**31 - 1)
    assert conf.validate_channel_limits(max_concurrency=1, release_interval=0.001, weight=1) == (
        conf.ChannelDefaults(1, timedelta(milliseconds=1), 1, None)
    )


@pytest.mark.parametrize(
    "change",
    [
        {"max_concurrency": 0},
        {"max_concurrency": 1_000_001},
        {"release_interval": timedelta(seconds=-1)},
        {"release_interval": timedelta(days=1, seconds=1)},
        {"weight": 0},
        {"weight": -1},
        {"weight": 1001},
        {"max_backlog": 0},
        {"max_backlog": -5},
        {"max_concurrency": -3},
        {"name": " alice"},
        {"name": "alice\t"},
        {"name": ""},
    ],
    ids=lambda change: "-".join(f"{k}={v!r}" for k, v in change.items()),
)
@pytest.mark.django_db
def test_database_rejects_absurd_channel_settings(change: dict[str, Any]) -> None:
    f.enqueue("alice")
    with pytest.raises(IntegrityError), transaction.atomic():
        if "name" in change:  # (a name never changes: a new channel's; save() refuses it)
            Channel.objects.bulk_create([Channel(**change)])
        else:
            Channel.objects.filter(name="alice").update(**change)
    assert list(Channel.objects.values_list("name", flat=True)) == ["alice"]


@pytest.mark.django_db
def test_database_accepts_the_edges() -> None:
    f.enqueue("alice")
    Channel.objects.filter(name="alice").update(
        max_concurrency=1_000_000, release_interval=timedelta(days=1), weight=1000, max_backlog=1
    )
    Channel.objects.filter(name="alice").update(max_concurrency=1, weight=1, max_backlog=None)


@pytest.mark.django_db
def test_a_model_instance_names_its_channel_by_label_and_primary_key() -> None:
    from django.contrib.auth.models import Group

    team = Group.objects.create(name="acme")
    mid = enqueue(f.NOOP, channel=team)
    assert Message.objects.get(pk=mid).channel.name == f"auth.group:{team.pk}"
    (other,) = enqueue_many([EnqueueRequest(f.NOOP, channel=team)])
    assert Message.objects.get(pk=other).channel_id == Message.objects.get(pk=mid).channel_id
    with pytest.raises(InvalidChannel, match="unsaved Group"):
        enqueue(f.NOOP, channel=Group(name="draft"))


@task(name="tests.enqueue.self_and_task")
def self_and_task(self: int = 0, task: int = 0) -> list[int]:
    """A task whose parameters share their names with the task object's methods' own."""
    return [self, task]


@pytest.mark.django_db
def test_task_parameters_named_self_or_task_reach_the_task() -> None:
    assert self_and_task(self=1, task=2) == [1, 2]
    for mid, kwargs in (
        (self_and_task.enqueue(task=1), {"task": 1}),
        (self_and_task.enqueue(self=1, channel="alice"), {"self": 1}),
        (self_and_task.using(channel="alice").enqueue(self=1, task=2), {"self": 1, "task": 2}),
    ):
        assert Message.objects.get(pk=mid).payload == {"args": [], "kwargs": kwargs}


@pytest.mark.django_db
def test_using_chains_as_djangos_task_using_does() -> None:
    bound = self_and_task.using(channel="alice").using(priority=2)
    message = Message.objects.get(pk=bound.using(priority=3).enqueue(self=1))
    assert (message.channel.name, message.priority) == ("alice", 3)
    assert (bound.channel, bound.priority) == ("alice", 2)  # each using() makes a new one
    assert bound.using(channel=None).channel == "alice"  # None keeps it, as Django's does
    with pytest.raises(TypeError, match=r"using\(\) takes the queue options .*; got max_attempts"):
        bound.using(max_attempts=2)


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_enqueue_leaves_no_message_but_the_channel_and_group_it_created() -> None:
    """Inside a transaction new channels and groups are committed on a connection of their own
    (docs/explanation/fairness.md, lock order): the rollback takes the message only."""
    with pytest.raises(RuntimeError), transaction.atomic():
        enqueue(f.NOOP, 1, channel=("acme", "alice"))
        raise RuntimeError("the view failed")
    assert not Message.objects.exists()
    assert ChannelGroup.objects.filter(name="acme").exists()
    assert not Channel.objects.get(name="acme/alice").messages.exists()

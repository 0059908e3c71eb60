"""No supported write can corrupt the scheduler's state, and nothing deadlocks.

Each test here reproduces a way the queue used to break through ordinary use: a stale
``Channel.save()``, ORM bulk writes, ``loaddata``, deleting a channel while work runs, lock
cycles between the queue's own statements and callers' transactions, the max_backlog bound
under REPEATABLE READ, clock steps, and one cap for messages and work batches together.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import DatabaseError, connection, connections, transaction
from django.utils import timezone

from django_fairqueue import ChannelFull, EnqueueRequest, batches, enqueue_many
from django_fairqueue.db import channel_store, integrity_store, message_store, stats_store
from django_fairqueue.exceptions import IsolationLevelError
from django_fairqueue.maintenance import CounterVerifier, verify
from django_fairqueue.models import Channel, ChannelDelta, Message, MessageState
from tests import factories as f

LEASE = timedelta(minutes=5)


def claim(limit: int = 1, **kwargs: Any) -> list[message_store.ClaimedMessage]:
    return message_store.claim_messages(limit, lease=LEASE, worker_id="test-worker", **kwargs)


def state(name: str) -> dict[str, Any]:
    return f.channel_state(name)


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``target`` on a thread of its own (its own connection); the dict gets its result or
    error."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = target()
        except BaseException as exc:  # reported by the test
            out["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.fixture
def raw_url(database_url: str) -> str:
    return database_url


@pytest.fixture
def side(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A second session, outside Django, with a transaction the test drives by hand."""
    with psycopg.connect(database_url) as conn:
        yield conn


# ------------------------------------------------------------------------------------------------
# The ORM writes configuration only


@pytest.mark.django_db
def test_a_stale_channel_save_keeps_the_live_counters() -> None:
    f.enqueue("acme", 5)
    stale = Channel.objects.get(name="acme")  # loaded before the claim
    assert len(claim(2)) == 2
    stale.max_concurrency = 3
    stale.save()  # a full save, as user code does
    f.fold_all()
    live = state("acme")
    assert (live["ready_count"], live["running_count"]) == (3, 2)
    assert Channel.objects.get(name="acme").max_concurrency == 3
    f.assert_counters_match_table()


@pytest.mark.django_db
def test_every_orm_path_of_a_channel_leaves_the_counters_alone() -> None:
    f.enqueue_spread({"a": 4, "b": 4})
    loaded = list(Channel.objects.order_by("name"))
    assert len(claim(4)) == 4
    before = {n: (state(n)["ready_count"], state(n)["running_count"]) for n in ("a", "b")}
    for channel in loaded:
        channel.weight = 2
    Channel.objects.bulk_update(loaded, ["weight"])
    loaded[0].save(update_fields=["weight"])
    Channel.objects.filter(name="b").update(max_backlog=100, paused=False)
    for name in ("a", "b"):
        assert (state(name)["ready_count"], state(name)["running_count"]) == before[name]
    f.assert_counters_match_table()
    # The model has no field to write them with at all.
    fields = {field.name for field in Channel._meta.get_fields()}
    assert not fields & {"ready_count", "running_count", "next_turn_at", "batch_pending"}


@pytest.mark.django_db
def test_no_orm_path_renames_a_channel_or_a_group() -> None:
    """A name is the identity enqueues use and what makes a channel a group's: the database
    refuses a write that changes it, whatever ORM path makes it, and the rows stay as they
    were (the admin shows names read-only; the model itself cannot be trusted to)."""
    from django_fairqueue import enqueue
    from django_fairqueue.models import ChannelGroup

    enqueue(f.NOOP, 1, channel=("acme", "alice"))
    enqueue(f.NOOP, 2, channel="solo")
    channel = Channel.objects.get(name="acme/alice")
    group = ChannelGroup.objects.get(name="acme")

    def refused(write: Callable[[], Any]) -> str:
        with pytest.raises(DatabaseError) as raised, transaction.atomic():
            write()
        return str(raised.value)

    channel.name = "other/zzz"
    assert "a channel keeps its name" in refused(channel.save)
    assert "'acme/alice' cannot become 'other/zzz'" in refused(channel.save)
    assert "keeps its name" in refused(lambda: Channel.objects.filter(name="solo").update(name="x"))
    channel.name = "x"
    assert "keeps its name" in refused(lambda: Channel.objects.bulk_update([channel], ["name"]))
    group.name = "other"
    assert "a channel group keeps its name" in refused(group.save)
    assert sorted(Channel.objects.values_list("name", "group__name")) == [
        ("acme/alice", "acme"),
        ("solo", None),
    ]
    # Writes that leave the name as it is go through (save() writes every field).
    fresh = Channel.objects.get(name="solo")
    fresh.weight = 3
    fresh.save()
    assert Channel.objects.get(name="solo").weight == 3
    f.assert_counters_match_table()


@pytest.mark.django_db
def test_no_orm_path_stores_a_priority_enqueue_refuses() -> None:
    message_id = enqueue_one("solo")
    message = Message.objects.get(pk=message_id)
    message.priority = 500
    # save() refuses it before the database does, with the error enqueue gives
    with pytest.raises(ValueError, match="priority must be between -100 and 100, got 500"):
        message.save()
    with pytest.raises(DatabaseError, match="fq_message_priority_range"), transaction.atomic():
        Message.objects.filter(pk=message_id).update(priority=-101)
    Message.objects.filter(pk=message_id).update(priority=100)
    assert Message.objects.get(pk=message_id).priority == 100


def enqueue_one(channel: str) -> int:
    from django_fairqueue import enqueue

    return enqueue(f.NOOP, 1, channel=channel)


@pytest.mark.django_db
def test_orm_writes_of_messages_recount_their_channels_on_commit(
    django_capture_on_commit_callbacks: Any,
) -> None:
    ids = f.enqueue("orm", 3)
    with django_capture_on_commit_callbacks(execute=True):
        Message.objects.filter(pk=ids[0]).update(state=MessageState.CANCELLED)
    with django_capture_on_commit_callbacks(execute=True):
        Message.objects.filter(pk=ids[1]).delete()
    with django_capture_on_commit_callbacks(execute=True):
        message = Message.objects.get(pk=ids[2])
        message.state = MessageState.FAILED
        message.save()
    f.assert_counters_match_table()
    assert (state("orm")["ready_count"], state("orm")["failed_count"]) == (0, 1)


class _Rollback(Exception):
    pass


def _queued_flushes() -> int:
    from django_fairqueue import integrity

    return sum(isinstance(entry[1], integrity._Flusher) for entry in connection.run_on_commit)


@pytest.mark.django_db(transaction=True)
def test_many_orm_writes_in_one_transaction_queue_one_recount() -> None:
    """One on-commit recount per transaction, not one per write; a recount queued inside a
    savepoint that rolls back does not stand in for the writes around it."""
    ids = f.enqueue("many", 6)
    with transaction.atomic():
        for pk in ids[:3]:
            message = Message.objects.get(pk=pk)
            message.state = MessageState.FAILED
            message.save()
        Message.objects.filter(pk=ids[3]).update(state=MessageState.CANCELLED)
        assert _queued_flushes() == 1
    f.assert_counters_match_table()
    assert (state("many")["ready_count"], state("many")["failed_count"]) == (2, 3)

    with transaction.atomic():
        with pytest.raises(_Rollback), transaction.atomic():
            Message.objects.filter(pk=ids[4]).update(state=MessageState.CANCELLED)
            assert _queued_flushes() == 1
            raise _Rollback
        assert _queued_flushes() == 0  # dropped with its savepoint
        Message.objects.filter(pk=ids[5]).update(state=MessageState.CANCELLED)
        assert _queued_flushes() == 1
    f.assert_counters_match_table()
    assert state("many")["ready_count"] == 1


@pytest.mark.django_db(transaction=True)
def test_loaddata_of_a_dump_taken_while_workers_ran_loads_consistent_counters() -> None:
    f.enqueue_spread({"x": 5, "y": 5})
    running = claim(3)
    out = io.StringIO()
    call_command("dumpdata", "fairqueue", stdout=out)
    dump = out.getvalue()
    # The queue moves on after the dump: completions, new work, a fold.
    message_store.complete_messages([(m.id, m.lease_token, None) for m in running])
    f.enqueue("x", 4)
    f.fold_all()
    path = "/tmp/fairqueue-integrity-dump.json"
    with open(path, "w") as fh:
        fh.write(dump)
    call_command("loaddata", path, verbosity=0)
    assert json.loads(dump)  # a real dump, with messages in it
    f.assert_counters_match_table()
    assert integrity_store.verify_channel_counters() == []


@pytest.mark.django_db
def test_the_admin_and_verify_see_no_drift_after_a_limit_edit() -> None:
    f.enqueue("edited", 3)
    assert len(claim(1)) == 1
    Channel.objects.filter(name="edited").update(max_concurrency=1)
    assert integrity_store.verify_channel_counters() == []


# ------------------------------------------------------------------------------------------------
# Deleting a channel


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("others", [0, 200], ids=["its-name-lock", "a-batch-of-many-names"])
def test_deleting_a_channel_waits_for_enqueues_in_flight_and_leaves_no_orphans(
    others: int,
) -> None:
    """Whether the enqueue holds the channel's name lock or, naming many channels at once,
    the stripe of its name."""
    f.enqueue("doomed", 2)
    entered = threading.Event()
    release = threading.Event()

    def enqueue_in_a_transaction() -> None:
        with transaction.atomic():
            names = ["doomed"] * 3 + [f"bystander-{i}" for i in range(others)]
            enqueue_many(EnqueueRequest(f.NOOP, (i,), channel=n) for i, n in enumerate(names))
            entered.set()
            release.wait(10)

    enq, enq_out = in_thread(enqueue_in_a_transaction)
    assert entered.wait(10)
    deleter, del_out = in_thread(lambda: Channel.objects.filter(name="doomed").delete())
    time.sleep(0.3)
    assert deleter.is_alive(), "the deletion must wait for the enqueue in flight"
    release.set()
    enq.join(10)
    deleter.join(10)
    assert "error" not in enq_out and "error" not in del_out, (enq_out, del_out)
    assert not Channel.objects.filter(name="doomed").exists()
    orphans = integrity_store.verify_orphans()
    assert (orphans["fairqueue_message"], orphans["fairqueue_channel_delta"]) == (0, 0)
    # After the deletion, an enqueue to the name creates the channel anew.
    f.enqueue("doomed", 1)
    assert (
        state("doomed")["ready_count"]
        + sum(d.ready for d in ChannelDelta.objects.filter(channel__name="doomed"))
        == 1
    )
    f.assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
def test_a_completion_after_its_channel_was_deleted_leaves_no_delta_behind() -> None:
    f.enqueue("gone", 1)
    (m,) = claim(1)
    with transaction.atomic():
        Channel.objects.filter(name="gone").delete()
    assert message_store.complete_messages([(m.id, m.lease_token, None)]) == set()
    f.fold_all()
    assert not ChannelDelta.objects.exists()
    # The worker's statistics of it, flushed afterwards, have no channel to go to: dropped,
    # not left as rows that verify would report as drift.
    minute = timezone.now().replace(second=0, microsecond=0)
    stats_store.record_channel_stats(
        [stats_store.ChannelMinuteStats(m.channel_id, minute, claimed=1)]
    )
    assert integrity_store.verify_orphans().get("fairqueue_channel_stat") == 0
    assert verify(repair=False) == []


# ------------------------------------------------------------------------------------------------
# Deadlocks


@pytest.mark.django_db(transaction=True)
def test_a_mixed_settle_batch_cannot_deadlock_with_a_heartbeat(side: Any) -> None:
    """Kept-result and plain messages in one completion used to be locked plain-first."""
    kept_id, plain_id = f.enqueue("mixed", 2)
    Message.objects.filter(pk=kept_id).update(keep_result=True)
    f.assert_counters_match_table()
    kept, plain = sorted(claim(2), key=lambda m: m.id)
    assert (kept.id, plain.id) == (kept_id, plain_id)
    # The heartbeat's session holds the kept (lower id) row...
    side.execute("SET deadlock_timeout = '100ms'")
    side.execute(
        "UPDATE fairqueue_message SET lease_expires_at = lease_expires_at WHERE id = %s",
        [kept.id],
    )
    done = [(kept.id, kept.lease_token, {"ok": 1}), (plain.id, plain.lease_token, None)]
    settle, out = in_thread(lambda: message_store.complete_messages(done))
    time.sleep(0.3)  # the completion now waits for the kept row, holding nothing
    # ...and then asks for the plain one, as a heartbeat in id order does.
    side.execute(
        "UPDATE fairqueue_message SET lease_expires_at = lease_expires_at WHERE id = %s",
        [plain.id],
    )
    side.commit()
    settle.join(10)
    assert out.get("result") == {kept.id, plain.id}, out


@pytest.mark.django_db(transaction=True)
def test_a_claim_skips_a_ready_row_another_transaction_holds(side: Any) -> None:
    """The claim used to wait for it, holding the channel: a deadlock as soon as that
    transaction wrote the channel (an operator's edit after a cancel)."""
    held, free = f.enqueue("busy", 2)
    side.execute("SET deadlock_timeout = '100ms'")
    side.execute("SELECT id FROM fairqueue_message WHERE id = %s FOR UPDATE", [held])
    got, out = in_thread(lambda: claim(2))
    got.join(5)
    assert not got.is_alive(), "the claim waited for a row lock"
    assert [m.id for m in out["result"]] == [free]
    side.execute("UPDATE fairqueue_channel SET weight = 2 WHERE name = 'busy'")
    side.commit()
    f.assert_counters_match_table()


def enqueue_in_opposite_orders(a: str, b: str) -> None:
    """Two transactions, each enqueueing to ``a`` and ``b`` in separate calls, in opposite
    orders, the second call of each after the first of both: the pattern that deadlocked."""
    barrier = threading.Barrier(2, timeout=10)

    def session(first: str, second: str) -> None:
        with transaction.atomic():
            f.enqueue(first, 1)
            barrier.wait()
            f.enqueue(second, 1)

    one, out1 = in_thread(lambda: session(a, b))
    two, out2 = in_thread(lambda: session(b, a))
    one.join(20)
    two.join(20)
    assert "error" not in out1 and "error" not in out2, (out1, out2)


@pytest.mark.django_db(transaction=True)
def test_transactions_creating_channels_in_opposite_orders_do_not_deadlock() -> None:
    enqueue_in_opposite_orders("new-a", "new-b")
    assert Message.objects.filter(channel__name__in=["new-a", "new-b"]).count() == 4
    f.assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
def test_enqueues_to_bounded_channels_in_opposite_orders_do_not_deadlock() -> None:
    f.enqueue_spread({"bound-a": 1, "bound-b": 1})
    f.set_limits(["bound-a", "bound-b"], max_backlog=10)
    enqueue_in_opposite_orders("bound-a", "bound-b")
    f.assert_counters_match_table()
    assert Message.objects.count() == 6


# ------------------------------------------------------------------------------------------------
# max_backlog


@pytest.mark.django_db(transaction=True)
def test_max_backlog_holds_between_concurrent_transactions_at_commit() -> None:
    f.enqueue("tight", 1)
    f.set_limits(["tight"], max_backlog=3)
    barrier = threading.Barrier(2, timeout=10)

    def session() -> None:
        with transaction.atomic():
            f.enqueue("tight", 2)  # each sees room: the other has not committed
            barrier.wait()

    one, out1 = in_thread(session)
    two, out2 = in_thread(session)
    one.join(20)
    two.join(20)
    errors = [o["error"] for o in (out1, out2) if "error" in o]
    assert len(errors) == 1, (out1, out2)
    full = ChannelFull.from_error(errors[0])
    assert full is not None and full.channel == "tight" and full.max_backlog == 3
    assert Message.objects.filter(channel__name="tight").count() == 3
    f.assert_counters_match_table()


@pytest.mark.django_db
def test_a_full_channel_refuses_at_once_inside_a_transaction() -> None:
    f.enqueue("small", 2)
    f.set_limits(["small"], max_backlog=2)
    with pytest.raises(ChannelFull) as caught:
        f.enqueue("small", 1)
    assert (caught.value.backlog, caught.value.batch) == (2, 1)


@pytest.mark.django_db(transaction=True)
def test_a_bounded_enqueue_under_repeatable_read_is_refused_and_stores_nothing() -> None:
    f.enqueue("rr", 1)
    f.set_limits(["rr"], max_backlog=2)
    with pytest.raises(IsolationLevelError, match="READ COMMITTED"), transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        f.enqueue("rr", 1)
    assert Message.objects.filter(channel__name="rr").count() == 1
    # an unbounded channel is fine at any level
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        f.enqueue("unbounded", 1)


def test_the_system_check_warns_about_another_isolation_level(monkeypatch: Any) -> None:
    from django.conf import settings

    from django_fairqueue.checks import check_isolation_level

    assert check_isolation_level() == []
    options = {"isolation_level": psycopg.IsolationLevel.REPEATABLE_READ}
    monkeypatch.setitem(settings.DATABASES["default"], "OPTIONS", options)
    (warning,) = check_isolation_level()
    assert warning.id == "fairqueue.W001" and "REPEATABLE_READ" in warning.msg


# ------------------------------------------------------------------------------------------------
# Clocks


@pytest.mark.django_db
def test_due_times_come_from_the_database_clock() -> None:
    (mid,) = f.enqueue("later", 1, run_after=timedelta(minutes=7))
    row = Message.objects.get(pk=mid)
    assert row.run_at - row.enqueued_at == timedelta(minutes=7)
    (now_id,) = f.enqueue("later2", 1)
    (m,) = claim(1, only_channel_ids=[f.channel_ids(["later2"])["later2"]])
    message_store.fail_messages([(m.id, m.lease_token, {"type": "X"}, timedelta(minutes=3))])
    with connection.cursor() as cur:
        cur.execute(
            "SELECT run_at - clock_timestamp() FROM fairqueue_message WHERE id = %s", [now_id]
        )
        (left,) = cur.fetchone()
    assert timedelta(minutes=2, seconds=50) < left <= timedelta(minutes=3)


@pytest.mark.django_db
def test_a_clock_step_back_never_parks_a_channel_without_a_rate_limit() -> None:
    f.enqueue("steady", 2)
    assert len(claim(1)) == 1
    # What a claim before a 10-minute step back of the database clock leaves behind.
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE fairqueue_channel SET next_turn_at = clock_timestamp() + interval '10 minutes'"
            " WHERE name = 'steady'"
        )
    # New work's delta is quiet (the channel counts a message): the maintenance loop's fold,
    # about once a second, is the one that brings its turn back to now.
    f.enqueue("steady", 1)
    channel_store.fold_channel_deltas()
    assert len(claim(5)) == 2


@pytest.mark.django_db
def test_removing_a_rate_limit_releases_the_channel_at_once() -> None:
    f.enqueue("metered", 3)
    f.set_limits(["metered"], release_interval=timedelta(hours=1))
    assert len(claim(5)) == 1
    assert claim(5) == []
    Channel.objects.filter(name="metered").update(release_interval=timedelta(0))
    channel_store.fold_deltas_of_channel(f.channel_ids(["metered"])["metered"])  # as the admin does
    assert len(claim(5)) == 2


# ------------------------------------------------------------------------------------------------
# One cap for messages and work batches


@pytest.mark.django_db
def test_max_concurrency_covers_messages_and_work_batches_together() -> None:
    from tests.test_batches import plan_job

    f.enqueue("both", 3)
    plan_job("both-job", "both", 2)
    f.set_limits(["both"], max_concurrency=2)
    assert len(claim(1)) == 1
    batch = batches.claim(worker_id="w", lease=LEASE)
    assert batch is not None  # 1 message + 1 batch = the cap
    assert claim(5) == []
    assert batches.claim(worker_id="w", lease=LEASE) is None
    with batches.fenced(batch):
        pass
    assert len(claim(5)) == 1  # the batch's slot, freed
    assert integrity_store.verify_channel_counters() == []


@pytest.mark.django_db(transaction=True)
def test_concurrent_message_and_batch_claimers_never_exceed_the_shared_cap() -> None:
    from tests.test_batches import plan_job

    f.enqueue("shared", 40)
    plan_job("shared-job", "shared", 20)
    f.set_limits(["shared"], max_concurrency=2)
    cid = f.channel_ids(["shared"])["shared"]
    most: list[int] = []
    done = {"messages": 0, "batches": 0}
    lock = threading.Lock()

    def running_now() -> int:
        with connection.cursor() as cur:
            cur.execute(
                "SELECT (SELECT count(*) FROM fairqueue_message WHERE state = 'running' "
                "AND channel_id = %s) + (SELECT count(*) FROM fairqueue_work_batch "
                "WHERE state = 'running' AND channel_id = %s)",
                [cid, cid],
            )
            return int(cur.fetchone()[0])

    def claimer(kind: str) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if kind == "messages":
                got = claim(2)
                if not got and done["messages"] >= 40:
                    return
                sample = running_now()
                time.sleep(0.002)
                message_store.complete_messages([(m.id, m.lease_token, None) for m in got])
                n = len(got)
            else:
                batch = batches.claim(worker_id=kind, lease=LEASE)
                if batch is None and done["batches"] >= 20:
                    return
                sample = running_now()
                time.sleep(0.002)
                if batch is not None:
                    with batches.fenced(batch):
                        pass
                n = int(batch is not None)
            with lock:
                most.append(sample)
                done[kind] += n

    threads = [in_thread(lambda k=k: claimer(k)) for k in ("messages", "messages", "batches")]
    threads += [in_thread(lambda: claimer("batches"))]
    for thread, out in threads:
        thread.join(30)
        assert "error" not in out, out
    assert done == {"messages": 40, "batches": 20}
    assert max(most) <= 2, f"running reached {max(most)} under a cap of 2"
    assert max(most) == 2, "the claimers never reached the cap: the test did not exercise it"
    assert integrity_store.verify_channel_counters() == []


# ------------------------------------------------------------------------------------------------
# Smaller


@pytest.mark.django_db
def test_a_claim_returns_messages_in_the_order_to_start_them() -> None:
    low = f.enqueue("prio", 2, priority=-5)
    high = f.enqueue("prio", 1, priority=50)
    assert [m.id for m in claim(3)] == [*high, *low]


@pytest.mark.django_db
def test_verify_reports_and_repairs_drift(caplog: Any) -> None:
    f.enqueue("drifty", 4)
    f.fold_all()
    with connection.cursor() as cur:
        cur.execute("UPDATE fairqueue_channel SET ready_count = 0 WHERE name = 'drifty'")
    out = io.StringIO()
    with pytest.raises(CommandError, match="disagree"):
        call_command("fairqueue", "verify", stdout=out)
    assert "channel 'drifty': ready recorded 0, counted 4" in out.getvalue()
    assert CounterVerifier().run_once() == 1
    assert "counter drift repaired: channel 'drifty' ready recorded 0, counted 4" in caplog.text
    call_command("fairqueue", "verify", stdout=out)
    assert "every channel's counters match its rows" in out.getvalue()
    assert len(claim(10)) == 4


def test_a_deadlock_is_reported_as_what_it_is() -> None:
    from django_fairqueue.runtime import after_database_error, conflict

    error = DatabaseError("deadlock detected")
    error.__cause__ = psycopg.errors.DeadlockDetected("deadlock detected")
    assert conflict(error) == "deadlock detected"
    assert after_database_error(error).startswith("deadlock detected, rolled back")
    down = DatabaseError("server closed the connection")
    down.__cause__ = psycopg.OperationalError("server closed the connection")
    assert conflict(down) is None


@pytest.mark.django_db(transaction=True)
def test_a_claim_waits_for_a_channel_a_concurrent_claim_only_folded(
    side: Any, settings: Any
) -> None:
    """A claim folds every waking delta but may serve other channels: the channel it folded
    stays locked (and not yet eligible to others) until it commits."""
    settings.FAIRQUEUE = {"CLAIM_WAIT": 2.0}
    f.enqueue("served", 1)
    f.fold_all()
    f.enqueue("folded", 1)  # a waking delta, not folded yet
    served = f.channel_ids(["served"])["served"]
    # The other claim: inside a transaction left open, it folds both channels and serves one.
    rows = side.execute(
        "SELECT channel_name FROM fairqueue_claim_v1(5, interval '5 minutes', 'other', %s)",
        [[served]],
    ).fetchall()
    assert rows == [("served",)]
    got, out = in_thread(lambda: claim(5))
    time.sleep(0.3)
    side.commit()
    got.join(10)
    assert [m.channel for m in out["result"]] == ["folded"], out

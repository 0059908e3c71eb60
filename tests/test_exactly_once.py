"""Exactly-once processing (django_fairqueue.exactly_once): the claim, the caller's writes and the
completion commit together or roll back together.

Most tests commit for real (``transaction=True``) and look from a second connection, which sees
committed data only: that is what "commit together" means.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.contrib.auth.models import Group
from django.db import connection, transaction
from django.db.models import Sum

from django_fairqueue import exactly_once
from django_fairqueue.api import EnqueueRequest, enqueue_many
from django_fairqueue.db import channel_store, message_store
from django_fairqueue.exceptions import IsolationLevelError, ResultNotStorable
from django_fairqueue.models import ChannelStat, Message, MessageState
from django_fairqueue.tasks import task
from django_fairqueue.testing import drain

TASK = "tests.exactly_once.record"
KEPT = "tests.exactly_once.kept"
RAISING = "tests.exactly_once.raising"
#: The worker id drain() runs under: a batch claiming with it records errors equal to its own.
DRAIN_WORKER_ID = "django_fairqueue.testing.drain"


@task(name=TASK)
def record(n: int) -> None:
    """Never run here: the tests process the messages themselves."""


@task(name=KEPT, keep_result=True)
def kept(n: int) -> None:
    """Like ``record``, but its row (and result) is kept after completion."""


class BadStr(Exception):
    """An exception whose ``str()`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("nope")


#: What ``raising`` raises, by name (a task's arguments are JSON): a new exception each time.
ERRORS: dict[str, Callable[[], BaseException]] = {
    "long": lambda: ValueError("x" * 20_000),
    "bad_str": lambda: BadStr("boom"),
}


@task(name=RAISING, max_attempts=1)
def raising(which: str) -> None:
    raise ERRORS[which]()


def enqueue(channel: str, n: int, name: str = TASK) -> list[int]:
    return enqueue_many(EnqueueRequest(name, [i], channel=channel) for i in range(n))


def counters(channel: str) -> tuple[int, int, int, int, int]:
    ids = channel_store.select_channel_ids([channel])
    (c,) = channel_store.select_channel_counters([ids[channel]])
    return (c.ready, c.scheduled, c.running, c.failed, c.succeeded)


def snapshot(ids: list[int]) -> list[tuple[Any, ...]]:
    """What a claim changes on a message row."""
    return list(
        Message.objects.filter(pk__in=ids)
        .order_by("pk")
        .values_list("pk", "state", "attempts", "lease_token", "claimed_at", "worker_id")
    )


def committed(database_url: str, sql: str, params: list[Any]) -> Any:
    """One value, as a second connection sees it (committed data only)."""
    with psycopg.connect(database_url) as other:
        found = other.execute(sql, params).fetchone()
    assert found is not None
    return found[0]


def waiting(database_url: str, ids: list[int]) -> int:
    """How many of these messages another connection still sees."""
    sql = "SELECT count(*) FROM fairqueue_message WHERE id = ANY(%s)"
    return int(committed(database_url, sql, [ids]))


@pytest.fixture
def alice_and_bob() -> Iterator[tuple[list[int], list[int]]]:
    yield enqueue("alice", 3), enqueue("bob", 2)


# -- guard rails -----------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_outside_atomic_it_refuses_to_claim() -> None:
    ids = enqueue("alice", 1)
    with (
        pytest.raises(exactly_once.TransactionRequired, match=r"transaction\.atomic"),
        exactly_once.batch(limit=1),
    ):
        pass
    assert snapshot(ids)[0][1:3] == (MessageState.READY, 0)


@pytest.mark.django_db
@pytest.mark.parametrize("how", ["setting", "using"])
def test_with_the_queue_in_another_database_the_error_names_the_atomic_to_open(
    settings: Any, how: str
) -> None:
    """With the queue in a database of its own, ``transaction.atomic()`` on ``default`` is not
    the queue's transaction: the error says which one to open."""
    if how == "setting":
        settings.FAIRQUEUE = {**settings.FAIRQUEUE, "DATABASE": "pooled"}
        settings.DATABASE_ROUTERS = ["django_fairqueue.routers.QueueRouter"]
    using = "pooled" if how == "using" else None
    with (
        transaction.atomic(),
        pytest.raises(
            exactly_once.TransactionRequired,
            match=r"inside transaction\.atomic\(using='pooled'\): the claim",
        ),
        exactly_once.batch(limit=1, using=using),
    ):
        pass


@pytest.mark.django_db(transaction=True)
def test_on_the_default_database_the_error_names_plain_atomic() -> None:
    with (
        pytest.raises(exactly_once.TransactionRequired, match=r"inside transaction\.atomic\(\):"),
        exactly_once.batch(limit=1),
    ):
        pass


@pytest.mark.django_db
def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="limit"), exactly_once.batch(limit=0):
        pass
    with (
        pytest.raises(TypeError, match="channels must be a list of channel names, not a string"),
        exactly_once.batch(channels="alice"),
    ):
        pass
    with (
        pytest.raises(TypeError, match="exclude_channels must be a list of channel names"),
        exactly_once.batch(exclude_channels="alice"),
    ):
        pass
    with (
        pytest.raises(TypeError, match="queues must be a list of queue names, not a string"),
        exactly_once.batch(queues="emails"),
    ):
        pass
    for worker_id in ("w" * 201, "  ", 5):
        with (
            pytest.raises(ValueError, match="worker_id must be"),
            exactly_once.batch(worker_id=worker_id),  # type: ignore[arg-type]
        ):
            pass


@pytest.mark.django_db(transaction=True)
def test_a_bad_retry_in_is_refused_by_fail_at_once_and_the_message_can_still_fail() -> None:
    enqueue("gina", 1)
    with transaction.atomic(), exactly_once.batch(limit=1) as batch:
        (message,) = batch
        with pytest.raises(TypeError, match="retry_in must be a timedelta"):
            batch.fail(message, ValueError("x"), retry_in=5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="must not be negative"):
            batch.fail(message, ValueError("x"), retry_in=timedelta(seconds=-1))
        batch.fail(message, ValueError("x"), retry_in=timedelta(0))  # still undecided
    assert counters("gina") == (1, 0, 0, 0, 0)  # retried at once: ready again


@pytest.mark.django_db(transaction=True)
def test_channels_are_found_in_the_named_queues_or_in_every_queue() -> None:
    (emailed,) = enqueue_many([EnqueueRequest(TASK, [1], channel="acme", queue="emails")])
    (default,) = enqueue("acme", 1)
    with transaction.atomic(), exactly_once.batch(channels=["acme"], queues=["emails"]) as b:
        assert [m.id for m in b] == [emailed]
        assert b.messages[0].queue == "emails"
        b.release(b.messages[0])
    with transaction.atomic(), exactly_once.batch(queues=["default"]) as b:
        assert [m.id for m in b] == [default]
        b.release(b.messages[0])
    with transaction.atomic(), exactly_once.batch(channels=["acme"]) as b:
        assert sorted(m.id for m in b) == sorted([emailed, default])  # every queue
        for m in b:
            b.release(m)


@pytest.mark.django_db(transaction=True)
def test_claims_and_outcomes_are_counted_in_the_statistics_once_committed() -> None:
    enqueue("hana", 4)
    with pytest.raises(RuntimeError, match="undo"), transaction.atomic():
        with exactly_once.batch(limit=3, channels=["hana"]) as batch:
            for message in batch:
                batch.fail(message, ValueError("retry"), retry_in=timedelta(hours=1))
        raise RuntimeError("undo")
    assert not ChannelStat.objects.exists()  # rolled back: nothing counted
    with transaction.atomic(), exactly_once.batch(limit=3, channels=["hana"]) as batch:
        first, second, _third = batch
        batch.fail(first, ValueError("dead"))
        batch.release(second)
        assert not ChannelStat.objects.exists()  # not before the commit
    totals = ChannelStat.objects.aggregate(
        claimed=Sum("claimed"),
        succeeded=Sum("succeeded"),
        failed=Sum("failed"),
        retried=Sum("retried"),
        run_ms=Sum("run_ms_sum"),
    )
    assert (totals["claimed"], totals["succeeded"], totals["failed"], totals["retried"]) == (
        3,
        1,
        1,
        0,
    )
    assert totals["run_ms"] >= 0


# -- commit ----------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_commit_completes_the_messages_together_with_the_callers_writes(
    database_url: str, alice_and_bob: tuple[list[int], list[int]]
) -> None:
    alice, bob = alice_and_bob
    with transaction.atomic():
        with exactly_once.batch(limit=10, channels=["alice"]) as batch:
            assert sorted(m.id for m in batch) == alice
            assert {m.channel for m in batch} == {"alice"}
            for message in batch:
                Group.objects.create(name=f"invoice-{message.payload['args'][0]}")
        # settled but not committed: another connection still sees them waiting, no invoices
        assert waiting(database_url, alice) == len(alice)
        assert committed(database_url, "SELECT count(*) FROM auth_group", []) == 0
    assert waiting(database_url, alice) == 0
    assert committed(database_url, "SELECT count(*) FROM auth_group", []) == 3
    assert counters("alice") == (0, 0, 0, 0, 3)
    assert counters("bob") == (2, 0, 0, 0, 0)  # other channels untouched
    assert [s[1] for s in snapshot(bob)] == [MessageState.READY] * 2


@pytest.mark.django_db(transaction=True)
def test_fail_release_and_complete_with_a_result() -> None:
    first, second, third, fourth = enqueue("carol", 4, name=KEPT)
    with transaction.atomic(), exactly_once.batch(limit=4) as batch:
        by_id = {m.id: m for m in batch}
        batch.fail(by_id[first], ValueError("bad invoice"))
        batch.release(by_id[second])
        batch.complete(by_id[third], {"invoice": 7})
        batch.fail(by_id[fourth], RuntimeError("later"), retry_in=timedelta(hours=1))
    failed, released, done, retried = Message.objects.order_by("pk")
    assert failed.state == MessageState.FAILED
    assert failed.last_error["type"] == "ValueError"
    assert failed.last_error["message"] == "bad invoice"
    assert "ValueError: bad invoice" in failed.last_error["traceback"]
    assert (released.state, released.attempts) == (MessageState.READY, 0)
    assert (done.state, done.result) == (MessageState.SUCCEEDED, {"invoice": 7})
    assert (retried.state, retried.attempts) == (MessageState.SCHEDULED, 1)
    assert counters("carol") == (1, 1, 0, 1, 1)


@pytest.mark.django_db(transaction=True)
def test_fail_records_the_error_exactly_as_a_worker_records_it() -> None:
    """A long message is cut and an exception whose ``__str__`` raises is recorded (not
    raised out of ``fail()``, which would roll the whole batch back), as by a worker."""
    which = list(ERRORS)
    for name in which:
        enqueue_many([EnqueueRequest(RAISING, [name], channel="by-worker")])
    assert drain(["by-worker"]) == len(which)
    by_worker = [
        m.last_error for m in Message.objects.filter(channel__name="by-worker").order_by("pk")
    ]
    ids = [enqueue_many([EnqueueRequest(RAISING, [n], channel="by-batch")])[0] for n in which]
    with (
        transaction.atomic(),
        exactly_once.batch(channels=["by-batch"], worker_id=DRAIN_WORKER_ID) as batch,
    ):
        by_id = {m.id: m for m in batch}
        for message_id, name in zip(ids, which, strict=True):
            batch.fail(by_id[message_id], ERRORS[name]())
    by_batch = [Message.objects.get(pk=i).last_error for i in ids]
    assert by_batch[0]["type"] == "ValueError" and len(by_batch[0]["message"]) == 8_000
    # The same record, but for the traceback's frames: a worker's exception was raised.
    for worker_error, batch_error in zip(by_worker, by_batch, strict=True):
        assert {**batch_error, "traceback": None} == {**worker_error, "traceback": None}
        last_line = batch_error["traceback"].splitlines()[-1]
        assert worker_error["traceback"].splitlines()[-1] == last_line


def set_isolation_level(level: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_only_a_read_committed_transaction_may_claim(level: str) -> None:
    """At the other levels the snapshot hides what other claimers committed: the claim would
    come back empty, or fail with a serialization error, with no other claimer about."""
    (message_id,) = enqueue("hank", 1)
    with transaction.atomic():
        set_isolation_level(level)
        with (
            pytest.raises(IsolationLevelError, match=f"this one is {level}: open it at READ C"),
            exactly_once.batch(channels=["hank"]),
        ):
            pass
    with transaction.atomic():
        set_isolation_level("READ COMMITTED")
        with exactly_once.batch(channels=["hank"]) as batch:
            assert [m.id for m in batch] == [message_id]


@pytest.mark.django_db(transaction=True)
def test_a_result_that_cannot_be_stored_is_refused_by_complete_and_the_message_can_fail() -> None:
    (kept_id,) = enqueue("carol", 1, name=KEPT)
    (not_kept_id,) = enqueue("carol", 1)
    with transaction.atomic(), exactly_once.batch(limit=2) as batch:
        by_id = {m.id: m for m in batch}
        with pytest.raises(ResultNotStorable, match=r"\(set\) cannot be stored as JSON") as e:
            batch.complete(by_id[kept_id], {1, 2})
        # what a worker's error says ("the task ran, and is not retried") is not true here
        assert str(e.value).endswith(
            f"message {kept_id} is not marked (left so, it completes with None when the block "
            "ends; raised out of the block, this error rolls the claim back): complete it with "
            "a value JSON can hold, or fail it"
        )
        batch.fail(by_id[kept_id], ValueError("no JSON result"))  # still undecided
        batch.complete(by_id[not_kept_id], {1, 2})  # not stored, so not refused
    kept_row = Message.objects.get(pk=kept_id)
    assert (kept_row.state, kept_row.last_error["message"]) == (
        MessageState.FAILED,
        "no JSON result",
    )
    assert not Message.objects.filter(pk=not_kept_id).exists()  # completed, row not kept


@pytest.mark.django_db(transaction=True)  # a batch claims committed work, like a worker
def test_a_message_is_decided_once_and_only_while_the_block_runs() -> None:
    enqueue("dave", 2)
    with transaction.atomic(), exactly_once.batch(limit=2) as batch:
        first, second = batch
        batch.complete(first)
        with pytest.raises(ValueError, match="already"):
            batch.fail(first, RuntimeError("x"))
        with pytest.raises(ValueError, match="not a message of this batch"):
            batch.complete(dataclasses.replace(second))  # equal, but not the one claimed
        with pytest.raises(TypeError, match="exception"):
            batch.fail(second, "not an exception")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="settled"):
        batch.release(second)


@pytest.mark.django_db(transaction=True)
def test_channel_filters() -> None:
    enqueue("erin", 2)
    enqueue("frank", 2)
    with transaction.atomic(), exactly_once.batch(channels=["nobody"]) as batch:
        assert len(batch) == 0 and not batch
    with transaction.atomic(), exactly_once.batch(exclude_channels=["erin"]) as batch:
        assert {m.channel for m in batch} == {"frank"}
        for message in batch:
            batch.release(message)


# -- rollback --------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_rollback_returns_the_messages_with_the_claim_undone(
    alice_and_bob: tuple[list[int], list[int]],
) -> None:
    alice, _ = alice_and_bob
    before_rows, before_counters = snapshot(alice), counters("alice")
    with (
        pytest.raises(RuntimeError, match="payment failed"),
        transaction.atomic(),
        exactly_once.batch(limit=10, channels=["alice"]) as batch,
    ):
        assert len(batch) == 3
        for message in batch:
            Group.objects.create(name=f"invoice-{message.id}")
        raise RuntimeError("payment failed")
    assert snapshot(alice) == before_rows  # ready, attempts 0, no lease, no worker
    assert counters("alice") == before_counters == (3, 0, 0, 0, 0)
    assert not Group.objects.exists()
    # and they are claimable again
    assert len(message_store.claim_messages(10, lease=timedelta(minutes=1), worker_id="w")) == 5


@pytest.mark.django_db(transaction=True)
def test_outer_rollback_after_the_block_undoes_the_completion_too(
    alice_and_bob: tuple[list[int], list[int]],
) -> None:
    alice, _ = alice_and_bob
    before_rows = snapshot(alice)
    with pytest.raises(RuntimeError, match="later failure"), transaction.atomic():
        with exactly_once.batch(limit=10, channels=["alice"]) as batch:
            for message in batch:
                Group.objects.create(name=f"invoice-{message.id}")
        assert not Message.objects.filter(pk__in=alice).exists()  # completed, in here
        raise RuntimeError("later failure")
    assert snapshot(alice) == before_rows
    assert counters("alice") == (3, 0, 0, 0, 0)
    assert not Group.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_an_exception_caught_outside_the_block_still_rolls_the_block_back(
    alice_and_bob: tuple[list[int], list[int]],
) -> None:
    alice, _ = alice_and_bob
    before_rows = snapshot(alice)
    with transaction.atomic():
        Group.objects.create(name="outside the block")
        try:
            with exactly_once.batch(limit=10, channels=["alice"]) as batch:
                Group.objects.create(name="inside the block")
                raise KeyError(batch.messages[0].id)
        except KeyError:
            pass
    assert snapshot(alice) == before_rows
    assert list(Group.objects.values_list("name", flat=True)) == ["outside the block"]


@pytest.mark.django_db
def test_work_enqueued_by_the_open_transaction_itself_is_not_claimable_yet() -> None:
    # Like workers, a batch sees committed work only: its housekeeping runs on a connection
    # of its own, which cannot see this (test) transaction's enqueue.
    enqueue("gina", 2)
    with exactly_once.batch(limit=5) as batch:
        assert len(batch) == 0


# -- concurrency -----------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_other_claimers_skip_the_claimed_channel_until_commit(
    database_url: str, alice_and_bob: tuple[list[int], list[int]]
) -> None:
    alice, bob = alice_and_bob
    # No folding beforehand: bob's enqueue left waking deltas. The batch must do its
    # housekeeping outside this transaction, or bob's row would stay locked until we commit.
    claim_sql = message_store.queries()["claim_messages"]
    params = {"limit": 10, "lease": timedelta(minutes=1), "worker": "other", "only": None}
    params |= {"exclude": None, "quantum": None, "maintain": True, "wait_ms": 50, "by_time": False}
    params["queues"] = None  # every queue, as a worker started without --queues
    params["async_except"] = []  # a worker's claim, as the worker sends it
    with transaction.atomic(), exactly_once.batch(limit=1, channels=["alice"]) as batch:
        assert len(batch) == 1
        # A worker on another connection claims meanwhile: it does not wait for our lock,
        # and takes nothing of alice's (its row is locked by us).
        with psycopg.connect(database_url, autocommit=True) as other:
            got = other.execute(claim_sql, params).fetchall()
        assert sorted(r[0] for r in got) == bob
        for message in batch:
            batch.release(message)
    assert [s[1] for s in snapshot(alice)] == [MessageState.READY] * 3

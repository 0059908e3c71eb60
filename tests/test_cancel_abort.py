"""Cancel waiting messages, abort running ones.

Statements first (counters exact, fencing), then the worker (the heartbeat picks a request up,
a cooperative task stops, a stubborn one is settled at the grace period), then the operators'
ways in (CLI, admin) and the django.tasks status. Races run on several connections at once.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from django_fairqueue import abort, abort_requested, cancel
from django_fairqueue.db import message_store
from django_fairqueue.models import Message, MessageState
from django_fairqueue.tasks import task
from django_fairqueue.worker import Worker, WorkerConfig
from tests import fairtasks
from tests.factories import assert_counters_match_table
from tests.test_claim_concurrency import run_threads
from tests.workerkit import run_in_thread, wait_until

LEASE = timedelta(minutes=5)


def claim(limit: int = 100, worker: str = "w") -> list[message_store.ClaimedMessage]:
    return message_store.claim_messages(limit, lease=LEASE, worker_id=worker)


def state(mid: int) -> str:
    return str(Message.objects.get(pk=mid).state)


# ------------------------------------------------------------------------------------------------
# cancel


@pytest.mark.django_db
def test_cancel_by_ids_channel_and_task_leaves_running_messages_alone() -> None:
    a1 = fairtasks.add.enqueue(1, 1, channel="a")
    a2 = fairtasks.add.enqueue(1, 1, channel="a", run_after=timedelta(hours=1))
    a3 = fairtasks.record.enqueue(channel="a")
    b1 = fairtasks.add.enqueue(1, 1, channel="b")
    b2 = fairtasks.record.enqueue(channel="b")
    running = fairtasks.add.enqueue(1, 1, channel="c")
    claim()  # takes a1, a3, b1, b2, running (a2 is scheduled)
    for m in Message.objects.filter(state="running").exclude(pk=running):
        # back to waiting, all but `running`
        message_store.release_messages([(m.id, m.lease_token)])

    assert cancel([a1, running, 999_999]) == [a1]
    assert sorted(cancel(channel="a", task=fairtasks.record)) == [a3]
    assert sorted(cancel(task="tests.fair.add")) == sorted([a2, b1])
    assert cancel(channel="b") == [b2]
    assert cancel(channel="no such channel") == []
    assert state(running) == MessageState.RUNNING
    assert Message.objects.filter(state="cancelled").count() == 5
    assert_counters_match_table()


@pytest.mark.django_db
def test_cancel_needs_a_selection_and_not_two() -> None:
    with pytest.raises(ValueError, match="needs ids"):
        cancel()
    with pytest.raises(ValueError, match="not both"):
        cancel([1], channel="a")
    with pytest.raises(TypeError, match="must be an integer"):
        cancel(["1"])  # type: ignore[list-item]


@pytest.mark.django_db(transaction=True)
def test_cancel_racing_claims_takes_each_message_once_and_frees_no_slot() -> None:
    """Claimers and cancellers on the same messages at once: each message ends either
    cancelled or claimed, never both, and the running counter matches the table."""
    ids = [fairtasks.add.enqueue(i, i, channel=f"c{i % 5}") for i in range(300)]

    def target(i: int) -> tuple[set[int], set[int]]:
        claimed: set[int] = set()
        cancelled: set[int] = set()
        for round_ in range(15):
            if i % 2:
                got = message_store.claim_messages(5, lease=LEASE, worker_id=f"w{i}")
                claimed |= {m.id for m in got}
                message_store.complete_messages([(m.id, m.lease_token, None) for m in got[:2]])
            else:
                chunk = ids[(i * 37 + round_ * 11) % 280 :][:20]
                cancelled |= set(cancel(chunk))
        return claimed, cancelled

    results = run_threads(6, target)
    claimed = set().union(*(r[0] for r in results))
    cancelled = set().union(*(r[1] for r in results))
    assert claimed and cancelled
    assert not claimed & cancelled
    assert Message.objects.filter(state="cancelled").count() == len(cancelled)
    assert_counters_match_table()


# ------------------------------------------------------------------------------------------------
# abort: statements


@pytest.mark.django_db
def test_abort_cancels_waiting_messages_and_flags_running_ones() -> None:
    waiting = fairtasks.add.enqueue(1, 1, channel="a", run_after=timedelta(hours=1))
    running = fairtasks.add.enqueue(2, 2, channel="a")
    (m,) = claim()
    assert abort([waiting, running, 999_999]) == {
        waiting: "cancelled",
        running: "abort_requested",
    }
    assert state(waiting) == "cancelled"
    row = Message.objects.get(pk=running)
    assert row.state == "running" and row.abort_requested_at is not None
    # the worker's heartbeat sees it
    assert message_store.heartbeat_messages([(m.id, m.lease_token)], lease=LEASE) == {running: True}
    assert_counters_match_table()


@pytest.mark.django_db
def test_an_aborted_attempt_is_settled_once_and_a_late_completion_changes_nothing() -> None:
    mid = fairtasks.add.enqueue(1, 1, channel="a")
    (m,) = claim()
    abort([mid])
    error = {"type": "django_fairqueue.exceptions.TaskAborted", "message": "stop"}
    assert message_store.settle_aborted_messages([(m.id, m.lease_token, error)]) == {mid}
    assert message_store.settle_aborted_messages([(m.id, m.lease_token, error)]) == set()
    assert message_store.complete_messages([(m.id, m.lease_token, 3)]) == set()
    assert message_store.fail_messages([(m.id, m.lease_token, {}, timedelta(0))]) == {}
    row = Message.objects.get(pk=mid)
    assert (row.state, row.lease_token, row.last_error["message"]) == ("aborted", None, "stop")
    assert_counters_match_table()


@pytest.mark.django_db
@pytest.mark.parametrize("how", ["fail", "release", "rescue"])
def test_a_message_with_an_abort_requested_is_never_retried(how: str) -> None:
    mid = fairtasks.add.enqueue(1, 1, channel="a")
    (m,) = claim()
    abort([mid])
    if how == "fail":
        assert message_store.fail_messages(
            [(m.id, m.lease_token, {"type": "E"}, timedelta(0))]
        ) == {mid: "aborted"}
    elif how == "release":
        assert message_store.release_messages([(m.id, m.lease_token)]) == {mid}
    else:
        Message.objects.filter(pk=mid).update(lease_expires_at="2000-01-01T00:00:00Z")
        assert [r.state for r in message_store.rescue_expired_messages()] == ["aborted"]
    assert state(mid) == "aborted"
    assert_counters_match_table()


@pytest.mark.django_db
def test_abort_by_channel_and_task_asks_the_running_messages_only() -> None:
    ids = [fairtasks.add.enqueue(i, i, channel="a") for i in range(3)]
    other = fairtasks.record.enqueue(channel="a")
    claim(3)
    waiting = fairtasks.add.enqueue(9, 9, channel="a")
    done = abort(channel="a", task=fairtasks.add)
    assert done == dict.fromkeys(ids, "abort_requested")
    assert state(other) == "ready" and state(waiting) == "ready"
    assert abort(channel="nowhere") == {}


@pytest.mark.django_db(transaction=True)
def test_abort_racing_completion_leaves_consistent_counters() -> None:
    """Completers, failers and aborters on the same running messages at once: every message is
    settled exactly once (succeeded, retried, failed or aborted) and the counters match."""
    for i in range(200):
        fairtasks.add.enqueue(i, i, channel=f"c{i % 4}")
    claimed = claim(200)
    assert len(claimed) == 200
    by_id = {m.id: m for m in claimed}
    ids = sorted(by_id)
    settled: list[set[int]] = []

    def target(i: int) -> set[int]:
        mine: set[int] = set()
        for round_ in range(10):
            chunk = ids[(i * 23 + round_ * 17) % 180 :][:20]
            if i % 3 == 0:
                abort(chunk)
            elif i % 3 == 1:
                mine |= message_store.complete_messages(
                    [(j, by_id[j].lease_token, None) for j in chunk]
                )
            else:
                mine |= set(
                    message_store.fail_messages(
                        [(j, by_id[j].lease_token, {"type": "E"}, None) for j in chunk]
                    )
                )
        aborting = Message.objects.filter(pk__in=chunk, state="running").exclude(
            abort_requested_at=None
        )
        mine |= message_store.settle_aborted_messages(
            [(m.id, by_id[m.id].lease_token, {"type": "TaskAborted"}) for m in aborting]
        )
        return mine

    settled = run_threads(6, target)
    total = sum(len(s) for s in settled)
    assert total == len(set().union(*settled))  # nothing settled twice
    assert_counters_match_table()


# ------------------------------------------------------------------------------------------------
# abort: the worker


def _worker(**config: Any) -> Worker:
    config.setdefault("worker_id", "abort-worker")
    config.setdefault("listen", False)
    config.setdefault("maintenance", False)
    config.setdefault("lease", timedelta(seconds=0.6))  # a heartbeat every 0.2 s
    return Worker(WorkerConfig(**config))


@pytest.mark.django_db(transaction=True)
def test_a_cooperative_task_stops_and_ends_aborted(tmp_path: Any, settings: Any) -> None:
    settings.FAIRQUEUE = {**settings.FAIRQUEUE, "ABORT_GRACE": 30}
    marker = tmp_path / "started"
    mid = fairtasks.until_aborted.enqueue(str(marker), 30.0, channel="a")
    worker = _worker(concurrency=2)
    thread = run_in_thread(worker)
    try:
        wait_until(marker.exists, what="the task started")
        started = time.monotonic()
        assert abort([mid]) == {mid: "abort_requested"}
        wait_until(lambda: state(mid) == "aborted", timeout=10, what="aborted")
        assert time.monotonic() - started < 5  # the heartbeat, not the grace period
    finally:
        worker.stop()
        thread.join(30)
    row = Message.objects.get(pk=mid)
    assert row.attempts == 1 and row.result is None
    assert row.last_error["type"] == "django_fairqueue.exceptions.TaskAborted"
    assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
def test_a_task_that_ignores_the_abort_is_aborted_at_the_grace_period(
    tmp_path: Any, settings: Any, caplog: Any
) -> None:
    settings.FAIRQUEUE = {**settings.FAIRQUEUE, "ABORT_GRACE": 0.5}
    marker = tmp_path / "started"
    stubborn = fairtasks.ignores_abort.enqueue(str(marker), 3.0, channel="a")
    worker = _worker(concurrency=1)
    thread = run_in_thread(worker)
    try:
        wait_until(marker.exists, what="the task started")
        abort([stubborn])
        wait_until(lambda: worker.ledger.stuck == 1, timeout=3, what="aborted at grace")
        # its thread was replaced: the next message runs while the stuck one still sleeps
        after = fairtasks.add.enqueue(1, 2, channel="a")
        wait_until(lambda: state(after) == "succeeded", timeout=5, what="the next message ran")
        # written once its thread returned: its channel's cap counted it until then
        assert state(stubborn) == "running"
        wait_until(lambda: state(stubborn) == "aborted", timeout=5, what="its thread returned")
    finally:
        worker.stop()
        thread.join(30)
    row = Message.objects.get(pk=stubborn)
    assert "ABORT_GRACE" in row.last_error["message"]
    assert row.result is None  # its late return ("finished") was discarded
    assert "after its abort's grace period ran out: discarded its outcome (succeeded); " in (
        caplog.text
    )
    assert "the attempt is settled as it was aborted then" in caplog.text
    assert_counters_match_table()


@pytest.mark.django_db
def test_abort_requested_is_false_outside_a_worker() -> None:
    assert abort_requested() is False


# ------------------------------------------------------------------------------------------------
# operators


@pytest.mark.django_db
def test_cli_cancel_and_abort() -> None:
    a = fairtasks.add.enqueue(1, 1, channel="a")
    b = fairtasks.add.enqueue(1, 1, channel="a")
    c = fairtasks.add.enqueue(1, 1, channel="b")
    out = StringIO()
    call_command("fairqueue", "cancel", str(a), "999999", "--json", stdout=out)
    assert json.loads(out.getvalue()) == {
        "action": "cancel",
        "count": 1,
        "ids": [a],
        "skipped": [999999],
    }
    out = StringIO()
    call_command("fairqueue", "cancel", "--channel", "a", stdout=out)
    assert out.getvalue().strip() == "Cancelled 1 message."
    assert state(b) == "cancelled"
    for name, said in (
        ("tests.noop", "Cancelled 0 messages."),  # registered, nothing waiting
        (
            "tests.no_such",
            "Cancelled 0 messages. No task named 'tests.no_such' is registered: check its name.",
        ),
    ):
        out = StringIO()
        call_command("fairqueue", "cancel", "--task", name, stdout=out)
        assert out.getvalue().strip() == said
    claim()
    out = StringIO()
    call_command("fairqueue", "abort", str(c), "--json", stdout=out)
    assert json.loads(out.getvalue())["abort_requested"] == [c]
    with pytest.raises(CommandError, match="not both") as both:
        call_command("fairqueue", "cancel", "1", "--channel", "a")
    with pytest.raises(CommandError, match="give message ids") as neither:
        call_command("fairqueue", "abort")
    assert both.value.returncode == neither.value.returncode == 2  # usage errors
    for verb in ("cancel", "abort"):
        # a bad queue name is a usage error (argparse's, exit 2 at a shell), as a bad channel's
        with pytest.raises(CommandError, match=r"argument --queue: queue name 'a b' may hold"):
            call_command("fairqueue", verb, "--queue", "a b")


@pytest.mark.django_db
def test_the_django_tasks_status_of_cancelled_and_aborted_messages() -> None:
    from django_fairqueue.tasks.django_compat import TaskResultStatus
    from tests.test_backend import add as backend_task  # a django.tasks task on this backend

    result = backend_task.enqueue(1, 1)
    cancel([int(result.id)])
    got = backend_task.get_backend().get_result(result.id)
    assert got.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in got.errors] == [
        "django_fairqueue.exceptions.TaskCancelled"
    ]

    result = backend_task.enqueue(2, 2)
    (m,) = claim()
    abort([m.id])
    message_store.settle_aborted_messages(
        [(m.id, m.lease_token, {"type": "django_fairqueue.exceptions.TaskAborted"})]
    )
    got = backend_task.get_backend().get_result(result.id)
    assert got.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in got.errors] == [
        "django_fairqueue.exceptions.TaskAborted"
    ]


@pytest.mark.django_db
def test_django_tasks_take_unique_keys_through_using() -> None:
    from tests.test_backend import add as backend_task

    keyed = backend_task.using(unique_key="daily", channel="acme")
    first = keyed.enqueue(1, 1)
    again = keyed.using(on_conflict="keep").enqueue(2, 2)
    assert again.id == first.id
    replaced = keyed.using(on_conflict="replace").enqueue(3, 3)
    assert replaced.id == first.id
    assert Message.objects.get(pk=int(first.id)).payload["args"] == [3, 3]


@pytest.mark.django_db
def test_cancel_and_abort_select_by_a_django_tasks_task_as_enqueued_does() -> None:
    from django_fairqueue.testing import enqueued
    from tests.test_backend import add as backend_task  # a django.tasks task on this backend
    from tests.test_testing import run_in_process  # one of another backend

    running = [int(backend_task.using(channel="cx").enqueue(i, i).id) for i in range(2)]
    claim()
    waiting = [int(backend_task.using(channel="cx").enqueue(i, i).id) for i in range(2)]
    other = fairtasks.add.enqueue(1, 1, channel="cx")
    assert [m.id for m in enqueued(task=backend_task, channel="cx")] == waiting
    assert sorted(cancel(task=backend_task, channel="cx")) == waiting
    assert abort(task=backend_task.using(priority=5)) == dict.fromkeys(running, "abort_requested")
    assert state(other) == "ready"
    with pytest.raises(ValueError, match="backend 'immediate', which is not a FairQueueBackend"):
        cancel(task=run_in_process)


@pytest.mark.django_db(transaction=True)
def test_a_prefetched_message_whose_abort_a_heartbeat_saw_ends_aborted_without_running(
    tmp_path: Any,
) -> None:
    """The guarantee for prefetched messages: once a heartbeat brought the request back, the
    message is not started (one that starts before that heartbeat runs, as documented)."""
    running, prefetched = tmp_path / "running", tmp_path / "prefetched"
    first = fairtasks.until_aborted.enqueue(str(running), 30.0, channel="a")
    worker = _worker(concurrency=1, prefetch=1)
    thread = run_in_thread(worker)
    try:
        wait_until(running.exists, what="the first task started")
        second = fairtasks.sleep.enqueue(0.0, str(prefetched), channel="b")
        wait_until(lambda: state(second) == "running", what="the second message prefetched")
        assert abort([second]) == {second: "abort_requested"}
        # settled by the heartbeat that saw it, while the handler thread is still busy
        wait_until(lambda: state(second) == "aborted", timeout=20, what="aborted")
        abort([first])  # frees the handler thread, which only frees the second's slot
        wait_until(lambda: state(first) == "aborted", timeout=10, what="the first aborted")
    finally:
        worker.stop()
        thread.join(30)
    assert not prefetched.exists()  # never started
    assert "before it started" in Message.objects.get(pk=second).last_error["message"]
    assert_counters_match_table()


@pytest.mark.django_db(transaction=True)
def test_an_abort_reaches_a_listening_worker_at_once_and_its_prefetched_message_never_starts(
    tmp_path: Any,
) -> None:
    """Told by a notification, the holding worker's heartbeat reads the request at once, not
    one interval (here 20 s) later: the prefetched message ends aborted without running."""
    running, prefetched = tmp_path / "running", tmp_path / "prefetched"
    first = fairtasks.sleep.enqueue(1.0, str(running), channel="a")
    worker = _worker(concurrency=1, prefetch=1, listen=True, lease=timedelta(seconds=60))
    thread = run_in_thread(worker)
    try:
        wait_until(worker.listening.is_set, what="the worker listening")
        wait_until(running.exists, what="the first task started")
        second = fairtasks.sleep.enqueue(0.0, str(prefetched), channel="b")
        wait_until(lambda: state(second) == "running", what="the second message prefetched")
        assert abort([second]) == {second: "abort_requested"}
        wait_until(lambda: state(first) != "running", timeout=10, what="the first finishing")
        wait_until(lambda: state(second) == "aborted", timeout=10, what="aborted")
    finally:
        worker.stop()
        thread.join(30)
    assert not prefetched.exists()  # never started: its thread freed a second later
    assert "before it started" in Message.objects.get(pk=second).last_error["message"]
    assert_counters_match_table()


#: set by the test to end the task below
_release = threading.Event()


@task(name="tests.abort.held", keep_result=True)
def held(marker: str) -> str:
    """Hold its handler thread until the test releases it (at most 30 s)."""
    Path(marker).touch()
    return "released" if _release.wait(30) else "ran out"


@pytest.mark.django_db(transaction=True)
def test_prefetched_messages_end_aborted_at_once_while_the_handler_thread_stays_busy(
    tmp_path: Any,
) -> None:
    """A heartbeat that reads the abort of messages no handler thread has taken settles them
    then, not once a thread is free: the only one runs another message meanwhile, whose
    outcome and the worker's counts are those of an abort settled by a thread."""
    _release.clear()
    marker = tmp_path / "held"
    first = held.enqueue(str(marker), channel="a")
    worker = _worker(concurrency=1, prefetch=2)
    thread = run_in_thread(worker)
    markers = [tmp_path / f"prefetched{i}" for i in range(2)]
    try:
        wait_until(marker.exists, what="the first task started")
        prefetched = [fairtasks.sleep.enqueue(0.0, str(m), channel="a") for m in markers]
        wait_until(lambda: all(state(m) == "running" for m in prefetched), what="prefetched")
        assert abort(prefetched) == dict.fromkeys(prefetched, "abort_requested")
        wait_until(
            lambda: all(state(m) == "aborted" for m in prefetched),
            timeout=2,
            what="aborted while the handler thread is busy",
        )
        assert state(first) == "running"
        _release.set()
        wait_until(lambda: state(first) == "succeeded", what="the first finishing")
        wait_until(lambda: worker.ledger.busy == 0 and worker.handled == 3, what="slots freed")
        assert worker.ledger.claimed == 3  # max_messages counts them, as before
    finally:
        _release.set()
        worker.stop()
        thread.join(30)
    assert not any(m.exists() for m in markers)  # never started
    for mid in prefetched:
        assert "before it started" in Message.objects.get(pk=mid).last_error["message"]
    row = Message.objects.get(pk=first)
    assert (row.result, row.attempts) == ("released", 1)
    assert_counters_match_table()

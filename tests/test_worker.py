"""The worker, in-process: run_once (synchronous), run() (threads), drain(), the commands.

Real worker subprocesses (kill -9, signals, SIGSTOP, LISTEN) are in test_worker_processes.py.
Tests whose worker threads open their own connections need committed data:
``django_db(transaction=True)``.
"""

from __future__ import annotations

import decimal
import itertools
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from io import StringIO
from typing import Any

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import OperationalError, connection, connections, transaction
from django.db.models import Sum
from django.utils import timezone

from django_fairqueue import conf, stats
from django_fairqueue.context import current_message
from django_fairqueue.db import channel_store, message_store, worker_store
from django_fairqueue.logging import JsonFormatter
from django_fairqueue.maintenance import (
    DeltaFolder,
    MaintenanceRunner,
    Pruner,
    Rescuer,
    in_batches,
)
from django_fairqueue.models import (
    Channel,
    ChannelStat,
    Message,
    MessageState,
    MinuteStat,
    WorkerRecord,
)
from django_fairqueue.runtime import StopFlag
from django_fairqueue.signals import message_finished, message_started
from django_fairqueue.tasks import registry, task
from django_fairqueue.testing import drain, enqueued
from django_fairqueue.worker import Outcome, Worker, WorkerConfig, retry_delay
from tests import fairtasks
from tests.factories import assert_counters_match_table, channel_state, set_limits
from tests.workerkit import counters, enqueue_raw, wait_until

SEEN: dict[str, Any] = {}


@task(name="tests.worker.capture")
def capture() -> None:
    SEEN["message"] = current_message.get()


@task(name="tests.worker.once_raises", delivery="at_most_once")
def once_raises() -> None:
    raise RuntimeError("at most once")


@task(name="tests.worker.unstorable", keep_result=True)
def unstorable(kind: str) -> Any:
    if kind == "deep":  # deeper than JSON encoding can recurse
        deep: list[Any] = []
        for _ in range(100_000):
            deep = [deep]
        return deep
    if kind == "circular":
        loop: list[Any] = []
        loop.append(loop)
        return loop
    values = {
        "set": {1, 2},
        "nan": float("nan"),
        "nul": "a\x00b",
        "backslash_nul": "a\\\x00",
        "long_int": 10**4300,  # past Python's int-to-text limit of 4,300 digits
        "decimal": decimal.Decimal("1.5"),
    }
    return values[kind]


@task(name="tests.worker.kept", keep_result=True)
def kept(value: Any) -> Any:
    return value


@task(name="tests.worker.nul_error")
def nul_error() -> None:
    raise ValueError("bad \x00 byte and a lone \udc80 surrogate")


@task(name="tests.worker.forger", max_attempts=1)
def forger() -> None:
    raise RuntimeError("a\x1b]0;x\x07b\r\nFORGED")


@task(name="tests.worker.leaky")
def leaky() -> None:
    transaction.atomic().__enter__()  # never left: the session would stay idle in transaction
    Channel.objects.count()


@task(name="tests.worker.async_add", keep_result=True)
async def async_add(a: int, b: int) -> int:
    return a + b


# ------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture
def fq(settings: Any) -> Callable[..., None]:
    """Override FAIRQUEUE keys for one test (TASK_MODULES and the rest stay)."""
    base = dict(settings.FAIRQUEUE)

    def apply(**overrides: Any) -> None:
        settings.FAIRQUEUE = {**base, **overrides}

    return apply


def one_worker(**config: Any) -> Worker:
    config.setdefault("worker_id", "test-worker")
    config.setdefault("listen", False)
    config.setdefault("maintenance", False)
    return Worker(WorkerConfig(**config))


@contextmanager
def running(worker: Worker) -> Iterator[dict[str, Any]]:
    """Run ``worker.run()`` in a thread; stop it and check it ended on leaving."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["handled"] = worker.run()
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=target, name="test-worker-run")
    thread.start()
    try:
        yield outcome
    finally:
        worker.stop()
        thread.join(30)
        assert not thread.is_alive(), "the worker did not stop"
    assert "error" not in outcome, outcome.get("error")


def message(mid: int) -> Message:
    return Message.objects.get(pk=mid)


# ------------------------------------------------------------------------------------------------
# one message, synchronously


@pytest.mark.django_db
def test_run_once_runs_a_message_and_keeps_its_result() -> None:
    mid = fairtasks.add.enqueue(2, 3, channel="alice")

    assert one_worker(concurrency=1).run_once() == 1

    row = message(mid)
    assert (row.state, row.result, row.attempts) == (MessageState.SUCCEEDED, 5, 1)
    c = counters("alice")
    assert (c.ready, c.running, c.succeeded) == (0, 0, 1)
    assert one_worker().run_once() == 0


@pytest.mark.django_db
@pytest.mark.parametrize("value", [1e17, 2.5e20, 1e308, -1e22, 12345678901234567890.0, 1.0])
def test_a_kept_float_result_comes_back_a_float(value: float) -> None:
    # jsonb prints 1e+17 back as 100000000000000000, an int to json.loads
    mid = fairtasks.add.enqueue(value, 0.0, channel="alice")
    assert one_worker(concurrency=1).run_once() == 1
    result = message(mid).result
    assert type(result) is float and result == value


@pytest.mark.django_db
def test_run_once_takes_at_most_concurrency_and_batch_size() -> None:
    for i in range(5):
        fairtasks.add.enqueue(i, i, channel="alice")
    assert one_worker(concurrency=3, batch_size=10).run_once() == 3
    assert one_worker(concurrency=3, batch_size=1).run_once() == 1
    assert len(enqueued(channel="alice")) == 1


@pytest.mark.django_db
def test_the_handler_sees_its_message_in_current_message() -> None:
    mid = capture.enqueue(channel="alice")
    SEEN.clear()

    one_worker().run_once()

    seen = SEEN["message"]
    assert (seen.id, seen.channel, seen.attempts) == (mid, "alice", 1)
    assert current_message.get() is None


@pytest.mark.django_db
def test_async_tasks_run_to_completion() -> None:
    mid = async_add.enqueue(2, 40, channel="alice")
    one_worker().run_once()
    assert message(mid).result == 42


# ------------------------------------------------------------------------------------------------
# poison messages: failed at once, with a clear error, and the worker goes on


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("task_name", "payload", "error_type", "text"),
    [
        ("tests.no_such_task", '{"args": [], "kwargs": {}}', "UnknownTask", "no task named"),
        ("tests.fair.add", '"not an object"', "PayloadError", "JSON object"),
        ("tests.fair.add", '{"args": {"a": 1}, "kwargs": {}}', "PayloadError", "'args' must"),
        ("tests.fair.add", '{"args": [1, 2], "kwargs": []}', "PayloadError", "'kwargs' must"),
        ("tests.fair.add", '{"args": [1, 2]}', "PayloadError", "'kwargs' must"),
        ("tests.fair.add", '{"args": [1, 2, 3], "kwargs": {}}', "TypeError", "too many"),
        ("tests.fair.add", '{"args": [1], "kwargs": {"c": 2}}', "TypeError", "do not fit"),
    ],
)
def test_a_message_that_cannot_run_fails_at_once_without_retries(
    task_name: str, payload: str, error_type: str, text: str
) -> None:
    bad = enqueue_raw("alice", task_name, payload, max_attempts=5)
    good = fairtasks.add.enqueue(1, 1, channel="alice")

    assert drain() == 2

    row = message(bad)
    assert (row.state, row.attempts) == (MessageState.FAILED, 1)
    error = row.last_error
    assert error is not None
    assert error["type"].endswith(error_type)
    assert text in error["message"]
    assert (error["attempt"], error["worker"], error["traceback"]) == (
        1,
        "django_fairqueue.testing.drain",
        None,
    )
    assert message(good).state == MessageState.SUCCEEDED
    c = counters("alice")
    assert (c.ready, c.running, c.failed, c.succeeded) == (0, 0, 1, 1)


def test_arguments_are_checked_as_signature_bind_checks_them() -> None:
    """The worker's check of a message's arguments (a shortcut for the usual signature, where
    every parameter may be given by position or by name) agrees with ``Signature.bind``."""
    import inspect

    from django_fairqueue.tasks.spec import TaskSpec, check_arguments

    def none() -> None: ...
    def two(a: int, b: int) -> None: ...
    def defaults(a: int, b: int = 2, c: int = 3) -> None: ...
    def keyword_only(a: int, *, b: int) -> None: ...
    def var(a: int, *args: int, b: int = 1, **kwargs: int) -> None: ...

    names = ["a", "b", "c", "d"]
    for func in (none, two, defaults, keyword_only, var):
        spec = TaskSpec(name=f"tests.check.{func.__name__}", func=func)
        sig = inspect.signature(func)
        for given in range(5):
            for n in range(len(names) + 1):
                for keys in itertools.combinations(names, n):
                    args, kwargs = list(range(given)), dict.fromkeys(keys, 0)
                    try:
                        sig.bind(*args, **kwargs)
                        fits = True
                    except TypeError:
                        fits = False
                    if fits:
                        check_arguments(spec, args, kwargs)
                    else:
                        with pytest.raises(TypeError, match="do not fit"):
                            check_arguments(spec, args, kwargs)


@pytest.mark.django_db
def test_a_raising_task_is_retried_with_backoff_then_dead_lettered(fq: Any) -> None:
    fq(RETRY_BACKOFF_BASE=100.0, RETRY_BACKOFF_MAX=1000.0)
    mid = fairtasks.boom.enqueue("kaput", channel="alice")
    before = timezone.now()

    assert drain() == 1

    row = message(mid)
    assert row.state == MessageState.SCHEDULED
    # attempt 1 waits RETRY_BACKOFF_BASE * 2**0 = 100 s, jittered down to no less than half
    assert before + timedelta(seconds=49) <= row.run_at <= timezone.now() + timedelta(seconds=101)
    error = row.last_error
    assert error is not None
    assert error["type"] == "tests.fairtasks.BoomError"
    assert error["message"] == "kaput"
    assert "raise BoomError(text)" in error["traceback"]
    assert (error["attempt"], error["worker"]) == (1, "django_fairqueue.testing.drain")
    assert drain() == 0  # not due yet
    c = counters("alice")
    assert (c.ready, c.scheduled, c.running) == (0, 1, 0)


@pytest.mark.django_db
def test_out_of_attempts_the_message_is_dead_lettered(fq: Any) -> None:
    fq(RETRY_BACKOFF_BASE=0)  # retries are due at once, so drain() runs every attempt
    mid = fairtasks.boom.enqueue(channel="alice")

    assert drain() == 2  # max_attempts=2

    row = message(mid)
    assert (row.state, row.attempts, row.last_error["attempt"]) == (MessageState.FAILED, 2, 2)
    assert row.finished_at is not None
    c = counters("alice")
    assert (c.ready, c.scheduled, c.running, c.failed) == (0, 0, 0, 1)


def test_retry_delay_doubles_per_attempt_with_jitter_and_a_cap(fq: Any) -> None:
    fq(RETRY_BACKOFF_BASE=2.0, RETRY_BACKOFF_MAX=50.0)
    for attempt, step in [(1, 2.0), (2, 4.0), (3, 8.0), (5, 32.0), (6, 50.0), (10_000, 50.0)]:
        delays = [retry_delay(attempt) for _ in range(200)]
        assert all(step / 2 <= d <= step for d in delays), (attempt, min(delays), max(delays))
        assert max(delays) - min(delays) > step / 10  # jittered, not constant


@pytest.mark.django_db
def test_at_most_once_fails_without_retry_and_a_lost_lease_dead_letters_it() -> None:
    raising = once_raises.enqueue(channel="alice")
    # enqueued while the task was still at-least-once: the worker follows the task's delivery
    switched = enqueue_raw("alice", once_raises.name, '{"args": [], "kwargs": {}}', 5)
    assert drain() == 2
    row = message(raising)
    assert (row.state, row.attempts, row.max_attempts) == (MessageState.FAILED, 1, 1)
    row = message(switched)
    assert (row.state, row.attempts, row.max_attempts) == (MessageState.FAILED, 1, 5)

    # A worker that dies mid-handler: the rescuer dead-letters the message, never reruns it.
    crashed = fairtasks.at_most_once.enqueue(channel="bob")
    _rescued_after_its_worker_died(crashed)
    row = message(crashed)
    assert (row.state, row.attempts, row.last_error["type"]) == (
        MessageState.FAILED,
        1,
        "LeaseExpired",
    )
    assert drain() == 0

    # ... and so does it for one enqueued while the task was at-least-once (attempts to spare)
    switched = enqueue_raw("carol", once_raises.name, '{"args": [], "kwargs": {}}', 5)
    _rescued_after_its_worker_died(switched)
    row = message(switched)
    assert (row.state, row.attempts, row.max_attempts) == (MessageState.FAILED, 1, 5)


def _rescued_after_its_worker_died(expected: int) -> None:
    """Claim ``expected`` under a lease that expires at once, as a worker that died, and let
    the rescuer take it back."""
    (claimed,) = message_store.claim_messages(
        1, lease=timedelta(milliseconds=1), worker_id="doomed"
    )
    assert claimed.id == expected
    time.sleep(0.01)
    assert Rescuer().run_once() == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("set", "(set) cannot be stored as JSON: Object of type set is not JSON serializable"),
        ("nan", "(float) cannot be stored as JSON: Out of range float values are not JSON"),
        ("nul", "(str) cannot be stored as JSON: it contains a NUL character"),
        ("backslash_nul", "(str) cannot be stored as JSON: it contains a NUL character"),
        ("long_int", "(int) cannot be stored as JSON: Exceeds the limit (4300 digits)"),
        ("decimal", "(decimal.Decimal) cannot be stored as JSON: Object of type Decimal is not"),
        ("deep", "(list) cannot be stored as JSON: it is nested too deeply"),
        ("circular", "(list) cannot be stored as JSON: Circular reference detected"),
    ],
)
def test_a_result_that_cannot_be_stored_fails_the_message_without_retry(
    kind: str, why: str
) -> None:
    mid = unstorable.enqueue(kind, channel="alice")
    assert drain() == 1
    row = message(mid)
    assert (row.state, row.attempts) == (MessageState.FAILED, 1)
    assert row.last_error["type"] == "django_fairqueue.exceptions.ResultNotStorable"
    text = row.last_error["message"]
    assert text.startswith(f"the return value of tests.worker.unstorable {why}"), text
    assert text.endswith("; the task ran, and is not retried"), text


@pytest.mark.django_db
@pytest.mark.parametrize("value", [r"x\u0000y", {r"k\u0000": [r"\\u0000", "\\"]}])
def test_a_result_with_a_backslash_before_u0000_is_kept(value: Any) -> None:
    # a backslash followed by "u0000" is text, not the NUL character jsonb refuses
    mid = kept.enqueue(value, channel="alice")
    assert drain() == 1
    row = message(mid)
    assert (row.state, row.result) == (MessageState.SUCCEEDED, value)


@pytest.mark.django_db
def test_error_text_postgres_would_refuse_is_stored_escaped() -> None:
    mid = nul_error.enqueue(channel="alice")
    assert drain() == 1
    row = message(mid)
    assert row.state == MessageState.SCHEDULED
    assert row.last_error["message"] == "bad \\x00 byte and a lone \\udc80 surrogate"


@pytest.mark.django_db
def test_a_tasks_error_is_escaped_in_the_worker_log_line_whatever_the_handler(
    caplog: pytest.LogCaptureFixture,
) -> None:
    forger.enqueue(channel="alice")
    # caplog's handler formats as a project's plain LOGGING handler does
    with caplog.at_level(logging.INFO, logger="django_fairqueue.worker"):
        assert drain() == 1
    (line,) = [r.getMessage() for r in caplog.records if "failed for good" in r.getMessage()]
    assert line.startswith("failed for good (RuntimeError: a\\x1b]0;x\\x07b\\r\\nFORGED) ")
    assert line.isprintable()
    assert "\x1b" not in caplog.text and "\nFORGED" not in caplog.text
    # a JSON log writes the line escaped once, as the plain one reads
    (record,) = [r for r in caplog.records if r.getMessage() == line]
    assert json.loads(JsonFormatter().format(record))["message"] == line


@pytest.mark.django_db(transaction=True)
def test_the_worker_id_is_escaped_in_the_starting_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="django_fairqueue.worker"):
        one_worker(worker_id="w\x1b]0;x\x07\nFORGED", burst=True).run()
    (line,) = [r.getMessage() for r in caplog.records if "starting:" in r.getMessage()]
    assert line.startswith("worker w\\x1b]0;x\\x07\\nFORGED starting: ")
    assert line.isprintable()
    assert ", fair by time" in line  # the default mode: a fleet runs one, and the log shows it


# ------------------------------------------------------------------------------------------------
# channels, limits, stopping


@pytest.mark.django_db
def test_channel_filters_include_exclude_and_channels_created_later() -> None:
    for name in ("a", "b", "c"):
        fairtasks.add.enqueue(1, 1, channel=name)

    only_a = one_worker(concurrency=10, channels=["a", "later"], poll_interval=0.01)
    assert only_a.run_once() == 1
    assert [m.channel.name for m in enqueued()] == ["b", "c"]

    assert one_worker(concurrency=10, exclude_channels=["b"]).run_once() == 1
    assert [m.channel.name for m in enqueued()] == ["b"]

    # "later" did not exist when only_a first resolved its channels; it is picked up once
    # it does (names are resolved again every poll interval while some are missing).
    fairtasks.add.enqueue(1, 1, channel="later")
    time.sleep(0.02)
    assert only_a.run_once() == 1
    assert [m.channel.name for m in enqueued()] == ["b"]


@pytest.mark.django_db
def test_max_messages_stops_drain() -> None:
    for i in range(5):
        fairtasks.add.enqueue(i, 0, channel="alice")
    assert drain(max_messages=3) == 3
    assert len(enqueued()) == 2


@pytest.mark.django_db
def test_a_stop_during_the_claim_gives_the_claimed_messages_back_unstarted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = [fairtasks.add.enqueue(i, 0, channel="alice") for i in range(3)]
    worker = one_worker(concurrency=3)
    real_claim = message_store.claim_messages

    def claim_then_signal(*args: Any, **kwargs: Any) -> list[message_store.ClaimedMessage]:
        claimed = real_claim(*args, **kwargs)
        worker.stop()  # SIGTERM arriving while the claim was in flight
        return claimed

    monkeypatch.setattr(message_store, "claim_messages", claim_then_signal)
    assert worker.run_once() == 0
    rows = Message.objects.filter(pk__in=ids)
    assert {(r.state, r.attempts, r.lease_token) for r in rows} == {(MessageState.READY, 0, None)}
    c = counters("alice")
    assert (c.ready, c.running) == (3, 0)


# ------------------------------------------------------------------------------------------------
# the threaded loop


@pytest.mark.django_db(transaction=True)
def test_run_in_burst_mode_drains_every_channel_then_returns() -> None:
    ids = [fairtasks.add.enqueue(i, 1, channel=f"c{i % 3}") for i in range(30)]
    worker = one_worker(concurrency=3, batch_size=4, burst=True)

    assert worker.run() == 30

    rows = Message.objects.filter(pk__in=ids)
    assert {r.state for r in rows} == {MessageState.SUCCEEDED}
    assert sorted(r.result for r in rows) == sorted(i + 1 for i in range(30))
    for name in ("c0", "c1", "c2"):
        c = counters(name)
        assert (c.ready, c.running, c.succeeded) == (0, 0, 10)


@pytest.mark.django_db(transaction=True)
def test_an_empty_claim_under_contention_does_not_end_a_burst_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A claim comes back empty when concurrent claims hold the channel rows it wanted (SKIP
    # LOCKED), though messages wait. Here the first five claims meet such peers, with nothing
    # in flight: more than the quick retries absorb, so the lock-free check must see the work.
    ids = [fairtasks.add.enqueue(i, 0, channel="solo") for i in range(12)]
    real_claim = message_store.claim_messages
    calls = 0

    def contended(*args: Any, **kwargs: Any) -> list[message_store.ClaimedMessage]:
        nonlocal calls
        calls += 1
        return [] if calls <= 5 else real_claim(*args, **kwargs)

    monkeypatch.setattr(message_store, "claim_messages", contended)
    assert one_worker(concurrency=2, burst=True).run() == 12
    assert {r.state for r in Message.objects.filter(pk__in=ids)} == {MessageState.SUCCEEDED}


@pytest.mark.django_db(transaction=True)
def test_burst_waits_for_retries_that_are_ready_at_once(fq: Any) -> None:
    fq(RETRY_BACKOFF_BASE=0)
    mid = fairtasks.fail_first.enqueue(channel="alice")
    assert one_worker(concurrency=2, burst=True).run() == 2
    row = message(mid)
    assert (row.state, row.attempts) == (MessageState.SUCCEEDED, 2)


@pytest.mark.django_db(transaction=True)
def test_max_messages_in_the_threaded_loop() -> None:
    for i in range(6):
        fairtasks.add.enqueue(i, 0, channel="alice")
    assert one_worker(concurrency=2, max_messages=4).run() == 4
    assert len(enqueued()) == 2


@pytest.mark.django_db(transaction=True)
def test_heartbeats_keep_a_long_handlers_lease_alive(tmp_path: Any) -> None:
    marker = tmp_path / "started"
    mid = fairtasks.sleep.enqueue(2.5, str(marker), channel="alice")
    # lease 1 s, renewed every 1/3 s; the worker's own rescuer looks every 0.1 s
    config = WorkerConfig(
        concurrency=1, lease=timedelta(seconds=1), burst=True, listen=False, worker_id="hb"
    )
    worker = Worker(config, services=[Rescuer(every=0.1)])
    leases: set[Any] = set()

    def watch() -> None:
        try:
            while not marker.exists():
                time.sleep(0.01)
            while (row := message(mid)).state == MessageState.RUNNING:
                leases.add(row.lease_expires_at)
                time.sleep(0.05)
        finally:
            connections.close_all()

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert worker.run() == 1
    finally:
        watcher.join(10)

    row = message(mid)
    # one attempt: the lease never expired although the handler ran for > 3 lease periods
    assert (row.state, row.attempts) == (MessageState.SUCCEEDED, 1)
    assert len(leases) >= 4, leases  # the lease moved forward while the handler slept


@pytest.mark.django_db(transaction=True)
def test_polling_alone_picks_up_work_without_listen() -> None:
    worker = one_worker(concurrency=1, poll_interval=0.2)
    with running(worker):
        time.sleep(0.3)  # idle: past its first (empty) claim
        mid = fairtasks.add.enqueue(1, 2, channel="alice")
        wait_until(lambda: message(mid).state == MessageState.SUCCEEDED, timeout=10)
    assert worker.listening.is_set() is False


@pytest.mark.django_db(transaction=True)
def test_a_capped_channel_drains_without_waiting_for_the_poll() -> None:
    # One message at a time: each completion frees the slot the next one needs. No
    # notification says so; the worker claims again after recording a completion.
    Channel.objects.create(name="capped", max_concurrency=1)
    ids = [fairtasks.add.enqueue(i, 0, channel="capped") for i in range(4)]
    worker = one_worker(concurrency=4, poll_interval=60.0)
    with running(worker):
        wait_until(lambda: counters("capped").succeeded == 4, timeout=20)
    assert {r.result for r in Message.objects.filter(pk__in=ids)} == {0, 1, 2, 3}


@pytest.mark.django_db(transaction=True)
def test_listen_wakes_an_idle_worker_long_before_the_poll(fq: Any) -> None:
    fq(POLL_INTERVAL=60.0)
    worker = one_worker(concurrency=1, listen=True)
    with running(worker):
        assert worker.listening.wait(10)
        time.sleep(0.2)  # let the first (empty) claim pass: now only a wake-up can help
        mid = fairtasks.record.enqueue("ping", channel="alice")
        committed = time.time()
        row = wait_until(
            lambda: (m := message(mid)).state == MessageState.SUCCEEDED and m, timeout=20
        )
    latency = row.result["started"] - committed
    assert latency < 10, latency  # the poll would have taken 60 s


@pytest.mark.django_db(transaction=True)
def test_a_wake_up_claim_that_meets_a_locked_channel_tries_again_soon(fq: Any) -> None:
    # The claim skips channel rows other transactions hold (SKIP LOCKED). When the one claim a
    # wake-up triggers meets the new message's channel locked for a moment (the maintenance
    # thread folding counters, an operator's edit), the worker must not sleep until its poll.
    fq(POLL_INTERVAL=60.0)
    first = fairtasks.add.enqueue(1, 1, channel="alice")
    worker = one_worker(concurrency=1, listen=True)
    with running(worker):
        assert worker.listening.wait(10)
        wait_until(lambda: message(first).state == MessageState.SUCCEEDED)
        time.sleep(0.2)  # idle now: only a wake-up (or the 60 s poll) makes it claim
        misses_before = worker.claimer.due_misses
        # an autocommit connection like the listener's; the lock lasts until the block ends
        with psycopg.connect(**worker.listener.params()) as locker, locker.transaction():
            locker.execute("SELECT 1 FROM fairqueue_channel WHERE name = 'alice' FOR UPDATE")
            mid = fairtasks.record.enqueue("ping", channel="alice")
            # the woken claim came back empty although the queue said work was claimable (the
            # channel was locked): the worker backs off briefly instead of waiting for the poll
            wait_until(lambda: worker.claimer.due_misses > misses_before, timeout=10)
        released = time.time()
        row = wait_until(
            lambda: (m := message(mid)).state == MessageState.SUCCEEDED and m, timeout=20
        )
    assert row.result["started"] - released < 5  # not the 60 s poll


@pytest.mark.django_db(transaction=True)
def test_the_worker_survives_its_connections_being_killed_and_retries_settlements(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="django_fairqueue")
    marker = tmp_path / "started"
    worker = one_worker(
        concurrency=2,
        poll_interval=0.2,
        maintenance=True,
        listen=True,
        lease=timedelta(seconds=1.5),  # a heartbeat every 0.5 s
    )
    with running(worker):
        # every thread holds a connection: the settler settled something, the heartbeat beat
        first = fairtasks.add.enqueue(1, 1, channel="alice")
        wait_until(lambda: message(first).state == MessageState.SUCCEEDED)
        mid = fairtasks.sleep.enqueue(1.5, str(marker), channel="alice")
        wait_until(marker.exists)
        assert worker.listening.wait(10)
        time.sleep(0.7)
        # A database restart, as seen by this worker: every session of it ends mid-run
        # (claimer, settler, heartbeat, maintenance, listener), while a handler is busy.
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND backend_type = 'client backend'"
            )
            (killed,) = cursor.fetchone()
        assert killed >= 3
        # the handler's outcome is written over a new connection: settled, not lost
        wait_until(lambda: message(mid).state == MessageState.SUCCEEDED, timeout=20)
        # and the worker still claims, and listens again
        later = fairtasks.add.enqueue(2, 2, channel="alice")
        wait_until(lambda: message(later).state == MessageState.SUCCEEDED, timeout=20)
        wait_until(worker.listening.is_set, timeout=20)
    assert message(mid).attempts == 1
    assert "writing 1 outcomes failed: database unavailable" in caplog.text  # then retried
    assert "heartbeat failed: database unavailable" in caplog.text
    assert "wake-up listener lost its connection" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_task_that_leaves_a_transaction_open_does_not_leave_its_session_idle_in_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="django_fairqueue")
    mid = leaky.enqueue(channel="alice")
    worker = one_worker(concurrency=1, poll_interval=0.1)
    with running(worker):
        wait_until(lambda: counters("alice").succeeded == 1)  # (its row is deleted: no result)
        # the handler thread stays alive, waiting for its next message
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND state LIKE 'idle in transaction%%'"
            )
            (idle_in_transaction,) = cursor.fetchone()
    assert idle_in_transaction == 0
    assert f"(message {mid}) left a transaction open" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_worker_releases_messages_handed_over_after_the_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = [fairtasks.add.enqueue(i, 0, channel="alice") for i in range(4)]
    worker = one_worker(concurrency=4)
    real_claim = message_store.claim_messages

    def claim_then_signal(*args: Any, **kwargs: Any) -> list[message_store.ClaimedMessage]:
        claimed = real_claim(*args, **kwargs)
        if claimed:
            worker.stop()
        return claimed

    monkeypatch.setattr(message_store, "claim_messages", claim_then_signal)
    assert worker.run() == 0
    rows = Message.objects.filter(pk__in=ids)
    assert {(r.state, r.attempts) for r in rows} == {(MessageState.READY, 0)}
    assert counters("alice").running == 0


# ------------------------------------------------------------------------------------------------
# fencing: a stale claimant's writes change nothing


@pytest.mark.django_db
def test_writes_of_a_worker_whose_lease_was_taken_over_change_nothing() -> None:
    mid = fairtasks.add.enqueue(1, 2, channel="alice")
    stale = one_worker(worker_id="stale")
    (old,) = message_store.claim_messages(1, lease=timedelta(milliseconds=1), worker_id="stale")
    time.sleep(0.01)
    assert Rescuer().run_once() == 1
    (new,) = message_store.claim_messages(1, lease=timedelta(minutes=1), worker_id="fresh")
    assert new.id == old.id == mid

    done = [Outcome(old, "succeeded", result=99)]
    stale.settle(done)
    failed = [Outcome(old, "failed", error={"type": "X"})]
    stale.settle(failed)
    assert (
        message_store.heartbeat_messages([(old.id, old.lease_token)], lease=timedelta(hours=1))
        == {}
    )

    row = message(mid)
    assert (row.state, row.worker_id, row.lease_token) == (
        MessageState.RUNNING,
        "fresh",
        new.lease_token,
    )
    assert row.lease_expires_at == new.lease_expires_at
    assert counters("alice").running == 1
    assert done == failed == []  # written (and fenced), not left to retry


# ------------------------------------------------------------------------------------------------
# testing helpers


@pytest.mark.django_db
def test_enqueued_and_drain_in_a_test_transaction() -> None:
    fairtasks.add.enqueue(1, 2, channel="alice")
    fairtasks.add.enqueue(3, 4, channel="bob")
    fairtasks.record.enqueue("x", channel="alice")

    assert [m.payload for m in enqueued(task=fairtasks.add, channel="alice")] == [
        {"args": [1, 2], "kwargs": {}}
    ]
    assert len(enqueued(task="tests.fair.record")) == 1
    assert len(enqueued()) == 3

    assert drain(channels="bob") == 1
    assert len(enqueued()) == 2
    assert drain() == 2
    assert enqueued() == []


@pytest.mark.django_db
def test_drain_survives_a_task_whose_database_error_would_break_the_transaction() -> None:
    @task(name="tests.worker.bad_sql")
    def bad_sql() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT * FROM no_such_table")

    try:
        mid = bad_sql.enqueue(channel="alice")
        ok = fairtasks.add.enqueue(1, 1, channel="alice")
        assert drain() == 2
        assert message(mid).state == MessageState.SCHEDULED  # retried later
        assert message(ok).state == MessageState.SUCCEEDED
    finally:
        registry.unregister("tests.worker.bad_sql")


# ------------------------------------------------------------------------------------------------
# maintenance


@pytest.mark.django_db
def test_maintenance_services_rescue_prune_and_fold(fq: Any) -> None:
    fq(RESULT_RETENTION=0)
    expired = fairtasks.add.enqueue(1, 1, channel="alice")
    message_store.claim_messages(1, lease=timedelta(milliseconds=1), worker_id="gone")
    done = fairtasks.add.enqueue(2, 2, channel="bob")
    drain(channels="bob")
    assert message(done).state == MessageState.SUCCEEDED
    time.sleep(0.01)

    out = StringIO()
    call_command("fairqueue", "maintain", "--once", stdout=out)

    assert re.fullmatch(
        r"folder: \d+, rescuer: 1, pruner: 1, stats-pruner: 0, batch-rescuer: 0, batch-pruner: 0, "
        r"verifier: 0, scheduler: 0",
        out.getvalue().strip(),
    )
    assert message(expired).state == MessageState.READY
    assert not Message.objects.filter(pk=done).exists()
    assert DeltaFolder().run_once() == 1  # the rescue's own delta
    assert Pruner().run_once() == Rescuer().run_once() == 0
    alice = channel_state("alice")
    assert (alice["ready_count"], alice["running_count"]) == (1, 0)


@pytest.mark.django_db(transaction=True)
def test_a_pass_cut_short_by_its_batch_limit_runs_again_at_once_not_an_interval_later(
    fq: Any,
) -> None:
    """Pruning at the rate messages finish: one pass per interval, capped, fell behind."""
    fq(RESULT_RETENTION=0)
    for i in range(25):
        fairtasks.add.enqueue(i, i, channel="pruned")
    assert drain(channels="pruned") == 25
    time.sleep(0.01)
    pruner = Pruner(batch_size=5, max_batches=2, every=3600)  # a pass prunes at most 10
    stop = StopFlag()

    def maintain() -> None:
        try:
            MaintenanceRunner([pruner], stop=stop).run()
        finally:
            connections.close_all()  # (this thread's)

    runner = threading.Thread(target=maintain)
    runner.start()
    try:
        wait_until(lambda: not Message.objects.exists(), timeout=10, what="all pruned")
    finally:
        stop.set()
        runner.join(10)
    assert not pruner.more  # its last pass found the end


def test_in_batches_says_whether_a_full_batch_ended_the_pass() -> None:
    left = [12]

    def step(limit: int) -> int:
        handled = min(limit, left[0])
        left[0] -= handled
        return handled

    assert in_batches(step, 5, 2) == (10, True)
    assert in_batches(step, 5, 2) == (2, False)
    assert in_batches(step, 5, 2) == (0, False)


# ------------------------------------------------------------------------------------------------
# the command


@pytest.mark.django_db(transaction=True)
def test_a_worker_waits_out_a_database_unavailable_as_it_starts(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Workers and database started together: the first registrations are refused."""
    real = worker_store.register_worker
    refusals = [OperationalError("the database system is starting up")] * 2

    def register_worker(*args: Any, **kwargs: Any) -> Any:
        if refusals:
            raise refusals.pop()
        return real(*args, **kwargs)

    monkeypatch.setattr(worker_store, "register_worker", register_worker)
    fairtasks.add.enqueue(1, 1, channel="alice")
    with caplog.at_level(logging.WARNING, logger="django_fairqueue.worker"):
        assert one_worker(burst=True).run() == 1
    assert sum("registering failed" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.django_db
def test_a_worker_refuses_to_start_on_a_database_missing_its_migrations() -> None:
    """Deployed before `migrate` ran: it says what to do instead of failing on a column."""
    with connection.cursor() as cur:
        cur.execute(
            "DELETE FROM django_migrations WHERE app = 'fairqueue' AND name = ("
            "SELECT max(name) FROM django_migrations WHERE app = 'fairqueue') RETURNING name"
        )
        (latest,) = cur.fetchone()
    with pytest.raises(
        CommandError,
        match=rf"lacks 1 of django-fairqueue's migrations "
        rf"\(the first: {latest}\): run `manage.py migrate`",
    ):
        call_command("runfairworker", "--burst", "--no-listen")
    with pytest.raises(CommandError, match="lacks 1 of"):  # a supervisor: before any child
        call_command("runfairworker", "--burst", "--processes", "2")


@pytest.mark.django_db(transaction=True)
def test_a_worker_started_while_the_database_is_unavailable_checks_its_migrations_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unchecked at start (no answer), the check runs once the database answers, before the
    worker registers: it refuses to start all the same."""
    from django_fairqueue.management.commands import runfairworker

    real = runfairworker._require_migrated_now
    refusals = [OperationalError("connection refused")] * 2

    def check() -> None:
        if refusals:
            raise refusals.pop()
        real()

    monkeypatch.setattr(runfairworker, "_require_migrated_now", check)
    with connection.cursor() as cur:
        cur.execute(
            "DELETE FROM django_migrations WHERE app = 'fairqueue' AND name = ("
            "SELECT max(name) FROM django_migrations WHERE app = 'fairqueue') RETURNING name"
        )
        (latest,) = cur.fetchone()
    try:
        with pytest.raises(CommandError, match=rf"the first: {latest}"):
            call_command("runfairworker", "--burst", "--no-listen", "--worker-id", "unchecked")
        assert refusals == []  # the command's check, then the worker's first try, refused
        assert not WorkerRecord.objects.filter(worker_id="unchecked").exists()
    finally:
        with connection.cursor() as cur:
            cur.execute(
                "INSERT INTO django_migrations (app, name, applied) "
                "VALUES ('fairqueue', %s, now())",
                [latest],
            )


@pytest.mark.django_db(transaction=True)
def test_a_stop_while_a_worker_waits_for_the_database_at_start_is_graceful(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("connection refused")

    monkeypatch.setattr(worker_store, "register_worker", refused)
    worker = one_worker()
    done: list[int] = []
    thread = threading.Thread(target=lambda: done.append(worker.run()))
    thread.start()
    time.sleep(0.3)  # waiting out the refusals
    worker.stop()
    thread.join(5)
    assert not thread.is_alive() and done == [0]


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--concurrency", "0"], "--concurrency must be at least 1"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--max-messages", "0"], "--max-messages must be at least 1"),
        (["--poll-interval", "0"], "--poll-interval must be above 0 to 3600 seconds"),
        (["--shutdown-grace", "-1"], "--shutdown-grace must be 0 to 86400 seconds"),
        (["--lease", "0"], "--lease must be 5 to 86400 seconds"),
        (["--burst-horizon", "-1"], "--burst-horizon must be 0 to 86400 seconds"),
        (["--burst-horizon", "nan"], "--burst-horizon must be 0 to 86400 seconds"),
        (["--worker-id", " "], "--worker-id must be 1 to 200"),
        (["--channels", "a,,b"], "--channels has an empty channel name"),
        (["--exclude-channels", ","], "--exclude-channels has an empty channel name"),
        (["--channels", "a,b", "--exclude-channels", "b"], "both in --channels and"),
        (["--channels", "x" * 201], "the most is 200"),
        (["--concurrency", "100000000"], "--concurrency must be at most 1,000, got 100,000,000"),
        (["--processes", "100000"], "--processes must be at most 256"),
        (["--batch-size", "10001"], "--batch-size must be at most 10,000"),
        (["--prefetch", "-1"], "--prefetch must be at least 0"),
        (["--max-tasks-per-child", "0"], "--max-tasks-per-child must be at least 1"),
        (["--max-abandoned-threads", "1001"], "--max-abandoned-threads must be at most 1,000"),
        (["--poll-interval", "inf"], "--poll-interval must be above 0 to 3600 seconds"),
        (["--poll-interval", "nan"], "--poll-interval must be above 0 to 3600 seconds"),
        (["--shutdown-grace", "inf"], "--shutdown-grace must be 0 to 86400 seconds"),
        (["--burst-horizon", "inf"], "--burst-horizon must be 0 to 86400 seconds"),
        (["--lease", "0.01"], "--lease must be 5 to 86400 seconds"),
        (["--lease", "4.9"], "--lease must be 5 to 86400 seconds"),
        (["--lease", "inf"], "--lease must be 5 to 86400 seconds"),
        (["--lease", "nan"], "--lease must be 5 to 86400 seconds"),
        (["--channels", " a"], "--channels: .*blank"),
        (["--channels", "a, b"], "--channels: .*blank"),
        (["--exclude-channels", "a\x00"], "--exclude-channels: .*NUL"),
    ],
)
def test_runfairworker_refuses_bad_options_readably(args: list[str], error: str) -> None:
    with pytest.raises(CommandError, match=error):
        call_command("runfairworker", *args)


def test_worker_config_validates() -> None:
    with pytest.raises(ValueError, match="concurrency must be 1 to 1000, got 0"):
        WorkerConfig(concurrency=0)
    with pytest.raises(ValueError, match="burst_horizon must be 0 to 86400 seconds"):
        WorkerConfig(burst_horizon=-0.5)
    with pytest.raises(TypeError, match="not a string"):  # a value of the wrong kind
        WorkerConfig(channels="abc")
    with pytest.raises(TypeError, match="queues must be a list of queue names, not a string"):
        WorkerConfig(queues="reports")
    with pytest.raises(ValueError, match="concurrency must be 1 to 1000, got 1001"):
        WorkerConfig(concurrency=1001)
    with pytest.raises(ValueError, match="both included and excluded"):
        WorkerConfig(channels=["a"], exclude_channels=["a"])
    assert WorkerConfig(channels=["a", "b"]).channels == ("a", "b")


@pytest.mark.django_db(transaction=True)
def test_runfairworker_burst_runs_what_is_ready_and_exits() -> None:
    ids = [fairtasks.add.enqueue(i, i, channel="alice") for i in range(3)]
    err = StringIO()
    call_command(
        "runfairworker",
        "--burst",
        "--concurrency",
        "2",
        "--no-listen",
        "--worker-id",
        "cmd",
        stderr=err,
    )
    assert "worker cmd: 3 messages handled" in err.getvalue()
    rows = Message.objects.filter(pk__in=ids)
    assert sorted(r.result for r in rows) == [0, 2, 4]
    assert {r.worker_id for r in rows} == {"cmd"}


@pytest.mark.django_db(transaction=True)
def test_a_burst_run_takes_back_and_runs_a_dead_workers_expired_leases() -> None:
    # A worker died holding two messages (claimed here, never settled) and their leases ran
    # out: the burst worker's first claim finds nothing ready, and its rescuer's first pass
    # makes them ready a moment later. The burst is not done before they ran.
    ids = [fairtasks.add.enqueue(i, 1, channel="orphans") for i in range(2)]
    taken = message_store.claim_messages(2, lease=timedelta(milliseconds=50), worker_id="dead")
    assert sorted(m.id for m in taken) == sorted(ids)
    time.sleep(0.1)
    err = StringIO()
    call_command("runfairworker", "--burst", "--no-listen", "--worker-id", "cmd", stderr=err)
    assert "worker cmd: 2 messages handled" in err.getvalue()
    rows = Message.objects.filter(pk__in=ids)
    assert {(r.state, r.attempts, r.worker_id) for r in rows} == {
        (MessageState.SUCCEEDED, 2, "cmd")
    }


@pytest.mark.django_db(transaction=True)
def test_runfairworker_burst_waits_for_a_rate_limited_channel_and_work_due_soon() -> None:
    # A channel releasing one message per 0.2 s has ready messages whose turn is a moment
    # away, and a message delayed by 0.5 s is due within the burst horizon (a few seconds by
    # default): a burst run is not done before all of them ran.
    ids = [fairtasks.add.enqueue(i, 1, channel="metered") for i in range(5)]
    set_limits(["metered"], release_interval=timedelta(seconds=0.2))
    soon = timezone.now() + timedelta(seconds=0.5)
    delayed = fairtasks.add.enqueue(9, 1, channel="other", run_after=soon)
    # due long after the horizon: not waited for
    later = fairtasks.add.enqueue(0, 0, channel="other", run_after=soon + timedelta(minutes=5))
    err = StringIO()
    started = time.monotonic()
    call_command(
        "runfairworker",
        "--burst",
        "--no-listen",
        "--no-maintenance",
        "--worker-id",
        "cmd",
        stderr=err,
    )
    elapsed = time.monotonic() - started
    assert "worker cmd: 6 messages handled" in err.getvalue()
    rows = Message.objects.filter(pk__in=[*ids, delayed])
    assert {(r.state, r.worker_id) for r in rows} == {(MessageState.SUCCEEDED, "cmd")}
    assert message(later).state == MessageState.SCHEDULED
    assert elapsed < 5  # it did not wait for the message due in five minutes


@pytest.mark.django_db(transaction=True)
def test_a_burst_run_does_not_wait_past_its_horizon() -> None:
    fairtasks.add.enqueue(1, 1, channel="metered")
    later = fairtasks.add.enqueue(
        0, 0, channel="metered", run_after=timezone.now() + timedelta(seconds=2)
    )
    worker = one_worker(burst=True, burst_horizon=0.5)
    started = time.monotonic()
    assert worker.run() == 1
    assert time.monotonic() - started < 1.5
    assert message(later).state == MessageState.SCHEDULED


# ------------------------------------------------------------------------------------------------
# wake-ups sent by enqueue


@pytest.mark.django_db(transaction=True)
def test_enqueue_notifies_only_when_an_idle_worker_may_be_waiting(
    database_url: str, fq: Any
) -> None:
    listener = psycopg.connect(database_url, autocommit=True)
    try:
        message_store.listen_wakeups(listener, conf.get().NOTIFY_CHANNEL)

        def notified() -> int:
            return sum(1 for _ in listener.notifies(timeout=0.3))

        fairtasks.add.enqueue(1, 1, channel="a")
        assert notified() == 1  # an empty channel: a worker may be idle
        time.sleep(0.1)
        fairtasks.add.enqueue(2, 2, channel="a")
        assert notified() == 0  # its head waits for a busy worker: no one idle to wake
        fairtasks.add.enqueue(3, 3, channel="b")
        assert notified() == 1
        with transaction.atomic():  # a batch of several channels notifies, once
            fairtasks.add.enqueue(4, 4, channel="a")
            fairtasks.add.enqueue(5, 5, channel="c")
            fairtasks.add.enqueue(6, 6, channel="d")
        assert notified() == 1
        # An empty channel whose new message was due an hour ago is a fresh head all the same
        # (it became ready just now): a worker may be idle. (This wake-up used to be lost.)
        from django_fairqueue.api import enqueue

        enqueue(fairtasks.add, 8, 8, channel="f", run_after=timezone.now() - timedelta(hours=1))
        assert notified() == 1
        fq(NOTIFY=False)
        fairtasks.add.enqueue(7, 7, channel="e")
        assert notified() == 0
    finally:
        listener.close()


# ------------------------------------------------------------------------------------------------
# signals and statistics (django_fairqueue.signals, django_fairqueue.stats)


@pytest.mark.django_db
def test_the_worker_sends_started_and_finished_signals_and_survives_a_broken_receiver() -> None:
    seen: list[tuple[str, Any]] = []

    def on_started(sender: Any, message: Any, worker_id: str, **kwargs: Any) -> None:
        seen.append(("started", (message.id, worker_id)))
        raise RuntimeError("a broken receiver")

    def on_finished(sender: Any, message: Any, outcome: str, error: Any, **kwargs: Any) -> None:
        seen.append(("finished", (message.id, outcome, error and error["type"])))

    ok = fairtasks.add.enqueue(1, 1, channel="alice")
    bad = enqueue_raw("alice", "tests.no_such_task", '{"args": [], "kwargs": {}}')
    message_started.connect(on_started, sender=Message)
    message_finished.connect(on_finished, sender=Message)
    try:
        assert drain() == 2
    finally:
        message_started.disconnect(on_started, sender=Message)
        message_finished.disconnect(on_finished, sender=Message)

    assert seen == [
        ("started", (ok, "django_fairqueue.testing.drain")),
        ("finished", (ok, "succeeded", None)),
        # a message that cannot run never starts, but finishes (failed)
        ("finished", (bad, "failed", "django_fairqueue.exceptions.UnknownTask")),
    ]


@pytest.mark.django_db(transaction=True)
def test_a_burst_is_not_done_while_a_settlement_races_its_last_question(
    fq: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst worker asks the database whether work is due, finds none (its last message
    is still running), and only then sees that message settle. The settlement was a retry
    without backoff: ready now, after the answer. The burst must run it, not call itself
    done because nothing is unsettled any more."""
    fq(RETRY_BACKOFF_BASE=0)
    fairtasks.boom.enqueue(channel="alice")  # retried once, then failed
    worker = one_worker(concurrency=1, burst=True)
    asked = message_store.select_next_due

    def answer_then_let_it_settle(*args: Any, **kwargs: Any) -> Any:
        due_in = asked(*args, **kwargs)
        if due_in is None:
            # the running message settles (and retries) between the answer and its use
            wait_until(lambda: worker.ledger.idle(), timeout=10)
        return due_in

    monkeypatch.setattr(message_store, "select_next_due", answer_then_let_it_settle)
    assert worker.run() == 2
    assert Message.objects.get().state == MessageState.FAILED


@pytest.mark.django_db(transaction=True)
def test_the_threaded_worker_records_per_channel_statistics(fq: Any) -> None:
    fq(RETRY_BACKOFF_BASE=0)
    for i in range(3):
        fairtasks.add.enqueue(i, 1, channel="alice")
    fairtasks.boom.enqueue(channel="alice")  # retried once, then failed

    assert one_worker(concurrency=2, burst=True).run() == 5

    totals = ChannelStat.objects.filter(channel__name="alice").aggregate(
        claimed=Sum("claimed"),
        succeeded=Sum("succeeded"),
        failed=Sum("failed"),
        retried=Sum("retried"),
        timed_out=Sum("timed_out"),
    )
    # boom raised: failures, not timeouts
    assert totals == {"claimed": 5, "succeeded": 3, "failed": 1, "retried": 1, "timed_out": 0}
    # the per-minute sums over all channels agree (written by the same flushes)
    assert (
        MinuteStat.objects.aggregate(
            claimed=Sum("claimed"),
            succeeded=Sum("succeeded"),
            failed=Sum("failed"),
            retried=Sum("retried"),
            timed_out=Sum("timed_out"),
        )
        == totals
    )


@pytest.mark.django_db
def test_select_next_due_tells_a_drained_queue_from_a_busy_one() -> None:
    def due(**filters: Any) -> float | None:
        return message_store.select_next_due(timedelta(seconds=5), **filters)

    assert due() is None
    fairtasks.add.enqueue(1, 1, channel="a")  # counted through its not yet folded delta
    a = channel_store.select_channel_ids(["a"])["a"]
    assert (due() or 1) <= 0  # claimable now
    assert due(exclude_channel_ids=[a]) is None
    assert (due(only_channel_ids=[a]) or 1) <= 0
    assert due(only_channel_ids=[]) is None

    Channel.objects.filter(pk=a).update(paused=True)  # an operator pauses it
    assert due() is None

    fairtasks.add.enqueue(2, 2, channel="b", run_after=timedelta(milliseconds=1))
    time.sleep(0.01)
    assert (due() or 1) <= 0  # due, promoted by the next claim
    fairtasks.add.enqueue(3, 3, channel="c", run_after=timedelta(seconds=2))
    assert 1 < (due(exclude_channel_ids=[channel_store.select_channel_ids(["b"])["b"]]) or 0) <= 2


@pytest.mark.django_db
def test_select_next_due_counts_an_expired_lease_for_a_worker_that_rescues() -> None:
    def due(**filters: Any) -> float | None:
        return message_store.select_next_due(timedelta(seconds=5), **filters)

    fairtasks.add.enqueue(1, 1, channel="a")
    a = channel_store.select_channel_ids(["a"])["a"]
    message_store.claim_messages(1, lease=timedelta(minutes=5), worker_id="alive")
    assert due(rescuing=True) is None  # a live lease is its worker's to renew
    Message.objects.filter(channel_id=a).update(lease_expires_at=timezone.now())
    assert due() is None  # a worker without the rescuer waits for nobody's
    assert (due(rescuing=True) or 1) <= 0
    assert due(rescuing=True, exclude_channel_ids=[a]) is None
    assert due(rescuing=True, queues=["elsewhere"]) is None
    Channel.objects.filter(pk=a).update(paused=True)
    assert due(rescuing=True) is None


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("folded", [True, False])
def test_select_next_due_honours_a_groups_turn_and_cap_as_the_claim_does(folded: bool) -> None:
    from django_fairqueue.models import ChannelGroup
    from tests.factories import fold_all

    lease = timedelta(minutes=5)

    def due(**filters: Any) -> float | None:
        return message_store.select_next_due(timedelta(seconds=5), **filters)

    def settle() -> None:
        if folded:
            fold_all()

    # A rate-limited group: one release, then its next turn is ten minutes away.
    for i in range(2):
        fairtasks.add.enqueue(i, 1, channel=("wg", "r1"))
    ChannelGroup.objects.filter(name="wg").update(release_interval=timedelta(minutes=10))
    settle()
    assert (due() or 1) <= 0  # its first turn is now
    (taken,) = message_store.claim_messages(10, lease=lease, worker_id="w")
    settle()
    assert message_store.claim_messages(10, lease=lease, worker_id="w") == []
    assert due() is None  # the claim takes nothing for ten minutes: nothing due in 5 s
    assert 590 < (message_store.select_next_due(timedelta(hours=1)) or 0) <= 600
    message_store.complete_messages([(taken.id, taken.lease_token, None)], run_seconds=None)
    settle()
    assert due() is None  # a freed slot does not move the group's turn

    # A capped group held at its cap by another worker's messages.
    for i in range(4):
        fairtasks.add.enqueue(i, 1, channel=("tg", "u0" if i < 2 else "u1"))
    ChannelGroup.objects.filter(name="tg").update(max_concurrency=2)
    fold_all()
    u0, u1 = (channel_store.select_channel_ids([n])[n] for n in ("tg/u0", "tg/u1"))
    held = message_store.claim_messages(2, lease=lease, worker_id="other", only_channel_ids=[u0])
    assert len(held) == 2
    settle()
    assert message_store.claim_messages(10, lease=lease, worker_id="w", only_channel_ids=[u1]) == []
    assert due(only_channel_ids=[u1]) is None
    # one of them finishes: its slot is free at once, folded or not
    message_store.complete_messages([(held[0].id, held[0].lease_token, None)], run_seconds=None)
    settle()
    assert (due(only_channel_ids=[u1]) or 1) <= 0
    assert (
        len(message_store.claim_messages(10, lease=lease, worker_id="w", only_channel_ids=[u1]))
        == 1
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("limit", ["rate", "cap"])
def test_a_burst_run_ends_when_only_a_groups_limit_keeps_work_from_it(limit: str) -> None:
    from django_fairqueue.models import ChannelGroup

    for i in range(3):
        fairtasks.add.enqueue(i, 1, channel=("wg", "r1"))
    group = ChannelGroup.objects.filter(name="wg")
    if limit == "rate":
        group.update(release_interval=timedelta(minutes=10))
        expected = 1  # its first turn, then ten minutes to the next
    else:
        group.update(max_concurrency=1)
        fairtasks.add.enqueue(9, 9, channel=("wg", "busy"))
        busy = channel_store.select_channel_ids(["wg/busy"])["wg/busy"]
        # another worker holds the group's only slot
        held = message_store.claim_messages(
            1, lease=timedelta(minutes=5), worker_id="other", only_channel_ids=[busy]
        )
        assert len(held) == 1
        expected = 0
    worker = one_worker(burst=True, channels=["wg/r1"])
    started = time.monotonic()
    with running(worker) as outcome:
        # it ends by itself (stopping it is the fallback of running(): a run that never
        # ended polled every second for work it could not take)
        wait_until(lambda: "handled" in outcome, 8, "the burst run ended")
    assert outcome["handled"] == expected
    assert time.monotonic() - started < 5


# ------------------------------------------------------------------------------------------------
# an idle worker claims when work comes due, not at its next poll


@pytest.mark.django_db(transaction=True)
def test_an_idle_worker_claims_when_work_comes_due_not_at_the_next_poll() -> None:
    # Polling every 30 s: whatever starts sooner was claimed at its due time (the wake-up an
    # enqueue sends comes before it is due). Six messages on a channel releasing one per
    # 0.1 s, and delayed messages (a retry's backoff is the same: a scheduled message).
    metered = [fairtasks.record.enqueue(f"m{i}", channel="metered") for i in range(6)]
    set_limits(["metered"], release_interval=timedelta(seconds=0.1))
    worker = one_worker(concurrency=2, poll_interval=30.0, listen=True)
    delayed: list[int] = []
    lateness: list[float] = []
    with running(worker):
        wait_until(
            lambda: all(message(m).state == MessageState.SUCCEEDED for m in metered),
            10,
            "the rate-limited channel drained",
        )
        time.sleep(0.2)  # idle now, its next poll 30 s away
        for i in range(40):
            due = 0.15 + 0.04 * i
            delayed.append(
                fairtasks.record.enqueue(
                    f"d{i}", channel=f"later{i % 3}", run_after=timedelta(seconds=due)
                )
            )
        wait_until(
            lambda: all(message(m).state == MessageState.SUCCEEDED for m in delayed),
            10,
            "the delayed messages",
        )
    starts = sorted(float(message(m).result["started"]) for m in metered)
    assert starts[-1] - starts[0] < 2.0, starts  # 6 releases 0.1 s apart, not 6 polls
    for mid in delayed:
        row = message(mid)
        lateness.append(float(row.result["started"]) - row.run_at.timestamp())
    lateness.sort()
    p99 = lateness[min(len(lateness) - 1, round(0.99 * (len(lateness) - 1)))]
    print(
        f"\nrate-limited 6 x 0.1 s drained in {starts[-1] - starts[0]:.2f}s; {len(lateness)} "
        f"delayed messages started after their run_at: p50 "
        f"{lateness[len(lateness) // 2] * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
        f"max {lateness[-1] * 1000:.1f} ms"
    )
    assert lateness[0] >= 0  # never early
    assert lateness[-1] < 1.0, lateness  # at its due time, not 30 s later


# time limits: a task that never returns (or returns too late)

#: Set at the end of each test below: lets their stuck handler threads return.
RELEASE_HUNG = threading.Event()


@task(name="tests.worker.hang", timeout=0.5, max_attempts=2, keep_result=True)
def hang() -> str:
    """Waits (for an hour, unless the test lets it go) on every attempt."""
    RELEASE_HUNG.wait(3600)
    return "returned late"


OVERRUNS: list[tuple[int, int, float, float]] = []  # (message id, attempt, start, end)


@task(name="tests.worker.overrun", timeout=0.3, max_attempts=2)
def overrun() -> None:
    """Ignores its time limit: runs a second on every attempt."""
    message = current_message.get()
    assert message is not None
    start = time.monotonic()
    time.sleep(1.0)
    OVERRUNS.append((message.id, message.attempts, start, time.monotonic()))


@task(name="tests.worker.hang_once", timeout=0.3, max_attempts=2, keep_result=True)
def hang_once() -> str:
    """Stuck on its first attempt (until the test lets it go); the retry returns at once."""
    message = current_message.get()
    assert message is not None
    if message.attempts == 1:
        RELEASE_HUNG.wait(3600)
        return "first attempt"
    return "second attempt"


@task(name="tests.worker.untimed")
def untimed() -> None:
    """No time limit of its own: FAIRQUEUE['TASK_TIMEOUT'] applies."""
    RELEASE_HUNG.wait(3600)


@task(name="tests.worker.meet", keep_result=True)
def meet() -> bool:
    """Returns only if another message of the test runs at the same time."""
    MEETING.wait()
    return True


MEETING = threading.Barrier(2, timeout=10)


@pytest.fixture
def hung() -> Iterator[None]:
    RELEASE_HUNG.clear()
    OVERRUNS.clear()
    MEETING.reset()
    try:
        yield
    finally:
        RELEASE_HUNG.set()  # the abandoned threads return (and their outcomes are discarded)


@pytest.mark.django_db(transaction=True)
def test_a_task_that_ignores_its_time_limit_never_runs_beside_its_retry_under_a_cap_of_one(
    fq: Any, hung: None
) -> None:
    # A cap of 1 holds in reality: a timed-out attempt's thread keeps running (Python cannot
    # stop it), so its channel's slot stays taken, and its retry waits, until it returns.
    fq(RETRY_BACKOFF_BASE=0)
    Channel.objects.create(name="capped", max_concurrency=1)
    stuck = [overrun.enqueue(channel="capped") for _ in range(2)]
    worker = one_worker(concurrency=3, poll_interval=0.5)
    with running(worker):
        # The stuck thread is replaced just after it is counted stuck: wait for both (the
        # fourth handler thread started, and the pool has three again: the stuck one left it)
        wait_until(
            lambda: (
                worker.ledger.stuck == 1
                and len(worker.pool.threads) == 3
                and "fairqueue-handler-4" in {t.name for t in worker.pool.threads}
            ),
            10,
            "the first time limit and the stuck thread's replacement",
        )
        # the message is still running (its lease renewed)
        assert {message(m).state for m in stuck} == {MessageState.RUNNING, MessageState.READY}
        # other tenants' work goes on meanwhile: two at once on the other threads
        meeting = [meet.enqueue(channel=f"m{i}") for i in range(2)]
        worker.wake()  # no LISTEN here
        wait_until(lambda: all_in(meeting, MessageState.SUCCEEDED), 20, "two at once")
        wait_until(lambda: all_in(stuck, MessageState.FAILED), 30, "both dead-lettered")
    runs = sorted((start, end) for _, _, start, end in OVERRUNS)
    assert len(runs) == 4, OVERRUNS  # two messages, two attempts each
    for (_, end), (start, _) in itertools.pairwise(runs):
        assert start >= end, runs  # never two copies of the tenant's tasks at once
    for mid in stuck:
        row = message(mid)
        assert (row.state, row.attempts, row.result) == (MessageState.FAILED, 2, None)
        error = row.last_error
        assert error["type"] == "django_fairqueue.exceptions.TaskTimeout"
        assert error["message"] == (
            "task tests.worker.overrun exceeded its time limit of 0.3 s (attempt 2 of 2)"
        )
        # the stuck handler thread's stack at the limit
        assert error["traceback"].startswith("Stack of the handler thread at the time limit")
        assert "django_fairqueue/worker/pool.py" in error["traceback"]
    # every attempt ran out of time: timeouts in the statistics, not failures
    stuck_stats = ChannelStat.objects.filter(channel__name="capped").aggregate(
        retried=Sum("retried"), failed=Sum("failed"), timed_out=Sum("timed_out")
    )
    assert stuck_stats == {"retried": 2, "failed": 2, "timed_out": 4}
    capped = Channel.objects.get(name="capped").pk
    assert stats.failing_counts(5)[capped] == stats.Failing(failures=0, timeouts=4)
    c = counters("capped")
    assert (c.ready, c.running, c.failed) == (0, 0, 2)
    assert_counters_match_table()


def all_in(ids: list[int], state: str) -> bool:
    return set(Message.objects.filter(pk__in=ids).values_list("state", flat=True)) == {state}


@pytest.mark.django_db(transaction=True)
def test_the_late_return_of_a_timed_out_attempt_changes_nothing(
    fq: Any, hung: None, caplog: pytest.LogCaptureFixture
) -> None:
    fq(RETRY_BACKOFF_BASE=0)
    finished: list[tuple[int, str]] = []

    def on_finished(sender: Any, message: Any, outcome: str, **kwargs: Any) -> None:
        finished.append((message.attempts, outcome))

    message_finished.connect(on_finished)
    mid = hang_once.enqueue(channel="alice")
    worker = one_worker(concurrency=1, poll_interval=60.0)
    try:
        with running(worker), caplog.at_level(logging.INFO, "django_fairqueue.worker"):
            wait_until(lambda: worker.ledger.stuck == 1, 10, "the time limit")
            time.sleep(0.5)
            # failed at the limit, but not written: the message runs while its thread does
            assert message(mid).state == MessageState.RUNNING
            assert finished == [(1, "retry")]
            RELEASE_HUNG.set()  # the first attempt's thread returns "first attempt" now
            wait_until(lambda: message(mid).state == MessageState.SUCCEEDED, 20, "the retry")
            assert worker.ledger.stuck == 0
            row = message(mid)
            assert (row.state, row.attempts, row.result) == (
                MessageState.SUCCEEDED,
                2,
                "second attempt",
            )
            assert row.last_error["type"] == "django_fairqueue.exceptions.TaskTimeout"
    finally:
        message_finished.disconnect(on_finished)
    assert finished == [(1, "retry"), (2, "succeeded")]  # nothing for the late return
    assert f"message {mid} (tests.worker.hang_once, channel 'alice') returned" in caplog.text
    assert "after its time limit (" in caplog.text
    assert "discarded its outcome (succeeded); the attempt is settled as it was failed" in (
        caplog.text
    )
    assert counters("alice").running == 0
    assert worker.handled == 2


@pytest.mark.django_db(transaction=True)
def test_the_task_timeout_setting_limits_tasks_without_a_timeout_of_their_own(
    fq: Any, hung: None
) -> None:
    fq(TASK_TIMEOUT=0.3, DEFAULT_MAX_ATTEMPTS=1)
    assert registry.get("tests.worker.untimed").effective_timeout == 0.3
    assert registry.get("tests.worker.hang").effective_timeout == 0.5  # its own wins
    mid = untimed.enqueue(channel="alice")
    worker = one_worker(concurrency=1, poll_interval=60.0)
    with running(worker):
        wait_until(lambda: worker.ledger.stuck == 1, 10, "the time limit")
        RELEASE_HUNG.set()  # written once its thread returns
        wait_until(lambda: message(mid).state == MessageState.FAILED, 10, "the time limit")
    assert message(mid).last_error["message"] == (
        "task tests.worker.untimed exceeded its time limit of 0.3 s (attempt 1 of 1)"
    )


def test_time_limits_are_validated(fq: Any) -> None:
    for good, seconds in [(None, None), (0, None), (2, 2.0), (timedelta(minutes=1), 60.0)]:
        fq(TASK_TIMEOUT=good)
        assert seconds == conf.get().TASK_TIMEOUT
    for bad in [-1, "30", float("nan"), float("inf"), True]:
        with pytest.raises(ValueError, match=r"TASK_TIMEOUT'\] must be a number of seconds"):
            conf.load({"TASK_TIMEOUT": bad})
    # a year at most, as every other interval (1e300 passed, for a timer no thread could set)
    fq(TASK_TIMEOUT=timedelta(days=365))
    for bad in [1e300, timedelta(days=366)]:
        with pytest.raises(
            ValueError, match=r"TASK_TIMEOUT'\] must be at most 31536000 seconds \(365 days\)"
        ):
            conf.load({"TASK_TIMEOUT": bad})

    def plain() -> None:
        pass

    for bad in (-1, 31_536_001):
        with pytest.raises(ValueError, match=r"'tests\.worker\.bad_timeout': timeout must be"):
            task(name="tests.worker.bad_timeout", timeout=bad)(plain)
    assert task(name="tests.worker.no_limit", timeout=0)(plain).spec.effective_timeout is None
    registry.unregister("tests.worker.no_limit")
    with pytest.raises(ValueError, match="max_abandoned_threads must be 1 to 1000"):
        WorkerConfig(max_abandoned_threads=0)
    with pytest.raises(CommandError, match="--max-abandoned-threads must be at least 1"):
        call_command("runfairworker", "--max-abandoned-threads", "0")


def test_supervised_workers_get_every_option_of_the_command_but_the_supervisors() -> None:
    from django_fairqueue.management.commands.runfairworker import Command
    from django_fairqueue.worker import supervisor

    parser = Command().create_parser("manage.py", "runfairworker")
    given = [
        "--concurrency", "3", "--channels", "a,b", "--batch-size", "7", "--prefetch", "2",
        "--poll-interval", "0.5", "--burst", "--burst-horizon", "2", "--lease", "9",
        "--no-listen", "--no-maintenance", "--max-abandoned-threads", "4",
        "--shutdown-grace", "3", "--pipelines", "enrich", "--queues", "reports,exports",
        "--pipeline-runners", "2",
    ]  # fmt: skip
    options = vars(parser.parse_args([*given, "--processes", "2", "--max-tasks-per-child", "5"]))
    child = vars(parser.parse_args(supervisor.child_flags(options)))
    for key in (
        "concurrency", "channels", "batch_size", "prefetch", "poll_interval", "burst",
        "burst_horizon", "lease", "no_listen", "no_maintenance", "max_abandoned_threads",
        "shutdown_grace", "pipelines", "queues", "pipeline_runners",
    ):  # fmt: skip
        assert child[key] == options[key], key
    assert (child["processes"], child["max_tasks_per_child"]) == (1, None)


def test_every_outcome_of_message_finished_is_documented() -> None:
    """The signal's docstring and the observability how-to name each outcome a worker sends."""
    from pathlib import Path
    from typing import get_args

    import django_fairqueue.signals
    from django_fairqueue.worker.config import OutcomeKind

    howto = (Path(__file__).parents[1] / "docs" / "howto" / "observability.md").read_text()
    (row,) = [line for line in howto.splitlines() if line.startswith("| `message_finished`")]
    docstring = django_fairqueue.signals.__doc__ or ""
    for kind in get_args(OutcomeKind):
        assert f'`"{kind}"`' in row, kind
        assert f'``"{kind}"``' in docstring, kind


@pytest.mark.django_db(transaction=True)
def test_a_worker_that_stops_before_its_first_beat_records_its_last_claim() -> None:
    from django_fairqueue.models import WorkerRecord, WorkerState

    fairtasks.add.enqueue(1, 2, channel="alice")
    config = WorkerConfig(worker_id="brief", burst=True, listen=False, maintenance=False)
    assert Worker(config).run() == 1
    record = WorkerRecord.objects.get(worker_id="brief")
    assert (record.state, record.handled) == (WorkerState.STOPPED, 1)
    assert record.last_claim_at is not None and record.last_claim_at <= timezone.now()


@pytest.mark.django_db(transaction=True)
def test_a_stop_past_its_grace_expires_the_leases_it_leaves_for_the_rescuer() -> None:
    from django_fairqueue.models import WorkerRecord, WorkerState

    started, release = threading.Event(), threading.Event()
    mid = fairtasks.sleep.enqueue(0.0, channel="alice")
    config = WorkerConfig(
        worker_id="leaving", concurrency=1, shutdown_grace=0.2, listen=False, maintenance=False
    )
    w = Worker(config)

    def hold(**kwargs: Any) -> None:
        started.set()
        release.wait(10)  # still running when the grace period ends

    def run() -> None:
        try:
            w.run()
        finally:
            connections.close_all()

    message_started.connect(hold, weak=False)
    runner = threading.Thread(target=run)
    try:
        runner.start()
        assert started.wait(10)
        w.stop()
        runner.join(20)
        assert not runner.is_alive()
        left = Message.objects.get(pk=mid)
        assert left.state == MessageState.RUNNING and left.lease_expires_at <= timezone.now()
        assert WorkerRecord.objects.get(worker_id="leaving").state == WorkerState.STOPPED
        assert message_store.rescue_expired_messages()  # requeued at the next pass
    finally:
        release.set()
        message_started.disconnect(hold)
        time.sleep(0.2)  # (the held thread ends its task; its outcome is not written)


def test_verbosity_sets_the_packages_level_under_the_projects_own_handlers() -> None:
    """With LOGGING's handlers (a root handler, as the observability page's JSON logging
    sets), `-v 0` must still drop the per-message lines (never showing more than LOGGING
    does) and `-v 2` add debug; the default keeps the level LOGGING gave; and the command's
    end puts the level back."""
    from django_fairqueue.runtime import command_logging

    package, root = logging.getLogger("django_fairqueue"), logging.getLogger()
    project = logging.NullHandler()
    was = package.level
    root.addHandler(project)
    try:
        package.setLevel(logging.INFO)
        with command_logging(0):
            assert package.level == logging.WARNING and not package.handlers
        assert package.level == logging.INFO  # put back
        with command_logging(2):
            assert package.level == logging.DEBUG
        package.setLevel(logging.ERROR)  # what the project's LOGGING says
        for verbosity in (0, 1):  # -v 0 shows no more than LOGGING does
            with command_logging(verbosity):
                assert package.level == logging.ERROR
    finally:
        root.removeHandler(project)
        package.setLevel(was)


def test_a_command_without_the_projects_handlers_leaves_none_behind() -> None:
    from django_fairqueue.runtime import command_logging

    package, root = logging.getLogger("django_fairqueue"), logging.getLogger()
    kept = root.handlers[:]
    root.handlers.clear()  # (pytest's own: as a project without LOGGING handlers)
    try:
        with command_logging(0):
            assert len(package.handlers) == 1 and package.level == logging.WARNING
        assert package.handlers == []
    finally:
        root.handlers[:] = kept

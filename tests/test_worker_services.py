"""The worker's services one at a time: each driven through ``run_once`` in the test's own
thread, with a ledger and queues of the test's making (no worker, no threads)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import queue
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections

from django_fairqueue import conf
from django_fairqueue.api import abort
from django_fairqueue.context import operator_interrupt
from django_fairqueue.db import channel_store
from django_fairqueue.db.message_store import ClaimedMessage
from django_fairqueue.maintenance import DeltaFolder
from django_fairqueue.models import Message, MessageState
from django_fairqueue.observe import tracing
from django_fairqueue.runtime.attempts import describe, error_info
from django_fairqueue.tasks import task
from django_fairqueue.tasks.spec import registry
from django_fairqueue.worker import Outcome, WorkerConfig
from django_fairqueue.worker import settler as settler_module
from django_fairqueue.worker.claimer import Claimer
from django_fairqueue.worker.config import lease_clock
from django_fairqueue.worker.core import Maintenance
from django_fairqueue.worker.heartbeat import Heartbeat
from django_fairqueue.worker.ledger import Ledger
from django_fairqueue.worker.listener import Listener
from django_fairqueue.worker.pool import Pool
from django_fairqueue.worker.settler import Settler
from django_fairqueue.worker.timer import Timer
from tests import fairtasks

LEASE = timedelta(seconds=30)


class Parts:
    """A ledger, the pool's queue of claimed messages and the settler's queue of outcomes."""

    def __init__(self, capacity: int = 4, *, abort_grace: float = 5.0) -> None:
        self.config = WorkerConfig(worker_id="svc", concurrency=capacity)
        self.ledger = Ledger(capacity=capacity, abort_grace=abort_grace)
        self.work: queue.SimpleQueue[ClaimedMessage | None] = queue.SimpleQueue()
        self.outcomes: queue.SimpleQueue[Outcome | None] = queue.SimpleQueue()
        self.freed: list[int] = []
        self.settled: list[bool] = []
        self.recycled: list[str] = []

    def claimer(self) -> Claimer:
        return Claimer(
            self.config, self.ledger, self.work, self.outcomes, lease=LEASE, poll_interval=60
        )

    def pool(self) -> Pool:
        return Pool(
            self.ledger,
            self.work,
            self.outcomes,
            concurrency=self.config.concurrency,
            worker_id="svc",
            on_free=self.freed.append,
        )

    def settler(self) -> Settler:
        return Settler(self.ledger, self.outcomes, worker_id="svc", on_settled=self.settled.append)

    def timer(self, pool: Pool, **options: Any) -> Timer:
        return Timer(
            self.ledger,
            self.outcomes,
            pool,
            worker_id="svc",
            max_stuck=options.get("max_stuck", 10),
            stuck_limit=options.get("stuck_limit", 300.0),
            on_recycle=self.recycled.append,
        )

    def drained(self) -> list[Any]:
        items = []
        while True:
            try:
                items.append(self.outcomes.get_nowait())
            except queue.Empty:
                return items


def claimed(n: int, channel: str = "a") -> tuple[Parts, list[ClaimedMessage]]:
    """Parts holding ``n`` claimed messages (on the pool's queue)."""
    registry.autodiscover()
    for i in range(n):
        fairtasks.add.enqueue(i, 1, channel=channel)
    parts = Parts()
    assert parts.claimer().run_once() is False
    messages = [parts.work.get_nowait() for _ in range(n)]
    assert all(m is not None for m in messages)
    return parts, [m for m in messages if m is not None]


# -- the ledger ------------------------------------------------------------------------------------


def message_stub(message_id: int) -> ClaimedMessage:
    return ClaimedMessage(  # type: ignore[call-arg]
        **{
            name: (message_id if name == "id" else None)
            for name in ClaimedMessage.__dataclass_fields__
        }
    )


def test_the_ledger_counts_claims_and_forgets_settled_messages_but_not_their_retries() -> None:
    ledger = Ledger(capacity=3, abort_grace=1.0)
    first, second = message_stub(1), message_stub(2)
    assert ledger.claimed_now([first, second], lease_clock() + 30)
    assert (ledger.free(), ledger.claimed, ledger.settling(), ledger.idle()) == (1, 2, 0, False)
    assert ledger.not_started(ran=True) == 2
    assert ledger.settling() == 1  # its outcome waits to be written
    retry = message_stub(1)  # the same message, claimed again before the settlement came back
    ledger.claimed_now([retry], lease_clock() + 30)
    ledger.settled([Outcome(first, "retry")], count=True)
    assert ledger.unsettled_ids() == [1, 2] and ledger.handled == 1
    ledger.settled([Outcome(retry, "succeeded"), Outcome(second, "succeeded")], count=True)
    assert ledger.idle() and ledger.handled == 3


def test_the_ledger_knows_a_lease_gone_by_its_clock_or_a_heartbeat() -> None:
    ledger = Ledger(capacity=3, abort_grace=1.0)
    late, lost, fine = message_stub(1), message_stub(2), message_stub(3)
    ledger.claimed_now([late], lease_clock() - 0.001)
    ledger.claimed_now([lost, fine], lease_clock() + 30)
    assert ledger.lost([(2, lost.lease_token), (99, lost.lease_token)]) == [2]  # 99: not held
    assert [ledger.lease_gone(m) for m in (late, lost, fine)] == [True, True, False]
    assert [i for i, _ in ledger.leases()] == [1, 3]  # a lost lease is not renewed


def test_a_stop_during_a_claim_gives_its_messages_back_uncounted() -> None:
    ledger = Ledger(capacity=3, abort_grace=1.0)
    ledger.give_back_unstarted()
    assert not ledger.claimed_now([message_stub(1)], lease_clock() + 30)
    assert (ledger.busy, ledger.claimed, ledger.unsettled_ids()) == (0, 0, [1])


# -- claimer, pool, settler ------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_claimer_claims_what_is_free_and_hands_it_to_the_pool() -> None:
    registry.autodiscover()
    for i in range(6):
        fairtasks.add.enqueue(i, 1, channel="a")
    parts = Parts(capacity=4)
    claimer = parts.claimer()
    assert claimer.run_once() is False
    assert parts.ledger.busy == parts.ledger.claimed == 4 and parts.ledger.free() == 0
    assert len(parts.ledger.unsettled_ids()) == 4
    assert claimer.run_once() is False  # nothing free: no claim at all
    assert len(parts.ledger.unsettled_ids()) == 4
    parts.ledger.give_back_unstarted()  # a stop while the next claim is in flight
    parts.ledger.not_started(ran=True)
    claimer.run_once()
    (released,) = parts.drained()
    assert isinstance(released, Outcome) and released.kind == "released"


# (transaction=True: a handler drops a connection a task left inside a transaction)


@pytest.mark.django_db(transaction=True)
def test_the_pool_runs_a_message_and_the_settler_writes_its_outcome() -> None:
    parts, (message,) = claimed(1)
    parts.work.put(message)
    pool = parts.pool()
    assert pool.run_once() is True
    assert pool.run_once() is False  # nothing more waits
    assert parts.freed == [4] and parts.ledger.busy == 0
    settler = parts.settler()
    assert settler.run_once() == 1
    assert parts.settled == [True] and parts.ledger.idle() and parts.ledger.handled == 1
    row = Message.objects.get(pk=message.id)
    assert (row.state, row.result) == (MessageState.SUCCEEDED, message.payload["args"][0] + 1)


class Outage:
    """The queue database unreachable from this process, from :meth:`begin` to :meth:`end`:
    its connections go to a port that refuses them."""

    def __init__(self) -> None:
        self.session = connections[conf.get().DATABASE]
        self.port = self.session.settings_dict["PORT"]

    def begin(self) -> None:
        self.session.close()
        self.session.settings_dict["PORT"] = "9"  # (discard: refused at once)

    def end(self) -> None:
        self.session.settings_dict["PORT"] = self.port


class Clock:
    """The settler's ``time`` in a test: a sleep passes at once; the database is back (the
    outage ends) once ``back_at`` is reached."""

    def __init__(self, outage: Outage, back_at: float) -> None:
        self.now = 1000.0
        self.outage = outage
        self.back_at = back_at

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.now >= self.back_at:
            self.outage.end()


@pytest.mark.django_db(transaction=True)  # (the outage ends the test's session)
@pytest.mark.parametrize("back", [True, False], ids=["back-at-the-deadline", "gone-for-good"])
def test_at_shutdown_the_settler_retries_through_an_outage_until_its_deadline_itself(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, back: bool
) -> None:
    """A stopped settler whose writes fail for the database tries again until its deadline,
    its last try at the deadline itself (not a backoff step before it): a database back by then
    gets the outcomes; one gone for good has them counted as unwritten, and said so."""
    parts, messages = claimed(2)
    pool = parts.pool()
    for message in messages:
        parts.work.put(message)
        assert pool.run_once() is True
    outage = Outage()
    deadline = 1005.0
    clock = Clock(outage, back_at=deadline if back else math.inf)
    monkeypatch.setattr(settler_module, "time", clock)
    settler = parts.settler()
    settler.stop(deadline)
    outage.begin()
    try:
        settler.run()
    finally:
        outage.end()
    assert clock.now == pytest.approx(deadline, abs=1e-6)
    assert "writing 2 outcomes failed: database unavailable" in caplog.text
    rows = Message.objects.filter(pk__in=[m.id for m in messages])
    if back:
        assert (settler.unwritten, parts.ledger.handled) == (0, 2)
        assert {r.state for r in rows} == {MessageState.SUCCEEDED}
    else:
        assert (settler.unwritten, parts.ledger.handled) == (2, 0)
        assert {r.state for r in rows} == {MessageState.RUNNING}  # for their leases to recover
        assert "giving up writing 2 outcomes at shutdown: the grace period ended" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_the_pool_drops_a_message_whose_lease_is_gone_without_running_it() -> None:
    parts, (message,) = claimed(1)
    parts.ledger.lost([(message.id, message.lease_token)])
    parts.work.put(message)
    assert parts.pool().run_once() is True
    assert parts.drained() == [] and parts.ledger.idle()
    assert parts.ledger.claimed == 0  # not run: max_messages does not count it


# -- what a task raises ----------------------------------------------------------------------------


class StrFailsError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str of this exception fails")


@task(name="tests.services.str_fails", max_attempts=3, timeout=30)
def str_fails() -> None:
    raise StrFailsError()


RAISED: dict[str, Callable[[], BaseException]] = {
    "KeyboardInterrupt": KeyboardInterrupt,
    "SystemExit": lambda: SystemExit(3),
    "GeneratorExit": GeneratorExit,
    "asyncio.exceptions.CancelledError": asyncio.CancelledError,
}


@task(name="tests.services.raises", max_attempts=2)
def raises(name: str) -> None:
    raise RAISED[name]()


def claim_one(queued: Any, *args: Any) -> tuple[Parts, ClaimedMessage]:
    """Parts holding one claimed message of the task ``queued`` (taken off the pool's
    queue)."""
    registry.autodiscover()
    queued.enqueue(*args, channel="raised")
    parts = Parts()
    assert parts.claimer().run_once() is False
    message = parts.work.get_nowait()
    assert message is not None
    return parts, message


def in_handler_thread(parts: Parts, pool: Pool, message: ClaimedMessage) -> Outcome:
    """Run ``message`` in one of the pool's own handler threads (under its time limit, as a
    worker runs it); its outcome."""
    crashed: list[BaseException] = []
    pool.start(lambda name, exc: crashed.append(exc))
    parts.work.put(message)
    outcome = parts.outcomes.get(timeout=30)
    for thread in pool.stop():
        thread.join(10)
    assert crashed == [] and isinstance(outcome, Outcome)
    return outcome


def test_an_exception_is_described_even_when_its_str_raises() -> None:
    class ReprFailsToo(StrFailsError):
        def __repr__(self) -> str:
            raise ValueError("nor repr")

    assert describe(ValueError("plain")) == "plain"
    assert (
        describe(StrFailsError()) == "StrFailsError() (str() of the exception failed: RuntimeError)"
    )
    assert describe(ReprFailsToo()) == (
        "tests.test_worker_services.test_an_exception_is_described_even_when_its_str_raises."
        "<locals>.ReprFailsToo (str() of the exception failed: RuntimeError)"
    )
    try:
        registry.get("tests.services.str_fails").func()
    except StrFailsError as exc:
        error = error_info(exc, attempt=1, worker_id="svc")
    assert error["type"] == "tests.test_worker_services.StrFailsError"
    assert "raise StrFailsError()" in error["traceback"]


@pytest.mark.django_db
def test_a_task_exception_whose_str_raises_is_retried_and_ends_its_attempt() -> None:
    """The attempt is an ordinary failure of the task, and it ends when its thread returns:
    the timer never fails it again at its time limit (nor takes its slot out of the count a
    second time, which left the worker's running count at -1)."""
    parts, message = claim_one(str_fails)
    pool = parts.pool()
    outcome = in_handler_thread(parts, pool, message)
    assert outcome.kind == "retry" and outcome.error is not None
    assert outcome.error["type"] == "tests.test_worker_services.StrFailsError"
    assert outcome.error["message"] == (
        "StrFailsError() (str() of the exception failed: RuntimeError)"
    )
    assert (parts.ledger.busy, parts.ledger.running, parts.ledger.stuck) == (0, 0, 0)
    timer = parts.timer(pool, stuck_limit=1.0)
    assert timer.run_once(now=time.monotonic() + 60) == 0  # no phantom timeout
    assert timer.run_once(now=time.monotonic() + 120) == 0
    assert parts.recycled == [] and parts.drained() == []
    assert (parts.ledger.busy, parts.ledger.stuck) == (0, 0)


@pytest.mark.django_db
def test_with_tracing_on_such_an_exception_is_still_recorded_as_the_tasks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    tracer = sdk.TracerProvider().get_tracer("tests")
    monkeypatch.setattr(tracing, "run_span", lambda message: tracer.start_as_current_span("run"))
    parts, message = claim_one(str_fails)
    outcome = in_handler_thread(parts, parts.pool(), message)
    assert outcome.kind == "retry" and outcome.error is not None
    assert outcome.error["type"] == "tests.test_worker_services.StrFailsError"


@pytest.mark.django_db
def test_an_error_outside_the_task_still_ends_its_attempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug while building an attempt's outcome fails the message (logged), and the attempt
    ends with it: no timeout of a thread that returned long ago, no slot freed twice."""

    def broken(*args: Any, **kwargs: Any) -> Outcome:
        raise RuntimeError("a bug while building the outcome")

    monkeypatch.setattr("django_fairqueue.worker.pool.failed_outcome", broken)
    parts, message = claim_one(str_fails)
    pool = parts.pool()
    outcome = in_handler_thread(parts, pool, message)
    assert outcome.kind == "failed" and outcome.error is not None
    assert outcome.error["message"] == "a bug while building the outcome"
    timer = parts.timer(pool)
    assert timer.run_once(now=time.monotonic() + 60) == 0
    assert (parts.ledger.busy, parts.ledger.running, parts.ledger.stuck) == (0, 0, 0)


@pytest.mark.django_db
@pytest.mark.parametrize("name", list(RAISED))
def test_whatever_a_task_raises_in_a_handler_thread_is_a_failure_retried_as_any(
    name: str,
) -> None:
    """A KeyboardInterrupt a task raises in a handler thread is not the operator's Ctrl-C
    (that one reaches the main thread, as a signal): retried like SystemExit and the rest,
    and the handler thread goes on."""
    parts, message = claim_one(raises, name)
    pool = parts.pool()
    outcome = in_handler_thread(parts, pool, message)
    assert outcome.kind == "retry" and outcome.error is not None
    assert outcome.error["type"] == name
    assert parts.ledger.busy == 0


def test_only_a_keyboard_interrupt_in_the_main_thread_may_be_the_operators() -> None:
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert operator_interrupt(KeyboardInterrupt())
        assert not operator_interrupt(SystemExit(1))
        elsewhere: list[bool] = []
        thread = threading.Thread(
            target=lambda: elsewhere.append(operator_interrupt(KeyboardInterrupt()))
        )
        thread.start()
        thread.join()
        assert elsewhere == [False]
        # a worker's own handlers installed: Ctrl-C stops it through them, never by raising
        signal.signal(signal.SIGINT, lambda signum, frame: None)
        assert not operator_interrupt(KeyboardInterrupt())
    finally:
        signal.signal(signal.SIGINT, previous)


# -- an outcome after the lease expired ---------------------------------------------------------

#: what the rescuer did with a message whose lease expired, in either delivery mode
TAKEN_BACK = "requeued, or failed (LeaseExpired) if at-most-once or out of attempts"


@pytest.mark.django_db(transaction=True)  # (the pool runs it in this thread)
def test_an_attempt_that_ends_after_its_lease_says_its_outcome_may_not_stand(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker held up past the lease (frozen, a task holding the GIL) does not log a plain
    "succeeded" for a message the rescuer may have dead-lettered meanwhile (at-most-once), nor
    say the rescuer requeued what it failed."""
    caplog.set_level(logging.INFO, "django_fairqueue.worker")
    parts, message = claim_one(fairtasks.sleep, 0.3)
    parts.ledger.renewed([message.id], lease_clock() + 0.1)  # expires while the task runs
    parts.work.put(message)
    assert parts.pool().run_once() is True
    (line,) = [r for r in caplog.records if r.getMessage().startswith("succeeded")]
    assert line.levelname == "WARNING"
    assert line.getMessage().endswith(
        ", after its lease had expired: recorded only if the lease still held, else the "
        f"rescuer took the message back ({TAKEN_BACK})"
    )
    Message.objects.filter(pk=message.id).update(lease_token=None, state=MessageState.FAILED)
    assert parts.settler().run_once() == 1
    assert (
        "complete of 1 messages changed nothing: their lease was lost (it expired and the "
        f"rescuer took them back: {TAKEN_BACK}; or an operator cancelled or deleted them, or "
        f"their channel was deleted); ids [{message.id}]"
    ) in caplog.text


@pytest.mark.django_db(transaction=True)  # (the pool runs it in this thread)
def test_a_message_that_ends_within_its_lease_logs_a_plain_success(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "django_fairqueue.worker")
    parts, message = claim_one(fairtasks.sleep, 0.0)
    parts.work.put(message)
    assert parts.pool().run_once() is True
    (line,) = [r for r in caplog.records if r.getMessage().startswith("succeeded")]
    assert line.levelname == "INFO" and "lease" not in line.getMessage()


# -- heartbeat -------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_heartbeat_renews_leases_finds_lost_ones_and_abort_requests() -> None:
    parts, (renewed, gone, aborted) = claimed(3)
    before = Message.objects.get(pk=renewed.id).lease_expires_at
    Message.objects.filter(pk=gone.id).update(lease_token=None, state=MessageState.READY)
    assert abort([aborted.id]) == {aborted.id: "abort_requested"}
    time.sleep(0.01)
    heartbeat = Heartbeat(parts.ledger, lease=LEASE, worker_id="svc")
    assert heartbeat.run_once() == 2
    assert Message.objects.get(pk=renewed.id).lease_expires_at > before
    assert parts.ledger.lease_gone(gone) and not parts.ledger.lease_gone(renewed)
    assert parts.ledger.abort_pending(aborted.id)
    assert [i for i, _ in parts.ledger.leases()] == [renewed.id, aborted.id]


# -- timer -----------------------------------------------------------------------------------------


def running_attempt(parts: Parts, message: ClaimedMessage, timeout: float | None) -> Any:
    """An attempt of ``message`` running (in this thread) under a time limit."""
    parts.ledger.claimed_now([message], lease_clock() + 30)
    return parts.ledger.start_attempt(message, registry.get(message.task_name), timeout)


@pytest.mark.django_db
@pytest.mark.parametrize("returns_first", [False, True])
def test_the_timer_fails_an_attempt_at_its_limit_and_it_is_written_when_its_thread_returns(
    returns_first: bool,
) -> None:
    parts, (message,) = claimed(1)
    parts.ledger.not_started(ran=False)  # (taken off the claim's count: recorded again below)
    attempt = running_attempt(parts, message, timeout=0.5)
    timer = parts.timer(parts.pool())
    assert timer.run_once(now=attempt.started + 0.4) == 0
    if returns_first:  # the thread returns between the limit and the timer's outcome
        parts.ledger.expire(attempt.started + 0.6)
        assert parts.ledger.end_attempt(attempt) == (False, None)
        assert parts.ledger.park(attempt, Outcome(message, "failed")) is True
        return
    assert timer.run_once(now=attempt.started + 0.6) == 1
    # failed at the limit, but nothing to write yet: the message holds its slot
    assert parts.drained() == [] and parts.ledger.stuck == 1 and not parts.ledger.idle()
    assert attempt.passed()
    mine, parked = parts.ledger.end_attempt(attempt)  # the stuck thread returns
    assert not mine and parked is not None and parked.kind == "retry" and parked.timed_out
    assert parked.error is not None and "exceeded its time limit of 0.5 s" in str(parked.error)
    assert parts.ledger.stuck == 0


@pytest.mark.django_db
def test_the_timer_recycles_the_worker_when_a_stuck_thread_outlives_the_limit() -> None:
    parts, (message, other) = claimed(2)
    for _ in range(2):
        parts.ledger.not_started(ran=False)
    attempt = running_attempt(parts, message, timeout=0.1)
    timer = parts.timer(parts.pool(), stuck_limit=60.0)
    timer.run_once(now=attempt.started + 0.2)
    timer.run_once(now=attempt.started + 30.0)
    assert parts.recycled == []
    timer.run_once(now=attempt.started + 61.0)
    assert parts.recycled and "STUCK_TASK_LIMIT 60s" in parts.recycled[0]
    # and when too many are stuck at once
    second = running_attempt(parts, other, timeout=0.1)
    many = parts.timer(parts.pool(), max_stuck=2)
    many.run_once(now=second.started + 0.2)
    assert "2 handler threads are stuck" in parts.recycled[-1]


@pytest.mark.django_db
def test_an_abort_not_heeded_within_its_grace_ends_aborted_when_its_thread_returns() -> None:
    parts, (message,) = claimed(1)
    parts.ledger.not_started(ran=False)
    parts.ledger = Ledger(capacity=4, abort_grace=0.5)
    attempt = running_attempt(parts, message, timeout=None)
    assert parts.ledger.aborts_requested([message.id]) == [message.id]
    assert attempt.aborting()
    timer = parts.timer(parts.pool())
    assert timer.run_once(now=time.monotonic() + 1.0) == 1
    _, parked = parts.ledger.end_attempt(attempt)
    assert parked is not None and parked.kind == "aborted"


# -- listener and maintenance ----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_listener_wakes_on_each_notification() -> None:
    wakes: list[None] = []
    listener = Listener(worker_id="svc", on_wake=lambda: wakes.append(None))
    try:
        assert listener.run_once(timeout=0.01) == 0
        assert listener.listening.is_set() and len(wakes) == 1  # the catch-up after LISTEN
        fairtasks.add.enqueue(1, 1, channel="listened")
        deadline = time.monotonic() + 5
        while len(wakes) < 2 and time.monotonic() < deadline:
            listener.run_once(timeout=0.1)
        assert len(wakes) == 2
    finally:
        listener.stop()
        listener._close()
    assert not listener.listening.is_set()


@pytest.mark.django_db
def test_the_maintenance_service_runs_each_of_its_services_once() -> None:
    rescued: list[None] = []
    service = Maintenance([DeltaFolder()], on_rescued=lambda: rescued.append(None))
    fairtasks.add.enqueue(1, 1, channel="m")
    assert service.run_once() == {"folder": 1}
    assert channel_store.fold_channel_deltas() == 0


def test_services_are_stopped_from_another_thread() -> None:
    parts = Parts()
    heartbeat = Heartbeat(parts.ledger, lease=timedelta(seconds=3600), worker_id="svc")
    heartbeat.start(lambda name, exc: None)
    heartbeat.stop()
    heartbeat.join(5)
    assert heartbeat.thread is not None and not heartbeat.thread.is_alive()


# -- the supervisor's restarts ---------------------------------------------------------------------


def test_a_slot_backs_off_exponentially_with_jitter_while_its_children_exit_young() -> None:
    from django_fairqueue.worker import supervisor

    slot = supervisor.Slot(0)
    delays = []
    for _ in range(8):
        slot.started = 100.0
        delays.append(slot.exited(1, 100.5))  # died half a second after starting
    ceilings = [min(supervisor.RESTART_CAP, supervisor.RESTART_FIRST * 2**i) for i in range(8)]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True)), delays
    assert slot.crash_loop and slot.young_exits == 8
    # one that lived past STABLE_AFTER starts over; a clean exit (a recycle) restarts at once
    slot.started = 300.0
    assert slot.exited(1, 300.0 + supervisor.STABLE_AFTER) == supervisor.RESTART_FIRST
    assert not slot.crash_loop and slot.backoff == 0
    slot.exited(1, slot.started + 1)
    slot.started = 400.0
    assert slot.exited(0, 400.5) == 0.0 and slot.young_exits == 0
    # the record is bounded
    for _ in range(3 * supervisor.EXIT_HISTORY):
        slot.exited(1, slot.started + 1)
    assert len(slot.exits) == supervisor.EXIT_HISTORY


def test_a_crash_loop_is_logged_and_restarts_slow_down(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from django_fairqueue.runtime import StopFlag
    from django_fairqueue.worker import supervisor

    monkeypatch.setattr(supervisor, "RESTART_FIRST", 0.2)
    stop = StopFlag()
    sup = supervisor.Supervisor(
        lambda i: [sys.executable, "-c", "raise SystemExit(3)"], 1, stop=stop
    )
    runner = threading.Thread(target=sup.run)
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while sup.slots[0].young_exits < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        runner.join(10)
    slot = sup.slots[0]
    assert slot.young_exits >= 5 and {e.code for e in slot.exits} == {3}
    starts = [e.at - e.lived for e in slot.exits]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert gaps[-1] > gaps[0], gaps  # each wait longer than the one before (with jitter)
    loops = [r for r in caplog.records if "crash loop:" in r.getMessage()]
    assert loops and loops[0].levelname == "ERROR"
    assert "deaths in a row soon after starting (exit status 3 after" in loops[0].getMessage()


def test_a_burst_gives_up_a_worker_that_could_not_start_and_ends_with_status_1(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its worker id in use, its metrics port taken: started again it would fail the same way,
    so a burst's supervisor does not start it for ever; the other slots finish their burst."""
    import sys

    from django_fairqueue.runtime import STARTUP_FAILED_EXIT, StopFlag
    from django_fairqueue.worker import supervisor

    monkeypatch.setattr(supervisor, "RESTART_FIRST", 0.05)
    stop = StopFlag()
    timer = threading.Timer(30, stop.set)  # (a supervisor that would go on: the test fails)
    timer.start()
    try:

        def command_for(i: int) -> list[str]:
            return [sys.executable, "-c", f"raise SystemExit({STARTUP_FAILED_EXIT if i else 0})"]

        started = time.monotonic()
        code = supervisor.Supervisor(command_for, 2, burst=True, stop=stop).run()
    finally:
        timer.cancel()
    assert not stop.is_set() and time.monotonic() - started < 20
    assert code == 1
    (gave_up,) = [r for r in caplog.records if "could not start" in r.getMessage()]
    assert gave_up.levelname == "ERROR" and "worker 1 (pid" in gave_up.getMessage()


def test_a_supervised_worker_that_cannot_start_says_so_by_its_exit_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    from django.core.management import CommandError, call_command

    from django_fairqueue.runtime import STARTUP_FAILED_EXIT, SUPERVISION_ENV

    pytest.importorskip("prometheus_client")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        with pytest.raises(CommandError, match="--metrics-port") as alone:
            call_command("runfairworker", "--burst", "--metrics-port", port)
        assert alone.value.returncode == 1  # a worker on its own: the usual status
        monkeypatch.setenv(SUPERVISION_ENV, "{}")
        with pytest.raises(CommandError, match="--metrics-port") as supervised:
            call_command("runfairworker", "--burst", "--metrics-port", port)
        assert supervised.value.returncode == STARTUP_FAILED_EXIT


def test_a_second_signal_ends_the_supervisor_with_128_plus_its_number(tmp_path: Any) -> None:
    import signal
    import sys

    from django_fairqueue.runtime import StopFlag
    from django_fairqueue.worker import supervisor

    # a child that stops cleanly on SIGTERM, as a worker does
    graceful = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))"
    sleeper = [sys.executable, "-c", f"{graceful}; time.sleep(30)"]
    for signals, code in ((1, 0), (2, 128 + signal.SIGTERM)):
        stop = StopFlag()
        sup = supervisor.Supervisor(lambda i: sleeper, 2, stop=stop)
        result: list[int] = []
        runner = threading.Thread(target=lambda: result.append(sup.run()))  # noqa: B023
        runner.start()
        deadline = time.monotonic() + 20
        while not all(s.proc is not None for s in sup.slots) and time.monotonic() < deadline:
            time.sleep(0.05)
        for _ in range(signals):  # (as the signal handler would be called)
            sup._on_signal(signal.SIGTERM)
        runner.join(20)
        assert result == [code], (signals, result)
    # a child that did not stop cleanly (it exited at once): status 1
    ready = tmp_path / "handler installed"
    at_once = (
        "import os, signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: os._exit(143)); "
        "open(sys.argv[1], 'w').close(); time.sleep(30)"
    )
    killed = supervisor.Supervisor(lambda i: [sys.executable, "-c", at_once, str(ready)], 1)
    result = []
    runner = threading.Thread(target=lambda: result.append(killed.run()))
    runner.start()
    deadline = time.monotonic() + 20
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    killed._on_signal(signal.SIGTERM)
    runner.join(20)
    assert result == [1]

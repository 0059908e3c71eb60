"""Real ``runfairworker`` subprocesses: crashes, signals, stalls, poison messages, LISTEN.

Each worker runs ``python -m django runfairworker --settings tests.settings`` against the test
database (``DATABASE_URL``), with short leases and intervals passed through
``FAIRQUEUE_TEST_OVERRIDES`` (read by tests/settings.py). The tests watch the database and the
workers' logs; they wait for states, never for fixed times, and bound waits generously.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from django_fairqueue.maintenance import Rescuer
from django_fairqueue.models import Channel, Message, MessageState
from django_fairqueue.runtime import SAME_STOP_SECONDS
from django_fairqueue.tasks import task
from tests import fairtasks
from tests.workerkit import WorkerProcess, counters, enqueue_raw, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

#: Short leases and intervals keep these tests quick; the worker renews leases 3x per period.
OVERRIDES = {
    "LEASE_SECONDS": 1.5,
    "RESCUE_INTERVAL": 0.3,
    "POLL_INTERVAL": 0.5,
    "RETRY_BACKOFF_BASE": 0,
}

FINAL = {MessageState.SUCCEEDED, MessageState.FAILED}
#: what the rescuer does with a message whose lease expired, as the workers' logs say it
TAKEN_BACK = "requeued, or failed (LeaseExpired) if at-most-once or out of attempts"


@task(name="tests.only_in_the_test_process")
def only_here() -> None:
    """Registered here, unknown to the worker subprocesses."""


class Workers:
    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self.started: list[WorkerProcess] = []

    def start(
        self, worker_id: str, *args: str, overrides: dict[str, Any] | None = None
    ) -> WorkerProcess:
        worker = WorkerProcess(
            self.database_url, worker_id, *args, overrides={**OVERRIDES, **(overrides or {})}
        )
        self.started.append(worker)
        return worker


@pytest.fixture
def workers(database_url: str) -> Iterator[Workers]:
    pool = Workers(database_url)
    try:
        yield pool
    finally:
        for worker in pool.started:
            worker.close()
            # shown only when the test fails
            print(f"--- log of worker {worker.worker_id} ---\n{worker.output}")


def row(mid: int) -> Message:
    return Message.objects.get(pk=mid)


def states(*ids: int) -> dict[int, str]:
    return dict(Message.objects.filter(pk__in=ids).values_list("id", "state"))


def all_final(*ids: int) -> bool:
    found = states(*ids)
    return len(found) == len(ids) and set(found.values()) <= FINAL


def test_kill_9_mid_message_runs_it_again_after_its_lease_and_frees_the_slot_once(
    workers: Workers, tmp_path: Path
) -> None:
    Channel.objects.create(name="k", max_concurrency=1)
    marker = tmp_path / "started"
    slow = fairtasks.sleep.enqueue(60, str(marker), True, channel="k")  # long on attempt 1 only
    after = fairtasks.record.enqueue("after", channel="k")

    a = workers.start("kill-a", "--concurrency", "2")
    wait_until(marker.exists, 30, "the slow message starting")
    assert row(after).state == MessageState.READY  # max_concurrency=1 holds it back
    a.signal(signal.SIGKILL)
    assert a.wait() == -signal.SIGKILL
    assert row(slow).state == MessageState.RUNNING  # orphaned until its lease expires

    b = workers.start("kill-b", "--concurrency", "2")
    wait_until(lambda: all_final(slow, after), 30, "both messages finishing")

    rerun, later = row(slow), row(after)
    assert (rerun.state, rerun.attempts, rerun.result["pid"]) == ("succeeded", 2, b.pid)
    assert (later.state, later.attempts, later.result["pid"]) == ("succeeded", 1, b.pid)
    b.wait_for(
        f"lease expired: tests.fair.sleep message {slow} channel 'k' of worker kill-a, "
        "attempt 1 -> retry"
    )
    # The rescue freed the dead worker's slot exactly once: a second release would leave
    # running at -1 (and let two messages of this channel run at once).
    c = counters("k")
    assert (c.ready, c.running, c.succeeded, c.failed) == (0, 0, 2, 0)


def test_sigterm_lets_running_messages_finish_and_claims_nothing_more(
    workers: Workers, tmp_path: Path
) -> None:
    markers = [tmp_path / "s0", tmp_path / "s1"]
    slow = [fairtasks.sleep.enqueue(1.5, str(m), channel="t") for m in markers]
    rest = [fairtasks.record.enqueue(str(i), channel="t") for i in range(3)]

    w = workers.start("term", "--concurrency", "2")
    wait_until(lambda: all(m.exists() for m in markers), 30, "both slow messages starting")
    w.signal(signal.SIGTERM)

    assert w.wait() == 0
    assert "SIGTERM received: claiming nothing more" in w.output
    for mid in slow:
        finished = row(mid)
        assert (finished.state, finished.attempts, finished.result["pid"]) == (
            "succeeded",
            1,
            w.pid,
        )
    assert {(r.state, r.attempts) for r in Message.objects.filter(pk__in=rest)} == {("ready", 0)}
    c = counters("t")
    assert (c.ready, c.running, c.succeeded) == (3, 0, 2)


def test_a_second_signal_exits_at_once_and_the_lease_recovers_the_message(
    workers: Workers, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    slow = fairtasks.sleep.enqueue(60, str(marker), channel="t")
    w = workers.start("twice", "--concurrency", "1")
    wait_until(marker.exists, 30, "the slow message starting")

    w.signal(signal.SIGTERM)
    w.wait_for("SIGTERM received")
    w.signal(signal.SIGTERM)  # at once: the same stop (a service manager's and a supervisor's)
    w.wait_for("SIGTERM received again within")
    time.sleep(SAME_STOP_SECONDS)
    w.signal(signal.SIGTERM)

    assert w.wait(10) == 128 + signal.SIGTERM
    assert (
        "SIGTERM received again: exiting now; the leases of 1 unfinished messages will expire "
        f"and the rescuer will take them back ({TAKEN_BACK})"
    ) in w.output
    assert row(slow).state == MessageState.RUNNING
    # once the lease (1.5 s) expires, any rescuer puts it back
    wait_until(lambda: Rescuer().run_once(), 15, "the lease expiring")
    back = row(slow)
    assert (back.state, back.attempts, back.last_error["type"]) == ("ready", 1, "LeaseExpired")


def test_after_the_grace_period_running_messages_are_left_to_their_leases(
    workers: Workers, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    slow = fairtasks.sleep.enqueue(60, str(marker), channel="t")
    w = workers.start("grace", "--concurrency", "1", "--shutdown-grace", "0.5")
    wait_until(marker.exists, 30, "the slow message starting")
    w.signal(signal.SIGTERM)

    assert w.wait(20) == 0
    assert (
        "1 messages still running after the 0.5s grace period: left behind (their leases "
        f"expire as the worker stops, and the rescuer takes them back: {TAKEN_BACK})"
    ) in w.output
    assert row(slow).state == MessageState.RUNNING


def test_a_stalled_worker_past_its_lease_changes_nothing_when_it_wakes_up(
    workers: Workers, tmp_path: Path
) -> None:
    m1, m2 = tmp_path / "m1", tmp_path / "m2"
    completes = fairtasks.sleep.enqueue(2.0, str(m1), True, channel="s")
    fails = fairtasks.fail_first.enqueue(2.0, str(m2), channel="s")

    stale = workers.start("stale", "--concurrency", "2")
    wait_until(lambda: m1.exists() and m2.exists(), 30, "both messages starting")
    stale.signal(signal.SIGSTOP)  # frozen mid-handler, past its 1.5 s lease

    fresh = workers.start("fresh", "--concurrency", "2")
    wait_until(
        lambda: set(states(completes, fails).values()) == {"succeeded"}, 30, "fresh finishing"
    )
    fields = ("state", "attempts", "result", "finished_at", "last_error", "lease_expires_at")
    before = {mid: [getattr(row(mid), f) for f in fields] for mid in (completes, fails)}
    for mid in (completes, fails):
        done = row(mid)
        assert (done.attempts, done.worker_id, done.result["pid"]) == (2, "fresh", fresh.pid)
        assert done.last_error["type"] == "LeaseExpired"  # the rescue's, kept by the success

    stale.signal(signal.SIGCONT)
    # its handlers finish (one returns, one raises) and it tries to record both
    stale.wait_for("complete of 1 messages changed nothing")
    stale.wait_for("fail of 1 messages changed nothing")
    # nor does its log say the success it could not record stands
    assert re.search(
        rf"succeeded tests\.fair\.sleep message {completes} .* after its lease had expired: "
        r"recorded only if the lease still held",
        stale.output,
    )
    assert f"rescuer took them back: {TAKEN_BACK}" in stale.output

    after = {mid: [getattr(row(mid), f) for f in fields] for mid in (completes, fails)}
    assert after == before  # no complete, fail or heartbeat of the stale worker landed
    c = counters("s")
    assert (c.ready, c.running, c.succeeded, c.failed) == (0, 0, 2, 0)


def test_poison_messages_end_failed_while_the_rest_finish(workers: Workers) -> None:
    unknown = only_here.enqueue(channel="p")
    bad_payload = enqueue_raw("p", "tests.fair.add", "[1, 2]")
    # (arguments that no longer fit: as an older deploy queued them; enqueue refuses them now)
    bad_args = enqueue_raw("p", "tests.fair.add", '{"args": [1, 2, 3], "kwargs": {}}')
    raising = fairtasks.boom.enqueue("kaboom", channel="p")
    good = [fairtasks.record.enqueue(str(i), channel=f"g{i % 2}") for i in range(6)]
    rest = [unknown, bad_payload, bad_args, raising, *good]

    a = workers.start("poison-a", "--concurrency", "2")
    # The worker goes on after each poison message until all of them are final...
    wait_until(lambda: all_final(*rest), 30, "the poison messages and the good ones")
    # ...and only then gets the message that kills it, so nothing else is in flight. (A delay
    # with run_after raced the worker's start-up on a loaded machine.)
    exiting = fairtasks.exit_process.enqueue(3, channel="p")
    assert a.wait(30) == 3  # the exit task killed it (os._exit(3))

    def error(mid: int) -> tuple[str, int, str, str]:
        r = row(mid)
        return (r.state, r.attempts, r.last_error["type"], r.last_error["message"])

    assert error(unknown)[:3] == ("failed", 1, "django_fairqueue.exceptions.UnknownTask")
    assert error(bad_payload)[:3] == ("failed", 1, "django_fairqueue.exceptions.PayloadError")
    assert error(bad_args)[:3] == ("failed", 1, "TypeError")
    assert error(raising) == ("failed", 2, "tests.fairtasks.BoomError", "kaboom")
    assert {(row(mid).state, row(mid).result["pid"]) for mid in good} == {("succeeded", a.pid)}

    # The message that killed its worker is left running; once its lease expires, another
    # worker's rescuer dead-letters it (max_attempts=1), and never runs it again.
    assert row(exiting).state == MessageState.RUNNING
    b = workers.start("poison-b", "--concurrency", "2")
    wait_until(lambda: all_final(exiting), 30, "the rescue of the exit message")
    exited = row(exiting)
    assert (exited.state, exited.attempts, exited.last_error["type"]) == (
        "failed",
        1,
        "LeaseExpired",
    )
    for channel in ("p", "g0", "g1"):
        assert counters(channel).running == 0
    assert b.proc.poll() is None  # still running


def test_listen_wakes_an_idle_worker_fast_and_the_listener_reconnects(workers: Workers) -> None:
    # Polling every 30 s: anything picked up sooner was woken by a notification.
    w = workers.start("listen", "--concurrency", "1", overrides={"POLL_INTERVAL": 30.0})
    w.wait_for("listening on 'fairqueue' for wake-ups")

    def pick_up(label: str) -> float:
        mid = fairtasks.record.enqueue(label, channel="l")
        committed = time.time()
        done = wait_until(
            lambda: (r := row(mid)).state == MessageState.SUCCEEDED and r, 20, f"{label} done"
        )
        return float(done.result["started"]) - committed

    time.sleep(0.3)  # past the first claim: the worker is idle
    latencies = sorted(pick_up(f"m{i}") for i in range(7))
    assert latencies[3] < 3.0, latencies  # the median, far below the 30 s poll

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = %s",
            ["fairqueue listener listen"],
        )
        assert cursor.fetchone() == (1,)
    # enqueued while the listener is down: the catch-up claim after reconnecting finds it
    catch_up = pick_up("during reconnect")
    w.wait_for("listening again on 'fairqueue'")
    assert catch_up < 10.0, catch_up
    again = sorted(pick_up(f"after{i}") for i in range(3))
    assert again[1] < 3.0, again
    print(f"\npick-up latency with LISTEN (s): {latencies}; after reconnect: {again}")


# ------------------------------------------------------------------------------------------------
# the supervisor: runfairworker --processes


def test_a_supervisor_restarts_workers_a_task_kills_and_stops_them_all(workers: Workers) -> None:
    killers = [fairtasks.exit_process.enqueue(3, channel=f"k{i}") for i in range(3)]
    good = [fairtasks.record.enqueue(str(i), channel=f"s{i % 3}") for i in range(30)]
    sup = workers.start(
        "sup", "--processes", "2", "--concurrency", "1", "--max-tasks-per-child", "7"
    )
    # Every message ends final: the good ones run, each killer takes one child down with it
    # and is dead-lettered once its lease expires, and the supervisor keeps two children alive.
    wait_until(lambda: all_final(*good, *killers), 60, "every message final")
    assert {row(mid).state for mid in good} == {MessageState.SUCCEEDED}
    assert {row(mid).last_error["type"] for mid in killers} == {"LeaseExpired"}
    # each killer took one child down, and its slot was started again after a backoff
    deaths = [line for line in sup.output.splitlines() if "died (exit status 3)" in line]
    assert len(deaths) == 3, sup.output
    assert all(re.search(r"restart \d+ in \d+\.\ds(;|$)", line) for line in deaths), deaths
    # 30 messages over children that are replaced every 7: at least 4 recycled
    sup.wait_for("recycled; starting a fresh one")
    pids = {r.result["pid"] for r in Message.objects.filter(pk__in=good)}
    assert len(pids) >= 4, pids
    assert sup.pid not in pids  # the supervisor itself ran nothing
    sup.signal(signal.SIGTERM)
    assert sup.wait(30) == 0
    sup.wait_for("signal SIGTERM, stopping gracefully")
    time.sleep(0.5)
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    assert alive == [], f"children outlived their supervisor: {alive}"


def test_a_slot_started_again_takes_back_its_dead_childs_messages_at_once(
    workers: Workers,
) -> None:
    from django_fairqueue.models import WorkerRecord

    killer = fairtasks.exit_process.enqueue(3, channel="k")
    # no --worker-id; a lease and a dead-after far longer than the test
    sup = workers.start(
        "", "--processes", "2", "--concurrency", "1", overrides={"LEASE_SECONDS": 120.0}
    )
    # the child dies with the message; the next child of the slot has the same id, and
    # registering expires the leases its dead predecessor left (the message: max_attempts=1)
    try:
        wait_until(lambda: all_final(killer), 20, "the killer dead-lettered by the next child")
    except AssertionError:
        raise AssertionError(sup.output) from None
    assert row(killer).last_error["type"] == "LeaseExpired"
    assert "died (exit status 3)" in sup.output
    slots = sorted(WorkerRecord.objects.values_list("worker_id", flat=True))
    assert [slot[-2:] for slot in slots] == ["-0", "-1"], slots  # two slots, two records
    sup.signal(signal.SIGTERM)
    assert sup.wait(30) == 0


def test_a_stop_signal_to_the_supervisor_and_its_children_at_once_is_one_graceful_stop(
    workers: Workers, tmp_path: Path
) -> None:
    """systemd's default KillMode signals every process of the service: each child hears the
    stop directly and again through the supervisor, and finishes its running message."""
    markers = [tmp_path / "s0", tmp_path / "s1"]
    slow = [fairtasks.sleep.enqueue(2, str(m), channel=f"g{i}") for i, m in enumerate(markers)]
    sup = workers.start("cgroup", "--processes", "2", "--concurrency", "1")
    wait_until(lambda: all(m.exists() for m in markers), 30, "both slow messages starting")
    children = Path(f"/proc/{sup.pid}/task/{sup.pid}/children").read_text().split()
    sup.signal(signal.SIGTERM)
    # a moment later, as two deliveries (two signals pending at once would merge into one)
    time.sleep(0.2)
    for pid in map(int, children):
        os.kill(pid, signal.SIGTERM)
    assert sup.wait(30) == 0, sup.output
    assert {row(mid).state for mid in slow} == {MessageState.SUCCEEDED}
    assert "received again within" in sup.output


def test_a_burst_with_recycled_children_runs_the_queue_down(workers: Workers) -> None:
    """A child replaced after its --max-tasks-per-child messages is a recycle, not the end of
    the burst: the supervisor starts a fresh one until the queue is empty."""
    ids = [fairtasks.record.enqueue(str(i), channel=f"b{i % 3}") for i in range(7)]
    sup = workers.start(
        "burst", "--processes", "1", "--concurrency", "2", "--max-tasks-per-child", "3", "--burst"
    )
    assert sup.wait(60) == 0, sup.output
    assert {row(mid).state for mid in ids} == {MessageState.SUCCEEDED}
    assert "recycled; starting a fresh one" in sup.output


def test_a_supervisor_refuses_max_messages() -> None:
    from django.core.management import call_command
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="--max-tasks-per-child"):
        call_command("runfairworker", "--processes", "2", "--max-messages", "5")


# ------------------------------------------------------------------------------------------------
# the worker registry


def test_workers_register_beat_and_deregister_and_a_dead_ones_leases_are_rescued_at_once(
    workers: Workers, tmp_path: Path, settings: Any
) -> None:
    from django_fairqueue.models import WorkerRecord
    from django_fairqueue.runtime import worker_registry

    fast = {"WORKER_HEARTBEAT": 0.2, "WORKER_DEAD_AFTER": 3.0, "LEASE_SECONDS": 60.0}
    settings.FAIRQUEUE = {**settings.FAIRQUEUE, **fast}
    marker = tmp_path / "started"
    slow = fairtasks.sleep.enqueue(120, str(marker), True, channel="d")
    a = workers.start("reg-a", "--concurrency", "2", "--channels", "d", overrides=fast)
    wait_until(marker.exists, 30, "the slow message starting")
    b = workers.start("reg-b", "--concurrency", "3", overrides=fast)  # after: a runs it
    rec = wait_until(
        lambda: WorkerRecord.objects.filter(worker_id="reg-a", running=1).first(), 20, "a beat"
    )
    assert (rec.pid, rec.concurrency, rec.channels, rec.state) == (a.pid, 2, ["d"], "running")
    both = {"reg-a": "alive", "reg-b": "alive"}
    wait_until(
        lambda: {v.worker_id: v.state for v in worker_registry.workers()} == both, 30, "both"
    )

    # reg-a dies holding the slow message under a 60 s lease; reg-b's maintenance loop (its
    # rescuer runs every 0.3 s here) finds it silent past WORKER_DEAD_AFTER and requeues the
    # message at once. (attempt 2 does not sleep: first_attempt_only)
    a.signal(signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: row(slow).state == MessageState.SUCCEEDED, 30, "the rescue and rerun")
    rescued_after = time.monotonic() - killed
    assert rescued_after < 20, rescued_after  # far below the 60 s lease
    assert row(slow).result["pid"] == b.pid
    assert WorkerRecord.objects.get(worker_id="reg-a").state == "dead"
    b.wait_for("is dead: no beat for")
    print(f"\ndead worker's message rerun {rescued_after:.1f}s after kill -9 (lease 60 s)")

    b.signal(signal.SIGTERM)
    assert b.wait(30) == 0
    assert WorkerRecord.objects.get(worker_id="reg-b").state == "stopped"


def test_a_second_live_worker_with_the_same_id_refuses_to_start_and_takes_nothing_over(
    workers: Workers, tmp_path: Path
) -> None:
    from django_fairqueue.models import WorkerRecord

    # a lease and a dead-after far longer than the test: only the pid check frees the id
    long = {"LEASE_SECONDS": 120.0, "WORKER_DEAD_AFTER": 120.0}
    marker = tmp_path / "started"
    slow = fairtasks.sleep.enqueue(4, str(marker), channel="dup")
    a = workers.start("same-id", "--concurrency", "1", overrides=long)
    wait_until(marker.exists, 30, "the slow message starting")
    b = workers.start("same-id", "--concurrency", "1", overrides=long)
    assert b.wait(30) == 1
    refusal = b.wait_for("worker id same-id is in use by a live worker on host")
    assert f" pid {a.pid}, last beat " in refusal
    assert "give each process its own --worker-id" in refusal
    # the first one's message ran once, in the first one, and its row is still its own
    wait_until(lambda: all_final(slow), 30, "the slow message finishing")
    done = row(slow)
    assert (done.state, done.attempts, done.result["pid"]) == ("succeeded", 1, a.pid)
    assert "lease was lost" not in a.output
    assert WorkerRecord.objects.get(worker_id="same-id").pid == a.pid

    # killed, the first one's process is gone: a worker started again with its id takes its
    # message back at once (not after the 120 s lease, nor the 120 s dead-after)
    marker.unlink()
    again = fairtasks.sleep.enqueue(60, str(marker), True, channel="dup")
    wait_until(marker.exists, 30, "the next slow message starting")
    a.signal(signal.SIGKILL)
    assert a.wait() == -signal.SIGKILL
    c = workers.start("same-id", "--concurrency", "1", overrides=long)
    wait_until(lambda: all_final(again), 30, "the killed worker's message rerun")
    rerun = row(again)
    assert (rerun.state, rerun.attempts, rerun.result["pid"]) == ("succeeded", 2, c.pid)
    c.wait_for("expired 1 leases a previous process with this id left behind")
    c.signal(signal.SIGTERM)
    assert c.wait(30) == 0


def test_a_supervisor_tells_a_slots_next_child_the_pid_of_the_one_it_reaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json
    import sys
    import threading

    from django_fairqueue.runtime import SUPERVISION_ENV, StopFlag, worker_registry
    from django_fairqueue.worker import supervisor

    monkeypatch.setattr(supervisor, "RESTART_FIRST", 0.1)
    told = tmp_path / "told"
    # each child writes its pid and what its supervisor told it, then dies
    child = (
        "import os, sys; "
        "open(sys.argv[1], 'a').write(str(os.getpid()) + ' ' + os.environ[sys.argv[2]] + '\\n'); "
        "sys.exit(3)"
    )
    stop = StopFlag()
    sup = supervisor.Supervisor(
        lambda i: [sys.executable, "-c", child, str(told), SUPERVISION_ENV], 1, stop=stop
    )
    runner = threading.Thread(target=sup.run)
    runner.start()
    try:
        wait_until(lambda: told.exists() and len(told.read_text().splitlines()) >= 3, 20, "3")
    finally:
        stop.set()
        runner.join(10)
    lines = [line.split(" ", 1) for line in told.read_text().splitlines()]
    pids = [int(pid) for pid, _ in lines]
    before = [json.loads(text)[worker_registry.PREDECESSOR_PID] for _, text in lines]
    assert before[:3] == [None, pids[0], pids[1]]


def test_a_worker_replaces_threads_stuck_past_a_time_limit_then_recycles_itself(
    workers: Workers, tmp_path: Path
) -> None:
    w = workers.start("recycle", "--concurrency", "2", "--max-abandoned-threads", "2")
    quick = [fairtasks.record.enqueue(str(i), channel="r") for i in range(4)]
    wait_until(lambda: all_final(*quick), 20, "the quick messages")
    markers = [tmp_path / "h0", tmp_path / "h1"]
    hung = [fairtasks.hang.enqueue(str(markers[0]), channel="h0")]
    w.wait_for("exceeded its time limit of 0.3s: attempt 1 of 1 failed; its handler thread")
    # One thread is stuck, its replacement runs the rest alongside the other thread.
    more = [fairtasks.record.enqueue(str(i), channel="r") for i in range(4)]
    wait_until(lambda: all_final(*more), 20, "messages after the first time-out")
    # the stuck attempt still holds its message (and its channel's slot)
    assert row(hung[0]).state == MessageState.RUNNING
    hung.append(fairtasks.hang.enqueue(str(markers[1]), channel="h1"))
    line = w.wait_for("recycling: 2 handler threads are stuck in tasks past their time limit")
    assert "max_abandoned_threads 2" in line
    assert w.wait(30) == 0  # a normal exit: the supervisor or process manager starts a new one
    w.wait_for("2 timed-out attempts still hold a handler thread: not written")
    assert all(m.exists() for m in markers)
    # Not written while their threads ran; now the process is gone, their leases expire and
    # the rescuer settles them (no attempts left: failed).

    def rescued() -> bool:
        Rescuer().run_once()
        return all_final(*hung)

    wait_until(rescued, 20, "the rescuer")
    for mid in hung:
        failed = row(mid)
        assert (failed.state, failed.attempts) == (MessageState.FAILED, 1)
        assert failed.last_error["type"] == "LeaseExpired"
    assert {row(m).state for m in quick + more} == {MessageState.SUCCEEDED}
    for name in ("h0", "h1"):
        c = counters(name)
        assert (c.ready, c.running, c.failed) == (0, 0, 1)
    w.wait_for(f"worker recycle stopped after {len(quick) + len(more)} messages")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("flags", "most"),
    [((), 6), (("--no-listen",), 5), (("--no-listen", "--no-maintenance"), 4)],
    ids=["listening", "no-listen", "no-listen-no-maintenance"],
)
def test_a_worker_opens_the_connections_the_deploy_page_counts(
    database_url: str, tmp_path: Path, flags: tuple[str, ...], most: int
) -> None:
    """deploy-workers.md, "Connections per worker process": with tasks that never touch the
    database, 6 (5 with --no-listen, 4 with --no-maintenance too): the claimer, settler,
    heartbeat, registry beat, maintenance and listener, each its own."""
    name = f"conncount-{len(flags)}"
    worker = WorkerProcess(
        f"{database_url}?application_name={name}",
        name,
        "--concurrency",
        "2",
        *flags,
        overrides={**OVERRIDES, "LEASE_SECONDS": 6},
    )
    try:
        markers = [tmp_path / f"m{i}" for i in range(2)]
        for marker in markers:
            fairtasks.sleep.enqueue(20.0, str(marker), channel=f"c{marker.name}")
        wait_until(lambda: all(m.exists() for m in markers), 30, "both tasks running")

        def connections_now() -> int:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [name]
                )
                (count,) = cursor.fetchone()
            return int(count)

        # the heartbeat connects at its first beat with messages in flight (every lease / 3)
        wait_until(lambda: connections_now() == most, 30, f"{most} connections")
        seen = []
        for _ in range(5):  # and no more a moment later
            time.sleep(0.2)
            seen.append(connections_now())
        assert max(seen) == most, seen
    finally:
        worker.close()

"""The worker registry seen from outside a worker: registering, status, the admin page."""

from __future__ import annotations

import io
import json
import os
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.db import connections
from django.test import Client
from django.urls import reverse
from django.utils import timezone

import django_fairqueue
from django_fairqueue import conf
from django_fairqueue.cli import status as status_cli
from django_fairqueue.cli import workers as workers_cli
from django_fairqueue.db import message_store
from django_fairqueue.maintenance import Rescuer
from django_fairqueue.models import Message, MessageState, WorkerRecord
from django_fairqueue.runtime import StopFlag, worker_registry
from tests import factories as f
from tests.workerkit import wait_until

pytestmark = pytest.mark.django_db

LEASE = timedelta(minutes=10)


def test_registering_expires_the_leases_a_previous_process_with_the_same_id_left() -> None:
    f.enqueue("slot", 3)
    claimed = message_store.claim_messages(2, lease=LEASE, worker_id="sup-0")
    assert len(claimed) == 2
    # the same slot's next process registers: nothing of its own can be running yet
    assert worker_registry.Registration("sup-0", concurrency=4).register() == 2
    assert Rescuer().run_once() == 2
    assert Message.objects.filter(state=MessageState.READY).count() == 3
    f.assert_counters_match_table()


def test_a_silent_worker_is_dead_and_its_leases_expire(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings.FAIRQUEUE = {**settings.FAIRQUEUE, "WORKER_DEAD_AFTER": 30.0}
    f.enqueue("x", 1)
    worker_registry.Registration("gone", concurrency=1).register()
    (m,) = message_store.claim_messages(1, lease=LEASE, worker_id="gone")
    WorkerRecord.objects.filter(worker_id="gone").update(
        heartbeat_at=timezone.now() - timedelta(minutes=1)
    )
    (dead,) = worker_registry.rescue_dead_workers()
    assert (dead.worker_id, dead.leases_expired) == ("gone", 1)
    assert "s; expired its 1 lease (the rescuer takes its messages back)" in caplog.text
    assert dead.silent_seconds >= 59
    assert Rescuer().run_once() == 1
    assert Message.objects.get(pk=m.id).state == MessageState.READY
    assert [v.state for v in worker_registry.workers()] == ["dead"]


def test_a_worker_held_up_past_dead_after_beats_instead_of_finding_itself_dead(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A task holding the GIL stops its worker's beat thread as well as its maintenance thread.
    When both run again, the worker's own rescuer pass finds its row silent: it beats instead
    of marking itself dead and expiring its own leases. A worker of another process, silent as
    long, is dead."""
    settings.FAIRQUEUE = {
        **settings.FAIRQUEUE,
        "WORKER_HEARTBEAT": 60.0,
        "WORKER_DEAD_AFTER": 180.0,
    }
    f.enqueue("held", 2)
    here = worker_registry.Registration("held-up", concurrency=1)
    here.register()
    worker_registry.Registration("gone", concurrency=1).register()
    (mine,) = message_store.claim_messages(1, lease=LEASE, worker_id="held-up")
    message_store.claim_messages(1, lease=LEASE, worker_id="gone")
    stop = StopFlag()
    # (its first beat of its own is a minute away: this thread never touches the database)
    beats = threading.Thread(
        target=here.beat_until, args=(stop, lambda: worker_registry.Beat(1, 0, None))
    )
    beats.start()
    silent = timezone.now() - timedelta(minutes=5)
    try:
        wait_until(lambda: "held-up" in worker_registry._beating, 10, "the beat loop starting")
        WorkerRecord.objects.update(heartbeat_at=silent)
        here._beat_sent -= 300  # its last beat, as the process remembers it: as long ago
        (dead,) = worker_registry.rescue_dead_workers()
        assert (dead.worker_id, dead.leases_expired) == ("gone", 1)
        row = WorkerRecord.objects.get(worker_id="held-up")
        assert row.state == "running" and row.heartbeat_at > timezone.now() - timedelta(minutes=1)
        assert Message.objects.get(pk=mine.id).lease_expires_at > timezone.now()
        assert "worker held-up: its registry beat is late (300s since" in caplog.text
        # Its row silent again while its beat looks recent to it (the process was held up
        # between the two): still alive to its own pass, in the same statement.
        WorkerRecord.objects.filter(worker_id="held-up").update(heartbeat_at=silent)
        assert worker_registry.rescue_dead_workers() == []
        assert WorkerRecord.objects.get(worker_id="held-up").state == "running"
    finally:
        stop.set()
        beats.join(10)
    # stopped beating: its row ages like any other
    assert "held-up" not in worker_registry._beating
    (dead,) = worker_registry.rescue_dead_workers()
    assert dead.worker_id == "held-up"


@pytest.mark.django_db(transaction=True)  # (the test's own session is cut)
def test_beats_that_failed_for_the_database_are_not_taken_for_a_held_up_process(
    settings: Any, caplog: pytest.LogCaptureFixture, database_url: str
) -> None:
    """Beats tried while the database was unreachable failed, each logged as it failed: when
    the worker's own pass finds its beat late, it beats without saying the process was held
    up (only a process that did not even try was)."""
    settings.FAIRQUEUE = {
        **settings.FAIRQUEUE,
        "WORKER_HEARTBEAT": 60.0,
        "WORKER_DEAD_AFTER": 180.0,
    }
    here = worker_registry.Registration("cut-off", concurrency=1)
    here.register()
    stop = StopFlag()
    beats = threading.Thread(
        target=here.beat_until, args=(stop, lambda: worker_registry.Beat(0, 0, None))
    )
    beats.start()
    try:
        wait_until(lambda: "cut-off" in worker_registry._beating, 10, "the beat loop starting")
        here._beat_sent -= 300  # no beat landed for five minutes
        session = connections[conf.get().DATABASE]
        session.ensure_connection()
        with psycopg.connect(database_url, autocommit=True) as admin:  # the database goes away
            admin.execute("SELECT pg_terminate_backend(%s)", [session.connection.info.backend_pid])
        here.beat(worker_registry.Beat(0, 0, None))  # the beat thread's try, during the outage
        assert "worker registry beat failed: database unavailable" in caplog.text
        assert worker_registry.rescue_dead_workers() == []  # back: the pass beats
        row = WorkerRecord.objects.get(worker_id="cut-off")
        assert row.state == "running" and row.heartbeat_at > timezone.now() - timedelta(minutes=1)
        assert "its registry beat is late" not in caplog.text
    finally:
        stop.set()
        beats.join(10)


@pytest.mark.django_db(transaction=True)
def test_a_worker_whose_connection_an_ended_outage_broke_still_marks_itself_stopped(
    caplog: pytest.LogCaptureFixture, database_url: str
) -> None:
    """The outage broke the connection of the thread that deregisters (its last use was
    before the database came back): one more try on a fresh connection marks it stopped."""
    here = worker_registry.Registration("after-outage", concurrency=1)
    here.register()
    session = connections[conf.get().DATABASE]
    session.ensure_connection()
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [session.connection.info.backend_pid])
    here.deregister(worker_registry.Beat(0, 4, None))
    row = WorkerRecord.objects.get(worker_id="after-outage")
    assert (row.state, row.handled) == ("stopped", 4)
    assert "could not mark stopped" not in caplog.text


def test_a_worker_stopping_with_messages_running_says_what_the_rescuer_does_with_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    f.enqueue("left", 1)
    stopping = worker_registry.Registration("w-stop", concurrency=1)
    stopping.register()
    (left,) = message_store.claim_messages(1, lease=LEASE, worker_id="w-stop")
    stopping.deregister(worker_registry.Beat(1, 0, None))
    assert (
        "worker w-stop stopped with 1 messages still running: their leases expired now, and "
        "the rescuer takes them back at its next pass (requeued, or failed (LeaseExpired) if "
        "at-most-once or out of attempts)"
    ) in caplog.text
    assert Rescuer().run_once() == 1
    assert Message.objects.get(pk=left.id).state == MessageState.READY


def test_beats_age_on_the_database_clock_not_the_web_servers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A web server whose clock runs an hour ahead of the database's still sees a worker that
    just beat as alive, in the registry, ``status`` and ``workers``: the rescuer (on the
    database's clock) would not call it dead either. ``status`` ages a channel's oldest ready
    message on the database's clock too."""
    worker_registry.Registration("w-skew", concurrency=2).register()
    f.enqueue("skewed", 1)

    class AheadClock(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.now(tz) + timedelta(hours=1)

    for module in (worker_registry, status_cli, workers_cli):
        if hasattr(module, "datetime"):
            monkeypatch.setattr(module, "datetime", AheadClock)
    monkeypatch.setattr(timezone, "now", lambda: AheadClock.now(UTC))
    assert [v.state for v in worker_registry.workers()] == ["alive"]
    out = io.StringIO()
    call_command("fairqueue", "workers", stdout=out)
    assert "1 live of 1 registered" in out.getvalue()
    out = io.StringIO()
    call_command("fairqueue", "status", stdout=out)
    assert "1 live worker" in out.getvalue()
    out = io.StringIO()
    call_command("fairqueue", "status", "--json", stdout=out)
    (row,) = [c for c in json.loads(out.getvalue())["channels"] if c["name"] == "skewed"]
    assert row["oldest_ready_age_seconds"] < 60  # not the hour between the two clocks
    assert worker_registry.rescue_dead_workers() == []


def test_status_warns_when_no_worker_is_alive_and_workers_lists_them() -> None:
    f.enqueue("waiting", 2)
    out = io.StringIO()
    call_command("fairqueue", "status", stdout=out)
    assert "0 live workers" in out.getvalue()
    assert "WARNING: no live worker" in out.getvalue()
    assert "belong to dead workers" not in out.getvalue()  # (none is running)
    worker_registry.Registration("w-1", concurrency=8, channels=["waiting"]).register()
    out = io.StringIO()
    call_command("fairqueue", "status", stdout=out)
    assert "1 live worker (8 threads, 0 running)" in out.getvalue()
    assert "WARNING" not in out.getvalue()
    out = io.StringIO()
    call_command("fairqueue", "workers", stdout=out)
    assert "w-1" in out.getvalue() and "alive" in out.getvalue()
    assert "1 live of 1 registered." in out.getvalue()


def test_a_worker_shows_its_release_and_the_last_migration_its_code_needs() -> None:
    """Old and new workers of one release tell apart across an upgrade that migrates."""
    from django.db import connection
    from django.db.migrations.loader import MigrationLoader

    (leaf,) = MigrationLoader(connection).graph.leaf_nodes("fairqueue")
    worker_registry.Registration("w-v", concurrency=1).register()
    expected = f"{django_fairqueue.__version__} ({leaf[1][:4]})"
    assert WorkerRecord.objects.get(worker_id="w-v").version == expected
    out = io.StringIO()
    call_command("fairqueue", "workers", stdout=out)
    assert expected in out.getvalue()


def test_the_workers_admin_page_is_read_only(client: Client) -> None:
    worker_registry.Registration("w-admin", concurrency=2, exclude_channels=["noisy"]).register()
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_workerrecord"))
    client.force_login(viewer)
    page = client.get(reverse("admin:fairqueue_workerrecord_changelist"))
    assert page.status_code == 200
    text = page.content.decode()
    assert "w-admin" in text and "alive" in text and "all but noisy" in text
    pk = WorkerRecord.objects.get(worker_id="w-admin").pk
    change = client.post(reverse("admin:fairqueue_workerrecord_change", args=[pk]), {})
    assert change.status_code in (302, 403) or "readonly" in change.content.decode()
    assert WorkerRecord.objects.get(pk=pk).state == "running"
    assert client.get(reverse("admin:fairqueue_workerrecord_add")).status_code == 403


def test_a_supervised_slots_crash_loop_shows_in_workers_and_the_admin(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django_fairqueue.runtime import SUPERVISION_ENV
    from django_fairqueue.worker import supervisor

    slot = supervisor.Slot(0)
    for _ in range(4):  # four children died a second after starting
        slot.exited(1, slot.started + 1.0)
        slot.restarts += 1
    told = slot.supervision()
    assert (told["restarts"], told["young_deaths"], told["crash_loop"]) == (4, 4, True)
    assert [e["how"] for e in told["exits"]] == ["exit status 1"] * 3  # type: ignore[attr-defined]
    monkeypatch.setenv(SUPERVISION_ENV, json.dumps(told))
    worker_registry.Registration("sup-0", concurrency=2).register()
    monkeypatch.setenv(SUPERVISION_ENV, json.dumps(supervisor.Slot(1).supervision()))
    worker_registry.Registration("sup-1", concurrency=2).register()
    monkeypatch.delenv(SUPERVISION_ENV)
    worker_registry.Registration("plain", concurrency=2).register()
    views = {v.worker_id: v for v in worker_registry.workers()}
    assert (views["sup-0"].restarts, views["sup-0"].crash_loop) == (4, True)
    assert (views["sup-1"].restarts, views["sup-1"].crash_loop) == (0, False)
    assert (views["plain"].restarts, views["plain"].crash_loop) == (None, False)
    assert WorkerRecord.objects.get(worker_id="sup-0").supervision == told
    out = io.StringIO()
    call_command("fairqueue", "workers", stdout=out)
    lines = {line.split()[0]: line for line in out.getvalue().splitlines() if line.strip()}
    assert lines["sup-0"].endswith("4, crash loop")
    assert lines["sup-1"].rstrip().endswith(" 0") and lines["plain"].rstrip().endswith(" -")
    assert "WARNING: crash loop: sup-0 (" in out.getvalue()
    out = io.StringIO()
    call_command("fairqueue", "workers", "--json", stdout=out)
    rows = {r["worker_id"]: r for r in json.loads(out.getvalue())}
    assert (rows["sup-0"]["restarts"], rows["sup-0"]["crash_loop"]) == (4, True)
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_workerrecord"))
    client.force_login(viewer)
    page = client.get(reverse("admin:fairqueue_workerrecord_changelist"))
    assert "4, crash loop" in page.content.decode()


def test_a_supervision_that_is_not_json_is_not_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    from django_fairqueue.runtime import SUPERVISION_ENV

    monkeypatch.setenv(SUPERVISION_ENV, "[1, 2")
    worker_registry.Registration("odd", concurrency=1).register()
    assert WorkerRecord.objects.get(worker_id="odd").supervision is None


# ------------------------------------------------------------------------------------------------
# One worker id, one live process


def register_as(worker_id: str, *, host: str, pid: int) -> int | None:
    """Register ``worker_id`` as a process ``pid`` on ``host`` does (fresh beat); None when a
    live holder keeps the id."""
    from django_fairqueue.db import worker_store

    return worker_store.register_worker(
        worker_id,
        host=host,
        pid=pid,
        version="test",
        concurrency=1,
        channels=[],
        exclude_channels=[],
        dead_after=30.0,
    )


def hold(worker_id: str, *, host: str, pid: int) -> None:
    assert register_as(worker_id, host=host, pid=pid) is not None


def a_gone_pid() -> int:
    """The pid of a process of this host that ran and was reaped."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert done.returncode == 0
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_live_holder_of_the_id_keeps_it_and_its_running_messages(settings: Any) -> None:
    settings.FAIRQUEUE = {**settings.FAIRQUEUE, "WORKER_DEAD_AFTER": 30.0}
    f.enqueue("busy", 1)
    hold("shared", host="other-host", pid=4242)
    (m,) = message_store.claim_messages(1, lease=LEASE, worker_id="shared")
    with pytest.raises(worker_registry.WorkerIdInUse) as refused:
        worker_registry.Registration("shared", concurrency=1).register()
    assert str(refused.value).startswith(
        "worker id shared is in use by a live worker on host other-host pid 4242, last beat 0s "
        "ago; give each process its own --worker-id"
    )
    # nothing was written: its row, and the lease of the message it runs, are untouched
    record = WorkerRecord.objects.get(worker_id="shared")
    assert (record.host, record.pid, record.state) == ("other-host", 4242, "running")
    assert Message.objects.get(pk=m.id).lease_expires_at > timezone.now() + timedelta(minutes=5)
    # once silent for WORKER_DEAD_AFTER it is dead: the id is free, its leases expire
    WorkerRecord.objects.filter(worker_id="shared").update(
        heartbeat_at=timezone.now() - timedelta(seconds=31)
    )
    assert worker_registry.Registration("shared", concurrency=1).register() == 1
    assert WorkerRecord.objects.get(worker_id="shared").pid == os.getpid()


def test_a_holder_on_this_host_is_taken_over_at_once_only_when_its_process_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    from django_fairqueue.runtime import SUPERVISION_ENV

    monkeypatch.delenv(SUPERVISION_ENV, raising=False)
    here = socket.gethostname()
    f.enqueue("slot", 2)
    # its process was killed (no process has its pid now): its leases expire at once
    hold("restarted", host=here, pid=a_gone_pid())
    message_store.claim_messages(1, lease=LEASE, worker_id="restarted")
    assert worker_registry.Registration("restarted", concurrency=1).register() == 1
    # a process of this host that runs (the test runner's parent) holds its id
    hold("running", host=here, pid=os.getppid())
    with pytest.raises(worker_registry.WorkerIdInUse, match=f"pid {os.getppid()}, last beat"):
        worker_registry.Registration("running", concurrency=1).register()
    # ... unless a supervisor says it reaped that very process (its pid went to another since)
    told = {"slot": 0, "restarts": 1, worker_registry.PREDECESSOR_PID: os.getppid()}
    monkeypatch.setenv(SUPERVISION_ENV, json.dumps(told))
    assert worker_registry.Registration("running", concurrency=1).register() == 0
    # this process: free once its worker's beat stopped, held while it beats
    stop = StopFlag()
    mine = worker_registry.Registration("mine", concurrency=1)
    mine.register()
    beating = threading.Thread(target=mine.beat_until, args=(stop, lambda: None))
    beating.start()
    try:
        wait_until(lambda: "mine" in worker_registry._beating, 5, "the beat running")
        with pytest.raises(worker_registry.WorkerIdInUse, match=f"pid {os.getpid()},"):
            worker_registry.Registration("mine", concurrency=1).register()
    finally:
        stop.set()
        beating.join(5)
    assert worker_registry.Registration("mine", concurrency=1).register() == 0


def register_at_once(worker_id: str, pids: list[int]) -> list[int]:
    """Register ``worker_id`` from one thread (one connection) per pid, all at once; returns
    the pids that got it."""
    from django.db import connections

    barrier = threading.Barrier(len(pids))
    won: list[int] = []

    def register(pid: int) -> None:
        try:
            barrier.wait(5)
            if register_as(worker_id, host=f"host-{pid}", pid=pid) is not None:
                won.append(pid)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=register, args=(pid,)) for pid in pids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return won


@pytest.mark.django_db(transaction=True)
def test_of_processes_registering_one_id_at_once_exactly_one_gets_it() -> None:
    for round_ in range(10):
        won = register_at_once(f"race-{round_}", [1, 2, 3, 4])
        assert len(won) == 1, won
        assert WorkerRecord.objects.get(worker_id=f"race-{round_}").pid == won[0]

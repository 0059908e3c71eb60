"""Periodic schedules under concurrency: several processes firing the same schedules at once,
while others enqueue into the same channels and an operator saves stale copies of the
schedules, produce exactly one message per slot; restarted firers add none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from django_fairqueue import schedules
from django_fairqueue.cron import ScheduleSpec
from django_fairqueue.db import schedule_store
from django_fairqueue.models import Channel, Message, Schedule, ScheduleFire

from . import factories as f

TASK = "tests.fair.record"  # in tests.fairtasks: every subprocess knows it
SCHEDULES = 12
CATCH_UP = 5
DEADLINE = 120.0

ROLE_PROCESS = """
import json, os, sys, time

import django

os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
django.setup()
from django.db import connection
from django_fairqueue import schedules
from django_fairqueue.db import schedule_store
from django_fairqueue.api import enqueue
from django_fairqueue.models import Schedule

barrier, role, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
stale = list(Schedule.objects.all())  # an operator's copies, loaded before any firing
firer = schedules.Firer()
seen = schedule_store.select_due_schedules(1000) if role == "stale-firer" else []
open(os.path.join(barrier, f"ready-{os.getpid()}"), "w").close()
while not os.path.exists(os.path.join(barrier, "go")):
    time.sleep(0.005)
fired, end = 0, time.monotonic() + seconds
if role == "stale-firer":
    # every process fires the same rows as it read them before the start: only the slot key
    # and the advance's check decide
    from datetime import timedelta
    for due in seen:
        fired += firer.fire(due, grace=timedelta(seconds=60))
while time.monotonic() < end:
    if role in ("firer", "stale-firer"):
        fired += firer.fire_due()
    elif role == "enqueuer":
        for i in range(12):
            enqueue("tests.fair.record", label="enqueuer", channel=f"tenant-{i % 4}")
    elif role == "operator":
        for s in stale:
            s.priority = (s.priority or 0) % 50 + 1
            s.save()  # a stale instance: must not touch the firing state
        time.sleep(0.01)
connection.close()
print(json.dumps({"fired": fired}))
"""


def start(roles: list[tuple[str, float]], barrier: Path, database_url: str) -> list[dict[str, int]]:
    """Run one process per (role, seconds), started together; their JSON results."""
    barrier.mkdir()
    env = {**os.environ, "DATABASE_URL": database_url}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ROLE_PROCESS, str(barrier), role, str(seconds)],
            cwd=Path(__file__).resolve().parent.parent,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for role, seconds in roles
    ]
    deadline = time.monotonic() + DEADLINE
    while len(list(barrier.glob("ready-*"))) < len(procs):
        for proc in procs:
            if proc.poll() is not None:
                raise AssertionError(f"a process died: {proc.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, "the processes did not start"
        time.sleep(0.05)
    (barrier / "go").touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=DEADLINE)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def declare(missed: str = "catch_up") -> None:
    specs = [
        ScheduleSpec.build(
            f"every-minute-{i}",
            {
                "task": TASK,
                "cron": "* * * * *",
                "channel": f"tenant-{i % 4}",
                "kwargs": {"label": f"schedule-{i}"},
                "missed": missed,
                "catch_up_max": CATCH_UP,
            },
            "test",
        )
        for i in range(SCHEDULES)
    ]
    schedules.sync(specs)
    assert schedules.fire_due() == 0  # the first pass: next slots only
    # ten minutes of missed slots for every schedule
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE fairqueue_schedule SET next_fire_at = date_trunc('minute', now()) "
            "- interval '10 minutes'"
        )


def assert_one_message_per_slot() -> dict[str, list[int]]:
    """Every fired slot has its own message, each message its slot; returns each schedule's
    slots as minutes since the epoch."""
    fires = list(ScheduleFire.objects.values_list("schedule__name", "slot_at", "message_id"))
    by_schedule: dict[str, list[int]] = {}
    for name, slot, _ in fires:
        by_schedule.setdefault(name, []).append(int(slot.timestamp()) // 60)
    scheduled = Message.objects.filter(task_name=TASK).exclude(payload__kwargs__label="enqueuer")
    per_label = Counter(scheduled.values_list("payload__kwargs__label", flat=True))
    message_ids = [m for *_, m in fires]
    assert None not in message_ids
    assert len(set(message_ids)) == len(message_ids) == scheduled.count()
    assert set(message_ids) == set(scheduled.values_list("id", flat=True))
    for i in range(SCHEDULES):
        name = f"every-minute-{i}"
        assert per_label[f"schedule-{i}"] == len(by_schedule[name])
        minutes = sorted(by_schedule[name])
        assert len(set(minutes)) == len(minutes), f"{name} fired a slot twice"
        # consecutive minutes: the newest CATCH_UP missed ones, then each slot as it came
        assert minutes == list(range(minutes[0], minutes[0] + len(minutes))), name
        assert len(minutes) >= CATCH_UP
    return {name: sorted(minutes) for name, minutes in by_schedule.items()}


def assert_state_follows_the_fires() -> None:
    states = schedules.states(list(Schedule.objects.values_list("id", flat=True)))
    last = {
        s: max(ScheduleFire.objects.filter(schedule_id=s).values_list("slot_at", flat=True))
        for s in states
    }
    for schedule_id, st in states.items():
        assert st.current
        assert st.last_slot_at == last[schedule_id]
        assert st.next_fire_at == last[schedule_id] + timedelta(minutes=1) or (
            st.next_fire_at is not None and st.next_fire_at > last[schedule_id]
        )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_firers_enqueuers_and_an_operator_at_once_fire_each_slot_once(
    database_url: str, tmp_path: Path
) -> None:
    declare()
    roles = [("firer", 3.0)] * 4 + [("enqueuer", 3.0)] * 2 + [("operator", 3.0)]
    results = start(roles, tmp_path / "wave-1", database_url)
    fired = [r["fired"] for r, (role, _) in zip(results, roles, strict=True) if role == "firer"]
    assert sum(fired) >= SCHEDULES * CATCH_UP
    by_schedule = assert_one_message_per_slot()
    assert_state_follows_the_fires()
    # restarts: new processes (a fresh process each, no memory of the first wave) fire again,
    # with the same slots due or not; still one message per slot
    with connection.cursor() as cur:
        cur.execute("UPDATE fairqueue_schedule SET next_fire_at = last_slot_at")  # rewound
    start([("firer", 1.5)] * 3, tmp_path / "wave-2", database_url)
    again = assert_one_message_per_slot()
    for name, minutes in by_schedule.items():
        assert set(minutes) <= set(again[name])  # and each once: none of them fired again
    f.assert_counters_match_table()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_firers_holding_the_same_stale_view_fire_each_slot_once(
    database_url: str, tmp_path: Path
) -> None:
    # Each process reads the due rows, then all fire those same rows at the same instant.
    declare()
    results = start([("stale-firer", 0.0)] * 5, tmp_path / "b", database_url)
    assert sum(r["fired"] for r in results) == SCHEDULES * CATCH_UP
    assert sum(1 for r in results if r["fired"]) >= 2, "only one process fired anything"
    assert_one_message_per_slot()
    assert_state_follows_the_fires()
    assert schedule_store.select_next_schedule_fire() is not None


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_deleting_channels_and_editing_schedules_while_firing_never_deadlocks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Firers enqueue (channel name locks, deltas, messages) then update schedule rows; an
    # operator edits schedule rows; channels are deleted (exclusive name lock, then their
    # schedules and slot rows). In the documented lock order none of them can wait in a cycle:
    # PostgreSQL would break one with "deadlock detected", which the firers would log.
    import threading

    from django.db import connections

    declare()
    stop = threading.Event()
    failures: list[BaseException] = []

    def guarded(target: Any) -> Any:
        def run() -> None:
            try:
                while not stop.is_set():
                    target()
            except BaseException as exc:
                failures.append(exc)
            finally:
                connections.close_all()

        return run

    firer = schedules.Firer()
    fired: list[int] = []

    def fire() -> None:
        fired.append(firer.fire_due())

    def rewind() -> None:  # fresh slots to fire, again and again
        with connection.cursor() as cur:
            cur.execute("DELETE FROM fairqueue_schedule_fire")
            cur.execute(
                "UPDATE fairqueue_schedule SET next_fire_at = date_trunc('minute', now()) "
                "- interval '10 minutes', last_slot_at = NULL"
            )
        time.sleep(0.02)

    def edit() -> None:
        # (not save(): a stale instance's save() after its channel was deleted would insert
        # the row again, as for any Django model)
        for pk in Schedule.objects.values_list("pk", flat=True):
            Schedule.objects.filter(pk=pk).update(
                priority=pk % 50, kwargs={"label": f"edited {pk}"}
            )

    threads = [threading.Thread(target=guarded(t)) for t in (fire, fire, rewind, edit)]
    for thread in threads:
        thread.start()
    try:
        for i in range(4):
            time.sleep(0.5)
            Channel.objects.filter(name=f"tenant-{i}").delete()
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert not failures, failures
    assert sum(fired) > SCHEDULES * CATCH_UP  # they fired all along (the slots rewound)
    assert not [r for r in caplog.records if "deadlock" in r.getMessage()]
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text[-3000:]
    assert not Schedule.objects.exists() and not ScheduleFire.objects.exists()
    assert not Message.objects.exclude(channel_id__in=Channel.objects.values("id")).exists()


@pytest.mark.django_db(transaction=True)
def test_deleting_a_channel_while_its_schedule_fires_waits_and_does_not_deadlock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A firing transaction takes its slot rows (their foreign key locks the schedule row) and
    then enqueues (the channel's name lock); deleting the channel takes the name lock, then
    deletes the schedule. The firer holds the name lock from its start, so the deletion waits
    for it instead of each waiting for the other. Paused between its slots and its enqueue,
    the firer gets there first in this test, every time."""
    import threading

    from django.db import connections

    declare()
    slotted, go = threading.Event(), threading.Event()
    claim_slots = schedule_store.claim_schedule_slots

    paused: list[int] = []

    def claim_and_pause(schedule_id: int, *args: Any, **kwargs: Any) -> list[Any]:
        got = claim_slots(schedule_id, *args, **kwargs)
        if not slotted.is_set():
            paused.append(schedule_id)
            slotted.set()
            go.wait(10)
        return got

    monkeypatch.setattr(schedule_store, "claim_schedule_slots", claim_and_pause)
    errors: list[BaseException] = []
    deleted: list[str] = []

    def in_thread(target: Any) -> threading.Thread:
        def run() -> None:
            try:
                target()
            except BaseException as exc:
                errors.append(exc)
            finally:
                connections.close_all()

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    due = schedule_store.select_due_schedules(1000)[0]
    firer = in_thread(lambda: schedules.Firer().fire(due, grace=timedelta(seconds=60)))
    assert slotted.wait(10)
    assert paused == [due.id]
    channel = due.channel

    def delete() -> None:
        Channel.objects.filter(name=channel).delete()
        deleted.append(channel)

    deleter = in_thread(delete)
    time.sleep(1.5)  # past deadlock_timeout (1 s): a cycle would have been broken by now
    assert not deleted  # the deletion waits for the firer
    go.set()
    firer.join(30)
    deleter.join(30)
    assert not errors, errors
    assert deleted == [channel]
    assert not Channel.objects.filter(name=channel).exists()
    assert not Message.objects.filter(channel__name=channel).exists()
    f.assert_counters_match_table()

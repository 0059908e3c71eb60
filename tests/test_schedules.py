"""Periodic schedules: slot arithmetic (timezones, DST), missed-slot policies, jitter, code and
settings declarations, the sync, firing once per slot, and the firing state kept apart from
what operators edit. Concurrency across processes is in tests/test_schedules_concurrency.py."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from django.db import connection
from django.test import override_settings

from django_fairqueue import conf, cron, schedules
from django_fairqueue.cron import ScheduleSpec
from django_fairqueue.db import pg, schedule_store
from django_fairqueue.exceptions import InvalidSchedule
from django_fairqueue.models import Channel, Message, Schedule, ScheduleFire
from django_fairqueue.tasks import task

from . import factories as f

TASK = "tests.schedules.tick"
BERLIN = "Europe/Berlin"


@task(name=TASK, max_attempts=2)
def tick(*args: Any, **kwargs: Any) -> None:
    """What the schedules here enqueue; the tests never run it."""


def berlin(*args: int) -> datetime:
    return datetime(*args, tzinfo=ZoneInfo(BERLIN))  # type: ignore[misc]


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def local(slots: list[datetime]) -> list[str]:
    return [f"{s.astimezone(ZoneInfo(BERLIN)):%m-%d %H:%M%z}" for s in slots]


def take(it: Iterator[datetime], n: int) -> list[datetime]:
    return [next(it) for _ in range(n)]


# -- cron expressions and slots ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        ("61 * * * *", "Bad minute"),
        ("* * *", "Wrong number of fields"),
        ("0 0 30 2 *", "Bad day-of-month"),
        ("*/0 * * * *", "Bad minute"),
        ("every day", "Wrong number of fields"),
    ],
)
def test_a_bad_cron_expression_is_refused_saying_why(expr: str, reason: str) -> None:
    with pytest.raises(InvalidSchedule, match=reason) as info:
        cron.validate_cron(expr, "schedule 'x': cron")
    assert repr(expr) in str(info.value)
    assert "schedule 'x': cron" in str(info.value)


@pytest.mark.parametrize("expr", ["* * * * * *", "0 0 * * * *", "*/5 * * * * *"])
def test_a_sixth_field_of_seconds_is_refused_everywhere_a_cron_enters(expr: str) -> None:
    with pytest.raises(InvalidSchedule, match="a field of seconds is not supported") as info:
        cron.validate_cron(expr)
    assert repr(expr) in str(info.value)
    with pytest.raises(InvalidSchedule, match="not five"):
        schedules.upcoming(expr, "UTC", datetime(2026, 1, 1, tzinfo=UTC), count=3)
    with pytest.raises(InvalidSchedule, match="not five"):
        schedules.periodic(expr, name="tests.six_fields")(tick)
    assert "tests.six_fields" not in {s.name for s in schedules.declared()}
    with pytest.raises(ValueError, match="not five"):
        conf.load({"SCHEDULES": {"six": {"task": TASK, "cron": expr}}})


def test_an_expression_that_never_comes_is_refused() -> None:
    # valid syntax, but no last Monday of a month falls on the 1st or 21st for 50 years
    with pytest.raises(InvalidSchedule, match="no slot in the next 50 years"):
        cron.validate_cron("* * */20 * 1L")
    assert cron.next_slot("* * */20 * 1L", "UTC", utc(2026, 1, 1)) is None


@pytest.mark.parametrize("bad", ["", "   ", None, 5])
def test_an_empty_or_non_text_cron_is_refused(bad: Any) -> None:
    with pytest.raises(InvalidSchedule, match="must be a cron expression"):
        cron.validate_cron(bad)


def test_aliases_and_blanks() -> None:
    assert cron.validate_cron("  */5   * * * * ") == "*/5 * * * *"
    assert cron.expand("@daily") == "0 0 * * *"
    assert cron.next_slot("@hourly", "UTC", utc(2026, 1, 1, 5, 0)) == utc(2026, 1, 1, 6, 0)


@pytest.mark.parametrize("name", ["Mars/Olympus", "localtime", "posix/Europe/Berlin"])
def test_a_bad_timezone_is_refused(name: str) -> None:
    with pytest.raises(InvalidSchedule, match="not a known timezone"):
        cron.validate_timezone(name)
    assert cron.validate_timezone(BERLIN) == BERLIN


def test_slots_are_read_in_the_schedules_timezone_and_returned_in_utc() -> None:
    slots = take(cron.slots_after("0 9 * * *", BERLIN, utc(2026, 1, 1)), 1)
    assert slots == [utc(2026, 1, 1, 8, 0)]  # 09:00 in Berlin (winter, +01:00)
    assert slots[0].tzinfo is UTC
    summer = take(cron.slots_after("0 9 * * *", BERLIN, utc(2026, 7, 1)), 1)
    assert summer == [utc(2026, 7, 1, 7, 0)]  # 09:00 in Berlin (summer, +02:00)


def test_a_fixed_time_in_the_skipped_spring_hour_runs_once_at_the_first_valid_moment() -> None:
    slots = take(cron.slots_after("30 2 * * *", BERLIN, berlin(2026, 3, 28, 12)), 3)
    assert local(slots) == ["03-29 03:00+0200", "03-30 02:30+0200", "03-31 02:30+0200"]


def test_a_fixed_time_in_the_repeated_autumn_hour_runs_once() -> None:
    slots = take(cron.slots_after("30 2 * * *", BERLIN, berlin(2026, 10, 24, 12)), 3)
    assert local(slots) == ["10-25 02:30+0200", "10-26 02:30+0100", "10-27 02:30+0100"]


def test_an_interval_runs_through_both_copies_of_the_repeated_hour() -> None:
    slots = take(cron.slots_after("0 * * * *", BERLIN, berlin(2026, 10, 25, 0, 30)), 4)
    assert local(slots) == [
        "10-25 01:00+0200",
        "10-25 02:00+0200",
        "10-25 02:00+0100",
        "10-25 03:00+0100",
    ]
    # one hour apart in real time: no slot is lost or doubled
    assert {b - a for a, b in itertools.pairwise(slots)} == {timedelta(hours=1)}


def test_due_slots_are_the_newest_within_the_bound_oldest_first() -> None:
    since, until = utc(2026, 1, 1, 0, 0), utc(2026, 1, 1, 0, 10)
    assert cron.due_slots("* * * * *", "UTC", since, until, 3) == [
        utc(2026, 1, 1, 0, 8),
        utc(2026, 1, 1, 0, 9),
        utc(2026, 1, 1, 0, 10),  # a slot exactly at `until` is due
    ]
    assert len(cron.due_slots("* * * * *", "UTC", since, until, 100)) == 11  # both ends
    assert cron.due_slots("* * * * *", "UTC", until, since, 5) == []
    # a year of missed minutes costs the bound, not half a million steps
    year = cron.due_slots("* * * * *", "UTC", utc(2025, 1, 1), utc(2026, 1, 1), 2)
    assert year == [utc(2025, 12, 31, 23, 59), utc(2026, 1, 1)]


def test_jitter_is_the_same_everywhere_for_a_slot_and_within_its_bound() -> None:
    jitter = timedelta(minutes=10)
    slot = utc(2026, 1, 1, 3, 0)
    offsets = {cron.jitter_offset(7, slot, jitter) for _ in range(5)}
    assert len(offsets) == 1  # deterministic: every process computes the same
    # the same instant given in another timezone is the same slot
    assert cron.jitter_offset(7, slot.astimezone(ZoneInfo(BERLIN)), jitter) in offsets
    spread = [cron.jitter_offset(7, slot + timedelta(days=d), jitter) for d in range(200)]
    assert all(timedelta(0) <= o < jitter for o in spread)
    assert len(set(spread)) > 150  # spread out, not one value
    assert max(spread) > timedelta(minutes=8) and min(spread) < timedelta(minutes=2)
    assert cron.jitter_offset(8, slot, jitter) != cron.jitter_offset(7, slot, jitter)
    assert cron.jitter_offset(7, slot, timedelta(0)) == timedelta(0)


# -- declarations --------------------------------------------------------------------------------


def test_a_spec_checks_every_option() -> None:
    ok = {"task": TASK, "cron": "*/5 * * * *"}
    spec = ScheduleSpec.build("s", {**ok, "jitter": 30, "args": (1, 2)}, "schedule 's'")
    assert spec.jitter == timedelta(seconds=30) and spec.args == [1, 2]
    bad: list[tuple[dict[str, Any], str]] = [
        ({"cron": "* * * * *"}, "needs 'task'"),
        ({**ok, "cron": "0 25 * * *"}, "Bad hour"),
        ({**ok, "timezone": "Nowhere"}, "not a known timezone"),
        ({**ok, "missed": "sometimes"}, "missed must be one of"),
        ({**ok, "missed": "catch_up", "catch_up_max": 0}, "catch_up_max"),
        ({**ok, "jitter": -1}, "jitter"),
        ({**ok, "jitter": timedelta(days=2)}, "jitter"),
        ({**ok, "args": [{1, 2}]}, "must be JSON"),
        ({**ok, "args": [(1, 2)]}, "round trip"),
        ({**ok, "kwargs": {1: 2}}, "string keys"),
        ({**ok, "priority": 500}, "priority"),
        ({**ok, "cronn": "x"}, "unknown keys"),
    ]
    for options, message in bad:
        with pytest.raises(InvalidSchedule, match=message):
            ScheduleSpec.build("s", options, "schedule 's'")


def test_settings_schedules_are_checked_with_a_clear_error() -> None:
    good = conf.load({"SCHEDULES": {"nightly": {"task": TASK, "cron": "0 3 * * *"}}})
    assert [s.name for s in good.SCHEDULES] == ["nightly"]
    with pytest.raises(ValueError, match=r"FAIRQUEUE\['SCHEDULES'\]\['nightly'\]: cron"):
        conf.load({"SCHEDULES": {"nightly": {"task": TASK, "cron": "0 3 * *"}}})
    with pytest.raises(ValueError, match="must be a dict"):
        conf.load({"SCHEDULES": [{"task": TASK}]})


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"args": {1, 2}}, "args must be a list or tuple, got set"),
        ({"args": "abc"}, "args must be a list or tuple, got str"),
        ({"args": b"ab"}, "args must be a list or tuple, got bytes"),
        ({"args": range(2)}, "args must be a list or tuple, got range"),
        ({"args": {"a": 1}}, "args must be a list or tuple, got dict"),
        ({"kwargs": [("a", 1)]}, "kwargs must be a dict"),
        ({"args": ["nul \x00"]}, "contain a NUL character"),
        ({"kwargs": {"k": "lone \ud800"}}, "not valid Unicode"),
    ],
)
def test_periodic_refuses_arguments_enqueue_would_refuse_instead_of_changing_them(
    options: dict[str, Any], words: str
) -> None:
    with pytest.raises(InvalidSchedule, match=re.escape(words)):
        schedules.periodic("* * * * *", name="tests.bad_args", **options)(tick)
    assert "tests.bad_args" not in {s.name for s in schedules.declared()}
    with pytest.raises(ValueError, match=re.escape(words)):
        conf.load({"SCHEDULES": {"bad": {"task": TASK, "cron": "@daily", **options}}})


def test_periodic_takes_a_tuple_of_args_and_a_literal_backslash_u0000() -> None:
    schedules.periodic("* * * * *", name="tests.good_args", args=(1, "\\u0000"))(tick)
    try:
        (found,) = [s for s in schedules.declared() if s.name == "tests.good_args"]
        assert found.args == [1, "\\u0000"]
    finally:
        schedules.undeclare("tests.good_args")


@pytest.mark.django_db
def test_sync_refuses_a_payload_over_the_size_limit_as_an_invalid_schedule(settings: Any) -> None:
    settings.FAIRQUEUE = {**settings.FAIRQUEUE, "MAX_PAYLOAD_BYTES": 100}
    with pytest.raises(InvalidSchedule, match="MAX_PAYLOAD_BYTES"):
        schedules.sync([spec("big", args=["x" * 200])])
    assert not Schedule.objects.exists()


def test_periodic_goes_on_a_registered_task_and_names_must_not_clash() -> None:
    with pytest.raises(InvalidSchedule, match="above @task"):
        schedules.periodic("* * * * *")(lambda: None)
    with pytest.raises(InvalidSchedule, match="Bad minute"):
        schedules.periodic("99 * * * *")(tick)

    @task(name="tests.schedules.other")
    def other() -> None: ...

    schedules.periodic("* * * * *", name="tests.clash")(tick)
    try:
        with pytest.raises(InvalidSchedule, match="already declared"):
            schedules.periodic("* * * * *", name="tests.clash")(other)
    finally:
        schedules.undeclare("tests.clash")


@pytest.mark.parametrize(
    ("name", "options", "words"),
    [
        ("tests.blank_channel", {"channel": " x"}, "@periodic 'tests.blank_channel': channel"),
        ("tests.sep_channel", {"channel": "a\x1fb"}, "unit separator"),
        ("tests.n\x00ul", {}, "must not contain NUL"),
    ],
)
def test_periodic_refuses_a_channel_or_name_the_sync_would_refuse_at_import(
    name: str, options: dict[str, Any], words: str
) -> None:
    with pytest.raises(InvalidSchedule, match=re.escape(words)):
        schedules.periodic("0 3 * * *", name=name, **options)(tick)
    assert name not in {s.name for s in schedules.declared()}


@pytest.mark.django_db
def test_a_settings_schedule_on_a_bad_channel_is_refused_naming_it() -> None:
    # by enqueue's own channel check, when the entry is read (before, only when synced)
    with pytest.raises(InvalidSchedule, match=r"^bad: channel name must not contain the unit"):
        schedules.sync([spec("bad", channel="a\x1fb")])
    assert not Schedule.objects.exists()


def test_a_second_periodic_of_the_same_name_is_refused_unless_it_is_the_same() -> None:
    schedules.periodic("0 3 * * *", name="tests.dup")(tick)
    try:
        schedules.periodic("0 3 * * *", name="tests.dup")(tick)  # imported again: the same
        with pytest.raises(InvalidSchedule, match=r"already declared .* other options"):
            schedules.periodic("0 4 * * *", name="tests.dup")(tick)
        (found,) = [s for s in schedules.declared() if s.name == "tests.dup"]
        assert found.cron == "0 3 * * *"
    finally:
        schedules.undeclare("tests.dup")


# -- the missed-slot policies (pure: what a pass does with a row as read) ------------------------


def row(**over: Any) -> schedule_store.DueSchedule:
    values: dict[str, Any] = {
        "id": 1,
        "name": "s",
        "channel": "acme",
        "task_name": TASK,
        "args": [],
        "kwargs": {},
        "cron": "*/10 * * * *",
        "timezone": "UTC",
        "missed": "latest",
        "catch_up_max": 3,
        "jitter": timedelta(0),
        "priority": None,
        "enabled": True,
        "spec": "*/10 * * * * UTC on",
        "fired_spec": "*/10 * * * * UTC on",
        "next_fire_at": utc(2026, 1, 1, 0, 0),
        "last_slot_at": utc(2025, 12, 31, 23, 50),
        "now": utc(2026, 1, 1, 0, 0, 2),
    }
    values.update(over)
    return schedule_store.DueSchedule(**values)


GRACE = timedelta(seconds=60)
OUTAGE = utc(2026, 1, 1, 1, 5)  # the pass comes 65 minutes after the due slot


@pytest.mark.parametrize("policy", ["latest", "skip", "catch_up"])
def test_an_on_time_slot_fires_once_whatever_the_policy(policy: str) -> None:
    step = schedules.plan(row(missed=policy), grace=GRACE)
    assert step == schedules.Plan([utc(2026, 1, 1, 0, 0)], utc(2026, 1, 1, 0, 10), False)


def test_latest_fires_only_the_latest_missed_slot() -> None:
    step = schedules.plan(row(missed="latest", now=OUTAGE), grace=GRACE)
    assert step.slots == [utc(2026, 1, 1, 1, 0)]
    assert step.next_fire_at == utc(2026, 1, 1, 1, 10) and step.missed


def test_skip_fires_no_missed_slot() -> None:
    step = schedules.plan(row(missed="skip", now=OUTAGE), grace=GRACE)
    assert step.slots == [] and step.next_fire_at == utc(2026, 1, 1, 1, 10)
    # ...but the latest one, if it is itself on time
    late = schedules.plan(row(missed="skip", now=utc(2026, 1, 1, 1, 0, 30)), grace=GRACE)
    assert late.slots == [utc(2026, 1, 1, 1, 0)]


def test_catch_up_fires_each_missed_slot_up_to_its_bound() -> None:
    step = schedules.plan(row(missed="catch_up", now=OUTAGE), grace=GRACE)
    assert step.slots == [utc(2026, 1, 1, 0, 40), utc(2026, 1, 1, 0, 50), utc(2026, 1, 1, 1, 0)]
    few = schedules.plan(row(missed="catch_up", catch_up_max=100, now=OUTAGE), grace=GRACE)
    assert len(few.slots) == 7  # 00:00 .. 01:00, every one missed


def test_a_new_edited_or_resumed_schedule_starts_at_its_next_slot_without_catching_up() -> None:
    fresh = row(fired_spec=None, next_fire_at=None, last_slot_at=None, now=OUTAGE)
    assert schedules.plan(fresh, grace=GRACE) == schedules.Plan([], utc(2026, 1, 1, 1, 10))
    edited = row(fired_spec="0 * * * * UTC on", now=OUTAGE, missed="catch_up")
    assert schedules.plan(edited, grace=GRACE) == schedules.Plan([], utc(2026, 1, 1, 1, 10))
    # slots only move forward: never at or before the last fired slot
    ahead = row(fired_spec=None, last_slot_at=utc(2026, 1, 1, 2, 0), now=OUTAGE)
    assert schedules.plan(ahead, grace=GRACE).next_fire_at == utc(2026, 1, 1, 2, 10)
    paused = row(enabled=False, spec="*/10 * * * * UTC off", now=OUTAGE)
    assert schedules.plan(paused, grace=GRACE) == schedules.Plan([], None)


# -- the database: sync, firing, state ------------------------------------------------------------


def spec(name: str = "tick", **options: Any) -> ScheduleSpec:
    return ScheduleSpec.build(name, {"task": TASK, "cron": "* * * * *", **options}, name)


def state(schedule: Schedule) -> schedule_store.ScheduleState:
    return schedules.states([schedule.pk])[schedule.pk]


def backdate(schedule: Schedule, minutes: int) -> None:
    """Pretend nothing fired for ``minutes``: the next slot lies that far in the past (the
    database's clock cannot be moved, the state can)."""
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE fairqueue_schedule SET next_fire_at = date_trunc('minute', now()) "
            "- make_interval(mins => %s) WHERE id = %s",
            [minutes, schedule.pk],
        )


def messages() -> list[Message]:
    return list(Message.objects.filter(task_name=TASK).order_by("id"))


@pytest.mark.django_db
def test_sync_creates_updates_and_deletes_code_schedules() -> None:
    result = schedules.sync([spec("a", channel="acme", args=[1]), spec("b")])
    assert result.created == ["a", "b"]
    a = Schedule.objects.get(name="a")
    assert (a.channel.name, a.args, a.source, a.enabled) == ("acme", [1], "code", True)
    assert Schedule.objects.get(name="b").channel.name == "default"
    Schedule.objects.filter(name="a").update(enabled=False)  # an operator paused it
    result = schedules.sync([spec("a", channel="acme", args=[2], cron="@hourly")])
    assert (result.created, result.updated, result.deleted) == ([], ["a"], ["b"])
    a.refresh_from_db()
    assert (a.args, a.cron, a.enabled) == ([2], "@hourly", False)  # the pause stays
    assert schedules.sync([spec("a", channel="acme", args=[2], cron="@hourly")]).updated == []
    # an admin schedule of the same name is the operator's: the sync leaves it alone
    Schedule.objects.create(name="b", channel=a.channel, task_name=TASK, cron="@daily")
    assert schedules.sync([]).deleted == ["a"]
    assert list(Schedule.objects.values_list("name", "source")) == [("b", "admin")]


@pytest.mark.django_db
def test_bad_arguments_are_refused_before_anything_runs() -> None:
    """A wrong type or a value PostgreSQL cannot hold is a TypeError or ValueError naming the
    argument, never a DataError or an AttributeError from inside."""
    schedules.sync([spec("a")])
    refused: list[tuple[Any, type[Exception], str]] = [
        (lambda: schedules.fire_due(limit=-1), ValueError, "limit must be 1 to 2147483647"),
        (lambda: schedules.fire_due(limit=2**31), ValueError, "limit must be 1 to"),
        (lambda: schedules.fire_due(limit="x"), TypeError, "limit must be an integer"),
        (lambda: schedules.states(["x"]), TypeError, "a schedule id must be an integer"),
        (lambda: schedules.states([2**70]), ValueError, "a schedule id must be 1 to 9223"),
        (lambda: schedules.states(5), TypeError, "ids must be a list of schedule ids"),
        (lambda: schedules.states(None), TypeError, "ids must be a list of schedule ids"),
        (lambda: schedules.sync("abc"), TypeError, "specs must be a list of ScheduleSpec"),
        (lambda: schedules.sync(spec("b")), TypeError, "specs must be a list of ScheduleSpec"),
        # empty, these would have deleted every code schedule
        (lambda: schedules.sync({}), TypeError, "specs must be a list of ScheduleSpec"),
        (lambda: schedules.sync(set()), TypeError, "specs must be a list of ScheduleSpec"),
        (lambda: schedules.sync(range(0)), TypeError, "specs must be a list of ScheduleSpec"),
        (lambda: schedules.sync([spec("b"), "x"]), TypeError, r"specs\[1\] must be a Schedule"),
        (
            lambda: schedules.sync([{"task": TASK, "cron": "@daily"}]),
            TypeError,
            r"specs\[0\] must be a ScheduleSpec \(django_fairqueue.cron.ScheduleSpec",
        ),
    ]
    for call, error, message in refused:
        with pytest.raises(error, match=message):
            call()
    # nothing was synced, deleted or fired
    assert list(Schedule.objects.values_list("name", flat=True)) == ["a"]
    assert not ScheduleFire.objects.exists()
    assert schedules.states([]) == {}
    assert schedules.fire_due(limit=1) == 0


@pytest.mark.django_db
def test_sync_refuses_an_unregistered_task_before_writing_anything() -> None:
    bad = ScheduleSpec.build("x", {"task": "no.such.task", "cron": "@daily"}, "x")
    with pytest.raises(InvalidSchedule, match=r"'no\.such\.task', which is not registered"):
        schedules.sync([spec("a"), bad])
    assert not Schedule.objects.exists()


@task(name="tests.schedules.report")
def report(tenant: str) -> None:
    """A task with a signature: the arguments of its schedules must fit it."""


@pytest.mark.django_db
def test_arguments_that_do_not_fit_the_task_are_refused_before_any_firing() -> None:
    words = "arguments do not fit tests.schedules.report(tenant"
    with pytest.raises(InvalidSchedule, match=re.escape(words)):
        schedules.periodic("@daily", name="tests.unfit", kwargs={"bogus": 1})(report)
    assert "tests.unfit" not in {s.name for s in schedules.declared()}
    # from settings, or another way into sync: refused before anything is written, and before
    # the task's channel_from could be called with them
    bad = ScheduleSpec.build("x", {"task": report.name, "cron": "@daily", "args": [1, 2]}, "x")
    with pytest.raises(InvalidSchedule, match=re.escape("schedule 'x': " + words)):
        schedules.sync([spec("a"), bad])
    assert not Schedule.objects.exists()


@pytest.mark.django_db
def test_the_first_pass_sets_the_next_slot_and_fires_nothing() -> None:
    schedules.sync([spec("a")])
    (a,) = Schedule.objects.all()
    assert schedules.fire_due() == 0
    st = state(a)
    now = pg.select_clock()
    assert st.current and st.last_slot_at is None
    assert st.next_fire_at is not None
    assert now < st.next_fire_at <= now + timedelta(minutes=1)
    assert st.next_fire_at.second == 0
    assert schedules.fire_due() == 0  # not due yet
    assert 0 < (schedule_store.select_next_schedule_fire() or 0) <= 60


@pytest.mark.django_db
def test_a_due_slot_fires_one_message_through_the_enqueue_path() -> None:
    schedules.sync([spec("a", channel="acme", args=[1], kwargs={"x": "y"}, priority=7)])
    (a,) = Schedule.objects.all()
    schedules.fire_due()
    backdate(a, 0)  # the slot of this minute is due
    assert schedules.fire_due() == 1
    (m,) = messages()
    assert (m.channel.name, m.payload, m.priority, m.max_attempts, m.state) == (
        "acme",
        {"args": [1], "kwargs": {"x": "y"}},
        7,
        2,  # the task's own max_attempts
        "ready",
    )
    st = state(a)
    fire = ScheduleFire.objects.get()
    assert (fire.schedule_id, fire.message_id) == (a.pk, m.pk)
    assert st.last_slot_at == fire.slot_at and st.last_message_id == m.pk
    assert st.next_fire_at == fire.slot_at + timedelta(minutes=1)
    assert schedules.fire_due() == 0
    f.assert_counters_match_table()


@pytest.mark.django_db
@pytest.mark.parametrize(("policy", "fired"), [("latest", 1), ("skip", 0), ("catch_up", 4)])
def test_missed_slots_follow_the_policy(policy: str, fired: int) -> None:
    schedules.sync([spec("a", missed=policy, catch_up_max=4)])
    (a,) = Schedule.objects.all()
    schedules.fire_due()
    backdate(a, 30)
    with override_settings(
        FAIRQUEUE={"TASK_MODULES": ["tests.fairtasks"], "SCHEDULE_GRACE": 0.001}
    ):
        assert schedules.fire_due() == fired
    slots = sorted(ScheduleFire.objects.values_list("slot_at", flat=True))
    assert len(slots) == len(messages()) == fired
    if fired > 1:
        assert {b - a for a, b in itertools.pairwise(slots)} == {timedelta(minutes=1)}
    # every missed slot is behind it now: nothing more is due
    assert schedules.fire_due() == 0
    assert state(a).next_fire_at > pg.select_clock()  # type: ignore[operator]


@pytest.mark.django_db
def test_jitter_delays_the_message_by_the_slots_offset() -> None:
    schedules.sync([spec("a", jitter=timedelta(hours=2))])
    (a,) = Schedule.objects.all()
    schedules.fire_due()
    backdate(a, 0)
    schedules.fire_due()
    (m,) = messages()
    fire = ScheduleFire.objects.get()
    offset = cron.jitter_offset(a.pk, fire.slot_at, timedelta(hours=2))
    assert m.run_at == fire.slot_at + offset
    assert m.state == ("scheduled" if offset > timedelta(minutes=1) else m.state)


@pytest.mark.django_db
def test_a_slot_already_fired_never_fires_again_even_when_the_state_is_rewound() -> None:
    # The state is rewound as a restore of the table, a stale firer or a bug would: the unique
    # slot key alone refuses the slot a second time.
    schedules.sync([spec("a")])
    (a,) = Schedule.objects.all()
    schedules.fire_due()
    backdate(a, 0)
    assert schedules.fire_due() == 1
    for _ in range(3):
        with connection.cursor() as cur:
            cur.execute(
                "UPDATE fairqueue_schedule SET next_fire_at = last_slot_at, last_slot_at = NULL "
                "WHERE id = %s",
                [a.pk],
            )
        assert schedules.fire_due() == 0
    assert len(messages()) == ScheduleFire.objects.count() == 1


@pytest.mark.django_db
def test_an_admin_save_of_a_stale_instance_keeps_the_firing_state() -> None:
    schedules.sync([spec("a")])
    stale = Schedule.objects.get()
    schedules.fire_due()
    backdate(stale, 0)
    schedules.fire_due()
    before = state(stale)
    stale.priority = 5  # not a slot-deciding field
    stale.save()
    Schedule.objects.filter(pk=stale.pk).update(kwargs={"k": 1})
    Schedule.objects.bulk_update([stale], ["args", "priority", "enabled"])
    assert state(stale) == before
    stale.cron = "*/2 * * * *"  # a new cron: the next pass computes a fresh slot
    stale.save()
    assert not state(stale).current
    assert schedules.fire_due() == 0
    after = state(stale)
    assert after.current and after.last_slot_at == before.last_slot_at
    assert after.next_fire_at is not None and after.next_fire_at.minute % 2 == 0


@pytest.mark.django_db
def test_pausing_fires_nothing_and_resuming_does_not_catch_up() -> None:
    schedules.sync([spec("a", missed="catch_up", catch_up_max=50)])
    (a,) = Schedule.objects.all()
    schedules.fire_due()
    Schedule.objects.filter(pk=a.pk).update(enabled=False)
    backdate(a, 20)
    assert schedules.fire_due() == 0
    assert state(a).next_fire_at is None and schedule_store.select_next_schedule_fire() is None
    Schedule.objects.filter(pk=a.pk).update(enabled=True)
    assert schedule_store.select_next_schedule_fire() == 0  # due for a fresh slot
    assert schedules.fire_due() == 0
    assert not messages()
    assert state(a).next_fire_at > pg.select_clock()  # type: ignore[operator]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("change", "undo"),
    [
        ({"enabled": False}, {"enabled": True}),  # paused, resumed
        ({"cron": "*/7 * * * *"}, {"cron": "* * * * *"}),  # an edit, reverted
        ({"timezone": BERLIN}, {"timezone": "UTC"}),
    ],
)
def test_a_pause_or_an_edit_undone_while_no_pass_ran_fires_no_slot_of_it(
    change: dict[str, Any], undo: dict[str, Any]
) -> None:
    # The fleet is down for maintenance: no firing pass runs between the change and its undo,
    # so the spec is the one the state was computed for again. The change itself was recorded.
    schedules.sync([spec("a", missed="catch_up", catch_up_max=50)])
    (a,) = Schedule.objects.all()
    schedules.fire_due()
    Schedule.objects.filter(pk=a.pk).update(**change)
    backdate(a, 20)  # twenty minutes pass
    a.refresh_from_db()
    for key, value in undo.items():
        setattr(a, key, value)
    a.save()  # undone by an admin save this time
    assert not state(a).current
    assert schedules.fire_due() == 0
    assert not messages() and not ScheduleFire.objects.exists()
    assert state(a).current
    assert state(a).next_fire_at > pg.select_clock()  # type: ignore[operator]


@pytest.mark.django_db
def test_an_unchanged_save_is_not_an_edit() -> None:
    schedules.sync([spec("a")])
    (a,) = Schedule.objects.all()
    schedules.fire_due()
    Schedule.objects.filter(pk=a.pk).update(enabled=True, cron="* * * * *")  # as they were
    a.save()
    assert state(a).current
    backdate(a, 0)
    assert schedules.fire_due() == 1


@pytest.mark.django_db
def test_a_full_channel_keeps_its_slot_due_until_there_is_room() -> None:
    schedules.sync([spec("a", channel="small")])
    (a,) = Schedule.objects.all()
    Channel.objects.filter(name="small").update(max_backlog=1)
    f.enqueue("small", 1)
    schedules.fire_due()
    backdate(a, 0)
    assert schedules.fire_due() == 0  # full: nothing stored, the slot stays due
    assert not ScheduleFire.objects.exists()
    Channel.objects.filter(name="small").update(max_backlog=2)  # room for one more
    assert schedules.fire_due() == 1
    assert len(messages()) == 1


@pytest.mark.django_db(transaction=True)  # committed, as a worker's passes are
def test_catch_up_into_a_channel_with_room_for_fewer_slots_fires_the_newest_that_fit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from django_fairqueue import cancel

    schedules.sync([spec("a", channel="small", missed="catch_up", catch_up_max=3)])
    (a,) = Schedule.objects.all()
    Channel.objects.filter(name="small").update(max_backlog=2)
    f.enqueue("small", 2)  # full: room for none
    schedules.fire_due()
    backdate(a, 5)  # 6 slots passed: catch_up_max makes the newest 3 due
    due = state(a).next_fire_at
    assert schedules.fire_due() == 0  # no room: nothing stored, the slot stays due
    assert not ScheduleFire.objects.exists() and state(a).next_fire_at == due
    assert "channel 'small' is full" in caplog.text
    cancel(channel="small")  # empty now, with room for 2 of the 3
    caplog.clear()
    assert schedules.fire_due() == 2
    fired = sorted(ScheduleFire.objects.values_list("slot_at", flat=True))
    assert len(fired) == len(messages()) == 2  # one fire row and one message per slot
    assert fired == [state(a).last_slot_at - timedelta(minutes=1), state(a).last_slot_at]
    assert (
        "schedule 'a' of channel 'small': the channel has room for only 2 of the 3 missed "
        "slots to fire: fired the newest 2 (" in caplog.text
    )
    assert "dropped the other 1" in caplog.text and "is full" not in caplog.text
    # the schedule moved on: nothing more is due, and the dropped slot never fires
    assert schedules.fire_due() == 0
    assert state(a).next_fire_at > pg.select_clock()  # type: ignore[operator]
    assert ScheduleFire.objects.count() == 2


@pytest.mark.django_db
def test_a_task_this_process_does_not_know_is_left_to_workers_that_do(
    caplog: pytest.LogCaptureFixture,
) -> None:
    channel = Channel.objects.create(name="acme")
    Schedule.objects.create(name="x", channel=channel, task_name="gone.task", cron="* * * * *")
    firer = schedules.Firer()
    assert firer.fire_due() == 0
    assert firer.fire_due() == 0
    assert firer.unknown_tasks == {"gone.task"}
    assert [r.message for r in caplog.records].count(
        "schedule 'x' of channel 'acme' names task 'gone.task', which this worker does not "
        "know; it fires on workers that do"
    ) == 1
    assert firer.seconds_to_next() is None


@pytest.mark.django_db
def test_deleting_a_channel_deletes_its_schedules_and_fires() -> None:
    schedules.sync([spec("a", channel="acme")])
    (a,) = Schedule.objects.all()
    schedules.fire_due()
    backdate(a, 0)
    schedules.fire_due()
    Channel.objects.filter(name="acme").delete()
    assert not Schedule.objects.exists() and not ScheduleFire.objects.exists()


@pytest.mark.django_db
def test_the_scheduler_service_syncs_once_then_wakes_at_the_next_slot() -> None:
    service = schedules.Scheduler(every=30)
    assert service.interval == 30
    with override_settings(
        FAIRQUEUE={
            "TASK_MODULES": ["tests.fairtasks"],
            "SCHEDULES": {"from-settings": {"task": TASK, "cron": "* * * * *"}},
        }
    ):
        assert service.run_once() == 0
    assert list(Schedule.objects.values_list("name", flat=True)) == ["from-settings"]
    assert 0 < service.interval <= 30
    service.run_once()  # synced already: the settings' schedule is not deleted
    assert Schedule.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_burst_worker_with_nothing_to_do_still_syncs_the_code_schedules() -> None:
    # It ends within milliseconds: before, its maintenance pass never reached the scheduler
    from django.core.management import call_command

    with override_settings(
        FAIRQUEUE={
            "TASK_MODULES": ["tests.fairtasks"],
            "SCHEDULES": {"nightly": {"task": TASK, "cron": "0 3 * * *"}},
        }
    ):
        call_command("runfairworker", "--burst", "--queues", "nothing", "--no-listen")
    assert list(Schedule.objects.values_list("name", "cron")) == [("nightly", "0 3 * * *")]


@pytest.mark.django_db
def test_the_schedules_command_lists_syncs_and_fires(capsys: pytest.CaptureFixture[str]) -> None:
    import io
    import json as jsonlib

    from django.core.management import call_command
    from django.core.management.base import CommandError

    out = io.StringIO()
    call_command("fairqueue", "schedules", stdout=out)
    assert "No schedules" in out.getvalue()
    with override_settings(
        FAIRQUEUE={
            "TASK_MODULES": ["tests.fairtasks"],
            "SCHEDULES": {"nightly": {"task": TASK, "cron": "0 3 * * *", "channel": "acme"}},
        }
    ):
        out = io.StringIO()
        call_command("fairqueue", "schedules", "--sync", "--fire", stdout=out)
    text = out.getvalue()
    assert "created: nightly" in text and "fired 0 message(s)" in text
    line = next(x for x in text.splitlines() if x.startswith("acme"))
    assert line.split()[:6] == ["acme", "default", "nightly", TASK, "0", "3"]
    assert "in " in line and "(code)" in line
    out = io.StringIO()
    call_command("fairqueue", "schedules", "--json", "--channel", "acme", stdout=out)
    (row,) = jsonlib.loads(out.getvalue())
    assert row["next_fire_at"].endswith("03:00:00+00:00") and row["enabled"]
    # a channel with none: said so (not "declare some": there is one, elsewhere)
    out = io.StringIO()
    call_command("fairqueue", "schedules", "--channel", "nosuch", stdout=out)
    assert out.getvalue() == "No schedule of channel 'nosuch' (1 schedule in all).\n"
    # with --json, what --sync and --fire did goes to stderr: stdout stays JSON
    out = io.StringIO()
    call_command("fairqueue", "schedules", "--sync", "--fire", "--json", stdout=out)
    assert [r["name"] for r in jsonlib.loads(out.getvalue())] == []  # (the sync deleted it)
    err = capsys.readouterr().err
    assert "deleted: nightly" in err and "fired 0 message(s)" in err
    with (
        override_settings(
            FAIRQUEUE={
                "TASK_MODULES": ["tests.fairtasks"],
                "SCHEDULES": {"bad": {"task": "no.such", "cron": "@daily"}},
            }
        ),
        pytest.raises(CommandError, match="not registered"),
    ):
        call_command("fairqueue", "schedules", "--sync", stdout=io.StringIO())


@pytest.mark.django_db
def test_the_schedules_command_names_the_code_schedules_not_synced_yet(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, settings: Any, capsys: Any
) -> None:
    import io
    import json as jsonlib
    import sys

    from django.core.management import call_command

    from django_fairqueue.tasks.spec import registry

    # A fresh deploy: a @periodic in a task module this process has not imported, no worker
    # started yet. "Declare them with @periodic" would tell the user to do what they did.
    (tmp_path / "fq_unsynced_tasks.py").write_text(
        "from django_fairqueue import periodic, task\n\n\n"
        '@periodic(cron="*/5 * * * *", name="sync.inventory")\n'
        '@task(name="sync.pull_inventory")\n'
        "def pull_inventory() -> None: ...\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    settings.FAIRQUEUE = {**settings.FAIRQUEUE, "TASK_MODULES": ["fq_unsynced_tasks"]}

    def listing(*options: str) -> str:
        out = io.StringIO()
        call_command("fairqueue", "schedules", *options, stdout=out)
        return out.getvalue()

    note = "1 code schedule(s) declared but not synced yet: sync.inventory."
    try:
        text = listing()
        assert text.startswith("No schedules in the table yet. " + note)
        assert "--sync" in text and "declare them" not in text
        # --json: stdout stays the list of the table's rows, the note goes to stderr
        assert jsonlib.loads(listing("--json")) == []
        assert note in capsys.readouterr().err
        assert "created: sync.inventory" in listing("--sync")
        text = listing()
        assert "sync.inventory" in text and "not synced" not in text
        # one declared after the sync: listed below the table's rows, alone
        schedules.periodic("@daily", name="tests.later")(tick)
        text = listing()
        assert "sync.inventory" in text.splitlines()[1]
        assert text.splitlines()[-1].startswith(
            "1 code schedule(s) declared but not synced yet: tests.later."
        )
    finally:
        schedules.undeclare("sync.inventory")
        schedules.undeclare("tests.later")
        registry.unregister("sync.pull_inventory")
        sys.modules.pop("fq_unsynced_tasks", None)


def _plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    stack = [plan]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.get("Plans", ()))


@pytest.mark.django_db
def test_the_firing_check_reads_two_indexes_not_the_schedules() -> None:
    # 10,000 schedules, none due: the check each worker runs every few seconds must stay an
    # index lookup (EXPLAIN ANALYZE of the two statements a pass runs when nothing is due).
    import json as jsonlib

    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO fairqueue_channel (name, release_interval, weight, paused, created_at) "
            "SELECT 't' || i, '0', 1, false, now() FROM generate_series(1, 100) i"
        )
        cur.execute(
            "INSERT INTO fairqueue_schedule (name, channel_id, task_name, args, kwargs, cron, "
            "timezone, missed, catch_up_max, jitter, enabled, source, created_at) "
            "SELECT 's' || i, (SELECT min(id) FROM fairqueue_channel) + i %% 100, %s, '[]', "
            "'{}', '0 3 * * *', 'UTC', 'latest', 10, '0', i %% 10 <> 0, 'admin', now() "
            "FROM generate_series(1, 10000) i",
            [TASK],
        )
        cur.execute(
            "UPDATE fairqueue_schedule SET fired_spec = spec, next_fire_at = "
            "CASE WHEN enabled THEN now() + make_interval(secs => id) END"
        )
        cur.execute("ANALYZE fairqueue_schedule")
        for name in ("select_due_schedules", "select_next_schedule_fire"):
            cur.execute(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + schedule_store.queries()[name],
                {"skip_tasks": [], "skip_ids": [], "limit": 100},
            )
            (doc,) = cur.fetchone()[0]
            nodes = list(_plan_nodes(doc["Plan"]))
            on_schedules = [n for n in nodes if n.get("Relation Name") == "fairqueue_schedule"]
            assert on_schedules, name
            assert all(n["Node Type"] != "Seq Scan" for n in on_schedules), jsonlib.dumps(doc)
            assert {n.get("Index Name") for n in on_schedules} <= {
                "fq_schedule_next_idx",
                "fq_schedule_stale_idx",
                None,  # the Bitmap Heap Scan above a Bitmap Index Scan
            }
            assert sum(n.get("Actual Rows", 0) for n in on_schedules) <= 3, name
    assert schedules.fire_due() == 0


@pytest.mark.django_db
def test_a_bad_declaration_is_logged_and_the_table_still_fires(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from django_fairqueue.maintenance import MaintenanceRunner
    from django_fairqueue.testing import drain

    schedules.sync([spec("a", channel="acme")])
    (a,) = Schedule.objects.all()
    schedules.fire_due()
    backdate(a, 0)
    bad = {
        "TASK_MODULES": ["tests.fairtasks"],
        "SCHEDULES": {
            "a": {"task": TASK, "cron": "* * * * *", "channel": "acme"},
            "x": {"task": "no.such", "cron": "@daily"},
        },
    }
    runner = MaintenanceRunner([schedules.Scheduler()], stop=None)  # type: ignore[arg-type]
    with override_settings(FAIRQUEUE=bad):
        assert runner.run_once() == {"scheduler": 1}
    assert (
        "code schedule 'x' not synced (the others are): schedule 'x' names task 'no.such'"
        in caplog.text
    )
    assert Schedule.objects.filter(name="a").exists()  # nothing was deleted either
    assert drain(channels="acme") == 1  # a worker runs the slot's message


@pytest.mark.django_db
def test_a_worker_skips_a_schedule_whose_arguments_do_not_fit_and_syncs_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # "unfit" was synced by an earlier release, when its arguments still fitted
    schedules.sync([spec("unfit", channel="acme"), spec("gone")])
    declared = {
        "TASK_MODULES": ["tests.fairtasks"],
        "SCHEDULES": {
            "unfit": {"task": report.name, "cron": "@daily", "args": [1, 2]},
            "good": {"task": report.name, "cron": "@daily", "args": ["acme"]},
        },
    }
    with override_settings(FAIRQUEUE=declared):
        schedules.Scheduler().run_once()  # what --skip-checks lets a worker meet
        with pytest.raises(InvalidSchedule, match="schedule 'unfit': arguments do not fit"):
            schedules.sync()  # asked for alone (`fairqueue schedules --sync`): refused whole
    rows = dict(Schedule.objects.filter(source="code").values_list("name", "task_name"))
    assert {name: rows.get(name) for name in ("unfit", "good", "gone")} == {
        "unfit": TASK,  # left as it was: neither changed nor deleted
        "good": report.name,
        "gone": None,  # no longer declared
    }
    (record,) = [r for r in caplog.records if "'unfit' not synced" in r.getMessage()]
    assert record.levelname == "ERROR"
    assert "schedule 'unfit': arguments do not fit tests.schedules.report(" in record.getMessage()


def test_the_scheduler_wakes_at_the_next_slot_unjittered() -> None:
    from django_fairqueue.maintenance import MaintenanceRunner

    service = schedules.Scheduler(every=30)
    assert service.interval == 30  # nothing known yet
    service._next_in = 2.0
    assert service.interval == pytest.approx(2.005)  # just past the slot, on the db's clock
    service._next_in = 0.0
    assert service.interval == 0.05  # more is due: soon
    service._next_in = 3600.0
    assert service.interval == 30  # but never later than SCHEDULE_INTERVAL

    class Quick:
        name = "quick"
        precise = True
        interval = 1.234

        def run_once(self) -> int:
            return 0

    runner = MaintenanceRunner([], stop=None)  # type: ignore[arg-type]
    # the other services get ±10%; a precise one wakes exactly when it asked
    assert {runner._pass(Quick()) for _ in range(20)} == {1.234}


@pytest.mark.django_db(transaction=True)
def test_a_process_frozen_mid_sync_delays_no_other_workers_maintenance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker stopped (SIGSTOP, a VM pause) inside its sync holds the sync's lock: another
    worker's scheduler gives up waiting after the lock timeout, fires what the table has and
    syncs at a later pass, so its maintenance loop (and the rescue of expired leases with it)
    goes on. It used to wait for the lock for ever."""
    import threading
    import time

    from django.db import connections, transaction

    monkeypatch.setattr(schedule_store, "SCHEDULE_SYNC_LOCK_TIMEOUT", "200ms")
    holding, release = threading.Event(), threading.Event()

    def frozen_sync() -> None:
        try:
            with transaction.atomic():
                schedule_store.lock_schedule_sync()
                holding.set()
                release.wait(20)
        finally:
            connections.close_all()

    thread = threading.Thread(target=frozen_sync)
    thread.start()
    try:
        assert holding.wait(10)
        scheduler = schedules.Scheduler()
        began = time.monotonic()
        scheduler.run_once()
        assert time.monotonic() - began < 5
        assert not scheduler.synced  # tried again at the next pass
    finally:
        release.set()
        thread.join(10)
    scheduler.run_once()
    assert scheduler.synced
    with connection.cursor() as cur:  # the previous lock_timeout is back after the lock
        cur.execute("SHOW lock_timeout")
        assert cur.fetchone() == ("0",)


def test_upcoming_takes_the_documented_names_and_previews_in_utc() -> None:
    after = datetime(2026, 3, 28, 12, 0, tzinfo=UTC)
    slots = schedules.upcoming(cron="0 3 * * *", timezone="Europe/Berlin", after=after, count=3)
    # 03:00 in Berlin is 01:00 UTC from 29 March (summer time began at 02:00 that day)
    assert slots == [
        datetime(2026, 3, 29, 1, 0, tzinfo=UTC),
        datetime(2026, 3, 30, 1, 0, tzinfo=UTC),
        datetime(2026, 3, 31, 1, 0, tzinfo=UTC),
    ]
    assert schedules.upcoming("0 3 * * *", "Europe/Berlin", after, 3) == slots
    assert schedules.upcoming("@daily", "UTC", after, count=0) == []


@pytest.mark.parametrize(
    ("after", "error", "words"),
    [
        ("2026-01-01", TypeError, "after must be a datetime, got '2026-01-01'"),
        (None, TypeError, "after must be a datetime, got None"),
    ],
)
def test_upcoming_refuses_an_after_that_is_not_a_datetime(
    after: Any, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=re.escape(words)):
        schedules.upcoming("@daily", "UTC", after)


def test_upcoming_reads_a_naive_after_in_the_schedules_timezone_and_ends_at_year_9999() -> None:
    naive = datetime(2026, 1, 1, 8, 30)  # 08:30 in Berlin is 07:30 UTC
    assert schedules.upcoming("0 * * * *", "Europe/Berlin", naive, count=1) == [
        datetime(2026, 1, 1, 8, 0, tzinfo=UTC)  # 09:00 in Berlin
    ]
    last = datetime(9999, 12, 31, 22, 0, tzinfo=UTC)
    assert schedules.upcoming("0 * * * *", "UTC", last, count=3) == [
        datetime(9999, 12, 31, 23, 0, tzinfo=UTC)
    ]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"cron": "0 25 * * *"}, InvalidSchedule),
        ({"cron": "not cron"}, InvalidSchedule),
        ({"timezone": "Mars/Olympus"}, InvalidSchedule),
        ({"count": -1}, ValueError),
        ({"count": 10**9}, ValueError),
    ],
)
def test_upcoming_refuses_a_bad_expression_timezone_or_count(
    kwargs: dict[str, Any], error: type[Exception]
) -> None:
    call = {"cron": "@daily", "timezone": "UTC", "after": datetime.now(UTC), **kwargs}
    with pytest.raises(error):
        schedules.upcoming(**call)


# -- pacing: a schedule that cannot fire is tried at its own pace --------------------------------


def transactions() -> tuple[int, int]:
    """Commits and rollbacks of this database so far, as the statistics collector has them."""
    with connection.cursor() as cur:
        cur.execute("SELECT pg_stat_clear_snapshot()")
        cur.execute(
            "SELECT xact_commit, xact_rollback FROM pg_stat_database "
            "WHERE datname = current_database()"
        )
        commits, rollbacks = cur.fetchone()
    return int(commits), int(rollbacks)


def run_schedulers(count: int, stop: Any) -> list[Any]:
    """``count`` workers' scheduler loops (each the maintenance runner of a worker, with only
    the scheduler), each on its own connection, which flushes its statistics when it ends."""
    import threading

    from django.db import connections

    from django_fairqueue.maintenance import MaintenanceRunner

    def loop() -> None:
        try:
            # (synced: the schedule of this test is not declared in code)
            MaintenanceRunner([schedules.Scheduler(synced=True)], stop=stop).run()
            with connections["default"].cursor() as cur:
                cur.execute("SELECT pg_stat_force_next_flush()")
        finally:
            connections.close_all()

    threads = [threading.Thread(target=loop) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


@pytest.mark.django_db(transaction=True)
def test_a_schedule_of_a_full_channel_is_tried_every_interval_not_in_a_tight_loop() -> None:
    import time

    from django_fairqueue.runtime import StopFlag

    schedules.sync([spec("a", channel="small", missed="latest")])
    (a,) = Schedule.objects.all()
    Channel.objects.filter(name="small").update(max_backlog=1)
    f.enqueue("small", 1)
    schedules.fire_due()
    backdate(a, 0)  # due, and its channel is full
    stop = StopFlag()
    settings = {"TASK_MODULES": ["tests.fairtasks"], "SCHEDULE_INTERVAL": 1.0}
    with override_settings(FAIRQUEUE=settings):
        commits, rollbacks = transactions()
        threads = run_schedulers(2, stop)
        time.sleep(3.0)
        # room for one more: the slot fires at the next try, within the interval
        Channel.objects.filter(name="small").update(max_backlog=2)
        time.sleep(2.0)
        stop.set()
        for thread in threads:
            thread.join()
        fired = len(messages())
    # the statistics of the ended sessions reach the collector shortly after they end
    settled = None
    for _ in range(20):
        now = transactions()
        if now == settled:
            break
        settled = now
        time.sleep(0.2)
    assert settled is not None
    more_commits, more_rollbacks = settled[0] - commits, settled[1] - rollbacks
    assert fired == 1
    # Two workers for 5 s at one try a second each: a handful of rolled-back firings, not one
    # every 50 ms (about 120 before the room came), and a few statements a pass: 90-250 commits
    # database-wide (this session's own reads and whatever else the server does in the test
    # database count too), against about 600 when every pass came 50 ms after the last.
    assert more_rollbacks <= 12, (more_commits, more_rollbacks)
    assert more_commits <= 300, (more_commits, more_rollbacks)


def test_a_held_schedule_waits_longer_while_its_error_lasts() -> None:
    firer = schedules.Firer()
    interval = conf.get().SCHEDULE_INTERVAL
    delays = []
    for _ in range(12):
        firer._hold(7, interval, schedules.RETRY_ERROR_CAP)
        delays.append(firer.held[7].delay)
    assert delays[:3] == [interval, 2 * interval, 4 * interval]
    assert max(delays) == delays[-1] == schedules.RETRY_ERROR_CAP
    assert firer._holding() == [7]

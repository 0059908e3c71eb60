"""Bad input (issue 6): hostile or careless channel names, payloads, limits, times, task names and
settings. Each gets a clear error or is handled correctly, nothing corrupts the tables, and no
value reaches SQL other than as a bound parameter (or a quoted identifier, for LISTEN).

Property-based with hypothesis, plus the explicit cases the issue lists.
"""

from __future__ import annotations

import dataclasses
import io
import math
import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from unittest import mock

import psycopg
import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import django_fairqueue
from django_fairqueue import checks, conf, enqueue, exactly_once, failures
from django_fairqueue.api import EnqueueRequest, enqueue_many
from django_fairqueue.db import channel_store, message_store
from django_fairqueue.exceptions import InvalidChannel, InvalidQueue, PayloadError, UnknownTask
from django_fairqueue.models import Channel, ChannelGroup, Message, MessageState
from django_fairqueue.worker import Worker, WorkerConfig
from tests import fairtasks
from tests.factories import NOOP, assert_counters_match_table
from tests.test_store_sql import all_statements
from tests.workerkit import enqueue_raw

pytestmark = pytest.mark.django_db

LEASE = timedelta(minutes=5)
#: Enough examples to find the edges, few enough for the normal test run (a few seconds each).
#: Derandomised: CI runs the same examples every time (a new edge found by a wider local run,
#: e.g. max_examples=2000 without derandomize, becomes an explicit case here).
EXAMPLES = settings(
    max_examples=100,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
NASTY_CHANNELS = [
    "o'brien",
    'say "hi"',
    "x'); DROP TABLE fairqueue_message; --",
    "a; DELETE FROM fairqueue_channel",
    "$$; SELECT pg_sleep(10); $$",
    "%(channels)s",
    "%s %s %%",
    "{channel}",
    "back\\slash",
    "租户-é-🙂",
    "Ünïcödé\u200bzero-width",
    "tab\tinside",
    "new\nline",
    "-- comment",
    "x" * 200,
]


def claim_all(limit: int = 1000) -> list[message_store.ClaimedMessage]:
    return message_store.claim_messages(limit, lease=LEASE, worker_id="bad-input")


def message_count() -> int:
    return Message.objects.count()


@pytest.fixture
def tables_intact() -> Iterator[None]:
    """After the test, the queue tables exist and their counters agree with their rows."""
    yield
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_tables WHERE tablename IN "
            "('fairqueue_message', 'fairqueue_channel', 'fairqueue_channel_delta')"
        )
        assert cursor.fetchone() == (3,)
    assert_counters_match_table()


# ------------------------------------------------------------------------------------------
# Channel names


@pytest.mark.parametrize("name", NASTY_CHANNELS)
def test_channel_names_with_sql_and_unicode_are_stored_verbatim(
    name: str, tables_intact: None
) -> None:
    mid = enqueue(NOOP, 1, channel=name)
    stored = Message.objects.select_related("channel").get(pk=mid)
    assert stored.channel.name == name
    (claimed,) = claim_all()
    assert (claimed.id, claimed.channel) == (mid, name)
    assert channel_store.select_channel_ids([name]) == {name: stored.channel_id}


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("", "must not be empty"),
        ("   ", "must not be only blanks: '   '"),
        (" padded", "must not start or end with blanks"),
        ("padded\n", "must not start or end with blanks"),
        ("nbsp\u00a0", "must not start or end with blanks"),
        ("x" * 201, "201 characters; the most is 200"),
        ("x" * 10_240, "10240 characters; the most is 200"),
        ("nul\x00inside", "NUL"),
        ("queue\x1fchannel", "unit separator U+001F"),
        (42, "must be a string"),
        (3.5, "must be a string"),
        (b"bytes", "must be a string"),
    ],
)
def test_bad_channel_names_are_refused_clearly(name: Any, error: str, tables_intact: None) -> None:
    with pytest.raises(InvalidChannel, match=re.escape(error)):
        enqueue(NOOP, channel=name)
    assert message_count() == 0
    assert not Channel.objects.exists()


@pytest.mark.parametrize(
    ("queue", "error"),
    [
        ("", "must not be empty"),
        ("two words", "may hold only letters"),
        ("-leading", "may hold only letters"),
        ("a/b", "may hold only letters"),
        ("q" * 65, "65 characters; the most is 64"),
        (7, "must be a string"),
    ],
)
def test_bad_queue_names_are_refused_clearly(queue: Any, error: str, tables_intact: None) -> None:
    with pytest.raises(InvalidQueue, match=re.escape(error)):
        enqueue(NOOP, channel="acme", queue=queue)
    with pytest.raises(InvalidQueue, match=re.escape(error)):
        enqueue_many([EnqueueRequest(NOOP, channel="acme"), EnqueueRequest(NOOP, queue=queue)])
    assert message_count() == 0
    assert not Channel.objects.exists()


def test_a_channel_name_too_long_for_its_queue_is_refused(tables_intact: None) -> None:
    enqueue(NOOP, channel="x" * 200)  # fits the default queue
    with pytest.raises(InvalidChannel, match="too long for queue 'reports'"):
        enqueue(NOOP, channel="x" * 200, queue="reports")
    with pytest.raises(InvalidChannel, match="too long for queue 'reports'"):
        enqueue(NOOP, channel=("g" * 95, "x"), queue="reports")
    assert message_count() == 1


def test_a_channel_name_that_is_not_valid_unicode_is_an_invalid_channel() -> None:
    with pytest.raises(InvalidChannel):
        enqueue(NOOP, channel="lone \ud800 surrogate")


def test_a_channel_name_that_is_not_valid_unicode_stores_nothing(tables_intact: None) -> None:
    with pytest.raises(InvalidChannel, match="not valid Unicode"):
        enqueue(NOOP, channel="lone \ud800 surrogate")
    assert message_count() == 0


@EXAMPLES
@given(name=st.text(min_size=0, max_size=260))
def test_any_channel_name_is_stored_verbatim_or_refused(name: str) -> None:
    try:
        with transaction.atomic():
            mid = enqueue(NOOP, channel=name)
    except InvalidChannel:
        stripped = name.strip()
        assert (
            not stripped or stripped != name or len(name) > 200 or "\x00" in name or "\x1f" in name
        )
        return
    assert Message.objects.select_related("channel").get(pk=mid).channel.name == name


@EXAMPLES
@given(names=st.lists(st.text(min_size=1, max_size=30).map(lambda s: f"c{s}c"), max_size=8))
def test_worker_channel_filters_take_any_names(names: list[str]) -> None:
    clean = [n for n in names if "\x00" not in n and "\x1f" not in n and len(n) <= 200]
    config = WorkerConfig(channels=sorted(set(clean)), worker_id="filters")
    assert set(config.channels) == set(clean)


# ------------------------------------------------------------------------------------------
# Payloads


class Opaque:
    pass


@pytest.mark.parametrize(
    ("args", "kwargs", "error"),
    [
        ([Opaque()], {}, "not JSON serialisable"),
        ([{1, 2}], {}, "not JSON serialisable"),
        ([b"bytes"], {}, "not JSON serialisable"),
        ([datetime(2020, 1, 1, tzinfo=UTC)], {}, "not JSON serialisable"),
        ([uuid.uuid4()], {}, "not JSON serialisable"),
        ([math.nan], {}, "not JSON serialisable"),
        ([math.inf], {}, "not JSON serialisable"),
        ([(1, 2)], {}, "round trip"),
        ([{1: "int key"}], {}, "round trip"),
        (["nul \x00 char"], {}, "NUL character"),
        ([], {"key": "nul \x00"}, "NUL character"),
        (["lone \ud800 surrogate"], {}, "not valid Unicode"),
        (["x" * 1_100_000], {}, "bytes as JSON; FAIRQUEUE['MAX_PAYLOAD_BYTES'] is 1048576"),
    ],
)
def test_payloads_that_do_not_survive_json_are_refused(
    args: list[Any], kwargs: dict[str, Any], error: str, tables_intact: None
) -> None:
    with pytest.raises(PayloadError, match=re.escape(error)):
        enqueue(NOOP, *args, channel="p", **kwargs)
    assert message_count() == 0


def test_a_payload_nested_too_deeply_is_refused(tables_intact: None) -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(PayloadError, match="nested too deeply"):
        enqueue(NOOP, deep, channel="p")
    assert message_count() == 0


def test_a_payload_nested_as_deeply_as_jsonb_allows_round_trips(tables_intact: None) -> None:
    nested: Any = "bottom"
    for _ in range(200):  # 400 levels: under Python's recursion limit, for the encoder
        nested = {"k": [nested]}
    enqueue(NOOP, nested, channel="p")
    (claimed,) = claim_all()
    assert claimed.payload == {"args": [nested], "kwargs": {}}


def test_a_large_payload_under_the_limit_round_trips(tables_intact: None) -> None:
    big = ["é" * 1000] * 400  # ~800 kB of UTF-8, under the 1 MiB default
    enqueue(NOOP, big, channel="p")
    (claimed,) = claim_all()
    assert claimed.payload["args"] == [big]


def test_the_payload_limit_is_a_setting(tables_intact: None) -> None:
    with override_settings(FAIRQUEUE={"MAX_PAYLOAD_BYTES": 100}):
        with pytest.raises(PayloadError, match="MAX_PAYLOAD_BYTES'] is 100"):
            enqueue(NOOP, "x" * 100, channel="p")
        enqueue(NOOP, "x" * 10, channel="p")
    assert message_count() == 1


JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats(allow_nan=False, allow_infinity=False, min_value=-1e15, max_value=1e15)
    | st.text(max_size=40)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)


def same_types(a: Any, b: Any) -> bool:
    """Equal with the same types all the way down (a float stays a float, a bool a bool).
    -0.0 and 0.0 count as the same: jsonb keeps no sign on zero."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same_types(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_types(a[k], b[k]) for k in a)
    return bool(a == b)


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    return False


@EXAMPLES
@given(
    args=st.lists(JSON_VALUES, max_size=3),
    kwargs=st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=3),
)
def test_json_arguments_come_back_to_the_task_unchanged(
    args: list[Any], kwargs: dict[str, Any]
) -> None:
    with transaction.atomic():
        try:
            # through EnqueueRequest: a keyword named like an enqueue option ("channel") is
            # the task's own argument there
            (mid,) = enqueue_many([EnqueueRequest(NOOP, args, kwargs, channel="json")])
        except PayloadError:
            assert _has_nul(args) or _has_nul(kwargs)
            return
        assert not (_has_nul(args) or _has_nul(kwargs))
        (claimed,) = message_store.claim_messages(1, lease=LEASE, worker_id="json")
        assert claimed.id == mid
        assert claimed.payload == {"args": args, "kwargs": kwargs}
        assert same_types(claimed.payload, {"args": args, "kwargs": kwargs})
        transaction.set_rollback(True)


def test_large_float_arguments_come_back_as_floats() -> None:
    args = [1e20, 1e308, -2.5e300, 1e-7, 12345.0, 'a "quoted 1e+20" \\', {"k": [7e22]}]
    enqueue(NOOP, *args, channel="floats")
    (claimed,) = claim_all()
    assert claimed.payload["args"] == args
    assert [type(a) for a in claimed.payload["args"][:5]] == [float] * 5
    assert type(claimed.payload["args"][6]["k"][0]) is float


# ------------------------------------------------------------------------------------------
# Limits


@pytest.mark.parametrize(
    ("limits", "error"),
    [
        ({"max_concurrency": 0}, "max_concurrency must be an integer >= 1"),
        ({"max_concurrency": -3}, "max_concurrency must be an integer >= 1"),
        ({"max_concurrency": 2_000_000}, "at most 1000000"),
        ({"max_concurrency": 1.5}, "max_concurrency must be an integer"),
        ({"max_concurrency": True}, "max_concurrency must be an integer"),
        ({"weight": 0}, "weight must be an integer >= 1"),
        ({"weight": -1}, "weight must be an integer >= 1"),
        ({"weight": 1001}, "weight must be at most 1000"),
        ({"max_backlog": 0}, "max_backlog must be an integer >= 1"),
        ({"max_backlog": -10}, "max_backlog must be an integer >= 1"),
        ({"max_backlog": 2**31}, "max_backlog must be at most 2,147,483,647, got 2,147,483,648"),
        ({"release_interval": -1}, "release_interval must be from 0 to 86400"),
        ({"release_interval": timedelta(days=2)}, "release_interval must be from 0 to 86400"),
        ({"release_interval": "1s"}, "number of seconds or a timedelta"),
    ],
)
def test_bad_channel_limits_are_refused(limits: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        conf.validate_channel_limits(**limits)
    with pytest.raises(ValueError, match=re.escape(error)):
        conf.load({"CHANNEL_DEFAULTS": limits})


@pytest.mark.parametrize(
    "fields",
    [
        {"max_concurrency": 0},
        {"weight": 0},
        {"max_backlog": 0},
        {"release_interval": timedelta(seconds=-1)},
        {"release_interval": timedelta(days=3)},
    ],
)
def test_the_database_refuses_bad_limits_written_past_the_model(
    fields: dict[str, Any], tables_intact: None
) -> None:
    channel = Channel(name="limits", **fields)
    with pytest.raises(ValidationError):
        channel.full_clean()
    with pytest.raises(InvalidChannel):
        channel.save()  # the model checks first
    assert not Channel.objects.filter(name="limits").exists()
    Channel.objects.create(name="limits")
    # QuerySet.update() does not go through save(): the database's CHECK refuses it
    with pytest.raises(IntegrityError), transaction.atomic():
        Channel.objects.filter(name="limits").update(**fields)
    assert Channel.objects.get(name="limits").weight == 1


@pytest.mark.parametrize("model", ["channel", "group"])
@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"weight": 0}, "weight must be an integer >= 1, got 0"),
        ({"weight": 5000}, "weight must be at most 1000, got 5000"),
        ({"weight": 1.5}, "weight must be an integer >= 1, got 1.5"),
        ({"weight": True}, "weight must be an integer >= 1, got True"),
        ({"max_concurrency": 0}, "max_concurrency must be an integer >= 1"),
        ({"max_concurrency": 2.5}, "max_concurrency must be an integer >= 1"),
        ({"max_concurrency": 10**7}, "max_concurrency must be at most 1000000"),
        ({"release_interval": timedelta(days=3)}, "release_interval must be from 0 to 86400"),
        ({"release_interval": "5"}, "number of seconds or a timedelta"),
    ],
)
def test_an_orm_save_of_bad_limits_raises_invalid_channel(
    model: str, fields: dict[str, Any], error: str
) -> None:
    from django_fairqueue.models import ChannelGroup

    obj: Any = (
        Channel(name="limits", **fields)
        if model == "channel"
        else ChannelGroup(name="limits", **fields)
    )
    with pytest.raises(InvalidChannel, match=re.escape(error)) as info:
        obj.save()
    assert f"{model if model == 'channel' else 'channel group'} 'limits'" in str(info.value)
    assert not type(obj).objects.exists()
    # an edit of a saved one too, also with update_fields
    obj = type(obj).objects.create(name="limits")
    for name, value in fields.items():
        setattr(obj, name, value)
    with pytest.raises(InvalidChannel, match=re.escape(error)):
        obj.save(update_fields=list(fields))
    assert type(obj).objects.get().weight == 1


def test_a_release_interval_in_seconds_is_saved_as_that_duration() -> None:
    channel = Channel.objects.create(name="limits", release_interval=5, max_backlog=3)
    channel.refresh_from_db()
    assert channel.release_interval == timedelta(seconds=5)


def test_a_bad_max_backlog_through_the_orm_raises_invalid_channel() -> None:
    with pytest.raises(InvalidChannel, match="max_backlog must be an integer >= 1, got 0"):
        Channel(name="limits", max_backlog=0).save()


@pytest.mark.parametrize(
    ("model", "name", "words"),
    [
        (ChannelGroup, "a/b", "must not contain '/'"),
        (ChannelGroup, "g" * 101, "the most is 100"),
        (ChannelGroup, " g", "must not start or end with blanks"),
        (ChannelGroup, f"reports\x1f{'g' * 95}", "too long for queue 'reports'"),
        (Channel, " bad", "must not start or end with blanks"),
        (Channel, "x" * 201, "201"),
        (Channel, f"reports\x1f{'x' * 195}", "too long for queue 'reports'"),
    ],
)
def test_a_bad_name_through_the_orm_raises_invalid_channel_and_stores_nothing(
    model: type[Channel | ChannelGroup], name: str, words: str
) -> None:
    """As an enqueue would refuse it, not with the database's IntegrityError or DataError."""
    with pytest.raises(InvalidChannel, match=re.escape(words)):
        model.objects.create(name=name)
    assert not model.objects.exists()
    # rows of another queue, named as the queue names them, are saved
    model.objects.create(name="reports\x1facme")


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"concurrency": 0}, "concurrency must be 1 to 1000, got 0"),
        ({"concurrency": -4}, "concurrency must be 1 to 1000"),
        ({"concurrency": 1001}, "concurrency must be 1 to 1000, got 1001"),
        ({"batch_size": 0}, "batch_size must be 1 to 10000"),
        ({"batch_size": 10_001}, "batch_size must be 1 to 10000, got 10001"),
        ({"prefetch": 10**9}, "prefetch must be 0 to 10000"),
        ({"max_messages": 0}, "max_messages must be 1 to 2147483647"),
        ({"poll_interval": 0}, "poll_interval must be 0.001 to 3600 seconds, got 0"),
        ({"poll_interval": -1.0}, "poll_interval must be 0.001 to 3600 seconds"),
        ({"lease": timedelta(0)}, "lease must be 0.001 to 86400 seconds, got 0"),
        ({"lease": timedelta(days=2)}, "lease must be 0.001 to 86400 seconds, got 172800"),
        ({"shutdown_grace": -1}, "shutdown_grace must be 0 to 86400 seconds"),
        ({"burst_horizon": float("nan")}, "burst_horizon must be 0 to 86400 seconds"),
        ({"channels": ["a"], "exclude_channels": ["a"]}, "both included and excluded"),
        # a name too long for the rows of every queue served: no enqueue can create it
        ({"channels": ["x" * 195], "queues": ["reports"]}, "cannot be in any of the queues"),
        ({"worker_id": "  "}, "worker_id must be a non-empty string"),
    ],
)
def test_bad_worker_options_are_refused(kwargs: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        WorkerConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"lease": 30}, "lease must be a timedelta (e.g. timedelta(seconds=60)), got int"),
        ({"poll_interval": timedelta(seconds=1)}, "poll_interval is a number of seconds"),
        ({"shutdown_grace": "10"}, "shutdown_grace is a number of seconds, got str"),
        ({"concurrency": "4"}, "concurrency must be an integer, got '4'"),
        ({"max_messages": "3"}, "max_messages must be an integer, got '3'"),
        ({"maintenance": "no"}, "maintenance must be True or False, got 'no'"),
        ({"listen": 0}, "listen must be True or False, got 0"),
        ({"burst": "no"}, "burst must be True or False"),
        ({"channels": "tenant-1"}, "channels must be a list of channel names, not a string"),
    ],
)
def test_worker_options_of_the_wrong_kind_say_what_they_take(
    kwargs: dict[str, Any], error: str
) -> None:
    with pytest.raises(TypeError, match=re.escape(error)):
        WorkerConfig(**kwargs)


@pytest.mark.parametrize("limit", [0, -1, None])
def test_a_claim_of_zero_or_fewer_messages_is_refused_by_the_database(limit: Any) -> None:
    enqueue(NOOP, channel="z")
    with pytest.raises(Exception, match="claim limit must be >= 1"), transaction.atomic():
        message_store.claim_messages(limit, lease=LEASE, worker_id="zero")
    assert Message.objects.get().state == MessageState.READY


@pytest.mark.parametrize("priority", [-101, 101, 2**40, 1.5, "high", True])
def test_bad_priorities_are_refused(priority: Any) -> None:
    with pytest.raises(ValueError, match="priority must be"):
        enqueue(NOOP, channel="p", priority=priority)
    assert message_count() == 0


# ------------------------------------------------------------------------------------------
# run_after


def test_run_after_far_in_the_past_is_ready_now(tables_intact: None) -> None:
    mid = enqueue(NOOP, channel="t", run_after=datetime(1970, 1, 1, tzinfo=UTC))
    assert Message.objects.get(pk=mid).state == MessageState.READY
    assert [m.id for m in claim_all()] == [mid]


def test_run_after_a_negative_delay_is_ready_now(tables_intact: None) -> None:
    mid = enqueue(NOOP, channel="t", run_after=timedelta(days=-365))
    assert [m.id for m in claim_all()] == [mid]


@pytest.mark.parametrize(
    "when",
    [datetime(9999, 12, 31, 23, 59, tzinfo=UTC), timedelta(days=365 * 1000)],
)
def test_run_after_far_in_the_future_waits(when: Any, tables_intact: None) -> None:
    mid = enqueue(NOOP, channel="t", run_after=when)
    assert Message.objects.get(pk=mid).state == MessageState.SCHEDULED
    assert claim_all() == []


@pytest.mark.parametrize(
    ("when", "error"),
    [
        (datetime(2030, 1, 1), ValueError),  # naive, with USE_TZ on
        ("tomorrow", TypeError),
        (3600, TypeError),
        (timedelta(days=10**8), OverflowError),  # past datetime.max: Python says so
    ],
)
def test_bad_run_after_values_are_refused(when: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        enqueue(NOOP, channel="t", run_after=when)
    assert message_count() == 0


# ------------------------------------------------------------------------------------------
# Task names


@pytest.mark.parametrize(
    "name", ["no.such.task", "", "os.system", "tests.fairtasks.add", "'; DROP TABLE x; --"]
)
def test_enqueueing_an_unknown_task_name_fails(name: str) -> None:
    with pytest.raises(UnknownTask):
        enqueue(name, channel="t")
    assert message_count() == 0


@pytest.mark.parametrize("task", [None, 42, object()])
def test_a_task_that_is_neither_a_name_nor_a_task_fails(task: Any) -> None:
    with pytest.raises(TypeError, match="task must be a task name or a registered task"):
        enqueue(task, channel="t")


def test_an_empty_task_name_is_refused_at_registration() -> None:
    with pytest.raises(ValueError, match="task name must be a non-empty string"):

        @django_fairqueue.task(name="")
        def unnamed() -> None: ...


def test_arguments_that_do_not_fit_the_task_are_refused_at_enqueue(tables_intact: None) -> None:
    with pytest.raises(TypeError, match=r"do not fit tests.fair.add\(a.*missing .* 'b'"):
        fairtasks.add.enqueue(1, channel="t")
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        enqueue(fairtasks.add, 1, 2, bogus=3, channel="t")
    with pytest.raises(TypeError, match="enqueue_many request 1: arguments do not fit"):
        enqueue_many(
            [EnqueueRequest(fairtasks.add, (1, 2)), EnqueueRequest(fairtasks.add, (1, 2, 3))]
        )
    assert message_count() == 0


def test_queue_options_after_using_are_the_tasks_own_and_refused_when_they_do_not_fit(
    tables_intact: None,
) -> None:
    with pytest.raises(
        TypeError,
        match=r"'channel' \(after \.using\(\), enqueue\(\) passes every keyword to the task: "
        r"give channel to \.using\(\)\)",
    ):
        fairtasks.add.using(queue="exports").enqueue(1, 2, channel="acme")
    assert message_count() == 0
    # a task whose own argument is named like an option: what using() is for
    mid = fairtasks.takes_channel.using(channel="acme").enqueue(channel="its own")
    assert Message.objects.get(pk=mid).payload["kwargs"] == {"channel": "its own"}


def test_a_stored_message_naming_an_unknown_task_fails_without_running(
    tables_intact: None,
) -> None:
    mid = enqueue_raw("t", "no.such.task", '{"args": [], "kwargs": {}}')
    assert Worker(WorkerConfig(worker_id="unknown")).run_once() == 1
    failed = Message.objects.get(pk=mid)
    assert (failed.state, failed.attempts) == (MessageState.FAILED, 1)
    assert failed.last_error["type"] == "django_fairqueue.exceptions.UnknownTask"


@pytest.mark.parametrize(
    "payload",
    ["[1, 2]", '"text"', "null", '{"args": {}, "kwargs": {}}', '{"args": [], "kwargs": []}'],
)
def test_a_stored_payload_of_the_wrong_shape_fails_without_running(
    payload: str, tables_intact: None
) -> None:
    mid = enqueue_raw("t", "tests.fair.add", payload)
    Worker(WorkerConfig(worker_id="shape")).run_once()
    failed = Message.objects.get(pk=mid)
    assert failed.state == MessageState.FAILED
    assert failed.last_error["type"] == "django_fairqueue.exceptions.PayloadError"


# ------------------------------------------------------------------------------------------
# Settings: system checks with stable ids


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("not a dict", "FAIRQUEUE must be a dict"),
        ({"NO_SUCH_KEY": 1}, "unknown keys ['NO_SUCH_KEY']"),
        ({"LEASE_SECONDS": "60"}, "LEASE_SECONDS'] must be a number"),
        ({"LEASE_SECONDS": 0}, "LEASE_SECONDS'] must be a number >= 0.001"),
        ({"LEASE_SECONDS": -5}, "LEASE_SECONDS'] must be a number >= 0.001"),
        ({"POLL_INTERVAL": None}, "POLL_INTERVAL'] must be a number"),
        ({"RETRY_BACKOFF_BASE": -1}, "RETRY_BACKOFF_BASE'] must be a number >= 0.0"),
        ({"CLAIM_WAIT": -0.1}, "CLAIM_WAIT'] must be a number >= 0.0"),
        ({"CLAIM_WAIT": 60}, "CLAIM_WAIT'] must be at most 10 seconds"),
        ({"CLAIM_WAIT": "50ms"}, "CLAIM_WAIT'] must be a number"),
        ({"CLAIM_WAIT": math.nan}, "CLAIM_WAIT'] must be a number"),
        ({"POLL_INTERVAL": math.inf}, "POLL_INTERVAL'] must be a number"),
        # within what --lease and --poll-interval take, every other interval within a year
        ({"LEASE_SECONDS": 86401}, "LEASE_SECONDS'] must be at most 86400 seconds (1 day)"),
        ({"POLL_INTERVAL": 3601}, "POLL_INTERVAL'] must be at most 3600 seconds (1 hour)"),
        ({"POLL_INTERVAL": 1e14}, "POLL_INTERVAL'] must be at most 3600 seconds"),
        ({"WORKER_HEARTBEAT": 1e14}, "HEARTBEAT'] must be at most"),
        ({"STUCK_TASK_LIMIT": 1e9}, "STUCK_TASK_LIMIT'] must be at most 31536000 seconds"),
        ({"DEFAULT_MAX_ATTEMPTS": 0}, "DEFAULT_MAX_ATTEMPTS'] must be an integer >= 1"),
        ({"DEFAULT_MAX_ATTEMPTS": 2.5}, "DEFAULT_MAX_ATTEMPTS'] must be an integer"),
        ({"MAX_PAYLOAD_BYTES": "1MB"}, "MAX_PAYLOAD_BYTES'] must be an integer"),
        ({"KEEP_RESULTS": "yes"}, "KEEP_RESULTS'] must be True or False"),
        ({"NOTIFY": 1}, "NOTIFY'] must be True or False"),
        ({"ASYNC_COMMIT": "off"}, "ASYNC_COMMIT'] must be True or False"),
        ({"NOTIFY_CHANNEL": 'x"; DROP TABLE y; --'}, "NOTIFY_CHANNEL'] must be a lower-case"),
        ({"NOTIFY_CHANNEL": "Upper"}, "NOTIFY_CHANNEL'] must be a lower-case"),
        ({"NOTIFY_CHANNEL": "x" * 64}, "NOTIFY_CHANNEL'] must be a lower-case"),
        ({"NOTIFY_CHANNEL": ""}, "NOTIFY_CHANNEL'] must be a lower-case"),
        ({"DEFAULT_DELIVERY": "exactly_once"}, "DEFAULT_DELIVERY'] must be one of"),
        ({"DATABASE": ""}, "DATABASE'] must be a non-empty string"),
        ({"DEFAULT_CHANNEL": 7}, "DEFAULT_CHANNEL'] must be a non-empty string"),
        ({"RESULT_RETENTION": "1 day"}, "RESULT_RETENTION'] must be a number of seconds"),
        ({"TASK_MODULES": "tests.fairtasks"}, "TASK_MODULES'] must be a list"),
        ({"TASK_MODULES": [1]}, "TASK_MODULES'] must be a list"),
        ({"CHANNEL_DEFAULTS": []}, "CHANNEL_DEFAULTS'] must be a dict"),
        ({"CHANNEL_DEFAULTS": {"cap": 1}}, "CHANNEL_DEFAULTS'] has unknown keys"),
        ({"CHANNEL_DEFAULTS": {"weight": 0}}, "weight must be an integer >= 1"),
    ],
)
def test_wrong_settings_stop_start_up_with_check_e001(value: Any, words: str) -> None:
    with override_settings(FAIRQUEUE=value):
        errors = checks.check_settings()
    assert [e.id for e in errors] == ["fairqueue.E001"], errors
    assert words in errors[0].msg
    assert errors[0].hint


def test_settings_naming_a_missing_database_are_check_e002() -> None:
    with override_settings(FAIRQUEUE={"DATABASE": "nope"}):
        assert [e.id for e in checks.check_settings()] == ["fairqueue.E002"]


def test_every_bad_setting_is_its_own_e001() -> None:
    raw = {"LEASE_SECONDS": "x", "POLL_INTERVAL": -1, "FOO": 1}
    with override_settings(FAIRQUEUE=raw):
        errors = checks.check_settings()
    assert [e.id for e in errors] == ["fairqueue.E001"] * 3, errors
    assert ["FOO" in errors[0].msg, "LEASE_SECONDS" in errors[1].msg] == [True, True]
    assert "POLL_INTERVAL'] must be a number >= 0.001" in errors[2].msg
    with pytest.raises(conf.SettingsError) as info:
        conf.load(raw)
    assert len(info.value.problems) == 3


@pytest.mark.parametrize(
    ("raw", "ok"),
    [
        ({"WORKER_DEAD_AFTER": 1}, False),  # the default beat is 5 s
        ({"WORKER_HEARTBEAT": 20}, False),  # the default dead-after is 30 s
        ({"WORKER_HEARTBEAT": 1, "WORKER_DEAD_AFTER": 2.5}, False),
        ({"WORKER_HEARTBEAT": 1, "WORKER_DEAD_AFTER": 3}, True),
        ({"WORKER_HEARTBEAT": 0.2, "WORKER_DEAD_AFTER": 0.6}, True),  # 3 * 0.2 > 0.6 in floats
    ],
)
def test_workers_are_declared_dead_only_after_three_missed_beats(
    raw: dict[str, float], ok: bool
) -> None:
    with override_settings(FAIRQUEUE=raw):
        errors = checks.check_settings()
    if ok:
        assert errors == []
    else:
        (error,) = errors
        assert error.id == "fairqueue.E001"
        assert "must be at least three times FAIRQUEUE['WORKER_HEARTBEAT']" in error.msg


def test_a_lease_shorter_than_the_worker_accepts_is_warning_w002() -> None:
    with override_settings(FAIRQUEUE={"LEASE_SECONDS": 1}):
        (warning,) = checks.check_settings()
    assert warning.id == "fairqueue.W002"
    assert "shorter than the 5 s `runfairworker --lease` accepts" in warning.msg


def test_a_queue_database_without_the_router_is_check_e007() -> None:
    # ("pooled" is a second alias of the test database)
    with override_settings(FAIRQUEUE={"DATABASE": "pooled"}):
        (error,) = checks.check_settings()
    assert error.id == "fairqueue.E007"
    assert "routers send django-fairqueue's models to 'default' for writes" in error.msg
    assert "django_fairqueue.routers.QueueRouter" in (error.hint or "")
    with override_settings(
        FAIRQUEUE={"DATABASE": "pooled"},
        DATABASE_ROUTERS=["django_fairqueue.routers.QueueRouter"],
    ):
        assert checks.check_settings() == []
    # reads sent elsewhere (a replica for the admin's lists): allowed, and said
    with override_settings(DATABASE_ROUTERS=["tests.test_bad_input.ReadsElsewhere"]):
        (warning,) = checks.check_settings()
    assert warning.id == "fairqueue.W003" and "reads of django-fairqueue's models" in warning.msg


class ReadsElsewhere:
    """A router that reads the queue's models from another alias (as from a replica)."""

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return "pooled"


def test_a_default_channel_the_queue_would_refuse_is_check_e004() -> None:
    for name in ("x" * 201, " padded ", "acme\x1fx", "acme\x00"):
        with override_settings(FAIRQUEUE={"DEFAULT_CHANNEL": name}):
            assert [e.id for e in checks.check_settings()] == ["fairqueue.E004"]


SETTING_VALUES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**6), max_value=10**6)
    | st.floats(allow_nan=False)
    | st.just(math.nan)
    | st.text(max_size=70)
    | st.lists(st.text(max_size=5), max_size=2)
    | st.dictionaries(st.text(max_size=5), st.integers(), max_size=2)
)
SETTING_KEYS = st.sampled_from(
    [f.name for f in conf.dataclasses.fields(conf.FairQueueSettings)] + ["BOGUS"]
)


@EXAMPLES
@given(raw=st.dictionaries(SETTING_KEYS, SETTING_VALUES, max_size=4))
def test_any_settings_dict_is_valid_or_check_e001_never_a_crash(raw: dict[str, Any]) -> None:
    with override_settings(FAIRQUEUE=raw):
        errors = checks.check_settings()
        ids = {e.id for e in errors}
        if "fairqueue.E001" in ids:
            with pytest.raises((ValueError, TypeError)):
                conf.load(raw)
        else:
            conf.load(raw)  # accepted: the settings load the same way at first use
            # E005: a TASK_MODULES entry that does not import
            # W002: a lease shorter than runfairworker --lease accepts
            assert ids <= {"fairqueue.E002", "fairqueue.E004", "fairqueue.E005", "fairqueue.W002"}


@pytest.mark.parametrize("value", [None, 3])
def test_a_task_modules_setting_that_is_not_a_list_is_named_in_e001(value: Any) -> None:
    with override_settings(FAIRQUEUE={"TASK_MODULES": value}):
        (error,) = checks.check_settings()
    assert "TASK_MODULES" in error.msg


def test_a_duration_setting_too_large_for_timedelta_is_check_e001() -> None:
    with override_settings(FAIRQUEUE={"RESULT_RETENTION": 8.64e13}):
        assert [e.id for e in checks.check_settings()] == ["fairqueue.E001"]


@pytest.mark.parametrize("key", ["RESULT_RETENTION", "BATCH_RETENTION"])
@pytest.mark.parametrize("value", [-5, timedelta(seconds=-1)])
def test_a_negative_retention_is_check_e001(key: str, value: Any) -> None:
    with override_settings(FAIRQUEUE={key: value}):
        (error,) = checks.check_settings()
    assert error.id == "fairqueue.E001"
    assert f"{key}'] must be from 0 to " in error.msg
    with override_settings(FAIRQUEUE={key: 0}):
        assert checks.check_settings() == []


def test_a_task_module_that_cannot_be_imported_is_check_e005_and_a_worker_command_error() -> None:
    with override_settings(FAIRQUEUE={"TASK_MODULES": ["tests.fairtasks", "nope.mod"]}):
        (error,) = checks.check_settings()
        assert error.id == "fairqueue.E005"
        assert "'nope.mod', which cannot be imported: ModuleNotFoundError" in error.msg
        assert error.hint
        with pytest.raises(CommandError, match=re.escape("names 'nope.mod', which cannot")):
            call_command("runfairworker", "--burst", "--no-listen")
    assert message_count() == 0


def test_a_task_module_whose_import_fails_keeps_its_own_error_in_the_worker(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a module that exists but raises: the check names it, the worker shows its traceback
    (tmp_path / "broken_fairtasks.py").write_text("raise RuntimeError('broken task module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with override_settings(FAIRQUEUE={"TASK_MODULES": ["broken_fairtasks"]}):
        (error,) = checks.check_settings()
        assert error.id == "fairqueue.E005"
        assert "RuntimeError: broken task module" in error.msg
        with pytest.raises(RuntimeError, match="broken task module"):
            call_command("runfairworker", "--burst", "--no-listen")


def test_a_settings_schedule_naming_an_unregistered_task_is_check_e006() -> None:
    schedules = {
        "fine": {"task": "tests.fair.add", "cron": "@daily", "args": [1, 2]},
        "orphan": {"task": "no.such.task", "cron": "@daily"},
    }
    with override_settings(FAIRQUEUE={"TASK_MODULES": ["tests.fairtasks"], "SCHEDULES": schedules}):
        (error,) = checks.check_settings()
    assert error.id == "fairqueue.E006"
    assert "['orphan'] names task 'no.such.task', which is not registered" in error.msg


# ------------------------------------------------------------------------------------------
# Nothing reaches SQL unparameterised


MARKER = "zz'marker\"; SELECT 1; --"


def test_no_value_is_ever_part_of_the_sql_text(tables_intact: None) -> None:
    """Every statement the queue sends is recorded; the marker (in a channel name, a payload,
    a task error, a result, a worker id) appears only among the bound parameters."""
    sent: list[str] = []
    real = psycopg.Cursor.execute

    def spy(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        text = query if isinstance(query, str | bytes) else query.as_string(self.connection)
        sent.append(text if isinstance(text, str) else text.decode())
        return real(self, query, params, **kwargs)

    with mock.patch.object(psycopg.Cursor, "execute", spy):
        ids = enqueue_many(
            [EnqueueRequest(NOOP, [MARKER], {"k": MARKER}, channel=MARKER) for _ in range(3)]
        )
        enqueue(NOOP, channel=f"{MARKER}-later", run_after=timedelta(hours=1))
        cid = channel_store.select_channel_ids([MARKER])[MARKER]
        claimed = message_store.claim_messages(3, lease=LEASE, worker_id=MARKER)
        a, b, c = claimed
        assert message_store.heartbeat_messages([(a.id, a.lease_token)], lease=LEASE) == {
            a.id: False
        }
        message_store.complete_messages([(a.id, a.lease_token, {"r": MARKER})])
        message_store.fail_messages([(b.id, b.lease_token, {"message": MARKER}, None)])
        message_store.release_messages([(c.id, c.lease_token)])
        channel_store.select_channel_counters([cid])
        message_store.cancel_messages([c.id])
        message_store.delete_failed_messages([b.id])
    assert sent, "nothing was recorded: the spy is not on the queue's cursor"
    assert set(ids) >= {a.id, b.id, c.id}
    leaked = [q for q in sent if "marker" in q]
    assert leaked == []


def test_listen_quotes_the_notify_channel_as_an_identifier(database_url: str) -> None:
    """LISTEN cannot take a bound parameter; the name is quoted, so even a hostile one (the
    settings refuse it before) is one identifier, and NOTIFY through pg_notify() reaches it."""
    hostile = 'wake"; DROP TABLE fairqueue_message; --'
    with psycopg.connect(database_url, autocommit=True) as listener:
        message_store.listen_wakeups(listener, hostile)
        with psycopg.connect(database_url, autocommit=True) as sender:
            sender.execute("SELECT pg_notify(%s, 'hello')", [hostile])
        got = [(n.channel, n.payload) for n in listener.notifies(timeout=5, stop_after=1)]
    assert got == [(hostile, "hello")]
    assert Message.objects.count() == 0  # the table is still there


def test_named_statements_take_values_only_as_bound_parameters() -> None:
    """db/statements/*.sql: values are %(name)s placeholders. Format fields stand only for
    what cannot be bound, and the db package fills each through psycopg.sql: LISTEN's channel
    and a source table's name and id column (sql.Identifier), and its filters
    (sql.Placeholder conditions).
    A new field fails this test until it is reviewed and added here."""
    fields = {
        field
        for text in all_statements().values()
        for field in re.findall(r"(?<![%'])\{(\w+)\}", text)
    }
    assert fields <= {"channel", "table", "id", "filters"}, fields
    assert re.findall(r"\{(\w+)\}", message_store.queries()["listen_wakeups"]) == ["channel"]
    for name, text in all_statements().items():
        # no %s positional placeholders, no Python %-formatting of values
        assert not re.search(r"(?<!%)%[sd]\b", text), name


# ------------------------------------------------------------------------------------------------
# integers PostgreSQL cannot hold: a clear error before the server's "bigint out of range"

HUGE = 10**20


@pytest.mark.parametrize(
    "call",
    [
        lambda: failures.retry([HUGE]),
        lambda: failures.delete([2**63]),
        lambda: failures.retry([0]),
        lambda: failures.list_failed(limit=HUGE),
        lambda: failures.list_failed(limit=2**31),
        lambda: failures.list_failed(after_id=HUGE),
    ],
)
def test_ids_and_limits_out_of_range_are_value_errors(call: Any, tables_intact: None) -> None:
    with pytest.raises(ValueError, match=r"must be (1|0) to \d+, got"):
        call()


@pytest.mark.parametrize("verb", ["cancel", "abort"])
def test_cancel_and_abort_refuse_ids_out_of_range(verb: str) -> None:
    with pytest.raises(ValueError, match="a message id must be 1 to"):
        getattr(django_fairqueue, verb)([1, HUGE])


def test_the_largest_id_and_limit_are_accepted() -> None:
    assert failures.retry([2**63 - 1]) == []
    assert failures.list_failed(limit=2**31 - 1, after_id=2**63 - 1) == []


def test_exactly_once_batch_refuses_a_limit_past_integer() -> None:
    too_many = pytest.raises(ValueError, match="limit must be 1 to 2147483647")
    with transaction.atomic(), too_many, exactly_once.batch(limit=10**10):
        pass


@pytest.mark.parametrize(
    "args",
    [
        ["cancel", str(HUGE)],
        ["abort", str(HUGE)],
        ["cancel", "0"],
        ["failures", "retry", str(HUGE)],
        ["failures", "delete", str(2**63)],
        ["failures", "list", "--limit", str(HUGE)],
        ["failures", "list", "--after", str(HUGE)],
        ["status", "--limit", str(2**31)],
        ["status", "--watch", "inf"],
        ["status", "--watch", "nan"],
    ],
)
def test_commands_refuse_integers_out_of_range_as_usage_errors(
    args: list[str], tables_intact: None
) -> None:
    with pytest.raises(CommandError, match=r"argument .*: (must be|not)"):
        call_command("fairqueue", *args, stdout=io.StringIO())


@pytest.mark.parametrize(
    "args",
    [
        ["status", ""],
        ["schedules", "--channel", ""],
        ["failures", "list", "--channel", ""],
        ["failures", "retry", "--all", "--channel", ""],
        ["failures", "delete", "--all", "--channel", ""],
        ["cancel", "--channel", ""],
        ["abort", "--channel", ""],
        ["cancel", "--channel", " padded"],
    ],
)
def test_commands_refuse_an_empty_channel_name_alike(args: list[str], tables_intact: None) -> None:
    with pytest.raises(CommandError, match=r"argument (--channel|CHANNEL): channel name must not"):
        call_command("fairqueue", *args, stdout=io.StringIO())


@pytest.mark.parametrize(
    ("worker_id", "error"),
    [("", "a non-empty"), ("  ", "a non-empty"), (None, "a non-empty"), ("w" * 201, "at most 200")],
)
def test_a_batch_claim_refuses_a_blank_worker_id_like_a_message_claim(
    worker_id: Any, error: str
) -> None:
    from django_fairqueue import batches

    with pytest.raises(ValueError, match=f"worker_id must be {error}"):
        batches.claim(worker_id=worker_id)
    if isinstance(worker_id, str):  # the worker's own check says the same
        with pytest.raises(ValueError, match=f"worker_id must be {error}"):
            WorkerConfig(worker_id=worker_id)


def _generator() -> Iterator[int]:
    yield 1


@pytest.mark.parametrize(
    ("args", "kwargs", "error"),
    [
        ("abc", {}, "args must be a list or tuple of arguments, got str"),
        ({"a": 1}, {}, "args must be a list or tuple of arguments, got dict"),
        (b"ab", {}, "args must be a list or tuple of arguments, got bytes"),
        ({3, 1}, {}, "args must be a list or tuple of arguments, got set"),
        (range(3), {}, "args must be a list or tuple of arguments, got range"),
        (_generator(), {}, "args must be a list or tuple of arguments, got generator"),
        (7, {}, "args must be a list or tuple of arguments, got int"),
        ((), [("a", 1)], "kwargs must be a dict, got list"),
        ((), "ab", "kwargs must be a dict, got str"),
        ((), {1: "x"}, "kwargs keys must be strings (argument names), got 1"),
    ],
)
def test_enqueue_many_refuses_args_it_would_have_to_change(
    args: Any, kwargs: Any, error: str, tables_intact: None
) -> None:
    good = EnqueueRequest(NOOP, [1], {"a": 2}, channel="p")
    bad = EnqueueRequest(NOOP, args, kwargs, channel="p")
    with pytest.raises(PayloadError, match=re.escape(f"enqueue_many request 1: task {NOOP!r}: ")):
        enqueue_many([good, bad])
    with pytest.raises(PayloadError, match=re.escape(error)):
        enqueue_many([bad])
    assert message_count() == 0


@pytest.mark.parametrize(
    "bad, error",
    [
        (dict(args=({1, 2},)), PayloadError),
        (dict(channel=" mix"), InvalidChannel),
        (dict(priority=500), ValueError),
        (dict(queue="no way"), InvalidQueue),
        (dict(task="no.such.task"), UnknownTask),
        (dict(run_after=datetime(2030, 1, 1)), ValueError),  # naive
        (dict(unique_key="k", on_conflict="sometimes"), ValueError),
    ],
)
def test_every_refusal_in_a_batch_names_the_request(
    bad: dict[str, Any], error: type[Exception], tables_intact: None
) -> None:
    good = EnqueueRequest(NOOP, [1], channel="p")
    wrong = dataclasses.replace(good, **bad)
    with pytest.raises(error, match=r"^enqueue_many request 2: ") as caught:
        enqueue_many([good, good, wrong, good])
    alone = str(caught.value).removeprefix("enqueue_many request 2: ")
    with pytest.raises(error) as caught:  # a batch of one: its call names it
        enqueue_many([wrong])
    assert str(caught.value) == alone
    assert message_count() == 0


def test_a_batch_item_that_is_no_request_is_refused_by_position(tables_intact: None) -> None:
    good = EnqueueRequest(NOOP, [1], channel="p")
    with pytest.raises(TypeError, match=r"^enqueue_many request 1: expected an EnqueueRequest, "):
        enqueue_many([good, (NOOP, [1])])  # type: ignore[list-item]
    assert message_count() == 0


def test_enqueue_many_takes_tuples_lists_and_mappings(tables_intact: None) -> None:
    from types import MappingProxyType

    ids = enqueue_many(
        [
            EnqueueRequest(NOOP, (1, "x"), MappingProxyType({"k": [1]}), channel="p"),
            EnqueueRequest(NOOP, [2], {}, channel="p"),
        ]
    )
    payloads = dict(Message.objects.filter(id__in=ids).values_list("id", "payload"))
    assert [payloads[i] for i in ids] == [
        {"args": [1, "x"], "kwargs": {"k": [1]}},
        {"args": [2], "kwargs": {}},
    ]


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"priority": 500}, ValueError, "priority must be between -100 and 100, got 500"),
        ({"priority": "x"}, ValueError, "priority must be an integer, got 'x'"),
        ({"priority": True}, ValueError, "priority must be an integer"),
        ({"channel": ""}, InvalidChannel, "channel name must not be empty"),
        ({"channel": " a"}, InvalidChannel, "must not start or end with blanks"),
        ({"channel": 5}, InvalidChannel, "channel name must be a string, got int"),
        ({"channel": "x" * 201}, InvalidChannel, "the most is 200"),
        ({"channel_from": "notcallable"}, TypeError, "channel_from must be a callable"),
        ({"name": "a\x00"}, ValueError, "must not contain NUL characters"),
        ({"name": "a\ud800"}, ValueError, "not valid Unicode"),
        ({"name": "x" * 201}, ValueError, "longer than 200 characters"),
        ({"max_attempts": 10**12}, ValueError, "max_attempts must be an integer from 1 to"),
        ({"max_attempts": 0}, ValueError, "max_attempts must be an integer from 1 to"),
        ({"timeout": -1}, ValueError, "timeout must be a number of seconds >= 0"),
        ({"delivery": "sometimes"}, ValueError, "delivery must be one of"),
        ({"keep_result": "yes"}, TypeError, "keep_result must be True, False or None"),
    ],
)
def test_task_options_every_enqueue_would_refuse_are_refused_at_decoration(
    options: dict[str, Any], error: type[Exception], words: str
) -> None:
    from django_fairqueue import task
    from django_fairqueue.tasks.spec import registry

    options.setdefault("name", "tests.bad_options")

    def func() -> None: ...

    with pytest.raises(error, match=re.escape(words)):
        task(**options)(func)
    assert "tests.bad_options" not in registry


def test_task_options_at_their_bounds_are_taken() -> None:
    from django_fairqueue import task
    from django_fairqueue.tasks.spec import registry

    def func() -> None: ...

    t = task(
        name="tests.good_options",
        priority=-100,
        channel=" x ".strip(),
        channel_from=lambda: None,
        max_attempts=2_147_483_647,
    )(func)
    try:
        assert t.spec.priority == -100 and t.spec.max_attempts == 2_147_483_647
    finally:
        registry.unregister("tests.good_options")


@pytest.mark.parametrize("priority", [500, -101, 101, 32767])
def test_an_orm_save_of_a_message_refuses_a_priority_out_of_range(priority: int) -> None:
    channel = Channel.objects.create(name="orm-priority")
    message = Message(channel=channel, task_name=NOOP, state=MessageState.READY, priority=priority)
    with pytest.raises(ValidationError, match="priority must be between -100 and 100"):
        message.full_clean()
    with pytest.raises(ValueError, match=f"priority must be between -100 and 100, got {priority}"):
        message.save()
    assert message_count() == 0
    message.priority = 100
    message.save()
    message.priority = 101
    with pytest.raises(ValueError, match="priority must be between"):
        message.save(update_fields=["priority"])
    assert Message.objects.get().priority == 100


def test_a_command_on_a_database_without_the_queue_tables_says_to_migrate() -> None:
    with connection.cursor() as cursor:  # (rolled back with the test's transaction)
        cursor.execute("DROP TABLE fairqueue_worker CASCADE")
    with pytest.raises(
        CommandError,
        match=r'"fairqueue_worker" does not exist.*: the queue\'s tables or functions are not in '
        r"this database; run `manage.py migrate`",
    ):
        call_command("fairqueue", "workers", stdout=io.StringIO())


def test_an_enqueue_into_a_database_without_the_queue_says_to_migrate() -> None:
    with connection.cursor() as cursor:  # (the test's transaction: none of the queue's objects)
        cursor.execute("CREATE SCHEMA fq_empty; SET LOCAL search_path = fq_empty")
    with pytest.raises(
        DatabaseError,
        match=r"fairqueue_\w+\(.*\) does not exist in database 'default': the queue's tables or "
        r"functions are not in this database; run `manage.py migrate`",
    ):
        enqueue(NOOP, channel="t")

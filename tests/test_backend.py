"""The Django Tasks backend (django_fairqueue.backend): Django's contract, on a real queue.

Runs on Django 6.1 (``django.tasks``) and on Django 5.2 with the django-tasks backport. The
tasks below are module-level, as Django requires; tests/settings.py makes FairQueueBackend the
``default`` task backend, so their decorators build ``FairQueueTask`` objects and register them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import pickle
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from fractions import Fraction
from typing import Any
from unittest import mock

import django
import psycopg
import pytest
from asgiref.sync import async_to_sync
from django.db import connections, transaction
from django.test import override_settings
from django.utils import timezone

from django_fairqueue.backend import FairQueueBackend, FairQueueTask
from django_fairqueue.context import current_message
from django_fairqueue.db import message_store
from django_fairqueue.exceptions import PayloadError, TaskTimeout
from django_fairqueue.models import Channel, Message, MessageState
from django_fairqueue.tasks import registry
from django_fairqueue.tasks import task as fairqueue_task
from django_fairqueue.tasks.django_compat import (
    InvalidTask,
    InvalidTaskBackend,
    TaskContext,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task,
    task_backends,
    task_enqueued,
    task_finished,
    task_started,
)
from django_fairqueue.testing import drain
from django_fairqueue.worker import Worker, WorkerConfig

FAIRQUEUE_BACKEND = "django_fairqueue.backend.FairQueueBackend"


# -- tasks (module level, as Django requires) ---------------------------------------------------


@task
def add(a: int, b: int) -> int:
    return a + b


@task
def greet(name: str, tenant: str | None = None) -> str:
    return f"hello {name}"


@task(takes_context=True)
def attempt_report(context: TaskContext, fail_before: int) -> dict[str, Any]:
    if context.attempt < fail_before:
        raise RuntimeError(f"failing attempt {context.attempt} on purpose")
    return {"attempt": context.attempt, "id": context.task_result.id}


@task
async def async_double(x: int) -> int:
    return x * 2


@task
def explode() -> None:
    raise ValueError("boom")


@task
def pair() -> tuple[int, int]:
    return (1, 2)


#: How many times each task below that returns what JSON cannot hold has run.
UNSTORABLE_RUNS: dict[str, int] = {}


@task
def returns_a_set() -> set[int]:
    UNSTORABLE_RUNS["set"] = UNSTORABLE_RUNS.get("set", 0) + 1
    return {1, 2}


@task
def returns_nan() -> float:
    UNSTORABLE_RUNS["nan"] = UNSTORABLE_RUNS.get("nan", 0) + 1
    return float("nan")


@task
def cancels_itself() -> None:
    raise asyncio.CancelledError("stop")


@task
def returns_int_keys() -> dict[Any, str]:
    UNSTORABLE_RUNS["keys"] = UNSTORABLE_RUNS.get("keys", 0) + 1
    # as JSON both keys are "1": one of the two would be lost
    return {"ok": "x", "nested": [{1: "int key", "1": "str key"}]}  # type: ignore[dict-item]


def reports() -> str:
    """Decorated in a test (Django 6.0's decorator would refuse ``channel=`` at import)."""
    return "report"


def in_emails(x: int) -> int:
    """Decorated in a test with ``queue_name="emails"`` (the test settings allow only the
    default queue until a test lifts ``QUEUES``)."""
    return x * 2


#: Set when a test below is done: lets the handler threads stuck in these tasks return.
RELEASE_STUCK = threading.Event()


def stuck() -> str:
    """Decorated in a test, after OPTIONS['TASK_TIMEOUT'] is set: never returns in time (a
    second, unless the test lets it go sooner)."""
    RELEASE_STUCK.wait(1.0)
    return "too late"


def stuck_briefly() -> str:
    """Decorated in a test with a time limit of its own."""
    return "quick"


@fairqueue_task(name="tests.backend.native")
def native() -> None:
    """A fairqueue task of its own (not a Django task)."""


def tenant_channel(task: Any, args: Any, kwargs: dict[str, Any]) -> str | None:
    """OPTIONS['CHANNEL_FROM'] for the tests: the ``tenant`` keyword argument, if given."""
    return kwargs.get("tenant")


# -- helpers --------------------------------------------------------------------------------------


def row(result_id: str) -> Message:
    return Message.objects.select_related("channel").get(pk=int(result_id))


@pytest.fixture
def tasks_options() -> Iterator[Any]:
    """Reconfigure the ``default`` task backend for one test: ``tasks_options(OPTIONS=...)``."""
    overrides: list[Any] = []

    def configure(**params: Any) -> None:
        override = override_settings(TASKS={"default": {"BACKEND": FAIRQUEUE_BACKEND, **params}})
        override.enable()
        overrides.append(override)

    yield configure
    for override in reversed(overrides):
        override.disable()


# -- the backend's declared features ---------------------------------------------------------


def test_backend_declares_what_it_supports() -> None:
    backend = task_backends["default"]
    assert isinstance(backend, FairQueueBackend)
    assert backend.supports_defer is True
    assert backend.supports_async_task is True
    assert backend.supports_get_result is True
    assert backend.supports_priority is True
    assert backend.task_class is FairQueueTask
    assert isinstance(add, FairQueueTask)


def test_defining_a_task_registers_it_by_module_path_with_results_kept() -> None:
    spec = registry.get("tests.test_backend.add")
    assert spec.keep_result is True
    assert spec.func(2, 3) == 5  # outside a worker the runner just calls the function
    # .using() validates (and registers) again: same entry, no "registered twice" error
    add.using(priority=3)
    assert registry.get("tests.test_backend.add") is spec


# -- enqueue ---------------------------------------------------------------------------------


@pytest.mark.django_db
def test_enqueue_returns_a_ready_result_and_queues_a_message() -> None:
    before = timezone.now()
    result = add.enqueue(2, b=3)
    assert result.status == TaskResultStatus.READY
    # the task as queued: add, with the channel the call went to
    assert result.task == dataclasses.replace(add, channel="default")
    assert (result.args, result.kwargs) == ([2], {"b": 3})
    assert result.backend == "default"
    assert result.enqueued_at is not None and result.enqueued_at >= before
    assert (result.started_at, result.finished_at, result.errors) == (None, None, [])
    message = row(result.id)
    assert message.task_name == "tests.test_backend.add"
    assert message.channel.name == "default"  # FAIRQUEUE['DEFAULT_CHANNEL']
    assert message.state == MessageState.READY
    assert message.payload == {"args": [2], "kwargs": {"b": 3}}
    assert message.keep_result is True


@pytest.mark.django_db
def test_priority_and_run_after_map_onto_the_message() -> None:
    later = timezone.now() + timedelta(hours=1)
    result = add.using(priority=42, run_after=later).enqueue(1, 1)
    message = row(result.id)
    assert (message.priority, message.state, message.run_at) == (42, MessageState.SCHEDULED, later)
    fetched = add.get_result(result.id)
    assert fetched.status == TaskResultStatus.READY  # Django has no "scheduled"
    assert (fetched.task.priority, fetched.task.run_after) == (42, later)


@pytest.mark.django_db
@pytest.mark.parametrize("whole", [5.0, Decimal("5"), Fraction(5, 1)], ids=repr)
def test_a_whole_priority_that_is_not_an_int_is_stored_as_one(whole: Any) -> None:
    # Django's validation takes any whole number, as its own backends run it
    result = add.using(priority=whole).enqueue(1, 1)
    assert row(result.id).priority == 5
    # the enqueue's result says what get_result says: 5, an int (5.0 == 5, yet printed 5.0)
    for said in (result, add.get_result(result.id)):
        assert repr(said.task.priority) == "5"


def test_priority_out_of_range_is_refused_by_django_validation() -> None:
    with pytest.raises(InvalidTask):
        add.using(priority=101)


@pytest.mark.django_db
def test_arguments_that_are_not_json_are_refused() -> None:
    with pytest.raises(TypeError):
        add.enqueue({1, 2}, 3)
    assert not Message.objects.exists()


@pytest.mark.django_db
def test_enqueue_sends_task_enqueued() -> None:
    seen = []

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        seen.append((sender, task_result.id, task_result.status))

    task_enqueued.connect(receiver)
    try:
        result = add.enqueue(1, 2)
    finally:
        task_enqueued.disconnect(receiver)
    assert seen == [(FairQueueBackend, result.id, TaskResultStatus.READY)]


@pytest.mark.django_db
def test_aenqueue_and_aget_result() -> None:
    result = async_to_sync(add.aenqueue)(4, 5)
    fetched = async_to_sync(add.aget_result)(result.id)
    assert (fetched.id, fetched.status, fetched.args) == (result.id, TaskResultStatus.READY, [4, 5])


# -- channel choice ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_using_channel_enqueues_to_that_channel() -> None:
    result = add.using(channel="alice").enqueue(1, 2)
    assert row(result.id).channel.name == "alice"
    assert result.task.channel == "alice"
    assert add.get_result(result.id).task.channel == "alice"
    assert add.channel is None  # using() made a copy


@pytest.mark.django_db
def test_using_channel_combines_with_django_options() -> None:
    bound = add.using(channel="bob", priority=-5)
    assert (bound.channel, bound.priority) == ("bob", -5)
    message = row(bound.enqueue(0, 0).id)
    assert (message.channel.name, message.priority) == ("bob", -5)


@pytest.mark.skipif(
    django.VERSION[:2] == (6, 0), reason="Django 6.0's @task does not forward extra arguments"
)
@pytest.mark.django_db
def test_decorator_accepts_a_channel() -> None:
    declared = task(channel="reports")(reports)
    assert declared.channel == "reports"
    assert row(declared.enqueue().id).channel.name == "reports"


def test_invalid_channel_is_refused_when_the_task_is_made() -> None:
    with pytest.raises(InvalidTask, match="blanks"):
        add.using(channel=" padded")


@pytest.mark.django_db
def test_channel_from_option_derives_the_channel_from_arguments(tasks_options: Any) -> None:
    tasks_options(OPTIONS={"CHANNEL_FROM": "tests.test_backend.tenant_channel"})
    assert row(greet.enqueue("ann", tenant="acme").id).channel.name == "acme"
    # None falls through to the default channel
    assert row(greet.enqueue("bea").id).channel.name == "default"
    # an explicit channel wins over the option
    assert row(greet.using(channel="vip").enqueue("cy", tenant="acme").id).channel.name == "vip"


@pytest.mark.django_db
def test_default_channel_option_then_fairqueue_setting(tasks_options: Any) -> None:
    tasks_options(OPTIONS={"DEFAULT_CHANNEL": "misc"})
    assert row(add.enqueue(1, 1).id).channel.name == "misc"
    tasks_options()
    with override_settings(FAIRQUEUE={"DEFAULT_CHANNEL": "fallback"}):
        assert row(add.enqueue(1, 1).id).channel.name == "fallback"


@pytest.mark.django_db
def test_the_enqueued_result_carries_the_channel_every_rule_gave(tasks_options: Any) -> None:
    """The result enqueue() returns names the channel the message went to, as get_result()
    of the same id does, whichever rule chose it."""
    tasks_options(
        OPTIONS={"CHANNEL_FROM": "tests.test_backend.tenant_channel", "DEFAULT_CHANNEL": "misc"}
    )
    for result, channel in (
        (greet.enqueue("ann", tenant="acme"), "acme"),  # CHANNEL_FROM
        (greet.enqueue("bea"), "misc"),  # OPTIONS['DEFAULT_CHANNEL']
        (greet.using(channel="vip").enqueue("cy", tenant="acme"), "vip"),  # using()
    ):
        assert result.task.channel == channel
        assert greet.get_result(result.id).task.channel == channel
    tasks_options()
    assert add.enqueue(1, 1).task.channel == "default"  # FAIRQUEUE['DEFAULT_CHANNEL']


def blank_channel(task: Any, args: Any, kwargs: dict[str, Any]) -> str:
    """OPTIONS['CHANNEL_FROM'] for the tests: a name no channel can have."""
    return ""


@pytest.mark.django_db
def test_a_channel_from_giving_an_invalid_name_raises_invalid_task(tasks_options: Any) -> None:
    tasks_options(OPTIONS={"CHANNEL_FROM": "tests.test_backend.blank_channel"})
    with pytest.raises(InvalidTask, match=r"CHANNEL_FROM.*blank_channel.*''"):
        add.enqueue(1, 2)
    assert not Message.objects.exists()


def grouped_channel(task: Any, args: Any, kwargs: dict[str, Any]) -> tuple[str, str] | None:
    """OPTIONS['CHANNEL_FROM'] for the tests: channel ``name`` of group ``tenant``, if given."""
    return (kwargs["tenant"], args[0]) if "tenant" in kwargs else None


@pytest.mark.django_db
def test_a_group_channel_pair_creates_the_group_with_the_channel_in_it(
    tasks_options: Any,
) -> None:
    """A (group, channel) pair, from .using() or CHANNEL_FROM, is enqueue's: the group is
    created (in the task's queue) and the channel is in it; results name the channel."""
    tasks_options(QUEUES=[], OPTIONS={"CHANNEL_FROM": "tests.test_backend.grouped_channel"})
    bound = add.using(channel=("newgrp", "alice"))
    assert bound.channel == ("newgrp", "alice")
    backend = task_backends["default"]
    for result, group, channel, queue in (
        (bound.enqueue(1, 2), "newgrp", "newgrp/alice", "default"),
        (greet.enqueue("bob", tenant="acme"), "acme", "acme/bob", "default"),
        (
            greet.using(queue_name="emails").enqueue("cy", tenant="acme"),
            "acme",
            "acme/cy",
            "emails",
        ),
    ):
        row_channel = row(result.id).channel
        assert (row_channel.queue, row_channel.short_name) == (queue, channel)
        assert row_channel.group is not None
        assert (row_channel.group.queue, row_channel.group.short_name) == (queue, group)
        assert result.task.channel == channel
        assert backend.get_result(result.id).task.channel == channel


@pytest.mark.django_db
def test_a_channel_too_long_for_the_tasks_queue_raises_invalid_task(tasks_options: Any) -> None:
    """Outside the default queue the queue's name is part of the channel's (and its group's):
    a name that fits alone but not with the queue is refused when the task is made, or, from
    CHANNEL_FROM, at that enqueue naming the function, as enqueue() would refuse it."""
    tasks_options(QUEUES=[], OPTIONS={"CHANNEL_FROM": "tests.test_backend.grouped_channel"})
    long_name, long_group = "k" * 195, ("h" * 95, "u")
    for channel, words in (
        (long_name, "between them take 202"),
        (long_group, "between them they take 102"),
    ):
        add.using(channel=channel)  # fits the default queue
        with pytest.raises(InvalidTask, match=words):
            add.using(queue_name="emails").using(channel=channel)
        with pytest.raises(InvalidTask, match=words):
            add.using(channel=channel).using(queue_name="emails")
    with pytest.raises(
        InvalidTask, match=r"CHANNEL_FROM.*grouped_channel.*between them they take 102"
    ):
        greet.using(queue_name="emails").enqueue("u", tenant="h" * 95)
    assert not Message.objects.exists()
    # a task changing queue and channel at once is checked with both new ones
    short = add.using(channel=long_name).using(channel="acme", queue_name="emails")
    assert row(short.enqueue(1, 1).id).channel.short_name == "acme"
    moved = add.using(queue_name="emails").using(channel=long_name, queue_name="default")
    assert row(moved.enqueue(1, 1).id).channel.name == long_name


@pytest.mark.django_db
def test_queue_name_is_the_queue_not_the_channel(tasks_options: Any) -> None:
    tasks_options(QUEUES=[])  # any queue name is valid
    emails = row(add.using(queue_name="emails").enqueue(1, 1).id).channel
    assert (emails.queue, emails.short_name) == ("emails", "default")
    plain = row(add.using(channel="acme").enqueue(1, 1).id).channel
    assert (plain.queue, plain.name) == ("default", "acme")
    # a worker of another queue never gets it; one of "emails" does
    lease = timedelta(minutes=1)
    assert message_store.claim_messages(10, lease=lease, worker_id="w", queues=["reports"]) == []
    (got,) = message_store.claim_messages(10, lease=lease, worker_id="w", queues=["emails"])
    assert (got.queue, got.channel, got.id) == ("emails", "default", int(emails.messages.get().id))


@pytest.mark.django_db
def test_a_task_moved_to_another_alias_of_this_backend_runs_and_reads_back_from_any(
    tasks_options: Any,
) -> None:
    # "default" takes only the default queue, "reports" only its own: the task is declared
    # for "default" and moved, so its message sits in a queue its own alias does not list
    tasks_options(QUEUES=["default"])
    finished = []

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        finished.append(task_result)

    with override_settings(
        TASKS={
            "default": {"BACKEND": FAIRQUEUE_BACKEND, "QUEUES": ["default"]},
            "reports": {"BACKEND": FAIRQUEUE_BACKEND, "QUEUES": ["reports"]},
        }
    ):
        moved = add.using(backend="reports", queue_name="reports").enqueue(2, 3)
        task_finished.connect(receiver)
        try:
            assert drain() == 1
        finally:
            task_finished.disconnect(receiver)
        assert [(r.status, r.task.backend, r.task.queue_name) for r in finished] == [
            (TaskResultStatus.SUCCESSFUL, "reports", "reports")
        ]
        for read in (
            task_backends["reports"].get_result(moved.id),
            task_backends["default"].get_result(moved.id),
            add.get_result(moved.id),
        ):
            assert (read.status, read.return_value) == (TaskResultStatus.SUCCESSFUL, 5)
            assert (read.task.backend, read.task.queue_name) == ("reports", "reports")
    # with no alias listing its queue any more, the row still reads back as it is
    read = task_backends["default"].get_result(moved.id)
    assert (read.status, read.task.backend, read.task.queue_name) == (
        TaskResultStatus.SUCCESSFUL,
        "default",
        "reports",
    )


@pytest.mark.django_db
def test_a_result_of_another_queue_reads_back_with_the_queue_it_ran_in(
    tasks_options: Any,
) -> None:
    tasks_options(QUEUES=[])
    emails = add.using(queue_name="emails").enqueue(2, 3)
    got = task_backends["default"].get_result(emails.id)
    assert (got.task.queue_name, got.task.channel, got.status) == (
        "emails",
        "default",
        TaskResultStatus.READY,
    )
    assert add.get_result(emails.id).task.queue_name == "emails"
    emails.refresh()
    assert emails.task.queue_name == "emails"
    assert drain() == 1
    emails.refresh()
    assert (emails.status, emails.return_value) == (TaskResultStatus.SUCCESSFUL, 5)
    # a task declared in a queue: its results read back, and report the queue the message
    # was in, not the one the task declares
    declared = task(queue_name="emails")(in_emails)
    first = declared.enqueue(3)
    assert declared.get_result(first.id).task.queue_name == "emails"
    moved = declared.using(queue_name="default", channel="acme").enqueue(4)
    assert row(moved.id).channel.name == "acme"
    got = declared.get_result(moved.id)
    assert (got.task.queue_name, got.task.channel) == ("default", "acme")


@pytest.mark.django_db
def test_a_queue_name_that_is_not_a_fairqueue_queue_is_refused(tasks_options: Any) -> None:
    tasks_options(QUEUES=[])
    with pytest.raises(InvalidTask, match="queue name"):
        add.using(queue_name="no spaces").enqueue(1, 1)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"CHANEL_FROM": "x.y"}, "unknown keys"),
        ({"DEFAULT_CHANNEL": ""}, "DEFAULT_CHANNEL"),
        ({"CHANNEL_FROM": len}, "dotted path"),
        ({"DELIVERY": "exactly_once"}, "DELIVERY"),
        ({"MAX_ATTEMPTS": 0}, "MAX_ATTEMPTS"),
        ({"TASK_TIMEOUT": -1}, r"TASK_TIMEOUT'\] must be a number of seconds"),
        ({"MAX_ATTEMPTS": 2**40}, "MAX_ATTEMPTS"),
    ],
)
def test_bad_options_are_reported_by_check_and_refused_at_every_use(
    options: dict[str, Any], message: str
) -> None:
    """Django's `check` builds every backend to ask for its checks: building one with bad
    OPTIONS reports them (fairqueue.E103), and every use raises the same words."""
    backend = FairQueueBackend("bad", {"OPTIONS": options})
    [error] = backend.check()
    assert error.id == "fairqueue.E103"
    assert re.search(message, error.msg), error.msg
    for use in (
        lambda: backend.enqueue(add, [1, 2], {}),
        lambda: backend.get_result("1"),
        lambda: backend.channel_for(add, [], {}),
    ):
        with pytest.raises(InvalidTaskBackend) as raised:
            use()
        assert str(raised.value) == error.msg


def test_a_default_channel_too_long_for_one_of_the_queues_is_check_e103() -> None:
    # 196 characters fit the default queue alone, not "emails" (the queue's name is added)
    options = {"DEFAULT_CHANNEL": "d" * 196}
    assert FairQueueBackend("ok", {"QUEUES": ["default"], "OPTIONS": options}).check() == []
    backend = FairQueueBackend("bad", {"QUEUES": ["default", "emails"], "OPTIONS": options})
    [error] = backend.check()
    assert error.id == "fairqueue.E103"
    assert "DEFAULT_CHANNEL" in error.msg and "too long for queue 'emails'" in error.msg
    with pytest.raises(InvalidTaskBackend, match="too long for queue 'emails'"):
        backend.enqueue(add, [1, 2], {})


@pytest.mark.django_db
def test_channel_from_that_cannot_be_imported_fails_check_and_enqueue(tasks_options: Any) -> None:
    tasks_options(OPTIONS={"CHANNEL_FROM": "tests.test_backend.no_such_function"})
    errors = task_backends["default"].check()
    assert [e.id for e in errors] == ["fairqueue.E102"]
    with pytest.raises(InvalidTaskBackend, match="cannot be imported"):
        add.enqueue(1, 2)


def test_channel_from_naming_a_module_is_reported_as_one(tmp_path: Any, monkeypatch: Any) -> None:
    """A module is not a callable: E102 says so, whether its package imports it or not."""
    package = tmp_path / "fq_shop"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "channels.py").write_text("def tenant(task, args, kwargs):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def errors(path: str) -> list[str]:
        backend = FairQueueBackend("shop", {"OPTIONS": {"CHANNEL_FROM": path}})
        return [f"{e.id}: {e.msg}" for e in backend.check()]

    try:
        module = re.escape("'fq_shop.channels' is a module, not a callable")
        [error] = errors("fq_shop.channels")  # not an attribute of its package yet
        assert re.match(rf"fairqueue.E102: .*{module}", error), error
        __import__("fq_shop.channels")
        [error] = errors("fq_shop.channels")  # now it is
        assert re.match(rf"fairqueue.E102: .*{module}", error), error
        assert errors("fq_shop.channels.tenant") == []
    finally:
        for name in ("fq_shop.channels", "fq_shop"):
            sys.modules.pop(name, None)


def test_check_requires_the_app() -> None:
    backend = task_backends["default"]
    assert backend.check() == []
    with mock.patch("django_fairqueue.backend.apps.is_installed", return_value=False):
        assert [e.id for e in backend.check()] == ["fairqueue.E101"]


# -- results through the lifecycle -----------------------------------------------------------


@pytest.mark.django_db
def test_get_result_follows_the_message_ready_running_successful() -> None:
    result = add.enqueue(20, 22)
    ready = add.get_result(result.id)
    assert ready.status == TaskResultStatus.READY
    assert (ready.started_at, ready.worker_ids, ready.attempts) == (None, [], 0)
    assert ready.enqueued_at == row(result.id).enqueued_at

    (claimed,) = message_store.claim_messages(1, lease=timedelta(minutes=1), worker_id="w-1")
    running = add.get_result(result.id)
    assert running.status == TaskResultStatus.RUNNING
    assert running.started_at == running.last_attempted_at == row(result.id).claimed_at
    assert (running.worker_ids, running.attempts) == (["w-1"], 1)
    with pytest.raises(ValueError, match="not finished"):
        running.return_value  # noqa: B018

    token = current_message.set(claimed)
    try:
        value = registry.get(claimed.task_name).func(*claimed.payload["args"])
    finally:
        current_message.reset(token)
    message_store.complete_messages([(claimed.id, claimed.lease_token, value)])
    result.refresh()  # Django's refresh() goes through get_result
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 42
    assert result.finished_at is not None and result.is_finished
    assert row(result.id).state == MessageState.SUCCEEDED  # kept for get_result until pruned


@pytest.mark.django_db
def test_successful_result_after_running_on_the_queue() -> None:
    results = [add.enqueue(i, i) for i in range(3)]
    assert drain() == 3
    for i, result in enumerate(results):
        fetched = add.get_result(result.id)
        assert (fetched.status, fetched.return_value) == (TaskResultStatus.SUCCESSFUL, 2 * i)


@pytest.mark.django_db
def test_failed_result_carries_the_error() -> None:
    with override_settings(FAIRQUEUE={"DEFAULT_MAX_ATTEMPTS": 1}):
        result = explode.enqueue()
    assert drain() == 1
    failed = explode.get_result(result.id)
    assert failed.status == TaskResultStatus.FAILED
    assert failed.is_finished and failed.finished_at is not None
    (error,) = failed.errors
    assert error.exception_class_path == "builtins.ValueError"
    assert error.exception_class is ValueError
    assert "boom" in error.traceback
    with pytest.raises(ValueError, match="failed"):
        failed.return_value  # noqa: B018


@pytest.mark.django_db
def test_arguments_that_do_not_fit_are_refused_or_fail_at_once_without_retries() -> None:
    with pytest.raises(TypeError, match="missing a required argument: 'b'"):
        add.enqueue(1)
    with pytest.raises(TypeError, match="too many positional arguments"):
        attempt_report.enqueue(1, 2)  # (the context is not counted)
    assert not Message.objects.exists()
    # What an older deploy queued for a signature that has changed since: failed, not retried.
    missing = add.enqueue(1, 2)
    Message.objects.filter(pk=int(missing.id)).update(payload={"args": [1], "kwargs": {}})
    fits = attempt_report.enqueue(fail_before=1)
    assert drain() == 2
    failed = task_backends["default"].get_result(missing.id)
    assert (failed.status, failed.attempts) == (TaskResultStatus.FAILED, 1)
    assert failed.errors[0].exception_class is TypeError
    assert attempt_report.get_result(fits.id).return_value == {"attempt": 1, "id": fits.id}


@pytest.mark.django_db
def test_error_types_that_are_not_importable_are_kept_as_recorded() -> None:
    result = add.enqueue(1, 2)
    (claimed,) = message_store.claim_messages(1, lease=timedelta(minutes=1), worker_id="w-1")
    error = {"type": "LeaseExpired", "message": "lease expired", "traceback": None}
    message_store.fail_messages([(claimed.id, claimed.lease_token, error, None)])
    (recorded,) = add.get_result(result.id).errors
    assert (recorded.exception_class_path, recorded.traceback) == ("LeaseExpired", "lease expired")


@pytest.mark.django_db
def test_cancelled_message_is_a_failed_result() -> None:
    result = add.enqueue(1, 2)
    message_store.cancel_messages([int(result.id)])
    assert add.get_result(result.id).status == TaskResultStatus.FAILED


@pytest.mark.django_db
def test_context_gives_the_attempt_and_result_id_and_retries_count() -> None:
    with override_settings(FAIRQUEUE={"DEFAULT_MAX_ATTEMPTS": 3, "RETRY_BACKOFF_BASE": 0}):
        result = attempt_report.enqueue(fail_before=2)
        assert drain() == 2  # attempt 1 fails and is retried at once, attempt 2 succeeds
    done = attempt_report.get_result(result.id)
    assert done.status == TaskResultStatus.SUCCESSFUL
    assert done.return_value == {"attempt": 2, "id": result.id}
    assert done.attempts == 2
    # the first attempt's error stays visible on the result
    assert "failing attempt 1" in done.errors[0].traceback


@pytest.mark.django_db
def test_async_task_runs_to_completion() -> None:
    result = async_double.enqueue(21)
    drain()
    assert async_double.get_result(result.id).return_value == 42


@pytest.mark.django_db
def test_return_value_is_normalised_json() -> None:
    result = pair.enqueue()
    drain()
    assert pair.get_result(result.id).return_value == [1, 2]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("kind", "returning", "why"),
    [
        ("set", returns_a_set, "(set) cannot be stored as JSON: Unsupported type: <class 'set'>"),
        ("nan", returns_nan, "(float) cannot be stored as JSON: Out of range float values"),
        (
            "keys",
            returns_int_keys,
            "(dict) cannot be stored as JSON: it has a dict key that is not a string (1)",
        ),
    ],
)
def test_a_return_value_that_is_not_json_fails_after_one_run_without_retries(
    kind: str, returning: Any, why: str
) -> None:
    UNSTORABLE_RUNS.pop(kind, None)
    finished = []

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        finished.append(task_result.status)

    task_finished.connect(receiver)
    try:
        with override_settings(FAIRQUEUE={"DEFAULT_MAX_ATTEMPTS": 3, "RETRY_BACKOFF_BASE": 0}):
            result = returning.enqueue()
            assert drain() == 1  # a retry would be ready at once, and drain() would run it
    finally:
        task_finished.disconnect(receiver)
    assert UNSTORABLE_RUNS[kind] == 1
    assert finished == [TaskResultStatus.FAILED]
    failed = returning.get_result(result.id)
    assert (failed.status, failed.attempts) == (TaskResultStatus.FAILED, 1)
    (error,) = failed.errors
    assert error.exception_class_path == "django_fairqueue.exceptions.ResultNotStorable"
    # readable: which task, the value's type, and why JSON cannot hold it
    assert f"the return value of {returning.module_path} {why}" in error.traceback
    assert "not retried" in error.traceback


@pytest.mark.django_db
def test_a_task_that_raises_a_base_exception_sends_task_finished_for_each_attempt() -> None:
    # the worker counts CancelledError (and KeyboardInterrupt, GeneratorExit) as a failed
    # attempt, retried while attempts remain: each attempt ends with its task_finished
    finished = []

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        finished.append((task_result.status, task_result.errors[-1].exception_class_path))

    task_finished.connect(receiver)
    try:
        with override_settings(FAIRQUEUE={"DEFAULT_MAX_ATTEMPTS": 2, "RETRY_BACKOFF_BASE": 0}):
            result = cancels_itself.enqueue()
            assert drain() == 2
    finally:
        task_finished.disconnect(receiver)
    assert finished == [(TaskResultStatus.FAILED, "asyncio.exceptions.CancelledError")] * 2
    assert cancels_itself.get_result(result.id).status == TaskResultStatus.FAILED


@pytest.mark.django_db
def test_get_result_of_unknown_ids_and_other_tasks() -> None:
    with pytest.raises(TaskResultDoesNotExist):
        add.get_result("999999999")
    with pytest.raises(TaskResultDoesNotExist):
        add.get_result("not-a-number")
    result = greet.enqueue("x")
    with pytest.raises(Exception, match="Task does not match"):
        add.get_result(result.id)


@pytest.mark.django_db
def test_get_result_refuses_messages_of_fairqueue_native_tasks() -> None:
    from django_fairqueue.api import enqueue

    message_id = enqueue("tests.backend.native", channel="x")
    with pytest.raises(TaskResultDoesNotExist, match=r"not a django\.tasks task"):
        task_backends["default"].get_result(str(message_id))


# -- signals and the runner ------------------------------------------------------------------


@pytest.mark.django_db
def test_running_sends_started_and_finished_and_a_bad_receiver_cannot_fail_it() -> None:
    seen = []

    def started(sender: Any, task_result: Any, **kwargs: Any) -> None:
        seen.append(("started", task_result.status, task_result.attempts))

    def finished(sender: Any, task_result: Any, **kwargs: Any) -> None:
        seen.append(("finished", task_result.status, task_result.return_value))
        raise RuntimeError("a broken receiver")

    task_started.connect(started)
    task_finished.connect(finished)
    try:
        result = add.enqueue(1, 2)
        drain()
    finally:
        task_started.disconnect(started)
        task_finished.disconnect(finished)
    assert seen == [
        ("started", TaskResultStatus.RUNNING, 1),
        ("finished", TaskResultStatus.SUCCESSFUL, 3),
    ]
    assert add.get_result(result.id).status == TaskResultStatus.SUCCESSFUL


def test_a_context_task_outside_a_worker_says_why_it_cannot_run() -> None:
    with pytest.raises(RuntimeError, match="only a fairqueue worker"):
        registry.get("tests.test_backend.attempt_report").func(fail_before=1)


@pytest.mark.skipif(django.VERSION < (6, 1), reason="Task pickling is new in Django 6.1")
def test_fairqueue_task_pickles_with_its_channel() -> None:
    bound = add.using(channel="alice", priority=3)
    assert pickle.loads(pickle.dumps(bound)) == bound


# -- transactional enqueue -------------------------------------------------------------------


def _count_elsewhere(database_url: str, message_id: str) -> int:
    """Rows with this id, as another connection sees them (committed data only)."""
    with psycopg.connect(database_url) as other:
        found = other.execute(
            "SELECT count(*) FROM fairqueue_message WHERE id = %s", [int(message_id)]
        ).fetchone()
    assert found is not None
    return int(found[0])


@pytest.mark.django_db(transaction=True)
def test_enqueue_inside_atomic_is_visible_at_commit(database_url: str) -> None:
    with transaction.atomic():
        result = add.enqueue(1, 2)
        assert _count_elsewhere(database_url, result.id) == 0  # not committed yet
    assert _count_elsewhere(database_url, result.id) == 1


@pytest.mark.django_db(transaction=True)
def test_rolled_back_enqueue_leaves_nothing(database_url: str) -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        result = add.enqueue(1, 2)
        raise RuntimeError("the view failed")
    assert _count_elsewhere(database_url, result.id) == 0
    with pytest.raises(TaskResultDoesNotExist):
        add.get_result(result.id)
    assert message_store.claim_messages(10, lease=timedelta(minutes=1), worker_id="w") == []


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_enqueue_leaves_the_channel_it_created_empty() -> None:
    """Inside a transaction a new channel is created and committed on a connection of its own
    (docs/explanation/fairness.md, lock order): the rollback takes the message, not the
    channel row."""
    with pytest.raises(RuntimeError), transaction.atomic():
        add.using(channel="rolled-back").enqueue(1, 2)
        raise RuntimeError("the view failed")
    assert not Message.objects.exists()
    channel = Channel.objects.get(name="rolled-back")
    assert not channel.messages.exists()


# -- time limits -----------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_task_past_the_task_timeout_option_ends_failed_with_the_timeout(
    tasks_options: Any,
) -> None:
    tasks_options(OPTIONS={"TASK_TIMEOUT": 0.3, "MAX_ATTEMPTS": 2})
    declared = task(stuck)  # registered now, under this backend's options
    name = declared.module_path
    assert registry.get(name).effective_timeout == 0.3
    RELEASE_STUCK.clear()
    finished: list[Any] = []

    def on_finished(sender: Any, task_result: Any, **kwargs: Any) -> None:
        finished.append(task_result.status)

    task_finished.connect(on_finished)
    worker = Worker(WorkerConfig(concurrency=1, listen=False, maintenance=False, worker_id="t"))
    thread = threading.Thread(target=lambda: (worker.run(), connections.close_all()))
    try:
        with override_settings(FAIRQUEUE={"RETRY_BACKOFF_BASE": 0, "POLL_INTERVAL": 0.2}):
            result = declared.enqueue()
            thread.start()
            deadline = time.monotonic() + 20
            while declared.get_result(result.id).status != TaskResultStatus.FAILED:
                assert time.monotonic() < deadline, "the task never timed out"
                time.sleep(0.05)
        failed = declared.get_result(result.id)
        assert failed.status == TaskResultStatus.FAILED
        assert failed.attempts == 2
        (error,) = failed.errors
        assert error.exception_class_path == "django_fairqueue.exceptions.TaskTimeout"
        assert error.exception_class is TaskTimeout
        assert f"task {name} exceeded its time limit of 0.3 s (attempt 2 of 2)" in error.traceback
        assert "RELEASE_STUCK.wait(1.0)" in error.traceback  # where it was stuck
        # (each attempt was written when its thread returned, its outcome discarded)
        deadline = time.monotonic() + 10
        while worker.ledger.stuck:
            assert time.monotonic() < deadline, "the stuck threads never returned"
            time.sleep(0.02)
        assert finished == []  # no task_finished for a timed-out attempt, even a late one
        assert declared.get_result(result.id).status == TaskResultStatus.FAILED
    finally:
        task_finished.disconnect(on_finished)
        worker.stop()
        thread.join(30)
        RELEASE_STUCK.set()
        registry.unregister(name)


@pytest.mark.skipif(
    django.VERSION[:2] == (6, 0), reason="Django 6.0's @task does not forward extra arguments"
)
def test_a_task_timeout_of_its_own_wins_over_the_option(tasks_options: Any) -> None:
    tasks_options(OPTIONS={"TASK_TIMEOUT": 30})
    declared = task(timeout=5)(stuck_briefly)
    try:
        assert declared.timeout == 5
        assert registry.get(declared.module_path).effective_timeout == 5
        assert declared.using(priority=3).timeout == 5
    finally:
        registry.unregister(declared.module_path)
    with pytest.raises(InvalidTask, match="timeout must be a number of seconds"):
        task(timeout="soon")(stuck_briefly)


# -- set-up mistakes, seen from a project of their own -----------------------------------------

_PROJECT_SETTINGS = """
import django
SECRET_KEY = "x"
USE_TZ = True
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", *{apps}]
if django.VERSION < (6, 0):
    INSTALLED_APPS.append("django_tasks")
DATABASES = {{"default": {{"ENGINE": "django.db.backends.postgresql", "NAME": "x",
                           "HOST": "127.0.0.1", "PORT": 9}}}}
TASKS = {{"default": {{"BACKEND": "{backend}", "OPTIONS": {options}}}}}
"""


def _in_project(
    tmp_path: Any, argv: list[str], *, apps: list[str], options: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    """Run Python with ``argv`` in a project of its own: a settings module (no database
    needed: `check` connects to none) and a tasks module."""
    import os

    (tmp_path / "proj_settings.py").write_text(
        _PROJECT_SETTINGS.format(apps=apps, backend=FAIRQUEUE_BACKEND, options=options)
    )
    (tmp_path / "proj_tasks.py").write_text(
        "from django_fairqueue.tasks.django_compat import task\n\n"
        "@task\ndef hello(name):\n    return name\n"
    )
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), root, *sys.path[1:]]),
        "DJANGO_SETTINGS_MODULE": "proj_settings",
    }
    return subprocess.run(
        [sys.executable, *argv],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_check_reports_the_backends_options_without_a_tasks_module_imported(
    tmp_path: Any,
) -> None:
    """Django registers its task checks when its tasks framework is first imported; the app
    imports it when TASKS uses this backend, so `check` sees a bad CHANNEL_FROM (on Django 6
    nothing else did before a task module was imported)."""
    out = _in_project(
        tmp_path,
        ["-m", "django", "check"],
        apps=["django_fairqueue"],
        options={"CHANNEL_FROM": "nowhere.x"},
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "fairqueue.E102" in out.stderr and "nowhere.x" in out.stderr


@pytest.mark.parametrize(
    "options",
    [{"MAX_ATTEMPTS": 0}, {"DELIVERY": "exactly_once"}, {"CHANEL_FROM": "x.y"}],
)
def test_check_reports_bad_options_as_an_error_not_a_traceback(
    tmp_path: Any, options: dict[str, Any]
) -> None:
    out = _in_project(
        tmp_path, ["-m", "django", "check"], apps=["django_fairqueue"], options=options
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "fairqueue.E103" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    # The task module imports (`check` may import it through the URLconf: that must not end
    # it in a traceback either), and the first enqueue raises the same words.
    used = _in_project(
        tmp_path,
        [
            "-c",
            "import django; django.setup()\nimport proj_tasks\nprint('imported')\n"
            "proj_tasks.hello.enqueue('x')",
        ],
        apps=["django_fairqueue"],
        options=options,
    )
    assert used.stdout == "imported\n", used.stdout + used.stderr
    last = used.stderr.strip().splitlines()[-1]
    assert last.startswith("django") and "InvalidTaskBackend" in last, used.stderr
    message = last.split(": ", 1)[1]
    assert message in out.stderr


def test_without_the_app_task_modules_import_and_the_first_use_says_what_is_missing(
    tmp_path: Any,
) -> None:
    script = (
        "import django; django.setup()\n"
        "import proj_tasks\n"  # the decorator validates the task: no import of the models
        "from django.core.management import call_command\n"
        "try:\n"
        "    proj_tasks.hello.enqueue('x')\n"
        "except Exception as exc:\n"
        "    print('ENQUEUE', type(exc).__name__, exc)\n"
        "call_command('check')\n"
    )
    out = _in_project(tmp_path, ["-c", script], apps=[], options={"DEFAULT_CHANNEL": "acme"})
    assert "ENQUEUE InvalidTaskBackend" in out.stdout, out.stdout + out.stderr
    assert "INSTALLED_APPS" in out.stdout
    assert "fairqueue.E101" in out.stderr


@pytest.mark.django_db
def test_tuple_arguments_are_normalised_as_djangos_own_backends_do() -> None:
    result = greet.enqueue(("a", "b"), tenant=None)  # type: ignore[arg-type]
    assert result.args == [["a", "b"]]
    assert Message.objects.get(pk=result.id).payload["args"] == [["a", "b"]]
    with pytest.raises(PayloadError, match="not JSON"):
        greet.enqueue({1, 2})  # type: ignore[arg-type]


@task(backend="immediate")
def declared_elsewhere(x: int) -> int:
    return x + 1


def test_a_task_of_another_kind_of_backend_is_refused_when_moved_here() -> None:
    """Workers import the module, where the task belongs to the other backend: they could not
    run it, so moving it here is refused, not queued to fail later."""
    with pytest.raises(InvalidTask, match="declared for backend 'immediate'"):
        declared_elsewhere.using(backend="default")
    assert add.using(backend="default").backend == "default"  # one of ours moves freely


@pytest.mark.django_db
def test_arguments_nested_too_deeply_raise_payload_error_and_store_nothing() -> None:
    deep: Any = 1
    for _ in range(1000):
        deep = [deep]
    with pytest.raises(PayloadError, match="nested too deeply"):
        add.enqueue(deep, 1)
    circular: list[Any] = []
    circular.append(circular)
    with pytest.raises(PayloadError, match="nested too deeply"):
        add.enqueue(1, b=circular)
    assert not Message.objects.exists()


@pytest.mark.django_db
def test_a_kept_unique_enqueue_returns_the_result_of_the_message_it_names() -> None:
    later = timezone.now() + timedelta(hours=1)
    held = add.using(unique_key="k", priority=5, run_after=later).enqueue(1, 2)
    kept = add.using(unique_key="k").enqueue(3, b=4)
    assert kept.id == held.id
    assert (kept.args, kept.kwargs, kept.status) == ([1, 2], {}, TaskResultStatus.READY)
    assert (kept.task.priority, kept.task.run_after) == (5, later)
    # a running holder of scope "active" is kept, not replaced: the result says so
    active = {"unique_key": "r", "unique_scope": "active"}
    running = add.using(**active).enqueue(1, 1)
    message_store.claim_messages(1, lease=timedelta(minutes=1), worker_id="w-1")
    answer = add.using(**active, on_conflict="replace", priority=9).enqueue(7, 7)
    assert answer.id == running.id
    assert (answer.args, answer.status, answer.task.priority) == (
        [1, 1],
        TaskResultStatus.RUNNING,
        0,
    )
    # a waiting holder replaced in place: the call's arguments, the holder's id
    replaced = add.using(unique_key="k", on_conflict="replace").enqueue(8, 8)
    assert (replaced.id, replaced.args, replaced.task.priority) == (held.id, [8, 8], 0)
    # what get_result says of that id (refresh() does not correct args, kwargs or the task)
    assert answer == add.get_result(running.id)
    assert replaced == add.get_result(held.id)


@pytest.mark.parametrize("priority", [True, False])
def test_a_bool_priority_is_refused_by_validation(priority: bool) -> None:
    with pytest.raises(InvalidTask, match=f"priority must be an integer, got {priority}"):
        add.using(priority=priority)

"""Settings checked at start-up by the system checks and at first use, in the same words: the
bounds of values the database or Python could not hold, every bad entry its own error, the
queue's database (fairqueue.E002, E003, E007) and the routers' hint (W003), the metrics'
setting, and code schedules whose arguments do not fit their task."""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import connections
from django.test import override_settings

from django_fairqueue import checks, conf, cron, maintenance
from django_fairqueue.exceptions import InvalidSchedule
from django_fairqueue.limits import MAX_LIMIT, MAX_RETENTION, MAX_RETRY_DELAY
from django_fairqueue.models import Message
from tests import fairtasks

ROUTER = "django_fairqueue.routers.QueueRouter"


def e001(raw: dict[str, Any]) -> list[str]:
    """The messages of the fairqueue.E001 errors the check gives for ``raw``."""
    with override_settings(FAIRQUEUE=raw):
        errors = checks.check_settings()
    assert {e.id for e in errors} == {"fairqueue.E001"}, errors
    return [e.msg.removeprefix("Invalid FAIRQUEUE setting: ") for e in errors]


# -- bounds: what passed the check and then failed in the database or in Python ------------------


@pytest.mark.parametrize("key", ["RETRY_BACKOFF_BASE", "RETRY_BACKOFF_MAX"])
def test_a_retry_delay_past_a_year_is_check_e001(key: str) -> None:
    (message,) = e001({key: 10**12})
    assert message == (
        f"FAIRQUEUE['{key}'] must be at most 31536000 seconds (365 days), got 1000000000000"
    )
    most = MAX_RETRY_DELAY.total_seconds()
    assert getattr(conf.load({key: most}), key) == most


@pytest.mark.django_db
def test_default_max_attempts_is_bounded_as_a_tasks_own() -> None:
    (message,) = e001({"DEFAULT_MAX_ATTEMPTS": 2**31})
    assert message.startswith(f"FAIRQUEUE['DEFAULT_MAX_ATTEMPTS'] must be at most {MAX_LIMIT}")
    # the most is what the messages' column holds: an enqueue with it goes through
    with override_settings(FAIRQUEUE={"DEFAULT_MAX_ATTEMPTS": MAX_LIMIT}):
        mid = fairtasks.record.enqueue("x")
    assert Message.objects.get(pk=mid).max_attempts == MAX_LIMIT


@pytest.mark.parametrize("key", ["RESULT_RETENTION", "USAGE_RETENTION", "BATCH_RETENTION"])
@pytest.mark.parametrize("value", [timedelta.max, 10**12])
def test_a_retention_past_a_century_is_check_e001(key: str, value: Any) -> None:
    (message,) = e001({key: value})
    assert message.startswith(
        f"FAIRQUEUE['{key}'] must be from 0 to 3153600000 seconds (36500 days): the most keeps "
        "rows for ever in practice; got "
    )


@pytest.mark.django_db
def test_the_pruners_run_with_the_longest_retention() -> None:
    most = {k: MAX_RETENTION for k in ("RESULT_RETENTION", "USAGE_RETENTION", "BATCH_RETENTION")}
    with override_settings(FAIRQUEUE=most):
        for pruner in (maintenance.Pruner(), maintenance.StatsPruner(), maintenance.BatchPruner()):
            pruner.run_once()  # now minus a century is a date both Python and PostgreSQL hold


# -- every bad entry its own error, in words that say what is wanted ------------------------------


def test_each_bad_channel_default_is_its_own_e001() -> None:
    raw = {
        "CHANNEL_DEFAULTS": {
            "max_concurrency": 0,
            "weight": 2.5,
            "release_interval": -1,
            "max_backlog": 0,
            "cap": 3,
        }
    }
    where = "FAIRQUEUE['CHANNEL_DEFAULTS']"
    assert e001(raw) == [
        f"{where} has unknown keys ['cap']",
        f"{where} max_backlog must be an integer >= 1, got 0",
        f"{where} max_concurrency must be an integer >= 1, got 0",
        f"{where} release_interval must be from 0 to 86400 seconds (1 day), got -1 seconds",
        f"{where} weight must be an integer >= 1, got 2.5",
    ]
    with pytest.raises(conf.SettingsError) as info:
        conf.load(raw)
    assert len(info.value.problems) == 5


def test_values_are_named_in_seconds_and_what_is_wanted_is_said() -> None:
    with pytest.raises(ValueError, match=r"^channel release_interval must be from 0 to 86400 "):
        conf.validate_channel_limits(release_interval=timedelta(seconds=-1))
    with pytest.raises(InvalidSchedule) as info:
        cron.validate_jitter(-5, "schedule 'x'")
    assert str(info.value) == (
        "schedule 'x': jitter must be a number of seconds or a timedelta from 0 to 86400 "
        "seconds (1 day), got -5 seconds"
    )
    assert e001({"RETRY_BACKOFF_BASE": math.inf}) == [
        "FAIRQUEUE['RETRY_BACKOFF_BASE'] must be a number >= 0.0 (a finite one), got inf"
    ]
    (message,) = e001({"NOTIFY_CHANNEL": "1abc"})
    assert "a letter or _ first, then letters, digits or _" in message


# -- the queue's database: the check's message at first use too ----------------------------------


@pytest.fixture
def sqlite_alias() -> Iterator[str]:
    """A DATABASES alias that is not PostgreSQL (added in place: overriding DATABASES is not
    supported by Django's test tools)."""
    alias = "lite"
    lite = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}
    config = connections.configure_settings({"default": lite, alias: lite})[alias]
    connections.settings[alias] = config  # (the same dict as settings.DATABASES)
    assert alias in settings.DATABASES
    try:
        yield alias
    finally:
        del connections.settings[alias]
        del connections[alias]


def check_and_first_use(
    fairqueue: dict[str, Any], routers: list[str] | None = None
) -> tuple[list[Any], str]:
    """The check's errors and what the first enqueue raises, under these settings."""
    with override_settings(FAIRQUEUE=fairqueue, DATABASE_ROUTERS=routers or []):
        errors = [e for e in checks.check_settings() if e.is_serious()]
        with pytest.raises(ImproperlyConfigured) as info:
            fairtasks.record.enqueue("x")
    return errors, str(info.value)


@pytest.mark.django_db
def test_a_database_alias_that_is_missing_is_e002_at_check_and_at_first_use() -> None:
    (error,), raised = check_and_first_use({"DATABASE": "nope"})
    assert error.id == "fairqueue.E002"
    assert raised == error.msg == "FAIRQUEUE['DATABASE'] is 'nope', which is not in DATABASES."


@pytest.mark.django_db
def test_a_database_that_is_not_postgresql_is_e003_at_check_and_at_first_use(
    sqlite_alias: str,
) -> None:
    (error,), raised = check_and_first_use({"DATABASE": sqlite_alias}, [ROUTER])
    assert error.id == "fairqueue.E003"
    assert raised == error.msg == "django-fairqueue needs PostgreSQL; database 'lite' is sqlite."


@pytest.mark.django_db
def test_a_database_the_orm_is_not_routed_to_is_e007_at_check_and_at_first_use() -> None:
    # ("pooled" is a second alias of the test database)
    (error,), raised = check_and_first_use({"DATABASE": "pooled"})
    assert error.id == "fairqueue.E007"
    assert raised == f"{error.msg} {error.hint}"
    assert f"Add '{ROUTER}' to DATABASE_ROUTERS" in raised
    with override_settings(FAIRQUEUE={"DATABASE": "pooled"}, DATABASE_ROUTERS=[ROUTER]):
        assert conf.get().DATABASE == "pooled"


@pytest.mark.parametrize("options", [[], ["--no-listen"]])
def test_the_worker_says_so_without_its_checks(options: list[str]) -> None:
    with (
        override_settings(FAIRQUEUE={"DATABASE": "nope"}),
        pytest.raises(CommandError, match=r"^FAIRQUEUE\['DATABASE'\] is 'nope', which is not in"),
    ):
        call_command("runfairworker", "--burst", *options, skip_checks=True)


class ReadsElsewhere:
    """A router that reads the queue's models from another alias (as from a replica)."""

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return "pooled"


class WritesDefault:
    """A router that sends every write to ``default``."""

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return "default"


def test_use_tz_false_is_no_problem_to_warn_of() -> None:
    """The admin and ``manage.py fairqueue`` work without time-zone support
    (tests/test_use_tz_false.py): no check warns of it."""
    with override_settings(USE_TZ=False, TIME_ZONE="America/New_York"):
        assert checks.check_settings() == []


def test_the_routers_hint_names_a_router_listed_before_the_queues() -> None:
    here = __name__
    with override_settings(DATABASE_ROUTERS=[f"{here}.ReadsElsewhere", ROUTER]):
        (warning,) = checks.check_settings()
    assert warning.id == "fairqueue.W003"
    assert (
        f"Move '{ROUTER}' before '{here}.ReadsElsewhere' in DATABASE_ROUTERS "
        f"('{here}.ReadsElsewhere' answers first for django-fairqueue's models)"
    ) in (warning.hint or "")
    with override_settings(
        FAIRQUEUE={"DATABASE": "pooled"}, DATABASE_ROUTERS=[f"{here}.WritesDefault", ROUTER]
    ):
        (error,) = checks.check_settings()
    assert error.id == "fairqueue.E007"
    assert f"Move '{ROUTER}' before '{here}.WritesDefault'" in (error.hint or "")
    assert error.hint.endswith("then run `manage.py migrate --database pooled`.")
    # without the queue's router: add it before the router answering first, or change that
    # one; the queue's database being "default", nothing to migrate
    with override_settings(DATABASE_ROUTERS=[f"{here}.ReadsElsewhere"]):
        (warning,) = checks.check_settings()
    assert warning.hint == (
        f"Intended for a replica; otherwise: Add '{ROUTER}' before '{here}.ReadsElsewhere' in "
        f"DATABASE_ROUTERS ('{here}.ReadsElsewhere' answers first for django-fairqueue's "
        f"models), or have '{here}.ReadsElsewhere' return None for them."
    )


# -- the metrics' bound ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (-1, "FAIRQUEUE_METRICS_MAX_CHANNELS must be 1 to 2147483647, got -1"),
        (0, "FAIRQUEUE_METRICS_MAX_CHANNELS must be 1 to 2147483647, got 0"),
        ("10", "FAIRQUEUE_METRICS_MAX_CHANNELS must be an integer, got '10'"),
    ],
)
def test_a_bad_metrics_channel_bound_is_e001_and_refused_at_first_use(
    value: Any, words: str
) -> None:
    with override_settings(FAIRQUEUE_METRICS_MAX_CHANNELS=value):
        (error,) = checks.check_settings()
        with pytest.raises(ImproperlyConfigured) as info:
            conf.metrics_max_channels()
    assert error.id == "fairqueue.E001"
    assert error.msg == f"Invalid FAIRQUEUE_METRICS_MAX_CHANNELS setting: {words}"
    assert str(info.value) == words
    with override_settings(FAIRQUEUE_METRICS_MAX_CHANNELS=3):
        assert checks.check_settings() == [] and conf.metrics_max_channels() == 3


# -- code schedules whose arguments do not fit their task -----------------------------------------


def test_a_schedule_of_a_channel_no_enqueue_takes_is_e006_and_the_others_stand() -> None:
    add = fairtasks.add.name
    raw = {
        "TASK_MODULES": ["tests.fairtasks"],
        "SCHEDULES": {
            "blanks": {"task": add, "cron": "@daily", "args": [1, 2], "channel": " x"},
            "separator": {"task": add, "cron": "@daily", "args": [1, 2], "channel": "a\x1fb"},
            "good": {"task": add, "cron": "@daily", "args": [1, 2], "channel": "acme"},
        },
    }
    with override_settings(FAIRQUEUE=raw):
        errors = checks.check_settings()
        assert conf.get().SCHEDULES  # the settings themselves load
    assert [e.id for e in errors] == ["fairqueue.E006"] * 2
    assert "['blanks']" in errors[0].msg and "blanks" in errors[0].msg.split(":", 1)[1]
    assert "['separator']" in errors[1].msg and "U+001F" in errors[1].msg


def test_each_schedule_whose_arguments_do_not_fit_its_task_is_e006() -> None:
    add = fairtasks.add.name
    raw = {
        "TASK_MODULES": ["tests.fairtasks"],
        "SCHEDULES": {
            "too_many": {"task": add, "cron": "@daily", "args": [1, 2, 3]},
            "good": {"task": add, "cron": "@daily", "args": [1, 2]},
            "unknown_kwarg": {"task": add, "cron": "@daily", "args": [1, 2], "kwargs": {"c": 1}},
        },
    }
    with override_settings(FAIRQUEUE=raw):
        errors = checks.check_settings()
    assert [e.id for e in errors] == ["fairqueue.E006"] * 2
    fits = f"arguments do not fit {add}(a: 'int', b: 'int') -> 'int': "
    assert (
        errors[0].msg == f"FAIRQUEUE['SCHEDULES']['too_many']: {fits}too many positional arguments"
    )
    assert errors[1].msg.startswith(f"FAIRQUEUE['SCHEDULES']['unknown_kwarg']: {fits}")
    assert errors[0].hint

"""Infrastructure faults cost no attempt: errors classed as the database being unavailable
(real ones, from a real server or a refused connection) give the message back without using
an attempt, after a short delay; warnings about one cause are rate-limited."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connections
from django.db.utils import DatabaseErrorWrapper
from django.utils import timezone
from psycopg.conninfo import make_conninfo

from django_fairqueue.models import Message
from django_fairqueue.runtime import dbfaults
from django_fairqueue.tasks import task
from django_fairqueue.worker import Worker, WorkerConfig
from tests.factories import assert_counters_match_table

#: Nothing listens on port 9 (discard) of the loopback: connecting is refused at once.
REFUSED = "postgresql://postgres@127.0.0.1:9/nothing?connect_timeout=3"


def _refuse() -> None:
    """Connect where the connection is refused, seen through Django's wrapper as a task using
    a database alias of its own would see it (``django.db.OperationalError``)."""
    with DatabaseErrorWrapper(connections["default"]):
        psycopg.connect(REFUSED)


@task(name="tests.dbfaults.refused", max_attempts=2)
def refused() -> None:
    _refuse()


@task(name="tests.dbfaults.refused_once", delivery="at_most_once")
def refused_at_most_once() -> None:
    _refuse()


@task(name="tests.dbfaults.bug", max_attempts=2)
def bug() -> None:
    raise ValueError("a bug in the task")


def _raised(action: Callable[[], Any]) -> BaseException:
    try:
        action()
    except BaseException as exc:
        return exc
    raise AssertionError("nothing raised")


def test_a_refused_connection_is_unavailability() -> None:
    assert dbfaults.unavailable(_raised(lambda: psycopg.connect(REFUSED))) == "connection failed"
    wrapped = _raised(_refuse)  # django.db.OperationalError from psycopg's
    assert type(wrapped).__module__ == "django.db.utils"
    assert dbfaults.unavailable(wrapped) == "connection failed"
    # raised while handling it, as a task's own except clause would: still seen
    try:
        try:
            _refuse()
        except DatabaseError as exc:
            raise RuntimeError("could not save the report") from exc
    except RuntimeError as outer:
        assert dbfaults.unavailable(outer) == "connection failed"


def test_server_errors_of_an_outage_are_unavailability(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as victim:
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [victim.info.backend_pid])
        # the server's FATAL 57P01 reaches the next statement
        assert dbfaults.unavailable(_raised(lambda: victim.execute("SELECT 1"))) in (
            "admin shutdown",
            "connection failed",  # when the socket's close is read before the message
        )
    with psycopg.connect(database_url) as conn:
        conn.execute("SET TRANSACTION READ ONLY")  # as a demoted primary, a hot standby
        exc = _raised(lambda: conn.execute("CREATE TEMPORARY TABLE t (i int)"))
        assert exc.sqlstate == "25006"  # type: ignore[attr-defined]
        assert dbfaults.unavailable(exc) == "read-only transaction"


def test_errors_of_the_task_are_not_unavailability(database_url: str) -> None:
    assert dbfaults.unavailable(ValueError("bug")) is None
    with psycopg.connect(database_url) as conn:
        conn.execute("SET statement_timeout = 1")
        timeout = _raised(lambda: conn.execute("SELECT pg_sleep(1)"))
        assert isinstance(timeout, psycopg.OperationalError)  # 57014: the task's own limit
        assert dbfaults.unavailable(timeout) is None
    with psycopg.connect(database_url) as conn:
        bad = _raised(lambda: conn.execute("SELECT 1 / 0"))
        assert dbfaults.unavailable(bad) is None


def test_settings_the_server_refuses_are_not_an_outage(database_url: str) -> None:
    """A database or role that does not exist, a password refused: waiting will not end these,
    so they are not unavailability, and a worker stops at once instead of waiting for ever."""
    missing_db = make_conninfo(database_url, dbname="fq_no_such_database", connect_timeout=3)
    missing_role = make_conninfo(database_url, user="fq_no_such_role", connect_timeout=3)
    exc = _raised(lambda: psycopg.connect(missing_db))
    assert dbfaults.misconfigured(exc) == 'database "fq_no_such_database" does not exist'
    wrapped = _raised(lambda: _connect_wrapped(missing_role))
    assert dbfaults.misconfigured(wrapped) == 'role "fq_no_such_role" does not exist'
    assert dbfaults.misconfigured(_raised(lambda: psycopg.connect(REFUSED))) is None
    assert dbfaults.misconfigured(ValueError("bug")) is None


def test_a_worker_whose_database_refuses_its_settings_stops_with_the_reason(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django_fairqueue.management.commands import runfairworker

    missing_db = make_conninfo(database_url, dbname="fq_no_such_database", connect_timeout=3)
    monkeypatch.setattr(
        runfairworker, "_require_migrated_now", lambda: _connect_wrapped(missing_db)
    )
    with pytest.raises(CommandError, match='database "fq_no_such_database" does not exist'):
        call_command("runfairworker", "--burst", "--no-maintenance")
    # an outage is still waited out (the worker checks again once the database answers)
    monkeypatch.setattr(runfairworker, "_require_migrated_now", lambda: _connect_wrapped(REFUSED))
    assert runfairworker._require_migrated() is False


@pytest.mark.django_db(transaction=True)
def test_a_pooler_that_mixes_prepared_statements_is_named_with_the_setting_to_change() -> None:
    """Behind PgBouncer in transaction mode (before 1.21), a server session holds the prepared
    statements of whichever client used it: the next client's first one collides."""
    from django.db import ProgrammingError, connection

    from django_fairqueue.db import message_store

    connection.close()
    connection.ensure_connection()
    try:
        # another client's statement on this server session, named as psycopg names its first
        connection.connection.execute("PREPARE _pg3_0 AS SELECT 1", prepare=False)
        with pytest.raises(ProgrammingError, match=r"PREPARED_STATEMENTS'\] = False"):
            message_store.select_next_due(timedelta(seconds=1), rescuing=False)  # prepared
    finally:
        connection.close()


@pytest.mark.parametrize(
    ("url", "said"),
    [
        (REFUSED, "Connection refused"),  # the server down
        (None, 'database "fq_no_such_database" does not exist'),  # a setting wrong
    ],
)
def test_commands_say_when_the_database_cannot_be_reached(
    database_url: str, url: str | None, said: str
) -> None:
    """`fairqueue status` (and every command of the product) with the database down or named
    wrong: one line saying so, exit 1, no traceback."""
    from tests.test_example_project import run_manage

    url = url or urlsplit(database_url)._replace(path="/fq_no_such_database").geturl()
    for command in ("status", "workers"):
        done = run_manage(url, "fairqueue", command)
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith("CommandError: cannot reach the queue's database ('default')")
        assert said in done.stderr


def _connect_wrapped(url: str) -> None:
    with DatabaseErrorWrapper(connections["default"]):
        psycopg.connect(url)


@pytest.mark.django_db
def test_a_task_cut_short_by_an_outage_is_given_back_without_an_attempt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ids = [refused.enqueue(channel="outage") for _ in range(4)]
    failing = bug.enqueue(channel="outage")
    before = timezone.now()
    worker = Worker(WorkerConfig(concurrency=5, batch_size=5, maintenance=False))
    with caplog.at_level(logging.WARNING, logger="django_fairqueue.worker"):
        # one handled: a message given back is not counted as handled (as a release)
        assert worker.run_once() == 1
    for m in Message.objects.filter(pk__in=ids):
        assert m.state == "scheduled", m.state
        assert m.attempts == 0  # the attempt was given back
        assert m.lease_token is None and m.worker_id == ""
        # back after GIVE_BACK_DELAY (jittered 50-100 %), on the database's clock
        assert before + timedelta(seconds=dbfaults.GIVE_BACK_DELAY * 0.5) <= m.run_at
        assert m.run_at <= timezone.now() + timedelta(seconds=dbfaults.GIVE_BACK_DELAY)
    # a task's own error still costs its attempt
    assert Message.objects.get(pk=failing).attempts == 1
    assert_counters_match_table()
    # four given back, one line: the others are folded into the next one about the cause
    lines = [r.getMessage() for r in caplog.records if "gave back" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "the database is unavailable" in lines[0] and "Connection refused" in lines[0]


@pytest.mark.django_db
def test_an_at_most_once_task_cut_short_by_an_outage_fails_and_never_runs_again() -> None:
    """It may have done its work (sent the mail) before the database went away."""
    mid = refused_at_most_once.enqueue(channel="outage")
    assert Worker(WorkerConfig(concurrency=1, maintenance=False)).run_once() == 1
    row = Message.objects.get(pk=mid)
    assert (row.state, row.attempts) == ("failed", 1)
    assert "Connection refused" in row.last_error["message"]
    assert_counters_match_table()


def test_warnings_are_rate_limited_per_cause(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("tests.dbfaults")
    clock = [100.0]
    warnings = dbfaults.RateLimitedWarnings(logger, every=10.0)
    with (
        caplog.at_level(logging.WARNING, logger="tests.dbfaults"),
        pytest.MonkeyPatch.context() as mp,
    ):
        mp.setattr(dbfaults.time, "monotonic", lambda: clock[0])
        assert warnings.warning("too many connections", "refused %s", 1)
        for i in range(40):
            clock[0] += 0.1
            assert not warnings.warning("too many connections", "refused %s", i)
        assert warnings.warning("admin shutdown", "shut down")  # another cause: logged
        clock[0] += 10.0
        assert warnings.warning("too many connections", "refused %s", "again")
    assert [r.getMessage() for r in caplog.records] == [
        "refused 1",
        "shut down",
        "refused again (and 40 more like it in the last 14s)",
    ]

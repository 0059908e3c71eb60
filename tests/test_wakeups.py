"""The wake-up listener checks itself after LISTEN: on a direct connection its own probe
arrives and the registry says ``notify``; where none arrives (here: a connection whose LISTEN
was lost, as behind a transaction pooler; tests/faults/test_pooler.py runs real workers behind
PgBouncer) it logs why, the registry says ``polling: ...`` and ``fairqueue workers`` shows it."""

from __future__ import annotations

import io
import logging

import psycopg
import pytest
from django.core.management import call_command

from django_fairqueue.db import message_store
from django_fairqueue.runtime import worker_registry
from django_fairqueue.worker import wakeups

pytestmark = pytest.mark.django_db(transaction=True)  # the probe comes from another connection

CHANNEL = "fairqueue_probe_test"


@pytest.fixture
def registered() -> str:
    worker_registry.Registration("checker", concurrency=1).register()
    return "checker"


def _wakeups(worker_id: str) -> str:
    (view,) = [v for v in worker_registry.workers() if v.worker_id == worker_id]
    return view.wakeups


def test_a_listener_that_receives_records_notify(database_url: str, registered: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        message_store.listen_wakeups(conn, CHANNEL)
        assert wakeups.confirm(conn, CHANNEL, registered, wait=5.0)
    assert _wakeups(registered) == "notify"
    out = io.StringIO()
    call_command("fairqueue", "workers", stdout=out)
    row = next(line for line in out.getvalue().splitlines() if line.startswith("checker"))
    assert out.getvalue().split("\n", 1)[0].split()[-2:] == ["WAKEUPS", "RESTARTS"]
    assert row.split()[-2:] == ["notify", "-"]  # not started by a supervisor


def test_a_listener_that_receives_nothing_polls_and_says_why(
    database_url: str, registered: str, caplog: pytest.LogCaptureFixture
) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        message_store.listen_wakeups(conn, CHANNEL)
        # as behind a transaction pooler: the server session that ran LISTEN is not this one
        # any more by the time a notification is sent
        conn.execute("UNLISTEN *")
        with caplog.at_level(logging.WARNING, logger="django_fairqueue.worker"):
            assert not wakeups.confirm(conn, CHANNEL, registered, wait=0.5)
    (line,) = [r.getMessage() for r in caplog.records if "LISTEN does not work" in r.getMessage()]
    assert "no notification arrived within 0.5s" in line and "--no-listen" in line
    recorded = _wakeups(registered)
    assert recorded.startswith("polling: no notification arrived within 0.5s")
    out = io.StringIO()
    call_command("fairqueue", "workers", stdout=out)
    text = out.getvalue()
    row = next(line for line in text.splitlines() if line.startswith("checker"))
    assert row.split()[-2:] == ["polling", "-"]
    assert "checker polls for new messages: no notification arrived" in text
    out = io.StringIO()
    call_command("fairqueue", "workers", "--json", stdout=out)
    assert '"wakeups": "polling: no notification arrived' in out.getvalue()


def test_only_its_own_probe_counts(
    database_url: str, registered: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        message_store.listen_wakeups(conn, CHANNEL)
        real = message_store.notify_probe
        # an enqueue's wake-up and another worker's probe arrive, its own does not (behind a
        # pooler, its own may reach another client): not a working LISTEN
        monkeypatch.setattr(
            message_store,
            "notify_probe",
            lambda channel, payload, using=None: (
                real(channel, "an enqueue wake-up", using=using),
                real(channel, "fairqueue probe other 0123456789abcdef", using=using),
            ),
        )
        assert not wakeups.confirm(conn, CHANNEL, registered, wait=0.5)
        monkeypatch.setattr(message_store, "notify_probe", real)
        assert wakeups.confirm(conn, CHANNEL, registered, wait=5.0)

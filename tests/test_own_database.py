"""The queue in a database of its own: ``FAIRQUEUE['DATABASE']`` names another alias, and
``django_fairqueue.routers.QueueRouter`` sends the queue's models there. Migrated with
``migrate --database queue``, the queue enqueues, runs, lists in the admin and reports in
``fairqueue status`` from that database while the project's own tables (users, sessions)
stay in ``default``; nothing of the queue is written to ``default``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from tests.workerkit import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def queue_db(database_url: str) -> Iterator[tuple[str, str]]:
    """(name, URL) of a fresh database on the test server for the queue alone."""
    parts = urlsplit(database_url)
    name = parts.path.lstrip("/") + "_queue"
    admin_url = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name, urlunsplit(parts._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _django(database_url: str, queue_name: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": database_url, "FAIRQUEUE_QUEUE_DB": queue_name},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_the_queue_in_a_database_of_its_own(database_url: str, queue_db: tuple[str, str]) -> None:
    name, url = queue_db
    _django(
        database_url,
        name,
        *("-m", "django", "migrate", "--database", "queue"),
        *("--settings", "tests.owndb_settings", "-v", "0"),
    )
    seen = json.loads(_django(database_url, name, "-m", "tests.owndb_probe").splitlines()[-1])
    assert seen["ran"] == 12 and seen["succeeded"] == 12, seen
    assert seen["message_db"] == "queue"
    assert seen["channels"] == ["own-0", "own-1", "own-2"]
    assert seen["admin_status"] == 200 and seen["admin_lists_them"], seen
    assert seen["status_channels"] == 3
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT count(*) FROM fairqueue_message").fetchone() == (12,)
    with psycopg.connect(database_url) as conn:
        # the project's tables are in default (the admin's user), the queue's rows are not
        assert conn.execute(
            "SELECT count(*) FROM auth_user WHERE username = 'own-admin'"
        ).fetchone() == (1,)
        assert conn.execute("SELECT count(*) FROM fairqueue_message").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM fairqueue_channel").fetchone() == (0,)

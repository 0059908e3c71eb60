"""The example project's upload page, as a visitor uses it: in a process of its own, on a
database of its own (the project's settings and apps are not the tests')."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

PROJECT = Path(__file__).resolve().parent.parent / "example_project"

# Posts an upload through Django's test client and prints the status, the form's errors on the
# tenant field and how many documents are stored.
VISIT = """
from django.test import Client
from django.test.utils import setup_test_environment
from documents.models import Document
setup_test_environment()
response = Client().post("/upload/", {"tenant": TENANT, "title": "t1"})
errors = list(response.context["form"].errors.get("tenant", [])) if response.context else []
print(repr((response.status_code, errors, Document.objects.count())))
"""


@pytest.fixture
def example_database(database_url: str) -> Iterator[str]:
    server, _, name = database_url.rpartition("/")
    own = f"{name}_example"
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{own}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{own}"')
    url = f"{server}/{own}"
    _manage(url, "migrate", "-v", "0")
    yield url
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{own}" WITH (FORCE)')


def run_manage(database_url: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``manage.py ARGV`` of the example project, on the database of ``database_url``."""
    env = {**os.environ, "DATABASE_URL": database_url}
    env.pop("DJANGO_SETTINGS_MODULE", None)  # the project's own
    return subprocess.run(
        [sys.executable, str(PROJECT / "manage.py"), *argv],
        env=env,
        cwd=PROJECT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _manage(database_url: str, *argv: str) -> str:
    done = run_manage(database_url, *argv)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize(
    ("tenant", "status", "error", "stored"),
    [
        ("acme", 302, None, 1),
        # a name the queue refuses: the form says why, and nothing is stored
        ("bad\x1fname", 200, "channel name must not contain the unit separator U+001F", 0),
    ],
)
def test_an_upload_is_queued_or_the_form_says_why_the_tenant_is_refused(
    example_database: str, tenant: str, status: int, error: str | None, stored: int
) -> None:
    out = _manage(example_database, "shell", "-c", f"TENANT = {tenant!r}\n{VISIT}")
    got_status, errors, got_stored = ast.literal_eval(out.strip().splitlines()[-1])
    assert (got_status, got_stored) == (status, stored), out
    if error is None:
        assert errors == []
    else:
        (message,) = errors
        assert message.startswith(error)

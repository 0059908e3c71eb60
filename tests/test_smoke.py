from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection


@pytest.mark.django_db
def test_database_is_postgresql() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT version()")
        (version,) = cursor.fetchone()
    assert version.startswith("PostgreSQL ")


@pytest.mark.django_db(transaction=True)
def test_database_url_reaches_the_test_database_from_a_subprocess(database_url: str) -> None:
    script = (
        "import sys, psycopg\n"
        "with psycopg.connect(sys.argv[1]) as conn:\n"
        "    print(conn.execute('SELECT current_database()').fetchone()[0])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, database_url],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert result.stdout.strip() == connection.settings_dict["NAME"]
    assert result.stdout.strip().startswith("test_")


def test_every_exception_the_api_reference_lists_is_exported() -> None:
    """docs/reference/api.md: "the public API is what django_fairqueue exports"; its Errors
    table lists the exceptions, each importable from the package and in ``__all__``."""
    import django_fairqueue

    text = (Path(__file__).resolve().parents[1] / "docs/reference/api.md").read_text()
    errors = text.split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", errors, flags=re.MULTILINE)
    assert len(listed) >= 12, listed
    for name in listed:
        exported = getattr(django_fairqueue, name)
        assert name in django_fairqueue.__all__, name
        assert issubclass(exported, django_fairqueue.FairQueueError), name

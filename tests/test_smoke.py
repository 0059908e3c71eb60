from __future__ import annotations

import subprocess
import sys

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

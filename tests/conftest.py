from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import pytest

if TYPE_CHECKING:
    from tests.workerkit import WorkerProcess


def pytest_report_header(config: pytest.Config) -> str:
    """Name the database in the header: output capture hides the line settings printed."""
    from django.conf import settings

    from django_fairqueue import devdb

    if devdb.announcement:
        return devdb.announcement
    db = settings.DATABASES["default"]
    return f"database: DATABASE_URL ({db['HOST']}:{db['PORT']}/{db['NAME']})"


@pytest.fixture
def by_count(settings: Any) -> None:
    """Fairness by count (the default is by time), whatever FAIRQUEUE_TEST_OVERRIDES says: for
    tests of turns of messages, which by time are ordered by the time charged."""
    settings.FAIRQUEUE = {**settings.FAIRQUEUE, "FAIRNESS": "count"}


@pytest.fixture(scope="session")
def database_url(django_db_setup: None, django_db_blocker: Any) -> str:
    """URL of the test database that pytest-django created, for code run in subprocesses.

    Workers started with ``subprocess`` do not inherit the test settings' connection; hand them
    this as ``DATABASE_URL``. Only data committed by the test is visible to them, so such tests
    need ``@pytest.mark.django_db(transaction=True)``.
    """
    from django.db import connection

    settings = connection.settings_dict
    user = quote(settings["USER"] or "", safe="")
    password = f":{quote(settings['PASSWORD'], safe='')}" if settings["PASSWORD"] else ""
    credentials = f"{user}{password}@" if user else ""
    host = settings["HOST"] or "localhost"
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    port = f":{settings['PORT']}" if settings["PORT"] else ""
    return f"postgres://{credentials}{host}{port}/{quote(settings['NAME'], safe='')}"


@pytest.fixture
def started(database_url: str) -> Iterator[list[WorkerProcess]]:
    """The worker processes a test starts (tests.workerkit), each closed after it, its log
    printed (pytest shows it when the test failed)."""
    workers: list[WorkerProcess] = []
    try:
        yield workers
    finally:
        for worker in workers:
            worker.close()
            print(f"--- log of worker {worker.worker_id} ---\n{worker.output}")  # on failure

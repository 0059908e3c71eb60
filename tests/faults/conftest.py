from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from django_fairqueue import devdb
from tests.faults import harness
from tests.faults.harness import Db, Fleet
from tests.workerkit import ROOT

#: Short leases and intervals: a killed worker's messages come back within seconds. Heartbeats
#: renew three times per lease, so a busy machine needs seconds of stall to lose one.
OVERRIDES = {
    "LEASE_SECONDS": 4.0,
    "RESCUE_INTERVAL": 0.5,
    "POLL_INTERVAL": 0.5,
    "RETRY_BACKOFF_BASE": 0,
}


@pytest.fixture(scope="session", autouse=True)
def _write_figures() -> Iterator[None]:
    """With FAIRQUEUE_FAULT_REPORT=path, write the scenarios' figures there as JSON at the end
    (``python -m tests.faults.report path`` prints them as the table of docs/reliability.md)."""
    yield
    target = os.environ.get("FAIRQUEUE_FAULT_REPORT")
    if target and harness.FIGURES:
        path = Path(target)
        old = json.loads(path.read_text()) if path.exists() else {}
        old.update(harness.FIGURES)
        path.write_text(json.dumps(old, indent=2, sort_keys=True, default=str) + "\n")


@pytest.fixture
def fault_db(database_url: str) -> Iterator[Db]:
    """The test database, with an empty execution log (the test itself must be
    ``django_db(transaction=True)`` so the queue tables are emptied after it)."""
    db = Db(database_url)
    harness.create_log_tables(db)
    try:
        yield db
    finally:
        db.close()


@pytest.fixture
def fleets() -> Iterator[Callable[..., Fleet]]:
    """Make worker fleets; every process is killed at the end, and logs printed on failure."""
    made: list[Fleet] = []

    def make(url: str, *, overrides: dict[str, Any] | None = None, **kwargs: Any) -> Fleet:
        fleet = Fleet(url, {**OVERRIDES, **(overrides or {})}, **kwargs)
        made.append(fleet)
        return fleet

    try:
        yield make
    finally:
        for fleet in made:
            fleet.close()
            print(fleet.logs())


@pytest.fixture
def private_server() -> Iterator[devdb.EmbeddedPostgres]:
    """A PostgreSQL of our own, in .fairqueue/ (the server's user must reach it), migrated:
    for the scenarios that restart, kill or reconfigure the server, never the shared one."""
    datadir = ROOT / ".fairqueue" / f"pgdata-faults-{os.getpid()}"
    server = devdb.EmbeddedPostgres(datadir, devdb.default_bindir())
    try:
        server.start()
        server.ensure_database("faults")
        subprocess.run(
            [sys.executable, "-m", "django", "migrate", "--settings", "tests.settings", "-v", "0"],
            cwd=ROOT,
            env={**os.environ, "DATABASE_URL": server.url("faults")},
            check=True,
            timeout=180,
        )
        yield server
    finally:
        with contextlib.suppress(devdb.DevDBError):  # killed by the scenario
            server.stop("immediate")
        shutil.rmtree(datadir, ignore_errors=True)

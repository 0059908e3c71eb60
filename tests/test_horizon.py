"""The xmin horizon named: a REPEATABLE READ transaction holding a snapshot in another
connection shows in ``fairqueue status`` (text and JSON), the admin's dashboard (page and
data) and the Prometheus metrics once it is older than ``HORIZON_WARN_AFTER``, and not before."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection
from django.test import Client, RequestFactory, override_settings
from django.urls import reverse

from django_fairqueue.observe import horizon

pytestmark = pytest.mark.django_db

QUERY = "SELECT count(*) AS horizon_probe FROM fairqueue_channel"


@pytest.fixture
def old_snapshot(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """Another session in REPEATABLE READ that took its snapshot, then sits idle in it."""
    conn = psycopg.connect(database_url, autocommit=False, application_name="nightly-report")
    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    conn.execute(QUERY).fetchone()  # the first query takes the snapshot
    try:
        yield conn
    finally:
        conn.rollback()
        conn.close()


def _named(holders: list[Any], pid: int) -> Any:
    return next((h for h in holders if h.kind == "transaction" and h.pid == pid), None)


def test_an_old_snapshot_is_named_past_the_threshold_only(
    old_snapshot: psycopg.Connection[Any],
) -> None:
    pid = old_snapshot.info.backend_pid
    with override_settings(FAIRQUEUE={"HORIZON_WARN_AFTER": 3600}):
        assert _named(horizon.holders(), pid) is None  # younger than an hour
    time.sleep(0.3)
    with override_settings(FAIRQUEUE={"HORIZON_WARN_AFTER": 0.2}):
        found = _named(horizon.holders(), pid)
    assert found is not None
    assert found.name == "nightly-report"
    assert found.state == "idle in transaction"
    assert found.age_seconds >= 0.3
    assert found.xid_age is not None and found.xid_age >= 0
    assert found.query == QUERY
    text = horizon.describe(found)
    assert f"pid {pid} (nightly-report, idle in transaction)" in text
    assert "SELECT count(*) AS horizon_probe" in text
    assert horizon.oldest_age() >= 0.3


@pytest.mark.django_db(transaction=True)  # pg_stat_activity is read once per transaction
def test_the_snapshot_ends_and_is_no_longer_named(database_url: str) -> None:
    conn = psycopg.connect(database_url, autocommit=False)
    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    conn.execute(QUERY).fetchone()
    pid = conn.info.backend_pid
    assert _named(horizon.holders(min_age=0), pid) is not None
    conn.rollback()  # idle, out of any transaction: no snapshot, no xmin
    try:
        assert _named(horizon.holders(min_age=0), pid) is None
    finally:
        conn.close()


@override_settings(FAIRQUEUE={"HORIZON_WARN_AFTER": 0.1})
def test_status_names_the_holder(old_snapshot: psycopg.Connection[Any]) -> None:
    pid = old_snapshot.info.backend_pid
    time.sleep(0.2)
    out = io.StringIO()
    call_command("fairqueue", "status", stdout=out)
    text = out.getvalue()
    assert "1 old transaction or slot (over " in text and ") holds the xmin horizon" in text
    line = next(line for line in text.splitlines() if f"pid {pid} " in line)
    assert "nightly-report" in line and "horizon_probe" in line
    out = io.StringIO()
    call_command("fairqueue", "status", "--json", stdout=out)
    data = json.loads(out.getvalue())
    (held,) = [h for h in data["xmin_horizon"] if h["pid"] == pid]
    assert held["query"] == QUERY and held["kind"] == "transaction"


def test_a_role_that_may_not_see_the_holders_age_still_names_it_by_its_xmin(
    old_snapshot: psycopg.Connection[Any], database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without pg_read_all_stats a role sees another role's transaction with its xmin but not
    its start: named once it holds the horizon far enough back, with no age."""
    pid = old_snapshot.info.backend_pid
    with psycopg.connect(database_url, autocommit=True) as other:
        for _ in range(12):  # transactions since the snapshot: its xmin ages
            other.execute("SELECT txid_current()")
    with connection.cursor() as cur:
        cur.execute("CREATE ROLE fq_no_stats NOLOGIN")  # (the test's transaction drops it)
        cur.execute("GRANT SELECT ON ALL TABLES IN SCHEMA public TO fq_no_stats")
        cur.execute("SET LOCAL ROLE fq_no_stats")
    monkeypatch.setattr(horizon, "HIDDEN_MIN_XID_AGE", 10)
    with override_settings(FAIRQUEUE={"HORIZON_WARN_AFTER": 3600}):
        found = _named(horizon.holders(), pid)
        assert found is not None
        assert (found.name, found.age_seconds, found.state, found.query) == (
            "nightly-report",
            None,
            "",
            None,
        )
        assert found.xid_age >= 12
        assert horizon.describe(found) == (
            f"pid {pid} (nightly-report) in a transaction holding the horizon "
            f"{found.xid_age:,} transactions back; its age, state and query are not visible "
            "to this role (GRANT pg_read_all_stats TO it)"
        )
        out = io.StringIO()
        call_command("fairqueue", "status", "--json", stdout=out)
        assert pid in [h["pid"] for h in json.loads(out.getvalue())["xmin_horizon"]]
        monkeypatch.setattr(horizon, "HIDDEN_MIN_XID_AGE", 10**9)
        assert _named(horizon.holders(), pid) is None  # not that far back


def test_status_is_quiet_without_an_old_transaction() -> None:
    out = io.StringIO()
    call_command("fairqueue", "status", stdout=out)
    assert "xmin horizon" not in out.getvalue()


@override_settings(FAIRQUEUE={"HORIZON_WARN_AFTER": 0.1})
def test_dashboard_and_metrics_name_the_holder(old_snapshot: psycopg.Connection[Any]) -> None:
    from django_fairqueue import metrics

    pid = old_snapshot.info.backend_pid
    time.sleep(0.2)
    root = User.objects.create_superuser("root", password="pw")
    client = Client()
    client.force_login(root)
    page = client.get(reverse("admin:fairqueue_channel_dashboard"))
    assert page.status_code == 200
    html = page.content.decode()
    assert 'id="fq-horizon"' in html and f"pid {pid} (nightly-report" in html
    data = client.get(reverse("admin:fairqueue_channel_dashboard_data")).json()
    assert [h["pid"] for h in data["xmin_horizon"]] == [pid]

    request = RequestFactory().get("/metrics")
    request.user = root
    text = metrics.metrics_view(request).content.decode()
    held = [
        line
        for line in text.splitlines()
        if line.startswith("fairqueue_xmin_horizon_holder_xid_age{")
    ]
    assert len(held) == 1 and f'pid="{pid}"' in held[0] and 'name="nightly-report"' in held[0]
    (age,) = [
        line for line in text.splitlines() if line.startswith("fairqueue_xmin_horizon_seconds ")
    ]
    assert float(age.split()[1]) >= 0.2

"""The kept cursors of django_fairqueue.db.pg: one per connection and kind, reused across
statements, never shared by two statements at once, and replaced when the connection is."""

from __future__ import annotations

import pytest
from django.db import connection

from django_fairqueue.db import pg


@pytest.mark.django_db
def test_statements_reuse_one_cursor_per_connection_and_kind() -> None:
    with pg.kept_cursor() as first:
        first.execute("SELECT 1")
    with pg.kept_cursor() as second:
        second.execute("SELECT 2")
        assert second.fetchone() == (2,)
    assert second is first
    with pg.kept_cursor(values=False) as plain:
        pass
    assert plain is not first  # results with jsonb values take a loader the other has not


@pytest.mark.django_db
def test_a_statement_inside_another_gets_a_cursor_of_its_own() -> None:
    with pg.kept_cursor() as outer:
        outer.execute("SELECT g FROM generate_series(1, 3) AS g")
        with pg.kept_cursor() as inner:
            assert inner is not outer
            inner.execute("SELECT 42")
            assert inner.fetchone() == (42,)
        assert inner.closed  # the extra one is not kept
        # the outer statement's rows are still its own
        assert outer.fetchall() == [(1,), (2,), (3,)]
    with pg.kept_cursor() as again:
        assert again is outer


@pytest.mark.django_db(transaction=True)
def test_a_new_connection_gets_a_new_cursor() -> None:
    with pg.kept_cursor() as before:
        before.execute("SELECT 1")
    connection.close()
    with pg.kept_cursor() as after:
        after.execute("SELECT 1")
        assert after.fetchone() == (1,)
    assert after is not before
    assert after.connection is connection.connection


@pytest.mark.django_db(transaction=True)
def test_a_failed_statement_leaves_the_kept_cursor_usable() -> None:
    with pytest.raises(Exception, match="division by zero"), pg.kept_cursor() as cur:
        cur.execute("SELECT 1 / 0")
    with pg.kept_cursor() as again:
        assert again is cur
        again.execute("SELECT 7")
        assert again.fetchone() == (7,)

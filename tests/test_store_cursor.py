"""The kept cursors of django_fairqueue.db.pg: one per connection and kind, reused across
statements, never shared by two statements at once, and replaced when the connection is."""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.test import SimpleTestCase
from django.test.testcases import DatabaseOperationForbidden
from psycopg import errors
from psycopg.types.json import Jsonb

from django_fairqueue.api import enqueue
from django_fairqueue.db import pg
from django_fairqueue.db.jsontext import JsonbLoader
from django_fairqueue.models import Message
from tests import factories as f


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


JSONB_VALUES = [
    {"args": ["A", 0], "kwargs": {}},
    [1, 2.5, -0.0, None, True, False, "", "\u00e9\u2603\U0001f600", 'a\\b"c\n\t\u0001'],
    "text",
    0,
    -(2**70),
    1.5e-300,
    {"nested": {"deep": [[[[{"x": [1]}]]]]}, "empty": [], "obj": {}},
    None,
]


@pytest.mark.django_db
@pytest.mark.parametrize("value", JSONB_VALUES, ids=range(len(JSONB_VALUES)))
def test_jsonb_comes_back_as_json_loads_reads_postgresqls_text(value: object) -> None:
    """The kept cursor's jsonb loader (the json scanner on the binary format's text) reads
    every JSON value as json.loads reads the text PostgreSQL writes for it."""
    with pg.kept_cursor() as cur:
        cur.execute("SELECT %s::jsonb, %s::jsonb::text", [Jsonb(value), Jsonb(value)], binary=True)
        loaded, text = cur.fetchone()
    assert loaded == json.loads(text)
    assert type(loaded) is type(json.loads(text))


def test_the_jsonb_loader_refuses_a_binary_format_it_does_not_know() -> None:
    loader = JsonbLoader(0)
    assert loader.load(memoryview(b'\x01{"a": [1]}')) == {"a": [1]}
    with pytest.raises(errors.DataError, match="unknown jsonb binary format: 2"):
        loader.load(b'\x02{"a": 1}')


@pytest.mark.django_db
def test_a_test_that_did_not_declare_the_queues_database_cannot_reach_it() -> None:
    """Django's test cases forbid a database a test does not declare by putting a failing
    cursor on its connection; an open connection (an earlier test's) must not let the queue's
    statements pass by it and commit where no rollback reaches."""
    connection.ensure_connection()

    class Undeclared(SimpleTestCase):  # declares no database
        pass

    Undeclared._add_databases_failures()
    try:
        with pytest.raises(DatabaseOperationForbidden):
            enqueue(f.NOOP, channel="undeclared")
    finally:
        Undeclared._remove_databases_failures()
    assert not Message.objects.filter(channel__name="undeclared").exists()

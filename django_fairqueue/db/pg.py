"""The connection side of the database layer: cursors, statement files, running one.

Every function of ``django_fairqueue.db`` runs its statement through :func:`run_statement` on
the Django connection of ``FAIRQUEUE['DATABASE']`` (or ``using``), so it joins the caller's
transaction (``transaction.atomic()``) or autocommits like any ORM query. Statements run on a
psycopg cursor with server-side binding (Django's default cursor binds on the client), the calls
of the server functions prepared (see :func:`named_statements`), wrapped in Django's error
translation so an error inside ``atomic()`` marks the transaction for rollback exactly as an ORM
error would. :func:`kept_cursor` is that cursor, kept per connection; :func:`own_connection` is
a short-lived connection outside Django's handler, for work that must commit apart from the
caller's transaction.

The optional apps (``django_fairqueue.contrib``) run their own statement files the same way,
with :class:`StatementFile`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from importlib import resources
from typing import Any

import psycopg
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.utils import ProgrammingError
from psycopg import pq

from django_fairqueue import conf
from django_fairqueue.db.jsontext import JsonbLoader

_NEVER = 2**31
_NAME_RE = re.compile(r"^-- name: (\w+)( prepared)?\s*$", re.MULTILINE)


def named_statements(package: str, resource: str) -> tuple[dict[str, str], frozenset[str]]:
    """The named statements of the SQL file ``resource`` of ``package``, by name, and the names
    of those prepared.

    The format of ``db/statements/*.sql``: ``-- name: NAME`` starts a statement, whose text
    runs to the next one. The optional apps (``django_fairqueue.contrib``) keep their
    statements in files of their own in the same format (see :class:`StatementFile`).

    A statement is planned at each run, from the tables as they are then, unless its file
    names it ``-- name: NAME prepared``. A prepared statement keeps one plan per session, made
    from the table sizes of its first runs, until a table's next ``ANALYZE``; made while a
    table was nearly empty (a fresh deployment's tables, the delta table whenever autovacuum
    has just truncated it, the message table before a tenant's bulk upload is analyzed), that
    plan scans the table sequentially or reads one side of a join once per row of the other
    once it holds millions of rows. So only statements that read no table themselves are
    prepared: calls of the server functions (the claim, the completion, the enqueue), which
    plan their own statements without a sequential scan. Planning the others costs a fraction
    of a millisecond, on paths that run seldom or settle many messages at once
    (``tests/test_store_sql.py`` holds prepared statements to this).
    """
    text = resources.files(package).joinpath(resource).read_text("utf-8")
    parts = _NAME_RE.split(text)
    # parts = [preamble, name1, prepared1, body1, name2, prepared2, body2, ...]
    named = {}
    prepared = set()
    for name, flag, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        if name in named:
            raise RuntimeError(f"{resource} names {name!r} twice")
        named[name] = body.strip()
        if flag:
            prepared.add(name)
    return named, frozenset(prepared)


class StatementFile:
    """The named statements of one SQL file, loaded on first use, and a way to run them.

    Each module of ``django_fairqueue.db`` holds the file of its family,
    ``queries = StatementFile("django_fairqueue.db", "statements/<family>.sql")``, and has one
    function per name; ``queries()`` is {name: statement}, ``queries.run(name, params, using)``
    runs one as :func:`run_statement` does. An optional app does the same with its own file.
    """

    def __init__(self, package: str, resource: str) -> None:
        self.package = package
        self.resource = resource
        self._named: dict[str, str] | None = None
        self._prepared: frozenset[str] = frozenset()

    def __call__(self) -> dict[str, str]:
        named = self._named
        if named is None:
            named, self._prepared = named_statements(self.package, self.resource)
            self._named = named
        return named

    def prepared(self) -> frozenset[str]:
        """The names of the statements this file says to prepare."""
        self()
        return self._prepared

    def run(
        self, name: str, params: dict[str, Any], using: str | None = None
    ) -> list[tuple[Any, ...]]:
        """Run the statement ``name`` (see :func:`run_statement`) and return its rows."""
        statement = self()[name]
        return run_statement(statement, params, using, prepare=name in self._prepared)


queries = StatementFile("django_fairqueue.db", "statements/pg.sql")
_run = queries.run


@contextmanager
def kept_cursor(
    using: str | None = None, *, wrapper: BaseDatabaseWrapper | None = None, values: bool = True
) -> Iterator[psycopg.Cursor[Any]]:
    """The kept psycopg cursor of the Django connection of ``using`` (or of ``wrapper``), for
    this block (see the module's docstring); a statement inside another's block gets a cursor
    of its own. ``values=False`` for statements whose results hold no jsonb: the cursor then
    shares the connection's adapters instead of copying them to register a loader (a
    measurable part of one enqueue)."""
    alias = using or conf.get().DATABASE
    if wrapper is None:
        wrapper = connections[alias]
    wrapper.validate_no_broken_transaction()
    if "cursor" in wrapper.__dict__:
        # A `cursor` set on the connection itself: Django's test cases put a failing one on
        # each database a test did not declare (the raw cursor below would pass it by, and
        # write where the test's rollback does not reach); any other wrapper costs one cursor.
        wrapper.cursor().close()
    try:
        with wrapper.wrap_database_errors:
            wrapper.ensure_connection()
            raw = wrapper.connection
            prepare = conf.get().PREPARED_STATEMENTS
            if prepare and raw.prepare_threshold is None:
                # Django turns psycopg's statement preparation off (threshold None), and then
                # psycopg ignores execute(prepare=True) too. A threshold no query reaches keeps
                # Django's own queries unprepared and lets ours be prepared explicitly: planning
                # the claim's call costs about what executing a claim of one message does.
                raw.prepare_threshold = _NEVER
            # One cursor per connection and kind, kept for the next statement: a cursor's
            # transformer learns which dumper each parameter's type takes, and a new cursor per
            # statement learnt it again every time (about 25 us of a single enqueue's client CPU).
            # A statement run while the kept cursor is in use (a function of the db package called
            # inside another's block) gets a cursor of its own, closed after it.
            kept: dict[bool, _KeptCursor] = wrapper.__dict__.setdefault(_KEPT_CURSORS, {})
            entry = kept.get(values)
            if entry is None or entry.connection is not raw or entry.cursor.closed:
                entry = kept[values] = _KeptCursor(raw, _new_cursor(raw, values))
            elif entry.busy:
                entry = None
            if entry is None:
                with _new_cursor(raw, values) as cur:
                    yield cur
                return
            entry.busy = True
            try:
                yield entry.cursor
            finally:
                entry.busy = False
    except ProgrammingError as exc:
        hint = what_to_do(exc)
        if hint is None:
            raise
        raise ProgrammingError(f"{str(exc).splitlines()[0]} in database {alias!r}: {hint}") from exc


def what_to_do(exc: BaseException) -> str | None:
    """What to do when ``exc`` comes of the setup, not of the queue: a table or function of the
    queue does not exist (the database was never migrated, or is another one than the one
    migrated), or a pooler does not keep prepared statements; None otherwise."""
    cause: BaseException | None = exc
    while cause is not None and getattr(cause, "sqlstate", None) is None:
        cause = cause.__cause__  # (Django's error wraps psycopg's, which has the state)
    state = getattr(cause, "sqlstate", None)
    if state == "42P05":  # duplicate_prepared_statement
        return (
            "a connection pooler in transaction mode that does not keep prepared statements "
            "(PgBouncer before 1.21, or without max_prepared_statements) stands between "
            "this process and PostgreSQL: set FAIRQUEUE['PREPARED_STATEMENTS'] = False "
            '(docs/howto/deploy-workers.md, "Behind PgBouncer")'
        )
    if state not in ("42P01", "42883") or "fairqueue_" not in str(exc):
        return None  # (42P01: undefined table, 42883: undefined function)
    return (
        "the queue's tables or functions are not in this database; run `manage.py migrate` "
        "(and `migrate --database ALIAS` when FAIRQUEUE['DATABASE'] names another). With the "
        "embedded development server, run commands from the directory you migrated from: "
        "another directory has a server of its own."
    )


#: The attribute of a Django connection wrapper that holds its kept cursors (see kept_cursor).
_KEPT_CURSORS = "_fairqueue_kept_cursors"


@dataclass
class _KeptCursor:
    connection: psycopg.Connection[Any]
    cursor: psycopg.Cursor[Any]
    busy: bool = False


def _new_cursor(raw: psycopg.Connection[Any], values: bool) -> psycopg.Cursor[Any]:
    cur = psycopg.Cursor(raw)
    # Results come back in binary format: psycopg's C loaders then apply, where Django's
    # connection registers Python text loaders (timestamptz) that cost ~1.5 ms per 100
    # claimed rows. Django keeps jsonb as text for its JSONField; here we want values.
    if values:
        cur.adapters.register_loader("jsonb", JsonbLoader)
    return cur


def run_statement(
    statement: str, params: dict[str, Any], using: str | None = None, *, prepare: bool = False
) -> list[tuple[Any, ...]]:
    """Run one statement as every function of the db package runs its own (see the module's
    docstring) and return its rows ([] for a statement that returns none).

    The statement is named in a statement file (:class:`StatementFile`): the queue's own run
    through the function of their name, an optional app's through its own module. It is
    prepared when ``prepare`` is true (a statement its file names ``prepared``, see
    :func:`named_statements`) and ``FAIRQUEUE['PREPARED_STATEMENTS']`` is on.
    """
    with kept_cursor(using) as cur:
        cur.execute(
            statement, params, prepare=prepare and conf.get().PREPARED_STATEMENTS, binary=True
        )
        # Not `cur.description`: it builds a Column object per result column on every call
        # (14 for a claim), a measurable share of a claim of one message's client time.
        result = cur.pgresult
        if result is None or result.status != pq.ExecStatus.TUPLES_OK:
            return []
        return cur.fetchall()


def statement_is_transaction(using: str | None = None) -> bool:
    """Whether a statement run now on ``using`` is a transaction of its own (autocommit, no
    atomic block): what a claim that may wait, or a commit without the WAL flush, needs, since
    either would otherwise apply to the caller's whole transaction."""
    wrapper = connections[using or conf.get().DATABASE]
    return wrapper.get_autocommit() and not wrapper.in_atomic_block


def is_lock_timeout(exc: BaseException) -> bool:
    """Whether a database error is a lock wait that ran out (SQLSTATE 55P03)."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return getattr(cause, "sqlstate", None) == "55P03"


@contextmanager
def own_connection(using: str | None = None) -> Iterator[BaseDatabaseWrapper]:
    """A new connection to the database of ``using`` (default ``FAIRQUEUE['DATABASE']``),
    outside Django's handler, closed (its session ended) on exit.

    For work that must commit apart from the caller's transaction, or hold a session of its
    own (a session lock, a snapshot) that ``connections.close_all()`` must not end. Run
    statements on it with ``kept_cursor(wrapper=...)``.
    """
    wrapper = connections.create_connection(using or conf.get().DATABASE)
    try:
        yield wrapper
    finally:
        wrapper.close()


def select_clock(*, using: str | None = None) -> datetime:
    """The database's clock (``clock_timestamp()``), for figures computed against its
    timestamps (ages, next fire times)."""
    return _run("select_clock", {}, using)[0][0]  # type: ignore[no-any-return]


def select_isolation_level(*, using: str | None = None) -> str:
    """The isolation level of the transaction open on ``using`` ("read committed", ...)."""
    return _run("select_isolation_level", {}, using)[0][0]  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class XminHolder:
    """A session, prepared transaction or replication slot holding the xmin horizon back."""

    kind: str  # "transaction", "prepared" or "slot"
    pid: int | None  # the backend (a slot's: its consumer's, None when none is connected)
    name: str  # application name (or role), prepared transaction's gid, slot name
    # since its transaction began (None: a slot, or a session this role may not see the age of)
    age_seconds: float | None
    xid_age: int | None  # how many transactions back its snapshot reaches
    state: str  # the session's state ("idle in transaction", ...), "prepared", "inactive"
    query: str | None  # the start of its latest query (None when not visible to this role)


def select_xmin_holders(
    min_age: timedelta, *, min_xid_age: int, limit: int = 5, using: str | None = None
) -> list[XminHolder]:
    """Who holds the xmin horizon of the queue's database back, oldest snapshot first:
    transactions and prepared transactions older than ``min_age``, inactive slots, and the
    transactions of other roles whose age this role may not see once they hold the horizon
    ``min_xid_age`` transactions back."""
    params = {"min_age": min_age, "min_xid_age": min_xid_age, "limit": limit}
    rows = _run("select_xmin_holders", params, using)
    return [XminHolder(*row) for row in rows]

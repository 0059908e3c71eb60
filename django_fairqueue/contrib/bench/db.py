"""The benchmark's SQL: one function per named statement of ``sql/bench.sql``.

The queue's ``django_fairqueue.db`` for the benchmark's own statements (locking a run, old
snapshots, function timings, bulk loads, scratch databases), run the same way: on the Django
connection of ``using`` (default ``FAIRQUEUE['DATABASE']``), through the public helpers of
:mod:`django_fairqueue.db.pg`. The queue never calls these.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from django_fairqueue import conf
from django_fairqueue.db import pg

queries = pg.StatementFile("django_fairqueue.contrib.bench", "sql/bench.sql")
_run = queries.run


@contextmanager
def lock_benchmark(*, scratch: bool = False, using: str | None = None) -> Iterator[bool]:
    """Hold fairbench's session lock on a dedicated connection; yields False if another run has it.

    One lock for runs in the database of ``using``, another (``scratch``) for runs in its
    scratch database: a run in one does not keep a run out of the other. A connection of its
    own, outside Django's handler, so ``connections.close_all()`` (before the benchmark forks)
    does not end the session and with it the lock.
    """
    with pg.own_connection(using) as wrapper:  # closing it ends the session and the lock
        with wrapper.wrap_database_errors:
            wrapper.ensure_connection()
            with psycopg.Cursor(wrapper.connection) as cur:
                cur.execute(queries()["lock_benchmark"], {"slot": -2 if scratch else -1})
                row = cur.fetchone()
        yield bool(row and row[0])


@contextmanager
def hold_old_snapshot(*, using: str | None = None) -> Iterator[int]:
    """Open a REPEATABLE READ transaction on a connection of its own and keep its snapshot
    until the block ends (fairbench's snapshot scenario); yields that session's pid."""
    with pg.own_connection(using) as wrapper:  # closing it ends the transaction and snapshot
        with wrapper.wrap_database_errors:
            wrapper.ensure_connection()
            conn = wrapper.connection
            conn.autocommit = False
            # Two statements in one string: only the simple query protocol (no parameters,
            # no prepare) takes that.
            conn.execute(queries()["hold_old_snapshot"], prepare=False)
            pid = int(conn.info.backend_pid)
        yield pid


def select_backend_holds_xmin(pid: int, *, using: str | None = None) -> bool:
    rows = _run("select_backend_holds_xmin", {"pid": pid}, using)
    return bool(rows and rows[0][0])


def enable_function_timing(*, using: str | None = None) -> None:
    _run("enable_function_timing", {}, using)


def force_stats_flush(*, using: str | None = None) -> None:
    _run("force_stats_flush", {}, using)


def select_index_reads(*, using: str | None = None) -> dict[str, int]:
    """{index: entries read so far} of the queue tables' indexes (flushed statistics)."""
    return {name: int(read) for name, read in _run("select_index_reads", {}, using)}


def select_function_times(*, using: str | None = None) -> dict[str, tuple[int, float, float]]:
    """{function: (calls, total ms, self ms)} of the fairqueue_* PL/pgSQL functions."""
    return {
        name: (int(calls), float(total), float(own))
        for name, calls, total, own in _run("select_function_times", {}, using)
    }


def select_queue_tables_in_use(*, using: str | None = None) -> dict[str, bool]:
    """{table role: holds rows} for messages, channels, channel_deltas, work_batches and
    schedules."""
    with pg.kept_cursor(using) as cur:
        cur.execute(queries()["select_queue_tables_in_use"], {}, binary=True)
        row = cur.fetchone()
        names = [d.name for d in cur.description or ()]
    return dict(zip(names, (bool(v) for v in row or ()), strict=True))


def truncate_queue_tables(*, using: str | None = None) -> None:
    _run("truncate_queue_tables", {}, using)


def analyze_queue_tables(*, using: str | None = None) -> None:
    _run("analyze_queue_tables", {}, using)


def select_wal_position(*, using: str | None = None) -> str:
    return str(_run("select_wal_position", {}, using)[0][0])


def select_wal_since(lsn: str, *, using: str | None = None) -> int:
    """Bytes of WAL the server wrote since ``lsn`` (from :func:`select_wal_position`)."""
    return int(_run("select_wal_since", {"lsn": lsn}, using)[0][0])


def select_backend_pid(*, using: str | None = None) -> int:
    return int(_run("select_backend_pid", {}, using)[0][0])


def load_ready_messages(
    channels: Sequence[str],
    count: int,
    *,
    task_name: str,
    payload: Any,
    defaults: conf.ChannelDefaults,
    max_attempts: int = 1,
    unique_scope: str | None = None,
    using: str | None = None,
) -> int:
    """Insert ``count`` ready messages round-robin over ``channels`` in one statement (with
    ``unique_scope``, each a unique job of that scope with a random key).

    For benchmarks and demos: about 90,000 rows/s here, where ``enqueue_many`` validates and
    encodes every payload in Python. Channels are created on first use with ``defaults``;
    counters stay exact (one delta per channel). Returns how many messages were loaded.
    """
    if count <= 0 or not channels:
        return 0
    params = {
        "channels": list(channels),
        "count": count,
        "task": task_name,
        "payload": Jsonb(payload),
        "max_attempts": max_attempts,
        "unique_scope": unique_scope,
        "default_max_concurrency": defaults.max_concurrency,
        "default_release_interval": defaults.release_interval,
        "default_weight": defaults.weight,
        "default_max_backlog": defaults.max_backlog,
    }
    return int(_run("load_ready_messages", params, using)[0][0])


def select_server_settings(names: Sequence[str], *, using: str | None = None) -> dict[str, str]:
    """Server settings as SHOW prints them; a setting unknown to the server maps to ''."""
    rows = _run("select_server_settings", {"names": list(names)}, using)
    return {name: value or "" for name, value in rows}


def select_database_comment(name: str, *, using: str | None = None) -> tuple[bool, str | None]:
    """(exists, comment) of a database on the server of ``using``."""
    rows = _run("select_database_comment", {"name": name}, using)
    return (True, rows[0][0]) if rows else (False, None)


def select_function_digests(*, using: str | None = None) -> dict[str, str]:
    """{function name: md5 of its body} for the installed fairqueue_* functions."""
    return {name: digest for name, digest in _run("select_function_digests", {}, using)}


# -- Scratch databases ------------------------------------------------------------------------
# CREATE/DROP DATABASE take an identifier, which cannot be a bound parameter: these two helpers
# (and only these) compose SQL, with psycopg.sql.Identifier quoting the name. Neither may run
# inside a transaction block.


def create_scratch_database(name: str, *, comment: str, using: str | None = None) -> None:
    """CREATE DATABASE ``name`` on the server of ``using``, marked with ``comment``."""
    with pg.kept_cursor(using) as cur:
        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        cur.execute(
            sql.SQL("COMMENT ON DATABASE {} IS {}").format(
                sql.Identifier(name), sql.Literal(comment)
            )
        )


def drop_scratch_database(name: str, *, using: str | None = None) -> None:
    """DROP DATABASE IF EXISTS ``name``, ending its sessions (PostgreSQL 13+)."""
    with pg.kept_cursor(using) as cur:
        cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


# -- The admin scenario's queue ----------------------------------------------------------------


def load_admin_messages(
    channel_ids: Sequence[int], start: int, count: int, total: int, *, using: str | None = None
) -> None:
    """Insert messages ``start .. start + count - 1`` of an admin benchmark queue of ``total``
    (their state, task name and times follow from their position; see sql/bench.sql)."""
    params = {"channel_ids": list(channel_ids), "start": start, "count": count, "total": total}
    _run("load_admin_messages", params, using)


def count_admin_messages(*, using: str | None = None) -> None:
    """One counter delta per channel for the messages ``load_admin_messages`` wrote."""
    _run("count_admin_messages", {}, using)


def load_admin_workers(*, using: str | None = None) -> None:
    _run("load_admin_workers", {}, using)


def delete_admin_workers(*, using: str | None = None) -> None:
    _run("delete_admin_workers", {}, using)


def load_admin_work_batches(channel_id: int, count: int, *, using: str | None = None) -> None:
    _run("load_admin_work_batches", {"channel_id": channel_id, "count": count}, using)


def vacuum_queue_tables(*, using: str | None = None) -> None:
    _run("vacuum_queue_tables", {}, using)


def make_schedules_due(n: int, slot: datetime, *, using: str | None = None) -> None:
    _run("make_schedules_due", {"n": n, "slot": slot}, using)


def analyze_schedules(*, using: str | None = None) -> None:
    _run("analyze_schedules", {}, using)


def load_admin_usage(days: int, *, using: str | None = None) -> None:
    """Usage of every channel for every hour of ``days`` days (then :func:`analyze_admin_usage`)."""
    _run("load_admin_usage", {"days": days}, using)


def analyze_admin_usage(*, using: str | None = None) -> None:
    _run("analyze_admin_usage", {}, using)


def delete_admin_usage(*, using: str | None = None) -> None:
    _run("delete_admin_usage", {}, using)

"""Work batches (``django_fairqueue.batches``): planning a job's id ranges over a
source table, claiming a batch under a lease, settling it. Design and locking:
docs/explanation/work-batches.md.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from psycopg import sql
from psycopg.types.json import Jsonb

from django_fairqueue.db import pg

queries = pg.StatementFile("django_fairqueue.db", "statements/work_batches.sql")
_run = queries.run


def retry_failed_work_batches(ids: Sequence[int], *, using: str | None = None) -> list[int]:
    """Set failed work batches back to pending with attempts 0; idempotent. Returns the ids
    retried now."""
    if not ids:
        return []
    return [r[0] for r in _run("retry_failed_work_batches", {"ids": list(ids)}, using)]


@dataclass(frozen=True, slots=True)
class ClaimedBatch:
    """A work batch claimed under a lease by ``worker_id``. ``attempts`` counts this attempt
    (1-based)."""

    id: int
    channel_id: int
    channel: str
    job_name: str
    start_id: int
    end_id: int
    row_count: int
    attempts: int
    max_attempts: int
    lease_token: uuid.UUID
    lease_expires_at: datetime
    #: the worker it was claimed for (what a failure records)
    worker_id: str = field(default="", kw_only=True)


@dataclass(frozen=True, slots=True)
class SourceColumn:
    """A source table's id column, as found in the catalog."""

    schema: str
    table: str
    type: str


@dataclass(frozen=True, slots=True)
class IdWindow:
    """One window of a walk over a source table's id index: how many ids, first and last."""

    count: int
    first_id: int
    last_id: int


@dataclass(frozen=True, slots=True)
class RescuedBatch:
    id: int
    job_name: str
    state: str
    worker_id: str
    attempts: int


@dataclass(frozen=True, slots=True)
class JobRow:
    """One job's batches and rows by state, straight from select_job_progress."""

    job_name: str
    channel: str | None
    batches_total: int
    pending: int
    running: int
    succeeded: int
    failed: int
    rows_total: int
    rows_done: int
    rows_written: int
    planned_at: datetime | None
    started_at: datetime | None
    last_finished_at: datetime | None
    now: datetime


def select_table_column(
    table: str, column: str, *, schema: str | None = None, using: str | None = None
) -> SourceColumn | None:
    """Where ``table``'s ``column`` lives and its type; None when the table or column is missing."""
    rows = _run("select_table_column", {"table": table, "column": column, "schema": schema}, using)
    return SourceColumn(*rows[0]) if rows else None


def lock_plan(job: str, *, using: str | None = None) -> None:
    """Take the job's planning lock until the end of the current transaction."""
    _run("lock_plan", {"job": job}, using)


def select_last_planned_batch(job: str, *, using: str | None = None) -> tuple[int, int] | None:
    """(channel id, end id) of the job's last planned batch, or None for a new job."""
    rows = _run("select_last_planned_batch", {"job": job}, using)
    return (int(rows[0][0]), int(rows[0][1])) if rows else None


def _source_sql(
    text: str, source: SourceColumn, column: str, filters: Sequence[str]
) -> sql.Composed:
    """A statement over a source table with its identifiers quoted and filter values bound."""
    conditions = sql.SQL("").join(
        sql.SQL(" AND t.{} = {}").format(sql.Identifier(f), sql.Placeholder(f"f{i}"))
        for i, f in enumerate(filters)
    )
    return sql.SQL(text).format(
        table=sql.Identifier(source.schema, source.table),
        id=sql.Identifier(column),
        filters=conditions,
    )


def _run_source(
    text: str,
    source: SourceColumn,
    column: str,
    filters: dict[str, Any],
    params: dict[str, Any],
    using: str | None,
) -> list[tuple[Any, ...]]:
    statement = _source_sql(text, source, column, list(filters))
    bound = {**params, **{f"f{i}": value for i, value in enumerate(filters.values())}}
    with pg.kept_cursor(using) as cur:
        cur.execute(statement, bound, binary=True)
        return cur.fetchall()


def walk_id_index(
    source: SourceColumn,
    column: str,
    *,
    start: int,
    size: int,
    steps: int,
    filters: dict[str, Any],
    using: str | None = None,
) -> list[IdWindow]:
    """Up to ``steps`` consecutive windows of ``size`` ids from ``start`` (under ``filters``);
    only the last may be short, and an exhausted table gives fewer (or none)."""
    params = {"from": start, "size": size, "steps": steps}
    rows = _run_source(queries()["walk_id_index"], source, column, filters, params, using)
    return [IdWindow(*r) for r in rows]


def select_id_span(
    source: SourceColumn, column: str, *, filters: dict[str, Any], using: str | None = None
) -> tuple[int | None, int | None]:
    """Lowest and highest id of the source table under ``filters`` (None, None when empty)."""
    rows = _run_source(queries()["select_id_span"], source, column, filters, {}, using)
    return rows[0][0], rows[0][1]


def insert_planned_batches(
    *,
    channel_id: int,
    job: str,
    ranges: Sequence[tuple[int, int, int]],
    max_attempts: int,
    using: str | None = None,
) -> tuple[int, int]:
    """Insert planned (start, end, rows) ranges; ranges the job already has are skipped.
    Returns (batches added, rows they cover)."""
    params = {
        "channel_id": channel_id,
        "job": job,
        "starts": [r[0] for r in ranges],
        "ends": [r[1] for r in ranges],
        "counts": [r[2] for r in ranges],
        "max_attempts": max_attempts,
    }
    added, rows = _run("insert_planned_batches", params, using)[0]
    return int(added), int(rows)


def claim_work_batch(
    *,
    worker: str,
    lease: timedelta,
    jobs: Sequence[str] | None = None,
    job_prefixes: Sequence[str] | None = None,
    only: Sequence[int] | None = None,
    exclude: Sequence[int] | None = None,
    using: str | None = None,
) -> ClaimedBatch | None:
    """Claim one batch fairly across channels (fairqueue_claim_batch_v1); None if none can run."""
    params = {
        "worker": worker,
        "lease": lease,
        "jobs": list(jobs) if jobs is not None else None,
        "job_prefixes": list(job_prefixes) if job_prefixes is not None else None,
        "only": list(only) if only is not None else None,
        "exclude": list(exclude) if exclude is not None else None,
    }
    rows = _run("claim_work_batch", params, using)
    return ClaimedBatch(*rows[0], worker_id=worker) if rows else None


def heartbeat_work_batch(
    batch_id: int, token: uuid.UUID, *, lease: timedelta, using: str | None = None
) -> datetime | None:
    """Extend the lease; returns the new expiry, or None when the lease is lost."""
    rows = _run("heartbeat_work_batch", {"id": batch_id, "token": token, "lease": lease}, using)
    return rows[0][0] if rows else None


def lock_leased_work_batch(batch_id: int, token: uuid.UUID, *, using: str | None = None) -> bool:
    """Lock the batch until commit if it still runs under ``token``."""
    return bool(_run("lock_leased_work_batch", {"id": batch_id, "token": token}, using))


def complete_work_batch(
    batch_id: int, token: uuid.UUID, *, rows: int, using: str | None = None
) -> bool:
    """Mark the batch succeeded under ``token``; False when the lease was lost."""
    return bool(_run("complete_work_batch", {"id": batch_id, "token": token, "rows": rows}, using))


def fail_work_batch(
    batch_id: int,
    token: uuid.UUID,
    *,
    error: dict[str, Any],
    retry_in: timedelta,
    final: bool = False,
    using: str | None = None,
) -> str | None:
    """Record a failed attempt; returns the new state, or None when the lease was lost."""
    params = {
        "id": batch_id,
        "token": token,
        "error": Jsonb(error),
        "retry_in": retry_in,
        "final": final,
    }
    rows = _run("fail_work_batch", params, using)
    return str(rows[0][0]) if rows else None


def release_work_batch(batch_id: int, token: uuid.UUID, *, using: str | None = None) -> bool:
    """Give the batch back without using an attempt; False when the lease was lost."""
    return bool(_run("release_work_batch", {"id": batch_id, "token": token}, using))


def rescue_expired_work_batches(
    *,
    backoff_base: timedelta,
    backoff_max: timedelta,
    limit: int = 1000,
    using: str | None = None,
) -> list[RescuedBatch]:
    """Return expired leases to pending (after a backoff) or failed (out of attempts)."""
    params = {"limit": limit, "backoff_base": backoff_base, "backoff_max": backoff_max}
    return [RescuedBatch(*r) for r in _run("rescue_expired_work_batches", params, using)]


def prune_finished_work_batches(before: datetime, *, using: str | None = None) -> int:
    """Delete the batches of jobs that fully succeeded before ``before``; returns the count."""
    with pg.kept_cursor(using) as cur:
        cur.execute(queries()["prune_finished_work_batches"], {"before": before})
        return max(cur.rowcount, 0)


def delete_failed_work_batches(ids: Sequence[int], *, using: str | None = None) -> list[int]:
    """Delete failed batches; ids in other states are left alone. Returns the ids deleted."""
    if not ids:
        return []
    return [r[0] for r in _run("delete_failed_work_batches", {"ids": list(ids)}, using)]


def select_failed_work_batch_ids(job: str | None = None, *, using: str | None = None) -> list[int]:
    """Ids of failed batches of ``job`` (or of every job)."""
    return [r[0] for r in _run("select_failed_work_batch_ids", {"job": job}, using)]


def select_job_progress(
    *, job: str | None = None, prefix: str | None = None, using: str | None = None
) -> list[JobRow]:
    """Per-job batch and row tallies (one job, a name prefix, or all)."""
    rows = _run("select_job_progress", {"job": job, "prefix": prefix}, using)
    return [JobRow(*r) for r in rows]

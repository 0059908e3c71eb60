"""Running one claimed work batch end to end.

A batch computes with its job's pinned formulas and date (:func:`prepare_batch`) and, when its
rules need them, phase one's tenant aggregates, computed once per job and id range and stored
with the job so every batch and worker uses the same values (:data:`aggregate_cache`). One
Spark job (``execute.run_range``) computes and writes its rows; the batch is then settled
under its fence (``batches.fenced``): an atomic sink merges its staging table there, so the
sink rows and the batch's ``succeeded`` commit together, while a direct sink's tasks have
written their rows already. The job's error counts and its last successful run are recorded
in the same transaction. How the two write paths work: the module doc of
:mod:`~django_fairqueue.contrib.pipeline.execute`.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import transaction

from django_fairqueue.contrib.pipeline import compile_joins, datastore
from django_fairqueue.contrib.pipeline.core import LongSink, Pipeline, parse_job_name, registry
from django_fairqueue.contrib.pipeline.execute import (
    PipelineError,
    Prepared,
    check_with_spark,
    executor_conninfo,
    integer_key,
    prepare,
    run_range,
    source_frame,
)

logger = logging.getLogger("django_fairqueue.pipeline")

#: the most groups phase one may compute for one job (a GROUP BY past it is refused)
MAX_AGGREGATE_GROUPS = 200_000
_STAGING_NAME = re.compile(r"^fq_stage_(\d+)_([0-9a-f]{32})$")


def staging_name(batch_id: int, lease_token: uuid.UUID) -> str:
    return f"{datastore.STAGING_PREFIX}{batch_id}_{lease_token.hex}"


class _Checked:
    """Formula sets Spark has already accepted in this process, by fingerprint."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str, str]] = set()
        self._lock = threading.Lock()

    def ensure(self, spark: Any, prepared: Prepared) -> None:
        key = (prepared.pipeline.name, prepared.tenant, prepared.fingerprint)
        with self._lock:
            if key in self._seen:
                return
        check_with_spark(spark, prepared)
        with self._lock:
            self._seen.add(key)


checked = _Checked()


@dataclass(frozen=True)
class BatchOutcome:
    batch_id: int
    rows: int
    seconds: float
    spark_seconds: float
    merge_seconds: float


class JobCancelled(RuntimeError):
    """The batch's job was cancelled (``fairpipeline cancel``): nothing is written."""


def pinned(job_name: str, using: str) -> Any:
    """The job's :class:`~django_fairqueue.models.PipelineJob` (its pinned formulas), or None."""
    from django_fairqueue.contrib.pipeline.models import PipelineJob

    return PipelineJob.objects.using(using).filter(job_name=job_name).first()


def prepare_batch(pipeline: Pipeline, tenant: str, job_name: str) -> Prepared:
    """:func:`prepare` with the formula set and date the job was planned with."""
    job = pinned(job_name, pipeline.alias)
    if job is None:  # planned by batches.plan() directly: today's formulas
        return prepare(pipeline, tenant)
    if job.cancelled_at is not None:
        raise JobCancelled(f"job {job_name} was cancelled at {job.cancelled_at:%Y-%m-%d %H:%M}")
    formulas = [tuple(pair) for pair in job.formulas] if job.formulas is not None else None
    return prepare(
        pipeline,
        tenant,
        formulas=formulas,
        today=job.today,
        now=job.created_at,
        output=job.output,
        changed_since=job.changed_since,
    )


class _AggregateCache:
    """Phase one's results per job, version and id range: computed by the first batch that
    needs them, stored with the job (``PipelineJob.aggregates``) so that every batch and every
    worker of the job uses the same values, and kept by the process."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, str, int, int], Any] = {}
        self._lock = threading.Lock()

    def get(self, spark: Any, prepared: Prepared, job_name: str, job_group: str | None) -> Any:
        from django.db.models import Max, Min

        from django_fairqueue.models import WorkBatch

        assert prepared.formulas is not None
        bounds = (
            WorkBatch.objects.using(prepared.pipeline.alias)
            .filter(job_name=job_name)
            .aggregate(lo=Min("start_id"), hi=Max("end_id"))
        )
        lo, hi = int(bounds["lo"]), int(bounds["hi"])
        key = (job_name, prepared.formulas.version, lo, hi)
        with self._lock:
            if key in self._values:
                return self._values[key]
        stored = _stored_aggregates(prepared, job_name, lo, hi)
        if stored is not None:
            with self._lock:
                self._values[key] = stored
            return stored
        rows = source_frame(spark, prepared, lo, hi, job_group)
        context = spark.sparkContext
        if job_group is not None:
            context.addJobTag(job_group)  # a stopping runner cancels this job too
        try:
            values = compile_joins.compute_aggregates(
                rows, prepared.formulas, today=prepared.moment, max_groups=MAX_AGGREGATE_GROUPS
            )
        except ValueError as exc:
            raise PipelineError(str(exc)) from None
        finally:
            if job_group is not None:
                context.removeJobTag(job_group)
        values = _store_aggregates(prepared, job_name, lo, hi, values)
        with self._lock:
            self._values = {k: v for k, v in self._values.items() if k[0] != job_name}
            self._values[key] = values
        return values


aggregate_cache = _AggregateCache()


def _json_value(value: Any) -> Any:
    return value.isoformat() if isinstance(value, dt.date) else value


def _typed_value(value: Any, value_type: str) -> Any:
    from django_fairqueue.contrib.pipeline.formula_tree import DATE_T

    if value is None:
        return None
    if value_type == DATE_T:
        return dt.date.fromisoformat(value)
    return value


def _decode_aggregates(prepared: Prepared, stored: Any) -> Any:
    """Phase one's values from their JSON form (None if they do not fit the formulas)."""
    assert prepared.formulas is not None
    shapes = compile_joins.aggregate_shapes(prepared.formulas)
    if not isinstance(stored, list) or len(stored) != len(shapes):
        return None
    groups = []
    for (keys, nodes), rows in zip(shapes, stored, strict=True):
        types = [k.type for k in keys]
        for node in nodes:
            types += [node.type, "boolean"]
        decoded = tuple(
            tuple(_typed_value(v, t) for v, t in zip(row, types, strict=True)) for row in rows
        )
        groups.append((keys, tuple(nodes), decoded))
    return compile_joins.AggregateValues(groups=tuple(groups))


def _stored_aggregates(prepared: Prepared, job_name: str, lo: int, hi: int) -> Any:
    from django_fairqueue.contrib.pipeline.models import PipelineJob

    assert prepared.formulas is not None
    job = PipelineJob.objects.using(prepared.pipeline.alias).filter(job_name=job_name).first()
    if job is None or not job.aggregates:
        return None
    saved = job.aggregates
    if saved.get("version") != prepared.formulas.version or saved.get("range") != [lo, hi]:
        return None
    return _decode_aggregates(prepared, saved.get("groups"))


def _store_aggregates(prepared: Prepared, job_name: str, lo: int, hi: int, values: Any) -> Any:
    """Store phase one's values with the job unless another worker stored them first; return
    the stored ones (so that every worker computes with the same)."""
    from django_fairqueue.contrib.pipeline.models import PipelineJob

    assert prepared.formulas is not None
    payload = {
        "version": prepared.formulas.version,
        "range": [lo, hi],
        "groups": [[[_json_value(v) for v in row] for row in rows] for _, _, rows in values.groups],
    }
    alias = prepared.pipeline.alias
    with transaction.atomic(using=alias):
        job = (
            PipelineJob.objects.using(alias)
            .select_for_update()
            .filter(job_name=job_name, version=prepared.formulas.version)
            .first()
        )
        if job is None:  # planned without pinning: keep them in the process only
            return values
        saved = job.aggregates or {}
        if saved.get("version") == payload["version"] and saved.get("range") == [lo, hi]:
            stored = _decode_aggregates(prepared, saved.get("groups"))
            return stored if stored is not None else values
        job.aggregates = payload
        job.save(update_fields=["aggregates"])
    return values


def execute_batch(
    spark: Any,
    batch: Any,
    *,
    job_group: str | None = None,
    lease_lost: Callable[[], bool] = lambda: False,
    stopping: Callable[[], bool] = lambda: False,
) -> BatchOutcome:
    """Run a claimed work batch (``batches.ClaimedBatch``) end to end; see the module doc.

    Raises ``LeaseLost`` if the lease was lost (nothing written by this run after the loss),
    :class:`FormulaError` for a bad formula, :class:`JobCancelled` for a cancelled job,
    :class:`RunnerStopping` when ``stopping()`` before the batch's Spark job starts, or
    whatever Spark or the database raised; the staging table (atomic sinks) is dropped in
    every case.
    """
    started = time.monotonic()
    name, tenant = parse_job_name(batch.job_name)
    pipeline = registry.get(name)
    prepared = prepare_batch(pipeline, tenant, batch.job_name)
    checked.ensure(spark, prepared)
    aggregates = None
    if prepared.formulas is not None and prepared.formulas.aggregates:
        aggregates = aggregate_cache.get(spark, prepared, batch.job_name, job_group)
    if prepared.output == "long" or pipeline.sink.atomic:  # a long sink is always atomic
        rows, spark_done = _run_atomic(
            spark, batch, prepared, job_group, lease_lost, aggregates, stopping
        )
    else:
        rows, spark_done = _run_direct(spark, batch, prepared, job_group, aggregates, stopping)
    finished = time.monotonic()
    return BatchOutcome(
        batch_id=batch.id,
        rows=rows,
        seconds=finished - started,
        spark_seconds=spark_done - started,
        merge_seconds=finished - spark_done,
    )


def _settle_job(alias: str, batch: Any, errors: dict[str, int]) -> None:
    """Inside the batch's fence: refuse if the job was cancelled, add the error counts, and
    record the run as the job's last successful one when this batch is its last to succeed."""
    from django_fairqueue.contrib.pipeline.models import PipelineJob
    from django_fairqueue.models import WorkBatch

    job_name = batch.job_name
    job = PipelineJob.objects.using(alias).select_for_update().filter(job_name=job_name).first()
    if job is None:
        return
    if job.cancelled_at is not None:
        raise JobCancelled(f"job {job_name} was cancelled while the batch ran; not written")
    if errors:
        merged = dict(job.errors or {})
        for rule, count in errors.items():
            merged[rule] = int(merged.get(rule, 0)) + count
        job.errors = merged
        job.save(update_fields=["errors"])
    # This batch completes when the fence commits. The job's row lock orders the batches that
    # settle at once: the last of them sees the others succeeded.
    others = WorkBatch.objects.using(alias).filter(job_name=job_name).exclude(pk=batch.id)
    job.record_success(others)


def _run_atomic(
    spark: Any,
    batch: Any,
    prepared: Prepared,
    job_group: str | None,
    lease_lost: Callable[[], bool],
    aggregates: Any = None,
    stopping: Callable[[], bool] = lambda: False,
) -> tuple[int, float]:
    """Spark tasks stage the rows; the driver merges them under the fence (all or nothing)."""
    from django_fairqueue import batches
    from django_fairqueue.exceptions import LeaseLost

    pipeline = prepared.pipeline
    alias = pipeline.alias
    target = prepared.target
    staging = staging_name(batch.id, batch.lease_token)
    statements = datastore.create_staging(
        alias, staging=staging, sink=target.table_name, columns=target.all_columns
    )
    try:
        written = run_range(
            spark,
            prepared,
            batch.start_id,
            batch.end_id,
            staging=statements,
            job_group=job_group,
            aggregates=aggregates,
            stopping=stopping,
        )
        spark_done = time.monotonic()
        if lease_lost():
            raise LeaseLost(f"work batch {batch.id}: lease lost while Spark ran; not written")
        rows = written.rows
        with batches.fenced(batch, using=alias) as fence:
            _settle_job(alias, batch, written.errors)
            if isinstance(target, LongSink):
                rows = datastore.merge_long_staging(
                    alias,
                    staging=staging,
                    sink=target.table_name,
                    id_column=target.id_column,
                    rule_column=target.rule_column,
                    columns=target.all_columns,
                )
            elif written.rows:
                datastore.merge_staging(
                    alias,
                    staging=staging,
                    sink=pipeline.sink.table_name,
                    key=pipeline.sink.key,
                    columns=pipeline.sink.all_columns,
                    key_range=written.key_range,
                )
            datastore.drop_staging(alias, staging)
            fence.rows_processed = rows
    finally:
        _drop_quietly(alias, staging)
    return rows, spark_done


def _run_direct(
    spark: Any,
    batch: Any,
    prepared: Prepared,
    job_group: str | None,
    aggregates: Any = None,
    stopping: Callable[[], bool] = lambda: False,
) -> tuple[int, float]:
    """``atomic=False``: Spark tasks upsert into the sink, each in its own transaction fenced on
    the lease; the driver then completes the batch (no writes of its own)."""
    from django_fairqueue import batches
    from django_fairqueue.exceptions import LeaseLost

    pipeline = prepared.pipeline
    alias = pipeline.alias
    spec = datastore.sink_write_spec(
        alias,
        conninfo=executor_conninfo(alias),
        batch_id=batch.id,
        lease_token=str(batch.lease_token),
        sink=pipeline.sink.table_name,
        key=pipeline.sink.key,
        columns=pipeline.sink.all_columns,
        integer_key=integer_key(prepared),
    )
    try:
        written = run_range(
            spark,
            prepared,
            batch.start_id,
            batch.end_id,
            sink=spec,
            job_group=job_group,
            aggregates=aggregates,
            stopping=stopping,
        )
    except Exception as exc:
        if datastore.LeaseLostInTask.MARKER in str(exc):
            raise LeaseLost(
                f"work batch {batch.id}: lease lost; its Spark tasks refused to write"
            ) from None
        raise
    spark_done = time.monotonic()
    with batches.fenced(batch, using=alias) as fence:
        _settle_job(alias, batch, written.errors)
        fence.rows_processed = written.rows
    return written.rows, spark_done


def _drop_quietly(alias: str, staging: str) -> None:
    try:
        datastore.drop_staging(alias, staging)
    except Exception as exc:  # the orphan cleanup will get it
        logger.warning("could not drop staging table %s: %s", staging, exc)


def drop_orphaned_staging(using: str) -> list[str]:
    """Drop staging tables whose batch is no longer running under the lease that made them
    (their worker crashed or lost its lease). Returns the tables dropped."""
    from django_fairqueue.models import BatchState, WorkBatch

    dropped = []
    for table in datastore.staging_tables(using):
        match = _STAGING_NAME.match(table)
        if match is None:
            continue
        batch_id, token = int(match.group(1)), uuid.UUID(match.group(2))
        alive = (
            WorkBatch.objects.using(using)
            .filter(pk=batch_id, state=BatchState.RUNNING, lease_token=token)
            .exists()
        )
        if not alive:
            datastore.drop_staging(using, table)
            dropped.append(table)
    return dropped

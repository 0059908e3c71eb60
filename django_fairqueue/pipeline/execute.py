"""Running one work batch of a pipeline on Spark, idempotently.

1. Spark tasks read the batch's id range in sub-ranges (one per partition) with psycopg
   ``COPY ... TO STDOUT`` parsed by Arrow's CSV reader (``mapInArrow``; no JDBC jar).
2. Spark applies the tenant's formulas (or the pipeline's transform) and casts each result to
   the sink column's type.
3. Atomic sinks (the default): the same tasks ``COPY`` their rows into an UNLOGGED staging table
   made for this attempt; then the driver, inside ``batches.fenced(batch)``, merges staging into
   the sink (a plain ``INSERT`` when the sink has no row in the staged key range, else ``INSERT
   ... ON CONFLICT (key) DO UPDATE``) and drops the staging table: the sink rows and the batch's
   ``succeeded`` state commit together or not at all, so no partial batch is ever visible.
4. ``Sink(atomic=False)``: each task writes its rows into the sink itself, in one transaction
   that first locks the batch row under the lease (``lock_batch_for_write``: a rescued batch's
   stalled tasks write nothing), COPY for key ranges the sink does not have yet, an upsert for
   the others; the driver then completes the batch under ``batches.fenced`` with no writes.
   The writes run in parallel, but a batch's rows appear partition by partition.

Either way a re-run (crash, retry) writes the same rows again. No transaction is open on the
driver while Spark works (that would pin an xid and hold back vacuum).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from django_fairqueue.pipeline import datastore
from django_fairqueue.pipeline.core import Pipeline, parse_job_name, registry
from django_fairqueue.pipeline.formulas import (
    BOOL,
    DATE,
    DECIMAL,
    FLOAT,
    INT,
    STR,
    FormulaError,
    FormulaSet,
    parse_formulas,
)
from django_fairqueue.pipeline.spark import spark_settings

logger = logging.getLogger("django_fairqueue.pipeline")

#: PostgreSQL type name -> (formula kind, Arrow type name, Spark type).
_SIMPLE_TYPES: dict[str, tuple[str, str, str]] = {
    "int2": (INT, "int16", "smallint"),
    "int4": (INT, "int32", "int"),
    "int8": (INT, "int64", "bigint"),
    "float4": (FLOAT, "float32", "float"),
    "float8": (FLOAT, "float64", "double"),
    "bool": (BOOL, "bool_", "boolean"),
    "text": (STR, "string", "string"),
    "varchar": (STR, "string", "string"),
    "bpchar": (STR, "string", "string"),
    "date": (DATE, "date32", "date"),
}
SUPPORTED_TYPES = "smallint, integer, bigint, real, double precision, numeric(p,s), boolean, " \
    "text, varchar, char, date"  # fmt: skip
_STAGING_NAME = re.compile(r"^fq_stage_(\d+)_([0-9a-f]{32})$")


class PipelineError(RuntimeError):
    """A pipeline cannot run as declared (missing table or column, unsupported type)."""


@dataclass(frozen=True)
class ColumnSpec:
    name: str
    kind: str
    arrow: str
    spark: str


def column_spec(table: str, column: datastore.ColumnType) -> ColumnSpec:
    if column.pg_type == "numeric":
        if column.precision is None or not 1 <= column.precision <= 38:
            raise PipelineError(
                f"{table}.{column.name} is numeric without a precision of at most 38; declare "
                "it numeric(p,s) or double precision"
            )
        p, s = column.precision, column.scale or 0
        return ColumnSpec(column.name, DECIMAL, f"decimal128({p},{s})", f"decimal({p},{s})")
    try:
        kind, arrow, spark = _SIMPLE_TYPES[column.pg_type]
    except KeyError:
        raise PipelineError(
            f"{table}.{column.name} has type {column.pg_type}, which the pipeline does not "
            f"read or write; supported: {SUPPORTED_TYPES}"
        ) from None
    return ColumnSpec(column.name, kind, arrow, spark)


def _columns(using: str, table: str, wanted: tuple[str, ...], role: str) -> list[ColumnSpec]:
    found = datastore.column_types(using, table)
    if not found:
        raise PipelineError(f"the {role} table {table!r} does not exist")
    missing = [c for c in wanted if c not in found]
    if missing:
        raise PipelineError(f"the {role} table {table!r} has no column(s) {missing}")
    return [column_spec(table, found[c]) for c in wanted]


@dataclass(frozen=True)
class Prepared:
    """A pipeline ready to run for one tenant: columns resolved, formulas parsed and checked."""

    pipeline: Pipeline
    tenant: str
    source: tuple[ColumnSpec, ...]
    sink: tuple[ColumnSpec, ...]
    formulas: FormulaSet | None

    @property
    def fingerprint(self) -> str:
        text = repr([f.text for f in self.formulas.formulas]) if self.formulas else "transform"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def prepare(pipeline: Pipeline, tenant: str) -> Prepared:
    """Resolve the tables and parse the tenant's formulas; :class:`FormulaError` if invalid."""
    alias = pipeline.alias
    source = _columns(alias, pipeline.source.table_name, tuple(pipeline.source.columns), "source")
    if pipeline.source.tenant_column is not None:
        _columns(alias, pipeline.source.table_name, (pipeline.source.tenant_column,), "source")
    sink = _columns(alias, pipeline.sink.table_name, pipeline.sink.all_columns, "sink")
    formulas = None
    if pipeline.formulas is not None:
        formulas = parse_formulas(
            tenant,
            pipeline.formulas(tenant),
            columns={c.name: c.kind for c in source},
            targets=pipeline.sink.columns,
            functions=pipeline.functions,
        )
    return Prepared(pipeline, tenant, tuple(source), tuple(sink), formulas)


# --------------------------------------------------------------------------------------------
# Spark


def _spark_schema(columns: tuple[ColumnSpec, ...]) -> str:
    return ", ".join(f"`{c.name}` {c.spark}" for c in columns)


def apply_transform(df: Any, prepared: Prepared) -> Any:
    """The tenant's formulas (or the pipeline's transform), then the sink's columns and types."""
    from pyspark.sql import functions as F

    if prepared.formulas is not None:
        level: dict[str, Any] = {}
        for formula in prepared.formulas.formulas:
            used = _columns_used(formula.spark_sql())
            if formula.target in level or used & set(level):
                df = df.withColumns(level)
                level = {}
            level[formula.target] = F.expr(formula.spark_sql())
        if level:
            df = df.withColumns(level)
    else:
        assert prepared.pipeline.transform is not None
        df = prepared.pipeline.transform(df, prepared.tenant)
    present = set(df.columns)
    selected = []
    for column in prepared.sink:
        value = F.col(f"`{column.name}`") if column.name in present else F.lit(None)
        selected.append(value.cast(column.spark).alias(column.name))
    return df.select(*selected)


def _columns_used(spark_sql: str) -> set[str]:
    return {name.replace("``", "`") for name in re.findall(r"`((?:[^`]|``)+)`", spark_sql)}


@contextmanager
def _quiet_analysis() -> Iterator[None]:
    """PySpark logs every analysis error with its Java stack trace; we report our own."""
    quiet = logging.getLogger("SQLQueryContextLogger")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        quiet.setLevel(level)


def check_with_spark(spark: Any, prepared: Prepared) -> None:
    """Let Spark's analyzer check the formulas against the source schema (no data is read).

    Raises :class:`FormulaError` naming the tenant and the first formula Spark rejects.
    """
    from pyspark.errors import PySparkException

    empty = spark.createDataFrame([], _spark_schema(prepared.source))
    with _quiet_analysis():
        if prepared.formulas is None:
            try:
                _ = apply_transform(empty, prepared).schema
            except PySparkException as exc:
                raise PipelineError(
                    f"pipeline {prepared.pipeline.name!r}, tenant {prepared.tenant!r}: the "
                    f"transform does not fit the source or sink: {_first_line(exc)}"
                ) from None
            return
        try:
            _ = apply_transform(empty, prepared).schema  # one analysis when all is well
            return
        except PySparkException as whole:
            failure = whole
        # Find the first formula Spark rejects, to name it.
        df = empty
        for formula in prepared.formulas.formulas:
            try:
                df = df.withColumns({formula.target: _expr(formula.spark_sql())})
                _ = df.schema
            except PySparkException as exc:
                raise FormulaError(prepared.tenant, formula.text, _first_line(exc)) from None
        raise FormulaError(
            prepared.tenant, "; ".join(prepared.formulas.targets()), _first_line(failure)
        ) from None


def _expr(text: str) -> Any:
    from pyspark.sql import functions as F

    return F.expr(text)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0][:500]


def staging_name(batch_id: int, lease_token: uuid.UUID) -> str:
    return f"{datastore.STAGING_PREFIX}{batch_id}_{lease_token.hex}"


@dataclass(frozen=True)
class Written:
    """What a Spark job wrote: rows, and the smallest and largest key if it is one integer."""

    rows: int
    key_range: tuple[int, int] | None


def integer_key(prepared: Prepared) -> bool:
    """Whether the sink's key is one integer column (its range can be checked cheaply)."""
    key = prepared.pipeline.sink.key
    return len(key) == 1 and any(c.name == key[0] and c.kind == INT for c in prepared.sink)


def run_range(
    spark: Any,
    prepared: Prepared,
    start_id: int,
    end_id: int,
    *,
    staging: datastore.StagingStatements | None = None,
    sink: datastore.SinkWriteSpec | None = None,
    job_group: str | None = None,
) -> Written:
    """One Spark job: read ids start..end in sub-ranges, transform, write.

    With ``staging``, each task COPYs its rows into the staging table (the atomic path); with
    ``sink`` (a :class:`~django_fairqueue.pipeline.datastore.SinkWriteSpec`), each task
    upserts them into the sink in its own transaction, fenced on the batch's lease.
    """
    if (staging is None) == (sink is None):
        raise ValueError("run_range writes to staging or to the sink: give one of them")
    pipeline = prepared.pipeline
    alias = pipeline.alias
    settings = spark_settings()
    parts = settings.partitions or max(1, int(spark.sparkContext.defaultParallelism))
    parts = max(1, min(parts, end_id - start_id + 1))
    conninfo = executor_conninfo(alias)
    read = datastore.ReadSpec(
        conninfo=conninfo,
        statement=datastore.read_statement(
            alias,
            table=pipeline.source.table_name,
            id_column=pipeline.source.id_column,
            columns=pipeline.source.columns,
            tenant_column=pipeline.source.tenant_column,
        ),
        start_id=start_id,
        end_id=end_id,
        parts=parts,
        tenant=prepared.tenant if pipeline.source.tenant_column else None,
        columns=tuple(c.name for c in prepared.source),
        arrow_types=tuple(c.arrow for c in prepared.source),
    )
    from pyspark.sql import functions as F

    context = spark.sparkContext
    if job_group is not None:
        context.addJobTag(job_group)  # cancelJobsWithTag(job_group) stops this job
    try:
        with warnings.catch_warnings():
            # pyspark 4 warns about pandas 3 on every mapInArrow; the Arrow path uses no pandas.
            warnings.filterwarnings("ignore", "PySpark does not yet fully support pandas")
            rows = spark.range(0, parts, 1, parts).mapInArrow(
                partial(datastore.read_sub_ranges, read), _spark_schema(prepared.source)
            )
            out = apply_transform(rows, prepared)
            if staging is not None:
                key_index = 0 if integer_key(prepared) else None
                write = datastore.WriteSpec(
                    conninfo=conninfo, statements=staging, key_index=key_index
                )
                out = out.select(F.spark_partition_id().alias("fq_part"), *out.columns)
                task = partial(datastore.write_staging, write)
            else:
                assert sink is not None
                task = partial(datastore.write_sink, sink)
            results = out.mapInArrow(task, datastore.WRITTEN_SCHEMA).collect()
    finally:
        if job_group is not None:
            context.removeJobTag(job_group)
    lows = [int(r[1]) for r in results if r[1] is not None]
    highs = [int(r[2]) for r in results if r[2] is not None]
    return Written(
        rows=sum(int(r[0]) for r in results),
        key_range=(min(lows), max(highs)) if lows and highs else None,
    )


def executor_conninfo(alias: str) -> str:
    """How Spark tasks connect to the database: every libpq option of ``alias``'s settings."""
    from django_fairqueue.pipeline import spark

    return spark.executor_conninfo(alias)


# --------------------------------------------------------------------------------------------
# A claimed batch


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


def execute_batch(
    spark: Any,
    batch: Any,
    *,
    job_group: str | None = None,
    lease_lost: Callable[[], bool] = lambda: False,
) -> BatchOutcome:
    """Run a claimed work batch (``batches.ClaimedBatch``) end to end; see the module doc.

    Raises ``LeaseLost`` if the lease was lost (nothing written by this run after the loss),
    :class:`FormulaError` for a bad formula, or whatever Spark or the database raised; the
    staging table (atomic sinks) is dropped in every case.
    """
    started = time.monotonic()
    name, tenant = parse_job_name(batch.job_name)
    pipeline = registry.get(name)
    prepared = prepare(pipeline, tenant)
    checked.ensure(spark, prepared)
    if pipeline.sink.atomic:
        rows, spark_done = _run_atomic(spark, batch, prepared, job_group, lease_lost)
    else:
        rows, spark_done = _run_direct(spark, batch, prepared, job_group)
    finished = time.monotonic()
    return BatchOutcome(
        batch_id=batch.id,
        rows=rows,
        seconds=finished - started,
        spark_seconds=spark_done - started,
        merge_seconds=finished - spark_done,
    )


def _run_atomic(
    spark: Any,
    batch: Any,
    prepared: Prepared,
    job_group: str | None,
    lease_lost: Callable[[], bool],
) -> tuple[int, float]:
    """Spark tasks stage the rows; the driver merges them under the fence (all or nothing)."""
    from django_fairqueue import batches
    from django_fairqueue.exceptions import LeaseLost

    pipeline = prepared.pipeline
    alias = pipeline.alias
    staging = staging_name(batch.id, batch.lease_token)
    statements = datastore.create_staging(
        alias, staging=staging, sink=pipeline.sink.table_name, columns=pipeline.sink.all_columns
    )
    try:
        written = run_range(
            spark, prepared, batch.start_id, batch.end_id, staging=statements, job_group=job_group
        )
        spark_done = time.monotonic()
        if lease_lost():
            raise LeaseLost(f"work batch {batch.id}: lease lost while Spark ran; not written")
        with batches.fenced(batch, using=alias) as fence:
            if written.rows:
                datastore.merge_staging(
                    alias,
                    staging=staging,
                    sink=pipeline.sink.table_name,
                    key=pipeline.sink.key,
                    columns=pipeline.sink.all_columns,
                    key_range=written.key_range,
                )
            datastore.drop_staging(alias, staging)
            fence.rows_processed = written.rows
    finally:
        _drop_quietly(alias, staging)
    return written.rows, spark_done


def _run_direct(
    spark: Any, batch: Any, prepared: Prepared, job_group: str | None
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
            spark, prepared, batch.start_id, batch.end_id, sink=spec, job_group=job_group
        )
    except Exception as exc:
        if datastore.LeaseLostInTask.MARKER in str(exc):
            raise LeaseLost(
                f"work batch {batch.id}: lease lost; its Spark tasks refused to write"
            ) from None
        raise
    spark_done = time.monotonic()
    with batches.fenced(batch, using=alias) as fence:
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

"""A work batch's Spark job, idempotently (:mod:`~django_fairqueue.contrib.pipeline.batch_run`
runs a claimed batch end to end with it).

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

import dataclasses
import datetime as dt
import hashlib
import json
import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from functools import partial
from typing import Any

from django_fairqueue.contrib.pipeline import compile_joins, compile_levels, datastore, sqlexpr
from django_fairqueue.contrib.pipeline.core import LongSink, Pipeline
from django_fairqueue.contrib.pipeline.formula_tree import BOOL, DATE, DECIMAL, FLOAT, INT, STR
from django_fairqueue.contrib.pipeline.formulas import (
    FormulaSet,
    LookupTable,
    parse_formulas,
    split_formulas,
)
from django_fairqueue.contrib.pipeline.spark import spark_settings

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
    "jsonb": ("json", "string", "string"),
}
SUPPORTED_TYPES = "smallint, integer, bigint, real, double precision, numeric(p,s), boolean, " \
    "text, varchar, char, date, jsonb (a results column)"  # fmt: skip
#: Groups one tenant aggregate ``BY`` list may have (their values come back to the driver).


class PipelineError(RuntimeError):
    """A pipeline cannot run as declared (missing table or column, unsupported type)."""


class RunnerStopping(RuntimeError):
    """The runner is stopping: the batch's Spark job was not started (the runner gives the
    batch back)."""


@dataclass(frozen=True)
class ColumnSpec:
    name: str
    kind: str
    arrow: str
    spark: str
    max_length: int | None = None  # characters a varchar(n) or char(n) column holds
    #: What a NOT NULL column gets instead of a blank or an error value (None: nullable).
    fill: Any = None


def column_spec(table: str, column: datastore.ColumnType) -> ColumnSpec:
    if column.pg_type == "numeric":
        if column.precision is None or not 1 <= column.precision <= 38:
            raise PipelineError(
                f"{table}.{column.name} is numeric without a precision of at most 38; declare "
                "it numeric(p,s) or double precision"
            )
        p, s = column.precision, column.scale or 0
        return ColumnSpec(column.name, DECIMAL, f"decimal128({p},{s})", f"decimal({p},{s})",
                          fill=_empty(DECIMAL) if column.not_null else None)  # fmt: skip
    try:
        kind, arrow, spark = _SIMPLE_TYPES[column.pg_type]
    except KeyError:
        raise PipelineError(
            f"{table}.{column.name} has type {column.pg_type}, which the pipeline does not "
            f"read or write; supported: {SUPPORTED_TYPES}"
        ) from None
    fill = _empty(kind) if column.not_null else None
    return ColumnSpec(column.name, kind, arrow, spark, column.max_length, fill)


#: What a NOT NULL sink column without a model default gets for a blank or an error value:
#: the empty value of its type (a date's is 1899-12-31, what a blank date compares as).
EMPTY_VALUES: dict[str, Any] = {INT: 0, FLOAT: 0.0, DECIMAL: 0, STR: "", BOOL: False,
                                DATE: dt.date(1899, 12, 31), "json": "{}"}  # fmt: skip


def _empty(kind: str) -> Any:
    return EMPTY_VALUES[kind]


def _model_defaults(table: Any, columns: list[ColumnSpec]) -> list[ColumnSpec]:
    """NOT NULL columns of a model take its field's default (``default=`` or a constant
    ``db_default=``) in place of the empty value."""
    meta = getattr(table, "_meta", None)
    if meta is None:
        return columns
    by_column = {f.column: f for f in meta.concrete_fields}
    filled = []
    for column in columns:
        field = by_column.get(column.name)
        if column.fill is not None and field is not None:
            default = _field_default(field)
            if default is not None:
                column = dataclasses.replace(column, fill=default)
        filled.append(column)
    return filled


def _field_default(field: Any) -> Any:
    db_default = getattr(field, "db_default", None)
    value = getattr(db_default, "value", None)  # a db_default=Value(...) or a constant
    if value is not None:
        return value
    if field.has_default():
        return field.get_default()
    return None


def not_null_fills(prepared: Prepared) -> dict[str, Any]:
    """The typed sink's NOT NULL columns a rule writes, with what a blank or an error value
    becomes there (what ``fairpipeline plan`` warns of)."""
    if prepared.output != "sink" or prepared.formulas is None:
        return {}
    targets = {f.target for f in prepared.formulas.outputs()}
    return {c.name: c.fill for c in prepared.sink if c.fill is not None and c.name in targets}


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
    #: What TODAY() is: the date the job was planned (the same for all its batches).
    today: dt.date
    #: The job's output: ``"sink"`` (the pipeline's sink) or ``"long"`` (its long sink).
    output: str = "sink"
    #: Only rows whose ``Source.changed_column`` is above this (a recompute of changed rows).
    changed_since: Any = None
    #: What NOW() is: when the job was planned, in the pipeline's time zone (no zone attached).
    now: dt.datetime | None = None

    @property
    def moment(self) -> dt.datetime:
        """TODAY()'s date at NOW()'s time of day: what the compiler is given as ``today``."""
        time_of_day = self.now.time() if self.now is not None else dt.time()
        return dt.datetime.combine(self.today, time_of_day)

    @property
    def target(self) -> Any:
        """The sink this job writes: a :class:`Sink` or a :class:`LongSink`."""
        return self.pipeline.output(self.output)

    @property
    def fingerprint(self) -> str:
        """The formula set's content hash (its version), or ``transform``."""
        return self.formulas.version if self.formulas else "transform"


def prepare(
    pipeline: Pipeline,
    tenant: str,
    *,
    formulas: list[tuple[str, str]] | None = None,
    today: dt.date | None = None,
    output: str = "sink",
    changed_since: Any = None,
    now: dt.datetime | None = None,
) -> Prepared:
    """Resolve the tables and parse the tenant's formulas; :class:`FormulaError` if invalid.

    ``now``: the moment the job was planned (default: now), shown in the pipeline's time zone;
    ``today`` defaults to its date there.

    ``formulas``: the pinned formula set of a planned job (default: the tenant's current one).
    ``output``: the sink the job writes (``"sink"`` or ``"long"``, see ``Pipeline.output``).
    """
    alias = pipeline.alias
    source = _columns(alias, pipeline.source.table_name, tuple(pipeline.source.columns), "source")
    if pipeline.source.tenant_column is not None:
        _columns(alias, pipeline.source.table_name, (pipeline.source.tenant_column,), "source")
    if pipeline.source.changed_column is not None:
        _changed_column(alias, pipeline)
    try:
        target = pipeline.output(output)
    except ValueError as exc:
        raise PipelineError(str(exc)) from None
    if isinstance(target, LongSink):
        sink = _long_columns(alias, target)
        targets: Any = None
    else:
        sink = _columns(alias, pipeline.sink.table_name, pipeline.sink.all_columns, "sink")
        sink = [c if c.name not in pipeline.sink.key else dataclasses.replace(c, fill=None)
                for c in _model_defaults(pipeline.sink.table, sink)]  # fmt: skip
        results = pipeline.sink.results
        for column in sink:
            if column.kind == "json" and column.name != results:
                raise PipelineError(
                    f"the sink column {column.name!r} is jsonb: declare it Sink(results=...)"
                )
            if column.name == results and column.kind != "json":
                raise PipelineError(f"the sink's results column {results!r} must be jsonb")
        targets = None if results else pipeline.sink.columns
    parsed = None
    if pipeline.formulas is not None:
        raw = formulas if formulas is not None else pipeline.formulas(tenant)
        parsed = parse_formulas(
            tenant,
            raw,
            columns={c.name: c.kind for c in source},
            targets=targets,
            functions=pipeline.functions,
            lookups=_lookup_tables(pipeline),
        )
    local = local_time(pipeline, tenant, now)
    prepared = Prepared(
        pipeline,
        tenant,
        tuple(source),
        tuple(sink),
        parsed,
        today or local.date(),
        output=output,
        changed_since=changed_since,
        now=local,
    )
    if parsed is not None:
        compile_levels.check_compiles(parsed, today=prepared.moment)
    return prepared


def _lookup_tables(pipeline: Pipeline) -> dict[str, LookupTable]:
    """The pipeline's lookup tables, their columns typed (checked as a sink's are)."""
    tables = {}
    for name, lookup in pipeline.lookups.items():
        wanted = (lookup.key, *lookup.columns)
        specs = _columns(pipeline.alias, lookup.table_name, wanted, f"lookup {name!r}")
        if lookup.tenant_column is not None:
            _columns(pipeline.alias, lookup.table_name, (lookup.tenant_column,), "lookup")
        tables[name] = LookupTable(lookup.key, {c.name: c.kind for c in specs})
    return tables


def lookup_rows(prepared: Prepared) -> dict[str, list[tuple[Any, ...]]]:
    """The rows of the lookup tables the formulas use (read when a batch runs): key first."""
    if prepared.formulas is None:
        return {}
    pipeline = prepared.pipeline
    tables = {}
    for name in sorted(
        {table for table, _key, _columns in compile_joins.lookup_shapes(prepared.formulas)}
    ):
        lookup = pipeline.lookups[name]
        rows = datastore.lookup_rows(
            pipeline.alias,
            table=lookup.table_name,
            key=lookup.key,
            columns=lookup.columns,
            tenant_column=lookup.tenant_column,
            tenant=prepared.tenant,
            limit=lookup.max_rows + 1,
        )
        if len(rows) > lookup.max_rows:
            raise PipelineError(
                f"lookup {name!r} has more than {lookup.max_rows:,} keys for tenant "
                f"{prepared.tenant!r} (Lookup.max_rows)"
            )
        tables[name] = rows
    return tables


def local_time(pipeline: Pipeline, tenant: str, moment: dt.datetime | None = None) -> dt.datetime:
    """``moment`` (default: now) in the tenant's time zone (``Pipeline.time_zone``, else the
    ``TIME_ZONE`` setting of ``FAIRQUEUE_PIPELINE``, else UTC), to the second, zone dropped."""
    from django_fairqueue.contrib.pipeline import appconf

    try:
        zone = appconf.zone(pipeline.zone_of(tenant) or appconf.get()["TIME_ZONE"])
    except ValueError as exc:
        raise PipelineError(f"pipeline {pipeline.name!r}, tenant {tenant!r}: {exc}") from None
    moment = moment or dt.datetime.now(dt.UTC)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.astimezone(zone).replace(tzinfo=None, microsecond=0)


#: The types a changed column may have: a timestamp, or a number that grows.
CHANGED_TYPES = ("timestamptz", "timestamp", "date", "int2", "int4", "int8", "numeric")


def _changed_column(alias: str, pipeline: Pipeline) -> None:
    table, column = pipeline.source.table_name, pipeline.source.changed_column
    assert column is not None
    found = datastore.column_types(alias, table).get(column)
    if found is None:
        raise PipelineError(f"the source table {table!r} has no changed column {column!r}")
    if found.pg_type not in CHANGED_TYPES:
        raise PipelineError(
            f"the source's changed column {table}.{column} is {found.pg_type}: it must be a "
            "timestamp or a number that grows when a row changes (an updated_at or a version)"
        )


def _long_columns(alias: str, sink: LongSink) -> list[ColumnSpec]:
    """The long sink's columns, each checked for its role."""
    columns = _columns(alias, sink.table_name, sink.all_columns, "long sink")
    by_name = {c.name: c for c in columns}
    wanted = [
        (sink.id_column, (INT,), "an integer (the source row's id)"),
        (sink.rule_column, (STR,), "text (the rule's name)"),
        (sink.value_column, ("json",), "jsonb (the value as JSON)"),
        (sink.number_column, (INT, FLOAT, DECIMAL), "a number type"),
        (sink.text_column, (STR,), "text"),
    ]
    for name, kinds, what in wanted:
        if name is not None and by_name[name].kind not in kinds:
            raise PipelineError(f"the long sink's column {name!r} must be {what}")
    for column in columns:
        if column.kind == "json" and column.name != sink.value_column:
            raise PipelineError(f"the long sink's column {column.name!r} is jsonb: not supported")
    return columns


def current_formulas(pipeline: Pipeline, tenant: str) -> list[tuple[str, str]]:
    """The tenant's formulas now, as (name, expression) pairs (what a job pins)."""
    assert pipeline.formulas is not None
    return split_formulas(pipeline.formulas(tenant))


# --------------------------------------------------------------------------------------------
# Spark


def _spark_schema(columns: tuple[ColumnSpec, ...]) -> str:
    return ", ".join(f"`{c.name}` {c.spark}" for c in columns)


def apply_transform(
    df: Any, prepared: Prepared, names: dict[str, Any] | None = None
) -> tuple[Any, list[str]]:
    """The tenant's formulas (or the pipeline's transform), then the sink's columns and types.

    Returns the DataFrame (sink columns, then the error flags of the rules that can have
    errors, packed as ``datastore.ERROR_BITS`` describes) and the names of those rules, in
    flag order. The columns are handed to Spark as SQL text (see :mod:`.compile`).
    """
    present: set[str]
    errors: dict[str, str] = {}
    values: dict[str, str] = {}
    if prepared.formulas is not None:
        df, outputs = compile_levels.apply_formulas(
            df, prepared.formulas, today=prepared.moment, names=dict(names or {})
        )
        for output in outputs:
            values[output.name] = sqlexpr.quoted(output.name)
            if output.error_column is not None:
                errors[output.name] = sqlexpr.quoted(output.error_column)
        present = {c.name for c in prepared.source}
    else:
        assert prepared.pipeline.transform is not None
        df = prepared.pipeline.transform(df, prepared.tenant)
        present = set(df.columns)
        values = {name: sqlexpr.quoted(name) for name in present}
    if prepared.output == "long":
        return _long_rows(df, prepared, values, errors)
    selected = []
    results = prepared.pipeline.sink.results
    typed = {c.name for c in prepared.sink}
    for column in prepared.sink:
        if column.name == results:
            fields = [f"{values[n]} AS {sqlexpr.quoted(n)}" for n in values if n not in typed]
            json = sqlexpr.call("to_json", sqlexpr.call("struct", *fields)) if fields else "'{}'"
            selected.append(f"{json} AS {sqlexpr.quoted(column.name)}")
            continue
        if column.name in values:
            value = values[column.name]
            cast = sqlexpr.try_cast(value, column.spark)
            if prepared.formulas is not None and column.max_length is not None:
                cast = _fitting(cast, column.max_length)
            if prepared.formulas is not None:
                # A value the column cannot hold (out of range, not a date...) is an error.
                bad = sqlexpr.lost(value, cast)
                errors[column.name] = sqlexpr.either(errors.get(column.name), bad)
            selected.append(f"{_filled(cast, column)} AS {sqlexpr.quoted(column.name)}")
        elif column.name in present:
            copied = sqlexpr.cast(sqlexpr.quoted(column.name), column.spark)
            selected.append(f"{_filled(copied, column)} AS {sqlexpr.quoted(column.name)}")
        else:
            selected.append(f"{_filled(sqlexpr.cast('NULL', column.spark), column)} AS "
                            f"{sqlexpr.quoted(column.name)}")  # fmt: skip
    counted = list(errors)
    return df.selectExpr(*selected, *_error_words(errors[n] for n in counted)), counted


def _filled(value: str, column: ColumnSpec) -> str:
    """A NOT NULL column's value: a blank (or an error value, blank by now) becomes its fill,
    so that a batch never fails on the column's constraint."""
    if column.fill is None:
        return value
    fill = column.fill
    if isinstance(fill, Decimal):
        fill = str(fill)
    return sqlexpr.coalesce(value, sqlexpr.cast(sqlexpr.literal(fill), column.spark))


def _fitting(text: str, length: int) -> str:
    """Text a varchar(length) column holds, else NULL (counted as an error by the caller)."""
    return sqlexpr.when((f"(char_length({text}) <= {int(length)})", text))


def _error_words(flags: Iterable[str]) -> list[str]:
    """The trailing columns a write task counts errors from (``datastore.ERROR_BITS``)."""
    words = compile_levels.packed_flags(list(flags), datastore.ERROR_BITS)
    return [
        f"{word} AS {sqlexpr.quoted(f'{compile_levels.ERROR_PREFIX}{j}')}"
        for j, word in enumerate(words)
    ]


def _long_rows(
    df: Any, prepared: Prepared, values: dict[str, str], errors: dict[str, str]
) -> tuple[Any, list[str]]:
    """The long sink's rows: per source row, one row per rule with a value, and a marker row
    (rule NULL) that carries the row's error flags and tells the merge which source rows the
    batch computed (their other rows in the sink are removed)."""
    from pyspark.sql.types import NumericType

    sink = prepared.target
    assert isinstance(sink, LongSink)
    source = {c.name for c in prepared.source}
    rules = (
        list(values) if prepared.formulas is not None else [n for n in values if n not in source]
    )
    types = {f.name: f.dataType for f in df.schema.fields}
    specs = {c.name: c for c in prepared.sink}
    numbers: dict[str, str] = {}
    if sink.number_column is not None:
        spark_type = specs[sink.number_column].spark
        for rule in rules:
            if isinstance(types.get(rule), NumericType):
                cast = sqlexpr.try_cast(values[rule], spark_type)
                numbers[rule] = cast
                if prepared.formulas is not None:  # a number the column cannot hold: an error
                    bad = sqlexpr.lost(values[rule], cast)
                    errors[rule] = sqlexpr.either(errors.get(rule), bad)
    texts = {rule: _as_text(values[rule], types.get(rule)) for rule in rules}
    length = specs[sink.text_column].max_length if sink.text_column is not None else None
    if length is not None and prepared.formulas is not None:
        for rule in rules:  # text the column cannot hold: an error, as for numbers
            fitting = _fitting(texts[rule], length)
            bad = sqlexpr.lost(texts[rule], fitting)
            errors[rule] = sqlexpr.either(errors.get(rule), bad)
            texts[rule] = fitting
    counted = list(errors)

    def entry(rule: str | None) -> str:
        fields = []
        for column in prepared.sink:
            name = column.name
            if name == sink.id_column:
                value = sqlexpr.cast(
                    sqlexpr.quoted(prepared.pipeline.source.id_column), column.spark
                )
            elif name == sink.rule_column:
                value = sqlexpr.cast(sqlexpr.literal(rule), "string")
            elif name not in sink.value_columns:  # copied from the source row
                value = sqlexpr.cast(sqlexpr.quoted(name), column.spark)
            elif rule is None:
                value = sqlexpr.cast("NULL", column.spark)
            elif name == sink.value_column:
                listed = sqlexpr.call("to_json", sqlexpr.call("array", values[rule]))
                value = f"substr({listed}, 2, (length({listed}) - 2))"  # the JSON scalar in [..]
            elif name == sink.number_column:
                value = numbers.get(rule, sqlexpr.cast("NULL", column.spark))
            else:
                value = texts[rule]
            fields.append(f"{value} AS {sqlexpr.quoted(name)}")
        # The marker row carries the source row's error flags; the rules' rows carry none.
        fields += _error_words((errors[n] if rule is None else "false") for n in counted)
        keep = "true" if rule is None else sqlexpr.not_null(values[rule])
        return sqlexpr.call("struct", *fields, f"{keep} AS fq_keep")

    entries = sqlexpr.call("array", entry(None), *(entry(rule) for rule in rules))
    rows = df.selectExpr(sqlexpr.call("inline", entries)).where("fq_keep").drop("fq_keep")
    return rows, counted


def _as_text(value: str, spark_type: Any) -> str:
    """A long sink's text: a double as a spreadsheet shows it, not in Java's E notation
    (integers and decimals print plainly as they are)."""
    from pyspark.sql.types import DoubleType, FloatType

    if isinstance(spark_type, (DoubleType, FloatType)):
        return sqlexpr.when(
            (sqlexpr.not_null(value), sqlexpr.number_text(sqlexpr.cast(value, "double")))
        )
    return sqlexpr.cast(value, "string")


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
    """Let Spark's analyzer check a ``transform`` against the source and sink (no data read).

    Formulas need no such check: they are typed and compiled to columns of known types.
    """
    from pyspark.errors import PySparkException

    if prepared.formulas is not None:
        return
    empty = spark.createDataFrame([], _spark_schema(prepared.source))
    with _quiet_analysis():
        try:
            _ = apply_transform(empty, prepared)[0].schema
        except PySparkException as exc:
            raise PipelineError(
                f"pipeline {prepared.pipeline.name!r}, tenant {prepared.tenant!r}: the "
                f"transform does not fit the source or sink: {_first_line(exc)}"
            ) from None


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0][:500]


@dataclass(frozen=True)
class Written:
    """What a Spark job wrote: rows, the smallest and largest key if it is one integer, and
    the error values per rule."""

    rows: int
    key_range: tuple[int, int] | None
    errors: dict[str, int]


def integer_key(prepared: Prepared) -> bool:
    """Whether the sink's key is one integer column (its range can be checked cheaply)."""
    if prepared.output != "sink":
        return False
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
    aggregates: Any = None,
    stopping: Callable[[], bool] = lambda: False,
) -> Written:
    """One Spark job: read ids start..end in sub-ranges, transform, write.

    With ``staging``, each task COPYs its rows into the staging table (the atomic path); with
    ``sink`` (a :class:`~django_fairqueue.contrib.pipeline.datastore.SinkWriteSpec`), each task
    upserts them into the sink in its own transaction, fenced on the batch's lease.
    :class:`RunnerStopping` if ``stopping()`` says so before the job starts.
    """
    if (staging is None) == (sink is None):
        raise ValueError("run_range writes to staging or to the sink: give one of them")
    settings = spark_settings()
    parts = settings.partitions or max(1, int(spark.sparkContext.defaultParallelism))
    parts = max(1, min(parts, end_id - start_id + 1))
    batch: dict[str, Any] = {"start_id": start_id, "end_id": end_id}
    if staging is not None:
        batch["statements"] = dataclasses.asdict(staging)
    else:
        assert sink is not None
        batch["batch_id"] = sink.batch_id
        batch["lease_token"] = sink.lease_token
    context = spark.sparkContext
    if job_group is not None:
        context.addJobTag(job_group)  # cancelJobsWithTag(job_group) stops this job
    context.setLocalProperty(datastore.BATCH_PROPERTY, json.dumps(batch))
    try:
        with warnings.catch_warnings():
            # pyspark 4 warns about pandas 3 on every mapInArrow; the Arrow path uses no pandas.
            warnings.filterwarnings("ignore", "PySpark does not yet fully support pandas")
            job = plans.get(spark, prepared, parts, aggregates, sink=sink)
            # Last look before the job starts: a stop requested while the driver planned it
            # found no job to cancel.
            if stopping():
                raise RunnerStopping("the runner is stopping: the batch's Spark job not started")
            try:
                results = job.frame.collect()
            except BaseException:
                # The DataFrame keeps what its run left: a broadcast (of the tenant aggregates,
                # of lookup rows) that failed or was cancelled fails every later run of it.
                plans.discard(job)
                raise
    finally:
        context.setLocalProperty(datastore.BATCH_PROPERTY, None)
        if job_group is not None:
            context.removeJobTag(job_group)
    counted = job.counted
    lows = [int(r[1]) for r in results if r[1] is not None]
    highs = [int(r[2]) for r in results if r[2] is not None]
    errors = dict.fromkeys(counted, 0)
    for r in results:
        for name, count in zip(counted, r[3] or (), strict=False):
            errors[name] += int(count)
    return Written(
        rows=sum(int(r[0]) for r in results),
        key_range=(min(lows), max(highs)) if lows and highs else None,
        errors={name: count for name, count in errors.items() if count},
    )


@dataclass(frozen=True)
class _Plan:
    frame: Any  # the DataFrame of write results; its analysed plan is reused
    counted: list[str]  # the rules whose error flags the write tasks count
    aggregates: Any
    pipeline: Pipeline


class _Plans:
    """The Spark plan of a tenant's batches, built once per process and formula version.

    A batch's own values (ids, staging table, lease) reach the tasks as a job property
    (``datastore.BATCH_PROPERTY``), so every batch of a tenant runs the same DataFrame,
    analysed and planned once: with hundreds of formulas that saves seconds per batch. Jobs
    of one formula version share it unless their rules read the job's moment (``TODAY()``,
    ``NOW()``) or tenant aggregates (phase one's values are part of the plan).

    The least recently used plan goes first when ``size`` are kept: a runner takes the
    tenants' batches in turns, so fewer plans than tenants at work would build a plan for
    every batch. A plan whose run failed is dropped (:meth:`discard`).
    """

    size = 32

    def __init__(self) -> None:
        self._plans: dict[tuple[Any, ...], _Plan] = {}
        self._lock = threading.Lock()
        #: Plans built by this process (what a tenant's fixed cost is paid for).
        self.builds = 0

    def get(
        self,
        spark: Any,
        prepared: Prepared,
        parts: int,
        aggregates: Any,
        *,
        sink: datastore.SinkWriteSpec | None,
    ) -> _Plan:
        pipeline = prepared.pipeline
        conninfo = executor_conninfo(pipeline.alias)
        if sink is not None:
            sink = dataclasses.replace(sink, batch_id=0, lease_token="")
        tables = lookup_rows(prepared)
        digest = hashlib.sha256(repr(sorted(tables.items())).encode()).hexdigest()
        key = (
            digest,  # a lookup table edited since: a new plan
            id(spark),
            pipeline.name,
            id(pipeline),  # a Pipeline may hold lists (tenants=[...]): not hashable
            prepared.tenant,
            prepared.fingerprint,
            prepared.moment
            if prepared.formulas and compile_levels.uses_moment(prepared.formulas)
            else None,
            prepared.source,
            prepared.sink,
            prepared.output,
            repr(prepared.changed_since),
            parts,
            conninfo,
            sink,
            id(aggregates),
        )
        with self._lock:
            found = self._plans.pop(key, None)
            if found is not None:
                self._plans[key] = found  # the most recently used: kept longest
        if found is not None and found.aggregates is aggregates and found.pipeline is pipeline:
            return found
        built = self._build(spark, prepared, parts, aggregates, conninfo, sink, tables)
        with self._lock:
            self.builds += 1
            self._plans.pop(key, None)
            while len(self._plans) >= self.size:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = built
        return built

    def discard(self, plan: _Plan) -> None:
        """Forget ``plan`` (its run failed): the tenant's next batch builds its plan anew."""
        with self._lock:
            self._plans = {k: v for k, v in self._plans.items() if v is not plan}

    def _build(
        self,
        spark: Any,
        prepared: Prepared,
        parts: int,
        aggregates: Any,
        conninfo: str,
        sink: datastore.SinkWriteSpec | None,
        tables: dict[str, list[tuple[Any, ...]]],
    ) -> _Plan:
        # The ids 0..0 are placeholders: tasks read the batch's range from the job property.
        rows = source_frame(spark, prepared, 0, parts - 1, None)
        names: dict[str, Any] = {}
        if aggregates is not None:
            assert prepared.formulas is not None
            rows, names = compile_joins.join_aggregates(
                spark, rows, aggregates, today=prepared.moment, formulas=prepared.formulas
            )
        if tables:
            assert prepared.formulas is not None
            columns = {n: (lk.key, *lk.columns) for n, lk in prepared.pipeline.lookups.items()}
            rows, found = compile_joins.join_lookups(
                spark, rows, prepared.formulas, tables, columns, today=prepared.moment
            )
            names.update(found)
        out, counted = apply_transform(rows, prepared, names)
        if sink is None:
            key_index = 0 if integer_key(prepared) else None
            write = datastore.WriteSpec(
                conninfo=conninfo,
                statements=datastore.StagingStatements(clear_part="", copy_in=""),
                key_index=key_index,
                error_columns=len(counted),
            )
            out = out.selectExpr("spark_partition_id() AS fq_part", "*")
            task = partial(datastore.write_staging, write)
        else:
            task = partial(
                datastore.write_sink, dataclasses.replace(sink, error_columns=len(counted))
            )
        frame = out.mapInArrow(task, datastore.WRITTEN_SCHEMA)
        return _Plan(frame, counted, aggregates, prepared.pipeline)


plans = _Plans()


def executor_conninfo(alias: str) -> str:
    """How Spark tasks connect to the database: every libpq option of ``alias``'s settings."""
    from django_fairqueue.contrib.pipeline import spark

    return spark.executor_conninfo(alias)


def source_frame(spark: Any, prepared: Prepared, lo: int, hi: int, job_group: str | None) -> Any:
    """A DataFrame over the tenant's source rows with ids lo..hi (read by Spark tasks)."""
    pipeline = prepared.pipeline
    settings = spark_settings()
    parts = settings.partitions or max(1, int(spark.sparkContext.defaultParallelism))
    parts = max(1, min(parts, hi - lo + 1))
    read = datastore.ReadSpec(
        conninfo=executor_conninfo(pipeline.alias),
        statement=datastore.read_statement(
            pipeline.alias,
            table=pipeline.source.table_name,
            id_column=pipeline.source.id_column,
            columns=pipeline.source.columns,
            tenant_column=pipeline.source.tenant_column,
            changed_column=pipeline.source.changed_column,
            changed_since=prepared.changed_since,
        ),
        start_id=lo,
        end_id=hi,
        parts=parts,
        tenant=prepared.tenant if pipeline.source.tenant_column else None,
        columns=tuple(c.name for c in prepared.source),
        arrow_types=tuple(c.arrow for c in prepared.source),
    )
    return spark.range(0, parts, 1, parts).mapInArrow(
        partial(datastore.read_sub_ranges, read), _spark_schema(prepared.source)
    )

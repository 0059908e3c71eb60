"""The only module that runs data-plane SQL: source reads, staging tables, the sink merge.

Statements come from ``sql/pipeline.sql`` (named templates); identifiers are filled with
``psycopg.sql.Identifier`` and values are always bound. Two kinds of callers:

* the driver (Django is set up): catalog look-ups, staging tables, the fenced merge, on the
  Django connection of the pipeline's database, so the merge joins ``batches.fenced()``'s
  transaction;
* Spark tasks (maybe on another machine, no Django): :func:`read_sub_ranges` and
  :func:`write_staging`, which get a connection string and pre-composed statements and need only
  psycopg and pyarrow. Importing this module imports neither Django's models nor pyarrow.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import psycopg
from psycopg import sql

_NAME_RE = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
STAGING_PREFIX = "fq_stage_"


@cache
def templates() -> dict[str, str]:
    """Named templates of sql/pipeline.sql, loaded once (without their comment lines)."""
    package = resources.files("django_fairqueue.contrib.pipeline")
    text = package.joinpath("sql/pipeline.sql").read_text("utf-8")
    parts = _NAME_RE.split(text)
    named: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in named:
            raise RuntimeError(f"sql/pipeline.sql names {name!r} twice")
        lines = [line for line in body.strip().splitlines() if not line.startswith("--")]
        named[name] = "\n".join(lines).strip().rstrip(";")
    return named


def table_identifier(name: str) -> sql.Identifier:
    """``"schema"."table"`` or ``"table"`` from a (possibly schema-qualified) table name."""
    parts = name.split(".")
    if not 1 <= len(parts) <= 2 or not all(parts):
        raise ValueError(f"not a table name: {name!r}")
    return sql.Identifier(*parts)


def _names(columns: Sequence[str], table: str | None = None) -> sql.Composed:
    if table is None:
        return sql.SQL(", ").join(sql.Identifier(c) for c in columns)
    return sql.SQL(", ").join(sql.Identifier(table, c) for c in columns)


def compose(name: str, **parts: sql.Composable) -> sql.Composed:
    """Template ``name`` with its ``{...}`` fields filled."""
    return sql.SQL(templates()[name]).format(**parts)


# --------------------------------------------------------------------------------------------
# Driver side: on a Django connection


@contextmanager
def _cursor(using: str) -> Iterator[psycopg.Cursor[Any]]:
    from django.db import connections

    wrapper = connections[using]
    wrapper.validate_no_broken_transaction()
    with wrapper.wrap_database_errors:
        wrapper.ensure_connection()
        cur = psycopg.Cursor(wrapper.connection)
        try:
            yield cur
        finally:
            cur.close()


def _execute(
    using: str, statement: sql.Composed, params: Mapping[str, Any] | None = None
) -> list[tuple[Any, ...]]:
    with _cursor(using) as cur:
        cur.execute(statement, dict(params or {}))
        return cur.fetchall() if cur.description is not None else []


@dataclass(frozen=True)
class ColumnType:
    name: str
    pg_type: str  # pg_type.typname: int4, float8, numeric, text, ...
    precision: int | None = None
    scale: int | None = None
    max_length: int | None = None  # of varchar(n) and char(n)
    not_null: bool = False


def column_types(using: str, table: str) -> dict[str, ColumnType]:
    """The table's columns in order; empty if the table does not exist."""
    quoted = table_identifier(table)
    with _cursor(using) as cur:
        rows = cur.execute(
            compose("column_types"), {"table": quoted.as_string(cur.connection)}
        ).fetchall()
    return {row[0]: ColumnType(*row) for row in rows}


def connection_string(using: str) -> str:
    """A libpq connection string for ``using``, for Spark tasks (which have no Django)."""
    from django.db import connections

    params = dict(connections[using].get_connection_params())
    keep = {"dbname", "user", "password", "host", "port", "sslmode", "options", "sslrootcert"}
    flat = {k: v for k, v in params.items() if k in keep and v not in (None, "")}
    return psycopg.conninfo.make_conninfo("", **flat)


def read_statement(
    using: str,
    *,
    table: str,
    id_column: str,
    columns: Sequence[str],
    tenant_column: str | None,
    changed_column: str | None = None,
    changed_since: str | None = None,
) -> str:
    """The COPY statement Spark tasks run for one sub-range (values still placeholders).

    With ``changed_since``: only rows whose ``changed_column`` is above it (composed into the
    statement as a literal: the tasks bind the same values for every statement)."""
    parts: dict[str, sql.Composable] = {
        "columns": _names(columns),
        "table": table_identifier(table),
        "id": sql.Identifier(id_column),
    }
    name = "read_range"
    if tenant_column is not None:
        name = "read_range_of_tenant"
        parts["tenant"] = sql.Identifier(tenant_column)
    if changed_since is not None:
        assert changed_column is not None
        name += "_changed"
        parts["changed"] = sql.Identifier(changed_column)
        parts["since"] = sql.Literal(changed_since)
    with _cursor(using) as cur:
        return compose(name, **parts).as_string(cur.connection)


@dataclass(frozen=True)
class StagingStatements:
    """Pre-composed statements a Spark task runs against a staging table."""

    clear_part: str
    copy_in: str


def create_staging(
    using: str, *, staging: str, sink: str, columns: Sequence[str]
) -> StagingStatements:
    """Create the (empty, UNLOGGED) staging table; return the statements tasks write with."""
    ident = sql.Identifier(staging)
    with _cursor(using) as cur:
        cur.execute(
            compose(
                "create_staging",
                staging=ident,
                columns=_names(columns),
                sink=table_identifier(sink),
            ),
            {},
        )
        return StagingStatements(
            clear_part=compose("clear_staging_part", staging=ident).as_string(cur.connection),
            copy_in=compose("copy_into_staging", staging=ident, columns=_names(columns)).as_string(
                cur.connection
            ),
        )


def _upsert_parts(sink: str, key: Sequence[str], columns: Sequence[str]) -> dict[str, Any]:
    updated = [c for c in columns if c not in key]
    sink_ident = table_identifier(sink)
    sink_name = sink.split(".")[-1]
    return {
        "sink": sink_ident,
        "columns": _names(columns),
        "key": _names(key),
        "updated": _names(updated),
        "excluded": _names(updated, "excluded"),
        "sink_updated": _names(updated, sink_name),
        "_has_updates": bool(updated),
    }


def merge_staging(
    using: str,
    *,
    staging: str,
    sink: str,
    key: Sequence[str],
    columns: Sequence[str],
    key_range: tuple[int, int] | None = None,
) -> int:
    """Upsert the staging table into the sink (in the caller's transaction); rows changed.

    A plain ``INSERT`` when the sink has none of the staged keys (no ``ON CONFLICT`` work per
    row: about twice as fast), else an upsert. ``key_range``: the smallest and largest (single,
    integer) key staged, if known: a sink with no row in it takes the plain ``INSERT`` at once.
    Otherwise (tenants' rows interleave in the table, so other tenants' keys lie in the range;
    or a re-run) the plain ``INSERT`` is tried under a savepoint, and a unique-key conflict
    rolls it back to the upsert: a key already in the sink is never duplicated.
    """
    from django.db import IntegrityError, transaction

    parts = _upsert_parts(sink, key, columns)
    upsert = "merge_staging" if parts.pop("_has_updates") else "merge_staging_keys_only"
    staged = sql.Identifier(staging)
    with _cursor(using) as cur:
        if key_range is not None and len(key) == 1:
            has_keys = compose("sink_has_keys", sink=parts["sink"], key=parts["key"])
            lo, hi = key_range
            if not cur.execute(has_keys, {"lo": lo, "hi": hi}).fetchone()[0]:  # type: ignore[index]
                cur.execute(compose("insert_staging", staging=staged, **parts), {})
                return max(cur.rowcount, 0)
        try:
            with transaction.atomic(using=using):  # a savepoint inside the batch's fence
                cur.execute(compose("insert_staging", staging=staged, **parts), {})
                return max(cur.rowcount, 0)
        except (psycopg.errors.UniqueViolation, IntegrityError) as exc:
            cause = exc if isinstance(exc, psycopg.Error) else exc.__cause__
            if getattr(cause, "sqlstate", None) != "23505":
                raise
        cur.execute(compose(upsert, staging=staged, **parts), {})
        return max(cur.rowcount, 0)


def merge_long_staging(
    using: str,
    *,
    staging: str,
    sink: str,
    id_column: str,
    rule_column: str,
    columns: Sequence[str],
) -> int:
    """Merge a long sink's staging table (in the caller's transaction): remove the rows of the
    staged source rows that were not computed again, upsert the others. Returns the source rows
    the batch computed."""
    key = (id_column, rule_column)
    parts = _upsert_parts(sink, key, columns)
    parts.pop("_has_updates")
    ident = sql.Identifier(staging)
    names = {"id": sql.Identifier(id_column), "rule": sql.Identifier(rule_column)}
    with _cursor(using) as cur:
        cur.execute(compose("analyze_staging", staging=ident), {})
        cur.execute(compose("delete_long_stale", staging=ident, sink=parts["sink"], **names), {})
        cur.execute(compose("merge_long_staging", staging=ident, rule=names["rule"], **parts), {})
        counted = cur.execute(compose("count_long_staged_rows", staging=ident, **names), {})
        return int(counted.fetchone()[0])  # type: ignore[index]


def _tenant_parts(
    table: str, changed_column: str, tenant_column: str | None
) -> dict[str, sql.Composable]:
    return {
        "table": table_identifier(table),
        "changed": sql.Identifier(changed_column),
        "tenant_filter": sql.SQL("{} = %(tenant)s").format(sql.Identifier(tenant_column))
        if tenant_column is not None
        else sql.SQL("TRUE"),
    }


def watermark(
    using: str, *, table: str, changed_column: str, tenant_column: str | None, tenant: str
) -> str | None:
    """The highest value of the changed column over the tenant's rows, as text (None: none)."""
    parts = _tenant_parts(table, changed_column, tenant_column)
    value = _execute(using, compose("select_watermark", **parts), {"tenant": tenant})[0][0]
    return None if value is None else str(value)


def changed_since(
    using: str,
    *,
    table: str,
    changed_column: str,
    tenant_column: str | None,
    tenant: str,
    since: str,
) -> bool:
    """Whether a row of the tenant changed since ``since`` (a watermark)."""
    parts = _tenant_parts(table, changed_column, tenant_column)
    statement = compose("select_changed_exists", since=sql.Literal(since), **parts)
    return bool(_execute(using, statement, {"tenant": tenant})[0][0])


def changed_windows(
    using: str,
    *,
    table: str,
    id_column: str,
    changed_column: str,
    tenant_column: str | None,
    tenant: str,
    since: str,
    size: int,
) -> list[tuple[int, int, int]]:
    """The ids of the tenant's rows changed since ``since``, as windows of ``size`` rows:
    (first id, last id, rows), in id order."""
    parts = _tenant_parts(table, changed_column, tenant_column)
    statement = compose(
        "select_changed_windows", id=sql.Identifier(id_column), since=sql.Literal(since), **parts
    )
    rows = _execute(using, statement, {"tenant": tenant, "size": size})
    return [(int(lo), int(hi), int(count)) for lo, hi, count in rows]


def drop_staging(using: str, staging: str) -> None:
    if not staging.startswith(STAGING_PREFIX):
        raise ValueError(f"not a staging table: {staging!r}")
    _execute(using, compose("drop_staging", staging=sql.Identifier(staging)), {})


def staging_tables(using: str) -> list[str]:
    return [row[0] for row in _execute(using, compose("staging_tables"), {})]


def insert_with_sql_statement(
    using: str,
    *,
    source: str,
    id_column: str,
    tenant_column: str,
    sink: str,
    expressions: Mapping[str, sql.Composable],
) -> str:
    """The benchmark's baseline for one tenant (parameters lo, hi, tenant) as text, for a
    connection of its own: ``INSERT ... SELECT`` of the expressions into a sink that has none of
    the keys (no ``ON CONFLICT``)."""
    statement = compose(
        "insert_with_sql",
        sink=table_identifier(sink),
        columns=_names(list(expressions)),
        expressions=sql.SQL(", ").join(expressions.values()),
        table=table_identifier(source),
        id=sql.Identifier(id_column),
        tenant_filter=compose("tenant_filter", tenant=sql.Identifier(tenant_column)),
    )
    with _cursor(using) as cur:
        return statement.as_string(cur.connection)


def id_range(using: str, table: str, id_column: str) -> tuple[int | None, int | None, int]:
    rows = _execute(
        using, compose("range_of_ids", id=sql.Identifier(id_column), table=table_identifier(table))
    )
    low, high, count = rows[0]
    return low, high, count


def checksum(using: str, table: str, column: str) -> tuple[int, float]:
    statement = compose(
        "sink_checksum", table=table_identifier(table), column=sql.Identifier(column)
    )
    count, total = _execute(using, statement, {})[0]
    return int(count), float(total)


def results_checksum(using: str, table: str, column: str, name: str) -> float:
    statement = compose(
        "results_checksum", table=table_identifier(table), column=sql.Identifier(column)
    )
    return float(_execute(using, statement, {"name": name})[0][0])


def truncate(using: str, table: str) -> None:
    _execute(using, compose("truncate_table", table=table_identifier(table)), {})


def create_bench_tables(using: str, *, source: str, sink: str) -> None:
    _execute(using, compose("create_bench_source", table=table_identifier(source)), {})
    _execute(using, compose("create_bench_sink", table=table_identifier(sink)), {})


def fill_bench_source(
    using: str,
    table: str,
    lo: int,
    hi: int,
    *,
    rows: int,
    tenants: Sequence[str],
    contiguous: bool = False,
) -> None:
    statement = compose("fill_bench_source", table=table_identifier(table))
    params = {"lo": lo, "hi": hi, "rows": rows, "tenants": list(tenants), "contiguous": contiguous}
    _execute(using, statement, params)


def index_bench_source(using: str, table: str) -> None:
    _execute(using, compose("index_bench_source", table=table_identifier(table)), {})


def vacuum_analyze(using: str, table: str) -> None:
    _execute(using, compose("vacuum_analyze_table", table=table_identifier(table)), {})


def backend_pid(using: str) -> int:
    return int(_execute(using, compose("backend_pid"), {})[0][0])


def drop_table(using: str, table: str) -> None:
    """Drop a scratch table of the benchmark (same statement as a staging table's)."""
    _execute(using, compose("drop_staging", staging=table_identifier(table)), {})


# --------------------------------------------------------------------------------------------
# Spark-task side: no Django, a connection string and pre-composed statements


@dataclass(frozen=True)
class ReadSpec:
    """What a Spark task needs to read its sub-ranges of one batch."""

    conninfo: str
    statement: str  # read_range / read_range_of_tenant, placeholders %(lo)s %(hi)s %(tenant)s
    start_id: int
    end_id: int
    parts: int
    tenant: str | None
    columns: tuple[str, ...]
    arrow_types: tuple[str, ...]  # see arrow_type()
    block_size: int = 8 << 20

    def bounds(self, index: int) -> tuple[int, int]:
        """Ids of sub-range ``index`` of ``parts`` (contiguous, covering start..end)."""
        span = self.end_id - self.start_id + 1
        lo = self.start_id + span * index // self.parts
        hi = self.start_id + span * (index + 1) // self.parts - 1
        return lo, hi


def arrow_type(name: str) -> Any:
    """An Arrow type from its short name: int16 int32 int64 float32 float64 bool string date32
    large_string, or decimal128(p,s)."""
    import pyarrow as pa

    match = re.fullmatch(r"decimal128\((\d+),(\d+)\)", name)
    if match:
        return pa.decimal128(int(match.group(1)), int(match.group(2)))
    return getattr(pa, name)()


#: The Spark job property carrying a batch's own values (JSON): its id range, staging
#: statements, batch id and lease token. Tasks read them from it, so one Spark plan serves
#: every batch of a job (analysing a plan of hundreds of formulas takes seconds).
BATCH_PROPERTY = "fairqueue.batch"


def for_batch(spec: Any) -> Any:
    """``spec`` with the running Spark job's batch values (see :data:`BATCH_PROPERTY`)."""
    import dataclasses
    import json

    from pyspark import TaskContext

    context = TaskContext.get()
    raw = context.getLocalProperty(BATCH_PROPERTY) if context is not None else None
    if not raw:
        return spec
    values = json.loads(raw)
    changes: dict[str, Any] = {
        f.name: values[f.name] for f in dataclasses.fields(spec) if f.name in values
    }
    if "statements" in changes:
        changes["statements"] = StagingStatements(**changes["statements"])
    return dataclasses.replace(spec, **changes)


def read_sub_ranges(spec: ReadSpec, indexes: Iterator[Any]) -> Iterator[Any]:
    """``mapInArrow`` function: for each sub-range index, COPY its rows into Arrow batches."""
    import pyarrow as pa

    spec = for_batch(spec)
    import pyarrow.csv as pacsv

    schema = pa.schema(
        [pa.field(c, arrow_type(t)) for c, t in zip(spec.columns, spec.arrow_types, strict=True)]
    )
    has_strings = any("string" in t for t in spec.arrow_types)
    read_options = pacsv.ReadOptions(
        column_names=list(spec.columns), block_size=spec.block_size, use_threads=False
    )
    parse_options = pacsv.ParseOptions(newlines_in_values=has_strings)
    convert_options = pacsv.ConvertOptions(
        column_types=schema,
        true_values=["t"],
        false_values=["f"],
        null_values=[""],
        strings_can_be_null=True,
        quoted_strings_can_be_null=False,
    )

    def parse(rows: list[bytes]) -> Iterator[Any]:
        table = pacsv.read_csv(
            pa.py_buffer(b"".join(rows)),
            read_options=read_options,
            parse_options=parse_options,
            convert_options=convert_options,
        )
        yield from table.to_batches()

    for batch in indexes:
        for index in batch.column(0).to_pylist():
            lo, hi = spec.bounds(index)
            if lo > hi:
                continue
            params = {"lo": lo, "hi": hi, "tenant": spec.tenant}
            with (
                psycopg.connect(spec.conninfo, autocommit=True) as conn,
                conn.cursor().copy(spec.statement, params) as copy,
            ):
                # COPY sends one message per row (so a block always ends on a row boundary).
                # Copying each row to bytes at once and joining them costs about half as much
                # as a file object over the messages, or as keeping the messages' buffers.
                rows: list[bytes] = []
                size = 0
                for row in copy:
                    data = bytes(row)
                    rows.append(data)
                    size += len(data)
                    if size >= spec.block_size:
                        yield from parse(rows)
                        rows, size = [], 0
                if rows:
                    yield from parse(rows)


#: The single-row result of a write task: rows written, smallest and largest integer key.
WRITTEN_SCHEMA = "rows bigint, key_min bigint, key_max bigint, errors array<bigint>"


class LeaseLostInTask(RuntimeError):
    """A Spark task found its batch no longer leased to this run (``lock_batch_for_write``)."""

    MARKER = "fairqueue: work batch lease lost"


@dataclass(frozen=True)
class WriteSpec:
    """What a Spark task needs to write its rows into the (atomic) staging table."""

    conninfo: str
    statements: StagingStatements
    key_index: int | None = None  # column of the single integer key, for its min/max
    error_columns: int = 0  # rules whose error values are counted: see ERROR_BITS


@dataclass(frozen=True)
class SinkWriteSpec:
    """What a Spark task needs to upsert its rows straight into the sink (``atomic=False``)."""

    conninfo: str
    batch_id: int
    lease_token: str
    lock_batch: str  # lock_batch_for_write
    copy_into_sink: str
    copy_into_task_staging: str
    create_task_staging: str
    merge_task_staging: str
    sink_has_keys: str | None  # None unless the key is one integer column
    key_index: int | None = None
    chunk_rows: int = 65_536
    error_columns: int = 0  # rules whose error values are counted: see ERROR_BITS


def sink_write_spec(
    using: str,
    *,
    conninfo: str,
    batch_id: int,
    lease_token: str,
    sink: str,
    key: Sequence[str],
    columns: Sequence[str],
    integer_key: bool,
) -> SinkWriteSpec:
    """The statements of :func:`write_sink`, composed on the driver."""
    parts = _upsert_parts(sink, key, columns)
    merge = "merge_staging" if parts.pop("_has_updates") else "merge_staging_keys_only"
    temp = sql.Identifier("fq_task_rows")
    with _cursor(using) as cur:
        conn = cur.connection
        return SinkWriteSpec(
            conninfo=conninfo,
            batch_id=batch_id,
            lease_token=lease_token,
            lock_batch=compose("lock_batch_for_write").as_string(conn),
            copy_into_sink=compose(
                "copy_rows", table=parts["sink"], columns=parts["columns"]
            ).as_string(conn),
            copy_into_task_staging=compose(
                "copy_rows", table=temp, columns=parts["columns"]
            ).as_string(conn),
            create_task_staging=compose(
                "create_task_staging", staging=temp, columns=parts["columns"], sink=parts["sink"]
            ).as_string(conn),
            merge_task_staging=compose(merge, staging=temp, **parts).as_string(conn),
            sink_has_keys=compose("sink_has_keys", sink=parts["sink"], key=parts["key"]).as_string(
                conn
            )
            if integer_key and len(key) == 1
            else None,
            key_index=list(columns).index(key[0]) if integer_key and len(key) == 1 else None,
        )


#: A row's error flags (one per counted rule) reach the write tasks packed into trailing
#: bigint columns, ERROR_BITS flags each (bit k of column j: rule ERROR_BITS * j + k): a
#: boolean column per rule cost more to move from the JVM to Python than the rules' values.
ERROR_BITS = 62


def error_words(rules: int) -> int:
    """How many trailing columns hold ``rules`` error flags."""
    return -(-rules // ERROR_BITS)


class _Encoder:
    """Arrow batches -> CSV bytes for COPY, counting rows and tracking the key's min and max."""

    def __init__(self, key_index: int | None, skip: int = 0, error_columns: int = 0) -> None:
        import pyarrow.csv as pacsv

        self.key_index = key_index
        self.skip = skip  # leading columns not written (the atomic path's partition number)
        self.words = error_words(error_columns)  # trailing columns counted, not written
        self.errors = [0] * error_columns
        self.options = pacsv.WriteOptions(include_header=False)
        self.rows = 0
        self.key_min: int | None = None
        self.key_max: int | None = None

    def key_range(self, batch: Any) -> tuple[int, int] | None:
        if self.key_index is None or batch.num_rows == 0:
            return None
        import pyarrow.compute as pc

        bounds = pc.min_max(batch.column(self.skip + self.key_index)).as_py()
        if bounds["min"] is None:
            return None
        return int(bounds["min"]), int(bounds["max"])

    def encode(self, batch: Any) -> memoryview:
        import pyarrow.csv as pacsv

        found = self.key_range(batch)
        if found is not None:
            lo, hi = found
            self.key_min = lo if self.key_min is None else min(self.key_min, lo)
            self.key_max = hi if self.key_max is None else max(self.key_max, hi)
        self.rows += batch.num_rows
        if self.words:
            import pyarrow as pa

            width = batch.num_columns - self.words
            for j in range(self.words):
                self._count(j, batch.column(width + j))
            batch = pa.RecordBatch.from_arrays(
                batch.columns[:width], names=batch.schema.names[:width]
            )
        buffer = io.BytesIO()
        pacsv.write_csv(batch, buffer, self.options)
        return buffer.getbuffer()

    def _count(self, word: int, packed: Any) -> None:
        import pyarrow.compute as pc

        if not (pc.max(packed).as_py() or 0):  # the usual case: no error in the batch
            return
        first = word * ERROR_BITS
        for bit in range(min(ERROR_BITS, len(self.errors) - first)):
            flags = pc.bit_wise_and(pc.shift_right(packed, bit), 1)
            self.errors[first + bit] += int(pc.sum(flags).as_py() or 0)

    def result(self) -> Any:
        import pyarrow as pa

        return pa.record_batch(
            [
                pa.array([self.rows], pa.int64()),
                pa.array([self.key_min], pa.int64()),
                pa.array([self.key_max], pa.int64()),
                pa.array([self.errors], pa.list_(pa.int64())),
            ],
            names=["rows", "key_min", "key_max", "errors"],
        )


def write_staging(spec: WriteSpec, batches: Iterator[Any]) -> Iterator[Any]:
    """``mapInArrow`` function: COPY the partition's rows (first column ``fq_part``) into the
    staging table in one transaction; yield one row (rows written, key min and max)."""
    from pyspark import TaskContext

    spec = for_batch(spec)
    context = TaskContext.get()
    part = context.partitionId() if context is not None else 0
    retry = context is not None and context.attemptNumber() > 0
    encoder = _Encoder(spec.key_index, skip=1, error_columns=spec.error_columns)
    with psycopg.connect(spec.conninfo) as conn:  # one transaction, committed on exit
        if retry:  # an earlier attempt of this task may have committed its rows
            conn.execute(spec.statements.clear_part, {"part": part})
        with conn.cursor().copy(spec.statements.copy_in) as copy:
            for batch in batches:
                if batch.num_rows:
                    copy.write(encoder.encode(batch))
    yield encoder.result()


def _chunks(batches: Iterator[Any], rows: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    size = 0
    for batch in batches:
        if not batch.num_rows:
            continue
        chunk.append(batch)
        size += batch.num_rows
        if size >= rows:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def write_sink(spec: SinkWriteSpec, batches: Iterator[Any]) -> Iterator[Any]:
    """``mapInArrow`` function (``atomic=False``): upsert the partition's rows into the sink in
    one transaction fenced on the batch's lease; yield one row (rows written, key min and max).

    The transaction first locks the batch row (``lock_batch_for_write``); if the batch is no
    longer running under this lease, :class:`LeaseLostInTask` is raised and nothing is written.
    Rows go in chunks: a chunk whose integer key range the sink has no row in is COPied straight
    into the sink; so is one whose range has rows (other tenants' keys, interleaved) but none
    of its own keys, tried under a savepoint; other chunks (a re-run, a non-integer key) go
    through a temporary table and one ``INSERT ... ON CONFLICT DO UPDATE``, so a re-run writes
    the same rows.
    """
    spec = for_batch(spec)
    encoder = _Encoder(spec.key_index, error_columns=spec.error_columns)
    with psycopg.connect(spec.conninfo) as conn:  # one transaction, committed on exit
        fenced = conn.execute(
            spec.lock_batch, {"batch": spec.batch_id, "token": spec.lease_token}
        ).fetchone()
        if fenced is None:
            raise LeaseLostInTask(
                f"{LeaseLostInTask.MARKER}: work batch {spec.batch_id} is no longer running "
                "under this lease; this task wrote nothing"
            )
        staged = False
        for chunk in _chunks(batches, spec.chunk_rows):
            target: str | None = spec.copy_into_sink
            if spec.sink_has_keys is None:
                target = spec.copy_into_task_staging
            else:
                ranges = [r for r in (encoder.key_range(b) for b in chunk) if r is not None]
                if ranges:
                    lo = min(r[0] for r in ranges)
                    hi = max(r[1] for r in ranges)
                    row = conn.execute(spec.sink_has_keys, {"lo": lo, "hi": hi}).fetchone()
                    if row is not None and row[0]:
                        target = None  # keys of other tenants or of an earlier run: see below
            encoded = [encoder.encode(batch) for batch in chunk]
            if target is None:
                # Tenants' rows interleave, so the range holds other tenants' keys: COPY into
                # the sink under a savepoint; a key already there rolls it back to the upsert.
                try:
                    with conn.transaction(), conn.cursor().copy(spec.copy_into_sink) as copy:
                        for data in encoded:
                            copy.write(data)
                    continue
                except psycopg.errors.UniqueViolation:
                    target = spec.copy_into_task_staging
            if target == spec.copy_into_task_staging and not staged:
                conn.execute(spec.create_task_staging)
                staged = True
            with conn.cursor().copy(target) as copy:
                for data in encoded:
                    copy.write(data)
        if staged:
            conn.execute(spec.merge_task_staging)
    yield encoder.result()


def lookup_rows(
    using: str,
    *,
    table: str,
    key: str,
    columns: Sequence[str],
    tenant_column: str | None,
    tenant: str,
    limit: int,
) -> list[tuple[Any, ...]]:
    """A lookup table's rows (key, then ``columns``), one per key, the tenant's only if
    ``tenant_column``; at most ``limit``."""
    parts: dict[str, sql.Composable] = {
        "key": sql.Identifier(key),
        "columns": _names([key, *columns]),
        "table": table_identifier(table),
    }
    name = "lookup_rows"
    if tenant_column is not None:
        name = "lookup_rows_of_tenant"
        parts["tenant"] = sql.Identifier(tenant_column)
    with _cursor(using) as cur:
        return cur.execute(compose(name, **parts), {"limit": limit, "tenant": tenant}).fetchall()

"""Declaring pipelines: source, per-tenant transformation, sink; and their registry.

::

    from django_fairqueue.contrib.pipeline import Sink, Source, pipeline

    @pipeline(
        name="analytics.enrich",
        source=Source(DataObject, columns=["id", "tenant", "price", "qty"], tenant_column="tenant"),
        sink=Sink(Result, key=["id"], columns=["tenant", "total"]),
        tenants=lambda: TenantFormula.objects.values_list("tenant", flat=True).distinct(),
    )
    def formulas(tenant):  # the tenant's formulas: ["total = price * qty", ...]
        return TenantFormula.objects.filter(tenant=tenant).values_list("target", "expression")

Workers import every installed app's ``pipelines`` module (like ``tasks``), so a pipeline is
found by name; a work batch's job is named ``"<pipeline>:<tenant>"``.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from django_fairqueue.contrib.pipeline.formula_catalog import DEFAULT_FUNCTIONS

_LOOKUP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_PIPELINE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,99}$")


class UnknownPipeline(LookupError):
    def __init__(self, name: str, known: Sequence[str]) -> None:
        super().__init__(
            f"no pipeline named {name!r} (registered: {', '.join(known) or 'none'}; pipelines "
            "are declared in an installed app's `pipelines` module)"
        )


def _table_name(table: Any) -> str:
    if isinstance(table, str):
        if not table.strip():
            raise ValueError("a table name must not be empty")
        return table
    meta = getattr(table, "_meta", None)
    if meta is None:
        raise TypeError(f"a table is a model class or a table name, got {table!r}")
    return str(meta.db_table)


def _names(values: Iterable[str], what: str) -> tuple[str, ...]:
    if isinstance(values, str):
        values = [values]
    names: tuple[Any, ...] = tuple(values)
    if any(not isinstance(v, str) or not v for v in names):
        raise ValueError(f"{what} must be column names, got {names!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"{what} names a column twice: {names!r}")
    return names


@dataclass(frozen=True)
class Source:
    """Where a batch's rows come from: a table (model or name) with an integer id column."""

    table: Any
    columns: Sequence[str]
    id_column: str = "id"
    #: If set, a tenant's job reads only rows whose column equals the tenant's name.
    tenant_column: str | None = None
    #: A column that grows whenever a row changes: an ``updated_at`` timestamp or a version
    #: number. With it, ``fairpipeline recompute`` recomputes only the rows changed since the
    #: tenant's last successful run (give the table an index on (tenant_column, this column)).
    changed_column: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", _names(self.columns, "Source.columns"))
        if self.changed_column is not None:
            _names([self.changed_column], "Source.changed_column")
        if self.id_column not in self.columns:
            object.__setattr__(self, "columns", (self.id_column, *self.columns))

    @property
    def table_name(self) -> str:
        return _table_name(self.table)


@dataclass(frozen=True)
class Sink:
    """Where results go: a table with a unique key (``INSERT ... ON CONFLICT (key)``).

    Each of ``columns`` is a formula's target, else the source column of the same name, else
    NULL. Key columns come from the source.

    ``results``: a ``jsonb`` column that gets every formula's result by name (``{"total":
    12.5, "band": "high"}``), so a tenant may have any number of rules without a column for
    each; a formula named like one of ``columns`` goes to that (typed) column instead. Without
    ``results``, every formula must be named after one of ``columns``.

    ``atomic`` (default True): a batch's rows appear all at once, with the batch's completion
    (staged, then merged in one transaction by the driver). ``atomic=False``: each Spark task
    upserts its rows straight into the sink in its own transaction, fenced on the batch's
    lease, so the writes run in parallel but a running batch's rows appear partition by
    partition (a failed batch may leave some of them; its re-run writes the same rows).
    """

    table: Any
    key: Sequence[str] = ("id",)
    columns: Sequence[str] = ()
    atomic: bool = True
    results: str | None = None

    def __post_init__(self) -> None:
        key = _names(self.key, "Sink.key")
        if not key:
            raise ValueError("Sink.key needs at least one column")
        object.__setattr__(self, "key", key)
        columns = _names(self.columns, "Sink.columns")
        object.__setattr__(self, "columns", tuple(c for c in columns if c not in key))
        if not isinstance(self.atomic, bool):
            raise ValueError(f"Sink.atomic must be True or False, got {self.atomic!r}")
        if self.results is not None:
            results: Any = self.results  # checked at run time: callers may pass anything
            if not isinstance(results, str) or not results:
                raise ValueError(f"Sink.results must be a column name, got {self.results!r}")
            if self.results in key or self.results in self.columns:
                raise ValueError(f"Sink.results {self.results!r} is also a key or a column")

    @property
    def table_name(self) -> str:
        return _table_name(self.table)

    @property
    def all_columns(self) -> tuple[str, ...]:
        return (*self.key, *self.columns, *([self.results] if self.results else []))


@dataclass(frozen=True)
class LongSink:
    """A long table of results: one row per source row and rule, ``(row id, rule, value)``.

    Unique key: ``(id_column, rule_column)``. Each rule's value goes, typed, into the value
    columns the table has (at least one):

    * ``value_column`` (``jsonb``): the value as a JSON scalar (number, text, boolean; a date
      as ``"YYYY-MM-DD"``), whatever its type;
    * ``number_column`` (``numeric(p,s)``, ``double precision``, ``real``, an integer type):
      the value if the rule gives a number, else NULL; a number the column cannot hold is an
      error value of the rule;
    * ``text_column`` (``text``, ``varchar``): the value as text (numbers, ``true``/``false``,
      dates ``YYYY-MM-DD``).

    ``columns``: more columns copied from the source row (``tenant`` say). A rule whose value
    is blank or an error has no row, and a batch removes the rows of its source rows that it
    did not compute again (a rule removed, a value now blank): after each batch the table holds
    exactly what the job computed for those rows. Always atomic: a batch's rows appear with
    its completion.
    """

    table: Any
    id_column: str = "row_id"
    rule_column: str = "rule"
    value_column: str | None = "value"
    number_column: str | None = None
    text_column: str | None = None
    columns: Sequence[str] = ()

    def __post_init__(self) -> None:
        columns = _names(self.columns, "LongSink.columns")
        object.__setattr__(self, "columns", columns)
        values = [c for c in (self.value_column, self.number_column, self.text_column) if c]
        if not values:
            raise ValueError(
                "LongSink needs a value column: value_column (jsonb), number_column or text_column"
            )
        _names([self.id_column, self.rule_column, *values, *columns], "LongSink's columns")

    @property
    def table_name(self) -> str:
        return _table_name(self.table)

    @property
    def key(self) -> tuple[str, str]:
        return (self.id_column, self.rule_column)

    @property
    def value_columns(self) -> tuple[str, ...]:
        return tuple(c for c in (self.value_column, self.number_column, self.text_column) if c)

    @property
    def all_columns(self) -> tuple[str, ...]:
        return (self.id_column, self.rule_column, *self.value_columns, *self.columns)


@dataclass(frozen=True)
class Lookup:
    """A lookup table a pipeline declares for ``VLOOKUP`` and ``XLOOKUP``: rows found by their
    ``key`` column, giving ``columns`` (VLOOKUP's column 1 is the key, 2 the first of
    ``columns``...). With ``tenant_column``, a tenant's formulas see only its own rows. A key
    is matched exactly (text without case); read when each batch runs, at most
    ``max_rows`` keys."""

    table: Any
    key: str
    columns: Sequence[str]
    tenant_column: str | None = None
    max_rows: int = 200_000

    def __post_init__(self) -> None:
        columns = _names(self.columns, "Lookup.columns")
        if not columns:
            raise ValueError("Lookup.columns needs at least one column")
        _names([self.key, *columns], "Lookup's key and columns")
        if self.tenant_column is not None:
            _names([self.tenant_column], "Lookup.tenant_column")
        object.__setattr__(self, "columns", columns)

    @property
    def table_name(self) -> str:
        return _table_name(self.table)


#: The outputs a job may choose (``plan(..., output=...)``): the pipeline's ``sink``, or its
#: ``long_sink``.
OUTPUTS = ("sink", "long")

Formulas = Any  # mapping {target: expr}, or an iterable of "target = expr" or (target, expr)


@dataclass(frozen=True)
class Pipeline:
    """A declared pipeline. Give ``formulas`` (tenant -> formulas) or ``transform``
    ((DataFrame, tenant) -> DataFrame), not both."""

    name: str
    source: Source
    sink: Sink
    formulas: Callable[[str], Formulas] | None = None
    transform: Callable[[Any, str], Any] | None = None
    #: The tenants the pipeline runs for (``fairpipeline plan`` plans a job for each).
    tenants: Callable[[], Iterable[str]] | Iterable[str] = ()
    #: The functions formulas may call (names, case-insensitive); default: all of them.
    functions: Iterable[str] = field(default_factory=lambda: DEFAULT_FUNCTIONS)
    batch_size: int = 100_000
    max_attempts: int = 3
    #: Django database alias of source, sink and (it must be the same) the work batches.
    database: str | None = None
    #: A second output a job may choose instead of ``sink``: one row per source row and rule.
    long_sink: LongSink | None = None
    #: The time zone of TODAY() and NOW(): an IANA name, or tenant -> name (None: the
    #: ``FAIRQUEUE_PIPELINE`` setting ``TIME_ZONE``, default UTC).
    time_zone: str | Callable[[str], str | None] | None = None
    #: Lookup tables by name, for VLOOKUP and XLOOKUP (``{"prices": Lookup(Price, ...)}``).
    lookups: dict[str, Lookup] = field(default_factory=dict)

    def __post_init__(self) -> None:
        name: Any = self.name  # checked at run time: callers may pass anything
        if not isinstance(name, str) or not _PIPELINE_NAME.match(name):
            raise ValueError(
                f"pipeline name must be 1-100 letters, digits, '_', '.', '-' (no ':'), "
                f"got {self.name!r}"
            )
        functions: Any = self.functions
        if isinstance(functions, str) or not all(isinstance(f, str) for f in functions):
            # (a value of the wrong kind: TypeError, as elsewhere)
            raise TypeError(f"pipeline {self.name!r}: functions must be function names")
        object.__setattr__(self, "functions", frozenset(f.upper() for f in functions))
        if (self.formulas is None) == (self.transform is None):
            raise ValueError(f"pipeline {self.name!r}: give formulas or transform (one of them)")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int):
            raise ValueError(f"pipeline {self.name!r}: batch_size must be an integer")
        if self.batch_size < 1 or self.max_attempts < 1:
            raise ValueError(f"pipeline {self.name!r}: batch_size and max_attempts must be >= 1")
        missing = [c for c in self.sink.key if c not in self.source.columns]
        if missing:
            raise ValueError(
                f"pipeline {self.name!r}: sink key columns {missing} are not source columns"
            )
        lookups: dict[Any, Any] = dict(self.lookups)  # checked at run time: callers pass anything
        for lookup_name, lookup in lookups.items():
            if not isinstance(lookup, Lookup) or not _LOOKUP_NAME.match(str(lookup_name)):
                raise ValueError(
                    f"pipeline {self.name!r}: lookups maps names (letters, digits, _) to Lookup"
                )
        if self.long_sink is not None:
            if not isinstance(self.long_sink, LongSink):
                raise ValueError(f"pipeline {self.name!r}: long_sink must be a LongSink")
            extra = [c for c in self.long_sink.columns if c not in self.source.columns]
            if extra:
                raise ValueError(
                    f"pipeline {self.name!r}: long sink columns {extra} are not source columns"
                )

    def output(self, name: str) -> Sink | LongSink:
        """The sink a job writes to: ``"sink"`` (the default) or ``"long"``."""
        if name == "sink":
            return self.sink
        if name == "long" and self.long_sink is not None:
            return self.long_sink
        if name == "long":
            raise ValueError(f"pipeline {self.name!r} declares no long_sink")
        raise ValueError(f"unknown output {name!r}: choose one of {', '.join(OUTPUTS)}")

    def job_name(self, tenant: str) -> str:
        return f"{self.name}:{tenant}"

    def zone_of(self, tenant: str) -> str | None:
        """The tenant's time zone name, if the pipeline declares one."""
        zone = self.time_zone(tenant) if callable(self.time_zone) else self.time_zone
        return None if zone is None else str(zone)

    def tenant_names(self) -> list[str]:
        tenants = self.tenants() if callable(self.tenants) else self.tenants
        return list(dict.fromkeys(str(t) for t in tenants))

    @property
    def alias(self) -> str:
        from django_fairqueue import conf

        return self.database or conf.get().DATABASE


def parse_job_name(job_name: str) -> tuple[str, str]:
    """``"pipeline:tenant"`` -> ``("pipeline", "tenant")``."""
    name, sep, tenant = job_name.partition(":")
    if not sep or not tenant:
        raise ValueError(f"not a pipeline job name (pipeline:tenant): {job_name!r}")
    return name, tenant


class Registry:
    def __init__(self) -> None:
        self._pipelines: dict[str, Pipeline] = {}
        self._lock = threading.Lock()
        self._discovered = False

    def register(self, pipeline: Pipeline) -> Pipeline:
        with self._lock:
            old = self._pipelines.get(pipeline.name)
            if old is not None and old != pipeline and _origin(old) != _origin(pipeline):
                raise ValueError(f"a pipeline named {pipeline.name!r} is already registered")
            self._pipelines[pipeline.name] = pipeline
        return pipeline

    def unregister(self, name: str) -> None:
        with self._lock:
            self._pipelines.pop(name, None)

    def autodiscover(self) -> None:
        """Import every installed app's ``pipelines`` module."""
        from django.utils.module_loading import autodiscover_modules

        autodiscover_modules("pipelines")
        self._discovered = True

    def get(self, name: str) -> Pipeline:
        if name not in self._pipelines and not self._discovered:
            self.autodiscover()
        try:
            return self._pipelines[name]
        except KeyError:
            raise UnknownPipeline(name, self.names()) from None

    def names(self) -> list[str]:
        if not self._discovered:
            self.autodiscover()
        return sorted(self._pipelines)


def _origin(pipeline: Pipeline) -> str:
    func = pipeline.formulas or pipeline.transform
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', '?')}"


registry = Registry()


def register(pipeline: Pipeline) -> Pipeline:
    """Register a :class:`Pipeline` (call it in an app's ``pipelines`` module)."""
    return registry.register(pipeline)


def pipeline(
    *,
    name: str,
    source: Source,
    sink: Sink,
    tenants: Callable[[], Iterable[str]] | Iterable[str] = (),
    functions: Iterable[str] | None = None,
    batch_size: int = 100_000,
    max_attempts: int = 3,
    database: str | None = None,
    long_sink: LongSink | None = None,
    time_zone: str | Callable[[str], str | None] | None = None,
    lookups: dict[str, Lookup] | None = None,
) -> Callable[[Callable[[str], Formulas]], Pipeline]:
    """Decorate a tenant -> formulas lookup to declare and register a pipeline."""

    def decorate(formulas: Callable[[str], Formulas]) -> Pipeline:
        return register(
            Pipeline(
                name=name,
                source=source,
                sink=sink,
                formulas=formulas,
                tenants=tenants,
                functions=frozenset(functions) if functions is not None else DEFAULT_FUNCTIONS,
                batch_size=batch_size,
                max_attempts=max_attempts,
                database=database,
                long_sink=long_sink,
                time_zone=time_zone,
                lookups=dict(lookups or {}),
            )
        )

    return decorate

"""Values joined to a tenant's rows before its formulas run: the tenant aggregates (phase
one: ``SUM(x)``, ``AVERAGE(x BY region)``, ``RANK(x)``, ... over all the tenant's rows, a row
per group brought back to the driver and broadcast to each batch) and the lookup tables
(``VLOOKUP``, ``XLOOKUP``).

Each join gives the compiler (:mod:`.compile`) a (value, error) pair by name for each
aggregate or lookup, read from the joined rows' columns. PySpark is imported only by the
functions that build DataFrames (the batch runner's side).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django_fairqueue.contrib.pipeline.compile import (
    AGG_PREFIX,
    LOOKUP_PREFIX,
    Compiler,
    Pair,
    lookup_name,
)
from django_fairqueue.contrib.pipeline.formula_catalog import RANK_ASC
from django_fairqueue.contrib.pipeline.formula_tree import BLANK, NUMBER, TEXT, Node
from django_fairqueue.contrib.pipeline.formulas import FormulaSet
from django_fairqueue.contrib.pipeline.sqlexpr import (
    SPARK_TYPES,
    SQL_FALSE,
    SQL_ZERO,
    Expr,
    call,
    cast,
    coalesce,
    is_null,
    literal,
    not_,
    quoted,
    when,
)

# --------------------------------------------------------------------------------------------
# Tenant aggregates (phase one)


@dataclass(frozen=True)
class AggregateValues:
    """What phase one computed: for each distinct ``BY`` list, rows of (group values...,
    aggregate value, aggregate error, ...) for the aggregates that use it."""

    groups: tuple[tuple[tuple[Node, ...], tuple[Node, ...], tuple[tuple[Any, ...], ...]], ...]


def _aggregate_texts(node: Node, value: Expr, error: Expr | None) -> tuple[Expr, Expr]:
    """An aggregate's value over the rows whose argument is not an error, and whether any is."""
    clean = when((not_(error), value)) if error is not None else value
    has_error = f"(max(CAST({error or SQL_FALSE} AS INT)) > (0))"
    match node.value:
        case "SUM":
            return coalesce(call("sum", clean), SQL_ZERO), has_error
        case "AVERAGE":
            return call("avg", clean), f"({has_error} OR (count({clean}) = (0)))"
        case "COUNT" | "RANK" | "RANK_ASC":  # a rank: its group's count, until ranked
            return cast(call("count", clean), "double"), has_error
        case "MEDIAN":
            return call("percentile", clean, "0.5D"), f"({has_error} OR (count({clean}) = (0)))"
        case "MIN":
            return call("min", clean), has_error
        case _:
            return call("max", clean), has_error


def aggregate_shapes(formulas: FormulaSet) -> list[tuple[tuple[Node, ...], list[Node]]]:
    """The aggregates grouped by ``BY`` list, in a fixed order: one Spark aggregation each."""
    by_groups: dict[str, tuple[tuple[Node, ...], list[Node]]] = {}
    for node in formulas.aggregates:
        groups = tuple(node.args[1:])
        key = "|".join(g.key() for g in groups)
        by_groups.setdefault(key, (groups, []))[1].append(node)
    return list(by_groups.values())


def aggregate_plan(
    formulas: FormulaSet, today: dt.date
) -> list[tuple[tuple[Node, ...], list[Node], list[Expr], list[Expr]]]:
    """Per ``BY`` list: its keys' texts, then each aggregate's value and error texts."""
    rules = {f.target: f.tree for f in formulas.formulas}
    compiler = Compiler(today=today, names={}, inline=rules)
    planned = []
    for groups, nodes in aggregate_shapes(formulas):
        keys = [compiler(g)[0] for g in groups]
        columns: list[Expr] = []
        for node in nodes:
            columns += _aggregate_texts(node, *compiler(node.args[0]))
        planned.append((groups, nodes, keys, columns))
    return planned


def compute_aggregates(
    df: Any, formulas: FormulaSet, *, today: dt.date, max_groups: int
) -> AggregateValues:
    """Phase one: every tenant aggregate of ``formulas`` over ``df`` (all the tenant's rows).

    One Spark aggregation per distinct ``BY`` list; the results (one row per group) come back
    to the driver: more than ``max_groups`` groups is a :class:`ValueError`.
    """
    from pyspark.sql import functions as F

    results = []
    for groups, nodes, keys, columns in aggregate_plan(formulas, today):
        by = [F.expr(k).alias(f"g{i}") for i, k in enumerate(keys)]
        values = [F.expr(c).alias(f"{'ve'[i % 2]}{i // 2}") for i, c in enumerate(columns)]
        frame = df.groupBy(*by).agg(*values) if by else df.agg(*values)
        rows = frame.limit(max_groups + 1).collect()
        if len(rows) > max_groups:
            raise ValueError(
                f"tenant {formulas.tenant!r}: an aggregate BY "
                f"{', '.join(g.key() for g in groups)} has more than {max_groups:,} groups"
            )
        plain = [list(row) for row in rows]
        for i, node in enumerate(nodes):
            if node.value in ("RANK", RANK_ASC):
                _rank_groups(plain, len(groups), i, ascending=node.value == RANK_ASC)
        results.append((groups, tuple(nodes), tuple(tuple(row) for row in plain)))
    return AggregateValues(groups=tuple(results))


def _rank_groups(rows: list[list[Any]], keys: int, index: int, *, ascending: bool) -> None:
    """Turn aggregate ``index``'s counts into ranks: the ranked value is key 0, the other keys
    (a RANK's BY groups) partition. A rank is 1 + the rows whose value ranks before; a blank
    value has none (an error value)."""
    column = keys + 2 * index
    partitions: dict[tuple[Any, ...], list[list[Any]]] = {}
    for row in rows:
        partitions.setdefault(tuple(row[1:keys]), []).append(row)
    for members in partitions.values():
        ranked = sorted((r for r in members if r[0] is not None), key=lambda r: r[0],
                        reverse=not ascending)  # fmt: skip
        before = 0.0
        for row in ranked:
            count = row[column]
            row[column] = before + 1
            before += count
        for row in members:
            if row[0] is None:
                row[column], row[column + 1] = None, True


def join_aggregates(
    spark: Any, df: Any, values: AggregateValues, *, today: dt.date, formulas: FormulaSet
) -> tuple[Any, dict[str, Pair]]:
    """Add phase one's results to each row (a broadcast join per ``BY`` list)."""
    from pyspark.sql import functions as F

    rules = {f.target: f.tree for f in formulas.formulas}
    compiler = Compiler(today=today, names={}, inline=rules)
    names: dict[str, Pair] = {}
    for index, (groups, nodes, rows) in enumerate(values.groups):
        prefix = f"{AGG_PREFIX}{index}_"
        if not groups:
            row = rows[0] if rows else None
            for i, node in enumerate(nodes):
                value = row[2 * i] if row is not None else None
                error = bool(row[2 * i + 1]) if row is not None else True
                names[AGG_PREFIX + node.key()] = (
                    cast(literal(value), SPARK_TYPES.get(node.type, "double")),
                    literal(error),
                )
            continue
        key_names = [f"{prefix}g{i}" for i in range(len(groups))]
        df = df.withColumns(
            {n: F.expr(compiler(g)[0]) for n, g in zip(key_names, groups, strict=True)}
        )
        fields = [f"{quoted(prefix + f'k{i}')} {SPARK_TYPES[g.type]}" for i, g in enumerate(groups)]
        for i, node in enumerate(nodes):
            fields += [f"{quoted(prefix + f'v{i}')} {SPARK_TYPES[node.type]}",
                       f"{quoted(prefix + f'e{i}')} boolean"]  # fmt: skip
        table = spark.createDataFrame([list(r) for r in rows], ", ".join(fields))
        condition = " AND ".join(
            f"({quoted(name)} <=> {quoted(f'{prefix}k{i}')})" for i, name in enumerate(key_names)
        )
        df = df.join(F.broadcast(table), on=F.expr(condition), how="left")
        for i, node in enumerate(nodes):
            names[AGG_PREFIX + node.key()] = (
                quoted(f"{prefix}v{i}"),
                coalesce(quoted(f"{prefix}e{i}"), SQL_FALSE),
            )
    return df, names


# --------------------------------------------------------------------------------------------
# Lookup tables (VLOOKUP, XLOOKUP): joined to the rows before the formulas


def lookup_shapes(formulas: FormulaSet) -> list[tuple[str, Node, list[tuple[str, str]]]]:
    """Each distinct (table, key expression): the columns (name, type) read through it."""
    shapes: dict[tuple[str, str], tuple[str, Node, list[tuple[str, str]]]] = {}
    for formula in formulas.formulas:
        for item in formula.tree.walk():
            if item.op != "lookup":
                continue
            table, column = item.value
            key = item.args[0]
            found = shapes.setdefault((table, key.key()), (table, key, []))[2]
            kind = item.type if len(item.args) == 1 else _returned_type(item)
            if (column, kind) not in found:
                found.append((column, kind))
    return list(shapes.values())


def _returned_type(node: Node) -> str:
    """The type of a lookup's column when the lookup has a default (its result's type)."""
    return node.type if node.type != BLANK else node.args[1].type


def join_lookups(
    spark: Any,
    df: Any,
    formulas: FormulaSet,
    tables: Mapping[str, Sequence[tuple[Any, ...]]],
    columns: Mapping[str, Sequence[str]],
    *,
    today: dt.date,
) -> tuple[Any, dict[str, Pair]]:
    """Add each lookup's columns to the rows: a broadcast left join per (table, key
    expression) on the key (text without case). ``tables``: a table's rows, their columns
    named by ``columns[table]`` (the key first)."""
    from pyspark.sql import functions as F

    rules = {f.target: f.tree for f in formulas.formulas}
    compiler = Compiler(today=today, names={}, inline=rules)
    names: dict[str, Pair] = {}
    for index, (table, key, wanted) in enumerate(lookup_shapes(formulas)):
        prefix = f"{LOOKUP_PREFIX}{index}_"
        order = list(columns[table])
        kinds = {c: k for c, k in wanted}
        key_type = SPARK_TYPES.get(key.type, "string")
        fields = [f"k {key_type}", *(f"{quoted('c' + str(i))} {SPARK_TYPES[kinds[c]]}"
                                      for i, c in enumerate(kinds))]  # fmt: skip
        picked = [
            [_lookup_value(row[0], key.type)]
            + [_lookup_value(row[order.index(c)], kinds[c]) for c in kinds]
            for row in tables[table]
        ]
        right = spark.createDataFrame(picked, ", ".join(fields))
        found_key = "lower(k)" if key.type == TEXT else "k"
        right = right.selectExpr(
            f"{found_key} AS {quoted(prefix + 'key')}",
            *(f"{quoted('c' + str(i))} AS {quoted(prefix + 'c' + str(i))}"
              for i in range(len(kinds))),
            f"true AS {quoted(prefix + 'found')}",
        )  # fmt: skip
        value = compiler(key)[0]
        joined = call("lower", value) if key.type == TEXT else value
        df = df.withColumn(prefix + "row", F.expr(joined))
        condition = f"({quoted(prefix + 'row')} = {quoted(prefix + 'key')})"
        df = df.join(F.broadcast(right), on=F.expr(condition), how="left")
        missing = is_null(quoted(prefix + "found"))
        for i, column in enumerate(kinds):
            names[lookup_name(table, column, key)] = (quoted(f"{prefix}c{i}"), missing)
    return df, names


def _lookup_value(value: Any, kind: str) -> Any:
    from decimal import Decimal

    if isinstance(value, Decimal) or (kind == NUMBER and isinstance(value, int)):
        return float(value)
    return value

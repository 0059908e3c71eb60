"""Checked formulas (:mod:`.formulas`) to PySpark ``Column`` objects, with spreadsheet semantics.

No SQL text is built: every node becomes ``pyspark.sql.functions`` calls on columns and
literals, so nothing a tenant writes can reach Spark's SQL parser. Each expression compiles to
a pair ``(value, error)``; ``error`` is a boolean column, or None where no error can occur.

Semantics (the how-to's reference): a blank is 0 in arithmetic, "" in text, FALSE as a
condition; an error (division by zero, ``SQRT(-1)``, ``VALUE("x")``, no true ``IFS``
condition, ...) spreads to every formula that uses it (except through ``IFERROR``,
``ISERROR`` and the untaken branch of ``IF``/``IFS``/``CASE``); a rule whose value is an error
is blank in the sink and counted in the rule's error count. Text comparisons ignore case.

Imports PySpark: only the batch runner uses it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from django_fairqueue.contrib.pipeline.formulas import (
    BLANK,
    BOOLEAN,
    DATE_T,
    NUMBER,
    TEXT,
    FormulaSet,
    Node,
    constant_number,
)

Pair = tuple[Column, Column | None]
ERROR_PREFIX = "__fq_err_"
_AGG_PREFIX = "__fq_agg_"
_INF = float("inf")
_SAFE_INTEGER = 9.0e15  # beyond this a double has no fraction; casts to long are guarded
_BLANK_DATE = dt.date(1899, 12, 31)  # what a blank date compares as (a spreadsheet's day 0)

SPARK_TYPES = {NUMBER: "double", TEXT: "string", BOOLEAN: "boolean", DATE_T: "date"}


def quoted(name: str) -> Column:
    """A column by its exact name (no nested-field or wildcard interpretation)."""
    return F.col("`" + name.replace("`", "``") + "`")


def _or(*errors: Column | None) -> Column | None:
    present = [e for e in errors if e is not None]
    if not present:
        return None
    result = present[0]
    for error in present[1:]:
        result = result | error
    return result


def _bad_number(value: Column) -> Column:
    return F.isnan(value) | (F.abs(value) == F.lit(_INF))


def _number(value: Column) -> Column:
    return F.coalesce(value, F.lit(0.0))


def _whole(value: Column) -> Column:
    """floor() of a (non-blank) number, as a double, without a cast that could overflow."""
    return F.when(F.abs(value) < _SAFE_INTEGER, F.floor(value).cast("double")).otherwise(value)


def _int(value: Column) -> Column:
    """A number as an int (for lengths, months, days): truncated, out of range -> null."""
    return F.when(F.abs(value) < 2.0e9, F.floor(value).cast("int"))


def _text(node: Node, value: Column) -> Column:
    """A value as text, blank as ""."""
    if node.type == TEXT:
        return F.coalesce(value, F.lit(""))
    if node.type == NUMBER:
        whole = (value == F.floor(value)) & (F.abs(value) < _SAFE_INTEGER)
        return F.coalesce(
            F.when(whole, value.try_cast("long").cast("string")).otherwise(value.cast("string")),
            F.lit(""),
        )
    if node.type == BOOLEAN:
        return F.when(value, F.lit("TRUE")).when(~value, F.lit("FALSE")).otherwise(F.lit(""))
    if node.type == DATE_T:
        return F.coalesce(F.date_format(value, "yyyy-MM-dd"), F.lit(""))
    return F.lit("")


def _condition(value: Column) -> Column:
    return F.coalesce(value, F.lit(False))


def _comparable(node: Node, value: Column, other: str) -> Column:
    kind = node.type if node.type != BLANK else other
    if kind == NUMBER:
        return _number(value)
    if kind == TEXT:
        return F.lower(F.coalesce(value, F.lit("")))
    if kind == BOOLEAN:
        return F.coalesce(value, F.lit(False))
    if kind == DATE_T:
        return F.coalesce(value, F.lit(_BLANK_DATE))
    return F.lit(0.0)


@dataclass
class Compiler:
    """Compiles nodes with ``names``: an earlier rule or aggregate -> its (value, error)."""

    today: dt.date
    names: Mapping[str, Pair]
    inline: Mapping[str, Node] | None = None  # phase one: rules compiled in place, not read

    def __call__(self, node: Node) -> Pair:
        method: Callable[[Node], Pair] | None = getattr(self, "_op_" + _method(node.op), None)
        if method is None:
            raise TypeError(f"cannot compile {node.op!r}")
        return method(node)

    def values(self, nodes: Sequence[Node]) -> tuple[list[Column], Column | None]:
        pairs = [self(n) for n in nodes]
        return [p[0] for p in pairs], _or(*(p[1] for p in pairs))

    # names and constants
    def _op_const(self, node: Node) -> Pair:
        if node.type == BLANK:
            return F.lit(None), None
        return F.lit(node.value), None

    def _op_col(self, node: Node) -> Pair:
        value = quoted(node.value)
        if node.type == NUMBER:
            value = value.cast("double")
        return value, None

    def _op_ref(self, node: Node) -> Pair:
        if self.inline is not None and node.value in self.inline:
            return self(self.inline[node.value])
        return self.names[node.value]

    def _op_agg(self, node: Node) -> Pair:
        return self.names[_AGG_PREFIX + node.key()]

    # arithmetic
    def _op_neg(self, node: Node) -> Pair:
        value, error = self(node.args[0])
        return -_number(value), error

    def _arith(self, node: Node) -> Pair:
        (a, b), error = self.values(node.args)
        a, b = _number(a), _number(b)
        match node.op:
            case "+":
                return a + b, error
            case "-":
                return a - b, error
            case "*":
                product = a * b
                return product, _or(error, _bad_number(product))
            case "/":
                return a / F.when(b != 0, b), _or(error, b == 0)
            case "%":
                return a % F.when(b != 0, b), _or(error, b == 0)
            case _:  # ^
                power = F.pow(a, b)
                return power, _or(error, _bad_number(power))

    _op_plus = _op_minus = _op_times = _op_divide = _op_modulo = _op_power = _arith

    def _op_days(self, node: Node) -> Pair:
        (end, start), error = self.values(node.args)
        return F.datediff(end, start).cast("double"), error

    def _op_date_plus(self, node: Node) -> Pair:
        (date, days), error = self.values(node.args)
        return F.date_add(date, _int(_number(days))), error

    def _op_date_minus(self, node: Node) -> Pair:
        (date, days), error = self.values(node.args)
        return F.date_sub(date, _int(_number(days))), error

    # comparisons and logic
    def _compare(self, node: Node) -> Pair:
        left, right = node.args
        (a, b), error = self.values(node.args)
        a = _comparable(left, a, right.type)
        b = _comparable(right, b, left.type)
        result = {
            "=": a == b,
            "<>": a != b,
            "<": a < b,
            "<=": a <= b,
            ">": a > b,
            ">=": a >= b,
        }[node.op]
        return result, error

    _op_eq = _op_ne = _op_lt = _op_le = _op_gt = _op_ge = _compare

    def _op_AND(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        result = _condition(values[0])
        for value in values[1:]:
            result = result & _condition(value)
        return result, error

    def _op_OR(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        result = _condition(values[0])
        for value in values[1:]:
            result = result | _condition(value)
        return result, error

    def _op_XOR(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        count = sum(
            (_condition(v).cast("int") for v in values[1:]), _condition(values[0]).cast("int")
        )
        return (count % 2) == 1, error

    def _op_NOT(self, node: Node) -> Pair:
        value, error = self(node.args[0])
        return ~_condition(value), error

    def _op_IF(self, node: Node) -> Pair:
        condition, condition_error = self(node.args[0])
        then, then_error = self(node.args[1])
        other, other_error = self(node.args[2]) if len(node.args) > 2 else (F.lit(None), None)
        test = _condition(condition)
        error = None
        if then_error is not None or other_error is not None:
            error = F.when(test, then_error if then_error is not None else F.lit(False)).otherwise(
                other_error if other_error is not None else F.lit(False)
            )
        return F.when(test, then).otherwise(other), _or(condition_error, error)

    def _branches(self, pairs: list[tuple[Node, Node]], default: Node | None, fail: bool) -> Pair:
        value: Any = F
        error: Any = F
        any_error = False
        conditions_error = []
        for condition, then in pairs:
            test, test_error = self(condition)
            conditions_error.append(test_error)
            result, result_error = self(then)
            any_error = any_error or result_error is not None
            value = value.when(_condition(test), result)
            error = error.when(_condition(test), result_error if result_error is not None
                               else F.lit(False))  # fmt: skip
        if default is not None:
            result, result_error = self(default)
            value = value.otherwise(result)
            any_error = any_error or result_error is not None
            error = error.otherwise(result_error if result_error is not None else F.lit(False))
        else:
            value = value.otherwise(F.lit(None))
            error = error.otherwise(F.lit(fail))
        branch_error = error if (any_error or fail) else None
        return value, _or(*conditions_error, branch_error)

    def _op_IFS(self, node: Node) -> Pair:
        args = list(node.args)
        return self._branches(list(zip(args[0::2], args[1::2], strict=True)), None, fail=True)

    def _op_case(self, node: Node) -> Pair:
        args = list(node.args)
        default = args.pop() if node.value else None
        return self._branches(list(zip(args[0::2], args[1::2], strict=True)), default, False)

    def _op_IFERROR(self, node: Node) -> Pair:
        value, error = self(node.args[0])
        if error is None:
            return value, None
        other, other_error = self(node.args[1])
        result_error = None
        if other_error is not None:
            result_error = F.when(error, other_error).otherwise(F.lit(False))
        return F.when(error, other).otherwise(value), result_error

    def _op_ISERROR(self, node: Node) -> Pair:
        _, error = self(node.args[0])
        return (error if error is not None else F.lit(False)), None

    def _op_ISBLANK(self, node: Node) -> Pair:
        value, error = self(node.args[0])
        if error is None:
            return value.isNull(), None
        return value.isNull() & ~error, None

    def _op_COALESCE(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        return F.coalesce(*values), error

    def _op_NULLIF(self, node: Node) -> Pair:
        (a, b), error = self.values(node.args)
        return F.when(a.eqNullSafe(b), F.lit(None)).otherwise(a), error

    def _op_cast(self, node: Node) -> Pair:
        source = node.args[0]
        value, error = self(source)
        target, integer, scale = node.value
        if target == TEXT:
            return F.when(value.isNotNull(), _text(source, value)), error
        if source.type == TEXT and target == NUMBER:
            result = F.trim(value).try_cast("double")
        elif source.type == BOOLEAN and target == NUMBER:
            result = F.when(value, F.lit(1.0)).when(~value, F.lit(0.0))
        elif source.type == target:
            result = value
        else:
            result = value.try_cast(SPARK_TYPES[target])
        if target == NUMBER and integer:
            result = F.signum(result) * _whole(F.abs(result))
        elif target == NUMBER and scale is not None:
            result = F.round(result, scale)
        bad = value.isNotNull() & result.isNull() if source.type != target else None
        return result, _or(error, bad)

    # numbers
    def _op_ROUND(self, node: Node) -> Pair:
        value, error = self(node.args[0])
        digits = 0
        if len(node.args) > 1:
            digits = int(constant_number(node.args[1]) or 0)
        return F.round(_number(value), digits), error

    def _unary_number(self, node: Node, f: Callable[[Column], Column]) -> Pair:
        value, error = self(node.args[0])
        return f(_number(value)), error

    def _op_ABS(self, node: Node) -> Pair:
        return self._unary_number(node, F.abs)

    def _op_SIGN(self, node: Node) -> Pair:
        return self._unary_number(node, F.signum)

    def _op_INT(self, node: Node) -> Pair:
        return self._unary_number(node, _whole)

    _op_FLOOR = _op_INT

    def _op_CEILING(self, node: Node) -> Pair:
        return self._unary_number(node, lambda v: -_whole(-v))

    _op_CEIL = _op_CEILING

    def _op_MOD(self, node: Node) -> Pair:
        (a, b), error = self.values(node.args)
        a, b = _number(a), _number(b)
        divisor = F.when(b != 0, b)
        return a - divisor * F.floor(a / divisor), _or(error, b == 0)

    def _op_POWER(self, node: Node) -> Pair:
        (a, b), error = self.values(node.args)
        power = F.pow(_number(a), _number(b))
        return power, _or(error, _bad_number(power))

    _op_POW = _op_POWER

    def _domain(
        self, node: Node, f: Callable[[Column], Column], ok: Callable[[Column], Column]
    ) -> Pair:
        value, error = self(node.args[0])
        value = _number(value)
        valid = ok(value)
        return f(F.when(valid, value)), _or(error, ~valid)

    def _op_SQRT(self, node: Node) -> Pair:
        return self._domain(node, F.sqrt, lambda v: v >= 0)

    def _op_LN(self, node: Node) -> Pair:
        return self._domain(node, F.log, lambda v: v > 0)

    def _op_LOG10(self, node: Node) -> Pair:
        return self._domain(node, F.log10, lambda v: v > 0)

    def _op_EXP(self, node: Node) -> Pair:
        value, error = self(node.args[0])
        result = F.exp(_number(value))
        return result, _or(error, _bad_number(result))

    def _op_MIN(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        return F.least(*values) if len(values) > 1 else values[0], error

    def _op_MAX(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        return F.greatest(*values) if len(values) > 1 else values[0], error

    _op_LEAST = _op_MIN
    _op_GREATEST = _op_MAX

    def _op_SUM(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        total = _number(values[0])
        for value in values[1:]:
            total = total + _number(value)
        return total, error

    def _op_AVERAGE(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        total: Column = F.lit(0.0)
        count: Column = F.lit(0)
        for value in values:
            total = total + _number(value)
            count = count + value.isNotNull().cast("int")
        return total / F.when(count > 0, count), _or(error, count == 0)

    def _op_VALUE(self, node: Node) -> Pair:
        source = node.args[0]
        value, error = self(source)
        if source.type == NUMBER:
            return value, error
        text = F.trim(_text(source, value))
        result = text.try_cast("double")
        return result, _or(error, value.isNotNull() & result.isNull())

    # text
    def _op_CONCAT(self, node: Node) -> Pair:
        pairs = [self(a) for a in node.args]
        texts = [_text(a, p[0]) for a, p in zip(node.args, pairs, strict=True)]
        return F.concat(*texts), _or(*(p[1] for p in pairs))

    _op_CONCATENATE = _op_CONCAT

    def _text_arg(self, node: Node) -> tuple[Column, Column | None]:
        value, error = self(node)
        return _text(node, value), error

    def _count_arg(self, node: Node | None, default: float) -> tuple[Column, Column | None]:
        if node is None:
            return F.lit(default), None
        value, error = self(node)
        return _number(value), error

    def _op_LEFT(self, node: Node) -> Pair:
        text, error = self._text_arg(node.args[0])
        count, count_error = self._count_arg(node.args[1] if len(node.args) > 1 else None, 1)
        return F.left(text, F.coalesce(_int(count), F.lit(0))), _or(error, count_error, count < 0)

    def _op_RIGHT(self, node: Node) -> Pair:
        text, error = self._text_arg(node.args[0])
        count, count_error = self._count_arg(node.args[1] if len(node.args) > 1 else None, 1)
        return F.right(text, F.coalesce(_int(count), F.lit(0))), _or(error, count_error, count < 0)

    def _op_MID(self, node: Node) -> Pair:
        text, error = self._text_arg(node.args[0])
        start, start_error = self._count_arg(node.args[1], 1)
        count, count_error = self._count_arg(node.args[2], 0)
        bad = (start < 1) | (count < 0)
        value = F.substring(
            text,
            F.coalesce(F.when(start >= 1, _int(start)), F.lit(1)),
            F.coalesce(F.when(count >= 0, _int(count)), F.lit(0)),
        )
        return value, _or(error, start_error, count_error, bad)

    def _op_LEN(self, node: Node) -> Pair:
        text, error = self._text_arg(node.args[0])
        return F.length(text).cast("double"), error

    _op_LENGTH = _op_LEN

    def _op_UPPER(self, node: Node) -> Pair:
        text, error = self._text_arg(node.args[0])
        return F.upper(text), error

    def _op_LOWER(self, node: Node) -> Pair:
        text, error = self._text_arg(node.args[0])
        return F.lower(text), error

    def _op_TRIM(self, node: Node) -> Pair:
        text, error = self._text_arg(node.args[0])
        return F.regexp_replace(F.trim(text), F.lit(" {2,}"), F.lit(" ")), error

    def _op_SUBSTITUTE(self, node: Node) -> Pair:
        pairs = [self._text_arg(a) for a in node.args]
        text, old, new = (p[0] for p in pairs)
        return F.replace(text, old, new), _or(*(p[1] for p in pairs))

    # dates
    def _op_DATE(self, node: Node) -> Pair:
        (year, month, day), error = self.values(node.args)
        year, month, day = _number(year), _number(month), _number(day)
        valid = (year >= 1) & (year < 10000) & (F.abs(month) < 120000) & (F.abs(day) < 4.0e6)
        first = F.make_date(F.when(valid, _int(year)), F.lit(1), F.lit(1))
        value = F.date_add(F.add_months(first, _int(month) - 1), _int(day) - 1)
        return F.when(valid, value), _or(error, ~valid)

    def _op_DATEVALUE(self, node: Node) -> Pair:
        source = node.args[0]
        value, error = self(source)
        if source.type == DATE_T:
            return value, error
        result = F.trim(_text(source, value)).try_cast("date")
        return result, _or(error, value.isNotNull() & result.isNull())

    def _date_part(self, node: Node, f: Callable[[Column], Column]) -> Pair:
        value, error = self(node.args[0])
        return f(value).cast("double"), error

    def _op_YEAR(self, node: Node) -> Pair:
        return self._date_part(node, F.year)

    def _op_MONTH(self, node: Node) -> Pair:
        return self._date_part(node, F.month)

    def _op_DAY(self, node: Node) -> Pair:
        return self._date_part(node, F.dayofmonth)

    def _op_WEEKDAY(self, node: Node) -> Pair:
        return self._date_part(node, F.dayofweek)

    def _op_TODAY(self, node: Node) -> Pair:
        return F.lit(self.today), None

    def _op_DAYS(self, node: Node) -> Pair:
        (end, start), error = self.values(node.args)
        return F.datediff(end, start).cast("double"), error

    def _op_DATEDIF(self, node: Node) -> Pair:
        (start, end), error = self.values(node.args[:2])
        unit = str(node.args[2].value).upper()
        if unit == "D":
            value = F.datediff(end, start).cast("double")
        else:
            months = (F.year(end) - F.year(start)) * 12 + F.month(end) - F.month(start)
            months = months - F.when(F.dayofmonth(end) < F.dayofmonth(start), 1).otherwise(0)
            value = (months if unit == "M" else F.floor(months / 12)).cast("double")
        return value, _or(error, end < start)

    def _op_EDATE(self, node: Node) -> Pair:
        (date, months), error = self.values(node.args)
        return F.add_months(date, _int(_number(months))), error

    def _op_EOMONTH(self, node: Node) -> Pair:
        (date, months), error = self.values(node.args)
        return F.last_day(F.add_months(date, _int(_number(months)))), error


_OPERATORS = {
    "+": "plus",
    "-": "minus",
    "*": "times",
    "/": "divide",
    "%": "modulo",
    "^": "power",
    "=": "eq",
    "<>": "ne",
    "<": "lt",
    "<=": "le",
    ">": "gt",
    ">=": "ge",
    "date+": "date_plus",
    "date-": "date_minus",
}


def _method(op: str) -> str:
    return _OPERATORS.get(op, op)


# --------------------------------------------------------------------------------------------
# Tenant aggregates (phase one) and the per-row formulas (phase two)


@dataclass(frozen=True)
class AggregateValues:
    """What phase one computed: for each distinct ``BY`` list, rows of (group values...,
    aggregate value, aggregate error, ...) for the aggregates that use it."""

    groups: tuple[tuple[tuple[Node, ...], tuple[Node, ...], tuple[tuple[Any, ...], ...]], ...]


def _aggregate_column(node: Node, value: Column, error: Column | None) -> tuple[Column, Column]:
    valid = ~error if error is not None else F.lit(True)
    clean = F.when(valid, value)
    has_error = F.max((error if error is not None else F.lit(False)).cast("int")) > 0
    match node.value:
        case "SUM":
            result = F.coalesce(F.sum(clean), F.lit(0.0))
            return result, has_error
        case "AVERAGE":
            return F.avg(clean), has_error | (F.count(clean) == 0)
        case "COUNT":
            return F.count(clean).cast("double"), has_error
        case "MIN":
            return F.min(clean), has_error
        case _:
            return F.max(clean), has_error


def aggregate_shapes(formulas: FormulaSet) -> list[tuple[tuple[Node, ...], list[Node]]]:
    """The aggregates grouped by ``BY`` list, in a fixed order: one Spark aggregation each."""
    by_groups: dict[str, tuple[tuple[Node, ...], list[Node]]] = {}
    for node in formulas.aggregates:
        groups = tuple(node.args[1:])
        key = "|".join(g.key() for g in groups)
        by_groups.setdefault(key, (groups, []))[1].append(node)
    return list(by_groups.values())


def compute_aggregates(
    df: DataFrame, formulas: FormulaSet, *, today: dt.date, max_groups: int
) -> AggregateValues:
    """Phase one: every tenant aggregate of ``formulas`` over ``df`` (all the tenant's rows).

    One Spark aggregation per distinct ``BY`` list; the results (one row per group) come back
    to the driver: more than ``max_groups`` groups is a :class:`ValueError`.
    """
    rules = {f.target: f.tree for f in formulas.formulas}
    compiler = Compiler(today=today, names={}, inline=rules)
    results = []
    for groups, nodes in aggregate_shapes(formulas):
        keys = [compiler(g)[0].alias(f"g{i}") for i, g in enumerate(groups)]
        columns: list[Column] = []
        for i, node in enumerate(nodes):
            value, error = compiler(node.args[0])
            aggregated, has_error = _aggregate_column(node, value, error)
            columns += [aggregated.alias(f"v{i}"), has_error.alias(f"e{i}")]
        frame = df.groupBy(*keys).agg(*columns) if keys else df.agg(*columns)
        rows = frame.limit(max_groups + 1).collect()
        if len(rows) > max_groups:
            raise ValueError(
                f"tenant {formulas.tenant!r}: an aggregate BY "
                f"{', '.join(g.key() for g in groups)} has more than {max_groups:,} groups"
            )
        results.append((groups, tuple(nodes), tuple(tuple(row) for row in rows)))
    return AggregateValues(groups=tuple(results))


def join_aggregates(
    spark: Any, df: DataFrame, values: AggregateValues, *, today: dt.date, formulas: FormulaSet
) -> tuple[DataFrame, dict[str, Pair]]:
    """Add phase one's results to each row (a broadcast join per ``BY`` list)."""
    rules = {f.target: f.tree for f in formulas.formulas}
    compiler = Compiler(today=today, names={}, inline=rules)
    names: dict[str, Pair] = {}
    for index, (groups, nodes, rows) in enumerate(values.groups):
        prefix = f"{_AGG_PREFIX}{index}_"
        if not groups:
            row = rows[0] if rows else None
            for i, node in enumerate(nodes):
                value = row[2 * i] if row is not None else None
                error = bool(row[2 * i + 1]) if row is not None else True
                names[_AGG_PREFIX + node.key()] = (
                    F.lit(value).cast(SPARK_TYPES.get(node.type, "double")),
                    F.lit(error),
                )
            continue
        key_names = [f"{prefix}g{i}" for i in range(len(groups))]
        df = df.withColumns({n: compiler(g)[0] for n, g in zip(key_names, groups, strict=True)})
        fields = [f"`{prefix}k{i}` {SPARK_TYPES[g.type]}" for i, g in enumerate(groups)]
        for i, node in enumerate(nodes):
            fields += [f"`{prefix}v{i}` {SPARK_TYPES[node.type]}", f"`{prefix}e{i}` boolean"]
        table = spark.createDataFrame([list(r) for r in rows], ", ".join(fields))
        condition = None
        for i, name in enumerate(key_names):
            test = quoted(name).eqNullSafe(table[f"`{prefix}k{i}`"])
            condition = test if condition is None else condition & test
        df = df.join(F.broadcast(table), on=condition, how="left")
        for i, node in enumerate(nodes):
            names[_AGG_PREFIX + node.key()] = (
                quoted(f"{prefix}v{i}"),
                F.coalesce(quoted(f"{prefix}e{i}"), F.lit(False)),
            )
    return df, names


@dataclass(frozen=True)
class Output:
    """A rule written to the sink: its column, and its error column if it can have errors."""

    name: str
    type: str
    error_column: str | None


def apply_formulas(
    df: DataFrame, formulas: FormulaSet, *, today: dt.date, names: Mapping[str, Pair]
) -> tuple[DataFrame, list[Output]]:
    """Phase two: each rule as a column (blank where it is an error), plus an error column for
    each rule that can have errors. Rules are added in levels (a rule goes into a new
    ``withColumns`` only when it uses a rule of the current level), keeping the plan shallow."""
    known: dict[str, Pair] = dict(names)
    compiler = Compiler(today=today, names=known)
    level: dict[str, Column] = {}
    level_names: set[str] = set()
    outputs: list[Output] = []
    for formula in formulas.formulas:
        used = _references(formula.tree)
        if used & level_names:
            df = df.withColumns(level)
            level, level_names = {}, set()
        value, error = compiler(formula.tree)
        if formula.tree.type == NUMBER and error is not None:
            error = error | _bad_number(value)
        error_name = None
        if error is not None:
            error_name = ERROR_PREFIX + formula.target
            error = F.coalesce(error, F.lit(False))
            level[error_name] = error
            value = F.when(~error, value)
        level[formula.target] = value
        level_names |= {formula.target, *([error_name] if error_name else [])}
        known[formula.target] = (
            quoted(formula.target),
            quoted(error_name) if error_name else None,
        )
        if not formula.intermediate:
            outputs.append(Output(formula.target, formula.tree.type, error_name))
    if level:
        df = df.withColumns(level)
    return df, outputs


def _references(tree: Node) -> set[str]:
    found: set[str] = set()
    stack = [tree]
    while stack:
        item = stack.pop()
        if item.op == "ref":
            found.add(item.value)
        stack.extend(item.args)
    return found

"""Checked formulas (:mod:`.formulas`) to Spark SQL expression text, with spreadsheet semantics.

Each expression compiles to a pair ``(value, error)`` of Spark SQL expression texts; ``error``
is a boolean expression, or None where no error can occur. A phase hands Spark all its
expressions at once (one ``selectExpr``), and Spark parses them in the JVM: built as PySpark
``Column`` objects instead, a tenant's 200 formulas took about 13,000 calls from Python into
the JVM, 5 s of the tenant's first batch. No Spark session is needed to compile, so a job is
checked when it is planned (:func:`check_compiles`).

What a tenant writes reaches the text only as data, never as SQL: a name goes in backquoted
(a backquote doubled), a text constant as a hexadecimal binary literal cast to a string
(``CAST(X'4869' AS STRING)``: no quote, backslash or escaping setting of Spark's parser comes
into it), a number from a Python float, a date from a date object. Every operator and function
in the text is this module's own, chosen by the checked tree's node types.

Semantics (the how-to's reference): a blank is 0 in arithmetic, "" in text, FALSE as a
condition; an error (division by zero, ``SQRT(-1)``, ``VALUE("x")``, no true ``IFS``
condition, ...) spreads to every formula that uses it (except through ``IFERROR``,
``ISERROR`` and the untaken branch of ``IF``/``IFS``/``CASE``); a rule whose value is an error
is blank in the sink and counted in the rule's error count. Text comparisons ignore case.

PySpark is imported only by the functions that build DataFrames (the batch runner's side).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django_fairqueue.contrib.pipeline.formulas import (
    BLANK,
    BOOLEAN,
    DATE_T,
    NUMBER,
    TEXT,
    FormulaError,
    FormulaSet,
    Node,
    constant_number,
)

Expr = str  # a Spark SQL expression
Pair = tuple[Expr, Expr | None]
ERROR_PREFIX = "__fq_err_"
_AGG_PREFIX = "__fq_agg_"
_BLANK_DATE = dt.date(1899, 12, 31)  # what a blank date compares as (a spreadsheet's day 0)
#: The longest text one rule may compile to. Some functions use their argument more than once
#: (``INT``, text conversion of a number, ``IF``'s condition in value and error), so nesting
#: them repeats text: a formula past this is refused when its job is planned. A 200-character
#: formula compiles to a few thousand characters.
MAX_EXPRESSION_CHARS = 200_000


class TooLong(Exception):
    """A rule's text passed :data:`MAX_EXPRESSION_CHARS` (``args[0]``: the length reached)."""


SPARK_TYPES = {NUMBER: "double", TEXT: "string", BOOLEAN: "boolean", DATE_T: "date"}

_TRUE, _FALSE, _NULL = "true", "false", "NULL"
_ZERO = "0.0D"
_INF = "CAST('Infinity' AS DOUBLE)"
_SAFE_INTEGER = "9.0E15D"  # beyond this a double has no fraction; casts to long are guarded
_INT_RANGE = "2.0E9D"
_EMPTY = "''"


# --------------------------------------------------------------------------------------------
# Text of names, constants and operators


def quoted(name: str) -> Expr:
    """A column by its exact name (no nested-field or wildcard interpretation)."""
    return "`" + name.replace("`", "``") + "`"


def literal(value: Any) -> Expr:
    """A constant as Spark SQL, typed as ``pyspark.sql.functions.lit`` would type it."""
    if value is None:
        return _NULL
    if isinstance(value, bool):
        return _TRUE if value else _FALSE
    if isinstance(value, int):
        if -(2**31) <= value < 2**31:
            return f"({value})"
        if -(2**63) <= value < 2**63:
            return f"({value}L)"
        return literal(float(value))
    if isinstance(value, float):
        if math.isnan(value):
            return "CAST('NaN' AS DOUBLE)"
        if math.isinf(value):
            return _INF if value > 0 else f"(- {_INF})"
        return f"({value!r}D)"
    if isinstance(value, str):
        return f"CAST(X'{value.encode().hex()}' AS STRING)"
    if isinstance(value, dt.date):
        return f"DATE '{value.isoformat()}'"
    raise TypeError(f"no Spark SQL literal for {type(value).__name__}")


def call(name: str, *args: Expr) -> Expr:
    return f"{name}({', '.join(args)})"


def cast(value: Expr, type_: str) -> Expr:
    return f"CAST({value} AS {type_})"


def try_cast(value: Expr, type_: str) -> Expr:
    return f"TRY_CAST({value} AS {type_})"


def when(*branches: tuple[Expr, Expr], otherwise: Expr | None = None) -> Expr:
    """``CASE WHEN ... END``; without ``otherwise`` a value no branch takes is NULL."""
    text = "CASE " + " ".join(f"WHEN {test} THEN {value}" for test, value in branches)
    return text + (f" ELSE {otherwise}" if otherwise is not None else "") + " END"


def _bin(a: Expr, op: str, b: Expr) -> Expr:
    return f"({a} {op} {b})"


def _not(a: Expr) -> Expr:
    return f"(NOT {a})"


def _and(*terms: Expr) -> Expr:
    return "(" + " AND ".join(terms) + ")"


def is_null(value: Expr) -> Expr:
    return f"({value} IS NULL)"


def not_null(value: Expr) -> Expr:
    return f"({value} IS NOT NULL)"


def lost(before: Expr, after: Expr) -> Expr:
    """A value a conversion turned into NULL (a cast that failed): an error value."""
    return _and(not_null(before), is_null(after))


def coalesce(*values: Expr) -> Expr:
    return call("coalesce", *values)


def or_errors(*errors: Expr | None) -> Expr | None:
    """Any of the error conditions given (None: none can occur)."""
    present = [e for e in errors if e is not None]
    if not present:
        return None
    return present[0] if len(present) == 1 else "(" + " OR ".join(present) + ")"


def either(error: Expr | None, other: Expr) -> Expr:
    """``error`` or ``other`` (``other`` alone when there is no ``error``)."""
    return other if error is None else f"({error} OR {other})"


def _bad_number(value: Expr) -> Expr:
    """NaN or infinite (NULL for NULL). Spark orders NaN above infinity, so one comparison
    covers both and the value is written once."""
    return f"(NOT (abs({value}) < {_INF}))"


def _number(value: Expr) -> Expr:
    return coalesce(value, _ZERO)


def _whole(value: Expr) -> Expr:
    """floor() of a (non-blank) number, as a double, without a cast that could overflow."""
    return when((f"(abs({value}) < {_SAFE_INTEGER})", cast(call("floor", value), "double")),
                otherwise=value)  # fmt: skip


def _int(value: Expr) -> Expr:
    """A number as an int (for lengths, months, days): truncated, out of range -> NULL."""
    return when((f"(abs({value}) < {_INT_RANGE})", cast(call("floor", value), "int")))


def _text(node: Node, value: Expr) -> Expr:
    """A value as text, blank as ""."""
    if node.type == TEXT:
        return coalesce(value, _EMPTY)
    if node.type == NUMBER:
        # floor() gives a bigint: only asked of a number it fits (else ANSI mode fails the job)
        whole = when((f"(abs({value}) < {_SAFE_INTEGER})", _bin(value, "=", call("floor", value))),
                     otherwise=_FALSE)  # fmt: skip
        as_text = when((whole, cast(try_cast(value, "bigint"), "string")),
                       otherwise=cast(value, "string"))  # fmt: skip
        return coalesce(as_text, _EMPTY)
    if node.type == BOOLEAN:
        return when((value, "'TRUE'"), (_not(value), "'FALSE'"), otherwise=_EMPTY)
    if node.type == DATE_T:
        return coalesce(call("date_format", value, "'yyyy-MM-dd'"), _EMPTY)
    return _EMPTY


def _condition(value: Expr) -> Expr:
    return coalesce(value, _FALSE)


def _comparable(node: Node, value: Expr, other: str) -> Expr:
    kind = node.type if node.type != BLANK else other
    if kind == NUMBER:
        return _number(value)
    if kind == TEXT:
        return call("lower", coalesce(value, _EMPTY))
    if kind == BOOLEAN:
        return coalesce(value, _FALSE)
    if kind == DATE_T:
        return coalesce(value, literal(_BLANK_DATE))
    return _ZERO


# --------------------------------------------------------------------------------------------
# The compiler


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
        value, error = method(node)
        # Checked at every node, so a text that grows by repetition stops here, small.
        length = max(len(value), len(error or ""))
        if length > MAX_EXPRESSION_CHARS:
            raise TooLong(length)
        return value, error

    def values(self, nodes: Sequence[Node]) -> tuple[list[Expr], Expr | None]:
        pairs = [self(n) for n in nodes]
        return [p[0] for p in pairs], or_errors(*(p[1] for p in pairs))

    # names and constants
    def _op_const(self, node: Node) -> Pair:
        if node.type == BLANK:
            return _NULL, None
        return literal(node.value), None

    def _op_col(self, node: Node) -> Pair:
        value = quoted(node.value)
        if node.type == NUMBER:
            value = cast(value, "double")
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
        return f"(- {_number(value)})", error

    def _arith(self, node: Node) -> Pair:
        (a, b), error = self.values(node.args)
        a, b = _number(a), _number(b)
        match node.op:
            case "+" | "-":
                return _bin(a, node.op, b), error
            case "*":
                product = _bin(a, "*", b)
                return product, or_errors(error, _bad_number(product))
            case "/" | "%":
                divisor = when((_bin(b, "<>", "(0)"), b))
                return _bin(a, node.op, divisor), or_errors(error, _bin(b, "=", "(0)"))
            case _:  # ^
                power = call("power", a, b)
                return power, or_errors(error, _bad_number(power))

    _op_plus = _op_minus = _op_times = _op_divide = _op_modulo = _op_power = _arith

    def _op_days(self, node: Node) -> Pair:
        (end, start), error = self.values(node.args)
        return cast(call("datediff", end, start), "double"), error

    def _op_date_plus(self, node: Node) -> Pair:
        (date, days), error = self.values(node.args)
        return call("date_add", date, _int(_number(days))), error

    def _op_date_minus(self, node: Node) -> Pair:
        (date, days), error = self.values(node.args)
        return call("date_sub", date, _int(_number(days))), error

    # comparisons and logic
    def _compare(self, node: Node) -> Pair:
        left, right = node.args
        (a, b), error = self.values(node.args)
        a = _comparable(left, a, right.type)
        b = _comparable(right, b, left.type)
        return _bin(a, node.op, b), error

    _op_eq = _op_ne = _op_lt = _op_le = _op_gt = _op_ge = _compare

    def _op_AND(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        return _and(*(_condition(v) for v in values)), error

    def _op_OR(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        return "(" + " OR ".join(_condition(v) for v in values) + ")", error

    def _op_XOR(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        count = " + ".join(cast(_condition(v), "int") for v in values)
        return f"((({count}) % 2) = 1)", error

    def _op_NOT(self, node: Node) -> Pair:
        value, error = self(node.args[0])
        return _not(_condition(value)), error

    def _op_IF(self, node: Node) -> Pair:
        condition, condition_error = self(node.args[0])
        then, then_error = self(node.args[1])
        other, other_error = self(node.args[2]) if len(node.args) > 2 else (_NULL, None)
        test = _condition(condition)
        error = None
        if then_error is not None or other_error is not None:
            error = when((test, then_error or _FALSE), otherwise=other_error or _FALSE)
        return when((test, then), otherwise=other), or_errors(condition_error, error)

    def _branches(self, pairs: list[tuple[Node, Node]], default: Node | None, fail: bool) -> Pair:
        values: list[tuple[Expr, Expr]] = []
        errors: list[tuple[Expr, Expr]] = []
        any_error = False
        conditions_error = []
        for condition, then in pairs:
            test, test_error = self(condition)
            conditions_error.append(test_error)
            result, result_error = self(then)
            any_error = any_error or result_error is not None
            values.append((_condition(test), result))
            errors.append((_condition(test), result_error or _FALSE))
        if default is not None:
            result, result_error = self(default)
            value = when(*values, otherwise=result)
            any_error = any_error or result_error is not None
            error = when(*errors, otherwise=result_error or _FALSE)
        else:
            value = when(*values, otherwise=_NULL)
            error = when(*errors, otherwise=_TRUE if fail else _FALSE)
        branch_error = error if (any_error or fail) else None
        return value, or_errors(*conditions_error, branch_error)

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
            result_error = when((error, other_error), otherwise=_FALSE)
        return when((error, other), otherwise=value), result_error

    def _op_ISERROR(self, node: Node) -> Pair:
        _, error = self(node.args[0])
        return error or _FALSE, None

    def _op_ISBLANK(self, node: Node) -> Pair:
        value, error = self(node.args[0])
        if error is None:
            return is_null(value), None
        return _and(is_null(value), _not(error)), None

    def _op_COALESCE(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        return coalesce(*values), error

    def _op_NULLIF(self, node: Node) -> Pair:
        (a, b), error = self.values(node.args)
        return when((_bin(a, "<=>", b), _NULL), otherwise=a), error

    def _op_cast(self, node: Node) -> Pair:
        source = node.args[0]
        value, error = self(source)
        target, integer, scale = node.value
        if target == TEXT:
            return when((not_null(value), _text(source, value))), error
        if source.type == TEXT and target == NUMBER:
            result = try_cast(call("trim", value), "double")
        elif source.type == BOOLEAN and target == NUMBER:
            result = when((value, "1.0D"), (_not(value), _ZERO))
        elif source.type == target:
            result = value
        else:
            result = try_cast(value, SPARK_TYPES[target])
        if target == NUMBER and integer:
            result = f"(signum({result}) * {_whole(call('abs', result))})"
        elif target == NUMBER and scale is not None:
            result = call("round", result, literal(int(scale)))
        bad = lost(value, result) if source.type != target else None
        return result, or_errors(error, bad)

    # numbers
    def _op_ROUND(self, node: Node) -> Pair:
        value, error = self(node.args[0])
        digits = 0
        if len(node.args) > 1:
            digits = int(constant_number(node.args[1]) or 0)
        return call("round", _number(value), literal(digits)), error

    def _unary_number(self, node: Node, f: Callable[[Expr], Expr]) -> Pair:
        value, error = self(node.args[0])
        return f(_number(value)), error

    def _op_ABS(self, node: Node) -> Pair:
        return self._unary_number(node, lambda v: call("abs", v))

    def _op_SIGN(self, node: Node) -> Pair:
        return self._unary_number(node, lambda v: call("signum", v))

    def _op_INT(self, node: Node) -> Pair:
        return self._unary_number(node, _whole)

    _op_FLOOR = _op_INT

    def _op_CEILING(self, node: Node) -> Pair:
        return self._unary_number(node, lambda v: f"(- {_whole(f'(- {v})')})")

    _op_CEIL = _op_CEILING

    def _op_MOD(self, node: Node) -> Pair:
        (a, b), error = self.values(node.args)
        a, b = _number(a), _number(b)
        # a - b * INT(a / b), computed exactly: Java's remainder (the sign of a), moved by b
        # when the signs differ (a / b loses the remainder of numbers past 2^53).
        rest = f"({a} % {when((_bin(b, '<>', '(0)'), b))})"
        value = when((f"(({rest} * {b}) < (0))", f"({rest} + {b})"), otherwise=rest)
        return value, or_errors(error, _bin(b, "=", "(0)"))

    def _op_POWER(self, node: Node) -> Pair:
        (a, b), error = self.values(node.args)
        power = call("power", _number(a), _number(b))
        return power, or_errors(error, _bad_number(power))

    _op_POW = _op_POWER

    def _domain(self, node: Node, function: str, ok: Callable[[Expr], Expr]) -> Pair:
        value, error = self(node.args[0])
        value = _number(value)
        valid = ok(value)
        return call(function, when((valid, value))), or_errors(error, _not(valid))

    def _op_SQRT(self, node: Node) -> Pair:
        return self._domain(node, "sqrt", lambda v: f"({v} >= (0))")

    def _op_LN(self, node: Node) -> Pair:
        return self._domain(node, "ln", lambda v: f"({v} > (0))")

    def _op_LOG10(self, node: Node) -> Pair:
        return self._domain(node, "log10", lambda v: f"({v} > (0))")

    def _op_EXP(self, node: Node) -> Pair:
        value, error = self(node.args[0])
        result = call("exp", _number(value))
        return result, or_errors(error, _bad_number(result))

    def _op_MIN(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        return call("least", *values) if len(values) > 1 else values[0], error

    def _op_MAX(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        return call("greatest", *values) if len(values) > 1 else values[0], error

    _op_LEAST = _op_MIN
    _op_GREATEST = _op_MAX

    def _op_SUM(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        return "(" + " + ".join(_number(v) for v in values) + ")", error

    def _op_AVERAGE(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        total = "(" + " + ".join([_ZERO, *(_number(v) for v in values)]) + ")"
        count = "(" + " + ".join(["(0)", *(cast(not_null(v), "int") for v in values)]) + ")"
        mean = f"({total} / {when((f'({count} > (0))', count))})"
        return mean, or_errors(error, f"({count} = (0))")

    def _op_VALUE(self, node: Node) -> Pair:
        source = node.args[0]
        value, error = self(source)
        if source.type == NUMBER:
            return value, error
        result = try_cast(call("trim", _text(source, value)), "double")
        return result, or_errors(error, lost(value, result))

    # text
    def _op_CONCAT(self, node: Node) -> Pair:
        pairs = [self(a) for a in node.args]
        texts = [_text(a, p[0]) for a, p in zip(node.args, pairs, strict=True)]
        return call("concat", *texts), or_errors(*(p[1] for p in pairs))

    _op_CONCATENATE = _op_CONCAT

    def _text_arg(self, node: Node) -> Pair:
        value, error = self(node)
        return _text(node, value), error

    def _count_arg(self, node: Node | None, default: float) -> Pair:
        if node is None:
            return literal(default), None
        value, error = self(node)
        return _number(value), error

    def _op_LEFT(self, node: Node) -> Pair:
        return self._side(node, "left")

    def _op_RIGHT(self, node: Node) -> Pair:
        return self._side(node, "right")

    def _side(self, node: Node, function: str) -> Pair:
        text, error = self._text_arg(node.args[0])
        count, count_error = self._count_arg(node.args[1] if len(node.args) > 1 else None, 1)
        value = call(function, text, coalesce(_int(count), "(0)"))
        return value, or_errors(error, count_error, f"({count} < (0))")

    def _op_MID(self, node: Node) -> Pair:
        text, error = self._text_arg(node.args[0])
        start, start_error = self._count_arg(node.args[1], 1)
        count, count_error = self._count_arg(node.args[2], 0)
        bad = f"(({start} < (1)) OR ({count} < (0)))"
        value = call(
            "substring",
            text,
            coalesce(when((f"({start} >= (1))", _int(start))), "(1)"),
            coalesce(when((f"({count} >= (0))", _int(count))), "(0)"),
        )
        return value, or_errors(error, start_error, count_error, bad)

    def _op_LEN(self, node: Node) -> Pair:
        text, error = self._text_arg(node.args[0])
        return cast(call("length", text), "double"), error

    _op_LENGTH = _op_LEN

    def _op_UPPER(self, node: Node) -> Pair:
        text, error = self._text_arg(node.args[0])
        return call("upper", text), error

    def _op_LOWER(self, node: Node) -> Pair:
        text, error = self._text_arg(node.args[0])
        return call("lower", text), error

    def _op_TRIM(self, node: Node) -> Pair:
        text, error = self._text_arg(node.args[0])
        return call("regexp_replace", call("trim", text), "' {2,}'", "' '"), error

    def _op_SUBSTITUTE(self, node: Node) -> Pair:
        pairs = [self._text_arg(a) for a in node.args]
        return call("replace", *(p[0] for p in pairs)), or_errors(*(p[1] for p in pairs))

    # dates
    def _op_DATE(self, node: Node) -> Pair:
        (year, month, day), error = self.values(node.args)
        year, month, day = _number(year), _number(month), _number(day)
        valid = _and(f"({year} >= (1))", f"({year} < (10000))", f"(abs({month}) < (120000))",
                     f"(abs({day}) < 4000000.0D)")  # fmt: skip
        first = call("make_date", when((valid, _int(year))), "(1)", "(1)")
        value = call("date_add", call("add_months", first, f"({_int(month)} - (1))"),
                     f"({_int(day)} - (1))")  # fmt: skip
        return when((valid, value)), or_errors(error, _not(valid))

    def _op_DATEVALUE(self, node: Node) -> Pair:
        source = node.args[0]
        value, error = self(source)
        if source.type == DATE_T:
            return value, error
        result = try_cast(call("trim", _text(source, value)), "date")
        return result, or_errors(error, lost(value, result))

    def _date_part(self, node: Node, function: str) -> Pair:
        value, error = self(node.args[0])
        return cast(call(function, value), "double"), error

    def _op_YEAR(self, node: Node) -> Pair:
        return self._date_part(node, "year")

    def _op_MONTH(self, node: Node) -> Pair:
        return self._date_part(node, "month")

    def _op_DAY(self, node: Node) -> Pair:
        return self._date_part(node, "dayofmonth")

    def _op_WEEKDAY(self, node: Node) -> Pair:
        return self._date_part(node, "dayofweek")

    def _op_TODAY(self, node: Node) -> Pair:
        return literal(self.today), None

    _op_DAYS = _op_days

    def _op_DATEDIF(self, node: Node) -> Pair:
        (start, end), error = self.values(node.args[:2])
        unit = str(node.args[2].value).upper()
        if unit == "D":
            value = cast(call("datediff", end, start), "double")
        else:
            borrow = when((f"(dayofmonth({end}) < dayofmonth({start}))", "(1)"), otherwise="(0)")
            years = f"((year({end}) - year({start})) * (12))"
            months = f"((({years} + month({end})) - month({start})) - {borrow})"
            value = cast(months if unit == "M" else f"floor({months} / (12))", "double")
        return value, or_errors(error, f"({end} < {start})")

    def _op_EDATE(self, node: Node) -> Pair:
        (date, months), error = self.values(node.args)
        return call("add_months", date, _int(_number(months))), error

    def _op_EOMONTH(self, node: Node) -> Pair:
        (date, months), error = self.values(node.args)
        return call("last_day", call("add_months", date, _int(_number(months)))), error


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


def _aggregate_texts(node: Node, value: Expr, error: Expr | None) -> tuple[Expr, Expr]:
    """An aggregate's value over the rows whose argument is not an error, and whether any is."""
    clean = when((_not(error), value)) if error is not None else value
    has_error = f"(max(CAST({error or _FALSE} AS INT)) > (0))"
    match node.value:
        case "SUM":
            return coalesce(call("sum", clean), _ZERO), has_error
        case "AVERAGE":
            return call("avg", clean), f"({has_error} OR (count({clean}) = (0)))"
        case "COUNT":
            return cast(call("count", clean), "double"), has_error
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


def _aggregate_plan(
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
    for groups, nodes, keys, columns in _aggregate_plan(formulas, today):
        by = [F.expr(k).alias(f"g{i}") for i, k in enumerate(keys)]
        values = [F.expr(c).alias(f"{'ve'[i % 2]}{i // 2}") for i, c in enumerate(columns)]
        frame = df.groupBy(*by).agg(*values) if by else df.agg(*values)
        rows = frame.limit(max_groups + 1).collect()
        if len(rows) > max_groups:
            raise ValueError(
                f"tenant {formulas.tenant!r}: an aggregate BY "
                f"{', '.join(g.key() for g in groups)} has more than {max_groups:,} groups"
            )
        results.append((groups, tuple(nodes), tuple(tuple(row) for row in rows)))
    return AggregateValues(groups=tuple(results))


def join_aggregates(
    spark: Any, df: Any, values: AggregateValues, *, today: dt.date, formulas: FormulaSet
) -> tuple[Any, dict[str, Pair]]:
    """Add phase one's results to each row (a broadcast join per ``BY`` list)."""
    from pyspark.sql import functions as F

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
            names[_AGG_PREFIX + node.key()] = (
                quoted(f"{prefix}v{i}"),
                coalesce(quoted(f"{prefix}e{i}"), _FALSE),
            )
    return df, names


@dataclass(frozen=True)
class Output:
    """A rule written to the sink: its column, and its error column if it can have errors."""

    name: str
    type: str
    error_column: str | None


@dataclass
class Level:
    """Rules computed side by side, in one projection: ``computed`` holds each rule's value
    (blank where an error) and, for a rule that can have errors, its error column. Such a
    rule's value text holds its error text, and its error text a number's value (an overflow
    is an error): Spark evaluates a repeated subexpression once per row (its subexpression
    elimination), while a second projection per level, reading the first's columns by name,
    doubled the plan's depth, and Spark's planning cost grows with the square of it (its
    planner walks the stack of projections below each one): 250 rules with chains 20 deep
    took minutes of the driver's CPU that way."""

    computed: dict[str, Expr]


def packed_flags(flags: Sequence[Expr], bits: int) -> list[Expr]:
    """Boolean expressions (NULL counts as false) packed ``bits`` to a bigint, bit k of
    word j being flag ``bits * j + k``."""
    words = []
    for first in range(0, len(flags), bits):
        terms = [f"CASE WHEN {flag} THEN {1 << k}L ELSE 0L END"
                 for k, flag in enumerate(flags[first : first + bits])]  # fmt: skip
        words.append("(" + " | ".join(terms) + ")")
    return words


def formula_levels(
    formulas: FormulaSet, *, today: dt.date, names: Mapping[str, Pair]
) -> tuple[list[Level], list[Output]]:
    """Phase two as text: each rule as a column (blank where it is an error) and an error
    column for each rule that can have errors, in :class:`Level` s (a projection each, over
    every column of the levels before). A rule other rules use goes in the level after the
    deepest rule it uses (the first if it uses none), so there are as many levels as the
    longest chain of rules using rules (two chains of 20 side by side make 20, not 40); every
    other rule goes in the last level. So the levels before the last carry only the source and
    the rules used later: Spark copies every column of a projection into each row it passes
    on, and its planning walks the stack of projections below each one, so 20 levels each
    carrying a tenant's 250 rules cost minutes of CPU where narrow ones cost seconds.

    :class:`FormulaError` for a rule whose text is longer than :data:`MAX_EXPRESSION_CHARS`.
    """
    known: dict[str, Pair] = dict(names)
    compiler = Compiler(today=today, names=known)
    depth: dict[str, int] = {}
    used: set[str] = set()  # the rules other rules use
    for formula in formulas.formulas:
        references = _references(formula.tree)
        used |= references
        depth[formula.target] = 1 + max((depth[n] for n in references if n in depth), default=-1)
    levels = [Level({}) for _ in range(1 + max(depth.values(), default=0))]
    outputs: list[Output] = []
    for formula in formulas.formulas:
        target = formula.target
        level = levels[depth[target] if target in used else -1]
        try:
            value, error = compiler(formula.tree)
        except TooLong as exc:
            raise _too_long(formulas.tenant, f"{target} = {formula.source}", exc) from None
        error_name = None
        if error is None:
            level.computed[target] = value
        else:
            error_name = ERROR_PREFIX + target
            if formula.tree.type == NUMBER:
                error = f"({error} OR {_bad_number(value)})"
            settled = coalesce(error, _FALSE)
            level.computed[error_name] = settled
            level.computed[target] = when((_not(settled), value))
        known[target] = (quoted(target), quoted(error_name) if error_name else None)
        if not formula.intermediate:
            outputs.append(Output(target, formula.tree.type, error_name))
    return levels, outputs


def _too_long(tenant: str, shown: str, exc: TooLong) -> FormulaError:
    return FormulaError(
        tenant,
        shown[:200],
        f"it compiles to more than {MAX_EXPRESSION_CHARS:,} characters of Spark SQL: "
        "functions that use their argument more than once (INT, CEILING, IF's condition, a "
        "number as text) repeat it when nested; name the inner part as an intermediate rule "
        "(_inner = ...) and use the name",
    )


def apply_formulas(
    df: Any, formulas: FormulaSet, *, today: dt.date, names: Mapping[str, Pair]
) -> tuple[Any, list[Output]]:
    """Phase two on ``df``: a ``selectExpr`` per level of :func:`formula_levels`."""
    levels, outputs = formula_levels(formulas, today=today, names=names)
    for level in levels:
        df = df.selectExpr("*", *(f"{text} AS {quoted(n)}" for n, text in level.computed.items()))
    return df, outputs


def check_compiles(formulas: FormulaSet, *, today: dt.date) -> None:
    """Compile every phase of ``formulas`` as a job's batches would (no Spark session):
    :class:`FormulaError` if a rule cannot be handed to Spark."""
    try:
        shapes = _aggregate_plan(formulas, today)
    except TooLong as exc:
        raise _too_long(formulas.tenant, "a tenant aggregate (SUM, AVERAGE, ...)", exc) from None
    placeholders = {
        _AGG_PREFIX + node.key(): (quoted("aggregate"), quoted("error"))
        for _groups, nodes, _keys, _columns in shapes
        for node in nodes
    }
    formula_levels(formulas, today=today, names=placeholders)


def _references(tree: Node) -> set[str]:
    found: set[str] = set()
    stack = [tree]
    while stack:
        item = stack.pop()
        if item.op == "ref":
            found.add(item.value)
        stack.extend(item.args)
    return found

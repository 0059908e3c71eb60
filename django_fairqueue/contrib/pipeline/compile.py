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
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from django_fairqueue.contrib.pipeline import textformat
from django_fairqueue.contrib.pipeline.formulas import (
    BLANK,
    BOOLEAN,
    DATE_T,
    DATETIME,
    NUMBER,
    NUMBER_START,
    NUMBER_TEXT,
    RANK_ASC,
    TEXT,
    FormulaError,
    FormulaSet,
    Node,
    constant_number,
    has_wildcard,
    wildcard_regex,
)

Expr = str  # a Spark SQL expression
Pair = tuple[Expr, Expr | None]
ERROR_PREFIX = "__fq_err_"
#: A last-level rule's value and error before blanking (:class:`Level`).
RAW_PREFIX = "__fq_raw_"
_AGG_PREFIX = "__fq_agg_"
_BLANK_DATE = dt.date(1899, 12, 31)  # what a blank date compares as (a spreadsheet's day 0)
#: The longest text one rule may compile to. Some functions use their argument more than once
#: (``INT``, text conversion of a number, ``IF``'s condition in value and error), so nesting
#: them repeats text: a formula past this is refused when its job is planned. A 200-character
#: formula compiles to a few thousand characters.
MAX_EXPRESSION_CHARS = 200_000


class TooLong(Exception):
    """A rule's text passed :data:`MAX_EXPRESSION_CHARS` (``args[0]``: the length reached)."""


SPARK_TYPES = {NUMBER: "double", TEXT: "string", BOOLEAN: "boolean", DATE_T: "date",
               DATETIME: "timestamp_ntz"}  # fmt: skip

_TRUE, _FALSE, _NULL = "true", "false", "NULL"
_ZERO = "0.0D"
_INF = "CAST('Infinity' AS DOUBLE)"
_SAFE_INTEGER = "9.0E15D"  # beyond this a double has no fraction; casts to long are guarded
_INT_RANGE = "2.0E9D"
_MAX_DOUBLE = "1.7976931348623157E308D"
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
    if isinstance(value, dt.datetime):  # before date: a datetime is a date too
        return f"TIMESTAMP_NTZ '{value.replace(tzinfo=None).isoformat(sep=' ')}'"
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
    covers both and the value is written once; with the largest double as a literal, not
    infinity (a cast Spark would analyse and fold again in every check of every rule)."""
    return f"(NOT (abs({value}) <= {_MAX_DOUBLE}))"


#: A double constant as :func:`literal` writes it: never blank, so no ``coalesce`` around it
#: (an integer one stays coalesced to a double: integer arithmetic could overflow).
_NUMBER_LITERAL = re.compile(r"^\(-?[0-9][0-9.]*([eE][-+]?[0-9]+)?D\)$")


def _number(value: Expr) -> Expr:
    """A number, blank as 0 (a constant as it is: every ``coalesce`` is text Spark parses,
    analyses and folds again for each rule, in each tenant's plan)."""
    if _NUMBER_LITERAL.match(value):
        return value
    return coalesce(value, _ZERO)


def _whole(value: Expr) -> Expr:
    """floor() of a (non-blank) number, as a double, without a cast that could overflow."""
    return when((f"(abs({value}) < {_SAFE_INTEGER})", cast(call("floor", value), "double")),
                otherwise=value)  # fmt: skip


def _int(value: Expr) -> Expr:
    """A number as an int (for lengths, months, days): truncated, out of range -> NULL."""
    return when((f"(abs({value}) < {_INT_RANGE})", cast(call("floor", value), "int")))


#: Numbers as text, as a spreadsheet's General format shows them: rounded to 15 significant
#: digits, trailing zeros dropped, in plain notation from 1E-9 up to 15 integer digits, in
#: scientific notation (``1.5E+20``, ``2E-10``) outside that range.
_PLAIN_LOW, _PLAIN_HIGH = "1.0E-9D", "999999999999999.5D"  # the second rounds up to 1E+15


def number_text(value: Expr) -> Expr:
    """A (non-blank) number as text, as a spreadsheet shows it (see above).

    Java's ``%.14E`` rounds to 15 significant digits (half up, from the shortest decimal that
    reads back as the double, so 0.1 + 0.2 is 0.3); that text, read as a decimal of 23 places,
    prints plainly; the zeros after the point are then dropped."""
    return bind([value], _number_text)


def _number_text(value: Expr) -> Expr:
    digits = call("format_string", "'%.14E'", value)
    plain = cast(cast(digits, "DECIMAL(38,23)"), "string")
    plain = call("regexp_replace", call("regexp_replace", plain, "'0+$'", _EMPTY), "'[.]$'",
                 _EMPTY)  # fmt: skip
    scientific = call("regexp_replace", digits, "'[.]?0+E'", "'E'")
    magnitude = call("abs", value)
    shown_plainly = _and(f"({magnitude} >= {_PLAIN_LOW})", f"({magnitude} < {_PLAIN_HIGH})")
    return when((_bin(value, "=", _ZERO), "'0'"), (shown_plainly, plain), otherwise=scientific)


def text_number(text: Expr) -> Expr:
    """Text as a number the way a spreadsheet reads it (``" 1,234.5 "``, ``"-12%"``,
    ``"1e3"``), NULL for anything else (Java's ``"12d"``, ``"Infinity"``, ``"0x1F"``, "")."""
    return bind([call("trim", text)], _text_number)


def _text_number(trimmed: Expr) -> Expr:
    accepted = _and(
        call("regexp_like", trimmed, literal(NUMBER_TEXT)),
        call("regexp_like", trimmed, literal(NUMBER_START)),
    )
    bare = call("regexp_replace", trimmed, "'[,%$]'", _EMPTY)
    number = try_cast(bare, "double")
    scaled = when((call("endswith", trimmed, "'%'"), f"({number} / 100.0D)"), otherwise=number)
    return when((accepted, scaled))


def _text(node: Node, value: Expr) -> Expr:
    """A value as text, blank as ""."""
    if node.type == TEXT:
        return value if node.op == "const" else coalesce(value, _EMPTY)
    if node.type == NUMBER:
        return coalesce(number_text(value), _EMPTY)
    if node.type == BOOLEAN:
        return when((value, "'TRUE'"), (_not(value), "'FALSE'"), otherwise=_EMPTY)
    if node.type == DATE_T:
        return coalesce(call("date_format", value, "'yyyy-MM-dd'"), _EMPTY)
    if node.type == DATETIME:
        return coalesce(call("date_format", value, "'yyyy-MM-dd HH:mm:ss'"), _EMPTY)
    return _EMPTY


def _condition(value: Expr) -> Expr:
    return coalesce(value, _FALSE)


def _comparable(node: Node, value: Expr, other: str) -> Expr:
    kind = node.type if node.type != BLANK else other
    if kind == NUMBER:
        return _number(value)
    if kind == TEXT:
        if node.op == "const" and node.type == TEXT and node.value.isascii():  # lowered here
            return literal(node.value.lower())
        return call("lower", coalesce(value, _EMPTY))
    if kind == BOOLEAN:
        return coalesce(value, _FALSE)
    if kind == DATE_T:
        return coalesce(value, literal(_BLANK_DATE))
    if kind == DATETIME:
        return coalesce(value, literal(dt.datetime.combine(_BLANK_DATE, dt.time())))
    return _ZERO


# --------------------------------------------------------------------------------------------
# The compiler


@dataclass
class Compiler:
    """Compiles nodes with ``names``: a rule computed before, an aggregate or a lookup -> its
    (value, error). ``today``: the job's date, or (a datetime) its planned moment, whose date
    is TODAY() and which NOW() is."""

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

    def _op_lookup(self, node: Node) -> Pair:
        table, column = node.value
        found, missing_or_none = self.names[lookup_name(table, column, node.args[0])]
        missing = missing_or_none or _FALSE
        _, key_error = self(node.args[0])
        if len(node.args) == 1:  # not found: an error (a spreadsheet's #N/A)
            return found, or_errors(key_error, missing)
        default, default_error = self(node.args[1])
        error = when((missing, default_error), otherwise=_FALSE) if default_error else None
        return when((missing, default), otherwise=found), or_errors(key_error, error)

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
        left, right = node.args
        (a, b), error = self.values(node.args)
        # Equal as ``=`` says (text without case, a blank as 0 or ""), not as Spark's <=>.
        equal = _bin(_comparable(left, a, right.type), "=", _comparable(right, b, left.type))
        return when((equal, _NULL), otherwise=a), error

    def _op_cast(self, node: Node) -> Pair:
        source = node.args[0]
        value, error = self(source)
        target, integer, scale = node.value
        if target == TEXT:
            return when((not_null(value), _text(source, value))), error
        if source.type == TEXT and target == NUMBER:
            result = text_number(value)
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
            return value, or_errors(error, is_null(value))
        result = text_number(_text(source, value))
        # A blank is an error too (a spreadsheet's #VALUE! for ""), as is "1e400".
        return result, or_errors(error, f"({result} IS NULL OR {_bad_number(result)})")

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
        given = constant_number(node.args[1]) if len(node.args) > 1 else 1.0
        if given is not None:  # LEFT(x, 2), as analysts write it: folded here, never an error
            whole = math.floor(given) if abs(given) < 2e9 else 0
            return call(function, text, literal(whole)), or_errors(
                error, _TRUE if given < 0 else None
            )
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
        constants = [constant_number(a) for a in node.args]
        if all(c is not None for c in constants):  # DATE(2026, 1, 31): a date constant
            folded = _constant_date(*(float(c or 0) for c in constants))
            return (literal(folded), None) if folded is not None else (_NULL, _TRUE)
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
        today = self.today.date() if isinstance(self.today, dt.datetime) else self.today
        return literal(today), None

    _op_DAYS = _op_days

    def _op_DATEDIF(self, node: Node) -> Pair:
        (start, end), error = self.values(node.args[:2])
        unit = str(node.args[2].value).upper()
        borrow = when((f"(dayofmonth({end}) < dayofmonth({start}))", "(1)"), otherwise="(0)")
        years = f"((year({end}) - year({start})) * (12))"
        months = f"((({years} + month({end})) - month({start})) - {borrow})"
        whole_years = f"floor({months} / (12))"
        match unit:
            case "D":
                value = call("datediff", end, start)
            case "M":
                value = months
            case "Y":
                value = whole_years
            case "YM":
                value = f"({months} % (12))"
            case "MD":  # days since the last whole month
                value = call("datediff", end, call("add_months", start, months))
            case _:  # "YD": days since the last whole year
                value = call("datediff", end, call("add_months", start, f"({whole_years} * 12)"))
        return cast(value, "double"), or_errors(error, f"({end} < {start})")

    def _op_EDATE(self, node: Node) -> Pair:
        (date, months), error = self.values(node.args)
        return call("add_months", date, _int(_number(months))), error

    def _op_EOMONTH(self, node: Node) -> Pair:
        (date, months), error = self.values(node.args)
        return call("last_day", call("add_months", date, _int(_number(months)))), error

    # Functions a spreadsheet user reaches for (numbers)
    def _significance(self, node: Node, up: bool) -> Pair:
        """CEILING/FLOOR(x, significance): the quotient rounded to 9 places first, so that
        1.5 / 0.1 (15.000000000000002) is 15, as a spreadsheet's 15 digits see it."""
        (x, significance), error = self.values(node.args)
        x, significance = _number(x), _number(significance)
        nonzero = when((_bin(significance, "<>", _ZERO), significance))
        quotient = call("round", f"({x} / {nonzero})", "9")
        whole = f"(- {_whole(f'(- {quotient})')})" if up else _whole(quotient)
        value = coalesce(f"({whole} * {significance})", _ZERO)
        bad = _and(f"({x} > {_ZERO})", f"({significance} < {_ZERO})")
        if not up:  # FLOOR(x, 0) is a division by zero, CEILING(x, 0) is 0
            bad = f"({bad} OR (({significance} = {_ZERO}) AND ({x} <> {_ZERO})))"
        return value, or_errors(error, bad)

    def _op_CEILING(self, node: Node) -> Pair:
        if len(node.args) > 1:
            return self._significance(node, up=True)
        return self._unary_number(node, lambda v: f"(- {_whole(f'(- {v})')})")

    _op_CEIL = _op_CEILING

    def _op_FLOOR(self, node: Node) -> Pair:
        if len(node.args) > 1:
            return self._significance(node, up=False)
        return self._op_INT(node)

    def _toward(self, node: Node, up: bool) -> Pair:
        """ROUNDUP (away from zero) and ROUNDDOWN/TRUNC (toward zero) to n digits; the scaled
        value is rounded to 9 places first (4.35 * 100 is 434.99999999999994)."""
        value, error = self(node.args[0])
        value = _number(value)
        digits = int(constant_number(node.args[1]) or 0) if len(node.args) > 1 else 0
        factor = literal(float(10 ** abs(digits)))
        grow, shrink = ("*", "/") if digits >= 0 else ("/", "*")
        scaled = call("round", f"(abs({value}) {grow} {factor})", "9")
        whole = f"(- {_whole(f'(- {scaled})')})" if up else _whole(scaled)
        return f"(signum({value}) * ({whole} {shrink} {factor}))", error

    def _op_ROUNDUP(self, node: Node) -> Pair:
        return self._toward(node, up=True)

    def _op_ROUNDDOWN(self, node: Node) -> Pair:
        return self._toward(node, up=False)

    _op_TRUNC = _op_ROUNDDOWN

    def _op_MROUND(self, node: Node) -> Pair:
        (x, multiple), error = self.values(node.args)
        x, multiple = _number(x), _number(multiple)
        nonzero = when((_bin(multiple, "<>", _ZERO), multiple))
        quotient = call("round", call("round", f"({x} / {nonzero})", "9"), "0")
        value = coalesce(f"({quotient} * {multiple})", _ZERO)
        return value, or_errors(error, f"(({x} * {multiple}) < {_ZERO})")

    def _op_LOG(self, node: Node) -> Pair:
        if len(node.args) == 1:
            return self._op_LOG10(node)
        (x, base), error = self.values(node.args)
        x, base = _number(x), _number(base)
        valid = _and(f"({x} > {_ZERO})", f"({base} > {_ZERO})", f"({base} <> 1.0D)")
        value = call("log", when((valid, base)), x)
        return value, or_errors(error, _not(valid))

    def _op_PI(self, node: Node) -> Pair:
        return literal(math.pi), None

    def _op_MEDIAN(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        present = f"array_sort(filter(array({', '.join(values)}), fq_v -> fq_v IS NOT NULL))"
        size = f"size({present})"
        upper = f"element_at({present}, CAST(({size} DIV 2) + 1 AS INT))"
        lower = f"element_at({present}, CAST(greatest({size} DIV 2, 1) AS INT))"
        value = when((f"({size} = 0)", _NULL), (f"(({size} % 2) = 1)", upper),
                     otherwise=f"(({lower} + {upper}) / 2.0D)")  # fmt: skip
        return value, or_errors(error, f"({size} = 0)")

    # logic
    _op_IFNA = _op_IFERROR

    def _is_type(self, node: Node, kind: str) -> Pair:
        source = node.args[0]
        if source.type != kind:
            return _FALSE, None
        value, error = self(source)
        return (not_null(value) if error is None else _and(not_null(value), _not(error))), None

    def _op_ISNUMBER(self, node: Node) -> Pair:
        return self._is_type(node, NUMBER)

    def _op_ISTEXT(self, node: Node) -> Pair:
        return self._is_type(node, TEXT)

    def _op_SWITCH(self, node: Node) -> Pair:
        subject, *cases = node.args
        default = cases.pop() if len(cases) % 2 else None
        pairs = [(Node("=", BOOLEAN, (subject, value)), result)
                 for value, result in zip(cases[0::2], cases[1::2], strict=True)]  # fmt: skip
        return self._branches(pairs, default, fail=True)

    def _op_CHOOSE(self, node: Node) -> Pair:
        index, *choices = node.args
        whole = Node("TRUNC", NUMBER, (index,))
        pairs = [(Node("=", BOOLEAN, (whole, Node("const", NUMBER, (), float(k)))), choice)
                 for k, choice in enumerate(choices, start=1)]  # fmt: skip
        return self._branches(pairs, None, fail=True)

    # text
    def _op_WILDCARD(self, node: Node) -> Pair:
        value, error = self(node.args[0])
        return f"({coalesce(value, _EMPTY)} RLIKE {literal(node.value)})", error

    def _position(self, node: Node, case: bool) -> Pair:
        """FIND (with case) and SEARCH (without; wildcards in a constant pattern)."""
        (find, find_error), (within, within_error) = (self._text_arg(a) for a in node.args[:2])
        error = or_errors(find_error, within_error)
        start, start_error = self._count_arg(node.args[2] if len(node.args) > 2 else None, 1)
        valid = _and(f"({start} >= 1.0D)", f"({start} <= (length({within}) + 1))")
        first = coalesce(when((valid, _int(start))), "(1)")
        pattern = node.args[0]
        if not case and pattern.op == "const" and isinstance(pattern.value, str) and (
            has_wildcard(pattern.value)
        ):  # fmt: skip
            regex = literal("(?isu)" + wildcard_regex(pattern.value))
            found = call("regexp_instr", call("substring", within, first), regex)
            position = f"(CASE WHEN {found} > 0 THEN {found} + {first} - 1 ELSE 0 END)"
        elif case:
            position = call("locate", find, within, first)
        else:
            position = call("locate", call("lower", find), call("lower", within), first)
        bad = f"({_not(valid)} OR ({position} = 0))"
        return cast(position, "double"), or_errors(error, start_error, bad)

    def _op_FIND(self, node: Node) -> Pair:
        return self._position(node, case=True)

    def _op_SEARCH(self, node: Node) -> Pair:
        return self._position(node, case=False)

    def _op_PROPER(self, node: Node) -> Pair:
        text, error = self._text_arg(node.args[0])
        letter = literal("\\p{L}")
        char = f"substr({text}, fq_i, 1)"
        after_letter = f"(fq_i > 1 AND substr({text}, fq_i - 1, 1) RLIKE {letter})"
        each = f"CASE WHEN {after_letter} THEN lower({char}) ELSE upper({char}) END"
        joined = f"array_join(transform(sequence(1, length({text})), fq_i -> {each}), '')"
        return when((f"(length({text}) = 0)", _EMPTY), otherwise=joined), error

    def _op_REPLACE(self, node: Node) -> Pair:
        old, error = self._text_arg(node.args[0])
        start, start_error = self._count_arg(node.args[1], 1)
        count, count_error = self._count_arg(node.args[2], 0)
        new, new_error = self._text_arg(node.args[3])
        valid = _and(f"({start} >= 1.0D)", f"({count} >= {_ZERO})")
        value = call("overlay", old, new, coalesce(when((valid, _int(start))), "(1)"),
                     coalesce(when((valid, _int(count))), "(0)"))  # fmt: skip
        return value, or_errors(error, start_error, count_error, new_error, _not(valid))

    def _op_REPT(self, node: Node) -> Pair:
        text, error = self._text_arg(node.args[0])
        times, times_error = self._count_arg(node.args[1], 0)
        valid = _and(f"({times} >= {_ZERO})", f"((length({text}) * {times}) <= {_MAX_TEXT})")
        value = call("repeat", text, coalesce(when((valid, _int(times))), "(0)"))
        return value, or_errors(error, times_error, _not(valid))

    def _op_TEXTJOIN(self, node: Node) -> Pair:
        delimiter, error = self._text_arg(node.args[0])
        ignore, ignore_error = self(node.args[1])
        pairs = [self._text_arg(a) for a in node.args[2:]]
        texts = [p[0] for p in pairs]
        skipping = call("concat_ws", delimiter, *(call("nullif", t, _EMPTY) for t in texts))
        keeping = call("concat_ws", delimiter, *texts)
        if node.args[1].op == "const":
            value = skipping if node.args[1].value else keeping
        else:
            value = when((_condition(ignore), skipping), otherwise=keeping)
        too_long = f"(length({value}) > {_MAX_TEXT})"
        return when((_not(too_long), value)), or_errors(
            error, ignore_error, *(p[1] for p in pairs), too_long
        )

    def _op_EXACT(self, node: Node) -> Pair:
        (a, a_error), (b, b_error) = (self._text_arg(arg) for arg in node.args)
        return _bin(a, "=", b), or_errors(a_error, b_error)

    def _op_TEXT(self, node: Node) -> Pair:
        source = node.args[0]
        value, error = self(source)
        spec = textformat.parse(str(node.args[1].value))
        return formatted(source.type, value, spec), error

    # dates
    def _op_NOW(self, node: Node) -> Pair:
        now = self.today
        if not isinstance(now, dt.datetime):
            now = dt.datetime.combine(now, dt.time())
        return literal(now), None

    def _op_WEEKNUM(self, node: Node) -> Pair:
        value, error = self(node.args[0])
        date = cast(value, "date")
        kind = int(constant_number(node.args[1]) or 1) if len(node.args) > 1 else 1
        if kind == 21:
            return cast(call("weekofyear", date), "double"), error
        first = {1: 1, 17: 1, 2: 2, 11: 2, 12: 3, 13: 4, 14: 5, 15: 6, 16: 7}[kind]
        offset = f"((dayofweek(trunc({date}, 'YEAR')) - {first} + 7) % 7)"
        week = f"((((dayofyear({date}) - 1) + {offset}) DIV 7) + 1)"
        return cast(week, "double"), error

    def _op_NETWORKDAYS(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        return cast(bind(values, _network_days), "double"), error

    def _op_YEARFRAC(self, node: Node) -> Pair:
        (first, second), error = self.values(node.args[:2])
        basis = int(constant_number(node.args[2]) or 0) if len(node.args) > 2 else 0

        def fraction(first: Expr, second: Expr) -> Expr:
            start, end = call("least", first, second), call("greatest", first, second)
            return bind([start, end], lambda s, e: _year_fraction(s, e, basis))

        return bind([first, second], fraction), error


def _network_days(start: Expr, end: Expr, *holidays: Expr) -> Expr:
    """NETWORKDAYS: whole weeks are 5 days each; the days left over start on a known weekday."""

    def count(low: Expr, high: Expr, *holidays: Expr) -> Expr:
        days = f"(datediff({high}, {low}) + 1)"
        weekday = f"((dayofweek({low}) + 5) % 7)"  # Monday 0 ... Sunday 6
        rest = f"({days} % 7)"
        first_week = f"greatest(0, least({weekday} + {rest}, 5) - {weekday})"
        second_week = f"greatest(0, least({weekday} + {rest}, 12) - greatest({weekday}, 7))"
        extra = f"({first_week} + {second_week})"
        total = f"((({days} DIV 7) * 5) + {extra})"
        if not holidays:
            return total
        off = (f"size(array_distinct(filter(array({', '.join(holidays)}), fq_h -> "
               f"fq_h BETWEEN {low} AND {high} AND dayofweek(fq_h) NOT IN (1, 7))))")  # fmt: skip
        return f"({total} - {off})"

    days = bind([call("least", start, end), call("greatest", start, end), *holidays], count)
    return when((f"({end} < {start})", f"(- {days})"), otherwise=days)


def _constant_date(year: float, month: float, day: float) -> dt.date | None:
    """DATE of constants, months and days past the end rolling over (None: out of range)."""
    if not (1 <= year < 10000 and abs(month) < 120000 and abs(day) < 4_000_000):
        return None
    months = int(year) * 12 + math.floor(month) - 1
    if not 1 <= months // 12 <= 9999:
        return None
    first = dt.date(months // 12, months % 12 + 1, 1)
    try:
        return first + dt.timedelta(days=math.floor(day) - 1)
    except OverflowError:
        return None


#: Texts up to this long are repeated where a function uses a value more than once; longer
#: ones are bound once (:func:`bind`), so that nesting cannot multiply them.
_SHORT = 80


def bind(values: Sequence[Expr], body: Callable[..., Expr]) -> Expr:
    """``body`` of ``values``, each written once: short ones (a column, a constant) inline,
    else through a one-element ``transform`` whose lambda names them."""
    if all(len(v) <= _SHORT for v in values):
        return body(*values)
    name = "fq_b"  # values hold any inner bind, outside this lambda: no name is shadowed
    fields = ", ".join(f"'v{i}', {v}" for i, v in enumerate(values))
    used = body(*(f"{name}.v{i}" for i in range(len(values))))
    return f"transform(array(named_struct({fields})), {name} -> {used})[0]"


def _year_fraction(start: Expr, end: Expr, basis: int) -> Expr:
    """YEARFRAC by day-count basis, as a spreadsheet counts (start <= end)."""
    days = f"CAST(datediff({end}, {start}) AS DOUBLE)"
    if basis == 2:
        return f"({days} / 360.0D)"
    if basis == 3:
        return f"({days} / 365.0D)"
    y1, m1, d1 = f"year({start})", f"month({start})", f"dayofmonth({start})"
    y2, m2, d2 = f"year({end})", f"month({end})", f"dayofmonth({end})"
    if basis in (0, 4):
        if basis == 4:  # European: the 31st is the 30th
            day1 = when((f"({d1} = 31)", "30"), otherwise=d1)
            day2 = when((f"({d2} = 31)", "30"), otherwise=d2)
        else:  # US (NASD), with the last day of February as the 30th
            feb_end1 = _and(f"({m1} = 2)", f"({start} = last_day({start}))")
            feb_end2 = _and(f"({m2} = 2)", f"({end} = last_day({end}))")
            day1 = when((f"(({d1} = 31) OR {feb_end1})", "30"), otherwise=d1)
            day2 = when((_and(f"({d2} = 31)", f"({d1} >= 30)"), "30"),
                        (_and(feb_end1, feb_end2), "30"), otherwise=d2)  # fmt: skip
        total = f"(((({y2} - {y1}) * 360) + (({m2} - {m1}) * 30)) + ({day2} - {day1}))"
        return f"(CAST({total} AS DOUBLE) / 360.0D)"

    # basis 1, actual/actual: within a year, 366 days if a February 29 is inside; else the
    # average length of the years the dates span.
    def leap(year: Expr) -> Expr:
        return f"((({year} % 4) = 0 AND ({year} % 100) <> 0) OR ({year} % 400) = 0)"

    def feb29_inside(year: Expr) -> Expr:
        feb29 = f"date_add(make_date({year}, 3, 1), -1)"
        return _and(leap(year), f"({start} <= {feb29})", f"({end} >= {feb29})")

    within_year = (f"(({y1} = {y2}) OR (({y2} = {y1} + 1) AND (({m1} > {m2}) OR "
                   f"(({m1} = {m2}) AND ({d1} >= {d2})))))")  # fmt: skip
    one_year = when((f"(({y1} = {y2}) AND {leap(y1)})", "366.0D"),
                    (f"({feb29_inside(y1)} OR {feb29_inside(y2)})", "366.0D"),
                    otherwise="365.0D")  # fmt: skip
    span = f"CAST(datediff(make_date({y2} + 1, 1, 1), make_date({y1}, 1, 1)) AS DOUBLE)"
    average = f"({span} / CAST(({y2} - {y1}) + 1 AS DOUBLE))"
    return when((within_year, f"({days} / {one_year})"), otherwise=f"({days} / {average})")


#: The longest text REPT and TEXTJOIN give (a spreadsheet cell's limit).
_MAX_TEXT = "32767"


def formatted(kind: str, value: Expr, spec: textformat.Format) -> Expr:
    """TEXT(value, format): ``value`` of type ``kind`` shown as ``spec`` describes."""
    if kind == TEXT or isinstance(spec, textformat.Text):
        return coalesce(value, _EMPTY) if kind == TEXT else _text(Node("v", kind), value)
    if kind == BOOLEAN:
        return _text(Node("v", kind), value)
    if isinstance(spec, textformat.DateFormat):
        if kind == NUMBER:  # a spreadsheet's date serial number: days since 1899-12-30
            value = call("date_add", literal(dt.date(1899, 12, 30)), _int(_number(value)))
        return coalesce(call("date_format", value, literal(spec.pattern)), _EMPTY)
    if kind in (DATE_T, DATETIME):  # a date as its serial number
        value = cast(call("datediff", cast(value, "date"), literal(dt.date(1899, 12, 30))),
                     "double")  # fmt: skip
    value = _number(value)
    if isinstance(spec, textformat.General):
        return number_text(value)
    return _number_format(value, spec)


def _number_format(value: Expr, spec: textformat.NumberFormat) -> Expr:
    """A number in a number format: Java's formatter rounds half up, as a spreadsheet does."""
    if spec.percent:
        value = f"({value} * 100.0D)"
    if spec.scale:
        value = f"({value} / {literal(float(1000**spec.scale))})"
    places = spec.decimals + spec.optional_decimals
    magnitude = call("abs", value)
    if spec.scientific:
        shown = call("format_string", literal(f"%.{places}E"), magnitude)
    else:
        width = spec.integer_zeros + (places + 1 if places else 0)
        flags = ("," if spec.grouping else "") + ("0" if spec.integer_zeros > 1 else "")
        pattern = f"%{flags}{width if spec.integer_zeros > 1 else ''}.{places}f"
        shown = call("format_string", literal(pattern), magnitude)
        if spec.integer_zeros == 0:  # "#.00": no 0 before the point
            shown = call("regexp_replace", shown, literal("^0(?=[.]|$)"), _EMPTY)
    if spec.optional_decimals:  # "#" places: their trailing zeros go
        zeros = literal(f"0{{1,{spec.optional_decimals}}}(?=$|E)")
        shown = call("regexp_replace", shown, zeros, _EMPTY)
    if spec.point and not places:
        shown = f"concat({shown}, '.')"
    sign = when((f"({value} < {_ZERO})", "'-'"), otherwise=_EMPTY)
    return call("concat", sign, literal(spec.prefix), shown, literal(spec.suffix))


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


# --------------------------------------------------------------------------------------------
# Lookup tables (VLOOKUP, XLOOKUP): joined to the rows before the formulas

_LOOKUP_PREFIX = "__fq_lk_"


def lookup_name(table: str, column: str, key: Node) -> str:
    """The name under which a lookup's (value, not found) pair is known to the compiler."""
    return f"{_LOOKUP_PREFIX}{table}|{column}|{key.key()}"


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
        prefix = f"{_LOOKUP_PREFIX}{index}_"
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
    took minutes of the driver's CPU that way.

    The last level (the rules no rule uses, most of a tenant's) is the exception: one more
    projection on top of a stack costs little, while writing each value there three times
    (as the value, inside its error, inside the blanked value) made that level three times
    the text Spark parses, analyses, optimises and generates code for. There ``computed``
    holds each such rule's raw value and raw error (:data:`RAW_PREFIX` names), and
    ``finish``, a projection over them, the rule's error column and blanked value, reading
    the raw ones by name."""

    computed: dict[str, Expr]
    finish: dict[str, Expr] = field(default_factory=dict)


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
        last = target not in used
        level = levels[-1 if last else depth[target]]
        try:
            value, error = compiler(formula.tree)
        except TooLong as exc:
            raise _too_long(formulas.tenant, f"{target} = {formula.source}", exc) from None
        error_name = None
        if error is None:
            level.computed[target] = value
        else:
            error_name = ERROR_PREFIX + target
            if last:  # the raw pair once each, then blanked by name (see Level)
                raw_value, raw_error = RAW_PREFIX + target, RAW_PREFIX + error_name
                level.computed[raw_value] = value
                if formula.tree.type == NUMBER:
                    error = _without_check(error, value)  # made below, by name
                if error is not None:
                    level.computed[raw_error] = error
                value, error = quoted(raw_value), quoted(raw_error) if error else None
            if formula.tree.type == NUMBER:
                error = either(error, _bad_number(value))
            assert error is not None  # only a number's own check was dropped, made again here
            settled = coalesce(error, _FALSE)
            (level.finish if last else level.computed)[error_name] = settled
            (level.finish if last else level.computed)[target] = when((_not(settled), value))
        known[target] = (quoted(target), quoted(error_name) if error_name else None)
        if not formula.intermediate:
            outputs.append(Output(target, formula.tree.type, error_name))
    return levels, outputs


def _without_check(error: Expr, value: Expr) -> Expr | None:
    """``error`` without its last term if that is ``value``'s own overflow check (a product
    or power at the top of a rule ends its error so, :func:`or_errors` joining the terms):
    a last-level rule's number is checked again by name (:class:`Level`), so the check and
    the copy of the value in it are text Spark would parse, analyse and compile for nothing.
    In a tenant of 250 realistic rules that copy was 14% of the plan's text."""
    check = _bad_number(value)
    if error == check:
        return None
    tail = f" OR {check})"
    if error.startswith("(") and error.endswith(tail):
        return f"({error[1 : -len(tail)]})"
    return error


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
    """Phase two on ``df``: a ``selectExpr`` per level of :func:`formula_levels` (and the last
    level's ``finish``).

    Each is analysed as it is added, the levels below already analysed. One query of nested
    ``SELECT`` s instead, analysed once, cost a tenant of 250 rules in 20 levels more, not
    less: Spark's analyser resolved the unresolved stack a level per pass of its rules, each
    pass over the whole tree."""
    levels, outputs = formula_levels(formulas, today=today, names=names)
    for level in levels:
        for step in (level.computed, level.finish):
            if step:
                df = df.selectExpr("*", *(f"{text} AS {quoted(n)}" for n, text in step.items()))
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
    for table, key, wanted in lookup_shapes(formulas):
        for column, _kind in wanted:
            placeholders[lookup_name(table, column, key)] = (quoted("found"), quoted("missing"))
    formula_levels(formulas, today=today, names=placeholders)


def uses_moment(formulas: FormulaSet) -> bool:
    """Whether any rule reads the job's moment (``TODAY()``, ``NOW()``): the only rules whose
    Spark text differs between two jobs of one formula version (aggregates aside)."""
    return any(item.op in ("TODAY", "NOW") for f in formulas.formulas for item in f.tree.walk())


def _references(tree: Node) -> set[str]:
    return {item.value for item in tree.walk() if item.op == "ref"}

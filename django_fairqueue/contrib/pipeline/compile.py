"""Checked formulas (:mod:`.formulas`) to Spark SQL expression text, with spreadsheet semantics.

Each expression compiles to a pair ``(value, error)`` of Spark SQL expression texts; ``error``
is a boolean expression, or None where no error can occur. A phase hands Spark all its
expressions at once (one ``selectExpr``), and Spark parses them in the JVM: built as PySpark
``Column`` objects instead, a tenant's 200 formulas took about 13,000 calls from Python into
the JVM, 5 s of the tenant's first batch. No Spark session is needed to compile, so a job is
checked when it is planned (:func:`.compile_levels.check_compiles`).

What a tenant writes reaches the text only as data, never as SQL (:mod:`.sqlexpr`): a name
goes in backquoted (a backquote doubled), a text constant as a hexadecimal binary literal cast
to a string (``CAST(X'4869' AS STRING)``: no quote, backslash or escaping setting of Spark's
parser comes into it), a number from a Python float, a date from a date object. Every operator
and function in the text is this module's own (or :mod:`.sqlexpr`'s), chosen by the checked
tree's node types.

Semantics (the how-to's reference): a blank is 0 in arithmetic, "" in text, FALSE as a
condition; an error (division by zero, ``SQRT(-1)``, ``VALUE("x")``, no true ``IFS``
condition, ...) spreads to every formula that uses it (except through ``IFERROR``,
``ISERROR`` and the untaken branch of ``IF``/``IFS``/``CASE``); a rule whose value is an error
is blank in the sink and counted in the rule's error count. Text comparisons ignore case.

This module is the compiler alone; the values joined to the rows before the formulas
(tenant aggregates, lookup tables) are :mod:`.compile_joins`, and the rules' levels of Spark
projections :mod:`.compile_levels`. It needs no PySpark.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from django_fairqueue.contrib.pipeline import textformat
from django_fairqueue.contrib.pipeline.formula_criteria import has_wildcard, wildcard_regex
from django_fairqueue.contrib.pipeline.formula_tree import (
    BLANK,
    BOOLEAN,
    DATE_T,
    NUMBER,
    TEXT,
    Node,
    constant_number,
)
from django_fairqueue.contrib.pipeline.sqlexpr import (
    SPARK_TYPES,
    SQL_EMPTY,
    SQL_FALSE,
    SQL_NULL,
    SQL_TRUE,
    SQL_ZERO,
    Expr,
    and_,
    as_condition,
    as_int,
    as_number,
    as_text,
    as_whole,
    bad_number,
    binary,
    bind,
    call,
    cast,
    coalesce,
    comparable,
    formatted,
    is_null,
    literal,
    lost,
    network_days,
    not_,
    not_null,
    or_errors,
    quoted,
    text_number,
    try_cast,
    when,
    year_fraction,
)

Pair = tuple[Expr, Expr | None]
AGG_PREFIX = "__fq_agg_"
LOOKUP_PREFIX = "__fq_lk_"
#: The longest text one rule may compile to. Some functions use their argument more than once
#: (``INT``, text conversion of a number, ``IF``'s condition in value and error), so nesting
#: them repeats text: a formula past this is refused when its job is planned. A 200-character
#: formula compiles to a few thousand characters.
MAX_EXPRESSION_CHARS = 200_000


class TooLong(Exception):
    """A rule's text passed :data:`MAX_EXPRESSION_CHARS` (``args[0]``: the length reached)."""


def lookup_name(table: str, column: str, key: Node) -> str:
    """The name under which a lookup's (value, not found) pair is known to the compiler."""
    return f"{LOOKUP_PREFIX}{table}|{column}|{key.key()}"


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
            return SQL_NULL, None
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
        return self.names[AGG_PREFIX + node.key()]

    def _op_lookup(self, node: Node) -> Pair:
        table, column = node.value
        found, missing_or_none = self.names[lookup_name(table, column, node.args[0])]
        missing = missing_or_none or SQL_FALSE
        _, key_error = self(node.args[0])
        if len(node.args) == 1:  # not found: an error (a spreadsheet's #N/A)
            return found, or_errors(key_error, missing)
        default, default_error = self(node.args[1])
        error = when((missing, default_error), otherwise=SQL_FALSE) if default_error else None
        return when((missing, default), otherwise=found), or_errors(key_error, error)

    # arithmetic
    def _op_neg(self, node: Node) -> Pair:
        value, error = self(node.args[0])
        return f"(- {as_number(value)})", error

    def _arith(self, node: Node) -> Pair:
        (a, b), error = self.values(node.args)
        a, b = as_number(a), as_number(b)
        match node.op:
            case "+" | "-":
                return binary(a, node.op, b), error
            case "*":
                product = binary(a, "*", b)
                return product, or_errors(error, bad_number(product))
            case "/" | "%":
                divisor = when((binary(b, "<>", "(0)"), b))
                return binary(a, node.op, divisor), or_errors(error, binary(b, "=", "(0)"))
            case _:  # ^
                power = call("power", a, b)
                return power, or_errors(error, bad_number(power))

    _op_plus = _op_minus = _op_times = _op_divide = _op_modulo = _op_power = _arith

    def _op_days(self, node: Node) -> Pair:
        (end, start), error = self.values(node.args)
        return cast(call("datediff", end, start), "double"), error

    def _op_date_plus(self, node: Node) -> Pair:
        (date, days), error = self.values(node.args)
        return call("date_add", date, as_int(as_number(days))), error

    def _op_date_minus(self, node: Node) -> Pair:
        (date, days), error = self.values(node.args)
        return call("date_sub", date, as_int(as_number(days))), error

    # comparisons and logic
    def _compare(self, node: Node) -> Pair:
        left, right = node.args
        (a, b), error = self.values(node.args)
        a = comparable(left, a, right.type)
        b = comparable(right, b, left.type)
        return binary(a, node.op, b), error

    _op_eq = _op_ne = _op_lt = _op_le = _op_gt = _op_ge = _compare

    def _op_AND(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        return and_(*(as_condition(v) for v in values)), error

    def _op_OR(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        return "(" + " OR ".join(as_condition(v) for v in values) + ")", error

    def _op_XOR(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        count = " + ".join(cast(as_condition(v), "int") for v in values)
        return f"((({count}) % 2) = 1)", error

    def _op_NOT(self, node: Node) -> Pair:
        value, error = self(node.args[0])
        return not_(as_condition(value)), error

    def _op_IF(self, node: Node) -> Pair:
        condition, condition_error = self(node.args[0])
        then, then_error = self(node.args[1])
        other, other_error = self(node.args[2]) if len(node.args) > 2 else (SQL_NULL, None)
        test = as_condition(condition)
        error = None
        if then_error is not None or other_error is not None:
            error = when((test, then_error or SQL_FALSE), otherwise=other_error or SQL_FALSE)
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
            values.append((as_condition(test), result))
            errors.append((as_condition(test), result_error or SQL_FALSE))
        if default is not None:
            result, result_error = self(default)
            value = when(*values, otherwise=result)
            any_error = any_error or result_error is not None
            error = when(*errors, otherwise=result_error or SQL_FALSE)
        else:
            value = when(*values, otherwise=SQL_NULL)
            error = when(*errors, otherwise=SQL_TRUE if fail else SQL_FALSE)
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
            result_error = when((error, other_error), otherwise=SQL_FALSE)
        return when((error, other), otherwise=value), result_error

    def _op_ISERROR(self, node: Node) -> Pair:
        _, error = self(node.args[0])
        return error or SQL_FALSE, None

    def _op_ISBLANK(self, node: Node) -> Pair:
        value, error = self(node.args[0])
        if error is None:
            return is_null(value), None
        return and_(is_null(value), not_(error)), None

    def _op_COALESCE(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        return coalesce(*values), error

    def _op_NULLIF(self, node: Node) -> Pair:
        left, right = node.args
        (a, b), error = self.values(node.args)
        # Equal as ``=`` says (text without case, a blank as 0 or ""), not as Spark's <=>.
        equal = binary(comparable(left, a, right.type), "=", comparable(right, b, left.type))
        return when((equal, SQL_NULL), otherwise=a), error

    def _op_cast(self, node: Node) -> Pair:
        source = node.args[0]
        value, error = self(source)
        target, integer, scale = node.value
        if target == TEXT:
            return when((not_null(value), as_text(source, value))), error
        if source.type == TEXT and target == NUMBER:
            result = text_number(value)
        elif source.type == BOOLEAN and target == NUMBER:
            result = when((value, "1.0D"), (not_(value), SQL_ZERO))
        elif source.type == target:
            result = value
        else:
            result = try_cast(value, SPARK_TYPES[target])
        if target == NUMBER and integer:
            result = f"(signum({result}) * {as_whole(call('abs', result))})"
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
        return call("round", as_number(value), literal(digits)), error

    def _unary_number(self, node: Node, f: Callable[[Expr], Expr]) -> Pair:
        value, error = self(node.args[0])
        return f(as_number(value)), error

    def _op_ABS(self, node: Node) -> Pair:
        return self._unary_number(node, lambda v: call("abs", v))

    def _op_SIGN(self, node: Node) -> Pair:
        return self._unary_number(node, lambda v: call("signum", v))

    def _op_INT(self, node: Node) -> Pair:
        return self._unary_number(node, as_whole)

    def _op_MOD(self, node: Node) -> Pair:
        (a, b), error = self.values(node.args)
        a, b = as_number(a), as_number(b)
        # a - b * INT(a / b), computed exactly: Java's remainder (the sign of a), moved by b
        # when the signs differ (a / b loses the remainder of numbers past 2^53).
        rest = f"({a} % {when((binary(b, '<>', '(0)'), b))})"
        value = when((f"(({rest} * {b}) < (0))", f"({rest} + {b})"), otherwise=rest)
        return value, or_errors(error, binary(b, "=", "(0)"))

    def _op_POWER(self, node: Node) -> Pair:
        (a, b), error = self.values(node.args)
        power = call("power", as_number(a), as_number(b))
        return power, or_errors(error, bad_number(power))

    _op_POW = _op_POWER

    def _domain(self, node: Node, function: str, ok: Callable[[Expr], Expr]) -> Pair:
        value, error = self(node.args[0])
        value = as_number(value)
        valid = ok(value)
        return call(function, when((valid, value))), or_errors(error, not_(valid))

    def _op_SQRT(self, node: Node) -> Pair:
        return self._domain(node, "sqrt", lambda v: f"({v} >= (0))")

    def _op_LN(self, node: Node) -> Pair:
        return self._domain(node, "ln", lambda v: f"({v} > (0))")

    def _op_LOG10(self, node: Node) -> Pair:
        return self._domain(node, "log10", lambda v: f"({v} > (0))")

    def _op_EXP(self, node: Node) -> Pair:
        value, error = self(node.args[0])
        result = call("exp", as_number(value))
        return result, or_errors(error, bad_number(result))

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
        return "(" + " + ".join(as_number(v) for v in values) + ")", error

    def _op_AVERAGE(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        total = "(" + " + ".join([SQL_ZERO, *(as_number(v) for v in values)]) + ")"
        count = "(" + " + ".join(["(0)", *(cast(not_null(v), "int") for v in values)]) + ")"
        mean = f"({total} / {when((f'({count} > (0))', count))})"
        return mean, or_errors(error, f"({count} = (0))")

    def _op_VALUE(self, node: Node) -> Pair:
        source = node.args[0]
        value, error = self(source)
        if source.type == NUMBER:
            return value, or_errors(error, is_null(value))
        result = text_number(as_text(source, value))
        # A blank is an error too (a spreadsheet's #VALUE! for ""), as is "1e400".
        return result, or_errors(error, f"({result} IS NULL OR {bad_number(result)})")

    # text
    def _op_CONCAT(self, node: Node) -> Pair:
        pairs = [self(a) for a in node.args]
        texts = [as_text(a, p[0]) for a, p in zip(node.args, pairs, strict=True)]
        return call("concat", *texts), or_errors(*(p[1] for p in pairs))

    _op_CONCATENATE = _op_CONCAT

    def _text_arg(self, node: Node) -> Pair:
        value, error = self(node)
        return as_text(node, value), error

    def _count_arg(self, node: Node | None, default: float) -> Pair:
        if node is None:
            return literal(default), None
        value, error = self(node)
        return as_number(value), error

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
                error, SQL_TRUE if given < 0 else None
            )
        count, count_error = self._count_arg(node.args[1] if len(node.args) > 1 else None, 1)
        value = call(function, text, coalesce(as_int(count), "(0)"))
        return value, or_errors(error, count_error, f"({count} < (0))")

    def _op_MID(self, node: Node) -> Pair:
        text, error = self._text_arg(node.args[0])
        start, start_error = self._count_arg(node.args[1], 1)
        count, count_error = self._count_arg(node.args[2], 0)
        bad = f"(({start} < (1)) OR ({count} < (0)))"
        value = call(
            "substring",
            text,
            coalesce(when((f"({start} >= (1))", as_int(start))), "(1)"),
            coalesce(when((f"({count} >= (0))", as_int(count))), "(0)"),
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
            return (literal(folded), None) if folded is not None else (SQL_NULL, SQL_TRUE)
        (year, month, day), error = self.values(node.args)
        year, month, day = as_number(year), as_number(month), as_number(day)
        valid = and_(f"({year} >= (1))", f"({year} < (10000))", f"(abs({month}) < (120000))",
                     f"(abs({day}) < 4000000.0D)")  # fmt: skip
        first = call("make_date", when((valid, as_int(year))), "(1)", "(1)")
        value = call("date_add", call("add_months", first, f"({as_int(month)} - (1))"),
                     f"({as_int(day)} - (1))")  # fmt: skip
        return when((valid, value)), or_errors(error, not_(valid))

    def _op_DATEVALUE(self, node: Node) -> Pair:
        source = node.args[0]
        value, error = self(source)
        if source.type == DATE_T:
            return value, error
        result = try_cast(call("trim", as_text(source, value)), "date")
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
        return call("add_months", date, as_int(as_number(months))), error

    def _op_EOMONTH(self, node: Node) -> Pair:
        (date, months), error = self.values(node.args)
        return call("last_day", call("add_months", date, as_int(as_number(months)))), error

    # Functions a spreadsheet user reaches for (numbers)
    def _significance(self, node: Node, up: bool) -> Pair:
        """CEILING/FLOOR(x, significance): the quotient rounded to 9 places first, so that
        1.5 / 0.1 (15.000000000000002) is 15, as a spreadsheet's 15 digits see it."""
        (x, significance), error = self.values(node.args)
        x, significance = as_number(x), as_number(significance)
        nonzero = when((binary(significance, "<>", SQL_ZERO), significance))
        quotient = call("round", f"({x} / {nonzero})", "9")
        whole = f"(- {as_whole(f'(- {quotient})')})" if up else as_whole(quotient)
        value = coalesce(f"({whole} * {significance})", SQL_ZERO)
        bad = and_(f"({x} > {SQL_ZERO})", f"({significance} < {SQL_ZERO})")
        if not up:  # FLOOR(x, 0) is a division by zero, CEILING(x, 0) is 0
            bad = f"({bad} OR (({significance} = {SQL_ZERO}) AND ({x} <> {SQL_ZERO})))"
        return value, or_errors(error, bad)

    def _op_CEILING(self, node: Node) -> Pair:
        if len(node.args) > 1:
            return self._significance(node, up=True)
        return self._unary_number(node, lambda v: f"(- {as_whole(f'(- {v})')})")

    _op_CEIL = _op_CEILING

    def _op_FLOOR(self, node: Node) -> Pair:
        if len(node.args) > 1:
            return self._significance(node, up=False)
        return self._op_INT(node)

    def _toward(self, node: Node, up: bool) -> Pair:
        """ROUNDUP (away from zero) and ROUNDDOWN/TRUNC (toward zero) to n digits; the scaled
        value is rounded to 9 places first (4.35 * 100 is 434.99999999999994)."""
        value, error = self(node.args[0])
        value = as_number(value)
        digits = int(constant_number(node.args[1]) or 0) if len(node.args) > 1 else 0
        factor = literal(float(10 ** abs(digits)))
        grow, shrink = ("*", "/") if digits >= 0 else ("/", "*")
        scaled = call("round", f"(abs({value}) {grow} {factor})", "9")
        whole = f"(- {as_whole(f'(- {scaled})')})" if up else as_whole(scaled)
        return f"(signum({value}) * ({whole} {shrink} {factor}))", error

    def _op_ROUNDUP(self, node: Node) -> Pair:
        return self._toward(node, up=True)

    def _op_ROUNDDOWN(self, node: Node) -> Pair:
        return self._toward(node, up=False)

    _op_TRUNC = _op_ROUNDDOWN

    def _op_MROUND(self, node: Node) -> Pair:
        (x, multiple), error = self.values(node.args)
        x, multiple = as_number(x), as_number(multiple)
        nonzero = when((binary(multiple, "<>", SQL_ZERO), multiple))
        quotient = call("round", call("round", f"({x} / {nonzero})", "9"), "0")
        value = coalesce(f"({quotient} * {multiple})", SQL_ZERO)
        return value, or_errors(error, f"(({x} * {multiple}) < {SQL_ZERO})")

    def _op_LOG(self, node: Node) -> Pair:
        if len(node.args) == 1:
            return self._op_LOG10(node)
        (x, base), error = self.values(node.args)
        x, base = as_number(x), as_number(base)
        valid = and_(f"({x} > {SQL_ZERO})", f"({base} > {SQL_ZERO})", f"({base} <> 1.0D)")
        value = call("log", when((valid, base)), x)
        return value, or_errors(error, not_(valid))

    def _op_PI(self, node: Node) -> Pair:
        return literal(math.pi), None

    def _op_MEDIAN(self, node: Node) -> Pair:
        values, error = self.values(node.args)
        present = f"array_sort(filter(array({', '.join(values)}), fq_v -> fq_v IS NOT NULL))"
        size = f"size({present})"
        upper = f"element_at({present}, CAST(({size} DIV 2) + 1 AS INT))"
        lower = f"element_at({present}, CAST(greatest({size} DIV 2, 1) AS INT))"
        value = when((f"({size} = 0)", SQL_NULL), (f"(({size} % 2) = 1)", upper),
                     otherwise=f"(({lower} + {upper}) / 2.0D)")  # fmt: skip
        return value, or_errors(error, f"({size} = 0)")

    # logic
    _op_IFNA = _op_IFERROR

    def _is_type(self, node: Node, kind: str) -> Pair:
        source = node.args[0]
        if source.type != kind:
            return SQL_FALSE, None
        value, error = self(source)
        return (not_null(value) if error is None else and_(not_null(value), not_(error))), None

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
        return f"({coalesce(value, SQL_EMPTY)} RLIKE {literal(node.value)})", error

    def _position(self, node: Node, case: bool) -> Pair:
        """FIND (with case) and SEARCH (without; wildcards in a constant pattern)."""
        (find, find_error), (within, within_error) = (self._text_arg(a) for a in node.args[:2])
        error = or_errors(find_error, within_error)
        start, start_error = self._count_arg(node.args[2] if len(node.args) > 2 else None, 1)
        valid = and_(f"({start} >= 1.0D)", f"({start} <= (length({within}) + 1))")
        first = coalesce(when((valid, as_int(start))), "(1)")
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
        bad = f"({not_(valid)} OR ({position} = 0))"
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
        return when((f"(length({text}) = 0)", SQL_EMPTY), otherwise=joined), error

    def _op_REPLACE(self, node: Node) -> Pair:
        old, error = self._text_arg(node.args[0])
        start, start_error = self._count_arg(node.args[1], 1)
        count, count_error = self._count_arg(node.args[2], 0)
        new, new_error = self._text_arg(node.args[3])
        valid = and_(f"({start} >= 1.0D)", f"({count} >= {SQL_ZERO})")
        value = call("overlay", old, new, coalesce(when((valid, as_int(start))), "(1)"),
                     coalesce(when((valid, as_int(count))), "(0)"))  # fmt: skip
        return value, or_errors(error, start_error, count_error, new_error, not_(valid))

    def _op_REPT(self, node: Node) -> Pair:
        text, error = self._text_arg(node.args[0])
        times, times_error = self._count_arg(node.args[1], 0)
        valid = and_(f"({times} >= {SQL_ZERO})", f"((length({text}) * {times}) <= {_MAX_TEXT})")
        value = call("repeat", text, coalesce(when((valid, as_int(times))), "(0)"))
        return value, or_errors(error, times_error, not_(valid))

    def _op_TEXTJOIN(self, node: Node) -> Pair:
        delimiter, error = self._text_arg(node.args[0])
        ignore, ignore_error = self(node.args[1])
        pairs = [self._text_arg(a) for a in node.args[2:]]
        texts = [p[0] for p in pairs]
        skipping = call("concat_ws", delimiter, *(call("nullif", t, SQL_EMPTY) for t in texts))
        keeping = call("concat_ws", delimiter, *texts)
        if node.args[1].op == "const":
            value = skipping if node.args[1].value else keeping
        else:
            value = when((as_condition(ignore), skipping), otherwise=keeping)
        too_long = f"(length({value}) > {_MAX_TEXT})"
        return when((not_(too_long), value)), or_errors(
            error, ignore_error, *(p[1] for p in pairs), too_long
        )

    def _op_EXACT(self, node: Node) -> Pair:
        (a, a_error), (b, b_error) = (self._text_arg(arg) for arg in node.args)
        return binary(a, "=", b), or_errors(a_error, b_error)

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
        return cast(bind(values, network_days), "double"), error

    def _op_YEARFRAC(self, node: Node) -> Pair:
        (first, second), error = self.values(node.args[:2])
        basis = int(constant_number(node.args[2]) or 0) if len(node.args) > 2 else 0

        def fraction(first: Expr, second: Expr) -> Expr:
            start, end = call("least", first, second), call("greatest", first, second)
            return bind([start, end], lambda s, e: year_fraction(s, e, basis))

        return bind([first, second], fraction), error


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


#: The longest text REPT and TEXTJOIN give (a spreadsheet cell's limit).
_MAX_TEXT = "32767"


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

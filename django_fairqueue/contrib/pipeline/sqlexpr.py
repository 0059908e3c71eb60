"""Spark SQL expression text, put together as strings: names and constants as data
(:func:`quoted`, :func:`literal`), operators and calls, the conversions of spreadsheet
semantics (a blank as 0 or "", a number as text and text as a number, as a spreadsheet shows
and reads them), and the longer computations some functions need (NETWORKDAYS, YEARFRAC,
TEXT's formats).

:mod:`.compile` builds a checked tree's text from these; the batch's casts and error flags
(:mod:`.execute`) use them too. None of them walks a tree or needs a Spark session.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from django_fairqueue.contrib.pipeline import textformat
from django_fairqueue.contrib.pipeline.formula_criteria import NUMBER_START, NUMBER_TEXT
from django_fairqueue.contrib.pipeline.formula_tree import (
    BLANK,
    BOOLEAN,
    DATE_T,
    DATETIME,
    NUMBER,
    TEXT,
    Node,
)

Expr = str  # a Spark SQL expression
_BLANK_DATE = dt.date(1899, 12, 31)  # what a blank date compares as (a spreadsheet's day 0)

SPARK_TYPES = {NUMBER: "double", TEXT: "string", BOOLEAN: "boolean", DATE_T: "date",
               DATETIME: "timestamp_ntz"}  # fmt: skip

SQL_TRUE, SQL_FALSE, SQL_NULL = "true", "false", "NULL"
SQL_ZERO = "0.0D"
_INF = "CAST('Infinity' AS DOUBLE)"
_SAFE_INTEGER = "9.0E15D"  # beyond this a double has no fraction; casts to long are guarded
_INT_RANGE = "2.0E9D"
_MAX_DOUBLE = "1.7976931348623157E308D"
SQL_EMPTY = "''"


# --------------------------------------------------------------------------------------------
# Text of names, constants and operators


def quoted(name: str) -> Expr:
    """A column by its exact name (no nested-field or wildcard interpretation)."""
    return "`" + name.replace("`", "``") + "`"


def literal(value: Any) -> Expr:
    """A constant as Spark SQL, typed as ``pyspark.sql.functions.lit`` would type it."""
    if value is None:
        return SQL_NULL
    if isinstance(value, bool):
        return SQL_TRUE if value else SQL_FALSE
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


def binary(a: Expr, op: str, b: Expr) -> Expr:
    return f"({a} {op} {b})"


def not_(a: Expr) -> Expr:
    return f"(NOT {a})"


def and_(*terms: Expr) -> Expr:
    return "(" + " AND ".join(terms) + ")"


def is_null(value: Expr) -> Expr:
    return f"({value} IS NULL)"


def not_null(value: Expr) -> Expr:
    return f"({value} IS NOT NULL)"


def lost(before: Expr, after: Expr) -> Expr:
    """A value a conversion turned into NULL (a cast that failed): an error value."""
    return and_(not_null(before), is_null(after))


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


def bad_number(value: Expr) -> Expr:
    """NaN or infinite (NULL for NULL). Spark orders NaN above infinity, so one comparison
    covers both and the value is written once; with the largest double as a literal, not
    infinity (a cast Spark would analyse and fold again in every check of every rule)."""
    return f"(NOT (abs({value}) <= {_MAX_DOUBLE}))"


#: A double constant as :func:`literal` writes it: never blank, so no ``coalesce`` around it
#: (an integer one stays coalesced to a double: integer arithmetic could overflow).
_NUMBER_LITERAL = re.compile(r"^\(-?[0-9][0-9.]*([eE][-+]?[0-9]+)?D\)$")


def as_number(value: Expr) -> Expr:
    """A number, blank as 0 (a constant as it is: every ``coalesce`` is text Spark parses,
    analyses and folds again for each rule, in each tenant's plan)."""
    if _NUMBER_LITERAL.match(value):
        return value
    return coalesce(value, SQL_ZERO)


def as_whole(value: Expr) -> Expr:
    """floor() of a (non-blank) number, as a double, without a cast that could overflow."""
    return when((f"(abs({value}) < {_SAFE_INTEGER})", cast(call("floor", value), "double")),
                otherwise=value)  # fmt: skip


def as_int(value: Expr) -> Expr:
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
    plain = call("regexp_replace", call("regexp_replace", plain, "'0+$'", SQL_EMPTY), "'[.]$'",
                 SQL_EMPTY)  # fmt: skip
    scientific = call("regexp_replace", digits, "'[.]?0+E'", "'E'")
    magnitude = call("abs", value)
    shown_plainly = and_(f"({magnitude} >= {_PLAIN_LOW})", f"({magnitude} < {_PLAIN_HIGH})")
    return when((binary(value, "=", SQL_ZERO), "'0'"), (shown_plainly, plain), otherwise=scientific)


def text_number(text: Expr) -> Expr:
    """Text as a number the way a spreadsheet reads it (``" 1,234.5 "``, ``"-12%"``,
    ``"1e3"``), NULL for anything else (Java's ``"12d"``, ``"Infinity"``, ``"0x1F"``, "")."""
    return bind([call("trim", text)], _text_number)


def _text_number(trimmed: Expr) -> Expr:
    accepted = and_(
        call("regexp_like", trimmed, literal(NUMBER_TEXT)),
        call("regexp_like", trimmed, literal(NUMBER_START)),
    )
    bare = call("regexp_replace", trimmed, "'[,%$]'", SQL_EMPTY)
    number = try_cast(bare, "double")
    scaled = when((call("endswith", trimmed, "'%'"), f"({number} / 100.0D)"), otherwise=number)
    return when((accepted, scaled))


def as_text(node: Node, value: Expr) -> Expr:
    """A value as text, blank as ""."""
    if node.type == TEXT:
        return value if node.op == "const" else coalesce(value, SQL_EMPTY)
    if node.type == NUMBER:
        return coalesce(number_text(value), SQL_EMPTY)
    if node.type == BOOLEAN:
        return when((value, "'TRUE'"), (not_(value), "'FALSE'"), otherwise=SQL_EMPTY)
    if node.type == DATE_T:
        return coalesce(call("date_format", value, "'yyyy-MM-dd'"), SQL_EMPTY)
    if node.type == DATETIME:
        return coalesce(call("date_format", value, "'yyyy-MM-dd HH:mm:ss'"), SQL_EMPTY)
    return SQL_EMPTY


def as_condition(value: Expr) -> Expr:
    return coalesce(value, SQL_FALSE)


def comparable(node: Node, value: Expr, other: str) -> Expr:
    kind = node.type if node.type != BLANK else other
    if kind == NUMBER:
        return as_number(value)
    if kind == TEXT:
        if node.op == "const" and node.type == TEXT and node.value.isascii():  # lowered here
            return literal(node.value.lower())
        return call("lower", coalesce(value, SQL_EMPTY))
    if kind == BOOLEAN:
        return coalesce(value, SQL_FALSE)
    if kind == DATE_T:
        return coalesce(value, literal(_BLANK_DATE))
    if kind == DATETIME:
        return coalesce(value, literal(dt.datetime.combine(_BLANK_DATE, dt.time())))
    return SQL_ZERO


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


# --------------------------------------------------------------------------------------------
# Date counts and number formats of spreadsheet functions


def network_days(start: Expr, end: Expr, *holidays: Expr) -> Expr:
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


def year_fraction(start: Expr, end: Expr, basis: int) -> Expr:
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
            feb_end1 = and_(f"({m1} = 2)", f"({start} = last_day({start}))")
            feb_end2 = and_(f"({m2} = 2)", f"({end} = last_day({end}))")
            day1 = when((f"(({d1} = 31) OR {feb_end1})", "30"), otherwise=d1)
            day2 = when((and_(f"({d2} = 31)", f"({d1} >= 30)"), "30"),
                        (and_(feb_end1, feb_end2), "30"), otherwise=d2)  # fmt: skip
        total = f"(((({y2} - {y1}) * 360) + (({m2} - {m1}) * 30)) + ({day2} - {day1}))"
        return f"(CAST({total} AS DOUBLE) / 360.0D)"

    # basis 1, actual/actual: within a year, 366 days if a February 29 is inside; else the
    # average length of the years the dates span.
    def leap(year: Expr) -> Expr:
        return f"((({year} % 4) = 0 AND ({year} % 100) <> 0) OR ({year} % 400) = 0)"

    def feb29_inside(year: Expr) -> Expr:
        feb29 = f"date_add(make_date({year}, 3, 1), -1)"
        return and_(leap(year), f"({start} <= {feb29})", f"({end} >= {feb29})")

    within_year = (f"(({y1} = {y2}) OR (({y2} = {y1} + 1) AND (({m1} > {m2}) OR "
                   f"(({m1} = {m2}) AND ({d1} >= {d2})))))")  # fmt: skip
    one_year = when((f"(({y1} = {y2}) AND {leap(y1)})", "366.0D"),
                    (f"({feb29_inside(y1)} OR {feb29_inside(y2)})", "366.0D"),
                    otherwise="365.0D")  # fmt: skip
    span = f"CAST(datediff(make_date({y2} + 1, 1, 1), make_date({y1}, 1, 1)) AS DOUBLE)"
    average = f"({span} / CAST(({y2} - {y1}) + 1 AS DOUBLE))"
    return when((within_year, f"({days} / {one_year})"), otherwise=f"({days} / {average})")


def formatted(kind: str, value: Expr, spec: textformat.Format) -> Expr:
    """TEXT(value, format): ``value`` of type ``kind`` shown as ``spec`` describes."""
    if kind == TEXT or isinstance(spec, textformat.Text):
        return coalesce(value, SQL_EMPTY) if kind == TEXT else as_text(Node("v", kind), value)
    if kind == BOOLEAN:
        return as_text(Node("v", kind), value)
    if isinstance(spec, textformat.DateFormat):
        if kind == NUMBER:  # a spreadsheet's date serial number: days since 1899-12-30
            value = call("date_add", literal(dt.date(1899, 12, 30)), as_int(as_number(value)))
        return coalesce(call("date_format", value, literal(spec.pattern)), SQL_EMPTY)
    if kind in (DATE_T, DATETIME):  # a date as its serial number
        value = cast(call("datediff", cast(value, "date"), literal(dt.date(1899, 12, 30))),
                     "double")  # fmt: skip
    value = as_number(value)
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
            shown = call("regexp_replace", shown, literal("^0(?=[.]|$)"), SQL_EMPTY)
    if spec.optional_decimals:  # "#" places: their trailing zeros go
        zeros = literal(f"0{{1,{spec.optional_decimals}}}(?=$|E)")
        shown = call("regexp_replace", shown, zeros, SQL_EMPTY)
    if spec.point and not places:
        shown = f"concat({shown}, '.')"
    sign = when((f"({value} < {SQL_ZERO})", "'-'"), otherwise=SQL_EMPTY)
    return call("concat", sign, literal(spec.prefix), shown, literal(spec.suffix))

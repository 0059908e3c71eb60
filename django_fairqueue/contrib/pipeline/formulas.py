"""Tenant formulas: a spreadsheet-like language, parsed and type-checked before any job starts.

A formula is ``name = expression`` (an expression may start with ``=``, as in a spreadsheet
cell): ``total = IF(qty > 0, price * qty, 0)``, ``label = UPPER(LEFT(city, 3)) & "-" & id``,
``share = total / SUM(total BY region)``. The grammar is an LALR grammar run by `lark
<https://github.com/lark-parser/lark>`_ (no recursion while parsing, so no input can exhaust
Python's stack); this module turns lark's tree into a small typed tree (:class:`Node`) after
checking its depth and size, and checks every name, function, argument count and type. No
Spark session is needed for any of it: :mod:`.compile` turns a checked tree into Spark SQL
expression text in which the tenant's names and constants are data, never SQL.

Types: number, text, boolean, date, and the blank (``NULL``/a missing value). Errors (a
division by zero, ``SQRT(-1)``, ``VALUE("abc")``, ...) are values, as in a spreadsheet: the
cell is empty and the rule's error count goes up; they never fail a batch.

This module needs neither Django's app registry nor PySpark.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

#: Kinds of source and sink columns (from their PostgreSQL types; see execute.py).
INT, FLOAT, DECIMAL, STR, BOOL, DATE, NULL = (
    "int",
    "float",
    "decimal",
    "str",
    "bool",
    "date",
    "null",
)
NUMERIC_KINDS = (INT, FLOAT, DECIMAL)

#: Types of formula values.
NUMBER, TEXT, BOOLEAN, DATE_T, BLANK = "number", "text", "boolean", "date", "blank"
#: A date and time of day (what NOW() gives), in the pipeline's time zone, without the zone.
DATETIME = "datetime"
_KIND_TYPE = {INT: NUMBER, FLOAT: NUMBER, DECIMAL: NUMBER, STR: TEXT, BOOL: BOOLEAN, DATE: DATE_T}

#: Limits, checked before anything recursive runs.
MAX_FORMULA_LENGTH = 8192  # characters of one expression (a spreadsheet cell's limit)
MAX_DEPTH = 64  # nesting of one expression (a spreadsheet's function nesting limit)
MAX_NODES = 2000  # operators, calls, names and constants in one expression
MAX_RULES = 2000  # formulas of one tenant
MAX_TOTAL_NODES = 200_000  # over all of a tenant's formulas
MAX_CHAIN_DEPTH = 400  # nesting once each rule's references to other rules are counted
RESERVED_PREFIX = "__fq_"  # the columns the compiled formulas add (errors, aggregates)
#: Text a spreadsheet reads as a number (VALUE, criteria such as ">1,000"), once the spaces
#: around it are trimmed: a sign, digits with optional thousands separators, a fraction, an
#: exponent, a percent sign (a hundredth), a dollar sign after the sign; and a digit before
#: any exponent.
NUMBER_TEXT = r"^[+-]?[$]?([0-9]{1,3}(,[0-9]{3})+|[0-9]+)?([.][0-9]*)?([eE][+-]?[0-9]+)?%?$"
NUMBER_START = r"^[+-]?[$]?[.]?[0-9]"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_TARGET = re.compile(r"^\s*`?([A-Za-z_][A-Za-z0-9_]*)`?\s*=(?!=)\s*(.*)$", re.DOTALL)


class FormulaError(ValueError):
    """A tenant's formula is invalid; the message names the tenant and the formula."""

    def __init__(self, tenant: str, formula: str, reason: str) -> None:
        self.tenant = tenant
        self.formula = formula
        self.reason = reason
        if formula:
            super().__init__(f"tenant {tenant!r}: invalid formula {formula!r}: {reason}")
        else:  # about the tenant's formulas as a whole (none, too many, unreadable)
            super().__init__(f"tenant {tenant!r}: {reason}")


class _Invalid(Exception):
    pass


# --------------------------------------------------------------------------------------------
# Grammar

GRAMMAR = r"""
?start: expr
?expr: or_expr
?or_expr: and_expr | or_expr OR and_expr -> or_op
?and_expr: not_expr | and_expr AND not_expr -> and_op
?not_expr: comparison | NOT not_expr -> not_op
?comparison: concat
    | concat CMP concat -> compare
    | concat IS NULL -> is_null
    | concat IS NOT NULL -> is_not_null
    | concat BETWEEN concat AND concat -> between
    | concat NOT BETWEEN concat AND concat -> not_between
    | concat IN "(" expr ("," expr)* ")" -> in_list
    | concat NOT IN "(" expr ("," expr)* ")" -> not_in_list
?concat: sum | concat "&" sum -> concat
?sum: product | sum ADDOP product -> arith
?product: power | product MULOP power -> arith
?power: unary | power POWOP unary -> arith
?unary: atom | ADDOP unary -> unary
?atom: NUMBER -> number
    | PERCENT -> percent
    | STRING -> string
    | TRUE -> true
    | FALSE -> false
    | NULL -> null
    | NAME -> name
    | QUOTED -> name
    | NAME "(" [args] [by] ")" -> call
    | CASE (WHEN expr THEN expr)+ [ELSE expr] END -> case
    | CAST "(" expr AS NAME ["(" NUMBER ["," NUMBER] ")"] ")" -> cast
    | "(" expr ")"
args: expr ("," expr)*
by: BY expr ("," expr)*
CMP: "<=" | ">=" | "<>" | "!=" | "==" | "=" | "<" | ">"
ADDOP: "+" | "-"
MULOP: "*" | "/" | "%"
POWOP: "^"
OR: "OR"i
AND: "AND"i
NOT: "NOT"i
IS: "IS"i
NULL: "NULL"i
BETWEEN: "BETWEEN"i
IN: "IN"i
TRUE: "TRUE"i
FALSE: "FALSE"i
CASE: "CASE"i
WHEN: "WHEN"i
THEN: "THEN"i
ELSE: "ELSE"i
END: "END"i
CAST: "CAST"i
AS: "AS"i
BY: "BY"i
NAME: /[A-Za-z_][A-Za-z0-9_]*/i
QUOTED: /`(?:[^`]|``)+`/
NUMBER: /(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?/
PERCENT.2: /(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?%(?!\s*[A-Za-z0-9_.(`"'])/
STRING: /"(?:[^"]|"")*"/ | /'(?:[^']|'')*'/
%ignore /[ \t\r\n]+/
"""


@cache
def _parser() -> Any:
    try:
        from lark import Lark
    except ImportError:
        raise ImportError(
            "the pipeline's formulas need lark: pip install 'django-fairqueue[pipeline]'"
        ) from None

    return Lark(GRAMMAR, parser="lalr", lexer="contextual", maybe_placeholders=True)


# --------------------------------------------------------------------------------------------
# Typed tree


@dataclass(frozen=True)
class Node:
    """A checked expression: ``op`` with typed ``args``.

    ``op``: ``const`` (``value``), ``col`` (a source column), ``ref`` (another rule),
    ``agg`` (a tenant aggregate: ``value`` is the function, ``args`` its argument then the
    ``BY`` expressions), ``case`` (condition, value, ..., [default]), ``cast`` (``value``: the
    target type), or an operator or function name (``+``, ``=``, ``and``, ``concat``, ``IF``, ...).
    ``fallible``: whether evaluating it (or a part of it) can give an error value.
    """

    op: str
    type: str
    args: tuple[Node, ...] = ()
    value: Any = None
    fallible: bool = False

    def key(self) -> str:
        """A canonical text of the tree (equal trees, equal keys)."""
        return json.dumps(_plain(self), separators=(",", ":"), default=str)

    def walk(self) -> Iterator[Node]:
        """This node and every node below it (depth first, without recursion: chains of rules
        nest deep)."""
        stack = [self]
        while stack:
            item = stack.pop()
            stack.extend(item.args)
            yield item


def _plain(node: Node) -> Any:
    return [node.op, node.type, node.value, [_plain(a) for a in node.args]]


def _node(op: str, type_: str, args: Sequence[Node] = (), value: Any = None,
          fallible: bool = False) -> Node:  # fmt: skip
    return Node(op, type_, tuple(args), value, fallible or any(a.fallible for a in args))


@dataclass(frozen=True)
class Function:
    """A function's signature: argument counts and the types it takes and gives."""

    name: str
    min_args: int
    max_args: int | None  # None: any number
    check: Callable[[list[Node]], tuple[str, bool]]  # -> (result type, can give an error)
    summary: str
    example: str
    aggregate: bool = False


def _require(node: Node, types: Sequence[str], what: str) -> None:
    if node.type not in (*types, BLANK):
        raise _Invalid(f"{what} needs {' or '.join(types)}, got {node.type}")


def _common(nodes: Sequence[Node], what: str) -> str:
    types = {n.type for n in nodes} - {BLANK}
    if not types:
        return BLANK
    if len(types) == 1:
        return types.pop()
    raise _Invalid(f"{what} mixes {' and '.join(sorted(types))}")


def _numbers(result: str = NUMBER, fallible: bool = False) -> Callable[[list[Node]], Any]:
    def check(args: list[Node]) -> tuple[str, bool]:
        for i, arg in enumerate(args):
            _require(arg, (NUMBER,), f"argument {i + 1}")
        return result, fallible

    return check


def _texts(result: str = TEXT, fallible: bool = False, numbers_after: int = 1) -> Any:
    """First ``numbers_after`` arguments are text (any value converts), the rest numbers."""

    def check(args: list[Node]) -> tuple[str, bool]:
        for i, arg in enumerate(args[numbers_after:], start=numbers_after):
            _require(arg, (NUMBER,), f"argument {i + 1}")
        return result, fallible

    return check


def _all_texts(result: str = TEXT, fallible: bool = False) -> Any:
    def check(args: list[Node]) -> tuple[str, bool]:
        return result, fallible

    return check


def constant_number(node: Node) -> float | None:
    """The value of a number constant (``2``, ``-2``), else None."""
    if node.op == "neg":
        inner = constant_number(node.args[0])
        return None if inner is None else -inner
    if node.op == "const" and node.type == NUMBER:
        return float(node.value)
    return None


def _check_round(args: list[Node]) -> tuple[str, bool]:
    _numbers()(args)
    if len(args) > 1:
        digits = constant_number(args[1])
        if digits is None or digits != int(digits) or not -20 <= digits <= 20:
            raise _Invalid("the number of digits must be a whole number from -20 to 20")
    return NUMBER, False


def _check_if(args: list[Node]) -> tuple[str, bool]:
    _require(args[0], (BOOLEAN,), "IF's condition")
    return _common(args[1:], "IF's values"), False


def _check_ifs(args: list[Node]) -> tuple[str, bool]:
    if len(args) % 2:
        raise _Invalid("IFS takes pairs: condition, value, condition, value, ...")
    for condition in args[0::2]:
        _require(condition, (BOOLEAN,), "IFS's conditions")
    return _common(args[1::2], "IFS's values"), True  # no condition true: an error (#N/A)


def _check_logical(args: list[Node]) -> tuple[str, bool]:
    for arg in args:
        _require(arg, (BOOLEAN,), "a logical function")
    return BOOLEAN, False


def _check_same(what: str) -> Callable[[list[Node]], tuple[str, bool]]:
    def check(args: list[Node]) -> tuple[str, bool]:
        return _common(args, what), False

    return check


def _check_minmax(args: list[Node]) -> tuple[str, bool]:
    kind = _common(args, "MIN/MAX")
    if kind not in (NUMBER, DATE_T, TEXT, BLANK):
        raise _Invalid(f"MIN/MAX need numbers, dates or text, got {kind}")
    return kind if kind != BLANK else NUMBER, False


def _check_any(result: str, fallible: bool = False) -> Callable[[list[Node]], tuple[str, bool]]:
    return lambda args: (result, fallible)


def _check_date(args: list[Node]) -> tuple[str, bool]:
    _numbers()(args)
    return DATE_T, True  # a year out of 1..9999


def _check_date_part(args: list[Node]) -> tuple[str, bool]:
    _require(args[0], (DATE_T, DATETIME), "a date function")
    return NUMBER, False


def _check_edate(args: list[Node]) -> tuple[str, bool]:
    _require(args[0], (DATE_T,), "argument 1")
    _require(args[1], (NUMBER,), "argument 2")
    return DATE_T, False


def _check_days(args: list[Node]) -> tuple[str, bool]:
    for arg in args:
        _require(arg, (DATE_T,), "DAYS")
    return NUMBER, False


def _check_datedif(args: list[Node]) -> tuple[str, bool]:
    _require(args[0], (DATE_T,), "DATEDIF's start")
    _require(args[1], (DATE_T,), "DATEDIF's end")
    unit = args[2]
    if unit.op != "const" or not isinstance(unit.value, str) or unit.value.upper() not in (
        "D", "M", "Y", "YM", "MD", "YD"
    ):  # fmt: skip
        raise _Invalid('DATEDIF\'s unit must be "D", "M", "Y", "YM", "MD" or "YD"')
    return NUMBER, True  # start after end: an error


def _check_aggregate(numeric: bool) -> Callable[[list[Node]], tuple[str, bool]]:
    def check(args: list[Node]) -> tuple[str, bool]:
        if numeric:
            _require(args[0], (NUMBER,), "the aggregate")
        return NUMBER, True  # over an error: an error; AVERAGE of nothing: an error

    return check


def _check_agg_minmax(args: list[Node]) -> tuple[str, bool]:
    _require(args[0], (NUMBER, DATE_T), "MIN/MAX")
    return (args[0].type if args[0].type != BLANK else NUMBER), True


def _constant_in(node: Node, allowed: Sequence[float], what: str) -> None:
    value = constant_number(node)
    if value is None or value not in allowed:
        raise _Invalid(f"{what} must be a constant: one of {', '.join(f'{a:g}' for a in allowed)}")


def _check_digits(args: list[Node]) -> tuple[str, bool]:
    """ROUNDUP, ROUNDDOWN, TRUNC: a number and a constant number of digits."""
    return _check_round(args)


def _check_significance(args: list[Node]) -> tuple[str, bool]:
    """CEILING/FLOOR(x[, significance]): signs that differ (x > 0, significance < 0) and
    FLOOR's significance 0 are errors."""
    _numbers()(args)
    return NUMBER, len(args) > 1


def _check_log(args: list[Node]) -> tuple[str, bool]:
    _numbers()(args)
    return NUMBER, True


def _check_find(args: list[Node]) -> tuple[str, bool]:
    if len(args) > 2:
        _require(args[2], (NUMBER,), "the start position")
    return NUMBER, True  # not found: an error


def _check_replace(args: list[Node]) -> tuple[str, bool]:
    _require(args[1], (NUMBER,), "REPLACE's start")
    _require(args[2], (NUMBER,), "REPLACE's count")
    return TEXT, True


def _check_textjoin(args: list[Node]) -> tuple[str, bool]:
    _require(args[1], (BOOLEAN,), "TEXTJOIN's ignore_empty")
    return TEXT, True  # longer than 32,767 characters: an error


def _check_text_format(args: list[Node]) -> tuple[str, bool]:
    fmt = args[1]
    if fmt.op != "const" or not isinstance(fmt.value, str):
        raise _Invalid("TEXT's format must be a text constant")
    from django_fairqueue.contrib.pipeline import textformat

    try:
        textformat.parse(fmt.value)
    except ValueError as exc:
        raise _Invalid(str(exc)) from None
    return TEXT, False


def _check_switch(args: list[Node]) -> tuple[str, bool]:
    cases = args[1:]
    pairs = cases[: len(cases) - len(cases) % 2]
    for value in pairs[0::2]:
        _common([args[0], value], "SWITCH's values")
    results = [*pairs[1::2], *(cases[-1:] if len(cases) % 2 else [])]
    return _common(results, "SWITCH's results"), True  # no match and no default: an error


def _check_choose(args: list[Node]) -> tuple[str, bool]:
    _require(args[0], (NUMBER,), "CHOOSE's index")
    return _common(args[1:], "CHOOSE's values"), True  # index out of range: an error


def _check_weeknum(args: list[Node]) -> tuple[str, bool]:
    _require(args[0], (DATE_T, DATETIME), "WEEKNUM's date")
    if len(args) > 1:
        _constant_in(args[1], WEEKNUM_TYPES, "WEEKNUM's return type")
    return NUMBER, False


def _check_networkdays(args: list[Node]) -> tuple[str, bool]:
    for i, arg in enumerate(args):
        _require(arg, (DATE_T,), f"NETWORKDAYS' argument {i + 1}")
    return NUMBER, False


def _check_yearfrac(args: list[Node]) -> tuple[str, bool]:
    _require(args[0], (DATE_T,), "YEARFRAC's start")
    _require(args[1], (DATE_T,), "YEARFRAC's end")
    if len(args) > 2:
        _constant_in(args[2], (0, 1, 2, 3, 4), "YEARFRAC's basis")
    return NUMBER, False


def _check_median(args: list[Node]) -> tuple[str, bool]:
    _numbers()(args)
    return NUMBER, True  # no number: an error


def _check_is_type(args: list[Node]) -> tuple[str, bool]:
    return BOOLEAN, False


#: WEEKNUM's return types: 1 (weeks start on Sunday), 2 and 11 (Monday), 12-17 (Tuesday to
#: Sunday), 21 (ISO 8601 weeks).
WEEKNUM_TYPES = (1, 2, 11, 12, 13, 14, 15, 16, 17, 21)


def _f(name: str, lo: int, hi: int | None, check: Any, summary: str, example: str,
       aggregate: bool = False) -> Function:  # fmt: skip
    return Function(name, lo, hi, check, summary, example, aggregate)


#: Every function of the language, by upper-case name (the reference table of the how-to is
#: this table). Names are case-insensitive.
FUNCTIONS: dict[str, Function] = {
    f.name: f
    for f in [
        # logic
        _f("IF", 2, 3, _check_if, "value by condition; blank if false and no else",
           'IF(qty > 10, "bulk", "retail")'),
        _f("IFS", 2, None, _check_ifs, "the value of the first true condition; none: error",
           'IFS(total >= 500, "high", total >= 100, "mid", TRUE, "low")'),
        _f("AND", 1, None, _check_logical, "all true (blank is false)", "AND(qty > 0, price > 0)"),
        _f("OR", 1, None, _check_logical, "any true", "OR(qty = 0, ISBLANK(price))"),
        _f("NOT", 1, 1, _check_logical, "not", "NOT(ISBLANK(note))"),
        _f("XOR", 1, None, _check_logical, "an odd number true", "XOR(a > 0, b > 0)"),
        _f("IFERROR", 2, 2, _check_same("IFERROR"), "the value, or the second if it is an error",
           "IFERROR(price / qty, 0)"),
        _f("ISERROR", 1, 1, _check_any(BOOLEAN), "whether the value is an error",
           "ISERROR(price / qty)"),
        _f("ISBLANK", 1, 1, _check_any(BOOLEAN), "whether the value is blank", "ISBLANK(note)"),
        _f("COALESCE", 1, None, _check_same("COALESCE"), "the first non-blank value",
           'COALESCE(note, "n/a")'),
        _f("NULLIF", 2, 2, _check_same("NULLIF"), "blank if both are equal (as = compares: "
           "text without case), else the first", "NULLIF(qty, 0)"),
        _f("IFNA", 2, 2, _check_same("IFNA"), "same as IFERROR (the language has one kind of "
           "error)", 'IFNA(VALUE(code), -1)'),
        _f("ISNUMBER", 1, 1, _check_is_type, "whether the value is a number (not blank, not "
           "an error)", "ISNUMBER(price)"),
        _f("ISTEXT", 1, 1, _check_is_type, "whether the value is text (not blank, not an "
           "error)", "ISTEXT(note)"),
        _f("SWITCH", 3, None, _check_switch, "the result of the first value equal to the "
           "expression (as = compares), else the default; no match and no default: error",
           'SWITCH(MONTH(d), 1, "Jan", 2, "Feb", "other")'),
        _f("CHOOSE", 2, None, _check_choose, "the index-th value (1 is the first; the index "
           "truncated); out of range: error", 'CHOOSE(qty, "one", "two", "three")'),
        # numbers
        _f("ROUND", 1, 2, _check_round, "round half away from zero to n digits (default 0)",
           "ROUND(price * 1.2, 2)"),
        _f("ABS", 1, 1, _numbers(), "absolute value", "ABS(delta)"),
        _f("SIGN", 1, 1, _numbers(), "-1, 0 or 1", "SIGN(delta)"),
        _f("INT", 1, 1, _numbers(), "round down to an integer", "INT(price)"),
        _f("FLOOR", 1, 2, _check_significance, "round down to an integer, or to a multiple of "
           "the significance (toward zero if both are negative); x > 0 with a negative "
           "significance, or a significance of 0: error", "FLOOR(price, 0.05)"),
        _f("CEILING", 1, 2, _check_significance, "round up to an integer, or to a multiple of the "
           "significance (away from zero if both are negative); x > 0 with a negative "
           "significance: error; significance 0: 0", "CEILING(price, 0.25)"),
        _f("CEIL", 1, 2, _check_significance, "same as CEILING", "CEIL(price)"),
        _f("ROUNDUP", 2, 2, _check_digits, "round away from zero to n digits",
           "ROUNDUP(price, 1)"),
        _f("ROUNDDOWN", 2, 2, _check_digits, "round toward zero to n digits",
           "ROUNDDOWN(price, 1)"),
        _f("TRUNC", 1, 2, _check_digits, "cut to n digits (default 0), toward zero",
           "TRUNC(price)"),
        _f("MROUND", 2, 2, _numbers(fallible=True), "round half away from zero to a multiple; "
           "signs that differ: error; multiple 0: 0", "MROUND(price, 0.05)"),
        _f("LOG", 1, 2, _check_log, "logarithm to a base (default 10); x <= 0, base <= 0 or "
           "base 1: error", "LOG(8, 2)"),
        _f("PI", 0, 0, _check_any(NUMBER), "3.14159265358979", "PI() * r ^ 2"),
        _f("MEDIAN", 1, None, _check_median, "one argument: the tenant's median (aggregate); "
           "several: their median, blanks ignored; none: error", "MEDIAN(price BY region)"),
        _f("RANK", 1, 2, _check_any(NUMBER), "the rank of the row's value among the tenant's "
           "values of it (aggregate), 1 for the largest (order 0, default) or the smallest "
           "(order 1), ties sharing the better rank; blank: error", "RANK(revenue BY region)"),
        _f("SUMPRODUCT", 1, None, _numbers(), "the tenant's sum of the products of the "
           "arguments, row by row (aggregate); blanks as 0", "SUMPRODUCT(price, qty)"),
        _f("SUMIF", 2, 3, _check_any(NUMBER), "the tenant's sum of sum_range (default: range) "
           "over the rows whose range meets the criterion (aggregate)",
           'SUMIF(region, "north", revenue)'),
        _f("SUMIFS", 3, None, _check_any(NUMBER), "the tenant's sum of sum_range over the rows "
           "that meet every (range, criterion) pair (aggregate)",
           'SUMIFS(revenue, region, "north", qty, ">10")'),
        _f("COUNTIF", 2, 2, _check_any(NUMBER), "the tenant's number of rows whose range meets "
           "the criterion (aggregate)", 'COUNTIF(sku, "a*")'),
        _f("COUNTIFS", 2, None, _check_any(NUMBER), "the tenant's number of rows that meet "
           "every (range, criterion) pair (aggregate)", 'COUNTIFS(region, "north", qty, ">10")'),
        _f("AVERAGEIF", 2, 3, _check_any(NUMBER), "the tenant's mean of average_range (default: "
           "range) over the rows that meet the criterion (aggregate); none: error",
           'AVERAGEIF(qty, ">0")'),
        _f("AVERAGEIFS", 3, None, _check_any(NUMBER), "the tenant's mean of average_range over "
           "the rows that meet every pair (aggregate); none: error",
           'AVERAGEIFS(price, region, "north", qty, "<>0")'),
        _f("MAXIFS", 3, None, _check_any(NUMBER), "the tenant's maximum of max_range over the "
           "rows that meet every pair (aggregate); none: 0", 'MAXIFS(price, region, "north")'),
        _f("MINIFS", 3, None, _check_any(NUMBER), "the tenant's minimum of min_range over the "
           "rows that meet every pair (aggregate); none: 0", 'MINIFS(price, region, "north")'),
        _f("COUNTA", 1, 1, _check_any(NUMBER), "the tenant's number of non-blank values of any "
           "type (aggregate); same as COUNT", "COUNTA(note)"),
        _f("MOD", 2, 2, _numbers(fallible=True), "remainder, with the divisor's sign; "
           "divisor 0: error", "MOD(id, 7)"),
        _f("POWER", 2, 2, _numbers(fallible=True), "x to the power y; no real result: error",
           "POWER(1 + rate, years)"),
        _f("POW", 2, 2, _numbers(fallible=True), "same as POWER", "POW(2, 10)"),
        _f("SQRT", 1, 1, _numbers(fallible=True), "square root; negative: error", "SQRT(area)"),
        _f("EXP", 1, 1, _numbers(fallible=True), "e to the power x", "EXP(rate)"),
        _f("LN", 1, 1, _numbers(fallible=True), "natural logarithm; x <= 0: error", "LN(price)"),
        _f("LOG10", 1, 1, _numbers(fallible=True), "base-10 logarithm; x <= 0: error",
           "LOG10(price)"),
        _f("MIN", 1, None, _check_minmax, "one argument: the tenant's minimum (aggregate); "
           "several: the smallest, blanks ignored", "MIN(price, 100)"),
        _f("MAX", 1, None, _check_minmax, "one argument: the tenant's maximum (aggregate); "
           "several: the largest, blanks ignored", "MAX(price - discount, 0)"),
        _f("LEAST", 1, None, _check_minmax, "the smallest (blanks ignored)", "LEAST(a, b)"),
        _f("GREATEST", 1, None, _check_minmax, "the largest (blanks ignored)", "GREATEST(a, 0)"),
        _f("SUM", 1, None, _numbers(), "one argument: the tenant's total (aggregate); several: "
           "their sum, blanks as 0", "SUM(price, tax, shipping)"),
        _f("AVERAGE", 1, None, _numbers(fallible=True), "one argument: the tenant's mean "
           "(aggregate); several: the mean of the non-blank ones", "AVERAGE(q1, q2, q3, q4)"),
        _f("COUNT", 1, 1, _check_aggregate(False), "the tenant's number of non-blank values "
           "(aggregate)", "COUNT(price BY region)"),
        _f("VALUE", 1, 1, _all_texts(NUMBER, fallible=True), "text to a number as a "
           "spreadsheet reads it (spaces around, a sign, thousands separators, a fraction, an "
           "exponent, a trailing %); anything else, a blank, or a number out of range: error",
           'VALUE(" 1,234.5 ")'),
        # text
        _f("CONCAT", 1, None, _all_texts(), "the values joined as text (blank as \"\"); "
           "same as &", 'CONCAT(city, ", ", country)'),
        _f("CONCATENATE", 1, None, _all_texts(), "same as CONCAT", 'CONCATENATE(a, "-", b)'),
        _f("LEFT", 1, 2, _texts(fallible=True), "the first n characters (default 1); "
           "n < 0: error", "LEFT(sku, 3)"),
        _f("RIGHT", 1, 2, _texts(fallible=True), "the last n characters (default 1); "
           "n < 0: error", "RIGHT(sku, 2)"),
        _f("MID", 3, 3, _texts(fallible=True), "n characters from position start (from 1); "
           "start < 1 or n < 0: error", "MID(sku, 2, 3)"),
        _f("LEN", 1, 1, _all_texts(NUMBER), "number of characters", "LEN(TRIM(name))"),
        _f("LENGTH", 1, 1, _all_texts(NUMBER), "same as LEN", "LENGTH(name)"),
        _f("UPPER", 1, 1, _all_texts(), "upper case", "UPPER(country)"),
        _f("LOWER", 1, 1, _all_texts(), "lower case", "LOWER(email)"),
        _f("TRIM", 1, 1, _all_texts(), "spaces removed at both ends, runs of spaces made one",
           "TRIM(name)"),
        _f("SUBSTITUTE", 3, 3, _all_texts(), "every occurrence of old replaced by new",
           'SUBSTITUTE(phone, "-", "")'),
        _f("FIND", 2, 3, _check_find, "the position of text in text (from 1), with case, from "
           "start (default 1); not found or start out of range: error",
           'FIND("-", sku)'),
        _f("SEARCH", 2, 3, _check_find, "as FIND but without case, and * ? ~ are wildcards "
           "in a constant pattern", 'SEARCH("x*l", sku)'),
        _f("PROPER", 1, 1, _all_texts(), "each letter after a non-letter upper case, the "
           "others lower case", "PROPER(name)"),
        _f("REPLACE", 4, 4, _check_replace, "n characters from start replaced by new text; "
           "start < 1 or n < 0: error", 'REPLACE(sku, 1, 3, "X")'),
        _f("REPT", 2, 2, _texts(fallible=True), "the text repeated n times; n < 0 or a result "
           "over 32,767 characters: error", 'REPT("*", stars)'),
        _f("TEXTJOIN", 3, None, _check_textjoin, "the values joined with a delimiter, empty "
           "ones skipped if ignore_empty; over 32,767 characters: error",
           'TEXTJOIN(", ", TRUE, city, region, country)'),
        _f("EXACT", 2, 2, _all_texts(BOOLEAN), "whether two texts are equal, with case",
           "EXACT(code, UPPER(code))"),
        _f("VLOOKUP", 4, 4, _check_any(BLANK), "the column (1: the key) of the lookup "
           "table's row whose key equals the value (exact match: the 4th argument is FALSE); "
           "none: error", 'VLOOKUP(sku, "prices", 2, FALSE)'),
        _f("XLOOKUP", 3, 4, _check_any(BLANK), "the return column of the lookup table's row "
           "whose key equals the value; none: the 4th argument, else error",
           'XLOOKUP(sku, "prices.sku", "prices.price", 0)'),
        _f("TEXT", 2, 2, _check_text_format, "a number or date as text in a format (the "
           "format codes of the reference's TEXT table)", 'TEXT(price, "$#,##0.00")'),
        # dates
        _f("DATE", 3, 3, _check_date, "the date of year, month, day (months and days past "
           "the end roll over); year outside 1-9999: error", "DATE(2026, 12, 31)"),
        _f("DATEVALUE", 1, 1, _all_texts(DATE_T), "text (YYYY-MM-DD) to a date; not a date: "
           "error", 'DATEVALUE("2026-11-25")'),
        _f("YEAR", 1, 1, _check_date_part, "the year of a date", "YEAR(ordered_on)"),
        _f("MONTH", 1, 1, _check_date_part, "the month (1-12)", "MONTH(ordered_on)"),
        _f("DAY", 1, 1, _check_date_part, "the day of the month (1-31)", "DAY(ordered_on)"),
        _f("WEEKDAY", 1, 1, _check_date_part, "1 (Sunday) to 7 (Saturday)",
           "WEEKDAY(ordered_on)"),
        _f("TODAY", 0, 0, _check_any(DATE_T), "the job's date in the pipeline's time zone (the "
           "same for every batch of a job: pinned when the job is planned)",
           "TODAY() - ordered_on"),
        _f("NOW", 0, 0, _check_any(DATETIME), "the date and time the job was planned, in the "
           "pipeline's time zone (a datetime)", 'TEXT(NOW(), "yyyy-mm-dd hh:mm")'),
        _f("WEEKNUM", 1, 2, _check_weeknum, "the week of the year, week 1 holding January 1; "
           "return type 1 (weeks from Sunday, default), 2 or 11 (Monday), 12-17 (Tuesday to "
           "Sunday), 21 (ISO weeks)", "WEEKNUM(ordered_on, 2)"),
        _f("NETWORKDAYS", 2, None, _check_networkdays, "the weekdays (Monday to Friday) from "
           "start to end, both counted, less the holiday dates given after them; negative if "
           "end is before start", "NETWORKDAYS(ordered_on, shipped_on, DATE(2026, 12, 25))"),
        _f("YEARFRAC", 2, 3, _check_yearfrac, "the years between two dates, as a fraction, by "
           "day-count basis 0 (US 30/360, default), 1 (actual/actual), 2 (actual/360), 3 "
           "(actual/365), 4 (European 30/360)", "YEARFRAC(start_on, end_on, 1)"),
        _f("DAYS", 2, 2, _check_days, "days from start to end: DAYS(end, start)",
           "DAYS(TODAY(), ordered_on)"),
        _f("DATEDIF", 3, 3, _check_datedif, 'whole days ("D"), months ("M") or years ("Y") '
           'from start to end; months less whole years ("YM"), days less whole months ("MD"), '
           'days less whole years ("YD"); start after end: error',
           'DATEDIF(born_on, TODAY(), "Y")'),
        _f("EDATE", 2, 2, _check_edate, "the date n months later (earlier if n < 0)",
           "EDATE(ordered_on, 3)"),
        _f("EOMONTH", 2, 2, _check_edate, "the last day of the month n months later",
           "EOMONTH(ordered_on, 0)"),
    ]
}  # fmt: skip
#: RANK's aggregate with the smallest value first (RANK(x, 1)).
RANK_ASC = "RANK_ASC"
#: The tenant aggregates (one argument, optionally ``BY`` expressions).
AGGREGATES = ("SUM", "AVERAGE", "COUNT", "MIN", "MAX", "MEDIAN")
#: Tenant aggregates written as a spreadsheet writes them: with criteria, or over products.
#: They are rewritten to the aggregates above (SUMIF(r, c, s) is SUM(IF(r meets c, s))).
CRITERIA_AGGREGATES = ("SUMIF", "SUMIFS", "COUNTIF", "COUNTIFS", "AVERAGEIF", "AVERAGEIFS",
                       "MAXIFS", "MINIFS", "COUNTA", "SUMPRODUCT")  # fmt: skip
#: Functions a pipeline allows by default: all of them.
DEFAULT_FUNCTIONS: frozenset[str] = frozenset(FUNCTIONS)

#: CAST(x AS type): accepted type names -> value type.
CAST_TYPES: Mapping[str, str] = {
    "int": NUMBER,
    "integer": NUMBER,
    "bigint": NUMBER,
    "long": NUMBER,
    "double": NUMBER,
    "float": NUMBER,
    "decimal": NUMBER,
    "numeric": NUMBER,
    "number": NUMBER,
    "string": TEXT,
    "text": TEXT,
    "varchar": TEXT,
    "boolean": BOOLEAN,
    "date": DATE_T,
}


# --------------------------------------------------------------------------------------------
# From lark's tree to a checked Node


def _depth_and_size(tree: Any) -> tuple[int, int]:
    """Nesting depth and node count of a lark tree, without recursion."""
    from lark import Tree

    deepest, count = 0, 0
    stack: list[tuple[Any, int]] = [(tree, 1)]
    while stack:
        item, depth = stack.pop()
        count += 1
        deepest = max(deepest, depth)
        if isinstance(item, Tree):
            stack.extend((child, depth + 1) for child in item.children if child is not None)
    return deepest, count


def _expression_depth(tree: Any) -> int:
    """Nesting counted as a reader counts it: operators and calls, not lark's helper rules."""
    from lark import Tree

    deepest = 0
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, Tree):
            continue
        here = depth if item.data in ("args", "by") else depth + 1
        deepest = max(deepest, here)
        stack.extend((child, here) for child in item.children if child is not None)
    return deepest


class _Builder:
    def __init__(
        self,
        columns: Mapping[str, str],
        rules: Mapping[str, Node],
        functions: frozenset[str],
        lookups: Mapping[str, LookupTable] | None = None,
    ) -> None:
        self.columns = columns  # source column -> value type
        self.rules = rules  # a rule built before (one it may use) -> its checked tree
        self.functions = functions
        self.lookups = lookups or {}
        self.in_aggregate = False

    def build(self, tree: Any) -> Node:
        from lark import Token

        if isinstance(tree, Token):  # a bare "(expr)" never reaches here; names do
            raise _Invalid(f"unexpected {tree!s}")
        method = getattr(self, f"_{tree.data}", None)
        if method is None:
            raise _Invalid(f"unsupported construct {tree.data}")
        node: Node = method(*tree.children)
        return node

    # constants
    def _number(self, token: Any) -> Node:
        value = float(token)
        if value != value or value in (float("inf"), float("-inf")):
            raise _Invalid(f"number out of range: {token}")
        return _node("const", NUMBER, value=value)

    def _percent(self, token: Any) -> Node:
        """``10%`` is 0.1, as in a spreadsheet (``a % b``, between operands, is a remainder)."""
        return _node("const", NUMBER, value=self._number(str(token)[:-1]).value / 100)

    def _string(self, token: Any) -> Node:
        quote = token[0]
        return _node("const", TEXT, value=token[1:-1].replace(quote * 2, quote))

    def _true(self, _: Any) -> Node:
        return _node("const", BOOLEAN, value=True)

    def _false(self, _: Any) -> Node:
        return _node("const", BOOLEAN, value=False)

    def _null(self, _: Any) -> Node:
        return _node("const", BLANK)

    def _name(self, token: Any) -> Node:
        name = str(token)
        if name.startswith("`"):
            name = name[1:-1].replace("``", "`")
        if name in self.rules:
            rule = self.rules[name]
            if self.in_aggregate and _has_aggregate(rule):
                raise _Invalid(f"an aggregate's argument uses {name!r}, itself an aggregate")
            return _node("ref", rule.type, value=name, fallible=rule.fallible)
        if name in self.columns:
            return _node("col", self.columns[name], value=name)
        known = ", ".join(sorted({*self.columns, *self.rules})) or "none"
        raise _Invalid(f"unknown name {name!r} (known: {known})")

    # operators
    def _unary(self, op: Any, operand: Any) -> Node:
        node = self.build(operand)
        _require(node, (NUMBER,), f"unary {op}")
        return node if str(op) == "+" else _node("neg", NUMBER, [node])

    def _arith(self, left: Any, op: Any, right: Any) -> Node:
        a, b = self.build(left), self.build(right)
        symbol = str(op)
        if symbol in ("+", "-") and DATE_T in (a.type, b.type):
            if symbol == "-" and a.type == DATE_T and b.type == DATE_T:
                return _node("days", NUMBER, [a, b])
            date, number = (a, b) if a.type == DATE_T else (b, a)
            if symbol == "-" and date is b:
                raise _Invalid("a number minus a date means nothing; subtract dates or days")
            _require(number, (NUMBER,), f"date {symbol}")
            return _node("date+" if symbol == "+" else "date-", DATE_T, [date, number])
        _require(a, (NUMBER,), symbol)
        _require(b, (NUMBER,), symbol)
        fallible = symbol in ("/", "%", "^", "*")  # division by zero; overflow; no real power
        return _node(symbol, NUMBER, [a, b], fallible=fallible)

    def _concat(self, left: Any, right: Any) -> Node:
        return _node("CONCAT", TEXT, [self.build(left), self.build(right)])

    def _compare(self, left: Any, op: Any, right: Any) -> Node:
        a, b = self.build(left), self.build(right)
        if {a.type, b.type} != {DATE_T, DATETIME}:  # a date is its midnight beside a datetime
            _common([a, b], f"comparison {op}")
        symbol = {"==": "=", "!=": "<>"}.get(str(op), str(op))
        return _node(symbol, BOOLEAN, [a, b])

    def _logical(self, op: str, left: Any, right: Any) -> Node:
        a, b = self.build(left), self.build(right)
        _require(a, (BOOLEAN,), op.upper())
        _require(b, (BOOLEAN,), op.upper())
        return _node(op.upper(), BOOLEAN, [a, b])

    def _or_op(self, left: Any, _: Any, right: Any) -> Node:
        return self._logical("or", left, right)

    def _and_op(self, left: Any, _: Any, right: Any) -> Node:
        return self._logical("and", left, right)

    def _not_op(self, _: Any, operand: Any) -> Node:
        node = self.build(operand)
        _require(node, (BOOLEAN,), "NOT")
        return _node("NOT", BOOLEAN, [node])

    def _is_null(self, operand: Any, *_: Any) -> Node:
        return _node("ISBLANK", BOOLEAN, [self.build(operand)])

    def _is_not_null(self, operand: Any, *_: Any) -> Node:
        return _node("NOT", BOOLEAN, [_node("ISBLANK", BOOLEAN, [self.build(operand)])])

    def _between(self, operand: Any, _b: Any, low: Any, _a: Any, high: Any) -> Node:
        x = self.build(operand)
        lo, hi = self.build(low), self.build(high)
        _common([x, lo, hi], "BETWEEN")
        return _node("AND", BOOLEAN, [_node(">=", BOOLEAN, [x, lo]), _node("<=", BOOLEAN, [x, hi])])

    def _not_between(self, operand: Any, _n: Any, *rest: Any) -> Node:
        return _node("NOT", BOOLEAN, [self._between(operand, *rest)])

    def _in_list(self, operand: Any, _in: Any, *items: Any) -> Node:
        x = self.build(operand)
        values = [self.build(item) for item in items]
        _common([x, *values], "IN")
        tests = [_node("=", BOOLEAN, [x, value]) for value in values]
        node = tests[0]
        for test in tests[1:]:
            node = _node("OR", BOOLEAN, [node, test])
        return node

    def _not_in_list(self, operand: Any, _n: Any, *rest: Any) -> Node:
        return _node("NOT", BOOLEAN, [self._in_list(operand, *rest)])

    def _case(self, *children: Any) -> Node:
        from lark import Token

        parts = [c for c in children if not isinstance(c, Token) and c is not None]
        has_else = any(isinstance(c, Token) and c.type == "ELSE" for c in children)
        built = [self.build(p) for p in parts]
        pairs = built[: len(built) - 1] if has_else else built
        for condition in pairs[0::2]:
            _require(condition, (BOOLEAN,), "WHEN")
        values = [*pairs[1::2], *(built[-1:] if has_else else [])]
        return _node("case", _common(values, "CASE"), built, value=has_else)

    def _cast(self, _c: Any, operand: Any, _as: Any, type_name: Any, *digits: Any) -> Node:
        node = self.build(operand)
        name = str(type_name).lower()
        if name not in CAST_TYPES:
            raise _Invalid(
                f"CAST to an unsupported type {type_name!s}; use one of "
                f"{', '.join(sorted(CAST_TYPES))}"
            )
        scale = None
        if name in ("decimal", "numeric") and len(digits) > 1 and digits[1] is not None:
            scale = int(float(digits[1]))
        target = CAST_TYPES[name]
        integer = name in ("int", "integer", "bigint", "long")
        fallible = node.type != target and node.type != BLANK
        return _node("cast", target, [node], value=(target, integer, scale), fallible=fallible)

    def _call(self, name_token: Any, args: Any, by: Any) -> Node:
        name = str(name_token).upper()
        function = FUNCTIONS.get(name)
        if function is None or name not in self.functions:
            allowed = ", ".join(sorted(self.functions))
            raise _Invalid(f"function {name_token!s} is not allowed (allowed: {allowed})")
        raw_args = [] if args is None else [c for c in args.children if c is not None]
        raw_by = [] if by is None else [c for c in by.children[1:] if c is not None]
        if name in AGGREGATES and len(raw_args) == 1:
            return self._aggregate(name, raw_args[0], raw_by)
        if name == "RANK":
            _count_args(function, len(raw_args))
            try:
                return self._rank(raw_args, raw_by)
            except _Invalid as exc:
                raise _Invalid(f"RANK(): {exc}") from None
        if name in ("VLOOKUP", "XLOOKUP") and not raw_by:
            _count_args(function, len(raw_args))
            try:
                return self._lookup(name, [self.build(arg) for arg in raw_args])
            except _Invalid as exc:
                raise _Invalid(f"{name}(): {exc}") from None
        if name in CRITERIA_AGGREGATES:
            _count_args(function, len(raw_args))
            try:
                return self._criteria_aggregate(name, raw_args, raw_by)
            except _Invalid as exc:
                raise _Invalid(f"{name}(): {exc}") from None
        if raw_by:
            raise _Invalid(f"BY goes with an aggregate: {'/'.join(AGGREGATES)} of one argument")
        if name == "COUNT":
            raise _Invalid("COUNT takes one argument (the tenant's count of non-blank values)")
        _count_args(function, len(raw_args))
        built = [self.build(arg) for arg in raw_args]
        try:
            result, fallible = function.check(built)
        except _Invalid as exc:
            raise _Invalid(f"{name}(): {exc}") from None
        return _node(name, result, built, fallible=fallible)

    def _rank(self, raw_args: list[Any], by: list[Any]) -> Node:
        """RANK(x[, order] [BY ...]): an aggregate grouped by x itself (and the BY groups),
        whose per-group counts phase one turns into ranks."""
        args, groups = self._in_aggregate("RANK", raw_args, by)
        value = args[0]
        _require(value, (NUMBER,), "the value ranked")
        ascending = False
        if len(args) > 1:
            _constant_in(args[1], (0, 1), "the order (0: largest first, 1: smallest first)")
            ascending = constant_number(args[1]) == 1
        return Node("agg", NUMBER, (value, value, *groups), RANK_ASC if ascending else "RANK",
                    True)  # fmt: skip

    def _lookup(self, name: str, args: list[Node]) -> Node:
        """``lookup`` nodes: args (the value looked up[, the value if not found]), value
        (table, column returned)."""
        value, *rest = args
        if name == "VLOOKUP":
            table = self._lookup_table(rest[0], "the table")
            index = constant_number(rest[1])
            columns = list(self.lookups[table].columns)
            if index is None or index != int(index) or not 1 <= index <= len(columns):
                raise _Invalid(f"the column must be a constant from 1 to {len(columns)} (the "
                               f"key, then {', '.join(columns[1:])})")  # fmt: skip
            exact = rest[2] if len(rest) > 2 else None
            if exact is None or exact.op != "const" or exact.value not in (False, 0.0):
                raise _Invalid("only an exact match is supported: give FALSE as the 4th argument")
            column, default = columns[int(index) - 1], None
        else:
            table, key = self._lookup_column(rest[0], "the lookup array")
            if key != self.lookups[table].key:
                raise _Invalid(f"{table} is looked up by its key {self.lookups[table].key!r}")
            table_returned, column = self._lookup_column(rest[1], "the return array")
            if table_returned != table:
                raise _Invalid("the lookup and return arrays are columns of one table")
            default = rest[2] if len(rest) > 2 else None
        if _reads_joined(value, self.rules):
            raise _Invalid("the value looked up may not use an aggregate or another lookup")
        kind = self.lookups[table].columns[column]
        key_kind = self.lookups[table].columns[self.lookups[table].key]
        if value.type not in (key_kind, BLANK):
            raise _Invalid(f"the value looked up is {value.type}; {table}'s key is {key_kind}")
        if default is None:
            return _node("lookup", kind, [value], value=(table, column), fallible=True)
        result = _common([_node("const", kind), default], "the value if not found")
        return _node("lookup", result, [value, default], value=(table, column))

    def _lookup_table(self, node: Node, what: str) -> str:
        if node.op != "const" or node.value not in self.lookups:
            known = ", ".join(f'"{n}"' for n in sorted(self.lookups)) or "none declared"
            raise _Invalid(f"{what} is the name of a lookup table, in quotes ({known})")
        return str(node.value)

    def _lookup_column(self, node: Node, what: str) -> tuple[str, str]:
        text = str(node.value) if node.op == "const" else ""
        table, _, column = text.partition(".")
        if table not in self.lookups or column not in self.lookups[table].columns:
            raise _Invalid(f'{what} is "table.column" of a lookup table ({text!r} is not one)')
        return table, column

    def _aggregate(self, name: str, arg: Any, by: list[Any]) -> Node:
        (built,), groups = self._in_aggregate(name, [arg], by)
        return self._aggregate_node(name, built, groups)

    def _in_aggregate(self, name: str, args: list[Any], by: list[Any]) -> tuple[list[Node], ...]:
        """An aggregate's arguments and ``BY`` groups, built (no aggregate inside)."""
        if self.in_aggregate:
            raise _Invalid(f"{name}(): an aggregate inside an aggregate")
        self.in_aggregate = True
        try:
            built = [self.build(arg) for arg in args]
            groups = [self.build(b) for b in by]
        finally:
            self.in_aggregate = False
        for group in groups:
            if group.type == BLANK:
                raise _Invalid(f"{name}(... BY ...): a group must not be blank")
        return built, groups

    def _criteria_aggregate(self, name: str, raw_args: list[Any], by: list[Any]) -> Node:
        args, groups = self._in_aggregate(name, raw_args, by)
        if name == "COUNTA":
            return self._aggregate_node("COUNT", args[0], groups)
        if name == "SUMPRODUCT":
            product = args[0]
            for i, arg in enumerate(args):
                _require(arg, (NUMBER,), f"argument {i + 1}")
            for arg in args[1:]:
                product = _node("*", NUMBER, [product, arg], fallible=True)
            return self._aggregate_node("SUM", product, groups)
        if name in ("SUMIF", "AVERAGEIF", "COUNTIF"):
            condition = criterion(args[0], args[1])
            values = args[2] if len(args) > 2 else args[0]
        else:
            pairs = args if name == "COUNTIFS" else args[1:]
            if len(pairs) % 2:
                raise _Invalid("the criteria come in pairs: range, criterion, range, ...")
            tests = [criterion(r, c) for r, c in zip(pairs[0::2], pairs[1::2], strict=True)]
            condition = tests[0] if len(tests) == 1 else _node("AND", BOOLEAN, tests)
            values = args[0]
        if name in ("COUNTIF", "COUNTIFS"):
            values = _node("const", NUMBER, value=1.0)
        _require(values, (NUMBER,), "the values summed, averaged or compared")
        kind = {"SUM": "SUM", "AVE": "AVERAGE", "COU": "COUNT", "MAX": "MAX", "MIN": "MIN"}
        aggregate = self._aggregate_node(
            kind[name[:3]], _node("IF", NUMBER, [condition, values]), groups
        )
        if name in ("MAXIFS", "MINIFS"):  # no row meets the criteria: 0, as a spreadsheet gives
            return _node("COALESCE", NUMBER, [aggregate, _node("const", NUMBER, value=0.0)])
        return aggregate

    def _aggregate_node(self, name: str, built: Node, groups: list[Node]) -> Node:
        check = {
            "SUM": _check_aggregate(True),
            "AVERAGE": _check_aggregate(True),
            "MEDIAN": _check_aggregate(True),
            "COUNT": _check_aggregate(False),
            "MIN": _check_agg_minmax,
            "MAX": _check_agg_minmax,
        }[name]
        try:
            result, _ = check([built])
        except _Invalid as exc:
            raise _Invalid(f"{name}(): {exc}") from None
        return Node("agg", result, (built, *groups), name, True)


def _reads_joined(node: Node, rules: Mapping[str, Node]) -> bool:
    """Whether ``node`` (or a rule it uses) reads a tenant aggregate or a lookup: values
    joined to the rows, which a lookup's key cannot wait for."""
    stack, seen = [node], set()
    while stack:
        item = stack.pop()
        if item.op in ("agg", "lookup"):
            return True
        if item.op == "ref" and item.value not in seen and item.value in rules:
            seen.add(item.value)
            stack.append(rules[item.value])
        stack.extend(item.args)
    return False


def _count_args(function: Function, given: int) -> None:
    if given < function.min_args or (function.max_args is not None and given > function.max_args):
        if function.max_args is None:
            expected = f"at least {function.min_args}"
        elif function.min_args == function.max_args:
            expected = str(function.min_args)
        else:
            expected = f"{function.min_args} to {function.max_args}"
        raise _Invalid(f"{function.name}() takes {expected} arguments, got {given}")


def spreadsheet_number(text: str) -> float | None:
    """Text as a spreadsheet reads it as a number (see :data:`NUMBER_TEXT`), else None."""
    trimmed = text.strip(" ")
    if not re.match(NUMBER_TEXT, trimmed) or not re.match(NUMBER_START, trimmed):
        return None
    value = float(trimmed.replace(",", "").replace("%", "").replace("$", ""))
    return value / 100 if trimmed.endswith("%") else value


def wildcard_regex(pattern: str) -> str:
    """A spreadsheet pattern (``*`` any text, ``?`` one character, ``~`` escapes the next) as
    a Java regular expression."""
    parts: list[str] = []
    escaped = False
    for char in pattern:
        if escaped:
            parts.append(_regex_char(char))
            escaped = False
        elif char == "~":
            escaped = True
        elif char in "*?":
            parts.append(".*" if char == "*" else ".")
        else:
            parts.append(_regex_char(char))
    if escaped:
        parts.append(_regex_char("~"))
    return "".join(parts)


def has_wildcard(pattern: str) -> bool:
    return any(char in pattern for char in "*?~")


def _regex_char(char: str) -> str:
    # A backslash before any character that is not a letter or digit is that character.
    return char if char.isalnum() else "\\" + char


_CRITERION_OPS = ("<=", ">=", "<>", "=", "<", ">")


def criterion(subject: Node, given: Node) -> Node:
    """A spreadsheet criterion (``10``, ``">10"``, ``"<>x"``, ``"a*"``, ``""``) applied to
    ``subject``, as a boolean node. A blank meets only ``""``, ``"="`` and ``"<>..."``; text is
    compared without case; a criterion of another type than the subject's is never met (but
    ``"<>..."``, always met)."""
    if given.op != "const" or given.type == BLANK:
        raise _Invalid('a criterion must be a constant (10, ">10", "<>x", "a*")')
    value = given.value
    op, operand = "=", value
    if isinstance(value, str):
        op = next((o for o in _CRITERION_OPS if value.startswith(o)), "")
        operand = value[len(op) :]
        op = op or "="
    blank_test = _node("ISBLANK", BOOLEAN, [subject])
    never = _node("const", BOOLEAN, value=False)
    always = _node("const", BOOLEAN, value=True)
    if operand == "" and op in ("=", "<>"):
        return blank_test if op == "=" else _node("NOT", BOOLEAN, [blank_test])
    constant = _criterion_constant(subject.type, operand)
    if constant is None:
        return always if op == "<>" else never
    if subject.type == TEXT and op in ("=", "<>") and has_wildcard(constant.value):
        regex = "(?isu)^" + wildcard_regex(constant.value) + "$"
        match = _node("WILDCARD", BOOLEAN, [subject], value=regex)
        if op == "<>":
            return _node("NOT", BOOLEAN, [match])
        return _node("AND", BOOLEAN, [_node("NOT", BOOLEAN, [blank_test]), match])
    test = _node(op, BOOLEAN, [subject, constant])
    if op == "<>":
        return test
    return _node("AND", BOOLEAN, [_node("NOT", BOOLEAN, [blank_test]), test])


def _criterion_constant(kind: str, operand: Any) -> Node | None:
    """The criterion's operand as a constant of the subject's type, or None."""
    if kind == TEXT:
        text = operand if isinstance(operand, str) else _plain_number(operand)
        return _node("const", TEXT, value=text)
    if kind == NUMBER:
        if isinstance(operand, bool):
            return None
        number = operand if isinstance(operand, float) else spreadsheet_number(str(operand))
        return None if number is None else _node("const", NUMBER, value=float(number))
    if kind == BOOLEAN:
        if isinstance(operand, bool):
            return _node("const", BOOLEAN, value=operand)
        word = str(operand).strip().upper()
        return _node("const", BOOLEAN, value=word == "TRUE") if word in ("TRUE", "FALSE") else None
    if kind == DATE_T and isinstance(operand, str):
        try:
            return _node("const", DATE_T, value=dt.date.fromisoformat(operand.strip()))
        except ValueError:
            return None
    return None


def _plain_number(value: Any) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    number = float(value)
    return str(int(number)) if number.is_integer() and abs(number) < 1e15 else repr(number)


def _has_aggregate(node: Node) -> bool:
    return any(item.op == "agg" for item in node.walk())


def parse_expression(
    text: str,
    *,
    columns: Mapping[str, str],
    rules: Mapping[str, Node] | None = None,
    functions: Iterable[str] | None = None,
) -> Node:
    """Parse and check one expression; raises ``ValueError`` (the reason) if invalid.

    ``columns``: source column -> kind (``int``, ``float``, ``str``, ...) or value type.
    """
    try:
        return _parse(text, _value_types(columns), dict(rules or {}), _allowed(functions))
    except _Invalid as exc:
        raise ValueError(str(exc)) from None


def _value_types(columns: Mapping[str, str]) -> dict[str, str]:
    return {name: _KIND_TYPE.get(kind, kind) for name, kind in columns.items()}


def _allowed(functions: Iterable[str] | None) -> frozenset[str]:
    if functions is None:
        return DEFAULT_FUNCTIONS
    names = frozenset(str(f).upper() for f in functions)
    unknown = sorted(names - set(FUNCTIONS))
    if unknown:
        raise ValueError(f"unknown functions {unknown}; the language has {sorted(FUNCTIONS)}")
    return names


def _parse(
    text: str, columns: Mapping[str, str], rules: Mapping[str, Node], functions: frozenset[str]
) -> Node:
    return _Builder(columns, rules, functions).build(_syntax_tree(text))


def _syntax_tree(text: str) -> Any:
    """lark's tree of an expression, its depth and size checked."""
    from lark.exceptions import LarkError, UnexpectedCharacters, UnexpectedEOF, UnexpectedToken

    body = text.strip()
    if body.startswith("=") and not body.startswith("=="):
        body = body[1:].lstrip()
    if not body:
        raise _Invalid("the expression is empty")
    if len(body) > MAX_FORMULA_LENGTH:
        raise _Invalid(f"longer than {MAX_FORMULA_LENGTH} characters")
    try:
        tree = _parser().parse(body)
    except UnexpectedCharacters as exc:
        pos: int = getattr(exc, "pos_in_stream", 0) or 0
        raise _Invalid(f"unexpected character {body[pos]!r} at position {pos + 1}") from None
    except UnexpectedEOF:
        raise _Invalid("the expression ends too early") from None
    except UnexpectedToken as exc:
        if exc.token.type == "$END":
            raise _Invalid("the expression ends too early") from None
        raise _Invalid(f"unexpected {exc.token!s} at position {exc.column}") from None
    except LarkError as exc:  # anything else lark reports: still a clear error
        raise _Invalid(str(exc).strip().splitlines()[0]) from None
    depth = _expression_depth(tree)
    if depth > MAX_DEPTH:
        raise _Invalid(
            f"nested {depth} levels deep; at most {MAX_DEPTH} are allowed (each operator of a "
            "chain such as a + b + c is a level: write SUM(a, b, c), CONCAT(a, b, c), "
            "AND(a, b, c) or OR(a, b, c), which are one)"
        )
    _, size = _depth_and_size(tree)
    if size > MAX_NODES * 3:
        raise _Invalid(f"too large: at most {MAX_NODES} operators, names and constants")
    return tree


def _names_used(tree: Any) -> set[str]:
    """The names an expression's tree reads (columns and rules; not function names)."""
    from lark import Token, Tree

    found: set[str] = set()
    stack = [tree]
    while stack:
        item = stack.pop()
        if not isinstance(item, Tree):
            continue
        if item.data == "name":
            name = str(item.children[0])
            found.add(name[1:-1].replace("``", "`") if name.startswith("`") else name)
            continue
        stack.extend(c for c in item.children if isinstance(c, Tree | Token) or c is not None)
    return found


class Cycle(ValueError):
    """Rules that use each other in a circle (``members``: the circle, first one last too)."""

    def __init__(self, members: list[str]) -> None:
        self.members = members
        if len(members) == 2:
            super().__init__(f"{members[0]!r} uses itself")
        else:
            super().__init__("a cycle: " + " -> ".join(members) + " (each uses the next)")


def dependency_order(uses: Mapping[str, set[str]]) -> list[str]:
    """The rules in an order in which each comes after the rules it uses, as written where
    that allows; :class:`Cycle` naming the members of a cycle."""
    import heapq

    position = {name: i for i, name in enumerate(uses)}
    waiting = {name: {u for u in used if u in uses} for name, used in uses.items()}
    users: dict[str, list[str]] = {name: [] for name in uses}
    for name, used in waiting.items():
        for u in used:
            users[u].append(name)
    ready = [position[name] for name, used in waiting.items() if not used]
    heapq.heapify(ready)
    names = list(uses)
    order: list[str] = []
    while ready:
        name = names[heapq.heappop(ready)]
        order.append(name)
        for user in users[name]:
            waiting[user].discard(name)
            if not waiting[user]:
                heapq.heappush(ready, position[user])
    if len(order) < len(names):
        raise Cycle(_cycle({n: u for n, u in waiting.items() if u}))
    return order


def _cycle(waiting: Mapping[str, set[str]]) -> list[str]:
    """A cycle among rules that still wait on each other: ``[a, b, a]``."""
    start = min(waiting, key=list(waiting).index)
    path = [start]
    seen = {start: 0}
    while True:
        following = sorted(waiting[path[-1]], key=list(waiting).index)[0]
        if following in seen:
            return [*path[seen[following] :], following]
        seen[following] = len(path)
        path.append(following)


# --------------------------------------------------------------------------------------------
# Formula sets


@dataclass(frozen=True)
class Formula:
    """One checked formula: ``target = expression``."""

    target: str
    source: str  # the expression as written
    tree: Node
    kind: str  # the value type

    @property
    def text(self) -> str:
        return f"{self.target} = {self.source}"

    @property
    def intermediate(self) -> bool:
        """A name starting with ``_``: usable by later formulas, not written to the sink."""
        return self.target.startswith("_")

    @property
    def uses_aggregate(self) -> bool:
        return _uses_aggregate(self.tree, {})


def _uses_aggregate(node: Node, memo: dict[str, bool]) -> bool:
    return any(
        item.op == "agg" or (item.op == "ref" and memo.get(item.value, False))
        for item in node.walk()
    )


def split_formulas(raw: Any) -> list[tuple[str, str]]:
    """``(target, expression)`` pairs from what a formula lookup returned.

    Accepted: a mapping ``{target: expression}``, or an iterable of ``"target = expression"``
    strings or ``(target, expression)`` pairs.
    """
    if isinstance(raw, Mapping):
        return [(str(target), str(expression)) for target, expression in raw.items()]
    if isinstance(raw, str):
        raw = [raw]
    pairs: list[tuple[str, str]] = []
    for item in raw:
        if isinstance(item, str):
            match = _TARGET.match(item)
            if match is None:
                pairs.append(("", item))  # reported by parse_formulas with the tenant
            else:
                pairs.append((match.group(1), match.group(2)))
        else:
            target, expression = item
            pairs.append((str(target), str(expression)))
    return pairs


def version_of(pairs: Sequence[tuple[str, str]]) -> str:
    """The content hash of a formula set (16 hex digits): equal formulas, equal version."""
    text = json.dumps([[t, e.strip()] for t, e in pairs], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class FormulaSet:
    """A tenant's checked formulas, in dependency order (each after the ones it uses)."""

    tenant: str
    formulas: tuple[Formula, ...]
    version: str = ""
    aggregates: tuple[Node, ...] = field(default=())  # distinct tenant aggregates, in order
    #: The formulas as written (``formulas`` is in dependency order): what a job pins.
    written: tuple[tuple[str, str], ...] = ()

    def targets(self) -> list[str]:
        return [f.target for f in self.formulas]

    def outputs(self) -> list[Formula]:
        """The formulas whose results are written (not the ``_``-named intermediates)."""
        return [f for f in self.formulas if not f.intermediate]

    def pairs(self) -> list[tuple[str, str]]:
        """The formulas as written, in the order written (their version's order)."""
        return list(self.written) or [(f.target, f.source) for f in self.formulas]


@dataclass(frozen=True)
class LookupTable:
    """What formulas may read of a lookup table: its key and columns (key first), typed."""

    key: str
    columns: Mapping[str, str]  # column -> value type or kind


def parse_formulas(
    tenant: str,
    raw: Any,
    *,
    columns: Mapping[str, str],
    targets: Iterable[str] | None,
    functions: Iterable[str] | None = None,
    lookups: Mapping[str, LookupTable] | None = None,
) -> FormulaSet:
    """Parse and check a tenant's formulas against the source ``columns`` (name -> kind).

    ``targets``: the names a formula may define (a typed sink's columns), or None for any
    name (a JSON results sink). Names starting with ``_`` are intermediate results, always
    allowed. Raises :class:`FormulaError` for the first invalid formula.
    """
    allowed_targets = None if targets is None else set(targets)
    try:
        allowed = _allowed(functions)
    except ValueError as exc:
        raise FormulaError(tenant, "", str(exc)) from None
    known = _value_types(columns)
    rules: dict[str, Node] = {}
    aggregated: dict[str, bool] = {}
    parsed: list[Formula] = []
    try:
        pairs = split_formulas(raw)
    except (TypeError, ValueError) as exc:
        raise FormulaError(tenant, repr(raw)[:200], f"cannot read the formulas: {exc}") from None
    if not pairs:
        raise FormulaError(tenant, "", "the tenant has no formulas")
    if len(pairs) > MAX_RULES:
        raise FormulaError(tenant, "", f"{len(pairs)} formulas; at most {MAX_RULES} per tenant")
    total = 0
    chain: dict[str, int] = {}
    aggregates: dict[str, Node] = {}
    written: dict[str, tuple[str, str, Any]] = {}  # target -> (expression, shown, syntax tree)
    tables = {
        name: LookupTable(table.key, _value_types(table.columns))
        for name, table in (lookups or {}).items()
    }
    for target, expression in pairs:
        text = f"{target} = {expression}" if target else expression
        shown = text if len(text) <= 200 else text[:200] + "..."
        if not target:
            raise FormulaError(tenant, shown, "a formula reads `name = expression`")
        if not _NAME.match(target):
            raise FormulaError(tenant, shown, "a name starts with a letter or _, then letters, "
                               "digits and _ (at most 63 in all)")  # fmt: skip
        if (
            allowed_targets is not None
            and not target.startswith("_")
            and target not in allowed_targets
        ):
            raise FormulaError(
                tenant,
                shown,
                f"{target!r} is not a column of the sink (sink columns: "
                f"{', '.join(sorted(allowed_targets))})",
            )
        if target.startswith(RESERVED_PREFIX):
            raise FormulaError(tenant, shown, f"names starting with {RESERVED_PREFIX} are the "
                               "pipeline's own columns")  # fmt: skip
        if target in written:
            raise FormulaError(tenant, shown, f"{target!r} is defined twice")
        if target in known:
            raise FormulaError(tenant, shown, f"{target!r} is a source column's name")
        try:
            written[target] = (expression, shown, _syntax_tree(expression))
        except _Invalid as exc:
            raise FormulaError(tenant, shown, str(exc)) from None
    # As in a spreadsheet, a rule may use rules written after it: compute in dependency order.
    try:
        order = dependency_order({t: _names_used(w[2]) for t, w in written.items()})
    except Cycle as exc:
        raise FormulaError(tenant, written[exc.members[0]][1], str(exc)) from None
    for target in order:
        expression, shown, syntax = written[target]
        try:
            builder_rules = {
                name: (node if not aggregated[name] else _mark_aggregate(node))
                for name, node in rules.items()
            }
            tree = _Builder(known, builder_rules, allowed, tables).build(syntax)
        except _Invalid as exc:
            raise FormulaError(tenant, shown, str(exc)) from None
        size, depth = _tree_size_and_chain(tree, chain)
        total += size
        if total > MAX_TOTAL_NODES:
            raise FormulaError(tenant, shown, f"the formulas are too large together: at most "
                               f"{MAX_TOTAL_NODES} operators, names and constants")  # fmt: skip
        if depth > MAX_CHAIN_DEPTH:
            raise FormulaError(
                tenant,
                shown,
                f"nested {depth} levels deep counting the formulas it uses; at most "
                f"{MAX_CHAIN_DEPTH} are allowed",
            )
        chain[target] = depth
        rules[target] = tree
        aggregated[target] = _uses_aggregate(tree, aggregated)
        for node in _aggregate_nodes(tree):
            aggregates.setdefault(node.key(), node)
        parsed.append(Formula(target=target, source=expression.strip(), tree=tree, kind=tree.type))
    return FormulaSet(
        tenant=tenant,
        formulas=tuple(parsed),
        version=version_of(pairs),
        aggregates=tuple(aggregates.values()),
        written=tuple((t, e.strip()) for t, e in pairs),
    )


def _mark_aggregate(node: Node) -> Node:
    """A stand-in for a rule that uses an aggregate: the builder refuses it in an aggregate."""
    return Node("agg", node.type, (), "ref", node.fallible)


def _aggregate_nodes(tree: Node) -> list[Node]:
    found: list[Node] = []
    stack = [tree]
    while stack:
        item = stack.pop()
        if item.op == "agg":
            found.append(item)
            continue  # no aggregate inside an aggregate
        stack.extend(item.args)
    return found


def _tree_size_and_chain(tree: Node, chain: Mapping[str, int]) -> tuple[int, int]:
    """Node count, and depth counting each referenced rule's own depth."""
    size, deepest = 0, 0
    stack: list[tuple[Node, int]] = [(tree, 1)]
    while stack:
        item, depth = stack.pop()
        size += 1
        if item.op == "ref":
            depth += chain.get(item.value, 0)
        deepest = max(deepest, depth)
        stack.extend((arg, depth + 1) for arg in item.args)
    return size, deepest

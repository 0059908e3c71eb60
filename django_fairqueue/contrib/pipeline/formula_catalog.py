"""The formula language's functions: each one's argument counts, the types it takes and
gives, and its line in the how-to's reference (:data:`FUNCTIONS`); the tenant aggregates among
them; the type names ``CAST`` accepts.

A function's ``check`` sees its arguments already typed (:mod:`.formula_check` builds them)
and gives the result's type and whether the call can give an error value; :mod:`.compile`
gives each function its Spark SQL.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django_fairqueue.contrib.pipeline.formula_tree import (
    BLANK,
    BOOLEAN,
    DATE_T,
    DATETIME,
    NUMBER,
    TEXT,
    Invalid,
    Node,
    constant_number,
)


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


def require(node: Node, types: Sequence[str], what: str) -> None:
    if node.type not in (*types, BLANK):
        raise Invalid(f"{what} needs {' or '.join(types)}, got {node.type}")


def common_type(nodes: Sequence[Node], what: str) -> str:
    types = {n.type for n in nodes} - {BLANK}
    if not types:
        return BLANK
    if len(types) == 1:
        return types.pop()
    raise Invalid(f"{what} mixes {' and '.join(sorted(types))}")


def _numbers(result: str = NUMBER, fallible: bool = False) -> Callable[[list[Node]], Any]:
    def check(args: list[Node]) -> tuple[str, bool]:
        for i, arg in enumerate(args):
            require(arg, (NUMBER,), f"argument {i + 1}")
        return result, fallible

    return check


def _texts(result: str = TEXT, fallible: bool = False, numbers_after: int = 1) -> Any:
    """First ``numbers_after`` arguments are text (any value converts), the rest numbers."""

    def check(args: list[Node]) -> tuple[str, bool]:
        for i, arg in enumerate(args[numbers_after:], start=numbers_after):
            require(arg, (NUMBER,), f"argument {i + 1}")
        return result, fallible

    return check


def _all_texts(result: str = TEXT, fallible: bool = False) -> Any:
    def check(args: list[Node]) -> tuple[str, bool]:
        return result, fallible

    return check


def _check_round(args: list[Node]) -> tuple[str, bool]:
    _numbers()(args)
    if len(args) > 1:
        digits = constant_number(args[1])
        if digits is None or digits != int(digits) or not -20 <= digits <= 20:
            raise Invalid("the number of digits must be a whole number from -20 to 20")
    return NUMBER, False


def _check_if(args: list[Node]) -> tuple[str, bool]:
    require(args[0], (BOOLEAN,), "IF's condition")
    return common_type(args[1:], "IF's values"), False


def _check_ifs(args: list[Node]) -> tuple[str, bool]:
    if len(args) % 2:
        raise Invalid("IFS takes pairs: condition, value, condition, value, ...")
    for condition in args[0::2]:
        require(condition, (BOOLEAN,), "IFS's conditions")
    return common_type(args[1::2], "IFS's values"), True  # no condition true: an error (#N/A)


def _check_logical(args: list[Node]) -> tuple[str, bool]:
    for arg in args:
        require(arg, (BOOLEAN,), "a logical function")
    return BOOLEAN, False


def _check_same(what: str) -> Callable[[list[Node]], tuple[str, bool]]:
    def check(args: list[Node]) -> tuple[str, bool]:
        return common_type(args, what), False

    return check


def _check_minmax(args: list[Node]) -> tuple[str, bool]:
    kind = common_type(args, "MIN/MAX")
    if kind not in (NUMBER, DATE_T, TEXT, BLANK):
        raise Invalid(f"MIN/MAX need numbers, dates or text, got {kind}")
    return kind if kind != BLANK else NUMBER, False


def _check_any(result: str, fallible: bool = False) -> Callable[[list[Node]], tuple[str, bool]]:
    return lambda args: (result, fallible)


def _check_date(args: list[Node]) -> tuple[str, bool]:
    _numbers()(args)
    return DATE_T, True  # a year out of 1..9999


def _check_date_part(args: list[Node]) -> tuple[str, bool]:
    require(args[0], (DATE_T, DATETIME), "a date function")
    return NUMBER, False


def _check_edate(args: list[Node]) -> tuple[str, bool]:
    require(args[0], (DATE_T,), "argument 1")
    require(args[1], (NUMBER,), "argument 2")
    return DATE_T, False


def _check_days(args: list[Node]) -> tuple[str, bool]:
    for arg in args:
        require(arg, (DATE_T,), "DAYS")
    return NUMBER, False


def _check_datedif(args: list[Node]) -> tuple[str, bool]:
    require(args[0], (DATE_T,), "DATEDIF's start")
    require(args[1], (DATE_T,), "DATEDIF's end")
    unit = args[2]
    if unit.op != "const" or not isinstance(unit.value, str) or unit.value.upper() not in (
        "D", "M", "Y", "YM", "MD", "YD"
    ):  # fmt: skip
        raise Invalid('DATEDIF\'s unit must be "D", "M", "Y", "YM", "MD" or "YD"')
    return NUMBER, True  # start after end: an error


def check_aggregate(numeric: bool) -> Callable[[list[Node]], tuple[str, bool]]:
    def check(args: list[Node]) -> tuple[str, bool]:
        if numeric:
            require(args[0], (NUMBER,), "the aggregate")
        return NUMBER, True  # over an error: an error; AVERAGE of nothing: an error

    return check


def check_agg_minmax(args: list[Node]) -> tuple[str, bool]:
    require(args[0], (NUMBER, DATE_T), "MIN/MAX")
    return (args[0].type if args[0].type != BLANK else NUMBER), True


def constant_in(node: Node, allowed: Sequence[float], what: str) -> None:
    value = constant_number(node)
    if value is None or value not in allowed:
        raise Invalid(f"{what} must be a constant: one of {', '.join(f'{a:g}' for a in allowed)}")


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
        require(args[2], (NUMBER,), "the start position")
    return NUMBER, True  # not found: an error


def _check_replace(args: list[Node]) -> tuple[str, bool]:
    require(args[1], (NUMBER,), "REPLACE's start")
    require(args[2], (NUMBER,), "REPLACE's count")
    return TEXT, True


def _check_textjoin(args: list[Node]) -> tuple[str, bool]:
    require(args[1], (BOOLEAN,), "TEXTJOIN's ignore_empty")
    return TEXT, True  # longer than 32,767 characters: an error


def _check_text_format(args: list[Node]) -> tuple[str, bool]:
    fmt = args[1]
    if fmt.op != "const" or not isinstance(fmt.value, str):
        raise Invalid("TEXT's format must be a text constant")
    from django_fairqueue.contrib.pipeline import textformat

    try:
        textformat.parse(fmt.value)
    except ValueError as exc:
        raise Invalid(str(exc)) from None
    return TEXT, False


def _check_switch(args: list[Node]) -> tuple[str, bool]:
    cases = args[1:]
    pairs = cases[: len(cases) - len(cases) % 2]
    for value in pairs[0::2]:
        common_type([args[0], value], "SWITCH's values")
    results = [*pairs[1::2], *(cases[-1:] if len(cases) % 2 else [])]
    return common_type(results, "SWITCH's results"), True  # no match and no default: an error


def _check_choose(args: list[Node]) -> tuple[str, bool]:
    require(args[0], (NUMBER,), "CHOOSE's index")
    return common_type(args[1:], "CHOOSE's values"), True  # index out of range: an error


def _check_weeknum(args: list[Node]) -> tuple[str, bool]:
    require(args[0], (DATE_T, DATETIME), "WEEKNUM's date")
    if len(args) > 1:
        constant_in(args[1], WEEKNUM_TYPES, "WEEKNUM's return type")
    return NUMBER, False


def _check_networkdays(args: list[Node]) -> tuple[str, bool]:
    for i, arg in enumerate(args):
        require(arg, (DATE_T,), f"NETWORKDAYS' argument {i + 1}")
    return NUMBER, False


def _check_yearfrac(args: list[Node]) -> tuple[str, bool]:
    require(args[0], (DATE_T,), "YEARFRAC's start")
    require(args[1], (DATE_T,), "YEARFRAC's end")
    if len(args) > 2:
        constant_in(args[2], (0, 1, 2, 3, 4), "YEARFRAC's basis")
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
        _f("COUNT", 1, 1, check_aggregate(False), "the tenant's number of non-blank values "
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

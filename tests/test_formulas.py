"""The pipeline's formula language: checking (no Spark), limits, injection, and every
function's meaning on Spark (values, blanks, error values), plus the JSON sink, pinned
versions and cancelling, end to end."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from django.core.management import call_command

from django_fairqueue import batches
from django_fairqueue.contrib.pipeline.formula_catalog import CRITERIA_AGGREGATES, FUNCTIONS
from django_fairqueue.contrib.pipeline.formulas import (
    MAX_DEPTH,
    FormulaError,
    LookupTable,
    parse_formulas,
    version_of,
)
from django_fairqueue.contrib.pipeline.models import PipelineJob
from django_fairqueue.contrib.pipeline.runner import PipelineRunner, cancel, plan
from django_fairqueue.models import WorkBatch
from tests.pipelineapp import pipelines
from tests.pipelineapp.models import DataRow, JsonResultRow
from tests.test_pipeline import needs_spark, spark, spark_settings  # noqa: F401  (fixtures)

COLUMNS = {"n": "float", "z": "int", "b": "float", "t": "str", "tb": "str", "d": "date",
           "db": "date", "flag": "bool"}  # fmt: skip


def check(*formulas: str, targets: list[str] | None = None) -> Any:
    return parse_formulas("acme", list(formulas), columns=COLUMNS, targets=targets)


def refused(formula: str) -> str:
    with pytest.raises(FormulaError) as caught:
        check(formula)
    message = str(caught.value)
    assert message.startswith("tenant 'acme': invalid formula ")
    return message


# --------------------------------------------------------------------------------------------
# Checking, without Spark


def test_deep_nesting_is_a_clear_error_not_a_crash() -> None:
    # Thousands of nested operators: lark parses without recursion, the depth is checked on the
    # tree before anything recursive runs, and Spark never sees them.
    assert "nested 1901 levels deep; at most 64" in refused("x = " + "-" * 1900 + "1")
    # A long chain says how to write it; written so, it is one level.
    assert "write SUM(a, b, c)" in refused("x = " + " + ".join(["n"] * 80))
    assert check("x = SUM(" + ", ".join(["n"] * 80) + ")").formulas[0].kind == "number"
    assert "nested 901 levels deep" in refused("x = " + "NOT " * 900 + "TRUE")
    # Parentheses alone add no nesting (lark keeps no node for them).
    assert check("x = " + "(" * 3000 + "1" + ")" * 3000).formulas[0].kind == "number"
    assert "levels deep" in refused("x = " + "IF(TRUE, " * 100 + "1" + ", 0)" * 100)
    assert "longer than 8192" in refused("x = " + "1 + " * 3000 + "1")
    depth_ok = "x = " + "(" * (MAX_DEPTH - 1) + "1" + ")" * (MAX_DEPTH - 1)
    assert check(depth_ok).formulas[0].kind == "number"


def test_a_chain_of_rules_is_limited_too() -> None:
    rules = ["r0 = n + 1"] + [f"r{i} = r{i - 1} + r{i - 1} + 1" for i in range(1, 300)]
    with pytest.raises(FormulaError, match="counting the formulas it uses"):
        check(*rules)


@pytest.mark.parametrize(
    ("formula", "reason"),
    [
        ("x = n; DROP TABLE pipelinetest_data", "unexpected character ';'"),
        ("x = (SELECT 1)", "unexpected 1"),
        ('x = reflect("java.lang.Runtime", "exec", "id")', "function reflect is not allowed"),
        ("x = `n`) OR (1=1", "unexpected )"),
        ("x = n /* comment */", "unexpected *"),
        ("x = java_method('a', 'b')", "function java_method is not allowed"),
        ("x = t || 'a'", "unexpected character '|'"),
        ("x = `t`` OR 1=1 --`", "unknown name"),
        ("x = t = 'a' UNION SELECT 1", "unexpected UNION"),
        ("x = CAST(n AS int) ; SELECT", "unexpected character ';'"),
    ],
)
def test_injection_is_refused(formula: str, reason: str) -> None:
    assert reason in refused(formula)


@pytest.mark.parametrize(
    ("formula", "reason"),
    [
        ("x = t * 2", "* needs number, got text"),
        ("x = IF(n, 1, 2)", "IF's condition needs boolean, got number"),
        ('x = IF(n > 1, 1, "a")', "IF's values mixes number and text"),
        ("x = n > t", "comparison > mixes number and text"),
        ("x = YEAR(n)", "a date function needs date or datetime, got number"),
        ('x = DATEDIF(d, d, "W")', 'DATEDIF\'s unit must be "D", "M", "Y", "YM", "MD" or "YD"'),
        ("x = ROUND(n, z)", "the number of digits must be a whole number"),
        ("x = MID(t, 1)", "MID() takes 3 arguments, got 2"),
        ("x = IFS(n > 1, 1, n > 2)", "IFS takes pairs"),
        ("x = SUM(SUM(n))", "an aggregate inside an aggregate"),
        ("x = COUNT(n, z)", "COUNT takes one argument"),
        ("x = ABS(n BY t)", "BY goes with an aggregate"),
        ("x = 1 - d", "a number minus a date means nothing"),
        ("x = nope + 1", "unknown name 'nope'"),
        ("n = 1", "'n' is a source column's name"),
        ("x = ", "the expression is empty"),
    ],
)
def test_types_and_names_are_checked_before_a_job_starts(formula: str, reason: str) -> None:
    assert reason in refused(formula)


def test_rules_are_typed_and_may_use_earlier_rules_and_intermediates() -> None:
    parsed = check(
        "_base = n * 2",
        'label = t & " " & _base',
        "when = d + 30",
        "late = TODAY() - d > 10",
        "share = n / SUM(n BY t)",
    )

    assert [(f.target, f.kind) for f in parsed.formulas] == [
        ("_base", "number"),
        ("label", "text"),
        ("when", "date"),
        ("late", "boolean"),
        ("share", "number"),
    ]
    assert [f.target for f in parsed.outputs()] == ["label", "when", "late", "share"]
    assert len(parsed.aggregates) == 1
    with pytest.raises(FormulaError, match="itself an aggregate"):
        check("share = n / SUM(n)", "total = SUM(share)")
    # A typed sink: names must be its columns (intermediates aside).
    with pytest.raises(FormulaError, match="'label' is not a column of the sink"):
        check("_x = n", "label = t", targets=["total"])


def test_the_version_is_a_content_hash() -> None:
    a = check("x = n + 1", "y = x * 2")
    assert a.version == check("x =  n + 1 ", "y = x * 2").version == version_of(a.pairs())
    assert a.version != check("x = n + 2", "y = x * 2").version
    assert len(a.version) == 16


def test_every_function_is_documented_in_the_how_to() -> None:
    from pathlib import Path

    howto = (Path(__file__).parents[1] / "docs/howto/spark-pipeline.md").read_text()
    missing = [name for name in FUNCTIONS if f"`{name}(" not in howto]
    assert not missing


def test_names_and_constants_reach_the_spark_sql_text_as_data() -> None:
    from django_fairqueue.contrib.pipeline.sqlexpr import literal, quoted

    assert quoted("a`b") == "`a``b`"
    text = "it's \\ `x` -- /* */ \n é ${x}"
    rendered = literal(text)
    hex_digits = rendered.removeprefix("CAST(X'").removesuffix("' AS STRING)")
    assert bytes.fromhex(hex_digits).decode() == text  # nothing but hexadecimal digits
    assert literal(1e20) == "(1e+20D)" and literal(-2.5) == "(-2.5D)"
    assert literal(3) == "(3)" and literal(2**40) == "(1099511627776L)"
    assert (literal(True), literal(None)) == ("true", "NULL")
    assert literal(dt.date(2026, 1, 2)) == "DATE '2026-01-02'"
    with pytest.raises(TypeError):
        literal(object())


def test_constants_are_folded_before_spark_sees_them() -> None:
    from django_fairqueue.contrib.pipeline.compile_levels import formula_levels

    formulas = check('a = LEFT(t, 2)', 'f = IF(t = "EMAIL", 1, 0)', 'c = "x-" & t',
                     'g = LEFT(t, n)', 'e = t = "ÉTÉ"')  # fmt: skip
    [level], outputs = formula_levels(formulas, today=TODAY, names={})
    # A constant count is never negative at run time: no error value, no error flag.
    assert [o.name for o in outputs if o.error_column] == ["g"]
    assert level.computed["a"] == "left(coalesce(`t`, ''), (2))"
    assert "X'656d61696c'" in level.computed["f"]  # "email": lowered here, not by Spark
    assert "coalesce(CAST(X'782d' AS STRING)" not in level.computed["c"]  # never blank
    assert "lower(coalesce(CAST(X'" in level.computed["e"]  # beyond ASCII, Spark's lower()
    assert "Infinity" not in " ".join(level.computed.values())


def test_a_formula_whose_text_repeats_too_much_is_refused_without_spark() -> None:
    from django_fairqueue.contrib.pipeline.compile_levels import check_compiles

    # INT uses its argument three times: 40 nested would be 3^40 copies of n.
    formulas = check("ok = INT(INT(n))", "x = " + "INT(" * 40 + "n" + ")" * 40)
    with pytest.raises(FormulaError, match="more than 200,000 characters of Spark SQL") as caught:
        check_compiles(formulas, today=TODAY)
    assert "tenant 'acme'" in str(caught.value) and "x = INT(INT(" in str(caught.value)
    # Named intermediate rules keep each rule's text short.
    check_compiles(
        check(*(f"_i{k} = INT({'_i' + str(k - 1) if k else 'n'})" for k in range(40)), "x = _i39"),
        today=TODAY,
    )
    with pytest.raises(FormulaError, match="pipeline's own columns"):
        check("__fq_err_x = n")


# --------------------------------------------------------------------------------------------
# Meaning, on Spark

ROW = {"n": 10.0, "z": 0, "b": None, "t": "Hello World", "tb": None,
       "d": dt.date(2026, 1, 31), "db": None, "flag": True}  # fmt: skip
ERROR = object()
TODAY = dt.date(2026, 11, 25)
NOW = dt.datetime(2026, 11, 25, 14, 5, 9)  # what the job's planned moment may be (TODAY's)

#: (expression, value, or ERROR for an error value). Run on the row ROW.
CASES: list[tuple[str, Any]] = [
    # arithmetic, blanks, errors
    ("n + b", 10.0), ("n * b", 0.0), ("n / z", ERROR), ("n / b", ERROR), ("-n ^ 2", 100.0),
    ("2 ^ 3 ^ 2", 64.0), ("n % 3", 1.0), ("n % z", ERROR), ("1e308 * 10", ERROR),
    ("10 ^ 400", ERROR), ("(n / z) * 2", ERROR), ("(n / 2) * 3", 15.0),
    ("IFERROR(n / z, 1e308) * 10", ERROR), ("IFERROR(n / z, 2) * 10", 20.0),
    ("IFERROR(n / z, -1)", -1.0), ("IFERROR(n / 2, -1)", 5.0), ("ISERROR(n / z)", True),
    ("ISERROR(n)", False), ("(n / z) + 1", ERROR), ("IF(n > 0, 1, n / z)", 1.0),
    ("IF(n < 0, 1, n / z)", ERROR), ("IF(n < 0, 1)", None), ("IF(b > 0, 1, 2)", 2.0),
    ("IFS(n > 100, 1, n > 5, 2)", 2.0), ("IFS(n > 100, 1)", ERROR),
    ("CASE WHEN n > 5 THEN 'a' ELSE 'b' END", "a"), ("CASE WHEN n > 50 THEN 'a' END", None),
    # comparisons and logic
    ('t = "hello world"', True), ("b = 0", True), ('tb = ""', True), ("n <> 10", False),
    ("n BETWEEN 5 AND 10", True), ("n NOT IN (1, 2)", True), ("n IN (10, 2)", True),
    ("AND(n > 1, flag)", True), ("OR(n < 1, b > 0)", False), ("NOT(flag)", False),
    ("XOR(TRUE, TRUE, TRUE)", True), ("n > 1 AND NOT flag", False), ("b IS NULL", True),
    ("t IS NOT NULL", True), ("ISBLANK(b)", True), ("ISBLANK(n)", False),
    ("COALESCE(b, z, n)", 0.0), ("NULLIF(n, 10)", None), ("NULLIF(n, 3)", 10.0),
    # NULLIF compares as = does: text without case, a blank as 0 or ""
    ('NULLIF(t, "HELLO WORLD")', None), ("NULLIF(b, 0)", None), ('NULLIF("a", "b")', "a"),
    # numbers
    ("ROUND(2.5)", 3.0), ("ROUND(-2.5)", -3.0), ("ROUND(1.005, 2)", 1.01),
    ("ROUND(1234, -2)", 1200.0),
    ("ABS(-n)", 10.0), ("SIGN(-n)", -1.0), ("INT(-2.5)", -3.0), ("FLOOR(2.7)", 2.0),
    ("CEILING(2.1)", 3.0), ("CEIL(-2.1)", -2.0), ("MOD(-3, 2)", 1.0), ("MOD(3, -2)", -1.0),
    ("MOD(n, z)", ERROR), ("POWER(2, 10)", 1024.0), ("POW(-8, 0.5)", ERROR),
    ("SQRT(16)", 4.0), ("SQRT(-1)", ERROR), ("EXP(0)", 1.0), ("EXP(1000)", ERROR),
    ("LN(1)", 0.0), ("LN(z)", ERROR), ("LOG10(1000)", 3.0), ("LOG10(-1)", ERROR),
    ("MIN(n, 3, b)", 3.0), ("MAX(n, 30)", 30.0), ("LEAST(n, 3)", 3.0), ("GREATEST(n, b)", 10.0),
    ("SUM(n, b, 5)", 15.0), ("AVERAGE(n, b, 20)", 15.0), ("AVERAGE(b, b)", ERROR),
    ('VALUE(" 12.5 ")', 12.5), ('VALUE("abc")', ERROR), ("VALUE(tb)", ERROR),
    # VALUE reads what a spreadsheet reads (Excel's documented VALUE("$1,000") is 1000), and
    # nothing of Java's number syntax; a blank and a non-finite number are errors IFERROR sees
    ('VALUE("$1,000")', 1000.0), ('VALUE("1,234.5")', 1234.5), ('VALUE(" -12% ")', -0.12),
    ('VALUE("1e3")', 1000.0), ('VALUE(".5")', 0.5), ('VALUE("12d")', ERROR),
    ('VALUE("5f")', ERROR), ('VALUE("Infinity")', ERROR), ('VALUE("NaN")', ERROR),
    ('VALUE("0x1F")', ERROR), ('VALUE("1,23")', ERROR), ('VALUE("e3")', ERROR),
    ('VALUE("")', ERROR), ('VALUE("1e400")', ERROR), ('IFERROR(VALUE("1e400"), -1)', -1.0),
    ('IFERROR(VALUE("Infinity"), -1)', -1.0), ("CAST('12d' AS double)", ERROR),
    ("CAST(t AS int)", ERROR), ("CAST('42.9' AS int)", 42.0), ("CAST(n AS string)", "10"),
    ("CAST(2.345 AS decimal(5,2))", 2.35), ("CAST(flag AS int)", 1.0),
    # text
    ('t & "!"', "Hello World!"), ("tb & n", "10"), ("n / 4 & \"\"", "2.5"), ('flag & ""', "TRUE"),
    ('d & ""', "2026-01-31"), ('CONCAT(t, "-", n)', "Hello World-10"),
    ("CONCATENATE(tb, 1)", "1"), ("LEFT(t, 5)", "Hello"), ("LEFT(t)", "H"), ("LEFT(t, -1)", ERROR),
    ("RIGHT(t, 5)", "World"), ("RIGHT(t, 50)", "Hello World"), ("MID(t, 7, 3)", "Wor"),
    ("LEFT(t, 2.7)", "He"), ("LEFT(t, n / 5)", "He"),
    ("RIGHT(t, -0.5)", ERROR), ('"ÉTÉ" = "été"', True), ('"Email" <> "EMAIL"', False),
    ("MID(t, 0, 3)", ERROR), ("MID(t, 20, 3)", ""), ("LEN(t)", 11.0), ("LENGTH(tb)", 0.0),
    ("UPPER(t)", "HELLO WORLD"), ("LOWER(t)", "hello world"),
    ('TRIM("  a   b  ")', "a b"), ('SUBSTITUTE(t, "o", "0")', "Hell0 W0rld"),
    ('SUBSTITUTE(t, "", "x")', "Hello World"), ("LEFT(12345, 2)", "12"),
    # dates
    ("DATE(2026, 2, 29)", dt.date(2026, 3, 1)), ("DATE(2026, 13, 1)", dt.date(2027, 1, 1)),
    ("DATE(2026, 1, 0)", dt.date(2025, 12, 31)), ("DATE(0, 1, 1)", ERROR),
    ("DATE(1e12, 1, 1)", ERROR), ('DATEVALUE("2026-03-04")', dt.date(2026, 3, 4)),
    ('DATEVALUE("soon")', ERROR), ("YEAR(d)", 2026.0), ("MONTH(d)", 1.0), ("DAY(d)", 31.0),
    ("WEEKDAY(d)", 7.0), ("YEAR(db)", None), ("TODAY()", TODAY), ("d + 1", dt.date(2026, 2, 1)),
    ("d - 31", dt.date(2025, 12, 31)), ("TODAY() - d", 298.0), ("DAYS(TODAY(), d)", 298.0),
    ('DATEDIF(d, DATE(2026, 3, 30), "M")', 1.0), ('DATEDIF(d, TODAY(), "D")', 298.0),
    ('DATEDIF(DATE(2000, 2, 29), DATE(2026, 2, 28), "Y")', 25.0),
    ('DATEDIF(TODAY(), d, "D")', ERROR), ("EDATE(d, 1)", dt.date(2026, 2, 28)),
    ("EOMONTH(d, 1)", dt.date(2026, 2, 28)), ("d > DATE(2026, 1, 1)", True),
    # numbers past a bigint (floor() would overflow in Spark's ANSI mode)
    ("1e20 & \"\"", "1E+20"), ("n * 1e18 & \"\"", "1E+19"), ("MOD(1e20, 7)", 2.0),
    ("INT(-1e20)", -1e20), ("CEILING(1e300)", 1e300), ("MOD(-1e20, 7)", 5.0),
    # numbers as text as a spreadsheet's General format shows them: up to 15 significant
    # digits, plain from 1E-9 to 15 integer digits (Excel: ="a"&1/3 is a0.333333333333333,
    # ="a"&123456789012345678 is a1.23456789012346E+17)
    ('"CTR " & 0.000858', "CTR 0.000858"), ('"Revenue: " & 23883837.23', "Revenue: 23883837.23"),
    ('0.1 + 0.2 & ""', "0.3"), ('1 / 3 & ""', "0.333333333333333"), ('-2.5e-10 & ""', "-2.5E-10"),
    ('123456789012345678 & ""', "1.23456789012346E+17"),
    ('999999999999999 & ""', "999999999999999"),
    ('1e15 & ""', "1E+15"), ('-0.5 & ""', "-0.5"), ('1e-9 & ""', "0.000000001"),
    ("LEN(0.000858)", 8.0), ("LEFT(23883837.23, 4)", "2388"), ("RIGHT(0.000858, 3)", "858"),
    ("MID(23883837.23, 9, 3)", ".23"), ("CONCAT(n / 4, 0.000858)", "2.50.000858"),
    ("CAST(1e-9 AS string)", "0.000000001"), ("-z & \"\"", "0"),
    # 10% is a hundredth of 10 (postfix percent); a % b between operands is a remainder
    ("10%", 0.1), ("n * 10%", 1.0), ("200 * 15% + 1", 31.0), ("10 % 3", 1.0), ("10%3", 1.0),
    # numbers (each value from the function's Microsoft Excel documentation)
    ("CEILING(2.5, 1)", 3.0), ("CEILING(-2.5, -2)", -4.0), ("CEILING(-2.5, 2)", -2.0),
    ("CEILING(1.5, 0.1)", 1.5), ("CEILING(0.234, 0.01)", 0.24), ("CEILING(2.5, -2)", ERROR),
    ("CEIL(2.5, 0)", 0.0), ("FLOOR(3.7, 2)", 2.0), ("FLOOR(-2.5, -2)", -2.0),
    ("FLOOR(2.5, -2)", ERROR), ("FLOOR(1.58, 0.1)", 1.5), ("FLOOR(0.234, 0.01)", 0.23),
    ("FLOOR(-2.5, 2)", -4.0), ("FLOOR(n, 0)", ERROR),
    ("ROUNDUP(3.2, 0)", 4.0), ("ROUNDUP(76.9, 0)", 77.0), ("ROUNDUP(3.14159, 3)", 3.142),
    ("ROUNDUP(-3.14159, 1)", -3.2), ("ROUNDUP(31415.92654, -2)", 31500.0),
    ("ROUNDDOWN(3.2, 0)", 3.0), ("ROUNDDOWN(76.9, 0)", 76.0), ("ROUNDDOWN(3.14159, 3)", 3.141),
    ("ROUNDDOWN(-3.14159, 1)", -3.1), ("ROUNDDOWN(31415.92654, -2)", 31400.0),
    ("ROUNDDOWN(4.35, 2)", 4.35), ("TRUNC(8.9)", 8.0), ("TRUNC(-8.9)", -8.0), ("TRUNC(0.45)", 0.0),
    ("MROUND(10, 3)", 9.0), ("MROUND(-10, -3)", -9.0), ("MROUND(1.3, 0.2)", 1.4),
    ("MROUND(5, -2)", ERROR), ("MROUND(n, 0)", 0.0),
    ("LOG(10)", 1.0), ("LOG(8, 2)", 3.0), ("ROUND(LOG(86, 2.7182818), 7)", 4.4543473),
    ("LOG(0, 2)", ERROR), ("LOG(8, 1)", ERROR), ("ROUND(PI(), 14)", 3.14159265358979),
    ("MEDIAN(1, 2, 3, 4, 5)", 3.0), ("MEDIAN(1, 2, 3, 4, 5, 6)", 3.5), ("MEDIAN(n, b, 2)", 6.0),
    ("MEDIAN(b, b)", ERROR),
    # logic
    ("ISNUMBER(n)", True), ("ISNUMBER(b)", False), ("ISNUMBER(t)", False),
    ("ISNUMBER(n / z)", False), ("ISTEXT(t)", True), ("ISTEXT(tb)", False), ("ISTEXT(n)", False),
    ("IFNA(n / z, -1)", -1.0), ("IFNA(n, -1)", 10.0),
    ('SWITCH(WEEKDAY(DATE(2018, 2, 22)), 1, "Sunday", 2, "Monday", 3, "Tuesday", "No match")',
     "No match"),
    ('SWITCH(WEEKDAY(DATE(2018, 2, 20)), 1, "Sunday", 2, "Monday", 3, "Tuesday")', "Tuesday"),
    ('SWITCH(99, 1, "a")', ERROR), ('SWITCH(t, "hello world", 1, 2)', 1.0),
    ('CHOOSE(2, "1st", "2nd", "3rd", "Finished")', "2nd"),
    ('CHOOSE(4, "1st", "2nd", "3rd", "Finished")', "Finished"), ('CHOOSE(5, "a")', ERROR),
    ('CHOOSE(2.9, "a", "b")', "b"), ('CHOOSE(z, "a")', ERROR),
    # text (Excel's documented examples)
    ('FIND("M", "Miriam McGovern")', 1.0), ('FIND("m", "Miriam McGovern")', 6.0),
    ('FIND("M", "Miriam McGovern", 3)', 8.0), ('FIND("z", t)', ERROR), ('FIND("o", t, 99)', ERROR),
    ('SEARCH("e", "Statements", 6)', 7.0), ('SEARCH("margin", "Profit Margin")', 8.0),
    ('SEARCH("w?r", t)', 7.0), ('SEARCH("o*d", t, 6)', 8.0), ('SEARCH("x", t)', ERROR),
    ('PROPER("this is a TITLE")', "This Is A Title"), ('PROPER("2-way street")', "2-Way Street"),
    ('PROPER("76BudGet")', "76Budget"), ("PROPER(tb)", ""),
    ('REPLACE("abcdefghijk", 6, 5, "*")', "abcde*k"), ('REPLACE("2009", 3, 2, "10")', "2010"),
    ('REPLACE("123456", 1, 3, "@")', "@456"), ('REPLACE(t, 0, 1, "x")', ERROR),
    ('REPT("*-", 3)', "*-*-*-"), ('REPT("-", 10)', "----------"), ('REPT("x", -1)', ERROR),
    ('REPT("ab", 20000)', ERROR),
    ('TEXTJOIN(" ", TRUE, "The", "sun", "will", "come", "up", "tomorrow.")',
     "The sun will come up tomorrow."),
    ('TEXTJOIN(",", FALSE, "a", tb, "b")', "a,,b"), ('TEXTJOIN(",", flag, "a", tb, n)', "a,10"),
    ('EXACT("word", "word")', True), ('EXACT("Word", "word")', False),
    ('EXACT("w ord", "word")', False),
    ('TEXT(1234.567, "$#,##0.00")', "$1,234.57"), ('TEXT(0.285, "0.0%")', "28.5%"),
    ('TEXT(12200000, "0.00E+00")', "1.22E+07"), ('TEXT(1234, "0000000")', "0001234"),
    ('TEXT(d, "MM/DD/YY")', "01/31/26"), ('TEXT(d, "dddd, mmmm d, yyyy")',
                                          "Saturday, January 31, 2026"),
    ('TEXT(NOW(), "yyyy-mm-dd hh:mm:ss")', "2026-11-25 14:05:09"),
    ('TEXT(NOW(), "h:mm AM/PM")', "2:05 PM"), ('TEXT(0.5, "#.00")', ".50"),
    ('TEXT(1.5, "0.##")', "1.5"), ('TEXT(1, "0.##")', "1."), ('TEXT(-1234.5, "#,##0")', "-1,235"),
    ('TEXT(12345678, "#,##0,""K""")', "12,346K"), ('TEXT(t, "0.00")', "Hello World"),
    ('TEXT(n, "General")', "10"), ('TEXT(46053, "yyyy-mm-dd")', "2026-01-31"),
    # dates
    ("NOW()", NOW), ("YEAR(NOW())", 2026.0), ('NOW() & ""', "2026-11-25 14:05:09"),
    ("d < NOW()", True), ("TODAY() < NOW()", True), ("db < NOW()", True),
    ("WEEKNUM(DATE(2012, 3, 9))", 10.0), ("WEEKNUM(DATE(2012, 3, 9), 2)", 11.0),
    ("WEEKNUM(DATE(2021, 1, 1), 21)", 53.0), ("WEEKNUM(DATE(2012, 12, 31), 1)", 53.0),
    ("NETWORKDAYS(DATE(2012, 10, 1), DATE(2013, 3, 1))", 110.0),
    ("NETWORKDAYS(DATE(2012, 10, 1), DATE(2013, 3, 1), DATE(2012, 11, 22))", 109.0),
    ("NETWORKDAYS(DATE(2012, 10, 1), DATE(2013, 3, 1), DATE(2012, 11, 22), DATE(2012, 12, 4), "
     "DATE(2013, 1, 21))", 107.0),
    ("NETWORKDAYS(DATE(2013, 3, 1), DATE(2012, 10, 1))", -110.0),
    ("NETWORKDAYS(DATE(2026, 11, 28), DATE(2026, 11, 29))", 0.0),
    ("ROUND(YEARFRAC(DATE(2012, 1, 1), DATE(2012, 7, 30)), 8)", 0.58055556),
    ("ROUND(YEARFRAC(DATE(2012, 1, 1), DATE(2012, 7, 30), 1), 8)", 0.57650273),
    ("ROUND(YEARFRAC(DATE(2012, 1, 1), DATE(2012, 7, 30), 3), 8)", 0.57808219),
    ("YEARFRAC(DATE(2012, 7, 30), DATE(2012, 1, 1), 2)", 211 / 360),
    ("YEARFRAC(DATE(2011, 1, 31), DATE(2011, 3, 31), 4)", 60 / 360),
    ("YEARFRAC(DATE(2011, 2, 28), DATE(2012, 2, 29), 0)", 1.0),
    ('DATEDIF(DATE(2001, 6, 1), DATE(2002, 8, 15), "D")', 440.0),
    ('DATEDIF(DATE(2001, 6, 1), DATE(2002, 8, 15), "YD")', 75.0),
    ('DATEDIF(DATE(2001, 6, 1), DATE(2002, 8, 15), "MD")', 14.0),
    ('DATEDIF(DATE(2001, 6, 1), DATE(2002, 8, 15), "YM")', 2.0),
    ('DATEDIF(DATE(2001, 1, 1), DATE(2003, 1, 1), "Y")', 2.0),
    # text constants are data, whatever they hold
    ("\"it's \\ `x` -- /* */ é\" & \"\"", "it's \\ `x` -- /* */ é"),
    ("'\"); DROP TABLE t; --'", "\"); DROP TABLE t; --"),
    # deep nesting (the limit is 64 levels) parses in Spark
    ("(" * 30 + "n" + " + 1)" * 30, 40.0), ("ABS(" * 60 + "-n" + ")" * 60, 10.0),
]  # fmt: skip


#: Functions over the tenant's rows or a lookup table: their cases are in the aggregates and
#: lookup tests.
TENANT_AGGREGATES = {"SUM", "AVERAGE", "COUNT", "MIN", "MAX", "TODAY", "RANK", "VLOOKUP",
                     "XLOOKUP", *CRITERIA_AGGREGATES}  # fmt: skip


def test_every_function_has_a_meaning_case() -> None:
    used = {name for name in FUNCTIONS if any(f"{name}(" in case[0].upper() for case in CASES)}
    assert set(FUNCTIONS) - used <= TENANT_AGGREGATES - used


@needs_spark
@pytest.mark.spark
def test_each_function_means_what_the_reference_says(spark: Any) -> None:  # noqa: F811
    from django_fairqueue.contrib.pipeline.compile_levels import ERROR_PREFIX, apply_formulas

    formulas = check(*(f"c{i} = {case[0]}" for i, case in enumerate(CASES)))
    schema = "n double, z int, b double, t string, tb string, d date, db date, flag boolean"
    df = spark.createDataFrame([tuple(ROW.values())], schema)
    out, outputs = apply_formulas(df, formulas, today=NOW, names={})
    errors = [o.error_column for o in outputs if o.error_column]
    row = out.select(*[o.name for o in outputs], *errors).collect()[0].asDict()

    wrong = []
    for i, (expression, want) in enumerate(CASES):
        error = row.get(f"{ERROR_PREFIX}c{i}", False)
        got = ERROR if error else row[f"c{i}"]
        if want is ERROR or got is ERROR:
            ok = want is got
        elif isinstance(want, float) and isinstance(got, float):
            ok = abs(got - want) <= 1e-9 * max(1.0, abs(want))
        else:
            ok = got == want and type(got) is type(want)
        if not ok:
            wrong.append((expression, want, got))
        if error:
            assert row[f"c{i}"] is None, expression  # an error value is blank in the sink
    assert not wrong


@needs_spark
@pytest.mark.spark
def test_error_flags_packed_in_spark_are_counted_per_rule_by_the_write_task(
    spark: Any,  # noqa: F811
) -> None:
    import pyarrow as pa

    from django_fairqueue.contrib.pipeline import datastore
    from django_fairqueue.contrib.pipeline.compile_levels import packed_flags

    rules = 130  # three words of flags
    rows = [[None if (r + k) % 11 == 0 else (r * 7 + k) % 3 == 0 for k in range(rules)]
            for r in range(40)]  # fmt: skip
    schema = ", ".join(f"f{k} boolean" for k in range(rules))
    df = spark.createDataFrame([tuple(row) for row in rows], schema)
    words = packed_flags([f"f{k}" for k in range(rules)], datastore.ERROR_BITS)
    assert len(words) == datastore.error_words(rules) == 3
    packed = [list(r) for r in df.selectExpr(*words).collect()]

    encoder = datastore._Encoder(None, error_columns=rules)
    columns = [pa.array(range(len(rows)), pa.int64())]
    columns += [pa.array([r[j] for r in packed], pa.int64()) for j in range(len(words))]
    encoder.encode(pa.RecordBatch.from_arrays(columns, names=["id", "w0", "w1", "w2"]))

    assert encoder.errors == [sum(bool(row[k]) for row in rows) for k in range(rules)]


@needs_spark
@pytest.mark.spark
def test_aggregates_over_the_tenant_grouped_and_not(spark: Any) -> None:  # noqa: F811
    from django_fairqueue.contrib.pipeline.compile_joins import compute_aggregates, join_aggregates
    from django_fairqueue.contrib.pipeline.compile_levels import ERROR_PREFIX, apply_formulas

    rows = [(1, 10.0, "n"), (2, 30.0, "n"), (3, None, "s"), (4, 5.0, None), (5, 0.0, "z")]
    df = spark.createDataFrame(rows, "id long, x double, g string")
    formulas = parse_formulas(
        "acme",
        [
            "share = x / SUM(x BY g)",
            "total = SUM(x)",
            "mean = AVERAGE(x BY g)",
            "n = COUNT(x)",
            "lo = MIN(x)",
            "hi = MAX(x BY g)",
            'rank = IF(x >= AVERAGE(x), "top", "low")',
        ],
        columns={"id": "int", "x": "float", "g": "str"},
        targets=None,
    )
    values = compute_aggregates(df, formulas, today=TODAY, max_groups=100)
    joined, names = join_aggregates(spark, df, values, today=TODAY, formulas=formulas)
    out, _ = apply_formulas(joined, formulas, today=TODAY, names=names)
    got = {r["id"]: r.asDict() for r in out.collect()}

    assert got[1]["share"] == 0.25 and got[2]["share"] == 0.75
    assert got[4]["share"] == 1.0  # a blank group is a group
    assert got[3]["share"] is None and got[3][f"{ERROR_PREFIX}share"]  # 0 / 0 in group s
    assert {r["total"] for r in got.values()} == {45.0}
    assert got[3]["mean"] is None and got[3][f"{ERROR_PREFIX}mean"]  # no value in group s
    assert got[1]["mean"] == 20.0
    assert {r["n"] for r in got.values()} == {4.0}  # blanks are not counted
    assert {r["lo"] for r in got.values()} == {0.0}
    assert got[2]["hi"] == 30.0
    assert [got[i]["rank"] for i in (1, 2, 5)] == ["low", "top", "low"]
    with pytest.raises(ValueError, match="more than 2 groups"):
        compute_aggregates(df, formulas, today=TODAY, max_groups=2)


def _tenant_values(spark: Any, rows: list[tuple[Any, ...]], schema: str,  # noqa: F811
                   rules: list[str]) -> dict[str, Any]:  # fmt: skip
    """Each rule's value on the first row, its aggregates over all of ``rows`` (ERROR: an
    error value)."""
    from django_fairqueue.contrib.pipeline.compile_joins import compute_aggregates, join_aggregates
    from django_fairqueue.contrib.pipeline.compile_levels import ERROR_PREFIX, apply_formulas

    columns = {name: kind for name, kind in (f.split() for f in schema.split(", "))}
    kinds = {"double": "float", "string": "str", "long": "int"}
    formulas = parse_formulas(
        "acme", rules, columns={n: kinds[k] for n, k in columns.items()}, targets=None
    )
    df = spark.createDataFrame(rows, schema)
    values = compute_aggregates(df, formulas, today=TODAY, max_groups=10)
    joined, names = join_aggregates(spark, df, values, today=TODAY, formulas=formulas)
    out, outputs = apply_formulas(joined, formulas, today=TODAY, names=names)
    row = out.collect()[0].asDict()
    return {o.name: ERROR if row.get(f"{ERROR_PREFIX}{o.name}") else row[o.name]
            for o in outputs}  # fmt: skip


@needs_spark
@pytest.mark.spark
def test_criteria_aggregates_give_the_spreadsheets_documented_values(
    spark: Any,  # noqa: F811
) -> None:
    # Excel's SUMIF and AVERAGEIF examples (property values and commissions) beside its
    # COUNTIF example (fruit and counts): both four rows.
    got = _tenant_values(
        spark,
        [(100000.0, 7000.0, "apples", 32.0), (200000.0, 14000.0, "oranges", 54.0),
         (300000.0, 21000.0, "peaches", 75.0), (400000.0, 28000.0, "apples", 86.0)],
        "value double, commission double, fruit string, n double",
        [
            'a = SUMIF(value, ">160000", commission)', 'b = SUMIF(value, ">160000")',
            "c = SUMIF(value, 300000, commission)", 'd = AVERAGEIF(commission, "<23000")',
            'e = AVERAGEIF(value, "<250000")', 'f = AVERAGEIF(value, "<95000")',
            'g = AVERAGEIF(value, ">250000", commission)', 'h = COUNTIF(fruit, "apples")',
            'i = COUNTIF(n, ">55")', 'j = COUNTIF(n, "<>75")', 'k = COUNTIF(fruit, "*es")',
            'l = COUNTIF(fruit, "?????es")', 'm = COUNTIF(fruit, "*")',
            "o = SUMPRODUCT(value, commission)", "p = MEDIAN(commission)",
            'q = COUNTIF(fruit, "APPLES")', 'r = SUMIF(value, ">160,000", commission) / 1000',
        ],
    )  # fmt: skip
    assert got == {
        "a": 63000.0, "b": 900000.0, "c": 21000.0, "d": 14000.0, "e": 150000.0, "f": ERROR,
        "g": 24500.0, "h": 2.0, "i": 2.0, "j": 3.0, "k": 4.0, "l": 2.0, "m": 4.0,
        "o": 2.1e10, "p": 17500.0, "q": 2.0, "r": 63.0,
    }  # fmt: skip

    # Excel's SUMIF example by category and food (a blank category), and its MAXIFS/MINIFS
    # example (grades and weights): six rows each.
    got = _tenant_values(
        spark,
        [("Vegetables", "Tomatoes", 2300.0, 89.0, 1.0), ("Vegetables", "Celery", 5500.0, 93.0, 2.0),
         ("Fruits", "Oranges", 800.0, 96.0, 2.0), (None, "Butter", 400.0, 85.0, 3.0),
         ("Vegetables", "Carrots", 4200.0, 91.0, 1.0), ("Fruits", "Apples", 1200.0, 88.0, 1.0)],
        "category string, food string, sales double, grade double, weight double",
        [
            'a = SUMIF(category, "Fruits", sales)', 'b = SUMIF(category, "Vegetables", sales)',
            'c = SUMIF(food, "*es", sales)', 'd = SUMIF(category, "", sales)',
            "e = COUNTA(category)", "f = MAXIFS(grade, weight, 1)", "g = MINIFS(grade, weight, 1)",
            "h = MAXIFS(grade, weight, 9)", 'i = SUMIF(category, "<>Fruits", sales)',
        ],
    )  # fmt: skip
    assert got == {"a": 2000.0, "b": 12000.0, "c": 4300.0, "d": 400.0, "e": 5.0, "f": 91.0,
                   "g": 88.0, "h": 0.0, "i": 12400.0}  # fmt: skip

    # Excel's SUMIFS example: quantities by product and salesperson, eight rows.
    people = ["Tom", "Sarah"] * 4
    products = ["Apples", "Apples", "Artichokes", "Artichokes", "Bananas", "Bananas",
                "Carrots", "Carrots"]  # fmt: skip
    quantities = [5.0, 4.0, 15.0, 3.0, 22.0, 12.0, 10.0, 33.0]
    got = _tenant_values(
        spark,
        list(zip(quantities, products, people, strict=True)),
        "qty double, product string, person string",
        [
            'a = SUMIFS(qty, product, "=A*", person, "Tom")',
            'b = SUMIFS(qty, product, "<>Bananas", person, "Tom")',
            'c = COUNTIFS(product, "=A*", person, "Tom")', 'd = AVERAGEIFS(qty, person, "Sarah")',
            "e = qty / SUMIF(person, \"Tom\", qty BY product)", "f = MEDIAN(qty BY person)",
        ],
    )  # fmt: skip
    assert got == {"a": 20.0, "b": 30.0, "c": 2.0, "d": 13.0, "e": 1.0, "f": 12.5}

    # Excel's RANK example: 7, 3.5, 3.5, 1, 2 (RANK(3.5, ..., 1) is 3, RANK(7, ...) is 1); the
    # row asked about is the first, 3.5.
    got = _tenant_values(
        spark,
        [(3.5, "a"), (7.0, "a"), (3.5, "b"), (1.0, "b"), (2.0, "b"), (None, "b")],
        "x double, g string",
        ["up = RANK(x, 1)", "down = RANK(x)", "within = RANK(x BY g)", "share = x / RANK(x)"],
    )
    assert got == {"up": 3.0, "down": 2.0, "within": 2.0, "share": 1.75}


def test_criteria_are_constants_and_aggregate_over_rows_not_aggregates() -> None:
    assert "a criterion must be a constant" in refused("x = SUMIF(n, t)")
    assert "criteria come in pairs" in refused('x = SUMIFS(n, t, "a", n)')
    assert "aggregate inside an aggregate" in refused('x = SUMIF(n, ">1", SUM(n))')
    assert "TEXT's format: sections (;) are not supported" in refused('x = TEXT(n, "0;-0")')
    assert "WEEKNUM's return type must be a constant" in refused("x = WEEKNUM(d, n)")


def test_rules_may_come_in_any_order_and_a_cycle_names_its_members() -> None:
    formulas = check("total = _net * 2", "_net = subtotal - 1", "subtotal = n * z")
    assert formulas.targets() == ["subtotal", "_net", "total"]  # computed in dependency order
    assert formulas.pairs()[0] == ("total", "_net * 2")  # pinned as written (the version's)
    assert formulas.version == version_of(formulas.pairs())
    with pytest.raises(FormulaError) as caught:
        check("x = n", "p = q + 1", "q = r * 2", "r = IF(p > 0, 1, 2)")
    message = str(caught.value)
    assert "a cycle: p -> q -> r -> p" in message and "'p = q + 1'" in message
    assert "unknown name" not in message
    with pytest.raises(FormulaError, match="'x' uses itself"):
        check("x = x + 1")


# --------------------------------------------------------------------------------------------
# The JSON sink, pinned versions, cancelling: end to end


@pytest.fixture
def json_formulas(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    copy = {tenant: list(f) for tenant, f in pipelines.JSON_FORMULAS.items()}
    monkeypatch.setattr(pipelines, "JSON_FORMULAS", copy)
    return copy


def json_rows(count: int) -> None:
    rows = []
    for i in range(count):
        for tenant in ("alice", "bob"):
            rows.append(
                DataRow(
                    tenant=tenant,
                    price=float(1 + i % 9),
                    qty=1 + i % 5,
                    discount=0.1 if i % 2 else 0.0,
                    note=None if i % 4 == 0 else f"g{i % 3}",
                    ordered_on=dt.date(2026, 1, 1) + dt.timedelta(days=i),
                )
            )
    DataRow.objects.bulk_create(rows)


def run_all(spark: Any, name: str = "test.json") -> None:  # noqa: F811
    PipelineRunner(worker_id="test", pipelines=[name], burst=True, spark=spark).run()


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_json_sink_gets_every_rule_and_the_job_counts_errors(
    spark: Any,  # noqa: F811
    spark_settings: None,  # noqa: F811
    json_formulas: dict[str, list[str]],
) -> None:
    json_rows(100)  # 2 batches per tenant
    report = plan("test.json")
    run_all(spark)

    assert all(j.state == "succeeded" for j in batches.jobs(prefix="test.json:"))
    job = PipelineJob.objects.get(job_name="test.json:alice")
    today = job.today
    data = {r.id: r for r in DataRow.objects.filter(tenant="alice")}
    net = {i: round(r.price * r.qty * (1 - r.discount) + 1e-9, 2) for i, r in data.items()}
    group_total: dict[str | None, float] = {}
    for i, r in data.items():
        group_total[r.note] = group_total.get(r.note, 0.0) + net[i]
    results = {r.id: r.results for r in JsonResultRow.objects.filter(tenant="alice")}
    assert results.keys() == data.keys()
    unit_errors = 0
    for i, r in data.items():
        got = results[i]
        assert "_gross" not in got  # an intermediate is not written
        assert got["net"] == pytest.approx(net[i])
        assert got["share"] == pytest.approx(net[i] / group_total[r.note])
        assert got["label"] == f"{(r.note or 'none')[:2].upper()}-{i}"
        assert got["size"] == ("big" if r.qty > 3 else "small")
        assert got["age"] == (today - r.ordered_on).days
        assert got["month"] == r.ordered_on.month
        if r.qty == 3:
            assert "unit" not in got  # an error value: blank
            unit_errors += 1
        else:
            assert got["unit"] == pytest.approx(r.price / (r.qty - 3))
    assert unit_errors == 20
    assert job.errors == {"unit": unit_errors}
    assert job.version == report.versions["alice"]
    bob = JsonResultRow.objects.filter(tenant="bob").first()
    assert bob is not None and set(bob.results) == {"double"}
    assert json.loads(json.dumps(bob.results))["double"] == 2 * DataRow.objects.get(pk=bob.pk).price


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_job_keeps_the_formulas_it_was_planned_with(
    spark: Any,  # noqa: F811
    spark_settings: None,  # noqa: F811
    json_formulas: dict[str, list[str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    json_rows(100)
    json_formulas["alice"] = ["v = price * 2"]
    first = plan("test.json", tenants=["alice"])
    version = first.versions["alice"]
    PipelineRunner(
        worker_id="test", pipelines=["test.json"], burst=True, max_batches=1, spark=spark
    ).run()

    json_formulas["alice"] = ["v = price * 3"]  # edited while the job runs
    refused = plan("test.json", tenants=["alice"]).refused["alice"]
    assert "still has 1 unfinished batches" in str(refused)
    assert "its formulas changed" in str(refused)
    run_all(spark)

    # Every row was computed with the version the job was planned with.
    for row in JsonResultRow.objects.filter(tenant="alice"):
        assert row.results == {"v": 2 * DataRow.objects.get(pk=row.pk).price}
    assert PipelineJob.objects.get(job_name="test.json:alice").version == version

    # Finished: planning again pins the new version and recomputes every row.
    again = plan("test.json", tenants=["alice"])
    assert again.versions["alice"] != version
    assert again.planned[0].created == 2
    run_all(spark)
    for row in JsonResultRow.objects.filter(tenant="alice"):
        assert row.results == {"v": 3 * DataRow.objects.get(pk=row.pk).price}
    call_command("fairpipeline", "plan", "test.json", "--tenant", "alice", "--rerun")
    assert f"(formulas {again.versions['alice']}): 2 new batches" in capsys.readouterr().out


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_cancelled_job_drops_pending_batches_and_a_running_one_writes_nothing(
    spark: Any,  # noqa: F811
    spark_settings: None,  # noqa: F811
    json_formulas: dict[str, list[str]],
) -> None:
    from datetime import timedelta

    from django_fairqueue.contrib.pipeline import batch_run

    json_rows(150)  # 3 batches per tenant
    plan("test.json", tenants=["alice"])
    running = batches.claim(worker_id="w", jobs=["test.json:*"], lease=timedelta(minutes=5))
    assert running is not None

    assert cancel("test.json") == {"alice": 2}
    assert not WorkBatch.objects.filter(job_name="test.json:alice", state="pending").exists()
    with pytest.raises(batch_run.JobCancelled):
        batch_run.execute_batch(spark, running)
    assert not JsonResultRow.objects.exists()
    assert PipelineJob.objects.get(job_name="test.json:alice").cancelled_at is not None


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_every_batch_of_a_job_uses_the_aggregates_stored_with_the_job(
    spark: Any,  # noqa: F811
    spark_settings: None,  # noqa: F811
    json_formulas: dict[str, list[str]],
) -> None:
    from django_fairqueue.contrib.pipeline import batch_run

    json_rows(100)  # 2 batches
    json_formulas["alice"] = ["share = price / SUM(price)"]
    plan("test.json", tenants=["alice"])
    PipelineRunner(
        worker_id="test", pipelines=["test.json"], burst=True, max_batches=1, spark=spark
    ).run()
    job = PipelineJob.objects.get(job_name="test.json:alice")
    total = sum(DataRow.objects.filter(tenant="alice").values_list("price", flat=True))
    assert job.aggregates["version"] == job.version
    assert job.aggregates["groups"] == [[[total, False]]]

    # Another worker (here: this process, its memory cleared) uses the stored values, so the
    # job's batches cannot disagree even if the rows changed meanwhile.
    job.aggregates["groups"] = [[[total * 2, False]]]
    job.save()
    batch_run.aggregate_cache._values.clear()
    DataRow.objects.filter(tenant="alice").update(price=1000.0)
    run_all(spark)

    shares = sorted(r.results["share"] for r in JsonResultRow.objects.filter(tenant="alice"))
    done_first = [s for s in shares if s < 1000 / total / 2 - 1e-12]
    assert len(done_first) == 50  # the first batch: the prices as they were, over the total
    assert all(s == pytest.approx(1000.0 / (total * 2)) for s in shares[50:])


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_not_null_columns_get_their_default_and_today_is_the_pipelines_zones(
    spark: Any,  # noqa: F811
    spark_settings: None,  # noqa: F811
) -> None:
    import io
    import zoneinfo

    from tests.pipelineapp.models import StrictResultRow

    json_rows(60)
    err = io.StringIO()
    call_command("fairpipeline", "plan", "test.strict", stdout=io.StringIO(), stderr=err)
    warned = err.getvalue()
    for column, fill in (("band", "''"), ("total", "-1.0"), ("due", "1899, 12, 31")):
        assert f"sink column {column!r} is NOT NULL" in warned and fill in warned, column
    run_all(spark, "test.strict")  # a blank or an error into a NOT NULL column fails nothing

    assert all(j.state == "succeeded" for j in batches.jobs(prefix="test.strict:"))
    job = PipelineJob.objects.get(job_name="test.strict:alice")
    local = job.created_at.astimezone(zoneinfo.ZoneInfo("Pacific/Kiritimati"))
    assert job.today == local.date()  # the pipeline's zone, not Django's or the machine's
    data = {r.id: r for r in DataRow.objects.filter(tenant="alice")}
    got = {r.id: r for r in StrictResultRow.objects.all()}
    assert got.keys() == data.keys()
    for i, r in data.items():
        row = got[i]
        assert row.band == ("big" if r.price > 5 else "")  # the model's default, ""
        assert row.total == (-1.0 if r.qty == 3 else pytest.approx(r.price / (r.qty - 3)))
        assert row.due == (dt.date(2026, 1, 1) if r.qty > 3 else dt.date(1899, 12, 31))
        assert row.stamp == f"{local:%Y-%m-%d %H:%M} {job.today.isoformat()}"
    assert job.errors == {"total": sum(1 for r in data.values() if r.qty == 3)}


def test_lookups_are_checked_against_the_declared_tables() -> None:
    tables = {"prices": LookupTable("code", {"code": "str", "price": "float", "band": "str"})}

    def lookup_refused(formula: str) -> str:
        with pytest.raises(FormulaError) as caught:
            parse_formulas("acme", [formula], columns=COLUMNS, targets=None, lookups=tables)
        return str(caught.value)

    ok = parse_formulas("acme", ['x = VLOOKUP(t, "prices", 3, FALSE)',
                                 'y = XLOOKUP(t, "prices.code", "prices.price", 0) + 1'],
                        columns=COLUMNS, targets=None, lookups=tables)  # fmt: skip
    assert [f.kind for f in ok.formulas] == ["text", "number"]
    assert "only an exact match" in lookup_refused('x = VLOOKUP(t, "prices", 2, TRUE)')
    assert "from 1 to 3" in lookup_refused('x = VLOOKUP(t, "prices", 4, FALSE)')
    assert 'lookup table, in quotes ("prices")' in lookup_refused('x = VLOOKUP(t, "nope", 2, 0)')
    assert "looked up by its key 'code'" in lookup_refused(
        'x = XLOOKUP(t, "prices.band", "prices.price")'
    )
    assert "the value looked up is number" in lookup_refused('x = VLOOKUP(n, "prices", 2, 0)')
    aggregate = 'x = VLOOKUP(COUNT(t) & "", "prices", 2, 0)'
    assert "may not use an aggregate" in lookup_refused(aggregate)


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_vlookup_and_xlookup_read_the_tenants_own_lookup_rows(
    spark: Any,  # noqa: F811
    spark_settings: None,  # noqa: F811
) -> None:
    from decimal import Decimal

    from tests.pipelineapp.models import PriceRow

    json_rows(40)  # notes g0, g1, g2 and blanks
    PriceRow.objects.bulk_create([
        PriceRow(tenant="alice", code="g0", price=Decimal("1.50"), band="low"),
        PriceRow(tenant="alice", code="G1", price=Decimal("2.50"), band="high"),
        PriceRow(tenant="bob", code="g0", price=Decimal("100"), band="x"),
    ])  # fmt: skip
    plan("test.lookup")
    run_all(spark, "test.lookup")

    assert all(j.state == "succeeded" for j in batches.jobs(prefix="test.lookup:"))
    prices = {"g0": 1.5, "g1": 2.5}
    results = {r.id: r.results for r in JsonResultRow.objects.all()}
    missing = 0
    for row in DataRow.objects.all():
        got = results[row.id]
        price = prices.get(row.note or "") if row.tenant == "alice" else None
        if row.tenant == "bob":
            assert got.get("price_of") == (100.0 if row.note == "g0" else None)
            continue
        if price is None:  # not in the table (g2, a blank): an error, or XLOOKUP's default
            missing += 1
            assert "price_of" not in got and "total" not in got and "via" not in got
            assert got["band_of"] == "none"
            continue
        assert got["price_of"] == price == got["via"]  # a text key matches without case
        assert got["band_of"] == {"g0": "low", "g1": "high"}[row.note or ""]
        assert got["code_of"] == {"g0": "g0", "g1": "G1"}[row.note or ""]  # the key as stored
        assert got["total"] == pytest.approx(row.qty * price)
    job = PipelineJob.objects.get(job_name="test.lookup:alice")
    assert job.errors["price_of"] == missing == job.errors["via"]

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
from django_fairqueue.contrib.pipeline.formulas import (
    FUNCTIONS,
    MAX_DEPTH,
    FormulaError,
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
        ("x = YEAR(n)", "a date function needs date, got number"),
        ('x = DATEDIF(d, d, "W")', 'DATEDIF\'s unit must be "D", "M" or "Y"'),
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
    from django_fairqueue.contrib.pipeline import compile as fc

    assert fc.quoted("a`b") == "`a``b`"
    text = "it's \\ `x` -- /* */ \n é ${x}"
    rendered = fc.literal(text)
    hex_digits = rendered.removeprefix("CAST(X'").removesuffix("' AS STRING)")
    assert bytes.fromhex(hex_digits).decode() == text  # nothing but hexadecimal digits
    assert fc.literal(1e20) == "(1e+20D)" and fc.literal(-2.5) == "(-2.5D)"
    assert fc.literal(3) == "(3)" and fc.literal(2**40) == "(1099511627776L)"
    assert (fc.literal(True), fc.literal(None)) == ("true", "NULL")
    assert fc.literal(dt.date(2026, 1, 2)) == "DATE '2026-01-02'"
    with pytest.raises(TypeError):
        fc.literal(object())


def test_a_formula_whose_text_repeats_too_much_is_refused_without_spark() -> None:
    from django_fairqueue.contrib.pipeline import compile as fc

    # INT uses its argument three times: 40 nested would be 3^40 copies of n.
    formulas = check("ok = INT(INT(n))", "x = " + "INT(" * 40 + "n" + ")" * 40)
    with pytest.raises(FormulaError, match="more than 200,000 characters of Spark SQL") as caught:
        fc.check_compiles(formulas, today=TODAY)
    assert "tenant 'acme'" in str(caught.value) and "x = INT(INT(" in str(caught.value)
    # Named intermediate rules keep each rule's text short.
    fc.check_compiles(
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

#: (expression, value, or ERROR for an error value). Run on the row ROW.
CASES: list[tuple[str, Any]] = [
    # arithmetic, blanks, errors
    ("n + b", 10.0), ("n * b", 0.0), ("n / z", ERROR), ("n / b", ERROR), ("-n ^ 2", 100.0),
    ("2 ^ 3 ^ 2", 64.0), ("n % 3", 1.0), ("n % z", ERROR), ("1e308 * 10", ERROR),
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
    ('VALUE(" 12.5 ")', 12.5), ('VALUE("abc")', ERROR), ("VALUE(tb)", None),
    ("CAST(t AS int)", ERROR), ("CAST('42.9' AS int)", 42.0), ("CAST(n AS string)", "10"),
    ("CAST(2.345 AS decimal(5,2))", 2.35), ("CAST(flag AS int)", 1.0),
    # text
    ('t & "!"', "Hello World!"), ("tb & n", "10"), ("n / 4 & \"\"", "2.5"), ('flag & ""', "TRUE"),
    ('d & ""', "2026-01-31"), ('CONCAT(t, "-", n)', "Hello World-10"),
    ("CONCATENATE(tb, 1)", "1"), ("LEFT(t, 5)", "Hello"), ("LEFT(t)", "H"), ("LEFT(t, -1)", ERROR),
    ("RIGHT(t, 5)", "World"), ("RIGHT(t, 50)", "Hello World"), ("MID(t, 7, 3)", "Wor"),
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
    ("1e20 & \"\"", "1.0E20"), ("n * 1e18 & \"\"", "1.0E19"), ("MOD(1e20, 7)", 2.0),
    ("INT(-1e20)", -1e20), ("CEILING(1e300)", 1e300), ("MOD(-1e20, 7)", 5.0),
    # text constants are data, whatever they hold
    ("\"it's \\ `x` -- /* */ é\" & \"\"", "it's \\ `x` -- /* */ é"),
    ("'\"); DROP TABLE t; --'", "\"); DROP TABLE t; --"),
    # deep nesting (the limit is 64 levels) parses in Spark
    ("(" * 30 + "n" + " + 1)" * 30, 40.0), ("ABS(" * 60 + "-n" + ")" * 60, 10.0),
]  # fmt: skip


def test_every_function_has_a_meaning_case() -> None:
    used = {name for name in FUNCTIONS if any(f"{name}(" in case[0].upper() for case in CASES)}
    assert set(FUNCTIONS) - used <= {"SUM", "AVERAGE", "COUNT", "MIN", "MAX", "TODAY"} - used


@needs_spark
@pytest.mark.spark
def test_each_function_means_what_the_reference_says(spark: Any) -> None:  # noqa: F811
    from django_fairqueue.contrib.pipeline import compile as fc

    formulas = check(*(f"c{i} = {case[0]}" for i, case in enumerate(CASES)))
    schema = "n double, z int, b double, t string, tb string, d date, db date, flag boolean"
    df = spark.createDataFrame([tuple(ROW.values())], schema)
    out, outputs = fc.apply_formulas(df, formulas, today=TODAY, names={})
    errors = [o.error_column for o in outputs if o.error_column]
    row = out.select(*[o.name for o in outputs], *errors).collect()[0].asDict()

    wrong = []
    for i, (expression, want) in enumerate(CASES):
        error = row.get(f"{fc.ERROR_PREFIX}c{i}", False)
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

    from django_fairqueue.contrib.pipeline import compile as fc
    from django_fairqueue.contrib.pipeline import datastore

    rules = 130  # three words of flags
    rows = [[None if (r + k) % 11 == 0 else (r * 7 + k) % 3 == 0 for k in range(rules)]
            for r in range(40)]  # fmt: skip
    schema = ", ".join(f"f{k} boolean" for k in range(rules))
    df = spark.createDataFrame([tuple(row) for row in rows], schema)
    words = fc.packed_flags([f"f{k}" for k in range(rules)], datastore.ERROR_BITS)
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
    from django_fairqueue.contrib.pipeline import compile as fc

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
    values = fc.compute_aggregates(df, formulas, today=TODAY, max_groups=100)
    joined, names = fc.join_aggregates(spark, df, values, today=TODAY, formulas=formulas)
    out, _ = fc.apply_formulas(joined, formulas, today=TODAY, names=names)
    got = {r["id"]: r.asDict() for r in out.collect()}

    assert got[1]["share"] == 0.25 and got[2]["share"] == 0.75
    assert got[4]["share"] == 1.0  # a blank group is a group
    assert got[3]["share"] is None and got[3][f"{fc.ERROR_PREFIX}share"]  # 0 / 0 in group s
    assert {r["total"] for r in got.values()} == {45.0}
    assert got[3]["mean"] is None and got[3][f"{fc.ERROR_PREFIX}mean"]  # no value in group s
    assert got[1]["mean"] == 20.0
    assert {r["n"] for r in got.values()} == {4.0}  # blanks are not counted
    assert {r["lo"] for r in got.values()} == {0.0}
    assert got[2]["hi"] == 30.0
    assert [got[i]["rank"] for i in (1, 2, 5)] == ["low", "top", "low"]
    with pytest.raises(ValueError, match="more than 2 groups"):
        fc.compute_aggregates(df, formulas, today=TODAY, max_groups=2)


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

    from django_fairqueue.contrib.pipeline import execute

    json_rows(150)  # 3 batches per tenant
    plan("test.json", tenants=["alice"])
    running = batches.claim(worker_id="w", jobs=["test.json:*"], lease=timedelta(minutes=5))
    assert running is not None

    assert cancel("test.json") == {"alice": 2}
    assert not WorkBatch.objects.filter(job_name="test.json:alice", state="pending").exists()
    with pytest.raises(execute.JobCancelled):
        execute.execute_batch(spark, running)
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
    from django_fairqueue.contrib.pipeline import execute

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
    execute.aggregate_cache._values.clear()
    DataRow.objects.filter(tenant="alice").update(price=1000.0)
    run_all(spark)

    shares = sorted(r.results["share"] for r in JsonResultRow.objects.filter(tenant="alice"))
    done_first = [s for s in shares if s < 1000 / total / 2 - 1e-12]
    assert len(done_first) == 50  # the first batch: the prices as they were, over the total
    assert all(s == pytest.approx(1000.0 / (total * 2)) for s in shares[50:])

"""``fairpipeline bench`` (its tables' layout, its SQL baseline, that nothing stays behind) and
the atomic merge among interleaved keys that the benchmark's layout exercises."""

from __future__ import annotations

import datetime as dt
import itertools
from typing import Any

import pytest

from django_fairqueue.contrib.pipeline import bench, datastore
from django_fairqueue.contrib.pipeline.compile import AGG_PREFIX
from django_fairqueue.contrib.pipeline.compile_levels import (
    ERROR_PREFIX,
    RAW_PREFIX,
    Level,
    formula_levels,
)
from django_fairqueue.contrib.pipeline.execute import DATE, FLOAT, INT, STR
from django_fairqueue.contrib.pipeline.formulas import parse_formulas
from django_fairqueue.contrib.pipeline.models import PipelineJob
from django_fairqueue.contrib.pipeline.sqlexpr import bad_number, quoted
from django_fairqueue.models import Channel, WorkBatch
from tests.test_pipeline import needs_spark, spark, spark_settings  # noqa: F401 (fixtures)

TENANTS = ["t-a", "t-b", "t-c"]


def tenants_by_id(rows: int, *, contiguous: bool) -> list[str]:
    datastore.drop_table("default", bench.SOURCE)
    datastore.drop_table("default", bench.SINK)
    datastore.create_bench_tables("default", source=bench.SOURCE, sink=bench.SINK)
    try:
        datastore.fill_bench_source(
            "default", bench.SOURCE, 1, rows, rows=rows, tenants=TENANTS, contiguous=contiguous
        )
        from django.db import connection

        with connection.cursor() as cur:
            cur.execute(f"SELECT tenant FROM {bench.SOURCE} ORDER BY id")
            return [row[0] for row in cur.fetchall()]
    finally:
        datastore.drop_table("default", bench.SOURCE)
        datastore.drop_table("default", bench.SINK)


@pytest.mark.django_db(transaction=True)
def test_tenants_ids_interleave_by_default_and_run_contiguously_on_request() -> None:
    interleaved = tenants_by_id(3000, contiguous=False)
    assert sorted(set(interleaved)) == TENANTS
    for tenant in TENANTS:  # each tenant about a third of the rows, spread over the ids
        count = interleaved.count(tenant)
        assert 800 < count < 1200
        ids = [i for i, t in enumerate(interleaved) if t == tenant]
        assert ids[0] < 50 and ids[-1] > 2950
    switches = sum(a != b for a, b in itertools.pairwise(interleaved))
    assert switches > 1500  # not runs: neighbours mostly belong to different tenants

    contiguous = tenants_by_id(3000, contiguous=True)
    assert contiguous == ["t-a"] * 1000 + ["t-b"] * 1000 + ["t-c"] * 1000


def test_rules_have_a_formula_and_sql_each_and_tenants_differ() -> None:
    first, second = bench.tenant_rules(0, 12), bench.tenant_rules(1, 12)
    assert [r.name for r in first[:3]] == ["subtotal", "total", "band"]
    assert [r.name for r in first[3:]] == [f"r{k:03d}" for k in range(4, 13)]
    assert all(r.formula.startswith(f"{r.name} = ") and r.sql for r in first)
    assert [r.formula for r in first] != [r.formula for r in second]
    assert len(bench.tenant_rules(0, 200)) == 200
    expressions = bench.baseline_expressions(bench.tenant_rules(0, 120))
    assert list(expressions) == ["id", "tenant", "subtotal", "total", "band", "results"]
    # 117 results in jsonb_build_object calls of at most 50 keys (a function takes 100 args)
    assert expressions["results"].as_string(None).count("jsonb_build_object(") == 3


#: The benchmark source's columns, as the pipeline reads them.
BENCH_COLUMNS = {
    **dict.fromkeys(("id", "qty", "clicks", "impressions"), INT),
    **dict.fromkeys(("price", "discount", "tax_rate", "spend"), FLOAT),
    **dict.fromkeys(("tenant", "channel", "region"), STR),
    **dict.fromkeys(("first_on", "last_on"), DATE),
}


def test_realistic_rules_are_what_analysts_write_with_chains_twenty_deep() -> None:
    rules = bench.realistic_rules(0, 250)
    assert len(rules) == 250 and len({r.name for r in rules}) == 250
    assert all(r.formula.startswith(f"{r.name} = ") and r.sql for r in rules)
    text = "\n".join(r.formula for r in rules)
    used = ["IF(", "IFERROR(", "ISBLANK(", "COALESCE(", '" & ', "UPPER(", "LEFT(", "DAYS("]
    used += ["MONTH(", "YEAR(", " / ", "SUM(spend)", "AVERAGE(spend BY channel)", "ROUND("]
    assert [u for u in used if u not in text] == []
    assert [r.formula for r in rules] != [r.formula for r in bench.realistic_rules(1, 250)]
    assert bench.rule_set("simple", 0, 12) == bench.tenant_rules(0, 12)
    with pytest.raises(ValueError, match="unknown kind of rules"):
        bench.rule_set("tricky", 0, 12)

    formulas = parse_formulas("t", [r.formula for r in rules], columns=BENCH_COLUMNS, targets=None)
    assert len(formulas.aggregates) == 2  # SUM(spend) and AVERAGE(spend BY channel), shared
    levels, outputs = formula_levels(formulas, today=dt.date(2026, 11, 29), names={
        AGG_PREFIX + node.key(): ("1.0D", None) for node in formulas.aggregates
    })  # fmt: skip
    assert len(outputs) == 250
    # Two chains of 20 rules each using the one before (r084..r103, r184..r203): as many
    # levels as the longest chain, the chains side by side; the levels before the last hold
    # only the rules used later (the chains and the typed rule ``total``).
    by_name = {r.name: r for r in rules}
    assert "r102" in by_name["r103"].formula and "r083" not in by_name["r084"].formula
    assert len(levels) == bench.CHAIN_DEPTH
    assert {"r084", "r184"} <= rules_in(levels[0])  # both chains start in the first level
    assert {"r103", "r203"} <= rules_in(levels[-1])
    assert set().union(*map(rules_in, levels[:-1])) == {
        *(f"r{k:03d}" for k in (*range(84, 103), *range(184, 203))),
        *("subtotal", "total"),
    }


def rules_in(level: Level) -> set[str]:
    """The rules a level computes (a rule that can have errors has an error column too; in
    the last level, a raw value and error, blanked in the level's ``finish``)."""
    names = {name.removeprefix(RAW_PREFIX) for name in (*level.computed, *level.finish)}
    return {name.removeprefix(ERROR_PREFIX) for name in names}


def test_a_rule_used_goes_in_the_level_after_the_deepest_it_uses_the_others_last() -> None:
    formulas = parse_formulas(
        "t",
        ["a = qty + 1", "b = a * 2", "c = qty * 3", "d = c + b", "e = price - 1", "f = a / e"],
        columns=BENCH_COLUMNS,
        targets=None,
    )
    levels, _ = formula_levels(formulas, today=dt.date(2026, 11, 29), names={})
    assert [sorted(rules_in(level)) for level in levels] == [["a", "c", "e"], ["b"], ["d", "f"]]


def test_a_last_level_number_is_checked_for_overflow_once_by_name() -> None:
    formulas = parse_formulas(
        "t",
        ["a = IFERROR(price / qty, 2) * price", "b = (price / qty) * 2", "c = price / qty"],
        columns=BENCH_COLUMNS,
        targets=None,
    )
    [level], _ = formula_levels(formulas, today=dt.date(2026, 11, 29), names={})
    raw = {name.removeprefix(RAW_PREFIX): text for name, text in level.computed.items()}
    # A product's own check would repeat its value: the finish checks it, by name.
    assert "Infinity" not in raw["a"] and ERROR_PREFIX + "a" not in raw
    assert raw[ERROR_PREFIX + "b"] == "((coalesce(CAST(`qty` AS double), 0.0D) = (0)))"
    assert "Infinity" not in raw[ERROR_PREFIX + "c"]
    for name in "abc":
        checked = bad_number(quoted(RAW_PREFIX + name))
        assert checked in level.finish[ERROR_PREFIX + name]


@needs_spark
@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_benchmark_agrees_with_sql_and_leaves_nothing_behind(
    spark: Any,  # noqa: F811
    spark_settings: None,  # noqa: F811
) -> None:
    Channel.objects.create(name="existing")
    said: list[str] = []

    result = bench.run(600, using="default", tenants=3, rules=8, direct=True, say=said.append)

    assert result.results_match
    assert result.interleaved
    assert (result.rows, result.tenants, result.rules) == (600, 3, 8)
    assert result.batches == 3  # one per tenant
    assert result.sql_serial_seconds is not None and result.sql_parallel_seconds is not None
    assert result.sql_seconds == min(result.sql_serial_seconds, result.sql_parallel_seconds)
    assert result.spark_db_cpu_us_per_row is not None  # the test database runs on this machine
    assert result.sql_db_cpu_us_per_row is not None
    assert result.merge_seconds > 0 and result.spark_phase_seconds > 0
    assert any("interleaved" in line for line in said)
    # Nothing of the run stays: jobs, batches, channels, tables.
    assert not WorkBatch.objects.exists()
    assert not PipelineJob.objects.exists()
    assert list(Channel.objects.values_list("name", flat=True)) == ["existing"]
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT to_regclass(%s), to_regclass(%s)", [bench.SOURCE, bench.SINK])
        assert cur.fetchone() == (None, None)


@needs_spark
@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_realistic_rules_agree_with_their_sql_twins(
    spark: Any,  # noqa: F811
    spark_settings: None,  # noqa: F811
) -> None:
    # 12 rules: every kind but the chains (blanks, division by zero, text, dates, aggregates)
    result = bench.run(
        400, using="default", tenants=2, rules=12, rules_kind="realistic", direct=False,
        sql_connections=[1], say=lambda text: None,
    )  # fmt: skip
    assert result.results_match
    assert result.rules_kind == "realistic"
    assert bench.checked_results("realistic", 12) == ["r004", "r005", "r006", "r010", "r012"]
    assert bench.checked_results("realistic", 250)[-1] == "r103"  # the first chain's end
    assert bench.checked_results("simple", 250) == list(bench.CHECKED_RESULTS)


COLUMNS = ["id", "tenant", "subtotal", "total", "band"]


def stage(rows: list[tuple[int, str, float]]) -> str:
    """A staging table of the test sink holding ``rows`` (id, tenant, total)."""
    from django.db import connection

    from tests.pipelineapp.models import ResultRow

    staging = "fq_stage_7_" + "0" * 32
    datastore.create_staging(
        "default", staging=staging, sink=ResultRow._meta.db_table, columns=COLUMNS
    )
    with connection.cursor() as cur:
        for key, tenant, total in rows:
            cur.execute(
                f'INSERT INTO "{staging}" (fq_part, id, tenant, total) VALUES (0, %s, %s, %s)',
                [key, tenant, total],
            )
    return staging


@pytest.mark.django_db(transaction=True)
def test_a_merge_among_other_tenants_keys_inserts_and_a_rerun_upserts_without_duplicates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django.db import transaction

    from tests.pipelineapp.models import ResultRow

    used: list[str] = []
    compose = datastore.compose

    def recording(name: str, **parts: Any) -> Any:
        used.append(name)
        return compose(name, **parts)

    monkeypatch.setattr(datastore, "compose", recording)

    sink = ResultRow._meta.db_table
    # Another tenant's rows interleave with the batch's keys (even ids), so the batch's key range
    # is not empty: the plain INSERT is tried under a savepoint and succeeds.
    ResultRow.objects.bulk_create(
        ResultRow(id=i, tenant="other", total=-1) for i in range(1, 20, 2)
    )
    staging = stage([(i, "mine", float(i)) for i in range(2, 20, 2)])
    with transaction.atomic():
        changed = datastore.merge_staging(
            "default", staging=staging, sink=sink, key=["id"], columns=COLUMNS, key_range=(2, 18)
        )
        assert changed == 9
        ResultRow.objects.filter(id=1).update(band="same transaction")  # still usable
    assert "insert_staging" in used and "merge_staging" not in used  # no ON CONFLICT work
    assert ResultRow.objects.filter(tenant="mine").count() == 9
    assert ResultRow.objects.get(id=1).band == "same transaction"
    datastore.drop_staging("default", staging)

    # A re-run with one value changed: the INSERT hits a key already there and rolls back to
    # the savepoint; the upsert writes the one changed row, and no key is duplicated.
    staging = stage([(i, "mine", float(i) + (100 if i == 4 else 0)) for i in range(2, 20, 2)])
    used.clear()
    with transaction.atomic():
        changed = datastore.merge_staging(
            "default", staging=staging, sink=sink, key=["id"], columns=COLUMNS, key_range=(2, 18)
        )
    assert changed == 1
    assert used[-2:] == ["insert_staging", "merge_staging"]
    assert ResultRow.objects.count() == 19
    assert ResultRow.objects.get(id=4).total == 104.0
    assert sorted(
        ResultRow.objects.filter(tenant="mine").values_list("total", flat=True)
    ) == sorted([float(i) for i in range(2, 20, 2) if i != 4] + [104.0])
    assert ResultRow.objects.filter(tenant="other").count() == 10
    datastore.drop_staging("default", staging)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--master", "spark://"], "names no host"),
        (["--partitions", "0"], "--partitions must be at least 1"),
        (["--conf", "spark.executor.memory"], "--conf takes KEY=VALUE"),
        (["--conf", "=1g"], "--conf takes KEY=VALUE"),
    ],
)
@needs_spark
@pytest.mark.django_db(transaction=True)
def test_bench_refuses_bad_spark_options_before_it_builds_anything(
    args: list[str], message: str
) -> None:
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match=message):
        call_command("fairpipeline", "bench", "--rows", "20", "--tenants", "2", *args)
    from django.db import connection

    with connection.cursor() as cur:  # it stopped before creating its tables
        cur.execute("SELECT to_regclass(%s)", [bench.SOURCE])
        assert cur.fetchone() == (None,)
    assert not WorkBatch.objects.exists()


def test_spark_overrides_replace_the_settings_entries_for_the_run_only(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django_fairqueue.contrib.pipeline import spark as spark_module

    monkeypatch.setattr(spark_module, "_session", None)  # no session yet in this process

    settings.FAIRQUEUE_PIPELINE = {
        "SPARK": {"MASTER": "local[1]", "CONF": {"spark.executor.memory": "1g"}}
    }
    with bench.spark_overrides("local[2]", 3, {"spark.driver.memory": "2g"}):
        inside = spark_module.spark_settings()
    outside = spark_module.spark_settings()
    assert (inside.master, inside.partitions) == ("local[2]", 3)
    assert inside.conf == {"spark.executor.memory": "1g", "spark.driver.memory": "2g"}
    assert (outside.master, outside.partitions) == ("local[1]", None)
    assert outside.conf == {"spark.executor.memory": "1g"}
    with pytest.raises(ValueError, match="PARTITIONS"), bench.spark_overrides(partitions=-1):
        pass


@needs_spark
@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_bench_on_another_master_than_the_running_session_is_refused(
    spark: Any,  # noqa: F811
    spark_settings: None,  # noqa: F811
) -> None:
    with pytest.raises(ValueError, match="already runs a Spark session on local\\[1\\]"):
        bench.run(20, using="default", tenants=2, master="local[2]")
    # The session's own master is accepted, and the result says where the tasks ran.
    result = bench.run(
        40, using="default", tenants=2, rules=4, direct=False, master="local[1]",
        sql_connections=[1],
    )  # fmt: skip
    assert result.results_match
    assert (result.master, result.executors, result.executors_measured) == ("local[1]", 0, 0)
    assert [t[0] for t in result.batch_timings] and sum(t[0] for t in result.batch_timings) == 40
    assert all(total >= spark_phase >= 0 for _, total, spark_phase, _ in result.batch_timings)
    # One runner: each batch's Spark CPU (the JVM runs here), and the warm-up's before them.
    assert len(result.batch_cpu_seconds) == len(result.batch_timings)
    assert all(c is not None and c > 0 for c in result.batch_cpu_seconds)
    assert result.warmup_cpu_seconds is not None and result.warmup_cpu_seconds > 0


def test_the_report_shows_each_batchs_cpu_and_the_warm_up() -> None:
    from django_fairqueue.contrib.pipeline.management.commands.fairpipeline import Command

    result = bench.BenchResult(
        rows=10_000, tenants=3, rules=250, rules_kind="realistic", interleaved=True, batches=3,
        sql_serial_seconds=4.9, sql_parallel_seconds=None, sql_seconds=4.9, spark_seconds=30.0,
        direct_seconds=None, sql_rows_per_second=2040, spark_rows_per_second=333,
        direct_rows_per_second=None, ratio=6.12, direct_ratio=None, plan_seconds=0.8,
        spark_phase_seconds=28.0, merge_seconds=0.3, sql_db_cpu_us_per_row=490.0,
        spark_db_cpu_us_per_row=280.0, direct_db_cpu_us_per_row=None,
        spark_cpu_us_per_row=2600.0, results_match=True, driver_peak_rss_mb=160,
        jvm_peak_rss_mb=1000, python_workers_peak_rss_mb=90,
        batch_cpu_seconds=[9.94, 7.67, 7.16], warmup_cpu_seconds=48.6,
    )  # fmt: skip
    report = Command._bench_report(result)
    assert "CPU per batch, in run order: 9.9, 7.7, 7.2 s" in report
    assert "the warm-up before: 48.6 s" in report
    # Several runners overlap their batches: no per-batch line.
    assert "per batch" not in Command._bench_report(
        bench.BenchResult(**{**result.as_dict(), "batch_cpu_seconds": [], "runners": 2})
    )

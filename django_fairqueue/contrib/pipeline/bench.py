"""``manage.py fairpipeline bench``: the Spark pipeline against the same formulas in SQL.

For each row count: scratch source and sink tables (UNLOGGED, dropped afterwards) with two
tenants' rows (alice: the first half of the ids, bob: the rest) and different formulas; the
source gets the ``(tenant, id)`` index the how-to asks for and a ``VACUUM ANALYZE``. Then,
on a warm SparkSession:

* **SQL baseline**: each tenant's formulas as one ``INSERT ... SELECT ... ON CONFLICT``,
  computed by PostgreSQL in one process;
* **Spark pipeline, atomic sink** (the default): the same formulas through planned work
  batches, claimed, read by Spark tasks (COPY -> Arrow), transformed, staged and merged under
  the fence, as a worker runs them;
* **Spark pipeline, ``Sink(atomic=False)``**: the same, but each Spark task writes its rows
  into the sink in its own lease-fenced transaction.

Each starts from an empty sink; their results are compared with the baseline's.
"""

from __future__ import annotations

import os
import resource
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from django_fairqueue.contrib.pipeline import datastore
from django_fairqueue.contrib.pipeline.core import Pipeline, Sink, Source, registry
from django_fairqueue.contrib.pipeline.spark import get_session, jvm_peak_rss_bytes

SOURCE = "fq_bench_pipeline_source"
SINK = "fq_bench_pipeline_sink"
FORMULAS = {
    "alice": [
        "subtotal = price * qty",
        "total = round(subtotal * (1 - discount) * (1 + tax_rate), 2)",
        "band = CASE WHEN total >= 500 THEN 'high' WHEN total >= 100 THEN 'mid' ELSE 'low' END",
    ],
    "bob": [
        "subtotal = price * qty - discount * price",
        "total = greatest(subtotal, 0) * (1 + tax_rate) + 4.95",
        "band = CASE WHEN qty > 10 THEN 'bulk' ELSE 'retail' END",
    ],
}


def _baseline(tenant: str) -> dict[str, Any]:
    """The tenant's formulas written by hand in PostgreSQL's SQL (the data has no blanks, so
    the spreadsheet rules about blanks and errors do not come into it)."""
    from psycopg import sql

    if tenant == "alice":
        subtotal = "(price * qty)"
        total = f"round(({subtotal} * (1 - discount) * (1 + tax_rate))::text::numeric, 2)::float8"
        band = f"CASE WHEN {total} >= 500 THEN 'high' WHEN {total} >= 100 THEN 'mid' ELSE 'low' END"
    else:
        subtotal = "(price * qty - discount * price)"
        total = f"(greatest({subtotal}, 0) * (1 + tax_rate) + 4.95)"
        band = "CASE WHEN qty > 10 THEN 'bulk' ELSE 'retail' END"
    return {"subtotal": sql.SQL(subtotal), "total": sql.SQL(total), "band": sql.SQL(band)}


@dataclass
class BenchResult:
    rows: int
    batches: int  # per Spark run
    sql_seconds: float
    spark_seconds: float  # atomic sink
    direct_seconds: float  # Sink(atomic=False)
    sql_rows_per_second: float
    spark_rows_per_second: float
    direct_rows_per_second: float
    ratio: float  # atomic seconds / sql seconds
    direct_ratio: float  # atomic=False seconds / sql seconds
    results_match: bool  # both Spark runs wrote what the baseline wrote
    driver_peak_rss_mb: float
    jvm_peak_rss_mb: float
    python_workers_peak_rss_mb: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _workers_rss_bytes() -> int:
    """Resident memory of the Python processes Spark started (children of the JVM)."""
    jvm = _jvm_pid()
    if jvm is None:
        return 0
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != jvm:  # ppid
                continue
            with open(f"/proc/{entry}/status", encoding="ascii") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


def _jvm_pid() -> int | None:
    from django_fairqueue.contrib.pipeline import spark

    session = spark._session
    if session is None:
        return None
    try:
        return int(session.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
    except Exception:
        return None


def _bench_pipeline(name: str, batch_size: int, using: str, *, atomic: bool = True) -> Pipeline:
    return Pipeline(
        name=name,
        source=Source(
            SOURCE,
            columns=["id", "tenant", "price", "qty", "discount", "tax_rate"],
            tenant_column="tenant",
        ),
        sink=Sink(SINK, key=["id"], columns=["tenant", "subtotal", "total", "band"], atomic=atomic),
        formulas=FORMULAS.__getitem__,
        tenants=list(FORMULAS),
        batch_size=batch_size,
        database=using,
    )


def _forget_jobs(using: str, name: str) -> None:
    """Delete the benchmark's jobs and work batches: they must not stay in the admin."""
    from django_fairqueue.contrib.pipeline.models import PipelineJob
    from django_fairqueue.models import WorkBatch

    WorkBatch.objects.using(using).filter(job_name__startswith=name).delete()
    PipelineJob.objects.using(using).filter(pipeline__startswith=name).delete()


def _checksum(using: str) -> tuple[int, float]:
    return datastore.checksum(using, SINK, "total")


def run(
    rows: int,
    *,
    using: str,
    batch_size: int | None = None,
    say: Callable[[str], None] = print,
) -> BenchResult:
    from django_fairqueue.contrib.pipeline.runner import PipelineRunner, plan

    spark = get_session()
    half = rows // 2
    datastore.drop_table(using, SOURCE)
    datastore.drop_table(using, SINK)
    datastore.create_bench_tables(using, source=SOURCE, sink=SINK)
    try:
        say(f"{rows:,} rows: generating the source table")
        step = 1_000_000
        for lo in range(1, rows + 1, step):
            datastore.fill_bench_source(using, SOURCE, lo, min(rows, lo + step - 1), half)
        datastore.index_bench_source(using, SOURCE)
        datastore.vacuum_analyze(using, SOURCE)

        name = f"fqbench-{uuid.uuid4().hex[:8]}"
        size = batch_size or max(half, 1)
        pipeline = registry.register(_bench_pipeline(name, size, using))
        direct = registry.register(_bench_pipeline(f"{name}-direct", size, using, atomic=False))
        try:
            # Warm up: the first job of a session costs seconds more than later ones.
            for atomic in (True, False):
                warm = registry.register(
                    _bench_pipeline(f"{name}-warm{int(atomic)}", 5_000, using, atomic=atomic)
                )
                plan(warm.name)
                PipelineRunner(
                    worker_id=f"bench:{os.getpid()}", pipelines=[warm.name], burst=True,
                    max_batches=2, spark=spark,
                ).run()  # fmt: skip
                registry.unregister(warm.name)
            datastore.truncate(using, SINK)

            say(f"{rows:,} rows: SQL baseline (one INSERT ... SELECT per tenant)")
            started = time.monotonic()
            for tenant in FORMULAS:
                from psycopg import sql

                expressions = _baseline(tenant)
                columns = {"id": sql.Identifier("id"), "tenant": sql.Identifier("tenant")}
                datastore.upsert_with_sql(
                    using,
                    source=SOURCE,
                    id_column="id",
                    lo=1,
                    hi=rows,
                    tenant_column="tenant",
                    tenant=tenant,
                    sink=SINK,
                    key=["id"],
                    expressions={**columns, **expressions},
                )
            sql_seconds = time.monotonic() - started
            expected = _checksum(using)
            datastore.truncate(using, SINK)

            def run_spark(chosen: Pipeline) -> tuple[float, int, bool]:
                datastore.truncate(using, SINK)
                started = time.monotonic()
                planned = plan(chosen.name).planned
                say(f"{rows:,} rows: planned in {time.monotonic() - started:.1f} s")
                runner = PipelineRunner(
                    worker_id=f"bench:{os.getpid()}", pipelines=[chosen.name], burst=True,
                    spark=spark,
                )  # fmt: skip
                stats = runner.run()
                seconds = time.monotonic() - started
                if stats.failed or stats.lost:
                    raise RuntimeError(f"benchmark batches failed: {stats}")
                got = _checksum(using)
                match = got[0] == expected[0] == rows and abs(got[1] - expected[1]) <= 1e-6 * max(
                    1.0, abs(expected[1])
                )
                return seconds, sum(p.created for p in planned), match

            say(f"{rows:,} rows: Spark pipeline, atomic sink (Spark, staging, fenced merge)")
            spark_seconds, planned, atomic_match = run_spark(pipeline)
            say(f"{rows:,} rows: Spark pipeline, Sink(atomic=False) (tasks write, fenced)")
            direct_seconds, _, direct_match = run_spark(direct)
        finally:
            registry.unregister(name)
            registry.unregister(direct.name)
            _forget_jobs(using, name)
        return BenchResult(
            rows=rows,
            batches=planned,
            sql_seconds=round(sql_seconds, 2),
            spark_seconds=round(spark_seconds, 2),
            direct_seconds=round(direct_seconds, 2),
            sql_rows_per_second=round(rows / sql_seconds),
            spark_rows_per_second=round(rows / spark_seconds),
            direct_rows_per_second=round(rows / direct_seconds),
            ratio=round(spark_seconds / sql_seconds, 2),
            direct_ratio=round(direct_seconds / sql_seconds, 2),
            results_match=atomic_match and direct_match,
            driver_peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            jvm_peak_rss_mb=round(jvm_peak_rss_bytes() / 2**20),
            python_workers_peak_rss_mb=round(_workers_rss_bytes() / 2**20),
        )
    finally:
        datastore.drop_table(using, SOURCE)
        datastore.drop_table(using, SINK)

"""Work-batch benchmark: planning speed and claim latency as jobs and tenants grow.

    python3 dev.py bench-batches            # or: .venv/bin/python -m benchmarks.batches
    .venv/bin/python -m benchmarks.batches --rows 10000000 --tenants 10 1000

Runs on a database of its own (``fairqueue_bench_batches`` on the embedded server, or
``DATABASE_URL``), which it empties first. Prints:

* planning: rows/s walking a source table's id index into batches of 100,000 and of 1,000 rows;
* claim latency (p50/p95 of ``batches.claim``) with few and with many tenants holding pending
  batches, and the same with every tenant capped at one running batch (claims fill every
  tenant to its cap; the last, empty one walks past all of them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta


def setup() -> None:
    import django
    import environ
    from django.conf import settings

    from django_fairqueue import devdb

    url = os.environ.get("DATABASE_URL") or devdb.database_url("fairqueue_bench_batches")
    settings.configure(
        DATABASES={"default": environ.Env.db_url_config(url)},
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_fairqueue"],
        USE_TZ=True,
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
    )
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000, help="source rows (2,000,000)")
    parser.add_argument(
        "--tenants", type=int, nargs="+", default=[10, 1000], help="tenant counts (10 1000)"
    )
    parser.add_argument("--batches-per-tenant", type=int, default=100)
    parser.add_argument("--claims", type=int, default=300)
    args = parser.parse_args(argv)
    setup()
    from django.db import connection

    from django_fairqueue import batches

    def sql(*statements: str) -> None:
        with connection.cursor() as cur:
            for statement in statements:
                cur.execute(statement)

    def reset() -> None:
        sql("TRUNCATE fairqueue_work_batch, fairqueue_channel RESTART IDENTITY")

    print(f"server: {connection.pg_version}; source rows: {args.rows:,}", flush=True)
    reset()
    sql(
        "DROP TABLE IF EXISTS bench_source",
        "CREATE TABLE bench_source (id bigint PRIMARY KEY, tenant integer NOT NULL)",
        f"INSERT INTO bench_source SELECT g * 3, g % 1000 FROM generate_series(1, {args.rows}) g",
        "CREATE INDEX ON bench_source (tenant, id)",
    )
    connection.ensure_connection()
    connection.connection.autocommit = True  # VACUUM needs it; Django's default already is
    sql("VACUUM ANALYZE bench_source")

    for size in (100_000, 1_000):
        started = time.perf_counter()
        result = batches.plan(
            f"plan-{size}", channel="planner", table="bench_source", batch_size=size
        )
        seconds = time.perf_counter() - started
        print(
            f"plan {args.rows:,} rows into batches of {size:,}: {result.created:,} batches in "
            f"{seconds:.2f} s = {args.rows / seconds:,.0f} rows/s",
            flush=True,
        )

    lease = timedelta(minutes=5)
    for tenants in args.tenants:
        reset()
        per = args.batches_per_tenant
        for t in range(tenants):
            # every tenant's ids are 0..per*10 apart: plan over a slice of the shared table
            batches.plan(
                f"job-{t}",
                channel=f"tenant-{t:05d}",
                table="bench_source",
                batch_size=max(1, args.rows // 1000 // per),
                filters={"tenant": t % 1000},
            )
        sql("ANALYZE fairqueue_work_batch, fairqueue_channel")
        pending = tenants * per
        for capped in (False, True):
            if capped:
                # give the uncapped run's batches back, then cap every tenant at one: each
                # claim takes a tenant to its cap, and the last ones walk past capped tenants
                sql(
                    "UPDATE fairqueue_work_batch SET state = 'pending', lease_token = NULL, "
                    "lease_expires_at = NULL WHERE state = 'running'",
                    "UPDATE fairqueue_channel SET max_concurrency = 1, batch_pending = true",
                )
            samples = []
            for _ in range(args.claims):
                started = time.perf_counter()
                batch = batches.claim(worker_id="bench", lease=lease)
                samples.append((time.perf_counter() - started) * 1000)
                if batch is None:
                    break
            samples.sort()
            p50 = statistics.median(samples)
            p95 = samples[int(len(samples) * 0.95) - 1]
            label = "every tenant capped at 1" if capped else "uncapped"
            print(
                f"claim with {tenants:,} tenants x {per} batches ({pending:,} pending), {label}: "
                f"p50 {p50:.2f} ms, p95 {p95:.2f} ms over {len(samples)} claims",
                flush=True,
            )
    sql("DROP TABLE bench_source")


if __name__ == "__main__":
    sys.exit(main())

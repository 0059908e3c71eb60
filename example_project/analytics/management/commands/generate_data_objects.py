"""``manage.py generate_data_objects [--rows N]``: seed 002's data, fast (INSERT ... SELECT
generate_series), with two tenants and their formulas."""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import connection, transaction

from analytics.models import DataObject, TenantFormula

FORMULAS = {
    "acme": [
        ("subtotal", "price * qty"),
        ("total", "round(subtotal * (1 - discount) * (1 + tax_rate), 2)"),
        ("band", "CASE WHEN total >= 500 THEN 'high' WHEN total >= 100 THEN 'mid' ELSE 'low' END"),
    ],
    "globex": [
        ("subtotal", "price * qty - discount * price"),
        ("total", "greatest(subtotal, 0) * (1 + tax_rate) + 4.95"),
        ("band", "CASE WHEN qty > 10 THEN 'bulk' ELSE 'retail' END"),
    ],
}

# The example project is user code: its own SQL lives here, not in django_fairqueue.
GENERATE = """
INSERT INTO data_objects (tenant, price, qty, discount, tax_rate)
SELECT CASE WHEN g %% 4 = 0 THEN 'globex' ELSE 'acme' END,
       -- bigint: g * 7919 passes the integer range from g = 271,184 on
       round((1 + (g::bigint * 7919 %% 100000) / 100.0)::numeric, 2)::double precision,
       1 + g %% 17,
       (g %% 5) * 0.05,
       CASE WHEN g %% 3 = 0 THEN 0.2 ELSE 0.07 END
FROM generate_series(1, %s) AS g
"""


class Command(BaseCommand):
    help = "Add N data objects (default 1,000,000) for two tenants, and their formulas."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--rows", type=int, default=1_000_000)

    def handle(self, *args: Any, **options: Any) -> None:
        started = time.monotonic()
        with transaction.atomic():
            for tenant, formulas in FORMULAS.items():
                for position, (target, expression) in enumerate(formulas):
                    TenantFormula.objects.update_or_create(
                        tenant=tenant,
                        target=target,
                        defaults={"position": position, "expression": expression},
                    )
            with connection.cursor() as cursor:
                cursor.execute(GENERATE, [options["rows"]])
                cursor.execute("ANALYZE data_objects")
        self.stdout.write(
            f"{options['rows']:,} data objects added in {time.monotonic() - started:.1f} s "
            f"({DataObject.objects.count():,} in all). Next: manage.py fairpipeline plan "
            "analytics.enrich, then manage.py fairpipeline run (or runfairworker --pipelines)."
        )

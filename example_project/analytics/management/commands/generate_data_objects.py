"""``manage.py generate_data_objects [--rows N]``: data objects, fast (INSERT ... SELECT
generate_series), for three tenants and their formulas: acme and globex with a few rules,
initech with 200 (conditions, text, dates, a tenant aggregate; most go to the JSON results)."""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import connection, transaction

from analytics.models import DataObject, TenantFormula


def many_rules(count: int = 200) -> list[tuple[str, str]]:
    """A tenant with ``count`` rules of every kind."""
    rules = [
        ("subtotal", "price * qty"),
        ("total", "ROUND(subtotal * (1 - discount) * (1 + tax_rate), 2)"),
        ("band", 'IFS(total >= 500, "high", total >= 100, "mid", TRUE, "low")'),
        ("region_share", "total / SUM(total BY region)"),
        ("region_average", "AVERAGE(total BY region)"),
        ("above_average", "total > region_average"),
        ("label", 'UPPER(LEFT(region, 1)) & "-" & id'),
        ("age_days", "TODAY() - ordered_on"),
        ("order_month", "MONTH(ordered_on)"),
        ("unit_price", "IFERROR(total / qty, 0)"),
    ]
    for i in range(len(rules), count):
        name = f"r{i:03d}"
        match i % 5:
            case 0:
                expression = f"ROUND(price * {1 + i % 7} + qty * {i % 11}, 2)"
            case 1:
                expression = f'IF(qty > {i % 17}, "over {i % 17}", "at most {i % 17}")'
            case 2:
                expression = f'LEFT(region, {1 + i % 4}) & "/" & YEAR(ordered_on + {i})'
            case 3:
                expression = f'DATEDIF(ordered_on, TODAY(), "M") + {i}'
            case _:
                expression = f"price / (qty - {1 + i % 17})"  # some rows divide by zero
        rules.append((name, expression))
    return rules


FORMULAS = {
    "acme": [
        ("subtotal", "price * qty"),
        ("total", "ROUND(subtotal * (1 - discount) * (1 + tax_rate), 2)"),
        ("band", 'IFS(total >= 500, "high", total >= 100, "mid", TRUE, "low")'),
        ("region_share", "total / SUM(total BY region)"),
    ],
    "globex": [
        ("subtotal", "price * qty - discount * price"),
        ("total", "MAX(subtotal, 0) * (1 + tax_rate) + 4.95"),
        ("band", 'IF(qty > 10, "bulk", "retail")'),
    ],
    "initech": many_rules(200),
}

# The example project is user code: its own SQL lives here, not in django_fairqueue.
GENERATE = """
INSERT INTO data_objects (tenant, price, qty, discount, tax_rate, region, ordered_on)
SELECT CASE WHEN g %% 4 = 0 THEN 'globex' WHEN g %% 4 = 1 THEN 'initech' ELSE 'acme' END,
       -- bigint: g * 7919 passes the integer range from g = 271,184 on
       round((1 + (g::bigint * 7919 %% 100000) / 100.0)::numeric, 2)::double precision,
       1 + g %% 17,
       (g %% 5) * 0.05,
       CASE WHEN g %% 3 = 0 THEN 0.2 ELSE 0.07 END,
       (ARRAY['north', 'south', 'east', 'west'])[1 + g %% 7 %% 4],
       date '2025-01-01' + (g %% 700)
FROM generate_series(1, %s) AS g
"""


class Command(BaseCommand):
    help = "Add N data objects (default 1,000,000) for three tenants, and their formulas."

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

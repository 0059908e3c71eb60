"""The example's pipeline: each tenant's formulas (TenantFormula rows) over data_objects."""

from __future__ import annotations

from django_fairqueue.contrib.pipeline import LongSink, Sink, Source, pipeline

from .models import DataObject, DataResult, DataResultLong, TenantFormula


def tenants() -> list[str]:
    return list(TenantFormula.objects.values_list("tenant", flat=True).distinct())


@pipeline(
    name="analytics.enrich",
    source=Source(
        DataObject,
        columns=["id", "tenant", "price", "qty", "discount", "tax_rate", "region", "ordered_on"],
        tenant_column="tenant",
        changed_column="updated_at",  # recompute: only rows changed since the last run
    ),
    # Rules named subtotal, total or band go to those columns; every other rule to `results`.
    sink=Sink(
        DataResult,
        key=["id"],
        columns=["tenant", "subtotal", "total", "band"],
        results="results",
    ),
    # Or, per job (plan --output long): one row per data object and rule.
    long_sink=LongSink(DataResultLong, number_column="number", columns=["tenant"]),
    tenants=tenants,
    batch_size=250_000,
)
def formulas(tenant: str) -> list[tuple[str, str]]:
    return list(
        TenantFormula.objects.filter(tenant=tenant)
        .order_by("position")
        .values_list("target", "expression")
    )

"""The tests' pipeline: formulas per tenant from FORMULAS (tests change it)."""

from __future__ import annotations

from django_fairqueue.contrib.pipeline import LongSink, Lookup, Sink, Source, pipeline
from tests.pipelineapp.models import (
    DataRow,
    JsonResultRow,
    LongResultRow,
    PriceRow,
    ResultRow,
    StrictResultRow,
)

FORMULAS: dict[str, list[str]] = {
    "alice": [
        "subtotal = price * qty",
        "total = round(subtotal * (1 - discount), 2)",
        "band = CASE WHEN total >= 100 THEN 'high' WHEN note IS NULL THEN 'none' ELSE note END",
    ],
    "bob": [
        "subtotal = price * qty - discount",
        "total = greatest(subtotal, 0) / 3 + 1.5",
        "band = upper(coalesce(note, 'n/a'))",
    ],
}


@pipeline(
    name="test.enrich",
    source=Source(
        DataRow,
        columns=["id", "tenant", "price", "qty", "discount", "note"],
        tenant_column="tenant",
    ),
    sink=Sink(ResultRow, key=["id"], columns=["tenant", "subtotal", "total", "band"]),
    tenants=lambda: sorted(FORMULAS),
    batch_size=100,
)
def formulas(tenant: str) -> list[str]:
    return FORMULAS[tenant]


#: The JSON-sink pipeline's rules (tests change them).
JSON_FORMULAS: dict[str, list[str]] = {
    "alice": [
        "_gross = price * qty",
        "net = ROUND(_gross * (1 - discount), 2)",
        "share = net / SUM(net BY note)",
        "unit = price / (qty - 3)",
        'label = UPPER(LEFT(COALESCE(note, "none"), 2)) & "-" & id',
        'size = IF(qty > 3, "big", "small")',
        "age = DAYS(TODAY(), ordered_on)",
        "month = MONTH(ordered_on)",
    ],
    "bob": ["double = price * 2"],
}


@pipeline(
    name="test.json",
    source=Source(
        DataRow,
        columns=["id", "tenant", "price", "qty", "discount", "note", "ordered_on"],
        tenant_column="tenant",
        changed_column="version",
    ),
    sink=Sink(JsonResultRow, key=["id"], columns=["tenant"], results="results"),
    long_sink=LongSink(
        LongResultRow, number_column="number", text_column="text", columns=["tenant"]
    ),
    tenants=lambda: sorted(JSON_FORMULAS),
    batch_size=50,
)
def json_formulas(tenant: str) -> list[str]:
    return JSON_FORMULAS[tenant]


#: The NOT NULL sink's rules (tests change them); its tenants' time zones.
STRICT_FORMULAS: dict[str, list[str]] = {
    "alice": [
        'band = IF(price > 5, "big")',
        "total = price / (qty - 3)",
        "due = IF(qty > 3, DATE(2026, 1, 1))",
        'stamp = TEXT(NOW(), "yyyy-mm-dd hh:mm") & " " & TODAY()',
    ],
}
STRICT_ZONES = {"alice": "Pacific/Kiritimati"}  # UTC+14: its date is often not UTC's


@pipeline(
    name="test.strict",
    source=Source(
        DataRow, columns=["id", "tenant", "price", "qty", "discount"], tenant_column="tenant"
    ),
    sink=Sink(StrictResultRow, key=["id"], columns=["tenant", "band", "total", "due", "stamp"]),
    tenants=lambda: sorted(STRICT_FORMULAS),
    time_zone=STRICT_ZONES.get,
    batch_size=50,
)
def strict_formulas(tenant: str) -> list[str]:
    return STRICT_FORMULAS[tenant]


#: The lookup pipeline's rules (tests change them).
LOOKUP_FORMULAS: dict[str, list[str]] = {
    "alice": [
        'price_of = VLOOKUP(note, "prices", 2, FALSE)',
        'band_of = XLOOKUP(note, "prices.code", "prices.band", "none")',
        'code_of = VLOOKUP(UPPER(note), "prices", 1, FALSE)',
        "total = qty * price_of",
        'via = XLOOKUP(_key, "prices.code", "prices.price")',
        '_key = LOWER(note) & ""',
    ],
    "bob": ['price_of = VLOOKUP(note, "prices", 2, FALSE)'],
}


@pipeline(
    name="test.lookup",
    source=Source(DataRow, columns=["id", "tenant", "qty", "note"], tenant_column="tenant"),
    sink=Sink(JsonResultRow, key=["id"], columns=["tenant"], results="results"),
    tenants=lambda: sorted(LOOKUP_FORMULAS),
    lookups={
        "prices": Lookup(PriceRow, key="code", columns=["price", "band"], tenant_column="tenant")
    },
    batch_size=50,
)
def lookup_formulas(tenant: str) -> list[str]:
    return LOOKUP_FORMULAS[tenant]

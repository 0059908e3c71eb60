"""The pipeline app's settings: one ``FAIRQUEUE_PIPELINE = {...}`` dict, beside ``FAIRQUEUE``.

``SPARK``: the worker's Spark session (:mod:`.spark` lists its keys and checks them).
``TIME_ZONE``: the zone in which ``TODAY()`` and ``NOW()`` are read (an IANA name such as
``"Europe/Paris"``; default ``"UTC"``, whatever Django's ``TIME_ZONE``); a pipeline may set
its own, per tenant (``Pipeline.time_zone``).
Read on every use, so a test's ``settings`` override applies at once; checked at start-up by
the app's system check (``fairqueue_pipeline.E001``) with the same message as at first use.
"""

from __future__ import annotations

import zoneinfo
from functools import cache
from typing import Any

KEYS = ("SPARK", "TIME_ZONE")
DEFAULT_TIME_ZONE = "UTC"


@cache
def zone(name: str) -> zoneinfo.ZoneInfo:
    """The time zone ``name``; ``ValueError`` if there is none of that name."""
    try:
        return zoneinfo.ZoneInfo(str(name))
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, TypeError):
        raise ValueError(
            f"unknown time zone {name!r} (an IANA name, e.g. 'Europe/Paris')"
        ) from None


def get() -> dict[str, Any]:
    """``FAIRQUEUE_PIPELINE``, its shape checked; ``ValueError`` names a bad entry."""
    from django.conf import settings

    raw = getattr(settings, "FAIRQUEUE_PIPELINE", None)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"FAIRQUEUE_PIPELINE must be a dict, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ValueError(f"FAIRQUEUE_PIPELINE has unknown keys {unknown}; known keys: {list(KEYS)}")
    spark = raw.get("SPARK", {})
    if spark is None:
        spark = {}
    if not isinstance(spark, dict):
        raise ValueError(f"FAIRQUEUE_PIPELINE['SPARK'] must be a dict, got {type(spark).__name__}")
    time_zone = raw.get("TIME_ZONE", DEFAULT_TIME_ZONE)
    zone(time_zone)
    return {"SPARK": dict(spark), "TIME_ZONE": str(time_zone)}

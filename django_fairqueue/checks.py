"""System checks with stable ids: a bad FAIRQUEUE setting stops start-up with a clear message."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, register
from django.db import connections

from django_fairqueue import conf


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    errors: list[Error] = []
    raw = getattr(settings, "FAIRQUEUE", {})
    try:
        cfg = conf.load(raw)
    except (ValueError, TypeError) as exc:
        return [
            Error(
                f"Invalid FAIRQUEUE setting: {exc}",
                hint="See docs/reference/settings.md for every key and its type.",
                id="fairqueue.E001",
            )
        ]
    if cfg.DATABASE not in settings.DATABASES:
        errors.append(
            Error(
                f"FAIRQUEUE['DATABASE'] is {cfg.DATABASE!r}, which is not in DATABASES.",
                id="fairqueue.E002",
            )
        )
    elif connections[cfg.DATABASE].vendor != "postgresql":
        errors.append(
            Error(
                f"django-fairqueue needs PostgreSQL; database {cfg.DATABASE!r} is "
                f"{connections[cfg.DATABASE].vendor}.",
                id="fairqueue.E003",
            )
        )
    if len(cfg.DEFAULT_CHANNEL) > 200 or cfg.DEFAULT_CHANNEL.strip() != cfg.DEFAULT_CHANNEL:
        errors.append(
            Error(
                "FAIRQUEUE['DEFAULT_CHANNEL'] must be at most 200 characters without "
                "surrounding blanks.",
                id="fairqueue.E004",
            )
        )
    return errors

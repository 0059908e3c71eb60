"""Template filters of the fairqueue admin pages."""

from __future__ import annotations

from typing import Any

from django import template

register = template.Library()


@register.filter
def thousands(value: Any) -> str:
    """An integer with thousands separators (``1,234,567``); other values unchanged."""
    if isinstance(value, bool) or not isinstance(value, int):
        return "" if value is None else str(value)
    return f"{value:,}"

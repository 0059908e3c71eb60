"""Template filters and tags of the fairqueue admin pages."""

from __future__ import annotations

from typing import Any

import django
from django import template
from django.urls import reverse
from django.utils.text import capfirst

from django_fairqueue.observe import overview

register = template.Library()

#: Django 6 renders breadcrumbs as ``<ol class="breadcrumbs">`` of ``<li>`` (and styles only
#: that); Django 5.2 as ``<div class="breadcrumbs">`` with ``&rsaquo;`` between the links.
BREADCRUMBS_AS_LIST = django.VERSION >= (6, 0)


@register.filter
def thousands(value: Any) -> str:
    """An integer with thousands separators (``1,234,567``); other values unchanged."""
    if isinstance(value, bool) or not isinstance(value, int):
        return "" if value is None else str(value)
    return f"{value:,}"


@register.filter
def age(seconds: float | None) -> str:
    """A duration as the channel list shows ages (``29m 52s``; ``-`` for None)."""
    return overview.format_age(seconds)


@register.filter
def wait_ms(ms: float | None) -> str:
    """A wait as the dashboard shows it (``850 ms``, ``2.02 s``; ``-`` for None)."""
    return overview.format_ms(ms)


@register.inclusion_tag("admin/fairqueue/includes/breadcrumbs.html", takes_context=True)
def fairqueue_breadcrumbs(context: template.Context, opts: Any, current: str) -> dict[str, Any]:
    """Home, the app, the model's list and ``current``, in the breadcrumbs markup of the
    running Django (its admin CSS styles only its own), for our pages below a model's list."""
    request = context.get("request")
    app = getattr(request, "current_app", None) or "admin"
    crumbs = [
        (reverse("admin:index", current_app=app), None),  # "Home", translated by the template
        (
            reverse("admin:app_list", kwargs={"app_label": opts.app_label}, current_app=app),
            opts.app_config.verbose_name,
        ),
        (
            reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist", current_app=app),
            capfirst(opts.verbose_name_plural),
        ),
    ]
    return {"as_list": BREADCRUMBS_AS_LIST, "crumbs": crumbs, "current": current}

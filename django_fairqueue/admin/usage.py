"""The admin's usage page (registered by :mod:`django_fairqueue.admin`): per-tenant worker time,
attempts and failures over a range of days, per channel or per group, sortable by any column,
with a CSV export of what it shows (:mod:`django_fairqueue.observe.usage`).

``<admin>/fairqueue/usagehour/?from=2026-11-28&to=2026-11-28&by=channel&o=-worker_seconds``;
``&format=csv`` downloads the same report. The range defaults to yesterday. Viewing needs the
*view usage hour* permission; nothing here writes.
"""

from __future__ import annotations

from datetime import date
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.http import urlencode
from django.utils.translation import gettext_lazy as _

from django_fairqueue.admin import lists
from django_fairqueue.models import UsageHour
from django_fairqueue.observe import usage

if TYPE_CHECKING:
    _UsageAdminBase = admin.ModelAdmin[UsageHour]
else:
    _UsageAdminBase = admin.ModelAdmin

#: Most rows the page shows (the CSV has them all).
PAGE_ROWS = 500
#: The report's columns: (sort field, heading), in the page's order.
COLUMNS = (
    ("name", _("name")),
    ("queue", _("queue")),
    ("worker_seconds", _("worker time")),
    ("attempts", _("attempts")),
    ("succeeded", _("succeeded")),
    ("failures", _("failures")),
    ("timeouts", _("timeouts")),
    ("failure_rate", _("failure rate")),
)


class _UsageReport(_UsageAdminBase):
    """Usage per tenant, read-only: the page is a report, not a list of rows. Its view replaces
    the change list's, so :class:`UsageAdmin` puts the lists' NUL check in front of it."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: UsageHour | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: UsageHour | None = None) -> bool:
        return False

    def _params(self, request: HttpRequest) -> tuple[dict[str, Any], list[str]]:
        """The report's parameters from the query string, and what was wrong in it (a bad
        value falls back to its default, and the page says so)."""
        errors: list[str] = []
        yesterday = usage.parse_day("yesterday")
        days: dict[str, date] = {}
        for key in ("from", "to"):
            text = request.GET.get(key, "")
            if not text:
                continue
            try:
                days[key] = usage.parse_day(text)
            except ValueError as exc:
                errors.append(str(exc))
        first = days.get("from") or days.get("to") or yesterday
        last = days.get("to") or (first if "from" in days else yesterday)
        if last < first:
            errors.append(f"the last day ({last}) is before the first ({first}): showing {first}")
            last = first
        by = request.GET.get("by", "channel")
        if by not in usage.BY:
            errors.append(f"by must be one of {', '.join(usage.BY)}")
            by = "channel"
        order = request.GET.get("o", "-worker_seconds")
        if order.removeprefix("-") not in usage.SORTS:
            errors.append(f"cannot sort by {order!r}")
            order = "-worker_seconds"
        queue = request.GET.get("queue") or None
        return {"first": first, "last": last, "by": by, "order": order, "queue": queue}, errors

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        params, errors = self._params(request)
        start, end = usage.day_range(params["first"], params["last"])
        rows = usage.report(
            start, end, by=params["by"], order=params["order"], queue=params["queue"]
        )
        if request.GET.get("format") == "csv":
            response = HttpResponse(
                usage.as_csv(rows, start=start, end=end, by=params["by"]),
                content_type="text/csv; charset=utf-8",
            )
            name = f"fairqueue-usage-{params['by']}-{params['first']}-{params['last']}.csv"
            response["Content-Disposition"] = f'attachment; filename="{name}"'
            return response
        base = {
            "from": params["first"].isoformat(),
            "to": params["last"].isoformat(),
            "by": params["by"],
            **({"queue": params["queue"]} if params["queue"] else {}),
        }
        field, descending = params["order"].removeprefix("-"), params["order"].startswith("-")
        headers = []
        for key, label in COLUMNS:
            # a click on the sorted column flips it; on another, figures sort most first
            flip = "" if (key == field and descending) else "-"
            if key != field and key in ("name", "queue"):
                flip = ""
            headers.append(
                {
                    "label": label,
                    "url": "?" + urlencode({**base, "o": flip + key}),
                    "sorted": "descending"
                    if key == field and descending
                    else ("ascending" if key == field else ""),
                }
            )
        context = {
            **self.admin_site.each_context(request),
            "title": _("Usage per tenant"),
            "opts": self.model._meta,
            "params": params,
            "errors": errors,
            "headers": headers,
            "rows": [
                {
                    **r.as_dict(),
                    "worker_time": f"{r.worker_seconds:,.1f} s",
                    "failure_percent": f"{100 * r.failure_rate:.1f} %",
                }
                for r in rows[:PAGE_ROWS]
            ],
            "total_percent": f"{100 * usage.summed(rows).failure_rate:.1f} %",
            "span": (
                f"{params['first']}"
                if params["first"] == params["last"]
                else f"{params['first']} to {params['last']}"
            ),
            "shown": min(len(rows), PAGE_ROWS),
            "count": len(rows),
            "total": usage.summed(rows).as_dict(),
            "total_time": f"{usage.summed(rows).worker_seconds:,.1f} s",
            "csv_url": "?" + urlencode({**base, "o": params["order"], "format": "csv"}),
            "by_choices": usage.BY,
            "queues": lists.QueueFilter.known_queues(params["queue"]),
            "media": self.media,
            **(extra_context or {}),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/fairqueue/usage/report.html", context)


@admin.register(UsageHour)
class UsageAdmin(lists.NulSafeAdmin, _UsageReport):
    """The usage report; a NUL in its filter (a queue's name, looked up in the database, which
    cannot hold one) is refused with a 400 as in every list."""

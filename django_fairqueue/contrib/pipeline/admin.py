"""The admin's *Pipeline jobs*: each planned job, the formula version it is pinned to, its
error counts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import admin
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _

from django_fairqueue.contrib.pipeline.models import PipelineJob

if TYPE_CHECKING:
    _PipelineJobAdminBase = admin.ModelAdmin[PipelineJob]
else:  # the generic alias exists only for type checkers (no django-stubs-ext at run time)
    _PipelineJobAdminBase = admin.ModelAdmin


@admin.register(PipelineJob)
class PipelineJobAdmin(_PipelineJobAdminBase):
    """Planned pipeline jobs, read-only: the formula version each is pinned to, its errors."""

    list_display = ["job_name", "version", "today", "errors_display", "created_at", "cancelled_at"]
    list_filter = ["pipeline"]
    search_fields = ["job_name", "version"]
    readonly_fields = [
        "job_name",
        "pipeline",
        "tenant",
        "version",
        "today",
        "formulas_display",
        "errors",
        "created_at",
        "cancelled_at",
    ]
    exclude = ["formulas", "aggregates"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: PipelineJob | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: PipelineJob | None = None) -> bool:
        return False

    @admin.display(description=_("errors"))
    def errors_display(self, obj: PipelineJob) -> str:
        total = sum(int(v) for v in (obj.errors or {}).values())
        return f"{total:,} in {len(obj.errors or {})} rules" if total else "0"

    @admin.display(description=_("formulas"))
    def formulas_display(self, obj: PipelineJob) -> str:
        return "\n".join(f"{name} = {expression}" for name, expression in obj.formulas or [])

"""The admin's *Pipeline jobs*: each planned job, the formula version it is pinned to, its
error counts and last successful run; actions to recompute and cancel jobs.

Jobs are read-only here. The actions need *change pipeline job*: "Recompute what changed"
(``fairpipeline recompute`` for the selected tenants: every row if their formulas changed,
else the rows changed since their last successful run) and "Cancel" (``fairpipeline
cancel``). A view-only user sees the jobs and can do nothing to them. Each action writes an
admin log entry per job."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.models import CHANGE, LogEntry
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _

from django_fairqueue.admin.common import time_field, timestamp
from django_fairqueue.contrib.pipeline.models import PipelineJob

if TYPE_CHECKING:
    _PipelineJobAdminBase = admin.ModelAdmin[PipelineJob]
else:  # the generic alias exists only for type checkers (no django-stubs-ext at run time)
    _PipelineJobAdminBase = admin.ModelAdmin


@admin.register(PipelineJob)
class PipelineJobAdmin(_PipelineJobAdminBase):
    """Planned pipeline jobs, read-only: the formula version each is pinned to, its errors."""

    list_display = [
        "job_name",
        "version",
        "output",
        "scope_display",
        "today_display",
        "errors_display",
        "succeeded_display",
        "created_display",
        "cancelled_display",
    ]
    list_filter = ["pipeline", "output"]
    search_fields = ["job_name", "version"]
    readonly_fields = [
        "job_name",
        "pipeline",
        "tenant",
        "version",
        "today_display",
        "formulas_display",
        "errors",
        "output",
        "changed_since",
        "watermark",
        "created_display",
        "cancelled_display",
        "succeeded_version",
        "succeeded_output",
        "succeeded_watermark",
        "succeeded_at_display",
    ]
    # (the times are shown by the fields above, as every fairqueue page shows a time)
    exclude = ["formulas", "aggregates", "today", "created_at", "cancelled_at", "succeeded_at"]
    created_display = time_field("created_at", _("created at"), sortable=True)
    cancelled_display = time_field("cancelled_at", _("cancelled at"), sortable=True)
    succeeded_at_display = time_field("succeeded_at", _("succeeded at"))

    @admin.display(description=_("today"), ordering="today")
    def today_display(self, obj: PipelineJob) -> str:
        return obj.today.isoformat()  # as the times read: 2026-11-30

    actions = ["recompute_jobs", "cancel_jobs"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: PipelineJob | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: PipelineJob | None = None) -> bool:
        return False

    def has_view_permission(self, request: HttpRequest, obj: PipelineJob | None = None) -> bool:
        label = self.opts.app_label
        return request.user.has_perm(f"{label}.view_pipelinejob") or self.has_act_permission(
            request
        )

    def has_act_permission(self, request: HttpRequest) -> bool:
        """Recompute and cancel: *change pipeline job* (the jobs themselves stay read-only)."""
        return request.user.has_perm(f"{self.opts.app_label}.change_pipelinejob")

    @admin.action(description=_("Recompute what changed in selected jobs"), permissions=["act"])
    def recompute_jobs(self, request: HttpRequest, queryset: QuerySet[PipelineJob]) -> None:
        from django_fairqueue.contrib.pipeline.runner import recompute

        what = {"all": "every row", "changed": "changed rows", "none": "up to date"}
        for pipeline, jobs in _by_pipeline(queryset).items():
            try:
                report = recompute(pipeline, tenants=[job.tenant for job in jobs])
            except (LookupError, ValueError, RuntimeError) as exc:
                self.message_user(request, f"{pipeline}: {exc}", messages.ERROR)
                continue
            done = {d.tenant: d for d in report.tenants}
            for job in jobs:
                if job.tenant in report.refused:
                    self.message_user(
                        request, f"not recomputed: {report.refused[job.tenant]}", messages.ERROR
                    )
                    continue
                decided = done[job.tenant]
                text = f"{job.job_name}: {what[decided.scope]} ({decided.reason})"
                if decided.planned is not None:
                    text += f", {decided.planned.created} batches planned"
                self.message_user(request, text, messages.SUCCESS)
                if decided.scope != "none":
                    _log(request, job, f"Recomputed: {what[decided.scope]}")

    @admin.action(description=_("Cancel selected jobs"), permissions=["act"])
    def cancel_jobs(self, request: HttpRequest, queryset: QuerySet[PipelineJob]) -> None:
        from django_fairqueue.contrib.pipeline.runner import cancel

        for pipeline, jobs in _by_pipeline(queryset.filter(cancelled_at__isnull=True)).items():
            try:
                dropped = cancel(pipeline, tenants=[job.tenant for job in jobs])
            except LookupError as exc:
                self.message_user(request, f"{pipeline}: {exc}", messages.ERROR)
                continue
            for job in jobs:
                count = dropped.get(job.tenant, 0)
                self.message_user(
                    request, f"{job.job_name}: cancelled, {count} pending batches dropped"
                )
                _log(request, job, "Cancelled")

    @admin.display(description=_("rows"))
    def scope_display(self, obj: PipelineJob) -> str:
        return f"changed since {obj.changed_since}" if obj.changed_since is not None else "all"

    @admin.display(description=_("last success"))
    def succeeded_display(self, obj: PipelineJob) -> str:
        if obj.succeeded_at is None:
            return "-"
        return f"{obj.succeeded_version} ({timestamp(obj.succeeded_at)})"

    @admin.display(description=_("errors"))
    def errors_display(self, obj: PipelineJob) -> str:
        total = sum(int(v) for v in (obj.errors or {}).values())
        return f"{total:,} in {len(obj.errors or {})} rules" if total else "0"

    @admin.display(description=_("formulas"))
    def formulas_display(self, obj: PipelineJob) -> str:
        return "\n".join(f"{name} = {expression}" for name, expression in obj.formulas or [])


def _by_pipeline(queryset: QuerySet[PipelineJob]) -> dict[str, list[PipelineJob]]:
    grouped: dict[str, list[PipelineJob]] = defaultdict(list)
    for job in queryset.order_by("job_name"):
        grouped[job.pipeline].append(job)
    return dict(grouped)


def _log(request: HttpRequest, job: PipelineJob, message: str) -> None:
    user: Any = request.user
    LogEntry.objects.log_actions(
        user_id=user.pk or 0, queryset=[job], action_flag=CHANGE, change_message=message
    )

"""The admin of work batches: read-only, with retry."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, path, reverse
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext
from django.views.decorators.http import require_POST

from django_fairqueue import batches
from django_fairqueue.admin import lists
from django_fairqueue.admin.common import (
    WorkBatchAdminBase,
    chunks,
    error_html,
    error_summary,
    ids_of,
    log_changes,
    time_field,
)
from django_fairqueue.db import batch_store
from django_fairqueue.models import BatchState, WorkBatch
from django_fairqueue.observe import overview


@admin.register(WorkBatch)
class WorkBatchAdmin(lists.NulSafeAdmin, WorkBatchAdminBase):
    class Media:
        css = {"all": ["django_fairqueue/admin.css"]}

    change_list_template = "admin/fairqueue/workbatch/change_list.html"
    list_display = [
        "job_name",
        "range_display",
        "state",
        "row_count",
        "rows_processed",
        "attempts_display",
        "worker_id",
        "started_display",
        "finished_display",
        "error_summary",
    ]
    list_filter = ["state", "job_name"]
    search_fields = ["=job_name"]
    search_help_text = _("Job name (exact)")
    show_full_result_count = False
    actions = ["retry_batches"]
    readonly_fields = [
        "job_name",
        "channel",
        "start_id",
        "end_id",
        "row_count",
        "state",
        "run_at_display",
        "attempts",
        "max_attempts",
        "worker_id",
        "lease_token",
        "heartbeat_display",
        "lease_expires_display",
        "created_display",
        "started_display",
        "finished_display",
        "rows_processed",
        "error_display",
    ]
    # (the times are shown by the fields above, as every fairqueue page shows a time)
    exclude = [
        "last_error",
        "run_at",
        "heartbeat_at",
        "lease_expires_at",
        "created_at",
        "started_at",
        "finished_at",
    ]
    run_at_display = time_field("run_at", _("run at"))
    heartbeat_display = time_field("heartbeat_at", _("heartbeat at"))
    lease_expires_display = time_field("lease_expires_at", _("lease expires at"))
    created_display = time_field("created_at", _("created at"))
    started_display = time_field("started_at", _("started at"), sortable=True)
    finished_display = time_field("finished_at", _("finished at"), sortable=True)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: WorkBatch | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: WorkBatch | None = None) -> bool:
        return False

    def has_view_permission(self, request: HttpRequest, obj: WorkBatch | None = None) -> bool:
        label = self.opts.app_label
        return request.user.has_perm(f"{label}.view_workbatch") or self.has_act_permission(request)

    def has_act_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.change_workbatch")

    @admin.display(description=_("id range"), ordering="start_id")
    def range_display(self, obj: WorkBatch) -> str:
        return f"{obj.start_id:,} … {obj.end_id:,}"

    @admin.display(description=_("attempts"))
    def attempts_display(self, obj: WorkBatch) -> str:
        return f"{obj.attempts} / {obj.max_attempts}"

    @admin.display(description=_("error"))
    def error_summary(self, obj: WorkBatch) -> str:
        return error_summary(obj.last_error)

    @admin.display(description=_("last error"))
    def error_display(self, obj: WorkBatch) -> str:
        return error_html(obj.last_error)

    def _retry(self, request: HttpRequest, ids: Sequence[int]) -> int:
        done = 0
        for chunk in chunks(ids):
            retried = batch_store.retry_failed_work_batches(chunk)
            done += len(retried)
            log_changes(
                request,
                list(WorkBatch.objects.filter(pk__in=retried).order_by("pk")),
                "Retried: back to pending with attempts 0 (admin action).",
            )
        return done

    @admin.action(description=_("Retry selected failed batches"), permissions=["act"])
    def retry_batches(self, request: HttpRequest, queryset: QuerySet[WorkBatch]) -> None:
        done = sum(self._retry(request, ids) for ids in ids_of(queryset))
        self.message_user(
            request,
            ngettext("Retried %(n)d failed batch.", "Retried %(n)d failed batches.", done)
            % {"n": done},
            messages.SUCCESS,
        )

    def jobs(self) -> list[dict[str, Any]]:
        """Progress per job: batches by state, rows planned and done, rate and ETA."""
        out: list[dict[str, Any]] = []
        for job in batches.jobs():
            by = job.batches_by_state
            out.append(
                {
                    "job_name": job.job_name,
                    "channel": job.channel,
                    "state": job.state,
                    "total": job.batches_total,
                    "done": by["succeeded"],
                    "running": by["running"],
                    "pending": by["pending"],
                    "failed": by["failed"],
                    "rows": job.rows_total,
                    "rows_done": job.rows_done,
                    "processed": job.rows_written,
                    "percent": round(100 * job.fraction_done, 1),
                    "rate": round(job.rows_per_second) if job.rows_per_second else None,
                    "eta": overview.format_age(job.eta.total_seconds()) if job.eta else None,
                }
            )
        return out

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        context = {
            "jobs": self.jobs() if self.has_view_permission(request) else [],
            "can_retry": self.has_act_permission(request),
            **(extra_context or {}),
        }
        return super().changelist_view(request, extra_context=context)

    def get_urls(self) -> list[URLPattern]:
        return [
            path(
                "retry-job/",
                self.admin_site.admin_view(require_POST(self.retry_job_view)),
                name="fairqueue_workbatch_retry_job",
            ),
            *super().get_urls(),
        ]

    def retry_job_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_act_permission(request):
            raise PermissionDenied
        job = request.POST.get("job", "")
        if "\x00" in job:  # a 400, as the lists answer a NUL in a filter
            return lists.nul_refused("The job name")
        ids = list(
            WorkBatch.objects.filter(job_name=job, state=BatchState.FAILED)
            .order_by("pk")
            .values_list("pk", flat=True)
        )
        done = self._retry(request, ids)
        self.message_user(
            request,
            ngettext(
                "Retried %(n)d failed batch of job %(job)s.",
                "Retried %(n)d failed batches of job %(job)s.",
                done,
            )
            % {"n": done, "job": job},
            messages.SUCCESS,
        )
        return HttpResponseRedirect(reverse("admin:fairqueue_workbatch_changelist"))

"""The admin of the worker registry: who runs, where, what, since when; and what each runs now."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import Q, QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.safestring import mark_safe
from django.utils.translation import gettext_lazy as _

from django_fairqueue import conf
from django_fairqueue.admin import lists
from django_fairqueue.admin.common import WorkerAdminBase, time_field
from django_fairqueue.db import pg
from django_fairqueue.models import Message, MessageState, WorkerRecord
from django_fairqueue.observe import moments, overview
from django_fairqueue.runtime import worker_registry


class WorkerStateFilter(admin.SimpleListFilter):
    """The state column's values (alive, silent, dead, stopped), judged as the column judges
    them, on the database's clock: a registered worker whose beat is late is silent, and dead
    once WORKER_DEAD_AFTER passed, before the maintenance loop marks it so."""

    title = _("state")
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(s, s) for s in ("alive", "silent", "dead", "stopped")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        cfg = conf.get()
        now = pg.select_clock(using=cfg.DATABASE)
        late = now - timedelta(seconds=3 * cfg.WORKER_HEARTBEAT)
        gone = now - timedelta(seconds=cfg.WORKER_DEAD_AFTER)
        running = queryset.filter(state="running")
        if value == "alive":
            return running.filter(heartbeat_at__gte=late)
        if value == "silent":
            return running.filter(heartbeat_at__lt=late, heartbeat_at__gte=gone)
        if value == "dead":
            return queryset.filter(Q(state="dead") | Q(state="running", heartbeat_at__lt=gone))
        if value == "stopped":
            return queryset.filter(state="stopped")
        return queryset.none()


@admin.register(WorkerRecord)
class WorkerAdmin(lists.NulSafeAdmin, WorkerAdminBase):
    """The worker registry, read-only: who runs, where, what, since when, and what each ran.

    A supervisor's children (``runfairworker --processes``) are listed together under it; the
    *Busy* page shows what each live worker runs now and since when."""

    class Media:
        css = {"all": ["django_fairqueue/admin.css"]}

    change_list_template = "admin/fairqueue/workerrecord/change_list.html"
    list_display = [
        "worker_display",
        "alive_display",
        "supervisor_display",
        "host",
        "pid",
        "running_display",
        "handled",
        "messages_link",
        "heartbeat_display",
        "last_claim_display",
        "started_display",
        "queues_display",
        "filters_display",
        "version",
        "restarts_display",
    ]
    list_filter = [WorkerStateFilter, "host"]
    # The worker's page: its fields in the model's order, the times as every fairqueue page
    # shows a time (not Django's locale format).
    fields = [
        "worker_id",
        "host",
        "pid",
        "version",
        "concurrency",
        "channels",
        "exclude_channels",
        "queues",
        "state",
        "started_at_display",
        "heartbeat_at_display",
        "last_claim_at_display",
        "running",
        "handled",
        "stopped_at_display",
        "wakeups",
        "supervisor",
        "supervision",
    ]
    readonly_fields = [
        "started_at_display",
        "heartbeat_at_display",
        "last_claim_at_display",
        "stopped_at_display",
    ]
    started_at_display = time_field("started_at", _("started at"))
    heartbeat_at_display = time_field("heartbeat_at", _("last beat"))
    last_claim_at_display = time_field("last_claim_at", _("last claim"))
    stopped_at_display = time_field("stopped_at", _("stopped at"))
    search_fields = ["worker_id", "host", "supervisor"]
    show_full_result_count = False
    # a supervisor's children together, in slot order; workers on their own by id
    ordering = ["supervisor", "worker_id"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: WorkerRecord | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: WorkerRecord | None = None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        # One read of the registry and the clock per page, kept on the request's rows (never on
        # this admin, which every request shares): the states need the beat's age.
        return super().changelist_view(
            request,
            {"busy_url": reverse("admin:fairqueue_workerrecord_busy"), **(extra_context or {})},
        )

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        cl = super().get_changelist_instance(request)
        now = pg.select_clock()
        states = {v.worker_id: v.state for v in worker_registry.workers(now)}
        messages_url = reverse("admin:fairqueue_message_changelist")
        for obj in cl.result_list:
            setattr(obj, "_fq_now", now)  # noqa: B010
            setattr(obj, "_fq_state", states.get(obj.worker_id, obj.state))  # noqa: B010
            setattr(obj, "_fq_messages", messages_url)  # noqa: B010
        return cl

    def _ago(self, obj: WorkerRecord, moment: datetime | None) -> str:
        now = getattr(obj, "_fq_now", None) or moments.now()
        return overview.format_since(moment, now) if moment else "-"

    @admin.display(description=_("worker"), ordering="worker_id")
    def worker_display(self, obj: WorkerRecord) -> str:
        if obj.supervisor:  # a child, under its supervisor
            return format_html('<span class="fq-child">└ {}</span>', obj.worker_id)
        return obj.worker_id

    @admin.display(description=_("state"))
    def alive_display(self, obj: WorkerRecord) -> str:
        state: str = getattr(obj, "_fq_state", obj.state)
        if state in ("dead", "silent"):
            return format_html('<span class="fq-failed">{}</span>', state)
        return state

    @admin.display(description=_("supervisor"), ordering="supervisor")
    def supervisor_display(self, obj: WorkerRecord) -> str:
        return obj.supervisor or "-"

    @admin.display(description=_("running / threads"), ordering="running")
    def running_display(self, obj: WorkerRecord) -> str:
        state = getattr(obj, "_fq_state", obj.state)
        return f"{obj.running} / {obj.concurrency}" if state in ("alive", "silent") else "-"

    @admin.display(description=_("messages"))
    def messages_link(self, obj: WorkerRecord) -> str:
        """The messages it ran; for a dead worker, "ran or lost": what it was running when it
        died carries its id, with an expired lease (the rescuer's LeaseExpired error)."""
        url = getattr(obj, "_fq_messages", None) or reverse("admin:fairqueue_message_changelist")
        state = getattr(obj, "_fq_state", obj.state)
        label = _("ran or lost") if state == "dead" else _("ran")
        return format_html(
            '<a href="{}?{}"{}>{}</a>',
            url,
            urlencode({"worker": obj.worker_id}),
            mark_safe(' class="fq-failed"') if state == "dead" else "",  # a constant
            label,
        )

    @admin.display(description=_("last beat"), ordering="heartbeat_at")
    def heartbeat_display(self, obj: WorkerRecord) -> str:
        return self._ago(obj, obj.heartbeat_at)

    @admin.display(description=_("last claim"), ordering="last_claim_at")
    def last_claim_display(self, obj: WorkerRecord) -> str:
        return self._ago(obj, obj.last_claim_at)

    @admin.display(description=_("started"), ordering="started_at")
    def started_display(self, obj: WorkerRecord) -> str:
        return self._ago(obj, obj.started_at)

    @admin.display(description=_("queues"))
    def queues_display(self, obj: WorkerRecord) -> str:
        return str(_("all")) if obj.queues is None else ", ".join(obj.queues)

    @admin.display(description=_("restarts"))
    def restarts_display(self, obj: WorkerRecord) -> str:
        # under a supervisor: its slot's restarts before this process, and a crash loop
        return worker_registry.restarts_text(*worker_registry.supervised_restarts(obj.supervision))

    @admin.display(description=_("channels"))
    def filters_display(self, obj: WorkerRecord) -> str:
        if obj.channels:
            return ", ".join(obj.channels)
        if obj.exclude_channels:
            return str(_("all but %s")) % ", ".join(obj.exclude_channels)
        return str(_("all"))

    # -- busy: what each worker runs now --------------------------------------------------

    #: Most running messages the busy page lists (the oldest claims first per worker).
    BUSY_LIMIT = 300

    def get_urls(self) -> list[URLPattern]:
        return [
            path(
                "busy/",
                self.admin_site.admin_view(self.busy_view),
                name="fairqueue_workerrecord_busy",
            ),
            *super().get_urls(),
        ]

    def busy_view(self, request: HttpRequest) -> TemplateResponse:
        """Every worker that holds running messages or is live, its supervisor's children
        together, each with what it runs now: the message, its channel and task, since when,
        and its lease. A dead worker's messages stay listed (their lease expired) until a
        live worker's rescuer takes them back."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        now = pg.select_clock()
        views = {v.worker_id: v for v in worker_registry.workers(now)}
        running = list(
            Message.objects.filter(state=MessageState.RUNNING)
            .select_related("channel")
            .only(
                "id",
                "task_name",
                "claimed_at",
                "lease_expires_at",
                "worker_id",
                "attempts",
                "max_attempts",
                "abort_requested_at",
                "channel__name",
            )
            .order_by("worker_id", "claimed_at", "id")[: self.BUSY_LIMIT + 1]
        )
        truncated = len(running) > self.BUSY_LIMIT
        by_worker: dict[str, list[dict[str, Any]]] = {}
        for m in running[: self.BUSY_LIMIT]:
            expires = moments.aware(m.lease_expires_at)
            left = (expires - now).total_seconds() if expires else None
            by_worker.setdefault(m.worker_id, []).append(
                {
                    "id": m.pk,
                    "channel": m.channel.short_name,
                    "channel_id": m.channel_id,
                    "task": m.task_name,
                    "attempt": f"{m.attempts} / {m.max_attempts}",
                    "since": overview.format_since(m.claimed_at, now),
                    "lease": (
                        "-"
                        if left is None
                        else f"in {overview.format_age(left)}"
                        if left >= 0
                        else f"expired {overview.format_age(-left)} ago"
                    ),
                    "expired": left is not None and left < 0,
                    "aborting": m.abort_requested_at is not None,
                }
            )
        ids = set(by_worker) | {w for w, v in views.items() if v.state in ("alive", "silent")}
        workers = []
        for worker_id in sorted(
            ids, key=lambda w: ((views[w].supervisor if w in views else ""), w)
        ):
            view = views.get(worker_id)
            workers.append(
                {
                    "id": worker_id,
                    "state": view.state if view else "?",
                    "supervisor": view.supervisor if view else "",
                    "host": view.host if view else "",
                    "pid": view.pid if view else "",
                    "slots": f"{len(by_worker.get(worker_id, []))} / {view.concurrency}"
                    if view
                    else str(len(by_worker.get(worker_id, []))),
                    "messages": by_worker.get(worker_id, []),
                }
            )
        context = {
            **self.admin_site.each_context(request),
            "title": _("Busy: what each worker runs now"),
            "opts": self.model._meta,
            "workers": workers,
            "truncated": truncated,
            "limit": self.BUSY_LIMIT,
            "now": overview.format_time(now),
            "media": self.media,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/fairqueue/workerrecord/busy.html", context)

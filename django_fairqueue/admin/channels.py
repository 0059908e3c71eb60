"""The admin of channels: the per-tenant table with its filters and figures, editable limits,
actions (pause, resume, retry failed, purge), and the dashboard."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.db.models import F, IntegerField, Lookup, Q, QuerySet, Value
from django.http import HttpRequest, JsonResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import format_lazy
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from django_fairqueue import conf, failures, stats
from django_fairqueue.admin import lists
from django_fairqueue.admin.common import (
    ACTION_CHUNK,
    ChannelAdminBase,
    ChannelFormBase,
    as_typed,
    carry_initial,
    check_limits,
    duration,
    log_changes,
    timestamp,
)
from django_fairqueue.admin.schedules import ScheduleInline
from django_fairqueue.api import validate_channel_name
from django_fairqueue.db import channel_store, message_store, pg
from django_fairqueue.exceptions import InvalidChannel, InvalidQueue
from django_fairqueue.limits import CHANNEL_NAME_MAX_LENGTH
from django_fairqueue.models import Channel, Message
from django_fairqueue.observe import horizon, moments, overview, waiting
from django_fairqueue.queues import DEFAULT_QUEUE, row_name, validate_queue_name
from django_fairqueue.runtime import worker_registry

#: The limits an operator edits; a change saves only these columns (see ChannelAdmin.save_model).
EDITABLE_LIMITS = ("max_concurrency", "release_interval", "weight", "max_backlog", "paused")
#: The pseudo-field the "oldest ready" column sorts by (sorted in Python, see ChannelChangeList).
AGE_ORDER = "oldest_ready_age"
#: Pseudo-fields of columns whose figures come from the per-minute statistics, sorted in
#: Python over every channel of the filtered list (ChannelChangeList): the database holds no
#: column to order them by.
FIGURE_ORDERS = ("wait_p50", "served_recent", "finished_recent")
#: Most tenants the dashboard shows (and its JSON accepts).
DASHBOARD_MAX_TENANTS = 100


class ChannelForm(ChannelFormBase):
    """A channel's limits, checked with the same rules as FAIRQUEUE['CHANNEL_DEFAULTS'].

    Adding, also its queue (``queue_name``): the channel ``acme`` of queue ``reports`` is the
    row named ``reports<U+001F>acme``, as enqueue names it, and the database sets the row's
    ``queue`` from that name. Names are checked as enqueue checks them."""

    queue_name = forms.CharField(
        label=_("Queue"),
        initial=DEFAULT_QUEUE,
        required=False,
        help_text=_(
            "The queue the channel belongs to (workers started with --queues serve only "
            "theirs). Letters, digits, '_', '.' and '-'."
        ),
    )

    class Meta:
        model = Channel
        fields = ["name", *EDITABLE_LIMITS]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None:  # a channel's queue is part of its identity
            self.fields.pop("queue_name", None)
        carry_initial(self, EDITABLE_LIMITS)

    def clean_name(self) -> str:
        try:
            return validate_channel_name(as_typed(self, "name"))
        except InvalidChannel as exc:
            raise ValidationError(str(exc)) from None

    def clean_queue_name(self) -> str:
        if self.add_prefix("queue_name") not in self.data:
            return DEFAULT_QUEUE  # a post without the field (a script of before queues)
        queue = self.cleaned_data.get("queue_name") or ""
        try:
            return validate_queue_name(queue)
        except InvalidQueue as exc:
            text = str(exc)
            raise ValidationError(text[:1].upper() + text[1:]) from None

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        queue = data.get("queue_name")
        if "queue_name" in self.fields and queue and data.get("name"):
            # the row's name, as enqueue names it: unique among all queues' channels
            row = row_name(queue, data["name"])
            if len(row) > CHANNEL_NAME_MAX_LENGTH:
                self.add_error(
                    "name",
                    f"Channel name is too long for queue {queue!r}: queue and channel names "
                    f"and the one character between them take {len(row)} of the "
                    f"{CHANNEL_NAME_MAX_LENGTH} characters a channel row's name may have",
                )
            else:
                data["name"] = row
        check_limits(
            self, data, ("max_concurrency", "release_interval", "weight", "max_backlog"), "channel"
        )
        return data


class _AnyOf(Lookup):
    """``column = ANY(ids)``: membership in a list of ids passed as one text parameter
    (``1,2,3``), which PostgreSQL splits; dumping a Python list as an array parameter costs
    several microseconds per element on the client."""

    lookup_name = "fq_any_of"

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, tuple[Any, ...]]:
        lhs, lhs_params = self.process_lhs(compiler, connection)
        rhs, rhs_params = self.process_rhs(compiler, connection)
        return f"{lhs} = ANY(string_to_array({rhs}, ',')::bigint[])", (*lhs_params, *rhs_params)


def _among(queryset: QuerySet[Any], ids: Sequence[int]) -> QuerySet[Any]:
    """The rows of ``queryset`` whose id is in ``ids``, passed as one array parameter.

    ``pk__in=ids`` would put one placeholder per id into every query of the page (the count,
    the rows): with thousands of channels Django spends longer building the SQL, and
    PostgreSQL parsing it, than the database answering it. Passed as text (:class:`_AnyOf`).
    """
    if not ids:
        return queryset.none()
    return queryset.filter(_AnyOf(F("pk"), Value(",".join(str(int(i)) for i in ids))))


class HasFailuresFilter(admin.SimpleListFilter):
    """Channels keeping dead letters (failed messages, out of attempts) or none."""

    title = _("dead letters")
    parameter_name = "failures"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", str(_("has dead letters"))), ("no", str(_("no dead letters")))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "yes":
            return queryset.filter(failed_now__gt=0)
        if self.value() == "no":
            return queryset.filter(failed_now__lte=0)
        return queryset


class BacklogOverFilter(admin.SimpleListFilter):
    """Channels with more than N ready messages; any N works in the URL (``?backlog_over=250``)."""

    title = _("backlog (ready)")
    parameter_name = "backlog_over"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(str(n), f"over {n:,}") for n in (0, 100, 1_000, 10_000, 100_000)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        try:
            over = int(value)
        except ValueError:
            return queryset.none()
        return queryset.filter(backlog__gt=over)


class CapFilter(admin.SimpleListFilter):
    """Channels at their concurrency cap, or over it (after the cap was lowered)."""

    title = _("concurrency cap")
    parameter_name = "cap"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("at", str(_("at or over its cap"))), ("over", str(_("over its cap")))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        capped = queryset.filter(max_concurrency__isnull=False)
        if self.value() == "at":
            return capped.filter(running_now__gte=F("max_concurrency"))
        if self.value() == "over":
            return capped.filter(running_now__gt=F("max_concurrency"))
        return queryset


def _waited_since(value: str, unit: timedelta) -> datetime | None:
    """The database's clock less a wait of ``value`` units, given in a filter's URL (a
    negative wait counts as none); None when ``value`` is not a number or the wait reaches
    back before year 1, past the calendar: no channel has waited that long."""
    try:
        wait = max(float(value), 0.0) * unit  # NaN: ValueError; past timedelta: OverflowError
        return pg.select_clock() - wait  # before year 1: OverflowError
    except (ValueError, OverflowError):
        return None


class StarvingFilter(admin.SimpleListFilter):
    """Channels whose longest-waiting ready message has waited longer than N seconds
    (``?starving=60``): one index probe (per priority level) per channel with a backlog, the
    backlogged channels found by their counters, in one statement."""

    title = _("oldest ready waits")
    parameter_name = "starving"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(str(s), f"over {overview.format_age(s)}") for s in (10, 60, 600, 3600)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        cutoff = _waited_since(value, timedelta(seconds=1))
        if cutoff is None:
            return queryset.none()
        since = channel_store.select_backlogged_oldest_ready(using=conf.get().DATABASE)
        return _among(queryset, [cid for cid, t in since.items() if t < cutoff])


class UnservedFilter(admin.SimpleListFilter):
    """Channels starving under a backlog: not paused, ready messages waiting for more than N
    minutes, and nothing claimed from the channel in those N minutes (``?unserved=5``). Under a
    big backlog every channel's oldest message is old; only those the round passes over are
    also unserved."""

    title = _("served nothing while backlogged")
    parameter_name = "unserved"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(str(m), str(_("in %d min")) % m) for m in (1, 5, 15, 60)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        cutoff = _waited_since(value, timedelta(minutes=1))
        if cutoff is None:
            return queryset.none()
        since = channel_store.select_backlogged_oldest_ready(using=conf.get().DATABASE)
        waiting = _among(queryset, [cid for cid, t in since.items() if t < cutoff])
        # last_claimed_at: annotated by overview.annotate_counters (the scheduler's column)
        return waiting.filter(paused=False).filter(
            Q(last_claimed_at__lt=cutoff) | Q(last_claimed_at__isnull=True)
        )


class FailingFilter(admin.SimpleListFilter):
    """Channels failing now: an attempt failed (retried or for good, time limits and expired
    leases included) in the last minutes, or messages wait for a retry."""

    title = _("failing")
    parameter_name = "failing"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("yes", str(_("failed in the last %d minutes")) % overview.FINISHED_MINUTES),
            ("retrying", str(_("messages waiting for a retry"))),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "yes":
            failing = stats.failing_counts(overview.FINISHED_MINUTES)
            return _among(queryset, list(failing))
        if self.value() == "retrying":
            # only channels with scheduled messages can have retries waiting
            scheduled = [cid for cid, c in overview.all_counts().items() if c.scheduled > 0]
            retrying = channel_store.select_channel_retrying(scheduled, using=conf.get().DATABASE)
            return _among(queryset, list(retrying))
        return queryset


class ChannelChangeList(ChangeList):
    """Adds three things to the standard list: sorting by figures the database cannot order
    by (oldest ready age, and the statistics of the last minutes: wait p50, served, finished),
    computed for the filtered channels and then paged here; the page's figures fetched for the
    whole page at once (:func:`django_fairqueue.observe.overview.rows`); and whether any worker is
    alive, read once, so a running count no live worker renews does not look alive."""

    computed_order: tuple[str, bool] | None = None  # (pseudo-field, descending)

    def get_ordering(self, request: HttpRequest, queryset: QuerySet[Any]) -> list[Any]:
        ordering = super().get_ordering(request, queryset)
        kept = []
        for field in ordering:
            name = field.removeprefix("-") if isinstance(field, str) else ""
            if name == AGE_ORDER or name in FIGURE_ORDERS:
                if self.computed_order is None:  # the first sort key the user clicked
                    self.computed_order = (name, str(field).startswith("-"))
            else:
                kept.append(field)
        return kept

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        if self.computed_order is not None:
            self.result_list = self._by_computed(*self.computed_order)
        page = list(self.result_list)
        now = moments.now()
        found = {row.id: row for row in overview.rows([obj.pk for obj in page], now=now)}
        live = len(worker_registry.live(worker_registry.workers()))
        for obj in page:
            # Read by the column methods (ChannelAdmin.*_display, through _row).
            setattr(obj, "_fq_row", found.get(obj.pk))  # noqa: B010
            setattr(obj, "_fq_now", now)  # noqa: B010
            setattr(obj, "_fq_live", live)  # noqa: B010
        self.result_list = page

    def _by_computed(self, name: str, descending: bool) -> list[Channel]:
        ids = list(self.queryset.order_by().values_list("pk", flat=True))
        counts = overview.all_counts()
        if name == AGE_ORDER:
            ranked = overview.ranked_ids("age", counts=counts, among=ids)  # longest wait first
            waiting = [cid for cid in ranked if counts[cid].ready > 0]
            idle = [cid for cid in ranked if counts[cid].ready <= 0]
            # ascending age: the most recently ready first; nothing ready stays last
            ordered = (waiting if descending else waiting[::-1]) + idle
        else:
            figures = _figures(name, ids)
            with_figure = sorted(
                (cid for cid in ids if cid in figures and cid in counts),
                key=lambda cid: (figures[cid], counts[cid].name),
                reverse=descending,
            )
            # channels without the figure (nothing claimed in the window) last, by name
            without = sorted(
                (cid for cid in ids if cid not in figures and cid in counts),
                key=lambda cid: counts[cid].name,
            )
            ordered = with_figure + without
        if not (self.show_all and self.can_show_all) and self.multi_page:
            start = (self.page_num - 1) * self.list_per_page
            ordered = ordered[start : start + self.list_per_page]
        objects = self.queryset.order_by().in_bulk(ordered)
        return [objects[cid] for cid in ordered if cid in objects]


def _figures(name: str, ids: Sequence[int]) -> dict[int, float]:
    """{channel id: its figure ``name`` (of FIGURE_ORDERS) over the last FINISHED_MINUTES
    minutes}, for the channels of ``ids`` that have one (one statement over the window)."""
    # Read for every channel, then kept for ``ids``: thousands of ids as parameters would
    # cost more to send and plan than the window's rows cost to read.
    minutes = overview.FINISHED_MINUTES
    wanted = set(ids)
    figures: dict[int, float]
    if name == "wait_p50":
        waits = stats.wait_by_channel(minutes, None)
        figures = {cid: w.p50_ms for cid, w in waits.items() if w.p50_ms is not None}
    else:
        window = stats.window_stats(minutes)
        of = stats.served_of if name == "served_recent" else stats.finished_of
        figures = {cid: float(n) for cid, n in of(window).items()}
    return {cid: v for cid, v in figures.items() if cid in wanted}


def _row(obj: Channel) -> overview.ChannelRow | None:
    row: overview.ChannelRow | None = getattr(obj, "_fq_row", None)
    if row is None and getattr(obj, "_fq_now", None) is None:
        # Outside the change list (the change page, the shell): fetch this one row, once.
        now = moments.now()
        found = overview.rows([obj.pk], now=now)
        row = found[0] if found else None
        setattr(obj, "_fq_row", row)  # noqa: B010
        setattr(obj, "_fq_now", now)  # noqa: B010
    return row


def _stale_running(obj: Channel, row: overview.ChannelRow) -> str:
    """Why a channel's running count is not running anything (or ""): no live worker at all
    (the list reads the registry once: ``_fq_live``), or leases expired and not rescued yet."""
    if row.running <= 0:
        return ""
    live = getattr(obj, "_fq_live", None)
    if live is None:  # the change page: read here
        live = len(worker_registry.live(worker_registry.workers()))
        setattr(obj, "_fq_live", live)  # noqa: B010
    if live == 0:
        return str(_("no live worker"))
    if row.expired_leases:
        return str(_("%d lease expired")) % row.expired_leases
    return ""


@admin.register(Channel)
class ChannelAdmin(lists.NulSafeAdmin, ChannelAdminBase):
    class Media:
        css = {"all": ["django_fairqueue/admin.css"]}

    form = ChannelForm
    change_list_template = "admin/fairqueue/channel/change_list.html"
    # What a support engineer looks for first (backlog, running against the cap, how long the
    # oldest waits, failures), then the rest; the limits come last.
    list_display = [
        "name_display",  # "paused" shows beside the name: never off-screen
        "queue_display",
        "ready_display",
        "running_display",
        "oldest_ready_display",
        "last_served_display",
        "wait_display",
        "served_display",
        "finished_display",
        "failures_display",
        "timeouts_display",
        "retrying_display",
        "failed_display",
        "scheduled_display",
        "group_display",
        "weight",
        "release_interval_display",
        "max_backlog_display",
    ]
    list_filter = [
        lists.QueueFilter,
        CapFilter,
        StarvingFilter,
        UnservedFilter,
        FailingFilter,
        "paused",
        HasFailuresFilter,
        BacklogOverFilter,
        ("group", admin.RelatedOnlyFieldListFilter),
    ]
    # Facet counts would run every filter's query over all channels: not on a page view.
    show_facets = admin.ShowFacets.NEVER
    search_fields = ["name"]
    search_help_text = _("Channel name contains")
    list_per_page = 100
    # The unfiltered total is the table's size; one COUNT(*) of channels is cheap, but there is
    # no need for it twice per page.
    show_full_result_count = False
    actions = ["pause_channels", "resume_channels", "retry_failed", "purge_backlog"]
    # the channel's periodic schedules, read-only (django_fairqueue.admin.schedules)
    inlines = [ScheduleInline]
    fieldsets = [
        (None, {"fields": ["name", "queue", "group_display"]}),
        (
            _("Limits (take effect on the next claim)"),
            {"fields": list(EDITABLE_LIMITS)},
        ),
        (
            _("State"),
            {
                "fields": [
                    "counters_display",
                    "failures_display",
                    "timeouts_display",
                    "retrying_display",
                    "failed_display",
                    "why_waiting_display",
                    "oldest_ready_display",
                    "finished_display",
                    "last_claimed_display",
                    "created_display",
                ]
            },
        ),
    ]

    # -- queryset, permissions ------------------------------------------------------------

    def action_checkbox(self, obj: Channel) -> SafeString:
        # The same markup as Django's, without rendering a form widget template per row (a
        # third of the list's rendering time at 100 rows).
        return format_html(
            '<input type="checkbox" name="{}" value="{}" class="action-select" aria-label="{}">',
            helpers.ACTION_CHECKBOX_NAME,
            obj.pk,
            format_html(str(_("Select this object for an action - {}")), str(obj)),
        )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Channel]:
        qs = overview.annotate_counters(super().get_queryset(request).select_related("group"))
        # Constant stand-ins, so that Django can check an ordering that names a computed column
        # (ChannelChangeList takes it out and sorts by the figure itself).
        return qs.annotate(
            **{name: Value(0, output_field=IntegerField()) for name in (AGE_ORDER, *FIGURE_ORDERS)}
        )

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return ChannelChangeList

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, Any]:
        """A channel added here starts with FAIRQUEUE['CHANNEL_DEFAULTS'], as a channel that
        enqueue creates does (the form shows them; the operator may change them)."""
        defaults = dataclasses.asdict(conf.get().CHANNEL_DEFAULTS)
        return {**defaults, **super().get_changeform_initial_data(request)}

    def get_readonly_fields(self, request: HttpRequest, obj: Channel | None = None) -> list[str]:
        fields = ["counters_display", "failures_display", "timeouts_display"]
        fields += ["retrying_display", "failed_display"]
        fields += ["why_waiting_display", "oldest_ready_display", "finished_display"]
        fields += [
            "last_claimed_display",
            "created_display",
            "group_display",
            "queue",
            "name_display",
        ]
        if obj is not None:
            fields.append("name")  # the channel's identity: enqueue finds it by name
        return fields

    def get_inline_instances(self, request: HttpRequest, obj: Channel | None = None) -> Any:
        # The schedules inline only shows: a saved form has nothing of it to validate (and
        # needs no formset management data).
        if obj is None or request.method != "GET":
            return []
        return super().get_inline_instances(request, obj)

    def get_fieldsets(self, request: HttpRequest, obj: Channel | None = None) -> Any:
        if obj is None:  # adding: the name, its queue and the limits
            return [(None, {"fields": ["name", "queue_name"]}), self.fieldsets[1]]
        # the name within its queue, beside the queue
        return [(None, {"fields": ["name_display", "queue", "group_display"]}), *self.fieldsets[1:]]

    def has_delete_permission(self, request: HttpRequest, obj: Channel | None = None) -> bool:
        # Django's confirmation page would collect and list every message of the channel (a
        # million rows for a big tenant). Purge its backlog instead; deleting in code is safe.
        return False

    def has_purge_permission(self, request: HttpRequest) -> bool:
        return self.has_change_permission(request) and request.user.has_perm(
            f"{Message._meta.app_label}.delete_message"
        )

    def save_model(self, request: HttpRequest, obj: Channel, form: Any, change: bool) -> None:
        if not change:
            obj.save()
            return
        # Only the limits changed on the page (the form carries the values it showed): a
        # limit changed elsewhere since the page was loaded stays. (The scheduler's state is
        # no model field: no save can write it back.)
        fields = [name for name in EDITABLE_LIMITS if name in form.changed_data]
        if fields:
            with transaction.atomic(using=conf.get().DATABASE):
                obj.save(update_fields=fields)
                # A cap added to a busy channel must count the completions not folded yet,
                # or the channel looks full until maintenance folds them.
                channel_store.fold_deltas_of_channel(obj.pk)

    # -- columns ---------------------------------------------------------------------------

    @admin.display(description=_("name"), ordering="name")
    def name_display(self, obj: Channel) -> str:
        # the name within its queue (the row of channel "acme" in queue "reports" is named
        # "reports<U+001F>acme"; the queue has its own column); paused beside it, so a paused
        # tenant is never mistaken for a starving one, however narrow the screen
        if obj.paused:
            return format_html(
                '{} <span class="fq-badge fq-paused">{}</span>', obj.short_name, _("paused")
            )
        return obj.short_name

    @admin.display(description=_("queue"), ordering="queue")
    def queue_display(self, obj: Channel) -> str:
        # a link to the list of this queue's channels: any queue, not only those the filter
        # offers (the default queue and the registered tasks' queues)
        return format_html('<a href="?{}">{}</a>', urlencode({"queue": obj.queue}), obj.queue)

    @admin.display(description=_("group"), ordering="group__name")
    def group_display(self, obj: Channel) -> str:
        if obj.group_id is None:
            return "-"
        url = reverse("admin:fairqueue_channelgroup_change", args=[obj.group_id])
        return format_html('<a href="{}">{}</a>', url, obj.group.short_name if obj.group else "")

    @admin.display(description=_("ready"), ordering="backlog")
    def ready_display(self, obj: Channel) -> str:
        row = _row(obj)
        return f"{row.ready:,}" if row else "-"

    @admin.display(description=_("delayed"))
    def scheduled_display(self, obj: Channel) -> str:
        # delayed by their sender; retries waiting for their backoff have a column of their own
        row = _row(obj)
        return f"{row.delayed:,}" if row else "-"

    @admin.display(description=_("running / max"), ordering="running_now")
    def running_display(self, obj: Channel) -> str:
        row = _row(obj)
        if row is None:
            return "-"
        cap = obj.max_concurrency
        text = f"{row.running:,} / {'∞' if cap is None else f'{cap:,}'}"
        stale = _stale_running(obj, row)
        if stale:
            return format_html(
                '<span class="fq-stale" title="{}">{} ({})</span>', stale, text, stale
            )
        if cap is not None and row.running > cap:  # a cap lowered below what runs
            return format_html(
                '<span class="fq-over-cap" title="{}">{}</span>', _("over cap"), text
            )
        if cap is not None and row.running == cap:
            return format_html('<span class="fq-at-cap" title="{}">{}</span>', _("at cap"), text)
        return text

    @admin.display(description=format_lazy(_("failures {} min"), overview.FINISHED_MINUTES))
    def failures_display(self, obj: Channel) -> str:
        # attempts whose task raised in the last minutes, retried or dead-lettered
        row = _row(obj)
        if row is None:
            return "-"
        if not row.failures_recent:
            return "0"
        return format_html('<span class="fq-failed">{}</span>', f"{row.failures_recent:,}")

    @admin.display(description=format_lazy(_("timeouts {} min"), overview.FINISHED_MINUTES))
    def timeouts_display(self, obj: Channel) -> str:
        # attempts that ran past their time limit or lost their lease (rescued) in the last
        # minutes, retried or dead-lettered
        row = _row(obj)
        if row is None:
            return "-"
        if not row.timeouts_recent:
            return "0"
        return format_html('<span class="fq-failed">{}</span>', f"{row.timeouts_recent:,}")

    @admin.display(description=_("retrying"))
    def retrying_display(self, obj: Channel) -> str:
        # messages waiting out the backoff after a failed attempt
        row = _row(obj)
        if row is None:
            return "-"
        if not row.retrying:
            return "0"
        url = (
            reverse("admin:fairqueue_message_changelist")
            + "?"
            + urlencode({"channel__id__exact": str(obj.pk), "state__exact": "scheduled"})
        )
        return format_html('<a href="{}" class="fq-retrying">{}</a>', url, f"{row.retrying:,}")

    @admin.display(description=_("dead letters"), ordering="failed_now")
    def failed_display(self, obj: Channel) -> str:
        row = _row(obj)
        if row is None:
            return "-"
        if row.failed <= 0:
            return "0"
        url = (
            reverse("admin:fairqueue_message_changelist")
            + "?"
            + urlencode({"channel__id__exact": str(obj.pk), "state__exact": "failed"})
        )
        return format_html('<a href="{}" class="fq-failed">{}</a>', url, f"{row.failed:,}")

    @admin.display(description=_("release interval"), ordering="release_interval")
    def release_interval_display(self, obj: Channel) -> str:
        return duration(obj.release_interval)

    @admin.display(description=_("max backlog"), ordering="max_backlog")
    def max_backlog_display(self, obj: Channel) -> str:
        return "-" if obj.max_backlog is None else f"{obj.max_backlog:,}"

    @admin.display(description=_("oldest ready"), ordering=AGE_ORDER)
    def oldest_ready_display(self, obj: Channel) -> str:
        row = _row(obj)
        if row is None or row.oldest_ready_since is None:
            return "-"
        now: Any = getattr(obj, "_fq_now", None) or moments.now()
        return format_html(
            '<span title="ready since {}">{}</span>',
            timestamp(row.oldest_ready_since),
            overview.format_age(row.oldest_age(now)),
        )

    @admin.display(description=_("last served"), ordering="last_claimed_at")
    def last_served_display(self, obj: Channel) -> str:
        # when the claim last took a message of it: a backlogged channel not served for long
        # is starving (the filter "served nothing while backlogged" finds them all)
        row = _row(obj)
        if row is None or row.last_claimed_at is None:
            return "-"
        now: Any = getattr(obj, "_fq_now", None) or moments.now()
        age = max((now - row.last_claimed_at).total_seconds(), 0.0)
        late = row.ready > 0 and not obj.paused and age >= 60
        return format_html(
            '<span title="{}"{}>{} ago</span>',
            timestamp(row.last_claimed_at),
            mark_safe(' class="fq-failed"') if late else "",  # a constant
            overview.format_age(age),
        )

    @admin.display(
        description=format_lazy(_("served {} min"), overview.FINISHED_MINUTES),
        ordering="served_recent",
    )
    def served_display(self, obj: Channel) -> str:
        # messages claimed from it in the window: its share of the workers lately
        row = _row(obj)
        return f"{row.served_recent:,}" if row else "-"

    @admin.display(
        description=format_lazy(_("wait p50 {} min"), overview.FINISHED_MINUTES),
        ordering="wait_p50",
    )
    def wait_display(self, obj: Channel) -> str:
        # how long what it claimed lately waited: a backlog that moves slowly shows here
        # before its oldest message grows old
        row = _row(obj)
        if row is None or row.wait_p50_ms is None:
            return "-"
        return overview.format_ms(row.wait_p50_ms)

    @admin.display(
        description=format_lazy(_("finished {} min"), overview.FINISHED_MINUTES),
        ordering="finished_recent",
    )
    def finished_display(self, obj: Channel) -> str:
        row = _row(obj)
        return f"{row.finished_recent:,}" if row else "-"

    @admin.display(description=_("why it waits"))
    def why_waiting_display(self, obj: Channel) -> str:
        return waiting.channel(obj.pk).text

    @admin.display(description=_("created at"))
    def created_display(self, obj: Channel) -> str:
        return timestamp(obj.created_at)

    @admin.display(description=_("last served"))
    def last_claimed_display(self, obj: Channel) -> Any:
        # a scheduler column, read by the queryset (overview.annotate_counters), not a field
        moment = getattr(obj, "last_claimed_at", None)
        return overview.format_since(moment, moments.now()) if moment else "-"

    @admin.display(description=_("counts"))
    def counters_display(self, obj: Channel) -> str:
        row = _row(obj)
        if row is None:
            return "-"
        return (
            f"ready {row.ready:,}, delayed {row.delayed:,}, retrying {row.retrying:,}, "
            f"running {row.running:,}, dead letters {row.failed:,}, "
            f"succeeded {row.succeeded:,} in total"
        )

    # -- actions ---------------------------------------------------------------------------

    def _set_paused(self, request: HttpRequest, queryset: QuerySet[Channel], paused: bool) -> None:
        ids = list(queryset.values_list("pk", flat=True))
        changed = list(Channel.objects.filter(pk__in=ids, paused=not paused).order_by("pk"))
        # Only the paused column: an UPDATE of one non-counter column, never the counters.
        Channel.objects.filter(pk__in=[c.pk for c in changed]).update(paused=paused)
        if not paused:
            # A resumed channel is lifted to the others' virtual time (fairness by time): it
            # must not come back with the credit of the time it was paused.
            for channel in changed:
                channel_store.fold_deltas_of_channel(channel.pk)
        verb = "Paused" if paused else "Resumed"
        log_changes(request, changed, f"{verb} (admin action).")
        self.message_user(
            request,
            ngettext("%(verb)s %(n)d channel.", "%(verb)s %(n)d channels.", len(changed))
            % {"verb": verb, "n": len(changed)},
            messages.SUCCESS,
        )

    @admin.action(description=_("Pause selected channels"), permissions=["change"])
    def pause_channels(self, request: HttpRequest, queryset: QuerySet[Channel]) -> None:
        self._set_paused(request, queryset, True)

    @admin.action(description=_("Resume selected channels"), permissions=["change"])
    def resume_channels(self, request: HttpRequest, queryset: QuerySet[Channel]) -> None:
        self._set_paused(request, queryset, False)

    @admin.action(
        description=_("Retry failed messages of selected channels"), permissions=["change"]
    )
    def retry_failed(self, request: HttpRequest, queryset: QuerySet[Channel]) -> None:
        total = held = 0
        acted: list[Channel] = []
        for channel in queryset.order_by("pk"):
            n = 0
            after = 0
            while ids := message_store.select_failed_message_ids(
                channel_id=channel.pk, after_id=after, limit=ACTION_CHUNK
            ):
                retried, kept = failures.retry_reporting_held(ids)
                n += len(retried)
                held += len(kept)
                after = ids[-1]
            if n:
                acted.append(channel)
                log_changes(request, [channel], f"Retried {n} failed messages (admin action).")
            total += n
        self.message_user(
            request,
            ngettext(
                "Retried %(n)d failed message of %(channels)s.",
                "Retried %(n)d failed messages of %(channels)s.",
                total,
            )
            % {"n": total, "channels": _channels(len(acted))},
            messages.SUCCESS,
        )
        if held:
            self.message_user(request, key_held_note(held), messages.WARNING)

    @admin.action(description=_("Purge backlog of selected channels…"), permissions=["purge"])
    def purge_backlog(
        self, request: HttpRequest, queryset: QuerySet[Channel]
    ) -> TemplateResponse | None:
        channels = list(queryset.order_by("name"))
        counters = {
            c.id: c for c in channel_store.select_channel_counters([c.pk for c in channels])
        }
        if request.POST.get("post") == "yes":
            total = 0
            for channel in channels:
                n = message_store.purge_channel_backlog(channel.pk)
                total += n
                log_changes(
                    request, [channel], f"Purged the backlog: {n} waiting messages deleted."
                )
            self.message_user(
                request,
                ngettext(
                    "Deleted %(n)d waiting message from %(channels)s.",
                    "Deleted %(n)d waiting messages from %(channels)s.",
                    total,
                )
                % {"n": total, "channels": _channels(len(channels))},
                messages.SUCCESS,
            )
            return None
        lines: list[dict[str, Any]] = []
        retrying = channel_store.select_channel_retrying(
            [cid for cid, c in counters.items() if c.scheduled > 0]
        )
        for channel in channels:
            c = counters.get(channel.pk)
            ready, scheduled = (c.ready, c.scheduled) if c else (0, 0)
            again = retrying.get(channel.pk, 0)
            lines.append(
                {
                    "channel": channel,
                    "ready": ready,
                    "scheduled": scheduled,
                    "delayed": max(scheduled - again, 0),
                    "retrying": again,
                }
            )
        context = {
            **self.admin_site.each_context(request),
            "title": _("Purge the backlog?"),
            "opts": self.model._meta,
            "lines": lines,
            "total": sum(x["ready"] + x["scheduled"] for x in lines),
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "media": self.media,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/fairqueue/channel/purge_confirmation.html", context)

    # -- dashboard -------------------------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        wrap: Callable[..., Any] = self.admin_site.admin_view
        return [
            path(
                "dashboard/",
                wrap(self.dashboard_view),
                name="fairqueue_channel_dashboard",
            ),
            path(
                "dashboard/data/",
                wrap(self.dashboard_data_view),
                name="fairqueue_channel_dashboard_data",
            ),
            *super().get_urls(),
        ]

    def _dashboard_params(self, request: HttpRequest) -> dict[str, Any]:
        sort = request.GET.get("sort", "backlog")
        if sort not in overview.SORTS:
            sort = "backlog"
        queue = request.GET.get("queue") or None
        if queue is not None:
            try:
                validate_queue_name(queue)
            except InvalidQueue:
                queue = None  # as a bad sort: the default view (every queue)
        return {
            "sort": sort,
            "limit": _int_param(request, "limit", 20, 1, DASHBOARD_MAX_TENANTS),
            "window": _int_param(request, "window", 5, 1, 60),
            "queue": queue,
        }

    def dashboard_view(self, request: HttpRequest) -> TemplateResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        params = self._dashboard_params(request)
        context = {
            **self.admin_site.each_context(request),
            "title": _("Fair queue dashboard"),
            "opts": self.model._meta,
            "data": overview.dashboard(**params),
            "params": params,
            "sorts": overview.SORTS,
            "queues": lists.QueueFilter.known_queues(params["queue"]),
            "data_url": reverse(f"{self.admin_site.name}:fairqueue_channel_dashboard_data"),
            "refresh_seconds": _int_param(request, "refresh", 5, 1, 300),
            # what holds the xmin horizon back (a long transaction slows every claim)
            "xmin_horizon": [horizon.as_dict(h) for h in horizon.holders()],
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/fairqueue/dashboard.html", context)

    def dashboard_data_view(self, request: HttpRequest) -> JsonResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        data = overview.dashboard(**self._dashboard_params(request))
        data["xmin_horizon"] = [horizon.as_dict(h) for h in horizon.holders()]
        return JsonResponse(data)


def _int_param(request: HttpRequest, name: str, default: int, low: int, high: int) -> int:
    try:
        value = int(request.GET.get(name, default))
    except ValueError:
        return default
    return min(max(value, low), high)


def _channels(n: int) -> str:
    return ngettext("%(n)d channel", "%(n)d channels", n) % {"n": n}


def key_held_note(n: int) -> str:
    """What a retry action says of the ``n`` failed messages it left failed because another
    message holds their unique key (``failures.key_held``); the message admin's says it too."""
    return ngettext(
        "%(n)d failed message stays failed: another message holds its unique key and does "
        "its work.",
        "%(n)d failed messages stay failed: other messages hold their unique keys and do "
        "their work.",
        n,
    ) % {"n": n}

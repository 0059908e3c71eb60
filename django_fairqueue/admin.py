"""The admin: tenants (channels) to see and steer, messages and work batches to act on, and a
dashboard.

* **Channels**: the per-tenant table (docs/howto/admin.md explains each column), editable
  limits, and actions (pause, resume, retry failed, purge backlog with a confirmation page).
  The list stays fast with many channels: counts of the page come from the counters plus
  pending deltas in a few queries for the whole page (:mod:`django_fairqueue.overview`), never
  a COUNT(*) of messages per row.
* **Messages** and **work batches** are read-only; their actions (retry, cancel, delete) go
  through :mod:`django_fairqueue.db`, like the Python API, so counters stay exact.
* **Schedules**: periodic schedules, with their next fire time
  (:mod:`django_fairqueue.schedule_admin`); a channel's page lists its own.
* **Usage per tenant**: worker time, attempts and failures per channel or group over a range
  of days, sortable, as CSV too (:mod:`django_fairqueue.usage_admin`).
* **Dashboard** at ``<admin>/fairqueue/channel/dashboard/``: charts drawn in the browser by a
  small script shipped with the app, refreshed from a JSON endpoint next to it.

Permissions: viewing needs the model's view (or change) permission, as usual. Editing a
channel, pause, resume and retry need *change channel*; purge also needs *delete message*.
Message retry and cancel need *change message*, message delete needs *delete message*; work
batch retry needs *change work batch*. Channels and messages are never deleted through the
ORM here (that would bypass the counters). Every action writes admin log entries.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.db.models import F, IntegerField, Lookup, Q, QuerySet, Value
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import format_lazy
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext
from django.views.decorators.http import require_POST

from django_fairqueue import (
    adminlist,
    api,
    batches,
    conf,
    failures,
    horizon,
    overview,
    registry,
    stats,
    waiting,
)
from django_fairqueue.api import validate_channel_name, validate_group_name
from django_fairqueue.db import batch_store, channel_store, message_store, pg
from django_fairqueue.exceptions import InvalidChannel, InvalidQueue
from django_fairqueue.limits import CHANNEL_NAME_MAX_LENGTH
from django_fairqueue.models import (
    BatchState,
    Channel,
    ChannelGroup,
    Message,
    MessageState,
    WorkBatch,
    WorkerRecord,
)
from django_fairqueue.queues import DEFAULT_QUEUE, row_name, validate_queue_name
from django_fairqueue.schedule_admin import ScheduleAdmin, ScheduleInline
from django_fairqueue.usage_admin import UsageAdmin

__all__ = [
    "ChannelAdmin",
    "ChannelGroupAdmin",
    "MessageAdmin",
    "ScheduleAdmin",
    "UsageAdmin",
    "WorkBatchAdmin",
    "WorkerAdmin",
]

if TYPE_CHECKING:
    _ChannelAdminBase = admin.ModelAdmin[Channel]
    _GroupAdminBase = admin.ModelAdmin[ChannelGroup]
    _GroupFormBase = forms.ModelForm[ChannelGroup]
    _MessageAdminBase = admin.ModelAdmin[Message]
    _WorkBatchAdminBase = admin.ModelAdmin[WorkBatch]
    _WorkerAdminBase = admin.ModelAdmin[WorkerRecord]
    _ChannelFormBase = forms.ModelForm[Channel]
else:  # the generic aliases exist only for type checkers (no django-stubs-ext at run time)
    _ChannelAdminBase = _MessageAdminBase = _WorkBatchAdminBase = admin.ModelAdmin
    _WorkerAdminBase = _GroupAdminBase = admin.ModelAdmin
    _ChannelFormBase = _GroupFormBase = forms.ModelForm

#: The limits an operator edits; a change saves only these columns (see ChannelAdmin.save_model).
EDITABLE_LIMITS = ("max_concurrency", "release_interval", "weight", "max_backlog", "paused")
#: Ids per database call in bulk actions: each statement's locks and WAL stay bounded.
ACTION_CHUNK = 1000
#: The pseudo-field the "oldest ready" column sorts by (sorted in Python, see ChannelChangeList).
AGE_ORDER = "oldest_ready_age"
#: Pseudo-fields of columns whose figures come from the per-minute statistics, sorted in
#: Python over every channel of the filtered list (ChannelChangeList): the database holds no
#: column to order them by.
FIGURE_ORDERS = ("wait_p50", "served_recent", "finished_recent")
#: Most tenants the dashboard shows (and its JSON accepts).
DASHBOARD_MAX_TENANTS = 100


def _log_changes(request: HttpRequest, objects: Sequence[Any], message: str) -> None:
    """One admin log entry (CHANGE) per object, in one INSERT."""
    if objects:
        LogEntry.objects.log_actions(
            user_id=request.user.pk or 0,  # the admin only lets signed-in users this far
            queryset=objects,
            action_flag=CHANGE,
            change_message=message,
        )


def _as_typed(form: forms.BaseForm, field: str) -> Any:
    """A name as submitted, before the form field strips it: Python counts control characters
    such as U+001F as blanks, so a stripped ``"\x1fx"`` would save channel ``"x"`` instead of
    refusing a name enqueue refuses. The name checks then say what is wrong."""
    cleaned = form.cleaned_data[field]
    raw = form.data.get(form.add_prefix(field))
    return raw if isinstance(raw, str) else cleaned


# ============================================================================================
# Channel groups

GROUP_LIMITS = ("weight", "max_concurrency", "release_interval")


class ChannelGroupForm(_GroupFormBase):
    """A channel group's name and limits, checked as enqueue and channel limits are."""

    class Meta:
        model = ChannelGroup
        fields = ["name", *GROUP_LIMITS]

    def clean_name(self) -> str:
        try:
            return validate_group_name(_as_typed(self, "name"))
        except InvalidChannel as exc:
            raise ValidationError(str(exc)) from None

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        for name in GROUP_LIMITS:
            if name not in data or name in self.errors:
                continue
            value = data[name]
            if value is None and name == "release_interval":
                value = timedelta(0)
            if value is None and name == "weight":
                value = 1
            try:
                conf.validate_channel_limits(**{name: value}, where="group")
            except ValueError as exc:
                text = str(exc).removeprefix("group ")
                label = name.replace("_", " ")
                self.add_error(name, label.capitalize() + text.removeprefix(name))
        return data


@admin.register(ChannelGroup)
class ChannelGroupAdmin(adminlist.NulSafeAdmin, _GroupAdminBase):
    """Channel groups: the operator edits weight, cap and rate limit; the claim's state
    (sums over the channels, turn, tag) is shown read-only and is no model field."""

    form = ChannelGroupForm
    list_display = [
        "name_display",
        "queue",
        "channels_display",
        "ready_display",
        "running_display",
        "weight",
        "release_interval_display",
    ]
    search_fields = ["name"]
    list_filter = [adminlist.QueueFilter]
    list_per_page = 100
    show_full_result_count = False
    fieldsets = [
        (None, {"fields": ["name"]}),
        (_("Limits (take effect on the next claim)"), {"fields": list(GROUP_LIMITS)}),
        (_("State"), {"fields": ["state_display", "channels_link", "created_at"]}),
    ]

    @admin.display(description=_("name"), ordering="name")
    def name_display(self, obj: ChannelGroup) -> str:
        return obj.short_name

    def get_readonly_fields(
        self, request: HttpRequest, obj: ChannelGroup | None = None
    ) -> list[str]:
        fields = ["state_display", "channels_link", "created_at", "name_display", "queue"]
        if obj is not None:
            fields.append("name")  # the group's identity: channel names refer to it
        return fields

    def get_fieldsets(self, request: HttpRequest, obj: ChannelGroup | None = None) -> Any:
        if obj is None:
            return self.fieldsets[:2]
        return [(None, {"fields": ["name_display", "queue"]}), *self.fieldsets[1:]]

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        cl = super().get_changelist_instance(request)
        states = {g.id: g for g in channel_store.select_group_state([o.pk for o in cl.result_list])}
        for obj in cl.result_list:
            setattr(obj, "_fq_state", states.get(obj.pk))  # noqa: B010
        return cl

    def save_model(self, request: HttpRequest, obj: ChannelGroup, form: Any, change: bool) -> None:
        if not change:
            obj.save()  # takes in the existing channels named "<group>/..."
            return
        fields = [name for name in GROUP_LIMITS if name in form.changed_data]
        if fields:
            with transaction.atomic(using=conf.get().DATABASE):
                obj.save(update_fields=fields)
                # a rate limit removed or shortened must not leave the group due later
                channel_store.rearm_group(obj.pk)

    def delete_model(self, request: HttpRequest, obj: ChannelGroup) -> None:
        super().delete_model(request, obj)
        channel_store.forget_groups()

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[ChannelGroup]) -> None:
        super().delete_queryset(request, queryset)
        channel_store.forget_groups()

    def _state(self, obj: ChannelGroup) -> channel_store.GroupState | None:
        state: channel_store.GroupState | None = getattr(obj, "_fq_state", None)
        if state is None:
            found = channel_store.select_group_state([obj.pk])
            state = found[0] if found else None
            setattr(obj, "_fq_state", state)  # noqa: B010
        return state

    @admin.display(description=_("channels"))
    def channels_display(self, obj: ChannelGroup) -> str:
        state = self._state(obj)
        return f"{state.channels:,}" if state else "-"

    @admin.display(description=_("ready"))
    def ready_display(self, obj: ChannelGroup) -> str:
        state = self._state(obj)
        return f"{state.ready:,}" if state else "-"

    @admin.display(description=_("running / max"))
    def running_display(self, obj: ChannelGroup) -> str:
        state = self._state(obj)
        if state is None:
            return "-"
        cap = obj.max_concurrency
        return f"{state.running:,} / {'∞' if cap is None else f'{cap:,}'}"

    @admin.display(description=_("rate limit"))
    def release_interval_display(self, obj: ChannelGroup) -> str:
        return _duration(obj.release_interval)

    @admin.display(description=_("state"))
    def state_display(self, obj: ChannelGroup) -> str:
        state = self._state(obj)
        if state is None:
            return "-"
        return format_html(
            "{} ready, {} running, {} of {} channels claimable; next turn {}, virtual time {} s",
            f"{state.ready:,}",
            f"{state.running:,}",
            f"{state.claimable:,}",
            f"{state.channels:,}",
            _timestamp(state.next_turn_at),
            f"{state.vtime:.3f}",
        )

    @admin.display(description=_("channels"))
    def channels_link(self, obj: ChannelGroup) -> str:
        url = (
            reverse("admin:fairqueue_channel_changelist")
            + "?"
            + urlencode({"group__id__exact": str(obj.pk)})
        )
        return format_html('<a href="{}">{}</a>', url, _("the group's channels"))


def _chunks(ids: Sequence[int], size: int = ACTION_CHUNK) -> Iterator[list[int]]:
    for start in range(0, len(ids), size):
        yield list(ids[start : start + size])


def _ids_of(queryset: QuerySet[Any]) -> Iterator[list[int]]:
    """The primary keys of ``queryset`` in chunks, paged by id (also for "select all")."""
    after = 0
    while True:
        chunk = list(
            queryset.filter(pk__gt=after).order_by("pk").values_list("pk", flat=True)[:ACTION_CHUNK]
        )
        if not chunk:
            return
        yield chunk
        after = chunk[-1]


def _pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


def _error_summary(error: Any) -> str:
    """``Type: message`` of a stored error, on one line, at most 100 characters."""
    if not isinstance(error, dict):
        return ""
    text = " ".join(f"{error.get('type') or 'error'}: {error.get('message') or ''}".split())
    return text if len(text) <= 100 else text[:97] + "..."


def _error_html(error: Any) -> str:
    """A stored error: type and message, other details as JSON, the traceback as written."""
    if error is None:
        return "-"
    if not isinstance(error, dict):
        return format_html('<pre class="fq-json">{}</pre>', _pretty_json(error))
    details = {k: v for k, v in error.items() if k not in ("type", "message", "traceback")}
    return format_html(
        '<div class="fq-error"><strong>{}</strong>: {}{}{}</div>',
        error.get("type") or "error",
        error.get("message") or "",
        format_html('<pre class="fq-json">{}</pre>', _pretty_json(details)) if details else "",
        format_html('<pre class="fq-traceback">{}</pre>', error["traceback"])
        if error.get("traceback")
        else "",
    )


def _timestamp(value: datetime | None) -> str:
    """``2026-11-25 21:04:05`` in the current time zone; ``-`` for None."""
    return overview.format_time(value)


def _parse_time(text: Any) -> datetime | None:
    """A timestamp the database wrote into JSON (ISO 8601), or None."""
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


def _duration(value: timedelta | None) -> str:
    if not value:
        return "0"
    seconds = value.total_seconds()
    if seconds < 60:
        return f"{seconds:g}s"
    return overview.format_age(seconds)


# ============================================================================================
# Channels


class ChannelForm(_ChannelFormBase):
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

    def clean_name(self) -> str:
        try:
            return validate_channel_name(_as_typed(self, "name"))
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
                    f"together take {len(row)} of the {CHANNEL_NAME_MAX_LENGTH} characters a "
                    "channel row's name may have",
                )
            else:
                data["name"] = row
        defaults = {"max_concurrency": None, "release_interval": timedelta(0), "weight": 1}
        # One limit at a time, so each message lands under its own field.
        for name in ("max_concurrency", "release_interval", "weight", "max_backlog"):
            if name not in data or name in self.errors:
                continue
            value = data[name]
            if value is None and name in ("release_interval", "weight"):
                value = defaults[name]
            try:
                conf.validate_channel_limits(**{name: value}, where="channel")
            except ValueError as exc:
                # "channel max_concurrency must be ..." -> "Max concurrency must be ..."
                text = str(exc).removeprefix("channel ")
                label = name.replace("_", " ")
                self.add_error(name, label.capitalize() + text.removeprefix(name))
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
        try:
            seconds = float(value)
        except ValueError:
            return queryset.none()
        since = channel_store.select_backlogged_oldest_ready(using=conf.get().DATABASE)
        cutoff = pg.select_clock() - timedelta(seconds=seconds)
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
        try:
            minutes = float(value)
        except ValueError:
            return queryset.none()
        cutoff = pg.select_clock() - timedelta(minutes=minutes)
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
    whole page at once (:func:`django_fairqueue.overview.rows`); and whether any worker is
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
        now = timezone.now()
        found = {row.id: row for row in overview.rows([obj.pk for obj in page], now=now)}
        live = len(registry.live(registry.workers()))
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
        now = timezone.now()
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
        live = len(registry.live(registry.workers()))
        setattr(obj, "_fq_live", live)  # noqa: B010
    if live == 0:
        return str(_("no live worker"))
    if row.expired_leases:
        return str(_("%d lease expired")) % row.expired_leases
    return ""


@admin.register(Channel)
class ChannelAdmin(adminlist.NulSafeAdmin, _ChannelAdminBase):
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
        adminlist.QueueFilter,
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
    # the channel's periodic schedules, read-only (django_fairqueue.schedule_admin)
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
        # Only the limits that changed: another operator's edit of another limit, made since
        # this form was loaded, stays. (The scheduler's state is no model field: no save can
        # write it back.)
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
        return _duration(obj.release_interval)

    @admin.display(description=_("max backlog"), ordering="max_backlog")
    def max_backlog_display(self, obj: Channel) -> str:
        return "-" if obj.max_backlog is None else f"{obj.max_backlog:,}"

    @admin.display(description=_("oldest ready"), ordering=AGE_ORDER)
    def oldest_ready_display(self, obj: Channel) -> str:
        row = _row(obj)
        if row is None or row.oldest_ready_since is None:
            return "-"
        now: Any = getattr(obj, "_fq_now", None) or timezone.now()
        return format_html(
            '<span title="ready since {}">{}</span>',
            _timestamp(row.oldest_ready_since),
            overview.format_age(row.oldest_age(now)),
        )

    @admin.display(description=_("last served"), ordering="last_claimed_at")
    def last_served_display(self, obj: Channel) -> str:
        # when the claim last took a message of it: a backlogged channel not served for long
        # is starving (the filter "served nothing while backlogged" finds them all)
        row = _row(obj)
        if row is None or row.last_claimed_at is None:
            return "-"
        now: Any = getattr(obj, "_fq_now", None) or timezone.now()
        age = max((now - row.last_claimed_at).total_seconds(), 0.0)
        late = row.ready > 0 and not obj.paused and age >= 60
        return format_html(
            '<span title="{}"{}>{} ago</span>',
            _timestamp(row.last_claimed_at),
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
        return _timestamp(obj.created_at)

    @admin.display(description=_("last served"))
    def last_claimed_display(self, obj: Channel) -> Any:
        # a scheduler column, read by the queryset (overview.annotate_counters), not a field
        moment = getattr(obj, "last_claimed_at", None)
        return overview.format_since(moment, timezone.now()) if moment else "-"

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
        _log_changes(request, changed, f"{verb} (admin action).")
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
        total = 0
        acted: list[Channel] = []
        for channel in queryset.order_by("pk"):
            n = 0
            after = 0
            while ids := message_store.select_failed_message_ids(
                channel_id=channel.pk, after_id=after, limit=ACTION_CHUNK
            ):
                n += len(message_store.retry_failed_messages(ids))
                after = ids[-1]
            if n:
                acted.append(channel)
                _log_changes(request, [channel], f"Retried {n} failed messages (admin action).")
            total += n
        self.message_user(
            request,
            ngettext(
                "Retried %(n)d failed message of %(c)d channels.",
                "Retried %(n)d failed messages of %(c)d channels.",
                total,
            )
            % {"n": total, "c": len(acted)},
            messages.SUCCESS,
        )

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
                _log_changes(
                    request, [channel], f"Purged the backlog: {n} waiting messages deleted."
                )
            self.message_user(
                request,
                ngettext(
                    "Deleted %(n)d waiting message from %(c)d channels.",
                    "Deleted %(n)d waiting messages from %(c)d channels.",
                    total,
                )
                % {"n": total, "c": len(channels)},
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
            "queues": adminlist.QueueFilter.known_queues(params["queue"]),
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


# ============================================================================================
# Messages


@admin.register(Message)
class MessageAdmin(adminlist.NulSafeAdmin, _MessageAdminBase):
    """Messages at any scale (a million rows and more): an estimated count, pages by cursor over
    the two sorts an index serves, filters that never scan the table for their choices, and a
    search on ids and task names (:mod:`django_fairqueue.adminlist`)."""

    @property
    def media(self) -> forms.Media:
        return (
            super().media
            + adminlist.channel_widget(self.admin_site).media
            + forms.Media(
                css={"all": ["django_fairqueue/admin.css"]},
                # after jquery.init.js, which defines the django.jQuery it runs on (Media
                # merges lists by their relative order; alone it could come first)
                js=["admin/js/jquery.init.js", "django_fairqueue/channel_filter.js"],
            )
        )

    change_list_template = "admin/fairqueue/message/change_list.html"
    # What a running message is doing first (its worker, for how long, its lease), so they
    # stay on screen at 1440 px; the times and the error after.
    list_display = [
        "id",
        "channel_link",
        "task_name",
        "state",
        "attempts_display",
        "worker_link",
        "running_for_display",
        "lease_display",
        "enqueued_display",
        "run_at_display",
        "finished_display",
        "priority",
        "error_summary",
    ]
    list_filter = [
        "state",
        adminlist.TaskNameFilter,
        adminlist.MessageQueueFilter,
        adminlist.ChannelFilter,
        adminlist.WorkerFilter,
    ]
    list_select_related = ["channel"]
    ordering = ["-id"]  # newest first (a backward scan of the primary key)
    #: The sorts a list page may take, each an index's order (adminlist.KeysetChangeList); the
    #: first is the default (descending).
    keyset_orders = {"id": ("id",), "channel_link": ("channel_id", "id")}
    sortable_by = list(keyset_orders)
    search_fields = ["=id", "task_name"]  # get_search_results says how each is matched
    search_help_text = _(
        "A message id, or a task name or the start of one (case-sensitive, e.g. reports.)"
    )
    # Facets would count every filter choice over the whole table.
    show_facets = admin.ShowFacets.NEVER
    show_full_result_count = False
    actions = ["retry_messages", "cancel_messages", "abort_messages", "delete_messages"]
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "id",
                    "channel_link",
                    "task_name",
                    "state",
                    "why_waiting_display",
                    "priority",
                    "attempts_display",
                    "keep_result",
                    "unique_key",
                    "unique_scope",
                    "abort_requested_display",
                ]
            },
        ),
        (
            _("Times"),
            {
                "fields": [
                    "enqueued_display",
                    "run_at_display",
                    "claimed_display",
                    "finished_display",
                ]
            },
        ),
        (
            _("Lease"),
            {
                "fields": [
                    "worker_link",
                    "running_for_display",
                    "lease_display",
                    "lease_token",
                ]
            },
        ),
        (_("Payload and result"), {"fields": ["payload_display", "result_display"]}),
        (_("Error"), {"fields": ["error_display", "errors_display"]}),
    ]
    readonly_fields = [
        "id",
        "channel_link",
        "task_name",
        "state",
        "priority",
        "attempts_display",
        "keep_result",
        "unique_key",
        "unique_scope",
        "abort_requested_display",
        "enqueued_display",
        "run_at_display",
        "claimed_display",
        "finished_display",
        "worker_link",
        "running_for_display",
        "lease_display",
        "lease_token",
        "payload_display",
        "result_display",
        "error_display",
        "errors_display",
    ]
    change_form_template = "admin/fairqueue/message/change_form.html"

    # The checkbox without a widget template per row (see ChannelAdmin.action_checkbox).
    action_checkbox = ChannelAdmin.action_checkbox  # type: ignore[assignment]

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return adminlist.KeysetChangeList

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Message], search_term: str
    ) -> tuple[QuerySet[Message], bool]:
        """A whole number is a message id; anything else matches task names equal to it or
        starting with it (case-sensitive, so the match is a plain comparison)."""
        term = search_term.strip()
        if not term:
            return queryset, False
        if term.isdigit():
            return queryset.filter(pk=int(term)), False
        return queryset.filter(task_name__startswith=term), False

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # The links of a page share their URL prefixes (one reverse() each, not one a row);
        # they are the same for every request, unlike the clock (get_changelist_instance).
        self._urls = {
            "channel": reverse("admin:fairqueue_channel_changelist"),
            "workers": reverse("admin:fairqueue_workerrecord_changelist"),
        }
        return super().changelist_view(request, extra_context)

    @admin.display(description=_("why it waits"))
    def why_waiting_display(self, obj: Message) -> str:
        return waiting.message(obj).text

    # Read-only: no add, no ORM change or delete. The actions below are the only writes, and
    # they have permissions of their own (has_act_permission, has_remove_permission).
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Message | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Message | None = None) -> bool:
        return False

    def has_view_permission(self, request: HttpRequest, obj: Message | None = None) -> bool:
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.view_message") or request.user.has_perm(
            f"{opts.app_label}.change_message"
        )

    def has_act_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.change_message")

    def has_remove_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.delete_message")

    # -- one message's buttons: retry, cancel, abort ---------------------------------------

    #: The buttons of a message's page: verb -> (label, the states it applies to).
    BUTTONS: dict[str, tuple[Any, tuple[str, ...]]] = {
        "retry": (_("Retry"), (MessageState.FAILED,)),
        "cancel": (_("Cancel"), (MessageState.READY, MessageState.SCHEDULED)),
        "abort": (_("Abort"), (MessageState.RUNNING,)),
    }

    def get_urls(self) -> list[URLPattern]:
        return [
            path(
                "<int:object_id>/act/<str:verb>/",
                self.admin_site.admin_view(require_POST(self.act_view)),
                name="fairqueue_message_act",
            ),
            *super().get_urls(),
        ]

    def buttons(self, request: HttpRequest, obj: Message) -> list[dict[str, Any]]:
        """The buttons this user may press on this message's page, in its state."""
        if not self.has_act_permission(request):
            return []
        out = []
        for verb, (label, states) in self.BUTTONS.items():
            if obj.state in states and not (verb == "abort" and obj.abort_requested_at):
                url = reverse(f"{self.admin_site.name}:fairqueue_message_act", args=[obj.pk, verb])
                out.append({"verb": verb, "label": label, "url": url})
        return out

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        obj = self.get_object(request, object_id)
        context = {"fq_buttons": self.buttons(request, obj) if obj is not None else []}
        return super().change_view(
            request, object_id, form_url, {**context, **(extra_context or {})}
        )

    def act_view(self, request: HttpRequest, object_id: int, verb: str) -> HttpResponseRedirect:
        """A button of a message's page: the public API's retry, cancel or abort of this one
        message, logged; the page then says what happened (nothing, if its state moved on)."""
        if not self.has_act_permission(request):
            raise PermissionDenied
        if verb not in self.BUTTONS:
            raise Http404(f"no such action: {verb}")
        obj = Message.objects.filter(pk=object_id).only("id", "task_name", "state").first()
        if obj is None:
            raise Http404(f"no message {object_id}")
        if verb == "retry":
            done = bool(failures.retry([obj.pk]))
            text = _("Retried: ready again with a fresh attempt budget.")
        elif verb == "cancel":
            done = bool(api.cancel([obj.pk]))
            text = _("Cancelled.")
        else:
            outcome = api.abort([obj.pk]).get(obj.pk)
            done = outcome is not None
            text = (
                _("Cancelled (it was waiting).")
                if outcome == "cancelled"
                else _(
                    "Abort requested: it ends aborted once its task stops, or after the "
                    "abort grace period."
                )
            )
        if done:
            _log_changes(request, [obj], f"{verb.capitalize()} (admin button).")
            self.message_user(request, text, messages.SUCCESS)
        else:
            self.message_user(
                request,
                _("Nothing done: the message is no longer %(state)s.") % {"state": obj.state},
                messages.WARNING,
            )
        return HttpResponseRedirect(
            reverse(f"{self.admin_site.name}:fairqueue_message_change", args=[obj.pk])
        )

    # -- columns ---------------------------------------------------------------------------

    def _url(self, name: str) -> str:
        urls: dict[str, str] = getattr(self, "_urls", {})
        if name in urls:
            return urls[name]
        return reverse(
            "admin:fairqueue_channel_changelist"
            if name == "channel"
            else "admin:fairqueue_workerrecord_changelist"
        )

    @admin.display(description=_("channel"), ordering="channel_id")
    def channel_link(self, obj: Message) -> str:
        # <changelist>/<id>/change/: the admin's own URL of an object's page
        url = f"{self._url('channel')}{obj.channel_id}/change/"
        return format_html('<a href="{}">{}</a>', url, str(obj.channel))

    # Times, formatted directly and to the second, as on every fairqueue page (Django's
    # localized formatting shows minutes, and costs ten times more: a fifth of the list's
    # rendering at 100 rows).
    @admin.display(description=_("enqueued at"))
    def enqueued_display(self, obj: Message) -> str:
        return _timestamp(obj.enqueued_at)

    @admin.display(description=_("run at"))
    def run_at_display(self, obj: Message) -> str:
        return _timestamp(obj.run_at)

    @admin.display(description=_("finished at"))
    def finished_display(self, obj: Message) -> str:
        return _timestamp(obj.finished_at)

    @admin.display(description=_("claimed at"))
    def claimed_display(self, obj: Message) -> str:
        return _timestamp(obj.claimed_at)

    @admin.display(description=_("abort requested at"))
    def abort_requested_display(self, obj: Message) -> str:
        return _timestamp(obj.abort_requested_at)

    @admin.display(description=_("attempts"))
    def attempts_display(self, obj: Message) -> str:
        return f"{obj.attempts} / {obj.max_attempts}"

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        cl = super().get_changelist_instance(request)
        # The columns of running messages are relative to the database's clock, read once per
        # page and kept on the page's rows: never on this admin, which every request shares.
        now = pg.select_clock()
        for obj in cl.result_list:
            setattr(obj, "_fq_now", now)  # noqa: B010
        return cl

    @staticmethod
    def _clock(obj: Message) -> datetime:
        """The database's clock of this request: the list's, or read once for a detail page."""
        now: datetime | None = getattr(obj, "_fq_now", None)
        if now is None:
            now = pg.select_clock()
            setattr(obj, "_fq_now", now)  # noqa: B010
        return now

    @admin.display(description=_("worker"))
    def worker_link(self, obj: Message) -> str:
        """The worker running it (or that last ran it), linked to the worker registry."""
        if not obj.worker_id:
            return "-"
        url = self._url("workers") + "?" + urlencode({"worker_id__exact": obj.worker_id})
        return format_html('<a href="{}">{}</a>', url, obj.worker_id)

    @admin.display(description=_("running for"))
    def running_for_display(self, obj: Message) -> str:
        if obj.state != MessageState.RUNNING or obj.claimed_at is None:
            return "-"
        seconds = max(0.0, (self._clock(obj) - obj.claimed_at).total_seconds())
        return format_html(
            '<span title="claimed at {}">{}</span>',
            _timestamp(obj.claimed_at),
            overview.format_age(seconds),
        )

    @admin.display(description=_("lease expires"))
    def lease_display(self, obj: Message) -> str:
        if obj.state != MessageState.RUNNING or obj.lease_expires_at is None:
            return "-"
        left = (obj.lease_expires_at - self._clock(obj)).total_seconds()
        at = _timestamp(obj.lease_expires_at)
        if left < 0:
            return format_html(
                '<span class="fq-failed" title="{}">{}</span>',
                at,
                f"expired {overview.format_age(-left)} ago",
            )
        return format_html('<span title="{}">{}</span>', at, f"in {overview.format_age(left)}")

    @admin.display(description=_("error"))
    def error_summary(self, obj: Message) -> str:
        return _error_summary(obj.last_error)

    @admin.display(description=_("payload"))
    def payload_display(self, obj: Message) -> str:
        return format_html('<pre class="fq-json">{}</pre>', _pretty_json(obj.payload))

    @admin.display(description=_("result"))
    def result_display(self, obj: Message) -> str:
        if obj.result is None:
            return "-"
        return format_html('<pre class="fq-json">{}</pre>', _pretty_json(obj.result))

    @admin.display(description=_("last error"))
    def error_display(self, obj: Message) -> str:
        return _error_html(obj.last_error)

    @admin.display(description=_("every attempt's error"))
    def errors_display(self, obj: Message) -> str:
        """The history of failed attempts (at most ERROR_HISTORY, oldest first), one line each,
        the traceback folded."""
        history = obj.errors if isinstance(obj.errors, list) else []
        if not history:
            return "-"
        rows = format_html_join(
            "",
            '<tr><td>{}</td><td class="fq-nowrap">{}</td><td class="fq-nowrap">{}</td>'
            "<td>{}{}</td></tr>",
            (
                (
                    e.get("attempt", "?"),
                    _timestamp(_parse_time(e.get("at"))),
                    e.get("worker") or "-",
                    _error_summary(e),
                    format_html(
                        '<details><summary>{}</summary><pre class="fq-traceback">{}</pre>'
                        "</details>",
                        _("traceback"),
                        e["traceback"],
                    )
                    if e.get("traceback")
                    else "",
                )
                for e in history
                if isinstance(e, dict)
            ),
        )
        return format_html(
            '<table class="fq-errors" id="fq-errors"><thead><tr><th>{}</th><th>{}</th><th>{}</th>'
            "<th>{}</th></tr></thead><tbody>{}</tbody></table>",
            _("attempt"),
            _("at"),
            _("worker"),
            _("error"),
            rows,
        )

    # -- actions ---------------------------------------------------------------------------

    def _act(
        self,
        request: HttpRequest,
        queryset: QuerySet[Message],
        action: Callable[[Sequence[int]], list[int]],
        verb: str,
        deleting: bool = False,
    ) -> None:
        done = 0
        for ids in _ids_of(queryset):
            # Fetched before acting: a deleted row can still be named in the log.
            before = Message.objects.only("id", "task_name", "state").in_bulk(ids)
            acted = action(ids)
            done += len(acted)
            objects = [before[i] for i in acted if i in before]
            if deleting:
                self.log_deletions(request, objects)  # type: ignore[arg-type]
            else:
                _log_changes(request, objects, f"{verb} (admin action).")
        self.message_user(
            request,
            ngettext("%(verb)s %(n)d message.", "%(verb)s %(n)d messages.", done)
            % {"verb": verb, "n": done},
            messages.SUCCESS,
        )

    @admin.action(description=_("Retry selected failed messages"), permissions=["act"])
    def retry_messages(self, request: HttpRequest, queryset: QuerySet[Message]) -> None:
        self._act(request, queryset, message_store.retry_failed_messages, "Retried")
        self.message_user(request, _("Only failed messages are retried."), messages.INFO)

    @admin.action(description=_("Cancel selected waiting messages"), permissions=["act"])
    def cancel_messages(self, request: HttpRequest, queryset: QuerySet[Message]) -> None:
        self._act(request, queryset, message_store.cancel_messages, "Cancelled")
        self.message_user(
            request, _("Only ready and delayed messages are cancelled."), messages.INFO
        )

    @admin.action(
        description=_("Abort selected messages (cancel waiting, stop running)"),
        permissions=["act"],
    )
    def abort_messages(self, request: HttpRequest, queryset: QuerySet[Message]) -> None:
        self._act(
            request, queryset, lambda ids: sorted(message_store.abort_messages(ids)), "Aborted"
        )
        self.message_user(
            request,
            _(
                "Waiting messages are cancelled. Running ones are asked to stop: they end "
                "aborted once their task stops, or after the abort grace period."
            ),
            messages.INFO,
        )

    @admin.action(description=_("Delete selected messages (not running)"), permissions=["remove"])
    def delete_messages(self, request: HttpRequest, queryset: QuerySet[Message]) -> None:
        self._act(request, queryset, message_store.delete_messages, "Deleted", deleting=True)
        self.message_user(request, _("Running messages are never deleted."), messages.INFO)


# ============================================================================================
# Work batches


@admin.register(WorkBatch)
class WorkBatchAdmin(adminlist.NulSafeAdmin, _WorkBatchAdminBase):
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
        "started_at",
        "finished_at",
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
        "run_at",
        "attempts",
        "max_attempts",
        "worker_id",
        "lease_token",
        "heartbeat_at",
        "lease_expires_at",
        "created_at",
        "started_at",
        "finished_at",
        "rows_processed",
        "error_display",
    ]
    exclude = ["last_error"]

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
        return _error_summary(obj.last_error)

    @admin.display(description=_("last error"))
    def error_display(self, obj: WorkBatch) -> str:
        return _error_html(obj.last_error)

    def _retry(self, request: HttpRequest, ids: Sequence[int]) -> int:
        done = 0
        for chunk in _chunks(ids):
            retried = batch_store.retry_failed_work_batches(chunk)
            done += len(retried)
            _log_changes(
                request,
                list(WorkBatch.objects.filter(pk__in=retried).order_by("pk")),
                "Retried: back to pending with attempts 0 (admin action).",
            )
        return done

    @admin.action(description=_("Retry selected failed batches"), permissions=["act"])
    def retry_batches(self, request: HttpRequest, queryset: QuerySet[WorkBatch]) -> None:
        done = sum(self._retry(request, ids) for ids in _ids_of(queryset))
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

    def retry_job_view(self, request: HttpRequest) -> HttpResponseRedirect:
        if not self.has_act_permission(request):
            raise PermissionDenied
        job = request.POST.get("job", "")
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


# ============================================================================================
# Workers


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
class WorkerAdmin(adminlist.NulSafeAdmin, _WorkerAdminBase):
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
        states = {v.worker_id: v.state for v in registry.workers(now)}
        messages_url = reverse("admin:fairqueue_message_changelist")
        for obj in cl.result_list:
            setattr(obj, "_fq_now", now)  # noqa: B010
            setattr(obj, "_fq_state", states.get(obj.worker_id, obj.state))  # noqa: B010
            setattr(obj, "_fq_messages", messages_url)  # noqa: B010
        return cl

    def _ago(self, obj: WorkerRecord, moment: datetime | None) -> str:
        now = getattr(obj, "_fq_now", None) or timezone.now()
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
        return registry.restarts_text(*registry.supervised_restarts(obj.supervision))

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
        views = {v.worker_id: v for v in registry.workers(now)}
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
            left = (m.lease_expires_at - now).total_seconds() if m.lease_expires_at else None
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

"""The admin of periodic schedules (registered by :mod:`django_fairqueue.admin`).

* **Schedules**: every schedule with its next fire time (in its own timezone), last fired slot
  and message, enabled flag; filters by source, state and policy; search by name, channel and
  task; enable and disable actions. An operator adds a tenant's own schedule here (the channel
  page links to the form with its channel filled in), with its timezone, arguments (JSON,
  checked as enqueue checks them), missed-slot policy and jitter. Code schedules
  (``@periodic``, ``FAIRQUEUE['SCHEDULES']``) are read-only but for ``enabled``: the code
  owns the rest and workers sync it. ``?channel=<id>`` on the add form fills in the channel
  (a value that is no id is ignored).
* **The channel page** lists its schedules (read-only, each linked to its form).

Saving a schedule writes only what the form edits: the firing state is no model field
(:class:`~django_fairqueue.models.Schedule`), so a save of a form opened before the last firing
cannot move the schedule's slots. Every change needs *change schedule*; a view-only user sees
everything and changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.widgets import AutocompleteSelect
from django.core.exceptions import ValidationError
from django.db.models import BooleanField, DateTimeField, ForeignKey, QuerySet
from django.db.models.expressions import RawSQL
from django.forms import ModelChoiceField
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from django_fairqueue import conf, cron
from django_fairqueue.admin import lists
from django_fairqueue.admin.common import time_field
from django_fairqueue.db import pg, schedule_store
from django_fairqueue.exceptions import InvalidSchedule, PayloadError, UnknownTask
from django_fairqueue.models import Schedule, ScheduleSource
from django_fairqueue.observe import moments, overview
from django_fairqueue.tasks.spec import registry

if TYPE_CHECKING:
    _ScheduleAdminBase = admin.ModelAdmin[Schedule]
    _ScheduleInlineBase = admin.TabularInline[Schedule, Any]
    _ScheduleFormBase = forms.ModelForm[Schedule]
else:
    _ScheduleAdminBase = admin.ModelAdmin
    _ScheduleInlineBase = admin.TabularInline
    _ScheduleFormBase = forms.ModelForm

#: What the firing code writes, read into the admin's rows (not model fields: see Schedule).
_STATE = {
    "next_fire_at": RawSQL(
        "fairqueue_schedule.next_fire_at", (), output_field=DateTimeField(null=True)
    ),
    "last_slot_at": RawSQL(
        "fairqueue_schedule.last_slot_at", (), output_field=DateTimeField(null=True)
    ),
    "last_fired_at": RawSQL(
        "fairqueue_schedule.last_fired_at", (), output_field=DateTimeField(null=True)
    ),
    "state_current": RawSQL("NOT fairqueue_schedule.stale", (), output_field=BooleanField()),
}

#: What a code schedule lets an operator change (the code owns the rest).
CODE_EDITABLE = ("enabled",)


class _JSONField(forms.JSONField):
    """A JSON form field whose input nested deeper than the parser recurses, or that decodes
    to a lone surrogate, is a form error, not a server error."""

    def to_python(self, value: Any) -> Any:
        try:
            return super().to_python(value)
        except RecursionError:
            raise ValidationError(
                _("This JSON is nested too deeply."), code="invalid", params={"value": ""}
            ) from None

    def bound_data(self, data: Any, initial: Any) -> Any:
        try:
            value = super().bound_data(data, initial)
            # "\ud800" decodes to a lone surrogate (the form refuses it), and the page that
            # redisplays the value could not encode it as UTF-8
            self.prepare_value(value).encode()
        except (RecursionError, UnicodeEncodeError):
            return forms.fields.InvalidJSONInput(data)  # shown back as typed
        return value


class _ChannelSelect(AutocompleteSelect):
    """The channel's autocomplete. Django looks up the selected channel by its id to show its
    name, and a value that is no id (``?channel=abc`` on the add form, or posted) would fail
    the page in that lookup: it selects nothing instead (posted, the field says it is not a
    valid choice)."""

    def optgroups(
        self, name: str, value: Sequence[str], attr: dict[str, Any] | None = None
    ) -> list[tuple[str | None, list[dict[str, Any]], int | None]]:
        return super().optgroups(name, [v for v in value if self._is_id(v)], attr)

    def _is_id(self, value: str) -> bool:
        try:
            self.field.target_field.get_prep_value(value)  # what the lookup converts it with
        except (TypeError, ValueError):
            return False
        return True


class ScheduleForm(_ScheduleFormBase):
    """Checks a schedule as the firing code will need it: a cron cronsim reads, a known
    timezone, arguments enqueue accepts, a priority enqueue accepts, a registered task (when
    this process knows tasks)."""

    class Meta:
        field_classes = {"args": _JSONField, "kwargs": _JSONField}
        model = Schedule
        fields = [
            "name",
            "channel",
            "task_name",
            "args",
            "kwargs",
            "cron",
            "timezone",
            "missed",
            "catch_up_max",
            "jitter",
            "priority",
            "enabled",
        ]

    def clean_cron(self) -> str:
        try:
            return cron.validate_cron(self.cleaned_data.get("cron"), "cron")
        except InvalidSchedule as exc:
            raise ValidationError(str(exc)) from None

    def clean_timezone(self) -> str:
        try:
            return cron.validate_timezone(self.cleaned_data.get("timezone"), "timezone")
        except InvalidSchedule as exc:
            raise ValidationError(str(exc)) from None

    def clean_jitter(self) -> timedelta:
        try:
            return cron.validate_jitter(self.cleaned_data.get("jitter"), "jitter")
        except InvalidSchedule as exc:
            raise ValidationError(str(exc).removeprefix("jitter: ")) from None

    def clean_task_name(self) -> str:
        name: str = self.cleaned_data.get("task_name", "")
        registry.autodiscover()
        if registry.names() and name not in registry:
            known = ", ".join(registry.names()[:20])
            raise ValidationError(
                _("%(name)s is not a registered task (known: %(known)s)"),
                params={"name": name, "known": known},
            )
        return name

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        args, kwargs = data.get("args"), data.get("kwargs")
        if "args" in data and "kwargs" in data:
            if args is None:
                args = data["args"] = []
            if kwargs is None:
                kwargs = data["kwargs"] = {}
            # The field an error of the arguments shows under: the one given, kwargs when
            # only they are (a missing argument, an unknown keyword, a value JSON cannot
            # hold), else args.
            blamed = "kwargs" if kwargs and not args else "args"
            try:
                spec = registry.get(data.get("task_name") or "")
                max_bytes = conf.get().MAX_PAYLOAD_BYTES
                if not isinstance(args, list):
                    blamed = "args"
                    raise PayloadError('args must be a JSON list, e.g. [1, "x"]')
                if not isinstance(kwargs, dict):
                    blamed = "kwargs"
                    raise PayloadError('kwargs must be a JSON object, e.g. {"report": "daily"}')
                from django_fairqueue.api import check_call

                check_call(spec, args, kwargs, max_bytes)
            except UnknownTask:
                pass  # reported on the task field
            except TypeError as exc:  # (PayloadError is one) what each firing would fail on
                self.add_error(blamed, str(exc))
        if data.get("missed") and data.get("catch_up_max") is not None:
            try:
                cron.validate_missed(data["missed"], data["catch_up_max"], "schedule")
            except InvalidSchedule as exc:
                self.add_error("catch_up_max", str(exc).removeprefix("schedule: "))
        return data


def _when(value: datetime | None, tz: str) -> str:
    if value is None:
        return "-"
    try:
        zone = ZoneInfo(tz)
    except (ValueError, KeyError):
        zone = ZoneInfo("UTC")
    return f"{moments.aware(value).astimezone(zone):%Y-%m-%d %H:%M %Z}"


def _next_fire(obj: Schedule, now: datetime) -> str:
    if not obj.enabled:
        return str(_("paused"))
    at: datetime | None = moments.aware(getattr(obj, "next_fire_at", None))
    if not getattr(obj, "state_current", False) or at is None:
        # new or just edited: the next pass computes this (from the database's clock)
        try:
            at = cron.next_slot(obj.cron, obj.timezone, now)
        except Exception:
            return "-"
    if at is None:
        return str(_("never"))
    seconds = (at - now).total_seconds()
    if seconds <= 0:
        return f"{_when(at, obj.timezone)} ({_('due')})"
    return f"{_when(at, obj.timezone)} ({_('in')} {overview.format_age(seconds)})"


class _StateColumns:
    """Columns of the firing state, shared by the list and the channel page's inline."""

    _now: datetime | None = None

    def now(self) -> datetime:
        # one read of the database's clock per page: the clock the slots are computed on
        if self._now is None:
            self._now = pg.select_clock()
        return self._now

    @admin.display(description=_("next fire"), ordering="next_fire_at")
    def next_fire_display(self, obj: Schedule) -> str:
        return _next_fire(obj, self.now())

    @admin.display(description=_("last slot fired"), ordering="last_slot_at")
    def last_slot_display(self, obj: Schedule) -> str:
        return _when(getattr(obj, "last_slot_at", None), obj.timezone)


@admin.register(Schedule)
class ScheduleAdmin(_StateColumns, lists.NulSafeAdmin, _ScheduleAdminBase):
    form = ScheduleForm
    list_display = [
        "name",
        "channel",
        "task_name",
        "when_display",
        "enabled",
        "next_fire_display",
        "last_slot_display",
        "missed_display",
    ]
    list_filter = ["enabled", "source", "missed"]
    search_fields = ["name", "channel__name", "task_name"]
    search_help_text = _("Schedule name, channel name or task contains")
    list_select_related = ["channel"]
    autocomplete_fields = ["channel"]
    show_full_result_count = False
    actions = ["enable_schedules", "disable_schedules"]
    fieldsets = [
        (None, {"fields": ["name", "channel", "task_name", "args", "kwargs"]}),
        (_("When"), {"fields": ["cron", "timezone", "missed", "catch_up_max", "jitter"]}),
        (_("Message"), {"fields": ["priority", "enabled"]}),
    ]
    state_fieldset = (
        _("Firing (written by the workers)"),
        {
            "fields": [
                "source",
                "next_fire_display",
                "upcoming_display",
                "last_slot_display",
                "last_fired_display",
                "last_message_display",
                "created_display",
            ]
        },
    )

    created_display = time_field("created_at", _("created at"))

    def get_queryset(self, request: HttpRequest) -> QuerySet[Schedule]:
        self._now = None
        return super().get_queryset(request).annotate(**_STATE)

    def formfield_for_foreignkey(
        self, db_field: ForeignKey[Any, Any], request: HttpRequest, **kwargs: Any
    ) -> ModelChoiceField[Any] | None:
        if db_field.name == "channel":
            kwargs["widget"] = _ChannelSelect(db_field, self.admin_site, using=kwargs.get("using"))
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def get_fieldsets(self, request: HttpRequest, obj: Schedule | None = None) -> Any:
        if obj is None:
            return self.fieldsets
        return [*self.fieldsets, self.state_fieldset]

    def get_readonly_fields(self, request: HttpRequest, obj: Schedule | None = None) -> Any:
        state = [
            "source",
            "next_fire_display",
            "upcoming_display",
            "last_slot_display",
            "last_fired_display",
            "last_message_display",
            "created_display",
        ]
        if obj is not None and obj.source == ScheduleSource.CODE:
            declared = [f for f in ScheduleForm.Meta.fields if f not in CODE_EDITABLE]
            return [*declared, *state]
        return state

    def has_delete_permission(self, request: HttpRequest, obj: Schedule | None = None) -> bool:
        # a code schedule comes back with the next worker's sync: pause it instead
        if obj is not None and obj.source == ScheduleSource.CODE:
            return False
        return super().has_delete_permission(request, obj)

    @admin.display(description=_("cron (timezone)"), ordering="cron")
    def when_display(self, obj: Schedule) -> SafeString:
        return format_html("<code>{}</code><br>{}", obj.cron, obj.timezone)

    @admin.display(description=_("missed"), ordering="missed")
    def missed_display(self, obj: Schedule) -> str:
        # the policy's short name: the choices' labels are sentences, too wide for a column
        if obj.missed == "catch_up":
            return f"catch_up ≤ {obj.catch_up_max}"
        return obj.missed

    @admin.display(description=_("next slots"))
    def upcoming_display(self, obj: Schedule) -> str:
        if not obj.pk:
            return "-"
        try:
            slots = cron.slots_after(obj.cron, obj.timezone, self.now())
            return ", ".join(_when(next(slots), obj.timezone) for _ in range(5))
        except Exception:
            return "-"

    @admin.display(description=_("last fired at"))
    def last_fired_display(self, obj: Schedule) -> str:
        return _when(getattr(obj, "last_fired_at", None), obj.timezone)

    @admin.display(description=_("last message"))
    def last_message_display(self, obj: Schedule) -> SafeString | str:
        states = schedule_store.select_schedule_states([obj.pk]) if obj.pk else {}
        message_id = states[obj.pk].last_message_id if obj.pk in states else None
        if message_id is None:
            return "-"
        url = reverse("admin:fairqueue_message_change", args=[message_id])
        return format_html('<a href="{}">#{}</a>', url, message_id)

    @admin.action(description=_("Enable selected schedules"), permissions=["change"])
    def enable_schedules(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        self._set_enabled(request, queryset, True)

    @admin.action(description=_("Disable (pause) selected schedules"), permissions=["change"])
    def disable_schedules(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        self._set_enabled(request, queryset, False)

    def _set_enabled(
        self, request: HttpRequest, queryset: QuerySet[Schedule], enabled: bool
    ) -> None:
        changed = list(queryset.exclude(enabled=enabled).order_by("pk"))
        # only the flag (the firing state is no field; an update writes nothing else)
        Schedule.objects.filter(pk__in=[s.pk for s in changed]).update(enabled=enabled)
        for schedule in changed:
            self.log_change(request, schedule, "enabled" if enabled else "disabled")
        what = _("enabled") if enabled else _("disabled")
        self.message_user(
            request,
            ngettext("%(n)d schedule %(what)s.", "%(n)d schedules %(what)s.", len(changed))
            % {"n": len(changed), "what": what},
            messages.SUCCESS,
        )


class ScheduleInline(_StateColumns, _ScheduleInlineBase):
    """A channel's schedules on its page, read-only, each linked to its own form."""

    model = Schedule
    extra = 0
    fields = ["name", "task_name", "cron", "timezone", "enabled", "next_fire_display"]
    readonly_fields = ["name", "task_name", "cron", "timezone", "enabled", "next_fire_display"]
    show_change_link = True
    can_delete = False
    verbose_name_plural = _("periodic schedules")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Schedule]:
        self._now = None
        return super().get_queryset(request).annotate(**_STATE)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

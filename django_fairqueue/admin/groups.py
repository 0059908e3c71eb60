"""The admin of channel groups: their limits to edit, and their claim state read-only."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.translation import gettext_lazy as _

from django_fairqueue.admin import lists
from django_fairqueue.admin.common import (
    GroupAdminBase,
    GroupFormBase,
    as_typed,
    carry_initial,
    check_limits,
    duration,
    time_field,
    timestamp,
)
from django_fairqueue.api import validate_group_name
from django_fairqueue.db import channel_store
from django_fairqueue.exceptions import InvalidChannel
from django_fairqueue.models import ChannelGroup

#: The limits an operator edits on a group (a change saves only these columns).
GROUP_LIMITS = ("weight", "max_concurrency", "release_interval")


class ChannelGroupForm(GroupFormBase):
    """A channel group's name and limits, checked as enqueue and channel limits are."""

    class Meta:
        model = ChannelGroup
        fields = ["name", *GROUP_LIMITS]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        carry_initial(self, GROUP_LIMITS)

    def clean_name(self) -> str:
        try:
            return validate_group_name(as_typed(self, "name"))
        except InvalidChannel as exc:
            raise ValidationError(str(exc)) from None

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        check_limits(self, data, GROUP_LIMITS, "group")
        return data


@admin.register(ChannelGroup)
class ChannelGroupAdmin(lists.NulSafeAdmin, GroupAdminBase):
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
    list_filter = [lists.QueueFilter]
    list_per_page = 100
    show_full_result_count = False
    fieldsets = [
        (None, {"fields": ["name"]}),
        (_("Limits (take effect on the next claim)"), {"fields": list(GROUP_LIMITS)}),
        (_("State"), {"fields": ["state_display", "channels_link", "created_display"]}),
    ]

    created_display = time_field("created_at", _("created at"))

    @admin.display(description=_("name"), ordering="name")
    def name_display(self, obj: ChannelGroup) -> str:
        return obj.short_name

    def get_readonly_fields(
        self, request: HttpRequest, obj: ChannelGroup | None = None
    ) -> list[str]:
        fields = ["state_display", "channels_link", "created_display", "name_display", "queue"]
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
            # (a rate limit removed or shortened is due at once: fairqueue_rearm_v1)
            obj.save(update_fields=fields)

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
        return duration(obj.release_interval)

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
            timestamp(state.next_turn_at),
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

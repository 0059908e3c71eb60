"""What the admin's pages share: the type aliases of its base classes, admin log entries,
bulk actions in chunks, and how errors, times and durations are shown."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin
from django.contrib.admin.models import CHANGE, LogEntry
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html

from django_fairqueue import conf
from django_fairqueue.models import Channel, ChannelGroup, Message, WorkBatch, WorkerRecord
from django_fairqueue.observe import overview

if TYPE_CHECKING:
    from django.utils.functional import _StrOrPromise as StrOrPromise

    ChannelAdminBase = admin.ModelAdmin[Channel]
    GroupAdminBase = admin.ModelAdmin[ChannelGroup]
    GroupFormBase = forms.ModelForm[ChannelGroup]
    MessageAdminBase = admin.ModelAdmin[Message]
    WorkBatchAdminBase = admin.ModelAdmin[WorkBatch]
    WorkerAdminBase = admin.ModelAdmin[WorkerRecord]
    ChannelFormBase = forms.ModelForm[Channel]
else:  # the generic aliases exist only for type checkers (no django-stubs-ext at run time)
    ChannelAdminBase = MessageAdminBase = WorkBatchAdminBase = admin.ModelAdmin
    WorkerAdminBase = GroupAdminBase = admin.ModelAdmin
    ChannelFormBase = GroupFormBase = forms.ModelForm

#: Ids per database call in bulk actions: each statement's locks and WAL stay bounded.
ACTION_CHUNK = 1000


def log_changes(request: HttpRequest, objects: Sequence[Any], message: str) -> None:
    """One admin log entry (CHANGE) per object, in one INSERT."""
    if objects:
        LogEntry.objects.log_actions(
            user_id=request.user.pk or 0,  # the admin only lets signed-in users this far
            queryset=objects,
            action_flag=CHANGE,
            change_message=message,
        )


def as_typed(form: forms.BaseForm, field: str) -> Any:
    """A name as submitted, before the form field strips it: Python counts control characters
    such as U+001F as blanks, so a stripped ``"\x1fx"`` would save channel ``"x"`` instead of
    refusing a name enqueue refuses. The name checks then say what is wrong."""
    cleaned = form.cleaned_data[field]
    raw = form.data.get(form.add_prefix(field))
    return raw if isinstance(raw, str) else cleaned


def carry_initial(form: forms.BaseModelForm[Any], names: Sequence[str]) -> None:
    """On an existing row's change form, send each of ``names`` back with the value the page
    showed (Django's hidden initial), so that ``changed_data`` names only what the operator
    changed on the page: a limit changed meanwhile elsewhere (another operator, an action, the
    ORM) is neither counted as changed nor written back."""
    if form.instance.pk is None:
        return
    for name in names:
        if name in form.fields:
            form.fields[name].show_hidden_initial = True


def check_limits(
    form: forms.BaseForm, data: dict[str, Any], names: Sequence[str], where: str
) -> None:
    """Check each of ``names`` in a channel's or group's cleaned form data as the settings and
    enqueue check them (``where``: ``"channel"`` or ``"group"``), one limit at a time, so each
    message lands under its own field: "channel max_concurrency must be ..." becomes "Max
    concurrency must be ...". An empty rate limit is none, an empty weight 1."""
    for name in names:
        if name not in data or name in form.errors:
            continue
        value = data[name]
        if value is None and name == "release_interval":
            value = timedelta(0)
        if value is None and name == "weight":
            value = 1
        try:
            conf.validate_channel_limits(**{name: value}, where=where)
        except ValueError as exc:
            text = str(exc).removeprefix(f"{where} ")
            label = name.replace("_", " ")
            form.add_error(name, label.capitalize() + text.removeprefix(name))


def chunks(ids: Sequence[int], size: int = ACTION_CHUNK) -> Iterator[list[int]]:
    for start in range(0, len(ids), size):
        yield list(ids[start : start + size])


def ids_of(queryset: QuerySet[Any]) -> Iterator[list[int]]:
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


def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


def error_summary(error: Any) -> str:
    """``Type: message`` of a stored error, on one line, at most 100 characters."""
    if not isinstance(error, dict):
        return ""
    text = " ".join(f"{error.get('type') or 'error'}: {error.get('message') or ''}".split())
    return text if len(text) <= 100 else text[:97] + "..."


def error_html(error: Any) -> str:
    """A stored error: type and message, other details as JSON, the traceback as written."""
    if error is None:
        return "-"
    if not isinstance(error, dict):
        return format_html('<pre class="fq-json">{}</pre>', pretty_json(error))
    details = {k: v for k, v in error.items() if k not in ("type", "message", "traceback")}
    return format_html(
        '<div class="fq-error"><strong>{}</strong>: {}{}{}</div>',
        error.get("type") or "error",
        error.get("message") or "",
        format_html('<pre class="fq-json">{}</pre>', pretty_json(details)) if details else "",
        format_html('<pre class="fq-traceback">{}</pre>', error["traceback"])
        if error.get("traceback")
        else "",
    )


def timestamp(value: datetime | None) -> str:
    """``2026-11-25 21:04:05`` in the zone Django shows times in; ``-`` for None."""
    return overview.format_time(value)


def time_field(field: str, description: StrOrPromise, *, sortable: bool = False) -> Any:
    """An admin column or read-only field showing the time ``field`` as every fairqueue page
    shows a time (:func:`timestamp`); ``sortable``: its column header sorts by it. Named in
    ``list_display``, ``readonly_fields`` or a fieldset in place of the field: Django's own
    rendering of a time follows the project's locale (``Nov. 30, 2026, 9:53 p.m.``, no
    seconds) and costs ten times more (a fifth of a list's rendering at 100 rows)."""

    @admin.display(description=description, ordering=field if sortable else None)
    def show(model_admin: Any, obj: Any) -> str:
        return timestamp(getattr(obj, field))

    return show


def parse_time(text: Any) -> datetime | None:
    """A timestamp the database wrote into JSON (ISO 8601), or None."""
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


def duration(value: timedelta | None) -> str:
    if not value:
        return "0"
    seconds = value.total_seconds()
    if seconds < 60:
        return f"{seconds:g}s"
    return overview.format_age(seconds)

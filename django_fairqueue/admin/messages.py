"""The admin of messages, at any scale: read-only, with retry, cancel, abort and delete actions
that go through the queue's own statements."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext
from django.views.decorators.http import require_POST

from django_fairqueue import api, failures
from django_fairqueue.admin import lists
from django_fairqueue.admin.channels import ChannelAdmin, key_held_note
from django_fairqueue.admin.common import (
    MessageAdminBase,
    error_html,
    error_summary,
    ids_of,
    log_changes,
    parse_time,
    pretty_json,
    time_field,
    timestamp,
)
from django_fairqueue.db import message_store, pg
from django_fairqueue.models import Message, MessageState
from django_fairqueue.observe import moments, overview, waiting


@admin.register(Message)
class MessageAdmin(lists.NulSafeAdmin, MessageAdminBase):
    """Messages at any scale (a million rows and more): an estimated count, pages by cursor over
    the two sorts an index serves, filters that never scan the table for their choices, and a
    search on ids and task names (:mod:`django_fairqueue.admin.lists`)."""

    @property
    def media(self) -> forms.Media:
        return (
            super().media
            + lists.channel_widget(self.admin_site).media
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
        lists.TaskNameFilter,
        lists.MessageQueueFilter,
        lists.ChannelFilter,
        lists.WorkerFilter,
    ]
    list_select_related = ["channel"]
    ordering = ["-id"]  # newest first (a backward scan of the primary key)
    #: The sorts a list page may take, each an index's order (lists.KeysetChangeList); the
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
        return lists.KeysetChangeList

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
            log_changes(request, [obj], f"{verb.capitalize()} (admin button).")
            self.message_user(request, text, messages.SUCCESS)
        else:
            self.message_user(request, self._nothing_done(obj.pk, verb), messages.WARNING)
        return HttpResponseRedirect(
            reverse(f"{self.admin_site.name}:fairqueue_message_change", args=[obj.pk])
        )

    def _nothing_done(self, pk: int, verb: str) -> str:
        """Why a button did nothing: the message's state moved on, or (a retry) another message
        holds its unique key, which leaves it failed."""
        if verb == "retry" and failures.key_held([pk]):
            return str(
                _(
                    "Nothing done: another message holds this one's unique key and does its "
                    "work; this one stays failed."
                )
            )
        now = Message.objects.filter(pk=pk).values_list("state", flat=True).first()
        return _(
            "Nothing done: %(verb)s needs a message that is %(needed)s; this one is %(state)s."
        ) % {
            "verb": verb,
            "needed": " or ".join(str(s) for s in self.BUTTONS[verb][1]),
            "state": now or _("deleted"),
        }

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

    enqueued_display = time_field("enqueued_at", _("enqueued at"))
    run_at_display = time_field("run_at", _("run at"))
    finished_display = time_field("finished_at", _("finished at"))
    claimed_display = time_field("claimed_at", _("claimed at"))
    abort_requested_display = time_field("abort_requested_at", _("abort requested at"))

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
        """The worker running it (or that last ran it), linked to the worker worker_registry."""
        if not obj.worker_id:
            return "-"
        url = self._url("workers") + "?" + urlencode({"worker_id__exact": obj.worker_id})
        return format_html('<a href="{}">{}</a>', url, obj.worker_id)

    @admin.display(description=_("running for"))
    def running_for_display(self, obj: Message) -> str:
        if obj.state != MessageState.RUNNING or obj.claimed_at is None:
            return "-"
        seconds = max(0.0, (self._clock(obj) - moments.aware(obj.claimed_at)).total_seconds())
        return format_html(
            '<span title="claimed at {}">{}</span>',
            timestamp(obj.claimed_at),
            overview.format_age(seconds),
        )

    @admin.display(description=_("lease expires"))
    def lease_display(self, obj: Message) -> str:
        if obj.state != MessageState.RUNNING or obj.lease_expires_at is None:
            return "-"
        left = (moments.aware(obj.lease_expires_at) - self._clock(obj)).total_seconds()
        at = timestamp(obj.lease_expires_at)
        if left < 0:
            return format_html(
                '<span class="fq-failed" title="{}">{}</span>',
                at,
                f"expired {overview.format_age(-left)} ago",
            )
        return format_html('<span title="{}">{}</span>', at, f"in {overview.format_age(left)}")

    @admin.display(description=_("error"))
    def error_summary(self, obj: Message) -> str:
        return error_summary(obj.last_error)

    @admin.display(description=_("payload"))
    def payload_display(self, obj: Message) -> str:
        return format_html('<pre class="fq-json">{}</pre>', pretty_json(obj.payload))

    @admin.display(description=_("result"))
    def result_display(self, obj: Message) -> str:
        if obj.result is None:
            return "-"
        return format_html('<pre class="fq-json">{}</pre>', pretty_json(obj.result))

    @admin.display(description=_("last error"))
    def error_display(self, obj: Message) -> str:
        return error_html(obj.last_error)

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
                    timestamp(parse_time(e.get("at"))),
                    e.get("worker") or "-",
                    error_summary(e),
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
        for ids in ids_of(queryset):
            # Fetched before acting: a deleted row can still be named in the log.
            before = Message.objects.only("id", "task_name", "state").in_bulk(ids)
            acted = action(ids)
            done += len(acted)
            objects = [before[i] for i in acted if i in before]
            if deleting:
                self.log_deletions(request, objects)  # type: ignore[arg-type]
            else:
                log_changes(request, objects, f"{verb} (admin action).")
        self.message_user(
            request,
            ngettext("%(verb)s %(n)d message.", "%(verb)s %(n)d messages.", done)
            % {"verb": verb, "n": done},
            messages.SUCCESS,
        )

    @admin.action(description=_("Retry selected failed messages"), permissions=["act"])
    def retry_messages(self, request: HttpRequest, queryset: QuerySet[Message]) -> None:
        held: list[int] = []

        def retry(ids: Sequence[int]) -> list[int]:
            retried, kept = failures.retry_reporting_held(ids)
            held.extend(kept)
            return retried

        self._act(request, queryset, retry, "Retried")
        self.message_user(request, _("Only failed messages are retried."), messages.INFO)
        if held:
            self.message_user(request, key_held_note(len(held)), messages.WARNING)

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
            request,
            queryset,
            lambda ids: sorted(message_store.abort_messages(ids)),
            "Aborted (cancelled if it was waiting)",
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

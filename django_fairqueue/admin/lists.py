"""The message list of the admin at a million rows: estimated counts, keyset paging, and filters
that never list the whole table.

* **Counts**: a list that fits its page is counted by the page. Otherwise the planner's
  estimate of the filtered query (``EXPLAIN``); only when it is at most
  :data:`EXACT_COUNT_UP_TO` rows is the count exact, and then bounded (``LIMIT``), so a wrong
  estimate never costs more than that many rows. The page says "about N" otherwise.
* **Paging**: by cursor, never ``OFFSET``. A page is the next :attr:`list_per_page` rows after
  (or before) the sort key of the previous page's last (or first) row, which an index range scan
  finds as fast on the ten-thousandth page as on the first. The sorts are the ones an index
  serves: by id (the primary key) and by channel then id (``fq_message_channel_idx``); a state
  filter reads ``fq_message_state_idx`` (state, id) in the same order, or for running messages,
  which that index leaves out (a claim would write an entry per message taken), the few rows of
  ``fq_message_lease_idx``.
* **Filters**: the channel is picked by name with the admin's autocomplete, not from a list of
  every channel; task names are the registered ones (no ``DISTINCT`` over the table).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from django import forms
from django.contrib import admin
from django.contrib.admin.views.main import ORDER_VAR, PAGE_VAR, SEARCH_VAR, ChangeList
from django.contrib.admin.widgets import AutocompleteSelect
from django.db.models import BooleanField, Model, QuerySet
from django.db.models.expressions import RawSQL
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.utils.translation import gettext_lazy as _

from django_fairqueue.models import Channel, Message
from django_fairqueue.queues import DEFAULT_QUEUE
from django_fairqueue.tasks.spec import registry

#: The query parameter of a page: ``a<key>`` (rows after key), ``b<key>`` (rows before it) or
#: ``last``; a key is ``<id>`` or, sorted by channel, ``<channel id>.<id>``.
CURSOR_VAR = "cursor"
#: Up to this many rows a count is exact (a bounded COUNT); above, the planner's estimate.
EXACT_COUNT_UP_TO = 1_000
#: The channel filter's query parameter (the channel list links to it).
CHANNEL_VAR = "channel__id__exact"

_CURSOR_RE = re.compile(r"^([ab])(-?\d+)(?:\.(-?\d+))?$")


@dataclass(frozen=True)
class ResultCount:
    """How many rows a list holds: exact, or the planner's estimate ("about")."""

    value: int
    exact: bool

    def __str__(self) -> str:
        if self.exact:
            return f"{self.value:,}"
        return f"about {_round(self.value):,}"


def _round(n: int) -> int:
    """Two significant digits: an estimate is not more precise than that."""
    if n < 100:
        return n
    digits = len(str(n)) - 2
    return round(n, -digits)


def planner_estimate(queryset: QuerySet[Any]) -> int:
    """The planner's row estimate for ``queryset`` (its ``EXPLAIN``, nothing executed); 0 for
    a query Django knows is empty (it sends no SQL for it)."""
    if queryset.query.is_empty():
        return 0
    plan = json.loads(queryset.order_by().values("pk").explain(format="json"))
    return int(plan[0]["Plan"]["Plan Rows"])


def count_rows(queryset: QuerySet[Any], exact_up_to: int | None = None) -> ResultCount:
    """Exact when small (at most ``exact_up_to`` rows, default :data:`EXACT_COUNT_UP_TO`,
    counted with a LIMIT), else estimated."""
    if exact_up_to is None:
        exact_up_to = EXACT_COUNT_UP_TO
    estimate = planner_estimate(queryset)
    if estimate > exact_up_to:
        return ResultCount(estimate, exact=False)
    counted = queryset.order_by()[: exact_up_to + 1].count()
    if counted > exact_up_to:  # the estimate was low: say at least this many
        return ResultCount(max(estimate, counted), exact=False)
    return ResultCount(counted, exact=True)


@dataclass(frozen=True)
class Cursor:
    """Where a page starts: after or before a key, or the last page."""

    direction: str  # "after", "before" or "last"
    key: tuple[int, ...] = ()

    def param(self) -> str:
        if self.direction == "last":
            return "last"
        return ("a" if self.direction == "after" else "b") + ".".join(map(str, self.key))

    @classmethod
    def parse(cls, text: str | None, width: int) -> Cursor | None:
        """The cursor of a query parameter; None (the first page) for a missing or bad one."""
        if not text:
            return None
        if text == "last":
            return cls("last")
        match = _CURSOR_RE.match(text)
        if match is None:
            return None
        key = tuple(int(g) for g in match.groups()[1:] if g is not None)
        if len(key) != width:
            return None
        return cls("after" if match.group(1) == "a" else "before", key)


class KeysetChangeList(ChangeList):
    """A change list paged by cursor over an indexed sort key, with an estimated count.

    The model admin names its sorts in ``keyset_orders``: ``{list_display column: key columns}``
    (each key ends with the primary key, so it is unique). Any other ``o=`` falls back to the
    first sort, newest first.
    """

    cursor: Cursor | None = None
    count: ResultCount
    has_next = False
    has_previous = False

    @property
    def keyset_orders(self) -> dict[str, tuple[str, ...]]:
        orders: dict[str, tuple[str, ...]] = getattr(self.model_admin, "keyset_orders")  # noqa: B009
        return orders

    def __init__(self, request: HttpRequest, *args: Any, **kwargs: Any) -> None:
        super().__init__(request, *args, **kwargs)
        # Read by get_results from the request; no link or form built from params keeps it.
        self.params.pop(CURSOR_VAR, None)
        self.filter_params.pop(CURSOR_VAR, None)

    # -- parameters: the cursor is no field lookup, and no other link keeps it ----------------

    def get_filters_params(self, params: Any = None) -> Any:
        lookup = super().get_filters_params(params)
        lookup.pop(CURSOR_VAR, None)
        return lookup

    def get_query_string(
        self, new_params: dict[str, Any] | None = None, remove: Iterable[str] | None = None
    ) -> str:
        new_params = dict(new_params or {})
        if CURSOR_VAR not in new_params:
            remove = [*(remove or ()), CURSOR_VAR]
        return super().get_query_string(new_params, remove)

    # -- sort: only keys an index serves --------------------------------------------------------

    def _sort(self) -> tuple[str, tuple[str, ...], bool]:
        """(list_display column, key columns, descending) of this request's sort."""
        columns = list(self.list_display)
        default_column = next(iter(self.keyset_orders))
        value = self.params.get(ORDER_VAR, "")
        first = value.split(".")[0] if value else ""
        try:
            index = int(first.lstrip("-"))
            column = columns[index]
        except (ValueError, IndexError):
            return default_column, self.keyset_orders[default_column], True
        if column not in self.keyset_orders:
            return default_column, self.keyset_orders[default_column], True
        return column, self.keyset_orders[column], first.startswith("-")

    def get_ordering(self, request: HttpRequest, queryset: QuerySet[Any]) -> list[Any]:
        _, key, descending = self._sort()
        sign = "-" if descending else ""
        return [sign + name for name in key]

    def get_ordering_field_columns(self) -> dict[int, Any]:
        column, _, descending = self._sort()
        return {list(self.list_display).index(column): "desc" if descending else "asc"}

    # -- the page ------------------------------------------------------------------------------

    def _key_of(self, obj: Any) -> tuple[int, ...]:
        _, key, _ = self._sort()
        return tuple(int(getattr(obj, "pk" if name == "id" else name)) for name in key)

    def _seek(self, queryset: QuerySet[Any], key: tuple[int, ...], forward: bool) -> QuerySet[Any]:
        """Rows strictly past ``key`` in the list's order (``forward``) or before it."""
        _, columns, descending = self._sort()
        table = queryset.model._meta.db_table
        names = ", ".join(
            f'"{table}"."{queryset.model._meta.get_field(c).column}"' for c in columns
        )
        operator = "<" if descending == forward else ">"
        marks = ", ".join(["%s"] * len(key))
        condition = RawSQL(f"({names}) {operator} ({marks})", key, output_field=BooleanField())
        return queryset.filter(condition)

    def _fetch(self, queryset: QuerySet[Any], limit: int) -> list[Any]:
        """The first ``limit`` rows of ``queryset``, in its order: their keys first, then the rows.

        The keys alone can come from an index-only scan of the index that serves the filter
        (``(state, id)``, ``(channel_id, id)``). Asked for whole rows, the planner prefers a
        backward scan of the primary key that skips non-matching rows, counting on the matches
        being spread evenly; but ids follow enqueue order, so the messages of an old state lie
        far back, behind every newer one.
        """
        ids = list(queryset.values_list("pk", flat=True)[:limit])
        found = self.queryset.order_by().in_bulk(ids)
        return [found[pk] for pk in ids if pk in found]

    def get_results(self, request: HttpRequest) -> None:
        _, key, _ = self._sort()
        self.cursor = Cursor.parse(request.GET.get(CURSOR_VAR), len(key))
        per_page = self.list_per_page
        qs = self.queryset
        cursor = self.cursor
        if cursor is None:
            rows = self._fetch(qs, per_page + 1)
            self.has_next, self.has_previous = len(rows) > per_page, False
            rows = rows[:per_page]
        elif cursor.direction == "after":
            rows = self._fetch(self._seek(qs, cursor.key, forward=True), per_page + 1)
            self.has_next, self.has_previous = len(rows) > per_page, True
            rows = rows[:per_page]
        else:  # before a key, or the last page: read backwards, show in the list's order
            back = qs if cursor.direction == "last" else self._seek(qs, cursor.key, forward=False)
            rows = self._fetch(back.reverse(), per_page + 1)
            self.has_previous, self.has_next = len(rows) > per_page, cursor.direction != "last"
            rows = rows[:per_page][::-1]
        if cursor is None and not self.has_next:  # the whole list is on this page
            self.count = ResultCount(len(rows), exact=True)
        else:
            self.count = count_rows(qs)
        self.result_count = self.count.value
        self.full_result_count = None
        self.show_full_result_count = False
        self.show_admin_actions = True
        self.result_list = rows
        self.can_show_all = False
        self.show_all = False
        self.multi_page = self.has_next or self.has_previous
        self.paginator = None
        self.page_num = 1

    # -- links ----------------------------------------------------------------------------------

    def page_links(self) -> dict[str, str | None]:
        """URLs (query strings) of the first, previous, next and last pages, None where none."""
        rows = list(self.result_list)
        remove = [CURSOR_VAR, PAGE_VAR]
        links: dict[str, str | None] = dict.fromkeys(("first", "previous", "next", "last"))
        if self.has_previous:
            links["first"] = self.get_query_string(remove=remove)
            if rows:
                key = Cursor("before", self._key_of(rows[0])).param()
                links["previous"] = self.get_query_string({CURSOR_VAR: key}, remove)
        if self.has_next:
            if rows:
                key = Cursor("after", self._key_of(rows[-1])).param()
                links["next"] = self.get_query_string({CURSOR_VAR: key}, remove)
            links["last"] = self.get_query_string({CURSOR_VAR: "last"}, remove)
        return links


# ============================================================================================
# NUL characters


#: The model of an admin: the mixin's get_queryset gives its admin's rows, so an admin's own
#: get_queryset calling it stays typed with its model.
_M = TypeVar("_M", bound=Model, covariant=True)


class _Admin(Protocol[_M]):
    def get_queryset(self, request: HttpRequest) -> QuerySet[_M]: ...


def nul_refused(what: str) -> HttpResponseBadRequest:
    """The 400 for a NUL character in ``what`` (a filter, a POSTed name): no stored value can
    hold one, and PostgreSQL refuses to look one up."""
    return HttpResponseBadRequest(
        f"{what} contains a NUL character, which no stored value has.",
        content_type="text/plain; charset=utf-8",
    )


class NulSafeAdmin:
    """A text PostgreSQL cannot store (a NUL character) in a list's filter parameters is a
    clear 400, and in a search (the list's search box, the autocomplete of a channel) matches
    nothing, instead of a database error."""

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        for key, values in request.GET.lists():
            if key != SEARCH_VAR and any("\x00" in v for v in values):
                return nul_refused(f"The filter {key!r}")
        response: HttpResponse = super().changelist_view(  # type: ignore[misc]
            request, extra_context
        )
        return response

    def get_queryset(self: _Admin[_M], request: HttpRequest) -> QuerySet[_M]:
        queryset: QuerySet[_M] = super().get_queryset(request)  # type: ignore[safe-super]
        # Django's list refuses a NUL in ?q= (its banner) and then searches for "", which
        # matches every row; get_search_results never sees the NUL. The list's rows all come
        # from here, whatever an admin's own get_search_results does.
        if "\x00" in request.GET.get(SEARCH_VAR, ""):
            return queryset.none()
        return queryset

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        # the autocomplete's term, which reaches here as it was sent
        if "\x00" in search_term:
            return queryset.none(), False
        return super().get_search_results(request, queryset, search_term)  # type: ignore[misc,no-any-return]


# ============================================================================================
# Filters


class TaskNameFilter(admin.SimpleListFilter):
    """Exact task name; the choices are the registered tasks (never a scan of the table).
    Any name works in the URL (``?task_name=reports.build``), registered or not."""

    title = _("task name")
    parameter_name = "task_name"

    def lookups(self, request: HttpRequest | None, model_admin: Any) -> list[tuple[str, str]]:
        names = registry.names()
        if not names:
            registry.autodiscover()
            names = registry.names()
        current = self.value() if hasattr(self, "used_parameters") else None
        if current and current not in names:
            names = sorted([*names, current])
        return [(n, n) for n in names]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value and "\x00" in value:  # no task name has one (and the database refuses it)
            return queryset.none()
        return queryset.filter(task_name=value) if value else queryset


class QueueFilter(admin.SimpleListFilter):
    """One queue (``?queue=reports``); the choices are the default queue and those of the
    registered tasks (never a scan of the table). Any queue works in the URL. ``field`` is
    the lookup of the queue from the listed model."""

    title = _("queue")
    parameter_name = "queue"
    field = "queue"

    def lookups(self, request: HttpRequest | None, model_admin: Any) -> list[tuple[str, str]]:
        current = self.value() if hasattr(self, "used_parameters") else None
        return [(n, n) for n in self.known_queues(current)]

    @staticmethod
    def known_queues(current: str | None = None) -> list[str]:
        """The default queue, the registered tasks' queues and ``current`` (if any), sorted."""
        if not registry.names():
            registry.autodiscover()
        names = {DEFAULT_QUEUE} | {registry.get(n).queue for n in registry.names()}
        if current:
            names.add(current)
        return sorted(names)

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(**{self.field: value}) if value else queryset


class WorkerFilter(admin.SimpleListFilter):
    """The messages a worker ran (``?worker=host:1234``): those it runs now, and those it ran
    last (a message keeps the id of the worker of its last attempt: what a dead worker was
    running carries its id, its lease expired). No list of choices (that would read every
    worker id of the table): the workers page links here, and the filter shows the one chosen.
    """

    title = _("worker")
    parameter_name = "worker"

    def lookups(self, request: HttpRequest | None, model_admin: Any) -> list[tuple[str, str]]:
        current = self.value() if hasattr(self, "used_parameters") else None
        return [(current, current)] if current else []

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(worker_id=value) if value else queryset


class MessageQueueFilter(QueueFilter):
    """The queue of a message's channel."""

    field = "channel__queue"


class ChannelFilter(admin.ListFilter):
    """One channel, picked by name with the admin's autocomplete (select2 over the channel
    admin's search), so the page never lists 10,000 channels. The parameter is the channel's
    id (``?channel__id__exact=17``), which the channel list's links use too."""

    title = _("channel")
    parameter_name = CHANNEL_VAR
    template = "admin/fairqueue/message/channel_filter.html"

    def __init__(
        self, request: HttpRequest, params: dict[str, Any], model: Any, model_admin: Any
    ) -> None:
        super().__init__(request, params, model, model_admin)
        self.admin_site = model_admin.admin_site if model_admin is not None else admin.site
        raw = params.pop(self.parameter_name, None)
        if isinstance(raw, list):
            raw = raw[-1] if raw else None
        self.used_parameters: dict[str, Any] = {}
        self.channel: Channel | None = None
        self.invalid = False
        if raw not in (None, ""):
            try:
                self.used_parameters[self.parameter_name] = int(raw)
            except (TypeError, ValueError):
                self.invalid = True
            else:
                self.channel = Channel.objects.filter(pk=int(raw)).only("pk", "name").first()

    def has_output(self) -> bool:
        return True

    def value(self) -> int | None:
        value: int | None = self.used_parameters.get(self.parameter_name)
        return value

    def expected_parameters(self) -> list[str | None]:
        return [self.parameter_name]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.invalid:
            return queryset.none()
        value = self.value()
        return queryset.filter(channel_id=value) if value is not None else queryset

    def widget(self) -> AutocompleteSelect:
        return channel_widget(self.admin_site)

    def choices(self, changelist: Any) -> Iterator[dict[str, Any]]:
        value = self.value()
        field = forms.ModelChoiceField(
            queryset=Channel.objects.only("pk", "name"),
            required=False,
            widget=self.widget(),
        )
        yield {
            "selected": value is None,
            "query_string": changelist.get_query_string(remove=[self.parameter_name]),
            "display": _("All"),
            "widget": field.widget.render(self.parameter_name, value),
            "base": changelist.get_query_string(remove=[self.parameter_name]),
            "parameter": self.parameter_name,
        }
        if value is not None:
            yield {
                "selected": True,
                "query_string": changelist.get_query_string({self.parameter_name: value}),
                "display": str(self.channel) if self.channel else f"#{value} (no such channel)",
            }


def channel_widget(admin_site: Any) -> AutocompleteSelect:
    return AutocompleteSelect(
        Message._meta.get_field("channel"),
        admin_site,
        attrs={
            "class": "fq-channel-select",
            "data-placeholder": str(_("Type a channel name")),
            "style": "width: 100%",
        },
    )

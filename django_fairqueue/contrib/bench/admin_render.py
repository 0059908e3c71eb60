"""Admin server time: every admin page over a big queue, against a 300 ms bound.

Target: with 1,000,000 messages over 10,000 channels, every admin page answers in 300 ms or
less (median of a few requests). The queue is bulk-loaded by ``INSERT ... SELECT`` over
``generate_series`` (``db.load_admin_messages``) with a realistic mix: ids follow enqueue order,
so the oldest 60 % have finished (most succeeded, 1 in 20 failed for good, 1 in 20 cancelled),
the next 1 % run under the leases of 8 registered workers, and the newest 39 % wait (3 in 4
ready, 1 in 4 delayed); 9 common task names and a rare one (1 in 100). Then half an hour of
per-minute statistics (20 % of the channels active a minute), a work-batch job of 500 batches,
and VACUUM ANALYZE, as autovacuum would have run on a queue that old.

Each page is requested through Django's test ``Client`` by a temporary superuser, in process
(no network, no browser): the figure is server time, SQL and template rendering included. The
pages: the channel list (by name, every sortable column, every choice of every filter), a
channel's change page, the channel autocomplete, the message list (newest first, oldest first,
by channel both ways, a page half-way down in both orders, the last page, every state, common
and rare task names, one channel, one channel's failed messages, search by task name and by
id), three message change pages (running, failed, ready), the dashboard and its JSON, the
workers and the work batches. The data is loaded once for all the pages (cells) of a run.

Scale: ``--messages`` and ``--channels`` (default from the size preset: 1,000,000 and 10,000
for the full run). The admin must be installed and routed (``admin:`` URLs). Every query of the
run, the admin's included, goes to the benchmark's database (a router set for the run), so with
``--scratch`` the temporary user lives and dies there.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import models
from django.urls import NoReverseMatch, reverse
from django.utils import timezone

from django_fairqueue import conf, stats
from django_fairqueue.contrib.bench import db
from django_fairqueue.contrib.bench.figures import median, percentile
from django_fairqueue.contrib.bench.harness import Bench, BenchmarkError, load1
from django_fairqueue.contrib.bench.scenario import Column, Scenario
from django_fairqueue.contrib.bench.sizes import Sizes
from django_fairqueue.db import stats_store
from django_fairqueue.models import Channel
from django_fairqueue.observe import moments

#: The bound for every page (median of the samples).
TARGET_MS = 300.0
#: Statistics written before timing: this many minutes, this share of channels active a minute.
STATS_MINUTES = 30
STATS_ACTIVE_SHARE = 0.2
#: Messages per INSERT: progress moves, and no single statement writes a gigabyte.
LOAD_CHUNK = 100_000
#: Work batches of the one planned job.
WORK_BATCHES = 500
#: The task names the load writes (sql/bench.sql, load_admin_messages).
COMMON_TASK = "bench.admin.task_3"
RARE_TASK = "bench.admin.rare_report"


@dataclass(frozen=True)
class Page:
    """A page to time: its URL name, URL arguments and query, with ``{placeholders}`` filled
    from the loaded data (see :func:`_fill`)."""

    name: str
    url: str
    args: tuple[str, ...] = ()
    query: str = ""


@dataclass(frozen=True)
class AdminCell:
    page: Page
    messages: int
    channels: int
    samples: int

    @property
    def label(self) -> str:
        return f"admin {self.page.name:<32} {self.messages:>9,} msgs / {self.channels:,} ch."


@dataclass(frozen=True)
class AdminResult:
    page: str
    url: str
    messages: int
    channels: int
    samples: int
    median_ms: float
    p95_ms: float
    max_ms: float
    #: Of the median request: time in SQL (as the connection measured it) and statements.
    sql_ms: float
    queries: int
    kib: float
    under_target: bool
    load1: float


def _sortable_columns(model_admin: Any, model: type[models.Model]) -> list[tuple[int, str]]:
    """(index in the ``o=`` parameter, name) of each column the list sorts by."""
    names = [str(n) for n in model_admin.list_display]
    allowed = model_admin.sortable_by
    fields = {f.name for f in model._meta.get_fields()}
    out = []
    for i, name in enumerate(names, start=1):  # 0 is the action checkbox
        if allowed is not None and name not in allowed:
            continue
        attr = getattr(model_admin, name, None)
        if name in fields or getattr(attr, "admin_order_field", None):
            out.append((i, name))
    return out


def _filter_queries(model_admin: Any, model: type[models.Model]) -> list[tuple[str, str]]:
    """(title, query string) of every choice of every list filter that offers fixed choices."""
    from django.contrib import admin

    out: list[tuple[str, str]] = []
    for spec in model_admin.list_filter:
        if isinstance(spec, str):
            field = model._meta.get_field(spec)
            if isinstance(field, models.BooleanField):
                out += [(f"{spec}={v}", f"{spec}__exact={v}") for v in (1, 0)]
            elif choices := getattr(field, "choices", None):
                out += [(f"{spec}={v}", f"{spec}__exact={v}") for v, _ in choices]
        elif isinstance(spec, type) and issubclass(spec, admin.SimpleListFilter):
            flt = spec(None, {}, model, model_admin)  # type: ignore[arg-type]
            out += [
                (f"{flt.parameter_name}={v}", f"{flt.parameter_name}={v}")
                for v, _ in flt.lookup_choices
            ]
    return out


def pages() -> list[Page]:
    """Every page the scenario times, in order."""
    from django.contrib import admin

    from django_fairqueue.admin.lists import CURSOR_VAR
    from django_fairqueue.models import Message

    channel_admin = admin.site._registry[Channel]
    message_admin = admin.site._registry[Message]
    out = [Page("channels", "admin:fairqueue_channel_changelist")]
    for i, name in _sortable_columns(channel_admin, Channel):
        out.append(Page(f"channels by {name} desc", out[0].url, query=f"o=-{i}"))
    for title, query in _filter_queries(channel_admin, Channel):
        out.append(Page(f"channels {title}", out[0].url, query=query))
    out += [
        Page("channels search", out[0].url, query="q=tenant-0001"),
        Page("channel change", "admin:fairqueue_channel_change", ("{channel}",)),
        Page(
            "channel autocomplete",
            "admin:autocomplete",
            query="app_label=fairqueue&model_name=message&field_name=channel&term=tenant-00",
        ),
    ]
    messages = "admin:fairqueue_message_changelist"
    columns = dict((name, i) for i, name in _sortable_columns(message_admin, Message))
    by_id, by_channel = columns["id"], columns["channel_link"]
    cur = CURSOR_VAR
    out += [
        Page("messages", messages),
        Page("messages oldest first", messages, query=f"o={by_id}"),
        Page("messages half-way down", messages, query=f"{cur}=a{{deep_id}}"),
        Page("messages last page", messages, query=f"{cur}=last"),
        Page("messages by channel", messages, query=f"o={by_channel}"),
        Page("messages by channel desc", messages, query=f"o=-{by_channel}"),
        Page(
            "messages by channel half-way",
            messages,
            query=f"o={by_channel}&{cur}=a{{deep_channel}}.0",
        ),
    ]
    for title, query in _filter_queries(message_admin, Message):
        out.append(Page(f"messages {title}", messages, query=query))
    out += [
        Page("messages task common", messages, query=f"task_name={COMMON_TASK}"),
        Page("messages task rare", messages, query=f"task_name={RARE_TASK}"),
        Page(
            "messages task rare deep", messages, query=f"task_name={RARE_TASK}&{cur}=a{{deep_id}}"
        ),
        Page("messages one channel", messages, query="channel__id__exact={channel}"),
        Page(
            "messages channel failed",
            messages,
            query="channel__id__exact={channel}&state__exact=failed",
        ),
        Page("messages ready half-way", messages, query=f"state__exact=ready&{cur}=a{{deep_id}}"),
        Page("messages search task", messages, query=f"q={COMMON_TASK}"),
        Page("messages search prefix", messages, query="q=bench.admin.rare"),
        Page("messages search id", messages, query="q={message_failed}"),
        Page("message running", "admin:fairqueue_message_change", ("{message_running}",)),
        Page("message failed", "admin:fairqueue_message_change", ("{message_failed}",)),
        Page("message ready", "admin:fairqueue_message_change", ("{message_ready}",)),
        Page("dashboard", "admin:fairqueue_channel_dashboard"),
        Page("dashboard json", "admin:fairqueue_channel_dashboard_data"),
        Page("workers", "admin:fairqueue_workerrecord_changelist"),
        Page("workers dead", "admin:fairqueue_workerrecord_changelist", query="state=dead"),
        Page("workers busy", "admin:fairqueue_workerrecord_busy"),
        Page("messages of a worker", messages, query="worker=fairbench-admin-3"),
        Page("work batches", "admin:fairqueue_workbatch_changelist"),
    ]
    usage = "admin:fairqueue_usagehour_changelist"
    out += [
        Page("usage yesterday", usage),
        # sorted in Python over the same rows: one by name, one by a ratio
        Page("usage by name", usage, query="o=name"),
        Page("usage by failure rate", usage, query="o=-failure_rate"),
        Page("usage by group", usage, query="by=group"),
        Page("usage whole retention", usage, query="from={first_day}&to=today"),
        Page("usage whole retention csv", usage, query="from={first_day}&to=today&format=csv"),
    ]
    return out


def plan(sizes: Sizes) -> list[AdminCell]:
    return [
        AdminCell(page, sizes.admin_messages, sizes.admin_channels, sizes.admin_samples)
        for page in pages()
    ]


class _OneDatabase:
    """A router sending every model to the benchmark's database, for the run."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def db_for_read(self, model: Any, **hints: Any) -> str:
        return self.alias

    def db_for_write(self, model: Any, **hints: Any) -> str:
        return self.alias

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool:
        return True


@contextmanager
def _admin_client(using: str) -> Iterator[Any]:
    """A test Client signed in as a temporary superuser, everything on ``using``."""
    from django.contrib.auth import get_user_model
    from django.test import Client, override_settings

    try:
        reverse("admin:fairqueue_channel_changelist")
    except NoReverseMatch as exc:
        raise BenchmarkError(
            "the admin scenario needs django.contrib.admin in INSTALLED_APPS and its URLs "
            "routed (path('admin/', admin.site.urls))"
        ) from exc
    hosts = [*settings.ALLOWED_HOSTS, "testserver"]
    with override_settings(DATABASE_ROUTERS=[_OneDatabase(using)], ALLOWED_HOSTS=hosts):
        user_model = get_user_model()
        user = user_model._default_manager.db_manager(using).create_superuser(
            username=f"fairbench-{secrets.token_hex(4)}",
            email="fairbench@example.invalid",
            # No password: force_login needs none, and hashing one (PBKDF2's iterations) cost
            # each page's cell about 0.4 s of CPU beside the page it measures.
            password=None,
        )
        client = Client()
        client.force_login(user)
        try:
            yield client
        finally:
            client.logout()
            user.delete()


def _load(bench: Bench, cell: AdminCell) -> dict[str, Any]:
    """The big queue (see the module's docstring); returns the placeholders of the pages."""
    from django_fairqueue.models import Message, MessageState

    using = bench.using
    began = time.perf_counter()
    bench.reset()
    stats_store.prune_channel_stats(timezone.now() + timedelta(days=1), using=using)
    width = max(5, len(str(cell.channels - 1)))
    Channel.objects.using(using).bulk_create(
        [Channel(name=f"tenant-{i:0{width}d}") for i in range(cell.channels)], batch_size=5_000
    )
    ids = list(Channel.objects.using(using).order_by("pk").values_list("pk", flat=True))
    for start in range(1, cell.messages + 1, LOAD_CHUNK):
        n = min(LOAD_CHUNK, cell.messages - start + 1)
        bench.progress.update(
            f"loading {start - 1:,}/{cell.messages:,} messages", (start - 1) / cell.messages
        )
        db.load_admin_messages(ids, start, n, cell.messages, using=using)
    db.count_admin_messages(using=using)
    db.load_admin_workers(using=using)
    db.load_admin_work_batches(ids[0], WORK_BATCHES, using=using)
    _write_stats(ids, using)
    bench.progress.update("loading usage")
    db.load_admin_usage(conf.get().USAGE_RETENTION.days, using=using)
    db.analyze_admin_usage(using=using)
    bench.settle()
    bench.progress.update("VACUUM ANALYZE")
    db.vacuum_queue_tables(using=using)
    bench.progress.say(
        f"admin: {cell.messages:,} messages over {cell.channels:,} channels built in "
        f"{time.perf_counter() - began:.0f}s (VACUUM ANALYZE included)"
    )

    def one(state: str) -> int:
        found = Message.objects.using(using).order_by("pk").values_list("pk", flat=True)
        # of the first channel, else of any (a small queue), else any message at all
        pk = (
            found.filter(state=state, channel_id=ids[0]).first()
            or found.filter(state=state).first()
        )
        return int(pk or found[0])

    return {
        "channel": ids[0],
        "deep_id": cell.messages // 2 + 1,
        "deep_channel": ids[len(ids) // 2],
        "message_running": one(MessageState.RUNNING),
        "message_failed": one(MessageState.FAILED),
        "message_ready": one(MessageState.READY),
        "first_day": (
            moments.today() - timedelta(days=conf.get().USAGE_RETENTION.days - 1)
        ).isoformat(),
    }


def _write_stats(ids: list[int], using: str) -> None:
    """Half an hour of statistics, as workers would have flushed them."""
    now = timezone.now()
    active = max(1, int(len(ids) * STATS_ACTIVE_SHARE))
    buckets = len(stats.BUCKETS) + 1
    for minute in range(STATS_MINUTES):
        at = stats.minute_of(now - timedelta(minutes=minute))
        start = (minute * active) % len(ids)
        rows = []
        for k in range(active):
            cid = ids[(start + k) % len(ids)]
            histogram = [0] * buckets
            histogram[5 + (cid % 6)] = 20
            rows.append(
                stats_store.ChannelMinuteStats(
                    cid,
                    at,
                    claimed=20,
                    succeeded=19,
                    failed=1,
                    wait_ms_sum=20 * 40,
                    wait_ms_max=2_000,
                    wait_histogram=tuple(histogram),
                    run_ms_sum=20 * 150,
                )
            )
        for chunk in range(0, len(rows), 5_000):
            stats_store.record_channel_stats(rows[chunk : chunk + 5_000], using=using)


def _cleanup(bench: Bench) -> None:
    """What the queue-table TRUNCATE at the end of the run does not remove."""
    stats_store.prune_channel_stats(timezone.now() + timedelta(days=1), using=bench.using)
    db.delete_admin_workers(using=bench.using)
    db.delete_admin_usage(using=bench.using)
    bench.state.pop("admin_render", None)


def _fill(page: Page, values: dict[str, Any]) -> str:
    url = reverse(page.url, args=[a.format(**values) for a in page.args])
    query = page.query.format(**values)
    return url + (f"?{query}" if query else "")


class _SqlTimer:
    """Time spent in the database's statements during one request, to the microsecond
    (Django's captured query times are rounded to the millisecond)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count = 0

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        began = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            self.seconds += time.perf_counter() - began
            self.count += 1


def run(bench: Bench, cell: AdminCell) -> AdminResult:
    loaded = bench.state.get("admin_render")
    if loaded is None or loaded[0] != (cell.messages, cell.channels):
        bench.state["admin_render"] = ((cell.messages, cell.channels), _load(bench, cell))
    values = bench.state["admin_render"][1]
    from django.db import connections

    load = load1()
    times: list[float] = []
    sql: list[tuple[float, int]] = []
    size = 0
    url = _fill(cell.page, values)
    try:
        with _admin_client(bench.using) as client:
            for i in range(cell.samples + 1):  # one warm-up request: caches, prepared plans
                bench.progress.update(f"{url} {i + 1}/{cell.samples + 1}")
                timer = _SqlTimer()
                with connections[bench.using].execute_wrapper(timer):
                    began = time.perf_counter()
                    response = client.get(url)
                    elapsed = (time.perf_counter() - began) * 1000
                if response.status_code != 200:
                    raise BenchmarkError(f"GET {url} answered {response.status_code}")
                size = len(response.content)
                if i >= 1:
                    times.append(elapsed)
                    sql.append((timer.seconds * 1000, timer.count))
    except BaseException:
        _cleanup(bench)
        raise
    if cell.page == pages()[-1]:  # the last page: leave no statistics or workers behind
        _cleanup(bench)
    mid = median(times)
    sql_ms, queries = sql[min(range(len(times)), key=lambda k: abs(times[k] - mid))]
    return AdminResult(
        page=cell.page.name,
        url=url,
        messages=cell.messages,
        channels=cell.channels,
        samples=len(times),
        median_ms=round(mid, 1),
        p95_ms=round(percentile(times, 95), 1),
        max_ms=round(max(times), 1),
        sql_ms=round(sql_ms, 1),
        queries=queries,
        kib=round(size / 1024, 1),
        under_target=not math.isnan(mid) and mid <= TARGET_MS,
        load1=round(load, 2),
    )


SCENARIO = Scenario(
    name="admin",
    title="Admin server time (ms)",
    plan=plan,
    run=run,
    columns=(
        Column("page", "page"),
        Column("messages", "messages", ","),
        Column("channels", "channels", ","),
        Column("median ms", "median_ms", ".0f"),
        Column("p95 ms", "p95_ms", ".0f"),
        Column("max ms", "max_ms", ".0f"),
        Column("SQL ms", "sql_ms", ".0f"),
        Column("queries", "queries"),
        Column("KiB", "kib", ".0f"),
        Column(f"<= {TARGET_MS:.0f} ms", "under_target"),
        Column("load", "load1", ".2f"),
    ),
    summary=lambda r: f"median {r.median_ms:.0f} ms, max {r.max_ms:.0f} ms",
    key=("page", "messages", "channels"),
    metric="median_ms",
    higher_is_better=False,
    notes=(
        "Each page fetched through Django's test Client by a superuser (server time: SQL and "
        "templates, no network); one warm-up request, then the samples (median shown). SQL ms and "
        "queries: of the median request, as the connection timed its statements (the rest is "
        "Python: the admin's code and the templates). Lists: 100 rows a page.",
        "Data: ids in enqueue order; the oldest 60 % finished (5 % of them failed, 5 % "
        "cancelled), 1 % running under 8 workers' leases, the newest 39 % waiting (ready, 1 in "
        f"4 delayed); 10 task names, one of them rare (1 %); {STATS_MINUTES} minutes of "
        f"statistics for {STATS_ACTIVE_SHARE:.0%} of the channels a minute; a job of "
        f"{WORK_BATCHES} work batches; VACUUM ANALYZE after the load.",
    ),
)

"""Admin render time: the channel list and the dashboard over a big queue.

Target: with 1,000,000 queued messages over 10,000 channels, the channel list and the dashboard
render in under 500 ms. The backlog is bulk-loaded (``load_ready_messages``), then some of it is
claimed (running), some failed (dead letters), and half an hour of per-minute statistics is
written for 2,000 active channels a minute (60,000 rows), as workers would have flushed them.
Each page is requested through Django's test ``Client`` by a temporary superuser, in process
(no network, no browser): the figure is server time, SQL and template rendering included. The
data is loaded once for all the pages (cells) of a run.

The admin must be installed and routed (``admin:`` URLs). Every query of the run, the admin's
included, goes to the benchmark's database (a router set for the run), so with ``--scratch``
the temporary user lives and dies there.
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
from django.urls import NoReverseMatch, reverse
from django.utils import timezone

from django_fairqueue import stats, store
from django_fairqueue.contrib.bench.harness import Bench, BenchmarkError, load1
from django_fairqueue.contrib.bench.scenario import Column, Scenario
from django_fairqueue.contrib.bench.sizes import Sizes
from django_fairqueue.figures import median, percentile

#: The issue's bound for every page (p95 of the samples).
TARGET_MS = 500.0
#: sizes name -> (messages, channels, samples per page)
SIZES = {
    "full": (1_000_000, 10_000, 15),
    "quick": (200_000, 10_000, 7),
    "tiny": (2_000, 20, 2),
}
#: Statistics written before timing: this many minutes, this share of channels active a minute.
STATS_MINUTES = 30
STATS_ACTIVE_SHARE = 0.2
#: page -> (URL name, query string); the two sorts are the list's backlog and age columns.
PAGES = {
    "channels": ("admin:fairqueue_channel_changelist", ""),
    "channels by backlog": ("admin:fairqueue_channel_changelist", "o=-{ready_display}"),
    "channels by age": ("admin:fairqueue_channel_changelist", "o=-{oldest_ready_display}"),
    "dashboard": ("admin:fairqueue_channel_dashboard", ""),
    "dashboard json": ("admin:fairqueue_channel_dashboard_data", ""),
}


@dataclass(frozen=True)
class AdminCell:
    page: str
    messages: int
    channels: int
    samples: int

    @property
    def label(self) -> str:
        return f"admin {self.page:<19} {self.messages:>9,} msgs / {self.channels:,} channels"


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
    kib: float
    under_target: bool
    load1: float


def plan(sizes: Sizes) -> list[AdminCell]:
    messages, channels, samples = SIZES.get(sizes.name, SIZES["quick"])
    return [AdminCell(page, messages, channels, samples) for page in PAGES]


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
            password=secrets.token_urlsafe(16),
        )
        client = Client()
        client.force_login(user)
        try:
            yield client
        finally:
            client.logout()
            user.delete()


def _load(bench: Bench, cell: AdminCell) -> None:
    """The big queue: backlog, some running and failed, half an hour of statistics."""
    bench.reset()
    store.prune_channel_stats(timezone.now() + timedelta(days=1), using=bench.using)
    names = [f"tenant-{i:05d}" for i in range(cell.channels)]
    bench.load(names, cell.messages)
    lease = timedelta(minutes=30)
    worker = "fairbench-admin"
    failure = {"type": "fairbench.Error", "message": "failed on purpose", "traceback": None}
    # Claims spread over channels (quantum 1): about 1 % running, half of those failed.
    for _ in range(max(1, cell.messages // 100 // 1000)):
        claimed = store.claim_messages(
            min(1000, cell.messages), lease=lease, worker_id=worker, quantum=1, using=bench.using
        )
        half = claimed[: len(claimed) // 2]
        store.fail_messages([(m.id, m.lease_token, failure, None) for m in half], using=bench.using)
    ids = sorted(store.select_channel_ids(names, using=bench.using).values())
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
                store.ChannelMinuteStats(
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
            store.record_channel_stats(rows[chunk : chunk + 5_000], using=bench.using)
    bench.settle()
    bench.state["admin_render"] = (cell.messages, cell.channels)


def run(bench: Bench, cell: AdminCell) -> AdminResult:
    from django_fairqueue.admin import ChannelAdmin

    if bench.state.get("admin_render") != (cell.messages, cell.channels):
        _load(bench, cell)
    name, query = PAGES[cell.page]
    columns = ["action_checkbox", *map(str, ChannelAdmin.list_display)]
    query = query.format(**{c: i for i, c in enumerate(columns)})
    load = load1()
    times: list[float] = []
    size = 0
    with _admin_client(bench.using) as client:
        url = reverse(name) + (f"?{query}" if query else "")
        for i in range(cell.samples + 2):  # two warm-up requests: caches, prepared plans
            bench.progress.update(f"{url} {i + 1}/{cell.samples + 2}")
            began = time.perf_counter()
            response = client.get(url)
            elapsed = (time.perf_counter() - began) * 1000
            if response.status_code != 200:
                raise BenchmarkError(f"GET {url} answered {response.status_code}")
            size = len(response.content)
            if i >= 2:
                times.append(elapsed)
    if cell.page == list(PAGES)[-1]:  # the last page: leave no statistics behind
        store.prune_channel_stats(timezone.now() + timedelta(days=1), using=bench.using)
        bench.state.pop("admin_render", None)
    p95 = percentile(times, 95)
    return AdminResult(
        page=cell.page,
        url=url,
        messages=cell.messages,
        channels=cell.channels,
        samples=len(times),
        median_ms=round(median(times), 1),
        p95_ms=round(p95, 1),
        max_ms=round(max(times), 1),
        kib=round(size / 1024, 1),
        under_target=not math.isnan(p95) and p95 < TARGET_MS,
        load1=round(load, 2),
    )


SCENARIO = Scenario(
    name="admin",
    title="Admin render time (ms, server side)",
    plan=plan,
    run=run,
    columns=(
        Column("page", "page"),
        Column("messages", "messages", ","),
        Column("channels", "channels", ","),
        Column("median ms", "median_ms", ".0f"),
        Column("p95 ms", "p95_ms", ".0f"),
        Column("max ms", "max_ms", ".0f"),
        Column("KiB", "kib", ".0f"),
        Column(f"< {TARGET_MS:.0f} ms", "under_target"),
        Column("load", "load1", ".2f"),
    ),
    summary=lambda r: f"median {r.median_ms:.0f} ms, p95 {r.p95_ms:.0f} ms",
    key=("page", "messages", "channels"),
    metric="median_ms",
    higher_is_better=False,
    notes=(
        "Each page fetched through Django's test Client by a superuser (server time: SQL and "
        "templates, no network); two warm-up requests, then the samples. Channel list: 100 "
        "channels a page, by name, by backlog (ready, descending) and by oldest ready age "
        "(longest-waiting first). Dashboard: the HTML page (20 tenants) and its JSON.",
        f"Data: the backlog bulk-loaded round-robin, ~1 % claimed (half of it failed), and "
        f"{STATS_MINUTES} minutes of statistics for {STATS_ACTIVE_SHARE:.0%} of the channels "
        "a minute.",
    ),
)

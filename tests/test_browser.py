"""The admin in a real browser: headless Chromium (Debian's package) driven by Playwright.

Two tests. One logs in, opens the dashboard (charts drawn by dashboard.js), watches it refresh,
changes a tenant's max concurrency through the channel form, and sees the change on the
dashboard. The other visits every page of the fairqueue admin (:data:`PAGES`: the app index,
the dashboard, the channel list, a channel, the purge confirmation, the message list, a
message, the workers, the work batches with their jobs table, a work batch) in the light and
the dark theme (``prefers-color-scheme``), and checks what a person sees, from the computed
styles and the boxes laid out: the theme's background, breadcrumbs styled as one bar on one
line, table headers apart from each other, the wait chart's lines not filled, no script error
and no failed request. Run it on each Django the app supports (the default .venv has Django
5.2; ``python3 dev.py tox -e py312-django61-nospark -- tests/test_browser.py`` runs 6.1).

Skipped with the reason when /usr/bin/chromium or the ``playwright`` package is missing
(``.ci/run`` installs Chromium with apt-get; ``playwright install`` is never used).

Screenshots (1440 px wide, the whole page) go to the test's temporary directory; with
``FAIRQUEUE_SCREENSHOTS=docs/img`` they are also written there, as ``admin-<page>.png`` and
``admin-<page>-dark.png`` (the images in docs/howto/admin.md and the README come from such a
run).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import date, datetime, time, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
from django.contrib.auth.models import User
from django.db import connections
from django.utils import timezone

from django_fairqueue import stats
from django_fairqueue.db import message_store, worker_store
from django_fairqueue.models import (
    BatchState,
    Channel,
    Message,
    MessageState,
    Schedule,
    WorkBatch,
)
from django_fairqueue.runtime import worker_registry
from tests.factories import channel_ids, enqueue, fold_all

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PASSWORD = "browser-test-password"
#: The width of the screenshots in docs/img, and the most height they show (a list of 100
#: rows is cut: the top of the page is what the docs show).
WIDTH = 1440
MAX_HEIGHT = 1800
T = TypeVar("T")

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _playwright() -> Any:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: apt-get install chromium (.ci/run does)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is not installed: pip install -e '.[dev]'")
    return sync_playwright


def off_loop(fn: Callable[[], T]) -> T:
    """Run Django ORM code in another thread: Playwright's sync API keeps an event loop
    running in this one, where Django refuses synchronous database access."""
    with ThreadPoolExecutor(1) as pool:
        try:
            return pool.submit(fn).result()
        finally:
            pool.submit(connections.close_all).result()


def load_demo_data() -> None:
    """A few tenants as an operator would see them: backlogs, a capped one at its cap, a
    paused one, failures, and half an hour of worker statistics."""
    tenants = {
        "acme-corp": 1250,
        "globex": 300,
        "initech": 75,
        "umbrella": 640,
        "stark-industries": 20,
        "hooli": 1,
    }
    for name, n in tenants.items():
        enqueue(name, n)
    enqueue("globex", 40, run_after=timedelta(minutes=30))
    Channel.objects.filter(name="acme-corp").update(max_concurrency=8)
    Channel.objects.filter(name="umbrella").update(weight=2, max_backlog=5000)
    Channel.objects.filter(name="stark-industries").update(release_interval=timedelta(seconds=2))
    # periodic schedules: a tenant's own, in its timezone, and a paused one
    acme, globex = (Channel.objects.get(name=n) for n in ("acme-corp", "globex"))
    Schedule.objects.create(
        name="weekly report",
        channel=acme,
        task_name="reports.weekly",
        kwargs={"format": "pdf"},
        cron="0 8 * * MON",
        timezone="Europe/Berlin",
        jitter=timedelta(minutes=10),
    )
    Schedule.objects.create(
        name="nightly sync",
        channel=globex,
        task_name="sync.pull",
        cron="*/30 * * * *",
        timezone="America/New_York",
        missed="catch_up",
        enabled=False,
    )
    Channel.objects.filter(name="initech").update(paused=True)
    ids = channel_ids(tenants)
    lease = timedelta(minutes=30)
    for name, n in (("acme-corp", 8), ("globex", 3), ("umbrella", 5)):
        message_store.claim_messages(
            n, lease=lease, worker_id="demo-worker", only_channel_ids=[ids[name]], quantum=n
        )
    failure = {
        "type": "documents.errors.CorruptPDF",
        "message": "xref table not found",
        "traceback": "Traceback (most recent call last):\n"
        '  File "documents/tasks.py", line 42, in process_document\n'
        "    pages = parse(pdf)\n"
        "documents.errors.CorruptPDF: xref table not found\n",
    }
    for name, n in (("globex", 12), ("hooli", 1)):
        claimed = message_store.claim_messages(
            n, lease=lease, worker_id="demo-worker", only_channel_ids=[ids[name]], quantum=n
        )
        message_store.fail_messages([(m.id, m.lease_token, failure, None) for m in claimed])
    # umbrella fails now and then: six messages wait for their retry
    claimed = message_store.claim_messages(
        6, lease=lease, worker_id="demo-worker", only_channel_ids=[ids["umbrella"]], quantum=6
    )
    timeout = {**failure, "type": "django_fairqueue.exceptions.TaskTimeout"}
    timeout["message"] = "task documents.process exceeded its time limit of 30 s"
    message_store.fail_messages(
        [(m.id, m.lease_token, timeout, timedelta(minutes=10)) for m in claimed]
    )
    fold_all()
    # How long each tenant's work has been waiting (test data: set directly on the rows).
    for name, minutes in (("acme-corp", 12), ("umbrella", 3), ("globex", 1), ("initech", 25)):
        since = timezone.now() - timedelta(minutes=minutes)
        Message.objects.filter(channel_id=ids[name], state=MessageState.READY).update(
            enqueued_at=since, run_at=since
        )
    # Half an hour of statistics, as workers would have flushed them.
    recorder = stats.StatsRecorder()
    now = timezone.now()
    profile = {  # tenant: (claims per minute, typical wait ms)
        "acme-corp": (40, 900.0),
        "globex": (25, 120.0),
        "umbrella": (50, 300.0),
        "stark-industries": (30, 1500.0),
        "hooli": (5, 15.0),
    }
    for minute in range(30, -1, -1):
        at = now - timedelta(minutes=minute)
        for name, (per_minute, wait) in profile.items():
            messages = [
                message_store.ClaimedMessage(
                    id=0,
                    channel_id=ids[name],
                    channel=name,
                    task_name="documents.process",
                    payload={},
                    priority=0,
                    attempts=1,
                    max_attempts=5,
                    keep_result=False,
                    lease_token=None,  # type: ignore[arg-type]
                    lease_expires_at=at,
                    enqueued_at=at - timedelta(milliseconds=wait * (0.2 + 1.6 * (i % 7) / 6)),
                    run_at=at - timedelta(hours=1),
                )
                for i in range(per_minute + (minute % 5))
            ]
            recorder.record_claimed(messages, at)
            for i, _ in enumerate(messages):
                outcome = "succeeded"
                if name == "globex" and i == 0 and minute % 3 == 0:
                    outcome = "failed"
                elif name == "umbrella" and i < 2 and minute < 4:
                    outcome = "retried"
                recorder.record_settled(ids[name], outcome, 250.0, at=at)  # type: ignore[arg-type]
    recorder.flush()
    load_demo_batches_and_workers()
    load_demo_incident(ids)


def load_demo_incident(ids: dict[str, int]) -> None:
    """What a support engineer meets in an incident: a tenant starving under its backlog,
    one over its cap, a dead worker whose messages were taken back, a supervisor's processes,
    and the usage of a past day."""
    enqueue("soylent", 30)
    soylent = channel_ids(["soylent"])["soylent"]
    since = timezone.now() - timedelta(minutes=20)
    Message.objects.filter(channel_id=soylent).update(enqueued_at=since, run_at=since)
    with connections["default"].cursor() as cur:  # served last a quarter of an hour ago
        cur.execute(
            "UPDATE fairqueue_channel SET last_claimed_at = %s WHERE id = %s",
            [timezone.now() - timedelta(minutes=15), soylent],
        )
    # umbrella runs 5 under a cap lowered to 4: over its cap
    Channel.objects.filter(name="umbrella").update(max_concurrency=4)
    # a worker that died holding two of globex's messages: its leases expired, rescued
    worker_store.register_worker(
        "batch-7:977",
        host="batch-7",
        pid=977,
        version="0.1.0",
        concurrency=4,
        channels=[],
        exclude_channels=[],
        dead_after=30.0,
    )
    held = message_store.claim_messages(
        2,
        lease=timedelta(minutes=30),
        worker_id="batch-7:977",
        only_channel_ids=[ids["globex"]],
        quantum=2,
    )
    assert len(held) == 2
    with connections["default"].cursor() as cur:
        cur.execute(
            "UPDATE fairqueue_worker SET heartbeat_at = now() - interval '10 minutes' "
            "WHERE worker_id = 'batch-7:977'"
        )
    worker_registry.rescue_dead_workers()
    message_store.rescue_expired_messages()
    # a supervisor's two processes (runfairworker --processes 2)
    for child in ("web-3:5101", "web-3:5102"):
        worker_store.register_worker(
            child,
            host="web-3",
            pid=int(child.split(":")[1]),
            version="0.1.0",
            concurrency=4,
            channels=[],
            exclude_channels=[],
            dead_after=30.0,
        )
        worker_store.set_worker_supervisor(child, "web-3:5100")
    # a past day's usage: worker time, attempts and failures per tenant
    recorder = stats.StatsRecorder()
    noon = timezone.make_aware(datetime.combine(usage_day(), time(12)))
    for name, (attempts, failed, run_ms) in {
        "acme-corp": (4200, 3, 2_100.0),
        "umbrella": (2600, 140, 3_100.0),
        "globex": (900, 60, 450.0),
        "hooli": (40, 0, 90.0),
    }.items():
        for i in range(attempts):
            outcome = "retried" if i < failed else "succeeded"
            recorder.record_settled(ids[name], outcome, run_ms, at=noon)  # type: ignore[arg-type]
    recorder.flush()


def usage_day() -> date:
    """The day the demo's usage was recorded on: the day before yesterday, so that the last
    half hour's statistics, which are yesterday's shortly after midnight, never mix in."""
    return timezone.localdate() - timedelta(days=2)


def load_demo_batches_and_workers() -> None:
    """Two jobs of work batches (one running, one with failures) and two workers."""
    enqueue("data-pipeline", 1)  # the batches' channel
    channel = Channel.objects.get(name="data-pipeline")
    now = timezone.now()
    failed = {
        "attempts": 3,
        "finished_at": now,
        "rows_processed": 1200,
        "last_error": {"type": "psycopg.errors.QueryCanceled", "message": "statement timeout"},
    }
    for i in range(12):
        # eight batches done a minute apart, two running, two pending
        more: dict[str, Any] = {}
        if i < 8:
            more = {
                "state": BatchState.SUCCEEDED,
                "attempts": 1,
                "rows_processed": 5000,
                "started_at": now - timedelta(minutes=9 - i),
                "finished_at": now - timedelta(minutes=8 - i),
                "worker_id": "web-1:4242",
            }
        elif i < 10:
            more = {
                "state": BatchState.RUNNING,
                "attempts": 1,
                "started_at": now - timedelta(seconds=20),
                "lease_token": uuid.uuid4(),
                "lease_expires_at": now + timedelta(minutes=5),
                "worker_id": "web-2:311",
            }
        WorkBatch.objects.create(
            channel=channel,
            job_name="orders-export",
            start_id=i * 5000 + 1,
            end_id=(i + 1) * 5000,
            row_count=5000,
            **more,
        )
    for i in range(4):
        WorkBatch.objects.create(
            channel=channel,
            job_name="search-reindex",
            start_id=i * 2000 + 1,
            end_id=(i + 1) * 2000,
            row_count=2000,
            state=BatchState.FAILED if i < 2 else BatchState.SUCCEEDED,
            **(failed if i < 2 else {"rows_processed": 2000, "finished_at": now}),
        )
    for worker, channels in (("web-1:4242", []), ("web-2:311", ["acme-corp", "globex"])):
        worker_store.register_worker(
            worker,
            host=worker.split(":")[0],
            pid=int(worker.split(":")[1]),
            version="0.1.0",
            concurrency=8,
            channels=channels,
            exclude_channels=[],
            dead_after=30.0,
        )


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    sync_playwright = _playwright()
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"),  # a fresh user data dir
            executable_path=str(CHROMIUM),
            args=CHROMIUM_ARGS,
            headless=True,
            viewport={"width": WIDTH, "height": 900},
        )
        try:
            yield context
        finally:
            context.close()


def save(path: Path) -> None:
    target = os.environ.get("FAIRQUEUE_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / path.name)


@pytest.fixture
def demo() -> int:
    """The operator and the demo data (before the browser starts: see off_loop); returns
    acme-corp's channel id."""
    User.objects.create_superuser("operator", "op@example.invalid", PASSWORD)
    load_demo_data()
    return channel_ids(["acme-corp"])["acme-corp"]


def test_dashboard_and_editing_a_tenant(
    demo: int, live_server: Any, browser: Any, tmp_path: Path
) -> None:
    acme = demo
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    dashboard = f"{live_server.url}/admin/fairqueue/channel/dashboard/"
    page.goto(f"{dashboard}?refresh=1")
    assert "/admin/login/" in page.url  # anonymous: the login page, no data
    page.fill("#id_username", "operator")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"{dashboard}?refresh=1")

    # charts drawn by dashboard.js
    page.wait_for_selector("#fq-chart-backlog svg rect")
    assert page.locator("#fq-chart-wait svg path.fq-line").count() == 2
    # the failing panel, most failing first: umbrella (8 failures in 5 minutes, 6 retrying),
    # globex (2 failures, 12 dead letters), hooli (1 dead letter)
    failing = page.locator("#fq-chart-failed svg text.fq-label").all_text_contents()
    assert failing == ["umbrella", "globex", "hooli"]
    row = page.locator("#fq-table tbody tr", has_text="acme-corp")
    assert "8 / 8" in row.inner_text()
    fairness = page.locator(".fq-card", has_text="fairness").locator(".fq-card-value")
    assert fairness.inner_text() not in ("", "-")

    # it refreshes itself: new work shows up without a reload
    off_loop(lambda: enqueue("acme-corp", 10))
    page.wait_for_function(
        "() => [...document.querySelectorAll('#fq-table tbody tr')].some("
        "tr => tr.textContent.includes('acme-corp') && tr.textContent.includes('1,252'))",
        timeout=15_000,
    )
    # change acme-corp's max concurrency through the channel form
    page.click("#fq-table tbody tr >> text=acme-corp")
    page.wait_for_url(f"**/admin/fairqueue/channel/{acme}/change/")
    page.fill("#id_max_concurrency", "12")
    page.click("input[name=_save]")
    page.wait_for_selector(".messagelist .success")
    assert off_loop(lambda: Channel.objects.get(pk=acme).max_concurrency) == 12

    page.goto(dashboard)
    page.wait_for_selector("#fq-table tbody tr")
    row = page.locator("#fq-table tbody tr", has_text="acme-corp")
    assert "8 / 12" in row.inner_text()

    assert not errors, errors


# ------------------------------------------------------------------------------------------
# Every page, light and dark: what a person sees

#: What the page checks read in the browser: boxes and computed styles.
LOOK = """() => {
  const style = (el, pseudo) => getComputedStyle(el, pseudo || null);
  const rgb = (text) => (text.match(/[0-9.]+/g) || []).map(Number);
  const luminance = (text) => {
    const [r, g, b, a] = rgb(text);
    return a === 0 ? null : (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255;
  };
  const textBox = (el) => {
    // the ink of the text itself: the union of its text nodes' boxes
    const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
    let left = Infinity;
    let right = -Infinity;
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      if (!node.textContent.trim()) continue;
      const range = document.createRange();
      range.selectNodeContents(node);
      const r = range.getBoundingClientRect();
      left = Math.min(left, r.left);
      right = Math.max(right, r.right);
    }
    return { left, right };
  };
  const crumbs = [...document.querySelectorAll(".breadcrumbs")].map((el) => {
    const s = style(el);
    const items = [...el.querySelectorAll("a")].map((a) => a.getBoundingClientRect());
    return {
      tag: el.tagName.toLowerCase(),
      background: s.backgroundColor,
      backgroundLuminance: luminance(s.backgroundColor),
      paddingLeft: parseFloat(s.paddingLeft),
      height: el.getBoundingClientRect().height,
      listStyle: s.listStyleType,
      linkTops: items.map((r) => Math.round(r.top)),
      gaps: items.slice(1).map((r, i) => r.left - items[i].right),
      linkLuminance: el.querySelector("a") ? luminance(style(el.querySelector("a")).color) : null,
    };
  });
  const headerRows = [...document.querySelectorAll("table thead tr")]
    .filter((tr) => tr.getBoundingClientRect().width > 0)
    .map((tr) => {
      const cells = [...tr.children].filter(
        (th) => th.textContent.trim() && th.getBoundingClientRect().width > 0
      );
      return {
        table: tr.closest("table").id || tr.closest("table").className,
        texts: cells.map((th) => th.textContent.trim()),
        // room between a header's edge and its text, and between neighbouring texts
        insets: cells.map((th) => textBox(th).left - th.getBoundingClientRect().left),
        gaps: cells.slice(1).map((th, i) => textBox(th).left - textBox(cells[i]).right),
      };
    });
  const lines = [...document.querySelectorAll("#fq-chart-wait path.fq-line")].map((p) => ({
    fill: style(p).fill,
    stroke: style(p).stroke,
  }));
  return {
    bodyLuminance: luminance(style(document.body).backgroundColor),
    textLuminance: luminance(style(document.body).color),
    crumbs,
    headerRows,
    lines,
    width: document.documentElement.scrollWidth,
  };
}"""


def check_looks_right(look: dict[str, Any], scheme: str, where: str) -> None:
    """What a person sees, from the computed styles and boxes ``LOOK`` read."""
    body, text = look["bodyLuminance"], look["textLuminance"]
    if scheme == "dark":
        assert body < 0.3 < text, f"{where}: not the dark theme ({body=}, {text=})"
    else:
        assert body > 0.7 > text, f"{where}: not the light theme ({body=}, {text=})"
    assert len(look["crumbs"]) == 1, f"{where}: breadcrumbs {look['crumbs']}"
    crumbs = look["crumbs"][0]
    # a coloured bar (the admin's --breadcrumbs-bg), padded like the header above it ...
    assert crumbs["backgroundLuminance"] is not None, f"{where}: breadcrumbs unstyled {crumbs}"
    assert crumbs["backgroundLuminance"] < 0.5, f"{where}: breadcrumbs unstyled {crumbs}"
    assert crumbs["paddingLeft"] >= 20, f"{where}: breadcrumbs unstyled {crumbs}"
    # ... on one line, links apart (a separator between them), light on the dark bar
    assert len(set(crumbs["linkTops"])) == 1, f"{where}: breadcrumbs on several lines {crumbs}"
    assert crumbs["height"] < 60, f"{where}: breadcrumbs {crumbs}"
    assert all(gap >= 8 for gap in crumbs["gaps"]), f"{where}: breadcrumbs run together {crumbs}"
    assert crumbs["linkLuminance"] > 0.6, f"{where}: breadcrumb links unreadable {crumbs}"
    for row in look["headerRows"]:
        assert all(inset >= 4 for inset in row["insets"]), f"{where}: header text on the edge {row}"
        assert all(gap >= 10 for gap in row["gaps"]), f"{where}: headers run together {row}"
    for line in look["lines"]:
        assert line["fill"] == "none", f"{where}: a chart line is filled {line}"
        assert line["stroke"] != "none", f"{where}: a chart line is not drawn {line}"
    assert look["width"] <= WIDTH, f"{where}: the page is wider than the window"


#: Every page of the fairqueue admin: screenshot name -> (path, what to wait for). Paths may
#: name the demo objects: {acme} (a channel), {message} (a dead letter), {batch} (a failed
#: work batch). The purge confirmation is reached through its action (see visit).
PAGES = {
    "app": ("/admin/fairqueue/", "#content-main"),
    "dashboard": ("/admin/fairqueue/channel/dashboard/", "#fq-chart-wait svg path.fq-line"),
    "channels": ("/admin/fairqueue/channel/", "#result_list"),
    "channel": ("/admin/fairqueue/channel/{acme}/change/", "#channel_form"),
    "purge": ("", ".fq-purge-total"),
    "messages": ("/admin/fairqueue/message/", "#result_list"),
    "message": ("/admin/fairqueue/message/{message}/change/", "#content-main .fq-error"),
    "workers": ("/admin/fairqueue/workerrecord/", "#result_list"),
    "busy": ("/admin/fairqueue/workerrecord/busy/", ".fq-busy"),
    "usage": ("/admin/fairqueue/usagehour/?from={usage_day}", "#fq-usage"),
    "work-batches": ("/admin/fairqueue/workbatch/", "#fq-jobs"),
    "work-batch": ("/admin/fairqueue/workbatch/{batch}/change/", "#content-main"),
    "schedules": ("/admin/fairqueue/schedule/", "#result_list"),
    "schedule": ("/admin/fairqueue/schedule/{schedule}/change/", "#schedule_form"),
}


#: The demo's live workers (the looks test beats them: its pages take longer than a beat).
ALIVE = ("web-1:4242", "web-2:311", "web-3:5101", "web-3:5102")


def visit(page: Any, base: str, name: str, ids: dict[str, Any]) -> None:
    path, ready = PAGES[name]
    if name == "purge":  # the action's confirmation page: select two channels, ask to purge
        page.goto(f"{base}/admin/fairqueue/channel/")
        for channel in ("acme-corp", "umbrella"):
            page.locator("#result_list tr", has_text=channel).locator("input.action-select").check()
        page.select_option("select[name=action]", "purge_backlog")
        page.click("button[name=index]")
    else:
        page.goto(base + path.format(**ids))
    page.wait_for_selector(ready)


def test_every_admin_page_looks_right_light_and_dark(
    demo: int, live_server: Any, browser: Any, tmp_path: Path
) -> None:
    def demo_ids() -> dict[str, Any]:
        message = Message.objects.filter(state=MessageState.FAILED).order_by("pk").first()
        batch = WorkBatch.objects.filter(state=BatchState.FAILED).order_by("pk").first()
        assert message is not None and batch is not None
        for worker in ALIVE:  # alive: a fresh beat
            worker_store.beat_worker(worker, running=3, handled=1200, last_claim_at=timezone.now())
        schedule = Schedule.objects.get(name="weekly report")
        return {
            "acme": demo,
            "message": message.pk,
            "batch": batch.pk,
            "schedule": schedule.pk,
            "usage_day": usage_day(),
        }

    ids = off_loop(demo_ids)
    page = browser.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"script error on {page.url}: {exc}"))
    page.on(  # failed requests are told by the response handler below
        "console",
        lambda msg: (
            problems.append(f"console: {msg.text}")
            if msg.type == "error" and not msg.text.startswith("Failed to load resource")
            else None
        ),
    )
    page.on(
        "response",
        # the browser's own favicon.ico request is none of the admin's
        lambda r: (
            problems.append(f"{r.status} {r.url}")
            if r.status >= 400 and not r.url.endswith("/favicon.ico")
            else None
        ),
    )
    page.goto(f"{live_server.url}/admin/login/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_selector("#site-name")
    shots = []
    for scheme in ("light", "dark"):
        page.emulate_media(color_scheme=scheme)
        for name in PAGES:
            visit(page, live_server.url, name, ids)
            where = f"{name} ({scheme})"
            check_looks_right(page.evaluate(LOOK), scheme, where)
            shot = tmp_path / f"admin-{name}{'-dark' if scheme == 'dark' else ''}.png"
            height = min(page.evaluate("document.documentElement.scrollHeight"), MAX_HEIGHT)
            clip = {"x": 0, "y": 0, "width": WIDTH, "height": height}
            page.screenshot(path=str(shot), full_page=True, clip=clip)
            shots.append(shot)
    # the pages show what they are about
    page.emulate_media(color_scheme="light")
    visit(page, live_server.url, "dashboard", ids)
    failing = page.locator("#fq-chart-failed svg text.fq-label").all_text_contents()
    assert failing == ["umbrella", "globex", "hooli"]
    visit(page, live_server.url, "channels", ids)
    umbrella = page.locator("#result_list tr", has_text="umbrella")
    assert umbrella.locator("td.field-retrying_display").inner_text() == "6"
    visit(page, live_server.url, "schedules", ids)
    weekly = page.locator("#result_list tr", has_text="weekly report").inner_text()
    assert "CET (in " in weekly or "CEST (in " in weekly  # the next fire, in Berlin time
    assert "paused" in page.locator("#result_list tr", has_text="nightly sync").inner_text()
    visit(page, live_server.url, "channel", ids)
    assert "weekly report" in page.locator("#schedules-group").inner_text()
    visit(page, live_server.url, "work-batches", ids)
    export = page.locator("#fq-jobs tbody tr", has_text="orders-export").inner_text()
    assert "8 / 12" in export and "40,000 / 60,000" in export
    # the job's retry button works (its form is not nested in the change list's form)
    reindex = page.locator("#fq-jobs tbody tr", has_text="search-reindex")
    reindex.locator("input[type=submit]").click()
    page.wait_for_selector(".messagelist .success")
    assert "Retried 2 failed batches of job search-reindex." in page.inner_text(".messagelist")
    states = off_loop(
        lambda: set(
            WorkBatch.objects.filter(job_name="search-reindex").values_list("state", flat=True)
        )
    )
    assert states == {BatchState.PENDING, BatchState.SUCCEEDED}
    assert not problems, problems
    assert off_loop(lambda: Message.objects.filter(state=MessageState.READY).count()) > 0
    for shot in shots:
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        save(shot)


# ------------------------------------------------------------------------------------------
# A support engineer's questions, each answered from the admin


def login(page: Any, base: str) -> None:
    page.goto(f"{base}/admin/login/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_selector("#site-name")


def test_a_support_engineer_answers_each_question_from_the_admin(
    demo: int, live_server: Any, browser: Any
) -> None:
    base = live_server.url
    off_loop(
        lambda: [
            worker_store.beat_worker(w, running=0, handled=0, last_claim_at=None) for w in ALIVE
        ]
    )
    page = browser.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"script error on {page.url}: {exc}"))
    login(page, base)

    # 1. Who is starving, and since when? The filter finds the one the round passes over
    # (every backlog here is old: "oldest ready over 1 min" would list five).
    page.goto(f"{base}/admin/fairqueue/channel/")
    page.click("#changelist-filter >> text=in 5 min")
    page.wait_for_url("**unserved=5")
    page.wait_for_selector("#result_list")
    rows = page.locator("#result_list tbody tr")
    assert rows.count() == 1 and "soylent" in rows.first.inner_text()
    served = rows.first.locator("td.field-last_served_display").inner_text()
    assert served.startswith("15m") and served.endswith("ago"), served
    assert "20m" in rows.first.locator("td.field-oldest_ready_display").inner_text()

    # 2. Who fails right now? The dashboard's failing panel, most failing first.
    page.goto(f"{base}/admin/fairqueue/channel/dashboard/")
    page.wait_for_selector("#fq-chart-failed svg text.fq-label")
    failing = page.locator("#fq-chart-failed svg text.fq-label").all_text_contents()
    assert failing[0] == "umbrella", failing

    # 3. Who is over its cap? The dashboard's bar says it in red, the list's filter names it.
    bar = page.evaluate(
        """() => [...document.querySelectorAll('#fq-chart-running svg rect')]
             .filter(r => r.querySelector('title').textContent.startsWith('umbrella: running'))
             .map(r => getComputedStyle(r).fill)"""
    )
    assert bar == ["rgb(225, 87, 89)"], bar  # over its cap: red, never green
    page.goto(f"{base}/admin/fairqueue/channel/?cap=over")
    assert page.locator("#result_list tbody tr").count() == 1
    assert "5 / 4" in page.locator("#result_list tbody tr").inner_text()

    # 4. Why does tenant X wait? Its page says, in one sentence.
    page.goto(f"{base}/admin/fairqueue/channel/{demo}/change/")
    why = page.locator(".field-why_waiting_display .readonly").inner_text()
    assert why.startswith("at its cap: 8 of 8 running, the oldest since"), why

    # 5. Which workers live, and what did the dead one have? (the live ones beat: this
    # machine may have taken longer than three beats to get here)
    off_loop(
        lambda: [
            worker_store.beat_worker(w, running=0, handled=0, last_claim_at=None) for w in ALIVE
        ]
    )
    page.goto(f"{base}/admin/fairqueue/workerrecord/?state=alive")
    alive = page.locator("#result_list tbody tr").all_inner_texts()
    assert len(alive) == 4 and all("alive" in row for row in alive)
    children = page.locator("#result_list tr", has_text="web-3:5101")
    assert "web-3:5100" in children.inner_text()  # listed under its supervisor
    page.goto(f"{base}/admin/fairqueue/workerrecord/?state=dead")
    dead = page.locator("#result_list tr", has_text="batch-7:977")
    assert re.search(r"\d\d:\d\d:\d\d \(1\dm \d\ds ago\)", dead.inner_text()), dead.inner_text()
    dead.locator("text=ran or lost").click()
    page.wait_for_url("**/message/?worker=**")
    page.wait_for_selector("#result_list")
    lost = page.locator("#result_list tbody tr").all_inner_texts()
    assert len(lost) == 2 and all("LeaseExpired" in row for row in lost), lost
    # what every live worker runs now, since when
    page.goto(f"{base}/admin/fairqueue/workerrecord/busy/")
    assert page.locator("h2.fq-busy-worker", has_text="web-3:5101").count() == 1
    assert "running since" in page.locator(".fq-busy").first.inner_text().lower()

    # 6. What does a schedule do next?
    page.goto(f"{base}/admin/fairqueue/schedule/")
    weekly = page.locator("#result_list tr", has_text="weekly report").inner_text()
    assert "CET (in " in weekly or "CEST (in " in weekly

    # 7. Who used how much worker time that day? Most first; the CSV says the same.
    page.goto(f"{base}/admin/fairqueue/usagehour/?from={usage_day()}")
    first = page.locator("#fq-usage tbody tr").first.inner_text()
    assert first.startswith("acme-corp") and "8,820.0 s" in first, first
    href = page.locator("#fq-usage-csv").get_attribute("href")
    csv_text = page.request.get(f"{base}/admin/fairqueue/usagehour/{href}").text()
    assert csv_text.splitlines()[1].split(",")[2:6] == ["acme-corp", "default", "", "8820.0"]
    page.click("#fq-usage thead >> text=failures")
    page.wait_for_url("**o=-failures**")
    assert page.locator("#fq-usage tbody tr").first.inner_text().startswith("umbrella")

    # A dead letter's page: every attempt's error, and a Retry button that works.
    page.goto(f"{base}/admin/fairqueue/message/?channel__id__exact={demo}&state__exact=running")
    # the running view: worker and lease on screen at 1440 px, nothing wrapped
    for column in ("worker_link", "lease_display", "running_for_display"):
        box = page.locator(f"#result_list td.field-{column}").first.bounding_box()
        assert box is not None and box["x"] + box["width"] <= WIDTH, (column, box)
    heights = {
        round(b["height"])
        for b in page.evaluate(
            "() => [...document.querySelectorAll('#result_list tbody tr')]"
            ".map(r => r.getBoundingClientRect().toJSON())"
        )
    }
    assert len(heights) == 1, heights  # every row one line high
    page.goto(f"{base}/admin/fairqueue/message/?state__exact=failed")
    page.locator("#result_list tbody tr th a").first.click()
    page.wait_for_url("**/change/**")
    page.wait_for_selector("#fq-errors")
    assert "CorruptPDF" in page.locator("#fq-errors").inner_text()
    page.click("#fq-message-actions input[value=Retry]")
    page.wait_for_selector(".messagelist .success")
    assert "Retried" in page.inner_text(".messagelist")

    # paused is visible beside the name, on screen at 1440 px
    page.goto(f"{base}/admin/fairqueue/channel/")
    badge = page.locator("#result_list tr", has_text="initech").locator(".fq-paused")
    box = badge.bounding_box()
    assert box is not None and box["x"] + box["width"] <= WIDTH
    assert not problems, problems

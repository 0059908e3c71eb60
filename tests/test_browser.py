"""The admin in a real browser: headless Chromium (Debian's package) driven by Playwright.

Log in, open the dashboard (charts drawn by dashboard.js), watch it refresh, change a tenant's
max concurrency through the channel form, and see the change on the dashboard. Skipped with the
reason when /usr/bin/chromium or the ``playwright`` package is missing (``.ci/run`` installs
Chromium with apt-get; ``playwright install`` is never used).

Screenshots go to the test's temporary directory; with ``FAIRQUEUE_SCREENSHOTS=docs/img`` they
are also written there as ``admin-channels.png`` and ``admin-dashboard.png`` (the images in
docs/howto/admin.md and the README come from such a run).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
from django.contrib.auth.models import User
from django.db import connections
from django.utils import timezone

from django_fairqueue import stats, store
from django_fairqueue.models import Channel, Message, MessageState
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
    Channel.objects.filter(name="initech").update(paused=True)
    ids = channel_ids(tenants)
    lease = timedelta(minutes=30)
    for name, n in (("acme-corp", 8), ("globex", 3), ("umbrella", 5)):
        store.claim_messages(
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
        claimed = store.claim_messages(
            n, lease=lease, worker_id="demo-worker", only_channel_ids=[ids[name]], quantum=n
        )
        store.fail_messages([(m.id, m.lease_token, failure, None) for m in claimed])
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
                store.ClaimedMessage(
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
                outcome = (
                    "failed" if name == "globex" and i == 0 and minute % 3 == 0 else "succeeded"
                )
                recorder.record_settled(ids[name], outcome, 250.0, at=at)  # type: ignore[arg-type]
    recorder.flush()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    sync_playwright = _playwright()
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"),  # a fresh user data dir
            executable_path=str(CHROMIUM),
            args=CHROMIUM_ARGS,
            headless=True,
            viewport={"width": 1680, "height": 900},
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
    assert page.locator("#fq-chart-failed svg rect").count() == 2  # globex and hooli
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
    page.goto(dashboard)  # the default refresh for the screenshot's status line
    page.wait_for_selector("#fq-chart-backlog svg rect")
    page.screenshot(path=str(tmp_path / "admin-dashboard.png"), full_page=True)

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

    page.goto(f"{live_server.url}/admin/fairqueue/channel/")
    page.wait_for_selector("#result_list")
    page.screenshot(path=str(tmp_path / "admin-channels.png"), full_page=True)
    assert not errors, errors
    for name in ("admin-dashboard.png", "admin-channels.png"):
        shot = tmp_path / name
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        save(shot)

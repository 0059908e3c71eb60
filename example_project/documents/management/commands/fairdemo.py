"""``manage.py fairdemo``: one tenant floods the queue, another uploads a few documents; watch the
small tenant get served at once while the big backlog drains."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction
from django.db.models import Count, Q

from django_fairqueue import EnqueueRequest, enqueue_many
from django_fairqueue.db.message_store import purge_channel_backlog
from django_fairqueue.models import Channel, Message, MessageState
from documents.models import Document

BIG, SMALL = "bob", "alice"


class Command(BaseCommand):
    help = "Demonstrate fair queueing: a big backlog for one tenant, a small upload for another."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--big", type=int, default=3000, help="bob's documents (3000)")
        parser.add_argument("--small", type=int, default=3, help="alice's documents (3)")
        parser.add_argument("--workers", type=int, default=2, help="worker processes (2)")
        parser.add_argument("--concurrency", type=int, default=4, help="threads per worker (4)")
        parser.add_argument(
            "--timeout", type=float, default=120.0, help="give up after this many seconds"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        call_command("migrate", verbosity=0)
        self._reset()
        big, small = options["big"], options["small"]

        self.stdout.write(f"{BIG} uploads {big} documents ...")
        self._upload(BIG, big)
        workers = self._start_workers(options["workers"], options["concurrency"])
        try:
            # Let the workers start and get busy with bob's backlog first.
            warm = max(1, min(50, big // 10))
            if not self._wait_until(lambda: self._done(BIG) >= warm, options["timeout"]):
                self.stderr.write("the workers did not start; see the log file above")
                return
            self.stdout.write(f"{SMALL} uploads {small} one-page PDF(s) while {BIG} is busy")
            bob_done_before = self._done(BIG)
            uploaded_at = time.monotonic()
            self._upload(SMALL, small)
            self._watch(big, small, uploaded_at, bob_done_before, options["timeout"])
        finally:
            self._stop_workers(workers)
        self.stdout.write(
            "\nBrowse it: python3 dev.py manage runserver, then http://127.0.0.1:8000/ "
            "(documents) and /admin/ (create a user with: python3 dev.py manage createsuperuser)."
        )

    def _reset(self) -> None:
        Document.objects.filter(tenant__in=[BIG, SMALL]).delete()
        for channel in Channel.objects.filter(name__in=[BIG, SMALL]):
            purge_channel_backlog(channel.pk)

    def _upload(self, tenant: str, count: int) -> None:
        with transaction.atomic():
            documents = Document.objects.bulk_create(
                Document(tenant=tenant, title=f"{tenant}-{i:05d}.pdf", body="lorem ipsum " * 50)
                for i in range(count)
            )
            enqueue_many(
                [EnqueueRequest("documents.process", [d.pk], channel=tenant) for d in documents]
            )

    def _start_workers(self, count: int, concurrency: int) -> list[subprocess.Popen[bytes]]:
        manage = Path(settings.BASE_DIR) / "manage.py"
        command = [sys.executable, str(manage), "runfairworker", "--concurrency", str(concurrency)]
        log_path = Path(settings.BASE_DIR).parent / ".fairqueue" / "demo-workers.log"
        log_path.parent.mkdir(exist_ok=True)
        log = log_path.open("wb")  # one line per message: too much for the terminal
        self.stdout.write(
            f"starting {count} worker process(es) x {concurrency} threads (log: {log_path})"
        )
        return [
            subprocess.Popen(command, env=os.environ.copy(), stdout=log, stderr=log)
            for _ in range(count)
        ]

    def _done(self, tenant: str) -> int:
        return Document.objects.filter(tenant=tenant, status=Document.Status.DONE).count()

    def _wait_until(self, condition: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.05)
        return False

    def _stop_workers(self, workers: list[subprocess.Popen[bytes]]) -> None:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        for worker in workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()

    def _counts(self) -> dict[str, dict[str, int]]:
        rows = (
            Document.objects.filter(tenant__in=[BIG, SMALL])
            .values("tenant")
            .annotate(done=Count("id", filter=Q(status=Document.Status.DONE)), total=Count("id"))
        )
        return {r["tenant"]: r for r in rows}

    def _watch(
        self, big: int, small: int, uploaded_at: float, bob_done_before: int, timeout: float
    ) -> None:
        small_done_after = None
        big_waiting_then = big_done_meanwhile = 0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            counts = self._counts()
            b = counts.get(BIG, {"done": 0, "total": big})
            s = counts.get(SMALL, {"done": 0, "total": small})
            self.stdout.write(
                f"  {BIG}: {b['done']:>6}/{b['total']} done   "
                f"{SMALL}: {s['done']}/{s['total']} done"
            )
            if small_done_after is None and s["done"] == s["total"]:
                small_done_after = time.monotonic() - uploaded_at
                big_waiting_then = b["total"] - b["done"]
                big_done_meanwhile = b["done"] - bob_done_before
            if b["done"] == b["total"] and s["done"] == s["total"]:
                break
            time.sleep(0.05 if small_done_after is None else 0.5)
        waiting = Message.objects.filter(
            channel__name__in=[BIG, SMALL],
            state__in=[MessageState.SCHEDULED, MessageState.READY, MessageState.RUNNING],
        ).count()  # succeeded rows may be kept (KEEP_RESULTS): they are not queued
        if small_done_after is None:
            self.stderr.write(f"{SMALL}'s documents did not finish in {timeout:.0f} s")
            return
        self.stdout.write(
            self.style.SUCCESS(
                f"\n{SMALL}'s {small} document(s) were done {small_done_after:.2f} s after upload; "
                f"meanwhile the workers finished {big_done_meanwhile} of {BIG}'s, and "
                f"{big_waiting_then} of {BIG}'s were still waiting. In a first-in-first-out "
                f"queue {SMALL} would have waited behind all "
                f"{big_waiting_then + big_done_meanwhile}."
            )
        )
        if waiting:
            self.stdout.write(f"({waiting} message(s) still queued when the demo stopped)")

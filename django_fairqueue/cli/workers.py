"""List the workers in the registry: alive, silent, dead or stopped, and what each runs.

QUEUES is what the worker claims from: "all" (every queue, the default), or the queues it
was started with (runfairworker --queues), in its order. WAKEUPS is how it learns of new
messages: "notify" (its listener saw a notification of its own arrive after LISTEN),
"polling" (none arrived, behind a transaction pooler say: it polls every POLL_INTERVAL on
purpose, and the line under the table says why), "-" (started with --no-listen, or not
checked yet). RESTARTS, for a worker started by a
supervisor (runfairworker --processes): how often its slot was restarted before it, and
"crash loop" when its predecessors kept dying soon after starting.

A worker beats every FAIRQUEUE['WORKER_HEARTBEAT'] seconds; one silent for longer than
WORKER_DEAD_AFTER is dead, and the maintenance loop of any live worker then requeues the
messages it was running. Stopped and dead workers stay listed for a day.
"""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import OutputWrapper

from django_fairqueue.cli.terminal import aligned, json_text, printable
from django_fairqueue.db import pg
from django_fairqueue.observe import overview
from django_fairqueue.runtime import worker_registry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")


def handle(options: dict[str, Any], stdout: OutputWrapper) -> None:
    now = pg.select_clock()  # the clock that stamped the beats
    views = worker_registry.workers(now)
    if options["json"]:
        stdout.write(json_text([v.as_dict() for v in views]))
        return
    if not views:
        stdout.write("No workers have registered (start one with manage.py runfairworker).")
        return
    header = (
        "WORKER",
        "STATE",
        "HOST",
        "PID",
        "VERSION",
        "QUEUES",
        "RUNNING",
        "HANDLED",
        "BEAT",
        "CLAIM",
        "WAKEUPS",
        "RESTARTS",
    )
    lines = [header]
    for v in views:
        beat = overview.format_age((now - v.heartbeat_at).total_seconds())
        claim = v.last_claim_at and overview.format_age((now - v.last_claim_at).total_seconds())
        lines.append(
            (
                printable(v.worker_id),
                v.state,
                printable(v.host),
                str(v.pid),
                printable(v.version),
                printable(worker_registry.queues_text(v.queues)),
                f"{v.running}/{v.concurrency}",
                f"{v.handled:,}",
                f"{beat} ago",
                f"{claim} ago" if claim else "-",
                v.wakeups.split(":", 1)[0] or "-",
                worker_registry.restarts_text(v.restarts, v.crash_loop),
            )
        )
    for line in aligned(lines):
        stdout.write(line)
    alive = worker_registry.live(views)
    stdout.write(f"\n{len(alive)} live of {len(views)} registered.")
    for v in alive:
        if v.wakeups.startswith("polling"):
            why = v.wakeups.split(":", 1)[1].strip()
            stdout.write(f"{printable(v.worker_id)} polls for new messages: {printable(why)}.")
    looping = [v for v in alive if v.crash_loop]
    if looping:
        names = ", ".join(printable(v.worker_id) for v in looping)
        stdout.write(
            f"WARNING: crash loop: {names} (its supervisor restarts it after a growing "
            "backoff; its log says why it dies)"
        )

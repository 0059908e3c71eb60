"""List the periodic schedules: channel, queue, task, cron and timezone, next fire, last slot.

A schedule's channel is its name within its queue (--channel acme --queue reports selects the
schedules of tenant acme's channel in queue reports; --queue alone, every schedule of a queue;
--channel alone, the default queue's channel).

Code schedules (@periodic, FAIRQUEUE['SCHEDULES']) reach the table when a worker starts;
--sync writes them now (after a deploy, before any worker runs) and says what changed; until
then the listing names those not in the table yet (on stderr with --json: stdout stays a list).
--fire runs one firing pass here, as every worker's maintenance loop does: each due slot
fires once, whoever else fires at the same time.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from django.core.management.base import CommandError, OutputWrapper

from django_fairqueue import cron, schedules
from django_fairqueue.cli import channel_name, queue_name
from django_fairqueue.cli.terminal import aligned, json_text, printable
from django_fairqueue.db import pg
from django_fairqueue.exceptions import InvalidSchedule
from django_fairqueue.models import Schedule
from django_fairqueue.observe import overview
from django_fairqueue.queues import DEFAULT_QUEUE, row_name, split_row_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--channel", type=channel_name, help="Only the schedules of this channel.")
    parser.add_argument(
        "--queue",
        type=queue_name,
        help=(
            "Only the schedules of this queue; the queue of --channel (default: --channel is "
            "a channel of the default queue)."
        ),
    )
    parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    parser.add_argument(
        "--sync", action="store_true", help="Sync the code schedules into the table first."
    )
    parser.add_argument("--fire", action="store_true", help="Fire the due schedules first.")


def handle(options: dict[str, Any], stdout: OutputWrapper) -> None:
    # With --json, what --sync and --fire did goes to stderr: stdout stays one JSON document.
    notes: TextIO | OutputWrapper = sys.stderr if options["json"] else stdout
    if options["sync"]:
        try:
            result = schedules.sync()
        except InvalidSchedule as exc:
            raise CommandError(str(exc)) from None
        for what, names in (
            ("created", result.created),
            ("updated", result.updated),
            ("deleted", result.deleted),
        ):
            if names:
                notes.write(f"{what}: {', '.join(map(printable, names))}\n")
    if options["fire"]:
        notes.write(f"fired {schedules.fire_due()} message(s)\n")
    rows = Schedule.objects.select_related("channel").order_by("channel__name", "name")
    queue = options.get("queue")
    if options["channel"] is not None:
        rows = rows.filter(channel__name=row_name(queue or DEFAULT_QUEUE, options["channel"]))
    elif queue is not None:
        rows = rows.filter(channel__queue=queue)
    found = list(rows)
    now = pg.select_clock()
    states = schedules.states([s.pk for s in found])
    views: list[dict[str, Any]] = []
    for s in found:
        st = states.get(s.pk)
        next_at = st.next_fire_at if st is not None and st.current else None
        if s.enabled and next_at is None:
            next_at = cron.next_slot(s.cron, s.timezone, now)  # what the next pass computes
        views.append(
            {
                "name": s.name,
                "channel": split_row_name(s.channel.name)[1],
                "queue": split_row_name(s.channel.name)[0],
                "task": s.task_name,
                "cron": s.cron,
                "timezone": s.timezone,
                "enabled": s.enabled,
                "source": s.source,
                "missed": s.missed,
                "next_fire_at": next_at if s.enabled else None,
                "last_slot_at": st.last_slot_at if st is not None else None,
                "last_message_id": st.last_message_id if st is not None else None,
            }
        )
    unsynced = _unsynced()
    if options["json"]:
        stdout.write(json_text(views))  # the table's rows only: a note is no row
        if unsynced:
            notes.write(f"{_unsynced_note(unsynced)}\n")
        return
    if not views and (options["channel"] is not None or queue is not None):
        # (not "declare some": the filter may be what found none)
        of = (
            [f"channel {printable(options['channel'])!r}"] if options["channel"] is not None else []
        )
        of += [f"queue {printable(queue)!r}"] if queue is not None else []
        total = Schedule.objects.count()
        stdout.write(
            f"No schedule of {' of '.join(of)} ({total:,} schedule{'' if total == 1 else 's'} "
            "in all)."
        )
        return
    if not views:
        if unsynced:
            stdout.write(f"No schedules in the table yet. {_unsynced_note(unsynced)}")
        else:
            stdout.write("No schedules (declare them with @periodic or add them in the admin).")
        return
    header = (
        "CHANNEL",
        "QUEUE",
        "SCHEDULE",
        "TASK",
        "CRON",
        "TIMEZONE",
        "NEXT FIRE",
        "LAST SLOT",
        "",
    )
    lines = [header]
    for v in views:
        nxt = v["next_fire_at"]
        last = v["last_slot_at"]
        lines.append(
            (
                printable(v["channel"]),
                v["queue"],
                printable(v["name"]),
                printable(v["task"]),
                printable(v["cron"]),
                printable(v["timezone"]),
                f"in {overview.format_age((nxt - now).total_seconds())}"
                if nxt is not None and nxt > now
                else ("due" if nxt is not None else ("never" if v["enabled"] else "paused")),
                f"{overview.format_age((now - last).total_seconds())} ago" if last else "-",
                "" if v["source"] == "admin" else "(code)",
            )
        )
    for line in aligned(lines):
        stdout.write(line)
    enabled = sum(1 for v in views if v["enabled"])
    stdout.write(f"\n{enabled} enabled of {len(views)}.")
    if unsynced:
        stdout.write(_unsynced_note(unsynced))


def _unsynced() -> list[str]:
    """The names of the code schedules declared but not in the table yet (after a deploy,
    before any worker started). The @periodic ones are known only once the task modules are
    imported, as a worker and --sync import them: declared() does."""
    try:
        declared = [spec.name for spec in schedules.declared()]
    except InvalidSchedule as exc:
        raise CommandError(str(exc)) from None
    synced = set(
        Schedule.objects.filter(source="code", name__in=declared).values_list("name", flat=True)
    )
    return [name for name in declared if name not in synced]


def _unsynced_note(names: list[str]) -> str:
    return (
        f"{len(names)} code schedule(s) declared but not synced yet: "
        f"{', '.join(map(printable, names))}. A worker syncs them when it starts; "
        "'fairqueue schedules --sync' syncs them now."
    )

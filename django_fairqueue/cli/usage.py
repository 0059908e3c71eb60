"""Show per-tenant usage: worker time, attempts and failures per channel or group.

  fairqueue usage [--from DAY] [--to DAY] [--by channel|group] [--queue Q]
                  [--sort FIELD] [--limit N] [--json | --csv]

DAY is YYYY-MM-DD, "today" or "yesterday" (days of the TIME_ZONE setting); --from and --to
default to yesterday, so "fairqueue usage" answers "who used how much worker time
yesterday". --sort takes name, queue, worker_seconds (the default, most first), attempts,
succeeded, failures, timeouts or failure_rate; a leading "-" sorts descending, "+" ascending.

Usage is kept FAIRQUEUE['USAGE_RETENTION'] (31 days by default); an older day reads empty.
"""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import CommandError, OutputWrapper

from django_fairqueue import limits
from django_fairqueue.cli import queue_name
from django_fairqueue.cli.terminal import aligned_row, column_widths, json_text, printable
from django_fairqueue.observe import usage


def _day(text: str) -> Any:
    try:
        return usage.parse_day(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _sort(text: str) -> str:
    """The report's order: "-FIELD" descending, "+FIELD" ascending; a bare FIELD sorts names
    A to Z and figures most first."""
    field = text.lstrip("+-")
    if field not in usage.SORTS:
        raise argparse.ArgumentTypeError(f"--sort takes one of {', '.join(usage.SORTS)}")
    if text.startswith(("+", "-")):
        return field if text.startswith("+") else "-" + field
    return field if field in ("name", "queue") else "-" + field


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="first", type=_day, default=None, metavar="DAY")
    parser.add_argument("--to", dest="last", type=_day, default=None, metavar="DAY")
    parser.add_argument("--by", choices=usage.BY, default="channel")
    parser.add_argument("--queue", type=queue_name, default=None, help="Only this queue.")
    parser.add_argument(
        "--sort", type=_sort, default=None, metavar="FIELD", help="Default: worker_seconds."
    )
    parser.add_argument(
        "--limit", type=limits.limit_option, default=None, help="Most rows to show."
    )
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="Print JSON.")
    out.add_argument("--csv", action="store_true", help="Print CSV (names as stored).")


def handle(options: dict[str, Any], stdout: OutputWrapper) -> None:
    yesterday = usage.parse_day("yesterday")
    first = options["first"] or options["last"] or yesterday
    last = options["last"] or (first if options["first"] else yesterday)
    try:
        start, end = usage.day_range(first, last)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    order = options["sort"] or "-worker_seconds"
    rows = usage.report(
        start, end, by=options["by"], order=order, queue=options["queue"], limit=options["limit"]
    )
    if options["csv"]:
        stdout.write(usage.as_csv(rows, start=start, end=end, by=options["by"]), ending="")
        return
    if options["json"]:
        payload = {
            "from": start.isoformat(),
            "to": end.isoformat(),
            "by": options["by"],
            "rows": [r.as_dict() for r in rows],
            "total": usage.summed(rows).as_dict(),
        }
        stdout.write(json_text(payload))
        return
    span = f"{first}" if first == last else f"{first} to {last}"
    if not rows:
        stdout.write(f"No usage recorded for {span}.")
        return
    header = (options["by"].upper(), "QUEUE", "WORKER TIME", "ATTEMPTS", "FAILURES", "TIMEOUTS")
    lines = [header]
    for r in [*rows, usage.summed(rows)]:
        lines.append(
            (
                printable(r.name),
                printable(r.queue),
                f"{r.worker_seconds:,.1f} s",
                f"{r.attempts:,}",
                f"{r.failures:,}",
                f"{r.timeouts:,}",
            )
        )
    widths = column_widths(lines)
    stdout.write(f"Usage for {span} ({start.tzinfo}), by {options['by']}:")
    for i, row in enumerate(lines):
        if i == len(lines) - 1:
            stdout.write("  ".join("-" * w for w in widths))
        stdout.write(aligned_row(row, widths, right=range(2, len(header))))

"""List, retry and delete failed messages (dead letters).

  fairqueue failures list [--channel C] [--task T] [--queue Q] [--limit N] [--after ID] [--json]
  fairqueue failures retry (ID ... | --all [--channel C] [--task T] [--queue Q]) [--json]
  fairqueue failures delete (ID ... | --all [--channel C] [--task T] [--queue Q]) [--json]

--queue narrows the selection to that queue (--channel is then that queue's channel); without
it, --channel is a channel of the default queue, and the rest covers every queue.

Retry makes a failed message ready again with a fresh attempt budget; delete removes it. Both
are idempotent: ids of messages that are not failed (any more) are left alone.
"""

# A subcommand module of the ``fairqueue`` command; the work is done by
# django_fairqueue.failures.

from __future__ import annotations

import argparse
from typing import Any, TextIO

from django.core.management.base import CommandError

from django_fairqueue import failures, limits
from django_fairqueue.cli import channel_name, queue_name
from django_fairqueue.cli.terminal import aligned, cut, json_text, printable
from django_fairqueue.observe import overview

#: Longest error message shown in the text listing; --json has it whole.
_ERROR_WIDTH = 80


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(
        dest="failures_action", metavar="{list,retry,delete}", required=True
    )
    listing = actions.add_parser(
        "list", help="Show failed messages, oldest first (a page at a time)."
    )
    _add_filters(listing)
    listing.add_argument(
        "--limit",
        type=limits.limit_option,
        default=100,
        help="Most messages to show (default: 100).",
    )
    listing.add_argument(
        "--after",
        type=limits.after_id,
        default=0,
        metavar="ID",
        help="Show messages with an id above ID (the next page).",
    )
    listing.add_argument("--json", action="store_true", help="Print JSON.")
    for name, verb in (("retry", "Retry"), ("delete", "Delete")):
        sub = actions.add_parser(
            name,
            help=f"{verb} failed messages by id, or all of them with --all (idempotent).",
        )
        sub.add_argument(
            "ids", nargs="*", type=limits.message_id, metavar="ID", help="Message ids."
        )
        sub.add_argument(
            "--all",
            action="store_true",
            help="Every failed message (narrowed by --channel, --task and --queue).",
        )
        _add_filters(sub)
        sub.add_argument("--json", action="store_true", help="Print JSON.")


def handle(options: dict[str, Any], stdout: TextIO) -> None:
    action = options["failures_action"]
    if action == "list":
        _list(options, stdout)
        return
    ids: list[int] = options["ids"]
    channel, task, queue = options["channel"], options["task"], options["queue"]
    if options["all"] and ids:
        raise CommandError(f"failures {action}: give message ids or --all, not both", returncode=2)
    if not options["all"] and not ids:
        raise CommandError(
            f"failures {action}: give message ids, or --all for every one", returncode=2
        )
    if not options["all"] and (channel is not None or task is not None or queue is not None):
        raise CommandError(
            f"failures {action}: --channel, --task and --queue only narrow --all", returncode=2
        )
    if options["all"]:
        bulk = failures.retry_all if action == "retry" else failures.delete_all
        count = bulk(channel=channel, task=task, queue=queue)
        report: dict[str, Any] = {"action": action, "count": count}
        text = f"{_past(action)} {_messages(count)}."
    else:
        if action == "retry":
            done, held = failures.retry_reporting_held(ids)
        else:
            done, held = failures.delete(ids), []
        skipped = sorted(set(ids).difference(done))
        report = {"action": action, "count": len(done), "ids": done, "skipped": skipped}
        if action == "retry":
            report["key_held"] = held  # of the skipped, those left to their key's holder
        text = f"{_past(action)} {_messages(len(done))}."
        if not_failed := [i for i in skipped if i not in held]:
            text += f"\nSkipped (not failed): {_ids(not_failed)}."
        if held:
            text += (
                "\nLeft failed (another message holds its unique key and does its work): "
                f"{_ids(held)}."
            )
    if options["json"]:
        _write(stdout, json_text(report))
    else:
        _write(stdout, text)


def _list(options: dict[str, Any], stdout: TextIO) -> None:
    limit = options["limit"]
    found = failures.list_failed(
        channel=options["channel"],
        task=options["task"],
        limit=limit,
        after_id=options["after"],
        queue=options["queue"],
    )
    # A full page may have a next one; a short page is the last.
    next_after = found[-1].id if len(found) == limit else None
    if options["json"]:
        report = {"failed": [m.as_dict() for m in found], "next_after": next_after}
        _write(stdout, json_text(report))
        return
    if not found:
        _write(stdout, "No failed messages.")
        return
    rows = [("ID", "CHANNEL", "QUEUE", "TASK", "ATTEMPTS", "FINISHED", "ERROR")]
    for m in found:
        error = f"{m.error_type}: {m.error_message}" if m.error_message else m.error_type
        # escaped, as every table's text: one line each (an escaped \n breaks none)
        error = cut(printable(error), _ERROR_WIDTH)
        finished = overview.format_time(m.finished_at)
        rows.append(
            (
                str(m.id),
                printable(m.channel),
                m.queue,
                printable(m.task),
                f"{m.attempts}/{m.max_attempts}",
                finished,
                error,
            )
        )
    for line in aligned(rows):
        _write(stdout, line)
    if next_after is not None:
        _write(stdout, f"(more may follow: --after {next_after})")


def _add_filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--channel", type=channel_name, help="Only messages of this channel.")
    parser.add_argument("--task", help="Only messages of this task name.")
    parser.add_argument(
        "--queue",
        type=queue_name,
        help=(
            "Only messages of this queue; the queue of --channel (default: --channel is a "
            "channel of the default queue)."
        ),
    )


def _write(stdout: TextIO, line: str) -> None:
    # An explicit newline: Django's OutputWrapper adds none to text that has one, a plain
    # stream adds none at all.
    stdout.write(line + "\n")


def _past(action: str) -> str:
    return "Retried" if action == "retry" else "Deleted"


def _messages(count: int) -> str:
    return f"{count} failed message" + ("" if count == 1 else "s")


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids))

"""Cancel waiting messages by id, channel, task or queue.

  fairqueue cancel (ID ... | [--channel C] [--task T] [--queue Q]) [--json]

--queue narrows the selection to that queue (--channel is then that queue's channel, --task
alone that task's messages in that queue); without it, --channel is a channel of the default
queue and --task alone selects in every queue.

Ready and delayed messages become ``cancelled`` (kept until pruned; a unique key they held is
free at once). Running messages are left alone: stop them with ``fairqueue abort``. A message
a worker is claiming at that very moment runs.
"""

# A subcommand module of the ``fairqueue`` command; the work is done by django_fairqueue.api.

from __future__ import annotations

import argparse
from typing import Any, TextIO

from django.core.management.base import CommandError

from django_fairqueue import api, limits
from django_fairqueue.cli import channel_name, queue_name
from django_fairqueue.cli.terminal import json_text, printable
from django_fairqueue.exceptions import InvalidChannel, UnknownTask
from django_fairqueue.tasks.spec import registry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_selection(parser)


def add_selection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ids", nargs="*", type=limits.message_id, metavar="ID", help="Message ids.")
    parser.add_argument(
        "--channel", type=channel_name, help="Every message of this channel (with --task: of both)."
    )
    parser.add_argument(
        "--queue",
        type=queue_name,
        help=(
            "Only this queue's messages; the queue of --channel (default: --channel is a "
            "channel of the default queue, --task alone selects in every queue)."
        ),
    )
    parser.add_argument("--task", help="Every message of this task name.")
    parser.add_argument("--json", action="store_true", help="Print JSON.")


def selection(options: dict[str, Any], verb: str) -> dict[str, Any]:
    """The ids / channel / task / queue keywords of the api call the options ask for."""
    ids: list[int] = options["ids"]
    channel, task, queue = options["channel"], options["task"], options.get("queue")
    if ids and (channel is not None or task is not None or queue is not None):
        raise CommandError(
            f"{verb}: give message ids, or --channel, --task and/or --queue, not both",
            returncode=2,  # a usage error, as argparse's
        )
    if not ids and channel is None and task is None and queue is None:
        raise CommandError(f"{verb}: give message ids, --channel, --task or --queue", returncode=2)
    if ids:
        return {"ids": ids}
    return {"channel": channel, "task": task, "queue": queue}


def handle(options: dict[str, Any], stdout: TextIO) -> None:
    chosen = selection(options, "cancel")
    try:
        done = api.cancel(**chosen)
    except InvalidChannel as exc:
        raise CommandError(f"cancel: {exc}") from exc
    report: dict[str, Any] = {"action": "cancel", "count": len(done), "ids": done}
    text = f"Cancelled {_messages(len(done))}."
    task = chosen.get("task")
    if not done and task is not None:
        # (messages of a task no longer in the code can still wait: a hint, not an error)
        try:
            registry.get(task)
        except UnknownTask:
            text += f" No task named {printable(task)!r} is registered: check its name."
    if "ids" in chosen:
        skipped = sorted(set(chosen["ids"]) - set(done))
        report["skipped"] = skipped
        if skipped:
            text += (
                f"\nSkipped (not waiting: running, finished, unknown, or being claimed): "
                f"{', '.join(map(str, skipped))}."
            )
    write(stdout, json_text(report) if options["json"] else text)


def write(stdout: TextIO, line: str) -> None:
    stdout.write(line + "\n")


def _messages(n: int) -> str:
    return f"{n} message" if n == 1 else f"{n} messages"

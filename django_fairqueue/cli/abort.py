"""Abort messages: ask the running ones to stop (given by id, cancel the waiting ones).

  fairqueue abort (ID ... | [--channel C] [--task T] [--queue Q]) [--json]

With ids, waiting messages are cancelled and running ones get an abort request; with --channel,
--task and/or --queue, the running messages of that selection get one (cancel the waiting ones
with ``fairqueue cancel``); --queue narrows it as for ``fairqueue cancel``. The worker running a
message sees the request at its next heartbeat: the task's ``abort_requested()`` turns True,
and the message ends ``aborted`` when the task stops, or after ``FAIRQUEUE['ABORT_GRACE']``
seconds if it does not.
"""

# A subcommand module of the ``fairqueue`` command; the work is done by django_fairqueue.api.

from __future__ import annotations

import argparse
from typing import Any, TextIO

from django.core.management.base import CommandError

from django_fairqueue import api
from django_fairqueue.cli.cancel import add_selection, selection, write
from django_fairqueue.cli.terminal import json_text
from django_fairqueue.exceptions import InvalidChannel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_selection(parser)


def handle(options: dict[str, Any], stdout: TextIO) -> None:
    chosen = selection(options, "abort")
    try:
        done = api.abort(**chosen)
    except InvalidChannel as exc:
        raise CommandError(f"abort: {exc}") from exc
    cancelled = sorted(i for i, what in done.items() if what == "cancelled")
    requested = sorted(i for i, what in done.items() if what == "abort_requested")
    report: dict[str, Any] = {
        "action": "abort",
        "cancelled": cancelled,
        "abort_requested": requested,
    }
    if "ids" in chosen:
        text = (
            f"Cancelled {len(cancelled)} waiting, requested the abort of {len(requested)} running."
        )
        skipped = sorted(set(chosen["ids"]) - set(done))
        report["skipped"] = skipped
        if skipped:
            text += f"\nSkipped (finished or unknown): {', '.join(map(str, skipped))}."
    else:  # a selection: its running messages only (its waiting ones stay: fairqueue cancel)
        text = f"Requested the abort of {len(requested)} running; waiting messages are left."
    write(stdout, json_text(report) if options["json"] else text)

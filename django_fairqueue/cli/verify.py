"""Check every channel's counters against its messages and work batches; --repair fixes them.

The counters the claim trusts (ready, delayed, running, failed) are recounted from the rows in
one read-only snapshot, without locks, and each channel group's sums from its channels; unique
jobs of scope 'active' that hold their key must be named by their key's hold row. With
--repair, each channel or group found wrong is recounted under its row lock, the missing hold
rows are written and rows whose channel no longer exists are deleted. Workers do the same
every FAIRQUEUE['VERIFY_INTERVAL'] seconds and log what they repaired. Exits with status 1
when it found drift and did not repair it, so a monitoring job can alert on it.
"""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import CommandError, OutputWrapper

from django_fairqueue.maintenance import verify
from django_fairqueue.queues import display_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--repair",
        action="store_true",
        help="Recount the channels and channel groups found wrong (under their row locks), "
        "write the missing hold rows of unique keys and delete rows of channels that no "
        "longer exist.",
    )


def handle(options: dict[str, Any], stdout: OutputWrapper) -> None:
    repair = options["repair"]
    drift = verify(repair=repair)
    for d in drift:
        stdout.write(
            f"{d.kind} {display_name(d.channel)!r}: {d.counter} recorded "
            f"{d.recorded}, counted {d.actual}" + (" (repaired)" if repair else "")
        )
    if not drift:
        stdout.write("every channel's counters match its rows")
    elif not repair:
        raise CommandError(
            f"{len(drift)} counter(s) disagree with the rows; run with --repair to fix them"
        )
    else:
        stdout.write(f"repaired {len(drift)} counter(s)")

"""Level every channel's and channel group's tag (fairness by time), as on a fresh install.

By time, a channel's tag is the worker time it has been charged; the claim serves the smallest.
Claims by count neither charge nor lift tags, so after a period by count a channel created or
kept busy meanwhile may be far behind the others, and take nearly every worker once the fleet
claims by time again, for as long as the fleet ran by time before. Run this when switching a
fleet back to ``FAIRNESS = "time"`` (after the workers by count have stopped): every channel
and group then starts even. Safe while workers run; it waits for claims holding the rows.
"""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import OutputWrapper
from django.db import transaction

from django_fairqueue import conf
from django_fairqueue.db import channel_store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass  # (no options: every tag of the queue's database)


def handle(options: dict[str, Any], stdout: OutputWrapper) -> None:
    using = conf.get().DATABASE
    with transaction.atomic(using=using):  # channels, then groups: the lock order
        channels = channel_store.level_channel_tags(using=using)
        groups = channel_store.level_group_tags(using=using)
    stdout.write(f"levelled the tags of {channels} channel(s) and {groups} channel group(s)")

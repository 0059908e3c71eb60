"""Subcommands of ``manage.py fairqueue``, one module each.

A subcommand module ``django_fairqueue/cli/<name>.py`` has a docstring (its first line is the
help text) and two functions:

* ``add_arguments(parser)``: add its options to its own ``argparse`` subparser;
* ``handle(options, stdout)``: run it; ``options`` is the parsed dict, ``stdout`` Django's
  output wrapper. Raise ``django.core.management.CommandError`` for a readable failure.

To add a subcommand, add its module and its name to :data:`SUBCOMMANDS`. An option or argument
that names a channel takes ``type=channel_name``, one that names a queue ``type=queue_name``.
"""

from __future__ import annotations

import argparse

#: Subcommand names, in the order ``manage.py fairqueue --help`` lists them.
SUBCOMMANDS: tuple[str, ...] = (
    "maintain",
    "failures",
    "cancel",
    "abort",
    "schedules",
    "status",
    "usage",
    "verify",
    "workers",
    "level",
)


def channel_name(text: str) -> str:
    """argparse ``type`` of a channel name: one ``enqueue()`` would accept, else a usage error
    (an empty name is refused, never read as "no filter" or as a channel no message has)."""
    from django_fairqueue.api import validate_channel_name
    from django_fairqueue.exceptions import InvalidChannel

    try:
        return validate_channel_name(text)
    except InvalidChannel as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def queue_name(text: str) -> str:
    """argparse ``type`` of a queue name: a valid one, else a usage error."""
    from django_fairqueue.exceptions import InvalidQueue
    from django_fairqueue.queues import validate_queue_name

    try:
        return validate_queue_name(text)
    except InvalidQueue as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None

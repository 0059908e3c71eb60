"""Subcommands of ``manage.py fairqueue``, one module each.

A subcommand module ``django_fairqueue/cli/<name>.py`` has a docstring (its first line is the
help text) and two functions:

* ``add_arguments(parser)``: add its options to its own ``argparse`` subparser;
* ``handle(options, stdout)``: run it; ``options`` is the parsed dict, ``stdout`` Django's
  output wrapper. Raise ``django.core.management.CommandError`` for a readable failure.

To add a subcommand, add its module and its name to :data:`SUBCOMMANDS`.
"""

from __future__ import annotations

#: Subcommand names, in the order ``manage.py fairqueue --help`` lists them.
SUBCOMMANDS: tuple[str, ...] = (
    "maintain",
    "failures",
    "cancel",
    "abort",
    "schedules",
    "status",
    "verify",
    "workers",
)

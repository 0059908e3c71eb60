"""``manage.py fairqueue SUBCOMMAND``: operations on the queue.

The subcommands live in ``django_fairqueue/cli/`` (one module each, listed in
``django_fairqueue.cli.SUBCOMMANDS``); this command only dispatches to them.
"""

from __future__ import annotations

import argparse
from importlib import import_module
from types import ModuleType
from typing import Any

from django.core.management.base import CommandParser

from django_fairqueue.cli import SUBCOMMANDS
from django_fairqueue.management.base import FairCommand


def _subcommand(name: str) -> ModuleType:
    return import_module(f"django_fairqueue.cli.{name}")


class Command(FairCommand):
    help = "django-fairqueue operations: " + ", ".join(SUBCOMMANDS) + "."

    def add_arguments(self, parser: CommandParser) -> None:
        subparsers = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
        for name in SUBCOMMANDS:
            module = _subcommand(name)
            doc = (module.__doc__ or "").strip()
            # the docstring speaks to users and is laid out by hand: printed as written
            subparser = subparsers.add_parser(
                name,
                help=doc.splitlines()[0] if doc else None,
                description=doc or None,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
            module.add_arguments(subparser)

    def handle(self, *args: Any, **options: Any) -> None:
        _subcommand(options["subcommand"]).handle(options, self.stdout)

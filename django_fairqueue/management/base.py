"""The base class of the product's management commands."""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser, OutputWrapper
from django.db.utils import InterfaceError, OperationalError, ProgrammingError

from django_fairqueue import conf
from django_fairqueue.cli.terminal import exit_quietly_on_closed_pipe, whole_stdout
from django_fairqueue.db import pg
from django_fairqueue.runtime import dbfaults


class FairCommand(BaseCommand):
    """A management command that exits quietly when the reader of its output goes away
    (``manage.py fairqueue failures list | head``): status 141, no traceback; and that says
    what to do, not a traceback, when the queue's tables are missing, a setting is bad or the
    database cannot be reached.

    A command with subcommands (``fairqueue``, ``fairpipeline``) takes Django's common options
    (``-v``, ``--settings``, ``--traceback``, ...) after a subcommand too, as every other
    command takes them anywhere: argparse hands what follows a subcommand to its own parser.
    """

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        self._base_arguments: list[tuple[tuple[str, ...], dict[str, Any]]] = []
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        for leaf in _subcommand_parsers(parser):
            # SUPPRESS: one given before the subcommand is not reset by the subcommand's
            for args, options in self._base_arguments:
                super().add_base_argument(leaf, *args, **{**options, "default": argparse.SUPPRESS})
            if self.requires_system_checks:
                leaf.add_argument(
                    "--skip-checks",
                    action="store_true",
                    default=argparse.SUPPRESS,
                    help="Skip system checks.",
                )
        return parser

    def add_base_argument(self, parser: Any, *args: Any, **kwargs: Any) -> None:
        super().add_base_argument(parser, *args, **kwargs)
        self._base_arguments.append((args, kwargs))

    def execute(self, *args: Any, **options: Any) -> str | None:
        try:
            return super().execute(*args, **options)
        except conf.SettingsError as exc:  # met with --skip-checks: the check's words
            raise CommandError(str(exc)) from None
        except ProgrammingError as exc:
            hint = pg.what_to_do(exc)
            if hint is None:
                raise
            first = str(exc).splitlines()[0]
            raise CommandError(first if hint in first else f"{first}: {hint}") from exc
        except (OperationalError, InterfaceError) as exc:
            refused = dbfaults.misconfigured(exc)
            if refused is None and dbfaults.unavailable(exc) is None:
                raise
            reason = refused or " ".join(str(exc).split())
            raise CommandError(
                f"cannot reach the queue's database ({conf.get().DATABASE!r}): {reason}"
            ) from exc

    def run_from_argv(self, argv: list[str]) -> None:
        self.stdout = OutputWrapper(whole_stdout())
        exit_quietly_on_closed_pipe(super().run_from_argv, argv)


def _subcommand_parsers(parser: argparse.ArgumentParser) -> list[CommandParser]:
    """Every parser below ``parser`` reached through subcommands, nested ones included (a
    command's subparsers are ``CommandParser``s: Django's ``add_subparsers`` makes them so)."""
    found: list[CommandParser] = []
    for action in parser._actions:  # (argparse lists subcommands only there)
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                if isinstance(child, CommandParser):
                    found.append(child)
                found += _subcommand_parsers(child)
    return found

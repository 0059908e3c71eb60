"""The base class of the product's management commands."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, OutputWrapper
from django.db.utils import ProgrammingError

from django_fairqueue import conf
from django_fairqueue.cli.terminal import exit_quietly_on_closed_pipe, whole_stdout
from django_fairqueue.db import pg


class FairCommand(BaseCommand):
    """A management command that exits quietly when the reader of its output goes away
    (``manage.py fairqueue failures list | head``): status 141, no traceback; and that says
    what to do, not a traceback, when the queue's tables are missing or a setting is bad."""

    def execute(self, *args: Any, **options: Any) -> str | None:
        try:
            return super().execute(*args, **options)
        except conf.SettingsError as exc:  # met with --skip-checks: the check's words
            raise CommandError(str(exc)) from None
        except ProgrammingError as exc:
            hint = pg.missing_schema(exc)
            if hint is None:
                raise
            first = str(exc).splitlines()[0]
            raise CommandError(first if hint in first else f"{first}: {hint}") from exc

    def run_from_argv(self, argv: list[str]) -> None:
        self.stdout = OutputWrapper(whole_stdout())
        exit_quietly_on_closed_pipe(super().run_from_argv, argv)

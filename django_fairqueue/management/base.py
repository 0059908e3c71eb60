"""The base class of the product's management commands."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from django_fairqueue.cli.terminal import exit_quietly_on_closed_pipe


class FairCommand(BaseCommand):
    """A management command that exits quietly when the reader of its output goes away
    (``manage.py fairqueue failures list | head``): status 141, no traceback."""

    def run_from_argv(self, argv: list[str]) -> None:
        exit_quietly_on_closed_pipe(super().run_from_argv, argv)

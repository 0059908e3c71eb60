"""Companions of a worker process: what an optional app runs beside ``runfairworker``.

An installed app that runs work of its own next to a worker (the Spark pipeline app runs its
work batches in a thread of the worker process) registers a :class:`WorkerExtension` in its
``AppConfig.ready()``::

    from django_fairqueue.worker import extensions

    class MyAppConfig(AppConfig):
        def ready(self) -> None:
            extensions.register(MyExtension())

``runfairworker`` then offers the extension's options, starts its companion before the worker
claims and stops it (and waits for it) when the worker stops, whatever the reason; with
``--burst`` it first lets the companion finish its own burst (:meth:`Companion.finish`); under a
supervisor (``--processes``) each worker process gets the extension's options again. The queue
knows no extension by name: without the app, its options do not exist.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django.core.management.base import CommandParser

    from django_fairqueue.worker.config import WorkerConfig


class Companion:
    """What an extension started: stopped once, when the worker stops."""

    def stop(self) -> None:
        """Stop, and return once stopped."""
        raise NotImplementedError

    def finish(self) -> None:
        """The worker ran with ``--burst`` and is done: return once the companion's own work
        is done too (it was started in burst mode). By default at once."""


class WorkerExtension:
    """Options and a companion for ``runfairworker``. ``name`` is unique among extensions."""

    name: str = ""

    def add_arguments(self, parser: CommandParser) -> None:
        """Add the extension's options to ``runfairworker``'s parser."""

    def child_flags(self, options: Mapping[str, Any]) -> list[str]:
        """The extension's options as given, for each supervised worker process."""
        return []

    def start(self, options: Mapping[str, Any], config: WorkerConfig) -> Companion | None:
        """Start the companion if the options ask for it (else None). Raise ``ValueError``
        with a message for the user if they are wrong: the worker does not start."""
        return None


_extensions: dict[str, WorkerExtension] = {}
_lock = threading.Lock()


def register(extension: WorkerExtension) -> WorkerExtension:
    """Register ``extension`` (again under the same name: replaced, so ``ready()`` may run
    twice)."""
    if not extension.name:
        raise ValueError(f"a worker extension needs a name: {extension!r}")
    with _lock:
        _extensions[extension.name] = extension
    return extension


def unregister(name: str) -> None:
    with _lock:
        _extensions.pop(name, None)


def registered() -> list[WorkerExtension]:
    """The registered extensions, in the order of registration."""
    with _lock:
        return list(_extensions.values())

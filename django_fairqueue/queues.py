"""Queues: named pools of work, orthogonal to channels (see docs/howto/queues.md).

A task declares its queue (``@task(queue="reports")``, or ``django.tasks``' ``queue_name``);
a worker serves the queues it is given (``runfairworker --queues reports``), fairly across the
channels (tenants) within each. A channel belongs to one queue: the channel ``"acme"`` of queue
``"reports"`` is a channel row of its own, named ``"reports\\x1facme"`` (the queue, the unit
separator U+001F, the channel), whose ``queue`` column the database sets from that name. The
default queue's rows are named as channels always were, so a project with one queue sees no
change. U+001F is refused in channel names given to the API, so no name can be mistaken for
another queue's.

A module of small functions without Django imports, so the models, the settings and the task
registry can all use it.
"""

from __future__ import annotations

import re
from typing import Any

from django_fairqueue.exceptions import InvalidQueue
from django_fairqueue.limits import QUEUE_NAME_MAX_LENGTH

#: The queue of a task that names none (Django's default ``queue_name`` too).
DEFAULT_QUEUE = "default"
#: Between the queue and the channel name in a channel row's name (never in a channel name).
SEPARATOR = "\x1f"

_QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def validate_queue_name(name: Any) -> str:
    """A queue name: 1-64 letters, digits, ``_``, ``.`` or ``-``, starting with a letter or a
    digit. Raises :class:`~django_fairqueue.exceptions.InvalidQueue` otherwise."""
    if not isinstance(name, str):
        raise InvalidQueue(f"queue name must be a string, got {type(name).__name__}")
    if not name:
        raise InvalidQueue("queue name must not be empty")
    if len(name) > QUEUE_NAME_MAX_LENGTH:
        raise InvalidQueue(
            f"queue name is {len(name)} characters; the most is {QUEUE_NAME_MAX_LENGTH}"
        )
    if not _QUEUE_NAME.fullmatch(name):
        raise InvalidQueue(
            f"queue name {name!r} may hold only letters, digits, '_', '.' and '-', "
            "and must start with a letter or a digit"
        )
    return name


def parse_queue_list(text: str) -> list[str]:
    """``"reports, exports"`` -> ``["reports", "exports"]``, each checked, duplicates dropped."""
    names: list[str] = []
    for part in text.split(","):
        name = validate_queue_name(part.strip())
        if name not in names:
            names.append(name)
    return names


def row_name(queue: str, name: str) -> str:
    """The name of the row of channel (or group) ``name`` in ``queue``."""
    return name if queue == DEFAULT_QUEUE else f"{queue}{SEPARATOR}{name}"


def display_name(row: str) -> str:
    """A channel or group row's name as people read it in text: ``acme`` (default queue), or
    ``acme [reports]`` (tables and JSON give the name and the queue apart instead)."""
    queue, name = split_row_name(row)
    return name if queue == DEFAULT_QUEUE else f"{name} [{queue}]"


def split_row_name(row: str) -> tuple[str, str]:
    """``(queue, name)`` of a channel or group row's name (the inverse of :func:`row_name`)."""
    queue, sep, name = row.partition(SEPARATOR)
    if not sep or not queue:
        return DEFAULT_QUEUE, row
    return queue, name

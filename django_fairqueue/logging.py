"""Structured logging: the channel, task and message id on every line a worker writes.

Three pieces, usable separately:

* :class:`MessageContextFilter`, a ``logging.Filter`` (attach it to a *handler*) that gives
  every record the attributes ``channel``, ``task``, ``message_id`` and ``attempt``. Values
  the caller passed with ``extra=`` are kept; otherwise they come from the message the current
  worker thread is running (:data:`django_fairqueue.context.current_message`), so lines logged
  by *your task code* through any logger carry them too. Outside a message they are ``None``,
  so a format string such as ``"%(channel)s %(message_id)s %(message)s"`` never fails.
* :func:`message_logger`, a ``LoggerAdapter`` that adds a given message's fields to each call
  (for code that holds a :class:`~django_fairqueue.db.message_store.ClaimedMessage` outside
  its thread, e.g. the settler).
* :class:`JsonFormatter`, one JSON object per line, with the fields above when set.

Example ``LOGGING`` for JSON lines on stderr (see docs/howto/observability.md)::

    LOGGING = {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"fairqueue": {"()": "django_fairqueue.logging.MessageContextFilter"}},
        "formatters": {"json": {"()": "django_fairqueue.logging.JsonFormatter"}},
        "handlers": {
            "console": {
                "class": "logging.StreamHandler",
                "filters": ["fairqueue"],
                "formatter": "json",
            },
        },
        "loggers": {"django_fairqueue": {"handlers": ["console"], "level": "INFO"}},
    }
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, MutableMapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from django_fairqueue.context import current_message

if TYPE_CHECKING:
    from django_fairqueue.db.message_store import ClaimedMessage

__all__ = ["CONTEXT_FIELDS", "JsonFormatter", "MessageContextFilter", "message_logger"]

#: The record attributes the filter guarantees, in the order the JSON formatter writes them.
CONTEXT_FIELDS = ("channel", "task", "message_id", "attempt")


def message_fields(message: ClaimedMessage | None) -> dict[str, Any]:
    """The context fields of ``message`` (all ``None`` without one)."""
    if message is None:
        return dict.fromkeys(CONTEXT_FIELDS)
    return {
        "channel": message.channel,
        "task": message.task_name,
        "message_id": message.id,
        "attempt": message.attempts,
    }


class MessageContextFilter(logging.Filter):
    """Adds ``channel``, ``task``, ``message_id`` and ``attempt`` to every record; never drops
    a record. Attach it to handlers: a filter on a logger does not see records of its
    children."""

    def filter(self, record: logging.LogRecord) -> bool:
        missing = [name for name in CONTEXT_FIELDS if getattr(record, name, None) is None]
        if missing:
            fields = message_fields(current_message.get())
            for name in missing:
                setattr(record, name, fields[name])
        return True


class _MessageAdapter(logging.LoggerAdapter[logging.Logger]):
    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        # The call's own extra wins over the message's fields (LoggerAdapter replaces it).
        extra: Mapping[str, Any] = self.extra or {}
        kwargs["extra"] = {**extra, **kwargs.get("extra", {})}
        return msg, kwargs


def message_logger(
    logger: logging.Logger, message: ClaimedMessage
) -> logging.LoggerAdapter[logging.Logger]:
    """``logger``, with ``message``'s channel, task, id and attempt on every call."""
    return _MessageAdapter(logger, message_fields(message))


#: LogRecord attributes that are not ``extra`` fields.
_STANDARD = frozenset(
    vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None)).keys()
) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``,
    the context fields that are set, any other ``extra`` value, and ``exc_info`` as text.

    Values that are not JSON types are written with ``str()``.
    """

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                out[name] = value
        for name, value in vars(record).items():
            if (
                name not in _STANDARD
                and name not in out
                and name not in CONTEXT_FIELDS
                and not name.startswith("_")
            ):
                out[name] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)

"""Errors that mean the database is unavailable, not that a task is wrong.

A task that fails because its own database connection was refused (the server at
``max_connections``, restarting, shutting down, a standby just promoted and the old primary
read-only) did nothing wrong: running it again once the database is back succeeds. Such an
attempt is **given back**: released without using an attempt, to run again after
:data:`GIVE_BACK_DELAY` seconds (jittered), instead of failing and costing one of the
message's ``max_attempts``, which an outage could exhaust and dead-letter.

:func:`unavailable` classifies an exception (it follows ``__cause__`` and ``__context__``, so
Django's wrappers of psycopg's errors are seen through). :class:`RateLimitedWarnings` keeps an
outage from flooding the log: one line per cause every :data:`WARN_EVERY` seconds, with how
many were folded into it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from datetime import timedelta
from typing import Any

#: SQLSTATEs of a database that is unavailable (or unwritable) now and will be back, besides
#: the connection exceptions (class 08): the server refusing connections or closing them
#: (class 57, except a cancelled statement: a timeout is the task's own), and a write to a
#: server that became read-only (a failover's demoted primary, a hot standby).
UNAVAILABLE_SQLSTATES = {
    "53300": "too many connections",
    "57P01": "admin shutdown",
    "57P02": "crash shutdown",
    "57P03": "cannot connect now",
    "57P05": "idle session timeout",
    "25006": "read-only transaction",
}
#: A refused connection carries no SQLSTATE (psycopg reports the server's FATAL message as
#: text): these words name its cause.
_REFUSALS = {
    "too many clients": "too many connections",
    "remaining connection slots are reserved": "too many connections",
    "the database system is starting up": "cannot connect now",
    "the database system is shutting down": "cannot connect now",
    "the database system is in recovery mode": "cannot connect now",
    "the database system is not yet accepting connections": "cannot connect now",
}

#: Refusals that waiting does not end: the settings name a database or a role the server does
#: not have, or credentials (or a client address) it does not accept. SQLSTATEs, and the words
#: of psycopg's text when the refusal came while connecting (no SQLSTATE).
_MISCONFIGURED_SQLSTATES = {"3D000", "28000", "28P01"}
_MISCONFIGURED = ("does not exist", "authentication failed", "no pg_hba.conf entry")

#: Seconds before a given-back message is claimed again (50-100 %: jittered, so the messages
#: of one outage do not all come back in the same instant).
GIVE_BACK_DELAY = 2.0
#: Seconds between two log lines about one cause.
WARN_EVERY = 10.0


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during, outermost first."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and not any(current is s for s in seen) and len(seen) < 10:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def unavailable(exc: BaseException) -> str | None:
    """The cause, if ``exc`` means the database is unavailable: ``"connection failed"``,
    ``"too many connections"``, ``"admin shutdown"``, ``"read-only transaction"``...; None
    for anything else (a task's bug, a constraint violated, a deadlock, a statement timeout)."""
    from django.db import InterfaceError as DjangoInterfaceError
    from django.db import OperationalError as DjangoOperationalError

    for error in _chain(exc):
        sqlstate = getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)
        if sqlstate:
            if sqlstate.startswith("08"):
                return "connection failed"
            return UNAVAILABLE_SQLSTATES.get(sqlstate)  # any other answer: not an outage
    for error in _chain(exc):
        if _is_connection_failure(error):
            text = str(error)
            return next((c for words, c in _REFUSALS.items() if words in text), "connection failed")
        if isinstance(error, DjangoInterfaceError):
            return "connection closed"
        if isinstance(error, DjangoOperationalError) and _is_connection_failure(error.__cause__):
            return "connection failed"
    return None


def misconfigured(exc: BaseException) -> str | None:
    """The server's reason, if ``exc`` is a connection refused for a reason waiting does not
    end (a database or role that does not exist, credentials refused); None otherwise, an
    unavailable database included."""
    for error in _chain(exc):
        sqlstate = getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)
        text = str(error)
        if sqlstate in _MISCONFIGURED_SQLSTATES or (
            _is_connection_failure(error) and any(words in text for words in _MISCONFIGURED)
        ):
            return " ".join(text.rpartition("FATAL:")[2].split())
    return None


def _is_connection_failure(error: BaseException | None) -> bool:
    """A psycopg error without a server answer: the connection could not be made, or broke
    (refused, reset, closed by the server, the host unreachable)."""
    try:
        import psycopg
    except ImportError:  # pragma: no cover - psycopg is a dependency
        return False
    if isinstance(error, psycopg.InterfaceError):
        return True  # "the connection is closed", a cursor of a closed connection
    return isinstance(error, psycopg.OperationalError) and not getattr(error, "sqlstate", None)


def give_back_delay() -> timedelta:
    """How long a given-back message waits before it is claimed again."""
    return timedelta(seconds=GIVE_BACK_DELAY * random.uniform(0.5, 1.0))


class RateLimitedWarnings:
    """Log at most one line per cause every ``every`` seconds; the next line says how many
    more there were in between. Thread-safe (every handler thread of a worker shares one)."""

    def __init__(self, logger: logging.Logger, every: float = WARN_EVERY) -> None:
        self.logger = logger
        self.every = every
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # cause -> when its last line was logged
        self._folded: dict[str, int] = {}  # cause -> lines not logged since

    def warning(self, cause: str, msg: str, *args: Any, **kwargs: Any) -> bool:
        """Log ``msg % args`` unless a line about ``cause`` was logged less than ``every``
        seconds ago (then count it); returns whether it was logged."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(cause)
            if last is not None and now - last < self.every:
                self._folded[cause] = self._folded.get(cause, 0) + 1
                return False
            folded = self._folded.pop(cause, 0)
            self._last[cause] = now
        if folded:
            msg += " (and %d more like it in the last %.0fs)"
            args = (*args, folded, now - last if last is not None else self.every)
        self.logger.warning(msg, *args, **kwargs)
        return True

"""What the worker and ``fairqueue maintain`` run on. Here: stop flags, signals, backoff and
reconnecting after database errors. Beside it: the retry policy and error record
(:mod:`.attempts`), the worker registry (:mod:`.worker_registry`) and the errors that mean the
database is unavailable (:mod:`.dbfaults`).

Signal handlers run in the main thread between two bytecodes, possibly while that thread is
inside ``threading.Event.wait()`` holding the event's (non-reentrant) lock: an ``Event.set()``
from the handler would then deadlock. :class:`StopFlag` uses a reentrant lock instead, so it
may be set from a signal handler.
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from django.db import DatabaseError, InterfaceError, OperationalError, connections

from django_fairqueue import conf

#: Errors that mean "the database is unreachable or restarting": retry with backoff on a fresh
#: connection. Anything else is a bug or a schema problem and is not retried blindly.
CONNECTION_ERRORS = (OperationalError, InterfaceError)

#: SQLSTATEs, among CONNECTION_ERRORS, of a statement that lost a race with another transaction
#: and was rolled back: the database is fine, and the statement is safe to run again (every
#: worker statement is its own transaction, and settlements are fenced by lease tokens).
CONFLICTS = {
    "40P01": "deadlock detected",
    "40001": "serialization failure",
    "55P03": "lock not available",
}


def conflict(exc: BaseException) -> str | None:
    """What kind of conflict ``exc`` is (see CONFLICTS), or None."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return CONFLICTS.get(getattr(cause, "sqlstate", None) or "")


def after_database_error(exc: BaseException, alias: str | None = None) -> str:
    """Deal with one of CONNECTION_ERRORS and say what it was, for the log line.

    A conflict (deadlock, serialization failure) keeps the connection, which is fine; anything
    else means the database is unreachable or restarting, and the connection is dropped so
    the next use reconnects.
    """
    kind = conflict(exc)
    if kind is not None:
        return f"{kind}, rolled back ({str(exc).strip()})"
    reset_connection(alias)
    return f"database unavailable ({str(exc).strip()})"


#: The signals that ask a worker to stop: the first one gracefully, the second one at once.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: A second stop signal this soon after the first is the same stop, not a second one: a
#: service manager that signals every process of a service (systemd's default KillMode) reaches
#: a supervised worker once itself and once through its supervisor, milliseconds apart.
SAME_STOP_SECONDS = 1.0
#: The exit status of a supervised worker that handled its ``--max-messages`` and asks to be
#: replaced (a recycle): a burst worker's 0 means its burst is done.
RECYCLE_EXIT = 75
#: The exit status of a supervised worker that could not start (its worker id in use, its
#: metrics port taken, its database refusing its settings or lacking this release's
#: migrations): started again, it would fail the same way, so a burst's supervisor gives its
#: slot up instead of starting it for ever (sysexits' EX_CONFIG).
STARTUP_FAILED_EXIT = 78


#: The environment variable through which a supervisor (``runfairworker --processes``) tells
#: each worker it starts about its slot: a JSON object the worker records in the registry
#: (``WorkerRecord.supervision``).
SUPERVISION_ENV = "FAIRQUEUE_SUPERVISION"


class StopFlag:
    """A one-way flag that threads can wait on, safe to set from a signal handler."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.RLock())
        self._set = False

    def set(self) -> None:
        with self._cond:
            self._set = True
            self._cond.notify_all()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until the flag is set or ``timeout`` passes; returns whether it is set."""
        with self._cond:
            if not self._set:
                self._cond.wait(timeout)
            return self._set


@contextmanager
def stop_signals(on_signal: Callable[[int], None]) -> Iterator[bool]:
    """Call ``on_signal(signum)`` on SIGTERM/SIGINT while the block runs.

    Handlers can only be installed from the main thread; elsewhere nothing is installed and the
    context yields False (the caller stops the loop some other way). The previous handlers are
    restored on exit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield False
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        on_signal(signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield True
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class Backoff:
    """Exponential backoff with jitter for reconnecting: first, 2*first, ... up to cap."""

    def __init__(self, first: float = 0.05, cap: float = 5.0) -> None:
        self.first = first
        self.cap = cap
        self._delay = 0.0

    def next(self) -> float:
        """The next delay in seconds (a random 50-100% of the current step)."""
        self._delay = self.first if self._delay == 0 else min(self.cap, self._delay * 2)
        return self._delay * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self._delay = 0.0


def reset_connection(alias: str | None = None) -> None:
    """Drop this thread's queue connection after a connection error; the next use reconnects."""
    wrapper = connections[alias or conf.get().DATABASE]
    # Closing a connection the server already dropped may fail too; it is gone either way.
    # (Django forgets the connection object even when closing it fails.)
    with contextlib.suppress(DatabaseError):
        wrapper.close()


def drop_broken_connection(alias: str | None = None) -> None:
    """Close this thread's queue connection if an error left it unusable (keep it otherwise).

    Unlike ``close_old_connections()`` this ignores CONN_MAX_AGE: the worker's own threads keep
    one connection each for their whole life (with CONN_MAX_AGE = 0, the default,
    ``close_old_connections()`` would reconnect on every pass).
    """
    wrapper = connections[alias or conf.get().DATABASE]
    if wrapper.connection is not None and wrapper.errors_occurred:
        if wrapper.is_usable():
            wrapper.errors_occurred = False
        else:
            reset_connection(alias)


@contextmanager
def command_logging(verbosity: int) -> Iterator[None]:
    """For a command's run, show django-fairqueue's log lines on stderr, unless the project's
    LOGGING already routes them somewhere: its handlers are then left alone. Put back as it
    was when the block ends (a command called in-process leaves no level behind).

    Verbosity 0: warnings and errors; 1: one line per message start and finish; 2+: debug.
    With the project's handlers, ``-v 0`` still drops the per-message lines (they cost CPU at
    thousands of messages a second, whoever formats them) without showing more than LOGGING
    does, ``-v 2`` adds debug, and the default, 1, keeps the level LOGGING gave.
    """
    import logging
    import sys

    package = logging.getLogger("django_fairqueue")
    was = package.level
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    added = None
    if package.handlers or logging.getLogger().handlers:
        if verbosity <= 0:
            package.setLevel(max(level, package.getEffectiveLevel()))
        elif verbosity >= 2:
            package.setLevel(level)
    else:
        from django_fairqueue.cli.terminal import PrintableFormatter  # names, errors escaped

        added = logging.StreamHandler(sys.stderr)
        added.setFormatter(
            PrintableFormatter("%(asctime)s %(levelname)s [%(threadName)s] %(name)s: %(message)s")
        )
        package.addHandler(added)
        package.setLevel(level)
    try:
        yield
    finally:
        package.setLevel(was)
        if added is not None:
            package.removeHandler(added)

"""Terminal output shared by the commands: :func:`printable`, which every table and line of
``manage.py fairqueue`` and ``runfairworker`` passes stored text through, and the progress
drawing of ``fairpipeline plan``'s bar (:class:`django_fairqueue.batches.ProgressBar`),
fairbench's live cell line and the peer comparison's (``benchmarks/compare``)."""

from __future__ import annotations

import logging
import time
from typing import Any

#: Erase the current terminal line and return to its start.
CLEAR_LINE = "\r\x1b[2K"


def printable(text: object) -> str:
    """``text`` with every control character escaped as ``repr`` would (``\\x1b``, ``\\r``,
    ``\\n``, ``\\u2028``...), and backslashes doubled so an escape cannot be forged.

    Channel, group, task and schedule names, error messages and worker ids come from tenants
    and tasks: printed raw, an escape sequence would reach the operator's terminal (recolour
    it, move the cursor, rewrite what an earlier line said) and a newline would split a table
    row. Everything else, any script, accents and emoji, is printed as is.
    """
    text = str(text)
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(
        "\\\\" if ch == "\\" else (ch if ch.isprintable() else repr(ch)[1:-1]) for ch in text
    )


class PrintableFormatter(logging.Formatter):
    """A log formatter for a terminal: the message passes through :func:`printable` (a log
    line names channels and tasks, and quotes task errors), and a traceback keeps its lines
    but has the control characters of each escaped."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        message = record.message
        record.message = printable(message)
        try:
            return super().formatMessage(record)
        finally:
            record.message = message

    def formatException(self, ei: Any) -> str:
        return _lines(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _lines(super().formatStack(stack_info))


def _lines(text: str) -> str:
    return "\n".join(printable(line) for line in text.split("\n"))


def bar(fraction: float, width: int = 20) -> str:
    """``[#####...............]`` for ``fraction`` (clamped to 0..1), ``width`` cells inside."""
    filled = int(width * min(max(fraction, 0.0), 1.0))
    return "[" + "#" * filled + "." * (width - filled) + "]"


class Throttle:
    """Say when a live line is due for a redraw: at most ``per_second`` times a second, and
    always for the final state (a bar that reaches 100% is drawn even if it just was)."""

    def __init__(self, per_second: float = 10.0) -> None:
        self.interval = 1.0 / per_second
        self._last = -float("inf")

    def due(self, *, final: bool = False) -> bool:
        now = time.monotonic()
        if not final and now - self._last < self.interval:
            return False
        self._last = now
        return True


#: The exit status of a command whose reader closed its output (``| head``): 128 + SIGPIPE,
#: as a program the signal ended would report.
CLOSED_PIPE_STATUS = 141


def exit_quietly_on_closed_pipe(run: Any, *args: Any) -> Any:
    """Call ``run(*args)``; if the reader of standard output went away (``fairqueue workers |
    head``), exit with :data:`CLOSED_PIPE_STATUS` and no traceback.

    Every management command of the product runs through this (their ``run_from_argv``).
    Standard output is pointed at ``/dev/null`` first, so the interpreter's own flush at exit
    cannot raise the same error again.
    """
    import os
    import sys

    try:
        result = run(*args)
        # What is still buffered is written here, where a closed pipe is caught, and not by
        # the interpreter's flush at exit (which reports it and exits with status 120). A
        # short listing fits in the buffer whole, so this is where it meets the closed pipe.
        sys.stdout.flush()
        return result
    except BrokenPipeError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # no real file descriptor behind sys.stdout
            pass
        raise SystemExit(CLOSED_PIPE_STATUS) from None

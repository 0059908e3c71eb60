"""Terminal output shared by the commands: :func:`printable`, which every table and line of
``manage.py fairqueue`` and ``runfairworker`` passes stored text through, the tables' columns
(:func:`aligned`, by display width), their JSON (:func:`json_text`), and the progress drawing
of ``fairpipeline plan``'s bar (:class:`django_fairqueue.batches.ProgressBar`), fairbench's
live cell line and the peer comparison's (``benchmarks/compare``)."""

from __future__ import annotations

import io
import json
import logging
import sys
import time
import unicodedata
from collections.abc import Collection, Sequence
from datetime import date
from typing import Any, TextIO

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


def json_text(data: object, *, indent: int | None = None) -> str:
    """``data`` as the JSON a command prints (``--json``): a time as ISO 8601
    (``2026-12-01T03:00:00+00:00``), as every subcommand writes it."""
    return json.dumps(data, default=_iso, indent=indent)


def _iso(value: object) -> str:
    if isinstance(value, date):  # a datetime too
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON")


def width(text: str) -> int:
    """The terminal columns ``text`` takes: two for a wide character (East Asian Width W or
    F: CJK, most emoji), none for a combining mark, one for the rest."""
    if text.isascii():
        return len(text)
    return sum(
        0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
        for ch in text
    )


def cut(text: str, columns: int) -> str:
    """``text`` if it takes at most ``columns``, else its start and "..." in ``columns``."""
    if width(text) <= columns:
        return text
    kept, used = [], 0
    for ch in text:
        used += width(ch)
        if used > columns - 3:
            break
        kept.append(ch)
    return "".join(kept) + "..."


def column_widths(rows: Sequence[Sequence[str]]) -> list[int]:
    """The display width of each column of ``rows`` (its widest cell)."""
    return [max(width(cell) for cell in column) for column in zip(*rows, strict=True)]


def aligned_row(row: Sequence[str], widths: Sequence[int], right: Collection[int] = ()) -> str:
    """One table line: each cell padded to its column's display width (on the left for the
    columns in ``right``, numbers), two spaces apart, no trailing blanks."""
    cells = []
    for i, (cell, columns) in enumerate(zip(row, widths, strict=True)):
        padding = " " * (columns - width(cell))
        cells.append(padding + cell if i in right else cell + padding)
    return "  ".join(cells).rstrip()


def aligned(rows: Sequence[Sequence[str]], right: Collection[int] = ()) -> list[str]:
    """``rows`` as table lines in columns (:func:`aligned_row`). Padding by display width
    keeps the columns straight past a tenant's name in Chinese or with an emoji, which take
    two columns a character."""
    widths = column_widths(rows)
    return [aligned_row(row, widths, right) for row in rows]


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


class _WholeWrites(io.TextIOWrapper):
    """A text stream over a buffered writer that hands every write on at once."""

    def write(self, text: str) -> int:
        count = super().write(text)
        self.flush()  # as unbuffered output would: a line appears when it is written
        return count


def whole_stdout() -> TextIO:
    """Standard output, made to write every text whole or raise, and returned.

    Unbuffered (``python -u``, ``PYTHONUNBUFFERED=1``, which many container images set),
    Python's text stream hands a write to the file once and ignores how much of it the file
    took: when the reader of a pipe goes away in the middle of a long write (``fairqueue
    status | head -1`` over a few hundred channels), the rest is dropped without an error, and
    the command would end with status 0 as if all of it had been read. There, standard output
    is replaced by the same file behind a buffered writer, which writes until everything is
    out or raises BrokenPipeError, and is flushed after every write.
    """
    stream = sys.stdout
    if isinstance(getattr(stream, "buffer", None), io.FileIO):
        sys.stdout = _WholeWrites(
            open(stream.fileno(), "wb", closefd=False),  # noqa: SIM115 (fd 1 stays open)
            encoding=stream.encoding,
            errors=stream.errors,
            write_through=True,
        )
    return sys.stdout


def exit_quietly_on_closed_pipe(run: Any, *args: Any) -> Any:
    """Call ``run(*args)``; if the reader of standard output went away (``fairqueue workers |
    head``), exit with :data:`CLOSED_PIPE_STATUS` and no traceback.

    Every management command of the product runs through this (their ``run_from_argv``),
    writing to :func:`whole_stdout`, so a long output meets the closed pipe too. Standard
    output is pointed at ``/dev/null`` first, so the interpreter's own flush at exit cannot
    raise the same error again.
    """
    import os

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

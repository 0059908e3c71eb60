"""What a failed attempt records, and when it is tried again (messages and work batches)."""

from __future__ import annotations

import random
import traceback
from typing import Any

from django_fairqueue import conf

#: Longest error message and traceback kept in ``last_error`` (characters). The traceback keeps
#: its end, where the exception was raised.
MAX_ERROR_MESSAGE = 8_000
MAX_TRACEBACK = 32_000

#: What the rescuer does with a message whose lease expired, as log lines tell it: an
#: at-least-once message with attempts left goes back to the queue, any other is dead-lettered.
RESCUED = "requeued, or failed (LeaseExpired) if at-most-once or out of attempts"


def retry_delay(attempt: int) -> float:
    """Seconds before retrying after failed attempt ``attempt`` (1-based).

    ``RETRY_BACKOFF_BASE * 2**(attempt - 1)``, capped at ``RETRY_BACKOFF_MAX``, then scaled by a
    random factor in [0.5, 1] so that messages failing together do not retry together.
    """
    cfg = conf.get()
    step = min(cfg.RETRY_BACKOFF_BASE * 2.0 ** min(attempt - 1, 60), cfg.RETRY_BACKOFF_MAX)
    return step * random.uniform(0.5, 1.0)


def qualified_name(cls: type) -> str:
    """A class's name as errors show it: ``module.QualName``, builtins by their name alone."""
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


#: Marks where :func:`storable` cut a text (counted within its limit).
CUT = "[...]"


def storable(text: str, limit: int, *, keep_end: bool = False) -> str:
    """Text jsonb accepts (no NUL, no lone surrogates), at most ``limit`` characters, the
    marker of a cut included."""
    text = text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > limit:
        kept = limit - len(CUT)
        text = CUT + text[-kept:] if keep_end else text[:kept] + CUT
    return text


def describe(exc: BaseException) -> str:
    """``str(exc)``, never failing: a task's exception class may define a ``__str__`` that
    raises, and the attempt must still be recorded (and retried) as the task's failure. When
    ``str()`` fails: the exception's ``repr()``, else its class name, noting that it failed."""
    try:
        return str(exc)
    except BaseException as failure:  # anything: this only describes, it must not fail
        why = qualified_name(type(failure))
    try:
        text = repr(exc)
    except BaseException:
        text = qualified_name(type(exc))
    return f"{text} (str() of the exception failed: {why})"


def error_info(
    exc: BaseException, *, attempt: int, worker_id: str, with_traceback: bool = True
) -> dict[str, Any]:
    """The ``last_error`` of a failed attempt (never raises for an odd exception)."""
    # (format_exception already survives a failing __str__: it writes "<exception str()
    # failed>" in the traceback's last line)
    tb = "".join(traceback.format_exception(exc)) if with_traceback else None
    return {
        "type": qualified_name(type(exc)),
        "message": storable(describe(exc), MAX_ERROR_MESSAGE),
        "traceback": storable(tb, MAX_TRACEBACK, keep_end=True) if tb is not None else None,
        "attempt": attempt,
        "worker": worker_id,
    }

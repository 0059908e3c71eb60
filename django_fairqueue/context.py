"""What the worker is running right now, for code that needs it (the django.tasks backend).

The worker sets :data:`current_message` around each handler call; it is ``None`` elsewhere.
A context variable, so each worker thread sees its own message.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from django_fairqueue.store import ClaimedMessage

current_message: ContextVar[ClaimedMessage | None] = ContextVar(
    "fairqueue_current_message", default=None
)

#: Set by the worker around a call under a time limit: tells whether the limit has passed (the
#: attempt was then settled as timed out, and whatever the call returns will be discarded).
time_limit_passed: ContextVar[Callable[[], bool] | None] = ContextVar(
    "fairqueue_time_limit_passed", default=None
)


def timed_out() -> bool:
    """Whether the running attempt has passed its time limit (False outside a worker, or for a
    task without one). A long task may check it to stop early: its outcome is discarded."""
    passed = time_limit_passed.get()
    return passed is not None and passed()

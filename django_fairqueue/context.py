"""What the worker is running right now, for code that needs it (the django.tasks backend).

The worker sets :data:`current_message` around each handler call; it is ``None`` elsewhere.
A context variable, so each worker thread sees its own message.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from django_fairqueue.db.message_store import ClaimedMessage

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


#: Set by the worker around each call it runs in a handler thread: tells whether an abort of
#: the running message was requested (the worker's heartbeat reads the request).
abort_flag: ContextVar[Callable[[], bool] | None] = ContextVar("fairqueue_abort_flag", default=None)


def abort_requested() -> bool:
    """Whether an abort of the running message was requested (``django_fairqueue.abort()``,
    the admin, ``manage.py fairqueue abort``). False outside a worker.

    A long task checks it now and then and stops when it is True: return, or raise
    :class:`~django_fairqueue.exceptions.TaskAborted` (:func:`raise_if_abort_requested`). The
    attempt then ends ``aborted`` whatever it returns, and is not retried. A task that does not
    stop within ``FAIRQUEUE['ABORT_GRACE']`` seconds is settled as aborted at that point and
    its thread abandoned, as at a time limit. The worker learns of a request at its next
    heartbeat (every ``LEASE_SECONDS / 3``).
    """
    flag = abort_flag.get()
    return flag is not None and flag()


def raise_if_abort_requested() -> None:
    """Raise :class:`~django_fairqueue.exceptions.TaskAborted` if :func:`abort_requested`."""
    if abort_requested():
        from django_fairqueue.exceptions import TaskAborted

        message = current_message.get()
        raise TaskAborted(f"abort of message {message.id if message else '?'} requested")


def operator_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` may be the operator's Ctrl-C rather than the task's own exception: a
    KeyboardInterrupt in the main thread while SIGINT has Python's default handler (the only
    place Python raises it for a signal). A handler thread's, or one raised while a worker's
    own signal handlers are installed, is the task's."""
    return (
        isinstance(exc, KeyboardInterrupt)
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )

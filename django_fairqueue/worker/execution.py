"""Running one message's task: arguments, signals, log fields, the connections it leaves, and
the outcomes an attempt ends with."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from types import FrameType
from typing import Any

from asgiref.sync import SyncToAsync, async_to_sync
from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections, connections, transaction
from django.db.backends.signals import connection_created

from django_fairqueue.cli.terminal import printable
from django_fairqueue.db.message_store import ClaimedMessage
from django_fairqueue.exceptions import PayloadError, TaskAborted
from django_fairqueue.models import Message
from django_fairqueue.runtime import dbfaults
from django_fairqueue.runtime.attempts import RESCUED, error_info, retry_delay
from django_fairqueue.signals import message_finished
from django_fairqueue.tasks.spec import TaskSpec
from django_fairqueue.worker.config import Outcome

logger = logging.getLogger("django_fairqueue.worker")
#: One line per cause of unavailability every few seconds, however many tasks it cut short.
_given_back = dbfaults.RateLimitedWarnings(logger)


def decode_payload(payload: Any) -> tuple[list[Any], dict[str, Any]]:
    """The call arguments of a message; :class:`PayloadError` if the payload is not usable."""
    if not isinstance(payload, dict):
        raise PayloadError(
            "payload must be a JSON object with 'args' (a list) and 'kwargs' (an object), "
            f"got {type(payload).__name__}"
        )
    args, kwargs = payload.get("args"), payload.get("kwargs")
    if not isinstance(args, list):
        raise PayloadError(f"payload 'args' must be a list, got {type(args).__name__}")
    if not isinstance(kwargs, dict):
        raise PayloadError(f"payload 'kwargs' must be an object, got {type(kwargs).__name__}")
    return args, kwargs


@functools.cache
def is_async(func: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(func)


def call_task(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a task's function; what it returns, a coroutine run to completion first.

    The returned value decides, not the function: an ``async def`` behind a decorator that is
    not async-aware (a plain ``functools.wraps`` wrapper) looks synchronous, and its coroutine,
    left unawaited, would never run while the attempt counted as a success.
    """
    result = func(*args, **kwargs)
    if inspect.iscoroutine(result) or is_async(func):
        return run_coroutine(result)
    return result


#: The coroutine each thread waits for in run_coroutine(), by thread id (for stack_of()).
_awaiting: dict[int, Awaitable[Any]] = {}


def run_coroutine(awaitable: Awaitable[Any]) -> Any:
    """Run ``awaitable`` to completion from this synchronous thread, as ``async_to_sync``
    does (its thread-sensitive ``sync_to_async`` calls, the ORM's, run in this thread, on this
    thread's connections), but on an event loop in a daemon thread.

    Left to itself, ``async_to_sync`` runs the loop in a ``ThreadPoolExecutor`` thread, which
    the interpreter waits for at exit: a worker that leaves a coroutine behind (a stop's grace
    period over, a recycle for a stuck thread) would not exit while it runs, and the message it
    handed back would run twice at once. Given a running loop as the thread's "main" loop
    (what a ``sync_to_async`` thread has), ``async_to_sync`` runs the coroutine there instead.
    """
    loop, close = _loop_in_daemon_thread()
    local = SyncToAsync.threadlocal
    outer = (getattr(local, "main_event_loop", None), getattr(local, "main_event_loop_pid", None))
    local.main_event_loop, local.main_event_loop_pid = loop, os.getpid()
    ident = threading.get_ident()
    waited = _awaiting.get(ident)
    _awaiting[ident] = awaitable
    try:
        return async_to_sync(_await)(awaitable)
    finally:
        local.main_event_loop, local.main_event_loop_pid = outer
        if waited is None:
            del _awaiting[ident]
        else:
            _awaiting[ident] = waited
        close()


async def _await(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def _loop_in_daemon_thread() -> tuple[asyncio.AbstractEventLoop, Callable[[], None]]:
    """An event loop running in a new daemon thread, and the function that ends it as
    ``asyncio.run`` ends a loop (the tasks left cancelled) and waits for the thread."""
    started: concurrent.futures.Future[tuple[asyncio.AbstractEventLoop, asyncio.Event]]
    started = concurrent.futures.Future()

    async def serve() -> None:
        done = asyncio.Event()
        started.set_result((asyncio.get_running_loop(), done))
        await done.wait()

    thread = threading.Thread(
        target=asyncio.run, args=(serve(),), name="fairqueue-event-loop", daemon=True
    )
    thread.start()
    loop, done = started.result()

    def close() -> None:
        loop.call_soon_threadsafe(done.set)
        thread.join()

    return loop, close


def stack_of(thread: threading.Thread) -> str | None:
    """The stack of ``thread``, most recent call last (None once it has ended), to show where
    a task hangs. A thread waiting in run_coroutine() shows, in place of that wait, the frames
    of the coroutine it waits for: the task's own code, down to the ``await`` it is stuck in."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return None
    frames = [f for f, _ in traceback.walk_stack(frame)][::-1]  # outermost first
    awaiting = _awaiting.get(thread.ident or -1)
    waits = [i for i, f in enumerate(frames) if f.f_code is run_coroutine.__code__]
    if awaiting is not None and waits:
        frames = frames[: waits[-1] + 1] + _coroutine_frames(awaiting)
    summary = traceback.StackSummary.extract((f, f.f_lineno) for f in frames)
    return "".join(summary.format())


def _coroutine_frames(awaitable: Any) -> list[FrameType]:
    """The frames of a suspended coroutine and of what it awaits, outermost first (following
    ``cr_await``, generator-based awaitables and awaited asyncio tasks)."""
    frames = []
    while awaitable is not None:
        if isinstance(awaitable, asyncio.Task):
            awaitable = awaitable.get_coro()
            continue
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "gi_frame", None)
        if frame is None:  # a future, or done
            break
        frames.append(frame)
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "gi_yieldfrom", None)
    return frames


def claim_observer() -> Callable[[float], None] | None:
    """``metrics.observe_claim`` when the prometheus extra is installed, else None."""
    try:
        from django_fairqueue import metrics
    except (ImportError, ImproperlyConfigured):
        return None
    return metrics.observe_claim


def send_robust(sig: Any, **kwargs: Any) -> None:
    """Send a django_fairqueue signal; a receiver's error is logged, never raised."""
    # `receivers` first: an empty list answers for the common case without has_listeners()
    # (about 2 us, twice per message)
    if not sig.receivers or not sig.has_listeners(Message):
        return
    for receiver, response in sig.send_robust(sender=Message, **kwargs):
        if isinstance(response, Exception):
            logger.error("signal receiver %r failed", receiver, exc_info=response)


def log_extra(message: ClaimedMessage, **more: Any) -> dict[str, Any]:
    return {
        "channel": message.channel,
        "task": message.task_name,
        "message_id": message.id,
        "attempt": message.attempts,
        "max_attempts": message.max_attempts,
        **more,
    }


class _ConnectionsMade(threading.local):
    #: False until the thread connects (a class default: reading it never raises, where a
    #: getattr() with a default raised and caught AttributeError once per message)
    any = False


_connections_made = _ConnectionsMade()


def _note_connection(sender: Any, connection: Any, **kwargs: Any) -> None:
    _connections_made.any = True


# Which threads have connected to a database (connection_created is sent in the thread that
# connects, pooled connections included): a handler thread checks this flag instead of
# walking every configured database after each message.
connection_created.connect(_note_connection, dispatch_uid="django_fairqueue.worker")


def connected_here() -> bool:
    """Whether the calling thread has ever opened a database connection."""
    return _connections_made.any


@contextlib.contextmanager
def savepoints() -> Iterator[None]:
    """A savepoint on every connection of this thread that is inside ``atomic()``."""
    with contextlib.ExitStack() as stack:
        for wrapper in connections.all(initialized_only=True):
            if wrapper.in_atomic_block:
                stack.enter_context(transaction.atomic(using=wrapper.alias))
        yield


def end_open_transactions(message: ClaimedMessage) -> None:
    """Roll back and drop any connection a task left inside a transaction.

    A task that enters ``atomic()`` without leaving it, or turns autocommit off, would leave its
    session idle in transaction (holding locks and the xmin horizon) until the thread's next
    message. Dropping the connection ends the transaction on the server.
    """
    for wrapper in connections.all(initialized_only=True):
        if wrapper.connection is None:
            continue
        if wrapper.in_atomic_block or not wrapper.get_autocommit():
            logger.error(
                "task %s (message %s) left a transaction open on database %r; rolled back",
                message.task_name,
                message.id,
                wrapper.alias,
            )
            # close() ends the session (or hands it back to the pool, which rolls it back);
            # a fresh wrapper then forgets the abandoned atomic() state.
            with contextlib.suppress(Exception):
                wrapper.close()
            del connections[wrapper.alias]


def close_stale_connections() -> None:
    try:
        close_old_connections()
    except Exception:  # closing a broken connection can fail; the next use reconnects
        logger.debug("closing an old connection failed", exc_info=True)


# -- outcomes ------------------------------------------------------------------------------------


def failed_outcome(
    message: ClaimedMessage,
    spec: TaskSpec,
    exc: BaseException,
    started: float,
    *,
    retry: bool,
    worker_id: str,
) -> Outcome:
    """A failed attempt: retried with backoff while attempts remain (never an
    ``at_most_once`` task's), else failed for good."""
    error = error_info(exc, attempt=message.attempts, worker_id=worker_id)
    at_most_once = spec.effective_delivery == "at_most_once"
    cause = dbfaults.unavailable(exc)
    # Not the task's fault: given back, the attempt not counted; but never an at-most-once
    # task's, which may have done its work before the database went away (it would run twice).
    if cause is not None and not at_most_once:
        return Outcome(
            message,
            "released",
            error={**error, "unavailable": cause},
            retry_in=dbfaults.give_back_delay(),
            duration=time.monotonic() - started,
        )
    # at_most_once messages have max_attempts 1; the check also covers a task switched to
    # at_most_once after its messages were enqueued.
    if retry and message.attempts < message.max_attempts and not at_most_once:
        return Outcome(
            message,
            "retry",
            error=error,
            retry_in=timedelta(seconds=retry_delay(message.attempts)),
            duration=time.monotonic() - started,
        )
    return Outcome(message, "failed", error=error, duration=time.monotonic() - started)


def aborted_outcome(
    message: ClaimedMessage, how: str, duration: float, *, worker_id: str
) -> Outcome:
    """The outcome of an attempt whose abort was requested."""
    exc = TaskAborted(f"message {message.id} aborted on request, {how}")
    return Outcome(
        message,
        "aborted",
        error=error_info(exc, attempt=message.attempts, worker_id=worker_id, with_traceback=False),
        duration=duration,
    )


def finished(outcome: Outcome, *, worker_id: str, lease_expired: bool = False) -> None:
    """Log an attempt's end and send ``message_finished``. ``lease_expired``: the lease had
    expired by the worker's clock when the attempt ended (its outcome may not be recorded)."""
    _log_finish(outcome, lease_expired)
    send_robust(
        message_finished,
        message=outcome.message,
        worker_id=worker_id,
        outcome=outcome.kind,
        duration=outcome.duration,
        error=outcome.error,
    )


def _log_finish(outcome: Outcome, lease_expired: bool = False) -> None:
    message = outcome.message
    level = logging.INFO if outcome.kind == "succeeded" and not lease_expired else logging.WARNING
    if not logger.isEnabledFor(level):
        return
    if outcome.kind == "released":  # given back: the database was unavailable
        error = outcome.error or {}
        _given_back.warning(
            str(error.get("unavailable")),
            "gave back %s message %s channel %r without using an attempt: the database is "
            "unavailable (%s: %s)",
            message.task_name,
            message.id,
            message.channel,
            error.get("type"),
            printable(error.get("message")),
            extra=log_extra(message, duration=outcome.duration, outcome="released"),
        )
        return
    if outcome.kind == "succeeded":
        what = "succeeded"
    elif outcome.kind == "aborted":
        what = "aborted"
    else:
        error = outcome.error or {}
        # a task's error text is the tenant's: escaped here, not only by the commands' own
        # formatter, so that a project's handler cannot be made to print a forged line
        cause = printable(f"{error.get('type')}: {error.get('message')}")
        if outcome.kind == "retry" and outcome.retry_in is not None:
            what = f"failed ({cause}); retry in {outcome.retry_in.total_seconds():.1f}s"
        else:
            what = f"failed for good ({cause})"
    # Its worker was held up past the lease (frozen, or a task held the GIL): the rescuer may
    # have settled the message otherwise already, which this line must not contradict.
    late = (
        ", after its lease had expired: recorded only if the lease still held, else the "
        f"rescuer took the message back ({RESCUED})"
        if lease_expired
        else ""
    )
    logger.log(
        level,
        "%s %s message %s channel %r attempt %s/%s in %.3fs%s",
        what,
        message.task_name,
        message.id,
        message.channel,
        message.attempts,
        message.max_attempts,
        outcome.duration,
        late,
        extra=log_extra(message, duration=outcome.duration, outcome=outcome.kind),
    )

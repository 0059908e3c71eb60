"""``@task``: register a function as a task, and the task objects it returns.

The registry and task specifications live in :mod:`django_fairqueue.tasks.spec` (re-exported
here). A task object's ``enqueue()`` calls :func:`django_fairqueue.api.enqueue`; the API itself
knows task objects only by their ``spec`` (it imports nothing from this module).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from datetime import datetime, timedelta
from typing import Any, Generic, ParamSpec, TypeVar, overload

from django_fairqueue import conf
from django_fairqueue.tasks.spec import (
    Registry,
    TaskSpec,
    check_arguments,
    check_result,
    qualname,
    registry,
    result_not_storable,
)

P = ParamSpec("P")
R = TypeVar("R")

__all__ = [
    "BoundTask",
    "FairTask",
    "Registry",
    "TaskSpec",
    "check_result",
    "registry",
    "result_not_storable",
    "task",
]


class FairTask(Generic[P, R]):
    """A registered task: call it to run it here and now, ``.enqueue()`` to queue it."""

    def __init__(self, spec: TaskSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.__wrapped__ = spec.func
        self.__doc__ = spec.func.__doc__

    # `self, /` here and in enqueue(): the task's own parameters may be named self or task.
    def __call__(self, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.spec.func(*args, **kwargs)  # type: ignore[no-any-return]

    def enqueue(self, /, *args: Any, **kwargs: Any) -> int:
        """Queue a call; ``channel=``, ``run_after=``, ``priority=``, ``unique_key=``,
        ``unique_scope=`` and ``on_conflict=`` are queue options."""
        from django_fairqueue.api import enqueue

        return enqueue(self, *args, **kwargs)

    def using(
        self,
        *,
        channel: str | None = None,
        run_after: datetime | timedelta | None = None,
        priority: int | None = None,
        unique_key: str | None = None,
        unique_scope: str | None = None,
        on_conflict: str | None = None,
        queue: str | None = None,
    ) -> BoundTask:
        """Fix queue options (also for calls whose own arguments share their names)."""
        return BoundTask(
            self,
            channel=channel,
            run_after=run_after,
            priority=priority,
            unique_key=unique_key,
            unique_scope=unique_scope,
            on_conflict=on_conflict,
            queue=queue,
        )

    def __repr__(self) -> str:
        return f"<FairTask {self.name}>"


@dataclass(frozen=True)
class BoundTask:
    """A task with queue options fixed (``FairTask.using()``)."""

    task: FairTask[Any, Any]
    channel: str | None = None
    run_after: datetime | timedelta | None = None
    priority: int | None = None
    unique_key: str | None = None
    unique_scope: str | None = None
    on_conflict: str | None = None
    queue: str | None = None

    def using(self, **options: Any) -> BoundTask:
        """These options fixed too, on top of those fixed already (``.using(a=1).using(b=2)``),
        as Django's ``Task.using()`` chains: an option given again replaces its value, and one
        given as None keeps it."""
        unknown = sorted(options.keys() - _QUEUE_OPTIONS)
        if unknown:
            raise TypeError(
                f"using() takes the queue options {', '.join(sorted(_QUEUE_OPTIONS))}; "
                f"got {', '.join(unknown)}"
            )
        return replace(self, **{k: v for k, v in options.items() if v is not None})

    def enqueue(self, /, *args: Any, **kwargs: Any) -> int:
        from django_fairqueue.api import EnqueueRequest, enqueue_many

        request = EnqueueRequest(
            self.task,
            args,
            kwargs,
            channel=self.channel,
            run_after=self.run_after,
            priority=self.priority,
            unique_key=self.unique_key,
            unique_scope=self.unique_scope,
            on_conflict=self.on_conflict,
            queue=self.queue,
        )
        options = sorted(kwargs.keys() & _QUEUE_OPTIONS)
        # task.using(...).enqueue(channel=...): after using(), every keyword is the task's own
        if options:
            try:
                check_arguments(self.task.spec, list(args), kwargs)
            except TypeError as exc:
                raise TypeError(
                    f"{exc} (after .using(), enqueue() passes every keyword to the task: give "
                    f"{', '.join(options)} to .using())"
                ) from None
        return enqueue_many([request])[0]


#: The options ``using()`` fixes, which ``FairTask.enqueue()`` also takes as keywords.
_QUEUE_OPTIONS = frozenset(f.name for f in fields(BoundTask)) - {"task"}


@overload
def task(func: Callable[P, R], /) -> FairTask[P, R]: ...


@overload
def task(
    *,
    name: str | None = None,
    delivery: str | None = None,
    max_attempts: int | None = None,
    keep_result: bool | None = None,
    priority: int = 0,
    channel: str | None = None,
    channel_from: Callable[..., str] | None = None,
    timeout: float | None = None,
    queue: str = "default",
) -> Callable[[Callable[P, R]], FairTask[P, R]]: ...


def task(
    func: Callable[P, R] | None = None,
    /,
    *,
    name: str | None = None,
    delivery: str | None = None,
    max_attempts: int | None = None,
    keep_result: bool | None = None,
    priority: int = 0,
    channel: str | None = None,
    channel_from: Callable[..., str] | None = None,
    timeout: float | None = None,
    queue: str = "default",
) -> FairTask[P, R] | Callable[[Callable[P, R]], FairTask[P, R]]:
    """Register a function as a task.

    ``name`` defaults to ``module.qualname``; ``delivery`` is ``"at_least_once"`` (default) or
    ``"at_most_once"``; ``channel`` or ``channel_from`` choose the channel when ``enqueue`` is not
    given one; ``timeout`` is the time limit of one attempt in seconds (default
    ``FAIRQUEUE['TASK_TIMEOUT']``, 0 for none): past it the worker fails the attempt with
    :class:`~django_fairqueue.exceptions.TaskTimeout` and retries it like any failure;
    ``queue`` is the queue its messages go to (workers started with ``--queues`` serve only
    theirs; see docs/howto/queues.md).
    """

    def wrap(f: Callable[P, R]) -> FairTask[P, R]:
        from django_fairqueue.api import check_priority, validate_channel_name

        # (an empty name is refused with the other bad names below, not replaced by the default)
        task_name = qualname(f) if name is None else name
        # the checks every enqueue of the task would make, made once here
        where = f"task {task_name!r}"
        try:
            check_priority(priority)
            if channel is not None:
                validate_channel_name(channel)
        except ValueError as exc:
            raise type(exc)(f"{where}: {exc}") from None
        if channel_from is not None and not callable(channel_from):
            raise TypeError(
                f"{where}: channel_from must be a callable taking the task's arguments, "
                f"got {type(channel_from).__name__}"
            )
        if keep_result is not None and not isinstance(keep_result, bool):
            raise TypeError(f"{where}: keep_result must be True, False or None")
        spec = TaskSpec(
            name=task_name,
            func=f,
            delivery=delivery,
            max_attempts=max_attempts,
            keep_result=keep_result,
            priority=priority,
            channel=channel,
            channel_from=channel_from,
            # seconds (a timedelta is accepted too); a bad value raises ValueError here
            timeout=conf.validate_timeout(timeout, f"task {task_name!r}: timeout"),
            queue=queue,
        )
        registry.register(spec)
        return FairTask(spec)

    return wrap(func) if func is not None else wrap

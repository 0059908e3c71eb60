"""Task registry.

A worker runs only functions registered here, looked up by name. A row never names code to
import: the task name is a key into this registry, which is filled by importing the modules the
project configures (each installed app's ``tasks`` module and ``FAIRQUEUE['TASK_MODULES']``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, ParamSpec, TypeVar, overload

from django_fairqueue import conf
from django_fairqueue.exceptions import ResultNotStorable, UnknownTask
from django_fairqueue.limits import TASK_NAME_MAX_LENGTH

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class TaskSpec:
    """How a registered task is run. ``None`` fields fall back to FAIRQUEUE settings."""

    name: str
    func: Callable[..., Any]
    delivery: str | None = None
    max_attempts: int | None = None
    keep_result: bool | None = None
    priority: int = 0
    channel: str | None = None
    # Derive the channel from the call's arguments, e.g. ``lambda doc_id, tenant: tenant``.
    channel_from: Callable[..., str] | None = None
    # Seconds an attempt may run (a worker fails it past that, TaskTimeout); None:
    # FAIRQUEUE['TASK_TIMEOUT']; 0: no limit whatever the setting says.
    timeout: float | None = None

    @property
    def effective_timeout(self) -> float | None:
        """The time limit of an attempt in seconds, or None for no limit."""
        if self.timeout is None:
            return conf.get().TASK_TIMEOUT
        return self.timeout or None

    @property
    def effective_delivery(self) -> str:
        return self.delivery or conf.get().DEFAULT_DELIVERY

    @property
    def effective_max_attempts(self) -> int:
        # at-most-once: one attempt, never redelivered (a lost lease dead-letters it)
        if self.effective_delivery == "at_most_once":
            return 1
        return self.max_attempts or conf.get().DEFAULT_MAX_ATTEMPTS

    @property
    def effective_keep_result(self) -> bool:
        if self.keep_result is None:
            return conf.get().KEEP_RESULTS
        return self.keep_result


def check_result(task_name: str, value: Any) -> None:
    """Raise :class:`ResultNotStorable` unless ``value`` can be stored as a message's result
    (jsonb): JSON without NaN or infinities, NUL characters or lone surrogates, not nested
    deeper than the encoder recurses."""
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
        if "\\u0000" in text:
            raise ValueError("it contains a NUL character")
        text.encode("utf-8")  # lone surrogates: UnicodeEncodeError (a ValueError)
    except (TypeError, ValueError, RecursionError) as exc:
        raise result_not_storable(task_name, value, exc) from exc


def result_not_storable(task_name: str, value: Any, exc: BaseException) -> ResultNotStorable:
    """The error of a return value that JSON cannot hold: the value's type, and why."""
    kind = type(value)
    name = kind.__qualname__ if kind.__module__ == "builtins" else str(kind)
    why = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
    return ResultNotStorable(
        f"the return value of {task_name} ({name}) cannot be stored as JSON: {why}; "
        "the task ran, and is not retried"
    )


class Registry:
    def __init__(self) -> None:
        self._specs: dict[str, TaskSpec] = {}
        self._lock = threading.Lock()
        self._discovered = False

    def register(self, spec: TaskSpec) -> None:
        _check_task_name(spec.name)
        if spec.delivery is not None and spec.delivery not in conf.DELIVERY_MODES:
            raise ValueError(
                f"task {spec.name!r}: delivery must be one of {conf.DELIVERY_MODES}, "
                f"got {spec.delivery!r}"
            )
        attempts: object = spec.max_attempts  # checked at run time: callers may pass anything
        if attempts is not None and (
            isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1
        ):
            raise ValueError(f"task {spec.name!r}: max_attempts must be an integer >= 1")
        conf.validate_timeout(spec.timeout, f"task {spec.name!r}: timeout")
        with self._lock:
            old = self._specs.get(spec.name)
            if (
                old is not None
                and old.func is not spec.func
                and _qualname(old.func) != _qualname(spec.func)
            ):
                raise ValueError(
                    f"task name {spec.name!r} is already registered for {_qualname(old.func)}"
                )
            self._specs[spec.name] = spec

    def get(self, name: str) -> TaskSpec:
        spec = self._specs.get(name)
        if spec is None and not self._discovered:
            self.autodiscover()
            spec = self._specs.get(name)
        if spec is None:
            raise UnknownTask(name)
        return spec

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def names(self) -> list[str]:
        return sorted(self._specs)

    def autodiscover(self) -> None:
        """Import every installed app's ``tasks`` module and FAIRQUEUE['TASK_MODULES']."""
        from importlib import import_module

        from django.utils.module_loading import autodiscover_modules

        autodiscover_modules("tasks")
        for module in conf.get().TASK_MODULES:
            import_module(module)
        self._discovered = True

    def unregister(self, name: str) -> None:
        with self._lock:
            self._specs.pop(name, None)


registry = Registry()


def _qualname(func: Callable[..., Any]) -> str:
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


def _check_task_name(name: Any) -> None:
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(
            f"task name must be a non-empty string without surrounding blanks: {name!r}"
        )
    if len(name) > TASK_NAME_MAX_LENGTH:
        raise ValueError(f"task name is longer than {TASK_NAME_MAX_LENGTH} characters")


class FairTask(Generic[P, R]):
    """A registered task: call it to run it here and now, ``.enqueue()`` to queue it."""

    def __init__(self, spec: TaskSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.__wrapped__ = spec.func
        self.__doc__ = spec.func.__doc__

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.spec.func(*args, **kwargs)  # type: ignore[no-any-return]

    def enqueue(self, *args: Any, **kwargs: Any) -> int:
        """Queue a call; ``channel=``, ``run_after=``, ``priority=`` are queue options."""
        from django_fairqueue.api import enqueue

        return enqueue(self, *args, **kwargs)

    def using(
        self,
        *,
        channel: str | None = None,
        run_after: datetime | None = None,
        priority: int | None = None,
    ) -> BoundTask:
        """Fix queue options for calls whose own arguments are named channel/priority/run_after."""
        return BoundTask(self, channel=channel, run_after=run_after, priority=priority)

    def __repr__(self) -> str:
        return f"<FairTask {self.name}>"


@dataclass(frozen=True)
class BoundTask:
    task: FairTask[Any, Any]
    channel: str | None = None
    run_after: datetime | None = None
    priority: int | None = None

    def enqueue(self, *args: Any, **kwargs: Any) -> int:
        from django_fairqueue.api import EnqueueRequest, enqueue_many

        request = EnqueueRequest(
            self.task,
            args,
            kwargs,
            channel=self.channel,
            run_after=self.run_after,
            priority=self.priority,
        )
        return enqueue_many([request])[0]


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
) -> FairTask[P, R] | Callable[[Callable[P, R]], FairTask[P, R]]:
    """Register a function as a task.

    ``name`` defaults to ``module.qualname``; ``delivery`` is ``"at_least_once"`` (default) or
    ``"at_most_once"``; ``channel`` or ``channel_from`` choose the channel when ``enqueue`` is not
    given one; ``timeout`` is the time limit of one attempt in seconds (default
    ``FAIRQUEUE['TASK_TIMEOUT']``, 0 for none): past it the worker fails the attempt with
    :class:`~django_fairqueue.exceptions.TaskTimeout` and retries it like any failure.
    """

    def wrap(f: Callable[P, R]) -> FairTask[P, R]:
        task_name = name or _qualname(f)
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
        )
        registry.register(spec)
        return FairTask(spec)

    return wrap(func) if func is not None else wrap

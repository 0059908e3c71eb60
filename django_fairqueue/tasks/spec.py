"""Task specifications and the registry workers look tasks up in, by name.

A worker runs only functions registered here. A row never names code to import: the task name
is a key into this registry, which is filled by importing the modules the project configures
(each installed app's ``tasks`` module and ``FAIRQUEUE['TASK_MODULES']``). The ``@task``
decorator and the task objects it returns are in :mod:`django_fairqueue.tasks`; this module
depends on neither them nor the enqueue API, so both can depend on it.
"""

from __future__ import annotations

import functools
import inspect
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django_fairqueue import conf
from django_fairqueue.db.jsontext import has_nul
from django_fairqueue.exceptions import InvalidQueue, ResultNotStorable, UnknownTask
from django_fairqueue.limits import TASK_NAME_MAX_LENGTH
from django_fairqueue.queues import validate_queue_name
from django_fairqueue.runtime.attempts import qualified_name

#: The most attempts a task may have: the messages' max_attempts column is a 32-bit integer.
MAX_ATTEMPTS_LIMIT = 2_147_483_647


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
    # The queue the task's messages go to (workers serve queues: runfairworker --queues).
    queue: str = "default"
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


#: What becomes of a message whose result cannot be stored, said by a worker's error.
NOT_RETRIED = "the task ran, and is not retried"


def check_result(task_name: str, value: Any, *, then: str = NOT_RETRIED) -> None:
    """Raise :class:`ResultNotStorable` unless ``value`` can be stored as a message's result
    (jsonb): JSON without NaN or infinities, NUL characters or lone surrogates, dict keys that
    are strings, not nested deeper than the encoder recurses. (Tuples are stored as lists.)
    ``then``: what becomes of the message, the error's last words."""
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
        if has_nul(text):
            raise ValueError("it contains a NUL character")
        text.encode("utf-8")  # lone surrogates: UnicodeEncodeError (a ValueError)
        # json.dumps writes a key 1 as "1", silently, and {1: .., "1": ..} keeps one of the
        # two: a result read back would not be the one returned. The walk runs only for a
        # value that did not come back equal (tuples, or such keys).
        if isinstance(value, (dict, list, tuple)) and json.loads(text) != value:
            keys = _non_string_keys(value)
            if keys:
                raise ValueError(f"it has a dict key that is not a string ({keys[0]!r})")
    except (TypeError, ValueError, RecursionError) as exc:
        raise result_not_storable(task_name, value, exc, then=then) from exc


def _non_string_keys(value: Any) -> list[Any]:
    """The first dict key in ``value`` (nested in dicts, lists and tuples) that is not a
    string, in a list; an empty list when every key is one."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, inner in item.items():
                if not isinstance(key, str):
                    return [key]
                stack.append(inner)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return []


def result_not_storable(
    task_name: str, value: Any, exc: BaseException, *, then: str = NOT_RETRIED
) -> ResultNotStorable:
    """The error of a return value that JSON cannot hold: the value's type, and why."""
    name = qualified_name(type(value))
    why = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
    return ResultNotStorable(
        f"the return value of {task_name} ({name}) cannot be stored as JSON: {why}; {then}"
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
            isinstance(attempts, bool)
            or not isinstance(attempts, int)
            or not 1 <= attempts <= MAX_ATTEMPTS_LIMIT
        ):
            raise ValueError(
                f"task {spec.name!r}: max_attempts must be an integer from 1 to "
                f"{MAX_ATTEMPTS_LIMIT}, got {attempts!r}"
            )
        conf.validate_timeout(spec.timeout, f"task {spec.name!r}: timeout")
        try:
            validate_queue_name(spec.queue)
        except InvalidQueue as exc:
            raise InvalidQueue(f"task {spec.name!r}: {exc}") from None
        with self._lock:
            old = self._specs.get(spec.name)
            if (
                old is not None
                and old.func is not spec.func
                and qualname(old.func) != qualname(spec.func)
            ):
                raise ValueError(
                    f"task name {spec.name!r} is already registered for {qualname(old.func)}"
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

    def at_most_once_names(self) -> list[str]:
        """The registered tasks delivered at most once (whose claims must commit durably)."""
        specs = list(self._specs.values())
        return sorted(s.name for s in specs if s.effective_delivery == "at_most_once")

    def import_task_modules(self) -> list[tuple[str, Exception]]:
        """Import each of FAIRQUEUE['TASK_MODULES'] and return those that failed, with why
        (a module that does not exist, or one whose import raised)."""
        from importlib import import_module

        failed: list[tuple[str, Exception]] = []
        # conf.values(): the system checks import them whatever the queue's database is
        for module in conf.values().TASK_MODULES:
            try:
                import_module(module)
            except Exception as exc:
                failed.append((module, exc))
        return failed

    def autodiscover(self) -> None:
        """Import every installed app's ``tasks`` module and FAIRQUEUE['TASK_MODULES']."""
        from importlib import import_module

        from django.utils.module_loading import autodiscover_modules

        autodiscover_modules("tasks")
        for module in conf.values().TASK_MODULES:
            import_module(module)
        self._discovered = True

    def unregister(self, name: str) -> None:
        with self._lock:
            self._specs.pop(name, None)


registry = Registry()


#: A function's plain parameters (see :func:`_parameters`): their names, how many of them
#: have no default, and each name's position.
Plain = tuple[tuple[str, ...], int, dict[str, int]]


@functools.cache
def _parameters(func: Callable[..., Any]) -> tuple[inspect.Signature | None, Plain | None]:
    """The signature to check arguments against, None when any arguments fit (it has none, as
    some builtins, or it is only ``*args, **kwargs``: binding would then check nothing); and
    its plain parameters when every one may be given by position or by name, as most tasks'
    are (those without a default come first), else None."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):  # some builtins have none: let the call itself check
        return None, None
    params = sig.parameters.values()
    kinds = {p.kind for p in params}
    if kinds == {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
        return None, None
    if kinds - {inspect.Parameter.POSITIONAL_OR_KEYWORD}:
        return sig, None
    names = tuple(p.name for p in params)
    required = sum(p.default is inspect.Parameter.empty for p in params)
    return sig, (names, required, {name: i for i, name in enumerate(names)})


def _fit(plain: Plain, args: list[Any], kwargs: dict[str, Any]) -> bool:
    """Whether arguments fit plain parameters: what ``Signature.bind`` decides for them, in a
    fraction of its time (it runs for every message enqueued and every message run)."""
    names, required, positions = plain
    given = len(args)
    if given > len(names):
        return False
    if not kwargs:
        return given >= required
    for key in kwargs:
        position = positions.get(key)
        if position is None or position < given:  # unknown, or given by position too
            return False
    # (a loop, not all(...): a generator costs more than the whole check of most calls)
    for i in range(given, required):  # noqa: SIM110
        if names[i] not in kwargs:
            return False
    return True


def check_arguments(spec: TaskSpec, args: list[Any], kwargs: dict[str, Any]) -> None:
    """Raise TypeError (without calling the task) if the arguments do not fit its signature."""
    sig, plain = _parameters(spec.func)
    if sig is None or (plain is not None and _fit(plain, args, kwargs)):
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"arguments do not fit {spec.name}{sig}: {exc}") from None


def qualname(func: Callable[..., Any]) -> str:
    """``module.qualname`` of a function: a task's default name."""
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


def _check_task_name(name: Any) -> None:
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(
            f"task name must be a non-empty string without surrounding blanks: {name!r}"
        )
    if len(name) > TASK_NAME_MAX_LENGTH:
        raise ValueError(f"task name is longer than {TASK_NAME_MAX_LENGTH} characters")
    if "\x00" in name:
        raise ValueError(f"task name must not contain NUL characters: {name!r}")
    if not name.isascii():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"task name is not valid Unicode: {name!r}") from None

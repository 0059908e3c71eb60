"""A backend for Django's tasks framework (``django.tasks``; the django-tasks backport on 5.2).

::

    TASKS = {
        "default": {
            "BACKEND": "django_fairqueue.backend.FairQueueBackend",
            "OPTIONS": {"CHANNEL_FROM": "myproject.tasks.tenant_channel"},  # all optional
        }
    }

Functions decorated with Django's ``@task`` enqueue as fairqueue messages and run on
``runfairworker``. How the pieces map (docs/howto/django-tasks.md has the reader's version):

* Registration. Django validates a task against its backend when the task is created (the
  decorator, ``.using()``). Validation registers it in fairqueue's registry under its
  ``module_path``, with a runner that calls the function (passing a ``TaskContext`` when it
  takes one). Workers import task modules by app autodiscovery and ``FAIRQUEUE['TASK_MODULES']``
  and run registered names only; no import path is ever read from a row.
* Enqueue is fairqueue's enqueue: SQL on Django's connection, so inside ``transaction.atomic()``
  it commits or rolls back with the caller's writes.
* Channel: ``task.using(channel=...)``, else ``OPTIONS['CHANNEL_FROM']``, else
  ``OPTIONS['DEFAULT_CHANNEL']``, else ``FAIRQUEUE['DEFAULT_CHANNEL']``: anything enqueue's
  ``channel=`` takes (a ``(group, channel)`` pair too), checked with the task's queue.
* Queue: the task's ``queue_name`` is its fairqueue queue (Django's ``"default"`` is the
  default queue): ``runfairworker --queues`` serves only the queues named.
* Results: every Django task keeps its row after success (``keep_result``), so ``get_result``
  works until the pruner removes it (``FAIRQUEUE['RESULT_RETENTION']``).
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import dataclasses
import importlib.util
import inspect
import logging
import sys
import traceback
import types
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast

from django.apps import apps
from django.core import checks
from django.utils import timezone
from django.utils.module_loading import import_string

from django_fairqueue import conf
from django_fairqueue.context import (
    abort_requested,
    current_message,
    operator_interrupt,
    timed_out,
)
from django_fairqueue.exceptions import InvalidChannel, PayloadError, TaskAborted, UnknownTask
from django_fairqueue.limits import MAX_LIMIT, integer
from django_fairqueue.observe import moments
from django_fairqueue.queues import validate_queue_name
from django_fairqueue.tasks.django_compat import (
    DEFAULT_TASK_QUEUE_NAME,
    BaseTaskBackend,
    InvalidTask,
    InvalidTaskBackend,
    Task,
    TaskContext,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    normalize_json,
    task_backends,
    task_enqueued,
    task_finished,
    task_started,
)
from django_fairqueue.tasks.spec import TaskSpec, check_result, registry, result_not_storable

if TYPE_CHECKING:
    from types import ModuleType

    from django_fairqueue.api import ChannelRef
    from django_fairqueue.db.message_store import ClaimedMessage
    from django_fairqueue.models import Message

    _TaskBase = Task[..., Any]

    #: ``OPTIONS['CHANNEL_FROM']``: ``(task, args, kwargs) -> channel`` (a name, a saved model
    #: instance, a ``(group, channel)`` pair), or ``None`` to fall through to the next rule.
    ChannelFrom = Callable[[Task[..., Any], Sequence[Any], Mapping[str, Any]], "ChannelRef | None"]
else:
    _TaskBase = Task

__all__ = ["OPTION_NAMES", "FairQueueBackend", "FairQueueTask"]

logger = logging.getLogger("django_fairqueue.backend")

P = ParamSpec("P")
R = TypeVar("R")

#: Keys accepted in ``TASKS[alias]['OPTIONS']``.
OPTION_NAMES = ("CHANNEL_FROM", "DEFAULT_CHANNEL", "DELIVERY", "MAX_ATTEMPTS", "TASK_TIMEOUT")

# Message state -> Django status. Django has no "scheduled" (a deferred task is READY) and no
# "cancelled" or "aborted": a task that will never run, or was stopped, is FAILED, and its
# errors say which (TaskCancelled, TaskAborted).
_STATUS = {
    "scheduled": TaskResultStatus.READY,
    "ready": TaskResultStatus.READY,
    "running": TaskResultStatus.RUNNING,
    "succeeded": TaskResultStatus.SUCCESSFUL,
    "failed": TaskResultStatus.FAILED,
    "cancelled": TaskResultStatus.FAILED,
    "aborted": TaskResultStatus.FAILED,
}
_STOPPED_ERRORS = {
    "cancelled": "django_fairqueue.exceptions.TaskCancelled",
    "aborted": "django_fairqueue.exceptions.TaskAborted",
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FairQueueTask(_TaskBase):
    """Django's ``Task`` plus the fairqueue channel it enqueues to.

    The backend's ``task_class``: Django's ``@task`` builds one for tasks on this backend, so
    ``my_task.using(channel="alice").enqueue(...)`` works. On Django 6.1 and the backport the
    decorator also accepts it (``@task(channel="reports")``); Django 6.0's decorator does not
    forward extra arguments, so there use ``.using(channel=...)``.

    ``timeout`` is the time limit of one attempt in seconds (``@task(timeout=30)``, where the
    decorator forwards it; 0: none), else ``OPTIONS['TASK_TIMEOUT']``, else
    ``FAIRQUEUE['TASK_TIMEOUT']``. It belongs to the task, not to a call: ``.using()`` does
    not change it.
    """

    #: as enqueue's ``channel=`` takes it (a ``(group, channel)`` pair is kept as a pair, so
    #: that enqueue creates the group); a result's task has the channel's name instead
    channel: ChannelRef | None = None
    timeout: float | None = None
    #: unique jobs (``django_fairqueue.enqueue``'s options of the same names)
    unique_key: str | None = None
    unique_scope: str | None = None
    on_conflict: str | None = None

    def using(
        self,
        *,
        channel: ChannelRef | None = None,
        unique_key: str | None = None,
        unique_scope: str | None = None,
        on_conflict: str | None = None,
        **changes: Any,
    ) -> FairQueueTask:
        """A copy with other defaults: Django's ``priority``, ``queue_name``, ``run_after``,
        ``backend``, and fairqueue's ``channel``, ``unique_key``, ``unique_scope`` and
        ``on_conflict``."""
        # Django's own using() for its options, so options a later Django adds keep working.
        # Task.using() copies with dataclasses.replace(), which keeps the class.
        task = self
        if changes and channel is not None:
            # Every copy is validated, and a channel is checked with the queue: change the
            # queue without the old channel, which might not fit the new queue.
            task = dataclasses.replace(self, channel=None)
        task = cast(FairQueueTask, Task.using(task, **changes)) if changes else task
        ours: dict[str, Any] = {
            name: value
            for name, value in (
                ("channel", channel),
                ("unique_key", unique_key),
                ("unique_scope", unique_scope),
                ("on_conflict", on_conflict),
            )
            if value is not None
        }
        if ours:
            task = dataclasses.replace(task, **ours)
        return task


class _TaskRunner:
    """What fairqueue's registry holds for a Django task: the worker calls it with the
    message's arguments, and it calls the task the way Django's own backends do."""

    def __init__(self, task: Task[..., Any]) -> None:
        self.task = task
        # The registry refuses a name already registered for another function, comparing
        # module and qualname: present the task function's, not this class's.
        self.__module__ = task.func.__module__
        self.__qualname__ = task.func.__qualname__
        self.__name__ = task.func.__name__
        self.__doc__ = task.func.__doc__
        # The worker checks a message's arguments against the handler's signature before it
        # calls it, and fails a message whose arguments cannot fit without retrying it. Show
        # it the task's parameters, less the context the runner passes itself.
        signature = inspect.signature(task.func)
        if task.takes_context:
            signature = signature.replace(parameters=list(signature.parameters.values())[1:])
        self.__signature__ = signature

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        message = current_message.get()
        task = self.task
        if message is None:
            # Called outside a worker (a test calling the registered function directly):
            # no message to report on, so no signals and no context.
            if task.takes_context:
                raise RuntimeError(
                    f"task {task.module_path} takes a context, which only a fairqueue worker "
                    "can provide (no message is running in this thread)"
                )
            return normalize_json(_call(task, *args, **kwargs))
        sender = type(task.get_backend())
        started = timezone.now()
        running = _result_from_message(task, message, args, kwargs, started)
        task_started.send(sender=sender, task_result=running)
        try:
            if task.takes_context:
                value = _call(task, TaskContext(task_result=running), *args, **kwargs)
            else:
                value = _call(task, *args, **kwargs)
            value = _normalized(task, value)
            if abort_requested():  # the attempt ends aborted, whatever the task returned
                raise TaskAborted(f"task {task.module_path}: abort requested")
        except BaseException as exc:
            # What the worker counts as a failed attempt (KeyboardInterrupt, GeneratorExit and
            # CancelledError too), but the operator's Ctrl-C, which stops it instead.
            if operator_interrupt(exc):
                raise
            failed = _replace_result(
                running,
                status=TaskResultStatus.FAILED,
                finished_at=timezone.now(),
                errors=[_task_error(exc)],
            )
            # Sent inside the except block, so receivers (Django logs it) see the exception.
            if not timed_out():  # else the worker discards this outcome: no signal for it
                _send_finished(sender, failed)
            raise
        if timed_out():  # past its time limit: the worker settled the attempt as failed
            return value
        done = _replace_result(
            running,
            status=TaskResultStatus.SUCCESSFUL,
            finished_at=timezone.now(),
            return_value=value,
        )
        _send_finished(sender, done)
        return value

    def __repr__(self) -> str:
        return f"<django.tasks runner for {self.task.module_path}>"


def _call(task: Task[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``Task.call()`` as the worker calls a native task: a coroutine the function returns
    runs to completion on a daemon thread's loop (Django's ``async_to_sync`` would hold up the
    process's exit), and so does one returned by a plain wrapper of an ``async def``."""
    from django_fairqueue.worker.execution import call_task  # (it needs the models loaded)

    return call_task(task.func, *args, **kwargs)


def _normalized(task: Task[..., Any], value: Any) -> Any:
    """The return value as Django's contract has it: JSON, normalised (tuples become lists).

    A value that is not JSON, or that jsonb cannot store (NaN, a NUL character), raises
    :class:`ResultNotStorable`: the attempt fails and is not retried, since the task ran (as
    Django's own backends fail a task whose return value is not JSON, after its one run).
    """
    try:
        value = normalize_json(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise result_not_storable(task.module_path, value, exc) from exc
    check_result(task.module_path, value)
    return value


def _send_finished(sender: type[Any], result: TaskResult[..., Any]) -> None:
    # The outcome is decided by now: a failing receiver must not turn a success into a retry
    # (the task would run twice), so it is logged rather than raised.
    for receiver, response in task_finished.send_robust(sender=sender, task_result=result):
        if isinstance(response, Exception):
            logger.error(
                "task_finished receiver %r failed for task result %s",
                receiver,
                result.id,
                exc_info=response,
            )


def _exception_path(recorded: Any) -> str:
    """Django's ``exception_class_path`` for the error type a message recorded.

    The worker records built-in exceptions without their module (``"ValueError"``); Django
    imports the path, so those get ``builtins.`` back. Other names (``"LeaseExpired"``, from
    the rescuer) are kept as recorded.
    """
    kind = str(recorded or "")
    if "." not in kind and isinstance(getattr(builtins, kind, None), type):
        return f"builtins.{kind}"
    return kind


def _task_error(exc: BaseException) -> TaskError:
    kind = type(exc)
    return TaskError(
        exception_class_path=f"{kind.__module__}.{kind.__qualname__}",
        traceback="".join(traceback.format_exception(exc)),
    )


class FairQueueBackend(BaseTaskBackend):
    """Runs Django tasks on django-fairqueue: fair across channels, transactional enqueue."""

    task_class = FairQueueTask

    supports_defer = True  # run_after becomes the message's run_at
    # The runner runs a coroutine function to completion from the worker thread, its
    # thread-sensitive sync_to_async calls on that thread, as Task.call() would.
    supports_async_task = True
    supports_get_result = True  # rows are kept after success until pruned
    supports_priority = True  # -100..100, higher first within a channel, as fairqueue's own

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.default_channel: str | None = None
        self._channel_from_path: str | None = None
        # Imported on first use, not here: the backend is built while a tasks module is being
        # imported (by its @task decorators), and the callable may live in that very module.
        self._channel_from: ChannelFrom | None = None
        self.delivery: str | None = None
        self.max_attempts: int | None = None
        self.task_timeout: float | None = None
        #: What is wrong with OPTIONS, if anything. Not raised here: Django's `check` builds
        #: every backend to ask for its checks, and a raise would end it in a traceback instead
        #: of a report. check() reports it (fairqueue.E103); enqueue and get_result raise it.
        self.options_error: str | None = None
        try:
            self._read_options()
        except InvalidTaskBackend as exc:
            self.options_error = str(exc)

    def _read_options(self) -> None:
        where = f"TASKS[{self.alias!r}]['OPTIONS']"
        options = self.options
        if not isinstance(options, dict):
            raise InvalidTaskBackend(f"{where} must be a dict")
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise InvalidTaskBackend(
                f"{where} has unknown keys {unknown}; known keys: {list(OPTION_NAMES)}"
            )
        if options.get("DEFAULT_CHANNEL") is not None and _app_installed():
            try:
                self.default_channel = _api().validate_channel_name(options["DEFAULT_CHANNEL"])
                # it must fit each queue its tasks may name (QUEUES empty: any, so the
                # default queue; a longer queue's enqueue says then what is too long)
                for queue in sorted(self.queues) or [DEFAULT_TASK_QUEUE_NAME]:
                    _check_channel(self.default_channel, queue)
            except InvalidChannel as exc:
                raise InvalidTaskBackend(f"{where}['DEFAULT_CHANNEL']: {exc}") from exc
        channel_from = options.get("CHANNEL_FROM")
        if channel_from is not None and not isinstance(channel_from, str):
            raise InvalidTaskBackend(
                f"{where}['CHANNEL_FROM'] must be the dotted path of a callable "
                f"(task, args, kwargs) -> channel, got {channel_from!r}"
            )
        self._channel_from_path = channel_from
        delivery = options.get("DELIVERY")
        if delivery is not None and delivery not in conf.DELIVERY_MODES:
            raise InvalidTaskBackend(
                f"{where}['DELIVERY'] must be one of {conf.DELIVERY_MODES}, got {delivery!r}"
            )
        self.delivery = delivery
        attempts = options.get("MAX_ATTEMPTS")
        if attempts is not None:
            try:
                integer(attempts, f"{where}['MAX_ATTEMPTS']", minimum=1, maximum=MAX_LIMIT)
            except (TypeError, ValueError) as exc:
                raise InvalidTaskBackend(str(exc)) from exc
        self.max_attempts = attempts
        try:
            self.task_timeout = conf.validate_timeout(
                options.get("TASK_TIMEOUT"), f"{where}['TASK_TIMEOUT']"
            )
        except ValueError as exc:
            raise InvalidTaskBackend(str(exc)) from exc

    def _require_options(self) -> None:
        """Raise what is wrong with OPTIONS, in the words check() reports it."""
        if self.options_error is not None:
            raise InvalidTaskBackend(self.options_error)

    # -- Django's backend API ------------------------------------------------------------------

    def validate_task(self, task: Task[..., Any]) -> None:
        # Django's range check takes True for 1; the queue refuses a bool priority at enqueue.
        if isinstance(task.priority, bool):
            raise InvalidTask(f"priority must be an integer, got {task.priority!r}")
        super().validate_task(task)
        try:
            conf.validate_timeout(
                getattr(task, "timeout", None), f"task {task.module_path}: timeout"
            )
        except ValueError as exc:
            raise InvalidTask(str(exc)) from exc
        channel = getattr(task, "channel", None)
        try:
            if channel is not None and _app_installed():
                _check_channel(channel, task.queue_name)
            validate_queue_name(task.queue_name)
        except InvalidChannel as exc:  # (InvalidQueue is one)
            raise InvalidTask(str(exc)) from exc
        self._refuse_moved(task)
        # With bad OPTIONS the task is declared (its module imports, so `check`, which may
        # import it through the URLconf, gets to report them) but not registered: nothing runs
        # it with options other than those written, and its enqueue raises.
        if self.options_error is None:
            self._register(task)

    def enqueue(
        self, task: Task[P, R], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> TaskResult[P, R]:
        """Queue one call; part of the caller's transaction, visible to workers at commit."""
        self._require_options()
        api = _api()
        self.validate_task(task)
        spec = registry.get(task.module_path)
        # As Django's TaskResult has them: JSON, tuples made lists (a call that works on
        # Django's own backends works here).
        try:
            args = cast(list[Any], normalize_json(args))
            kwargs = cast(dict[str, Any], normalize_json(kwargs))
        except (TypeError, ValueError) as exc:
            raise PayloadError(f"arguments of task {task.module_path} are not JSON: {exc}") from exc
        except RecursionError as exc:  # (a self-containing argument recurses until this, too)
            raise PayloadError(
                f"arguments of task {task.module_path} are nested too deeply"
            ) from exc
        channel = self.channel_for(task, args, kwargs)
        request = api.EnqueueRequest(
            spec,
            args,
            kwargs,
            channel=channel,
            run_after=task.run_after,
            # Django takes any whole number (5.0, Decimal("5")); the queue stores an integer
            priority=int(task.priority),
            unique_key=getattr(task, "unique_key", None),
            unique_scope=getattr(task, "unique_scope", None),
            on_conflict=getattr(task, "on_conflict", None),
            queue=task.queue_name,
        )
        (message_id,) = api.enqueue_many([request])
        result = _make_result(
            # the task as queued: whichever rule placed the call, its channel is the one used
            _bound_task(
                task,
                backend=task.backend,
                priority=request.priority,  # as stored: 5.0 is 5, as get_result has it
                channel=api.validate_channel_name(channel),  # its name, as get_result has it
                queue_name=task.queue_name,
                run_after=task.run_after,
            ),
            id=str(message_id),
            status=TaskResultStatus.READY,
            # The row's enqueued_at is the database clock a moment earlier; get_result has it.
            enqueued_at=timezone.now(),
            args=args,
            kwargs=kwargs,
            backend=self.alias,
        )
        if request.unique_key is not None:
            # The id may name the message that already held the key (kept, or running under
            # "replace"), not this call: describe the message it names, as get_result does.
            # (Unless that is no django.tasks task registered here, or gone since: then the
            # call's own description is all there is.)
            with contextlib.suppress(TaskResultDoesNotExist):
                result = cast("TaskResult[P, R]", self.get_result(result.id))
        # Sent now, like every backend: if the surrounding transaction rolls back, the result
        # id names a message that never existed (get_result raises TaskResultDoesNotExist).
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult[..., Any]:
        """The task result of message ``result_id``, from its row (one query)."""
        self._require_options()
        _require_app()
        from django_fairqueue.models import Message

        try:
            pk = int(result_id)
        except (TypeError, ValueError):
            raise TaskResultDoesNotExist(result_id) from None
        row = (
            Message.objects.using(conf.get().DATABASE)
            .select_related("channel")
            .filter(pk=pk)
            .first()
        )
        if row is None:
            raise TaskResultDoesNotExist(result_id)
        return self.result_from_row(row)

    def check(self, **kwargs: Any) -> list[Any]:
        errors: list[Any] = list(super().check(**kwargs))
        if not apps.is_installed("django_fairqueue"):
            errors.append(
                checks.Error(
                    f"Task backend {self.alias!r} is FairQueueBackend, but django_fairqueue is "
                    "not in INSTALLED_APPS.",
                    hint="Add 'django_fairqueue' to INSTALLED_APPS and run migrate.",
                    id="fairqueue.E101",
                )
            )
        if self.options_error is not None:
            errors.append(checks.Error(self.options_error, id="fairqueue.E103"))
        elif self._channel_from_path is not None:
            try:
                self._load_channel_from()
            except InvalidTaskBackend as exc:
                errors.append(checks.Error(str(exc), id="fairqueue.E102"))
        return errors

    # -- fairqueue specifics -------------------------------------------------------------------

    def channel_for(
        self, task: Task[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> ChannelRef:
        """The channel a call of ``task`` goes to (the first rule that gives one wins), as
        enqueue's ``channel=`` takes it: a ``(group, channel)`` pair stays a pair, so that
        enqueue creates the group. What ``CHANNEL_FROM`` returns is checked here (its fault is
        the call's: InvalidTask); a task's own channel was checked when the task was made, and
        the enqueue checks the one it is given."""
        self._require_options()
        channel = getattr(task, "channel", None)
        if channel is None and self._channel_from_path is not None:
            channel = self._load_channel_from()(task, args, kwargs)
            if channel is not None:
                # A bad name is the call's fault, as a bad .using(channel=...) is: InvalidTask.
                try:
                    _check_channel(channel, task.queue_name)
                except InvalidChannel as exc:
                    raise InvalidTask(
                        f"TASKS[{self.alias!r}]['OPTIONS']['CHANNEL_FROM'] "
                        f"({self._channel_from_path}) gave task {task.module_path} the channel "
                        f"{channel!r}: {exc}"
                    ) from exc
                return channel
        if channel is None:
            channel = self.default_channel or conf.get().DEFAULT_CHANNEL
        return cast("ChannelRef", channel)

    def result_from_row(self, row: Message) -> TaskResult[..., Any]:
        """Map a message row to Django's ``TaskResult``: the one place that does it.

        * status: scheduled/ready -> READY, running -> RUNNING, succeeded -> SUCCESSFUL (with
          the return value), failed/cancelled/aborted -> FAILED;
        * a cancelled or aborted message's ``errors`` name ``TaskCancelled`` or ``TaskAborted``
          (an aborted attempt's recorded error, or one without a traceback);
        * ``errors``: the last recorded error, if any (its type, and its traceback); earlier
          attempts' errors are not kept;
        * ``started_at`` and ``last_attempted_at``: when the latest attempt was claimed;
        * ``worker_ids``: fairqueue records the worker of the latest attempt only, so it is
          repeated once per attempt, keeping ``len(worker_ids) == attempts`` as Django defines.
        """
        runner = self._runner(row.task_name, row.pk)
        payload = row.payload if isinstance(row.payload, dict) else {}
        errors = []
        if isinstance(row.last_error, dict):
            errors.append(
                TaskError(
                    exception_class_path=_exception_path(row.last_error.get("type")),
                    traceback=str(
                        row.last_error.get("traceback") or row.last_error.get("message") or ""
                    ),
                )
            )
        state = str(row.state)
        stopped = _STOPPED_ERRORS.get(state)
        if stopped is not None and not any(e.exception_class_path == stopped for e in errors):
            errors.append(TaskError(exception_class_path=stopped, traceback=""))
        run_after = row.run_at if row.run_at > row.enqueued_at else None
        return _make_result(
            _bound_task(
                runner.task,
                backend=self.alias,
                priority=row.priority,
                channel=row.channel.short_name,
                queue_name=row.channel.queue,
                run_after=run_after if state in ("scheduled", "ready") else None,
            ),
            id=str(row.pk),
            status=_STATUS[state],
            enqueued_at=row.enqueued_at,
            started_at=row.claimed_at,
            last_attempted_at=row.claimed_at,
            finished_at=row.finished_at,
            args=payload.get("args", []),
            kwargs=payload.get("kwargs", {}),
            backend=self.alias,
            errors=errors,
            worker_ids=[row.worker_id] * row.attempts,
            return_value=row.result if state == "succeeded" else None,
        )

    def _refuse_moved(self, task: Task[..., Any]) -> None:
        """Refuse a task declared for another kind of backend and moved here with
        ``.using(backend=...)``: workers import the task modules, where it belongs to that
        backend, so none of them would know it, and the message would fail there for good."""
        if not (task.func.__module__ in sys.modules and task.func.__qualname__.isidentifier()):
            return  # (a nested function: not found by name in its module, as a worker would)
        declared = getattr(sys.modules[task.func.__module__], task.func.__qualname__, None)
        if not isinstance(declared, Task) or declared.func is not task.func:
            return  # being declared right now, or not found by that name
        try:
            if isinstance(declared.get_backend(), FairQueueBackend):
                return
        except InvalidTaskBackend:  # its alias is gone from TASKS: nothing to tell from it
            return
        raise InvalidTask(
            f"task {task.module_path} is declared for backend {declared.backend!r}, which is "
            "not a FairQueueBackend: fairqueue workers import it as that backend's and could "
            f"not run it. Declare it with @task(backend={self.alias!r}) instead."
        )

    def _runner(self, task_name: str, message_id: int) -> _TaskRunner:
        try:
            func = registry.get(task_name).func
        except UnknownTask:
            func = None
        if not isinstance(func, _TaskRunner):
            raise TaskResultDoesNotExist(
                f"message {message_id} runs {task_name!r}, which is not a django.tasks task "
                "registered in this process"
            )
        return func

    def _register(self, task: Task[..., Any]) -> None:
        name = task.module_path
        if name in registry:
            current = registry.get(name).func
            if isinstance(current, _TaskRunner) and current.task.func is task.func:
                return  # validated before (the decorator, an earlier .using())
        timeout = conf.validate_timeout(getattr(task, "timeout", None), f"task {name}: timeout")
        spec = TaskSpec(
            name=name,
            func=_TaskRunner(task),
            delivery=self.delivery,
            max_attempts=self.max_attempts,
            keep_result=True,
            timeout=timeout if timeout is not None else self.task_timeout,
        )
        try:
            registry.register(spec)
        except ValueError as exc:
            raise InvalidTask(str(exc)) from exc

    def _load_channel_from(self) -> ChannelFrom:
        if self._channel_from is None:
            path = self._channel_from_path
            where = f"TASKS[{self.alias!r}]['OPTIONS']['CHANNEL_FROM']"
            try:
                func = import_string(str(path))
            except ImportError as exc:
                # import_string() takes the last part for an attribute of its module: a
                # submodule the package does not import reads as a missing attribute.
                if _names_a_module(str(path)):
                    raise InvalidTaskBackend(_not_a_function(where, path)) from exc
                raise InvalidTaskBackend(f"{where} = {path!r} cannot be imported: {exc}") from exc
            if isinstance(func, types.ModuleType):
                raise InvalidTaskBackend(_not_a_function(where, path))
            if not callable(func):
                raise InvalidTaskBackend(f"{where} = {path!r} is not callable")
            self._channel_from = func
        return self._channel_from


def _names_a_module(path: str) -> bool:
    try:
        return importlib.util.find_spec(path) is not None
    except (ImportError, ValueError):  # (its package is missing; not a module name)
        return False


def _not_a_function(where: str, path: Any) -> str:
    return (
        f"{where} = {path!r} is a module, not a callable: give the dotted path of a "
        f"function (task, args, kwargs) -> channel in it ('{path}.<function>')"
    )


def _check_channel(channel: ChannelRef, queue: str) -> None:
    """``api.check_channel_in_queue`` (the api module is imported on first use)."""
    _api().check_channel_in_queue(channel, queue)


def _app_installed() -> bool:
    """Whether django_fairqueue is installed (while the app registry is still loading, as if
    it were: its ``INSTALLED_APPS`` cannot be asked yet)."""
    return not apps.apps_ready or apps.is_installed("django_fairqueue")


def _api() -> ModuleType:
    """``django_fairqueue.api``, imported on first use: it imports the queue's models, which
    only an installed app has. The backend itself loads without them, so that a project that
    configured it but forgot the app gets this error (and ``fairqueue.E101``), not a failing
    import of every tasks module."""
    _require_app()
    from django_fairqueue import api

    return api


def _require_app() -> None:
    if not _app_installed():
        raise InvalidTaskBackend(
            "FairQueueBackend needs django_fairqueue in INSTALLED_APPS (then run migrate)"
        )


# -- TaskResult construction -------------------------------------------------------------------


def _make_result(
    task: Task[P, R],
    *,
    id: str,
    status: TaskResultStatus,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    backend: str,
    enqueued_at: datetime | None = None,
    started_at: datetime | None = None,
    last_attempted_at: datetime | None = None,
    finished_at: datetime | None = None,
    errors: list[TaskError] | None = None,
    worker_ids: list[str] | None = None,
    return_value: Any = None,
) -> TaskResult[P, R]:
    result = TaskResult(
        task=task,
        id=id,
        status=status,
        enqueued_at=enqueued_at,
        started_at=started_at,
        last_attempted_at=last_attempted_at,
        finished_at=finished_at,
        args=list(args),
        kwargs=dict(kwargs),
        backend=backend,
        errors=errors or [],
        worker_ids=worker_ids or [],
    )
    object.__setattr__(result, "_return_value", return_value)
    return result


def _replace_result(result: TaskResult[P, R], **changes: Any) -> TaskResult[P, R]:
    fields = {
        name: getattr(result, name)
        for name in (
            "task",
            "id",
            "status",
            "enqueued_at",
            "started_at",
            "last_attempted_at",
            "finished_at",
            "args",
            "kwargs",
            "backend",
            "errors",
            "worker_ids",
        )
    }
    fields.update(changes)
    return _make_result(**fields)


def _result_from_message(
    task: Task[..., Any],
    message: ClaimedMessage,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    started: datetime,
) -> TaskResult[..., Any]:
    """The RUNNING result a worker's runner reports (signals, ``TaskContext``).

    Built from the claimed message, without a query: the row may already be gone (at-most-once
    delivery deletes it before the handler runs). The claim does not tell the handler which
    worker holds it, so ``worker_ids`` holds an empty string per attempt; ``attempts`` (and so
    ``TaskContext.attempt``) is exact.
    """
    return _make_result(
        _bound_task(
            task,
            backend=task.backend,
            priority=message.priority,
            channel=message.channel,
            queue_name=message.queue,
            run_after=None,
        ),
        id=str(message.id),
        status=TaskResultStatus.RUNNING,
        # as get_result reads it from the row: naive, like `started`, without USE_TZ
        enqueued_at=moments.as_django(message.enqueued_at),
        started_at=started,
        last_attempted_at=started,
        args=args,
        kwargs=kwargs,
        backend=task.backend,
        worker_ids=[""] * message.attempts,
    )


def _bound_task(
    task: Task[P, R],
    *,
    backend: str,
    priority: int,
    channel: str,
    queue_name: str,
    run_after: datetime | None,
) -> Task[P, R]:
    """``task`` as a message ran it: its backend, priority, run_after, queue (the queue the
    message was in, whatever the task declares) and (when it has the field) channel, the name
    within that queue. One copy at most, since every copy is validated again.

    A task moves freely between this backend's aliases, so its message may be in a queue that
    ``backend``'s QUEUES do not list: the copy then names an alias of this backend whose QUEUES
    do. With none (QUEUES changed since the enqueue), the copy is made without Django's
    validation, which would refuse the queue the message is in: a result says what was."""
    backend = _alias_for(queue_name, backend)
    changes: dict[str, Any] = {}
    if task.backend != backend:
        changes["backend"] = backend
    if task.queue_name != queue_name:
        changes["queue_name"] = queue_name
    if task.priority != priority or type(task.priority) is not int:  # 5.0 == 5, not the same
        changes["priority"] = priority
    if task.run_after != run_after:
        changes["run_after"] = run_after
    if isinstance(task, FairQueueTask) and task.channel != channel:
        changes["channel"] = channel
    if not changes:
        return task
    if not _admits(backend, queue_name):
        unchecked = copy.copy(task)
        for name, value in changes.items():
            object.__setattr__(unchecked, name, value)
        return unchecked
    return dataclasses.replace(task, **changes)


def _admits(alias: str, queue_name: str) -> bool:
    """Whether backend ``alias`` is this backend and its QUEUES take ``queue_name``."""
    backend = task_backends[alias]
    return isinstance(backend, FairQueueBackend) and (
        not backend.queues or queue_name in backend.queues
    )


def _alias_for(queue_name: str, preferred: str) -> str:
    """``preferred`` when it takes ``queue_name``, else the first alias of this backend that
    does; ``preferred`` again when none does."""
    if _admits(preferred, queue_name):
        return preferred
    return next((a for a in task_backends.settings if _admits(a, queue_name)), preferred)

"""What every service of a worker has: ``start`` (its loop in a thread of its own), ``stop``
and ``run_once`` (one pass in the calling thread: tests drive services this way, without
threads). A service's thread that fails stops the whole worker (``on_crash``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from django.db import connections

from django_fairqueue.runtime import StopFlag

logger = logging.getLogger("django_fairqueue.worker")

#: What a worker does when one of its threads fails: log it and stop gracefully.
CrashHandler = Callable[[str, BaseException], None]


def spawn(name: str, target: Callable[[], None], on_crash: CrashHandler) -> threading.Thread:
    """Run ``target`` in a daemon thread named ``fairqueue-<name>``; its database connections
    are closed when it ends, and an exception goes to ``on_crash``."""

    def guard() -> None:
        try:
            target()
        except BaseException as exc:
            on_crash(name, exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=guard, name=f"fairqueue-{name}", daemon=True)
    thread.start()
    return thread


class Service:
    """A loop in a thread of its own: :meth:`run` until :meth:`stop`."""

    name = "service"

    def __init__(self) -> None:
        self.stopping = StopFlag()
        self.thread: threading.Thread | None = None

    def start(self, on_crash: CrashHandler) -> None:
        self.thread = spawn(self.name, self.run, on_crash)

    def stop(self) -> None:
        self.stopping.set()

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def run(self) -> None:
        raise NotImplementedError

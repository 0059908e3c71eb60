"""The tasks the benchmark enqueues. They do nothing: fairbench measures the queue, not the work.

Worker processes started by the benchmark (``workerproc``) import this module themselves, so
these tasks need not be in ``FAIRQUEUE['TASK_MODULES']``.
"""

from __future__ import annotations

import time
from typing import Any

from django_fairqueue.tasks import task

NOOP_TASK_NAME = "fairbench.noop"
STAMP_TASK_NAME = "fairbench.stamp"


@task(name=NOOP_TASK_NAME, max_attempts=1)
def noop(*args: Any, **kwargs: Any) -> None:
    """Accept anything, do nothing."""


@task(name=STAMP_TASK_NAME, max_attempts=1, keep_result=True)
def stamp() -> float:
    """Return the wall-clock time the handler started (the pickup scenario reads it back)."""
    return time.time()

"""The worker: claim messages fairly, run their tasks on a thread pool, settle the outcomes.

``manage.py runfairworker`` is a thin shell around :class:`Worker`. One worker process runs
these threads, each with its own database connection (Django's connections are per thread):

* the **claimer** (the thread that calls :meth:`Worker.run`) claims up to the number of free
  handler slots plus ``prefetch`` (at most ``batch_size``) in one ``claim_messages`` call,
  whenever a slot is free and work may be waiting: after a full claim, on a LISTEN wake-up,
  when a retry or a rescued message is ready, when the worker is idle in burst mode, or when
  the jittered poll interval has passed;
* ``concurrency`` **handler** threads run the task functions (a connection only if the task
  uses the database);
* the **timer** fails an attempt that outlives its task's time limit (``TaskTimeout``), frees
  its slot and starts a handler thread in place of the stuck one (Python cannot stop a
  thread; its eventual outcome is discarded); past ``max_abandoned_threads`` stuck threads the
  worker stops claiming, finishes what runs and exits, for a fresh process to replace it;
* the **settler** writes outcomes in batches: every completion waiting in one
  ``complete_messages``, every failure in one ``fail_messages``;
* the **heartbeat** thread renews the lease of every claimed, unsettled message in one
  statement, three times per lease period, also while handlers are busy;
* the **maintenance** thread runs the rescuer, the pruner and the delta folder
  (:mod:`django_fairqueue.maintenance`);
* the **listener** holds a psycopg connection of its own (not Django's) that LISTENs for the
  enqueue wake-ups.

Every write after the claim presents the claim's lease token, so a worker that lost its lease
(stalled past it, or cut off from the database) changes nothing when it comes back.

Each part has a module of its own, each a mixin of :class:`Worker` over the shared state of
:class:`~django_fairqueue.worker.base.WorkerBase`: ``claimer``, ``handlers`` (the pool),
``timeouts`` (time limits), ``settler``, ``heartbeat`` and ``listener``; ``core`` puts them
together and starts and stops them. ``config`` holds the settings and constants, ``execution``
what running one task takes, and ``supervisor`` the process supervisor of ``runfairworker
--processes``. The registry is :mod:`django_fairqueue.registry`, the retry policy and error
record :mod:`django_fairqueue.attempts` (shared with work batches).
"""

from __future__ import annotations

from django_fairqueue.attempts import error_info, retry_delay
from django_fairqueue.worker.config import (
    Outcome,
    WorkerConfig,
    WorkerCrashed,
    default_worker_id,
)
from django_fairqueue.worker.core import Worker
from django_fairqueue.worker.execution import check_arguments, decode_payload

__all__ = [
    "Outcome",
    "Worker",
    "WorkerConfig",
    "WorkerCrashed",
    "check_arguments",
    "decode_payload",
    "default_worker_id",
    "error_info",
    "retry_delay",
]

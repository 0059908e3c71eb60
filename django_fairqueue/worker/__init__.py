"""The worker: claim messages fairly, run their tasks on a thread pool, settle the outcomes.

``manage.py runfairworker`` is a thin shell around :class:`Worker`, which composes small
services. Each owns its own state, meets the others only through the in-flight ledger and two
queues, and has ``start`` (its loop in a thread of its own, with its own database connection:
Django's connections are per thread), ``stop`` and ``run_once`` (one pass in the calling thread):

* the **ledger** (``ledger``) is not a thread: the messages claimed and not yet written back,
  their leases by this process's clock, lost leases, abort requests, running attempts and
  their deadlines, timed-out attempts whose thread is stuck, and the counts a claim is sized
  by, under one lock of its own;
* the **claimer** (``claimer``, in the thread that calls :meth:`Worker.run`) claims up to the
  free handler slots plus ``prefetch`` (at most ``batch_size``) in one ``claim_messages`` call,
  whenever a slot is free and work may be waiting: after a full claim, on a LISTEN wake-up,
  when a retry or a rescued message is ready, when the worker is idle in burst mode, or when
  the jittered poll interval has passed; it puts what it claimed on the pool's queue;
* the **pool** (``pool``): ``concurrency`` handler threads run the task functions (a
  connection only if the task uses the database) and put outcomes on the settler's queue;
* the **timer** (``timer``) fails an attempt that outlives its task's time limit
  (``TaskTimeout``) or its abort's grace period, and has the pool start a thread in place of
  the stuck one (Python cannot stop a thread). The message stays claimed, its lease renewed
  and its channel's cap counting it, until the stuck thread returns: only then is the outcome
  written (the late result discarded). Past ``STUCK_TASK_LIMIT`` seconds stuck, or
  ``max_abandoned_threads`` stuck threads, the worker recycles itself: it claims nothing more,
  finishes what runs and exits, for a fresh process to replace it;
* the **settler** (``settler``) writes outcomes in batches: every completion waiting in one
  ``complete_messages``, every failure in one ``fail_messages``;
* the **heartbeat** (``heartbeat``) renews the lease of every claimed, unsettled message in
  one statement, three times per lease period, also while handlers are busy, and finds abort
  requests;
* the **listener** (``listener``) holds a psycopg connection of its own (not Django's) that
  LISTENs for the enqueue wake-ups;
* **maintenance** (``core.Maintenance``) runs the rescuer, the pruner, the delta folder and
  the scheduler of periodic tasks (:mod:`django_fairqueue.maintenance`), and the registry
  beat keeps this worker's row in the worker registry fresh.

Every write after the claim presents the claim's lease token, so a worker that lost its lease
(stalled past it, or cut off from the database) changes nothing when it comes back.

``service`` has what the services share (``start``, ``stop``, a crash stops the worker),
``config`` the settings and constants, ``execution`` what running one task takes and the
outcomes an attempt ends with, and ``supervisor`` the process supervisor of ``runfairworker
--processes``. The worker registry is :mod:`django_fairqueue.runtime.worker_registry`, the
retry policy and error record :mod:`django_fairqueue.runtime.attempts` (shared with work
batches); the check that wake-ups arrive is ``wakeups``.
"""

from __future__ import annotations

from django_fairqueue.runtime.attempts import error_info, retry_delay
from django_fairqueue.worker.config import (
    Outcome,
    WorkerConfig,
    WorkerCrashed,
    default_worker_id,
)
from django_fairqueue.worker.core import Worker
from django_fairqueue.worker.execution import decode_payload

__all__ = [
    "Outcome",
    "Worker",
    "WorkerConfig",
    "WorkerCrashed",
    "decode_payload",
    "default_worker_id",
    "error_info",
    "retry_delay",
]

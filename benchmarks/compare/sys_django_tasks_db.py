"""django-tasks-db (PyPI ``django-tasks-db``): the ORM backend of ``django.tasks``.

Its ``DatabaseBackend`` with the ``django-tasks`` backport (Django 5.2; Django 6 has
``django.tasks`` built in). Enqueue is ``task.enqueue()``: one ``INSERT`` through the ORM per
job; there is no batch API, so a batch is 100 ``enqueue()`` calls in one
``transaction.atomic()``. Workers are ``manage.py db_worker``: one job at a time per process,
``SELECT ... FOR UPDATE SKIP LOCKED`` per job, polling every ``--interval`` (default 1 s) when
idle. Backlogs are bulk-loaded with ``bulk_create`` of the rows ``enqueue()`` writes (not timed).
Fairness: no mechanism (queues need a worker each): first in, first out.

Runs with Django set up (``COMPARE_DJANGO_APP=django-tasks-db``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from multiprocessing.synchronize import Barrier

import django_tasks_db
from django.db import connection, connections, transaction
from django_tasks_db.models import DBTaskResult, get_date_max

from benchmarks.compare.common import SERIES_SQL, Backlog, WorkerConfig, series_slices, timed_calls
from benchmarks.compare.system import BATCH, DjangoSystem, python
from benchmarks.compare.tasks_django_tasks import noop

CHUNK = 2_000


class DjangoTasksDb(DjangoSystem):
    name = "django-tasks-db"
    django_app = "django-tasks-db"
    configs = (WorkerConfig(1, 1), WorkerConfig(2, 1), WorkerConfig(4, 1))
    fair_config = WorkerConfig(2, 1)
    concurrency_unit = "one job at a time per db_worker process"
    pickup_config = WorkerConfig(1, 1)
    wakeup = "polling, --interval 1 s (the default)"
    version = f"django-tasks-db {getattr(django_tasks_db, '__version__', '')}".strip()

    def reset(self) -> None:
        with connection.cursor() as cursor:
            cursor.execute(f"TRUNCATE {DBTaskResult._meta.db_table}")

    def _row(self, tenant: str, seq: int) -> DBTaskResult:
        return DBTaskResult(
            id=uuid.uuid4(),
            args_kwargs={"args": [tenant, seq], "kwargs": {}},
            priority=noop.priority,
            task_path=noop.module_path,
            queue_name=noop.queue_name,
            # what its pre_save handler stores for "no run_after" (bulk_create sends no signals)
            run_after=noop.run_after or get_date_max(),
            backend_name="default",
        )

    def load(self, tenant: str, count: int, variant: str) -> None:
        for low in range(0, count, CHUNK):
            rows = [self._row(tenant, low + j) for j in range(min(CHUNK, count - low))]
            DBTaskResult.objects.bulk_create(rows)
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {DBTaskResult._meta.db_table}")

    def load_backlog(self, backlog: Backlog, variant: str) -> None:
        """The rows ``enqueue()`` writes, one ``INSERT ... SELECT`` per slice; ``enqueued_at``
        a microsecond apart in queueing order (its workers take the oldest first)."""
        table = DBTaskResult._meta.db_table
        sql = (
            f"INSERT INTO {table} (id, status, enqueued_at, args_kwargs, priority, task_path, "
            "worker_ids, queue_name, backend_name, run_after, exception_class_path, traceback) "
            "SELECT gen_random_uuid(), 'READY', now() + i * interval '1 microsecond', "
            "jsonb_build_object('args', jsonb_build_array(tenant, seq), 'kwargs', '{}'::jsonb), "
            "%(priority)s, %(task_path)s, '[]'::jsonb, %(queue)s, 'default', %(run_after)s, '', '' "
            f"FROM ({SERIES_SQL}) AS x ORDER BY i"
        )
        with connection.cursor() as cursor:
            for params in series_slices(backlog):
                cursor.execute(
                    sql,
                    {
                        **params,
                        "priority": noop.priority,
                        "task_path": noop.module_path,
                        "queue": noop.queue_name,
                        "run_after": noop.run_after or get_date_max(),
                    },
                )
            cursor.execute(f"ANALYZE {table}")

    def enqueue_loop(self, mode: str, duration: float, start: Barrier) -> tuple[int, float, float]:
        seq = 0

        def call() -> int:
            nonlocal seq
            if mode == "single":
                seq += 1
                noop.enqueue("E", seq)
                return 1
            with transaction.atomic():
                for j in range(BATCH):
                    noop.enqueue("E", seq + j)
            seq += BATCH
            return BATCH

        try:
            return timed_calls(call, start, duration)
        finally:
            connections.close_all()

    def burst(
        self, tenant: str, seqs: Sequence[int], variant: str, key: str | None = None
    ) -> float:
        with transaction.atomic():
            for s in seqs:
                noop.enqueue(tenant, s)
        return time.time()

    def worker_commands(self, config: WorkerConfig, variant: str) -> list[list[str]]:
        return [
            python("-m", "django", "db_worker", "--queue-name", "default", "--verbosity", "0")
            for _ in range(config.processes)
        ]

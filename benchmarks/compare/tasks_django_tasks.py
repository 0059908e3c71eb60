"""The no-op task, for django-tasks-db (through the ``django.tasks`` API of ``django-tasks``)."""

from __future__ import annotations

from django_tasks import task

from benchmarks.compare.common import stamp


@task()
def noop(tenant: str, seq: int) -> None:
    stamp(tenant, seq)

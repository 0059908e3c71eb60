"""The no-op task, for django-fairqueue."""

from __future__ import annotations

from benchmarks.compare.common import stamp
from django_fairqueue import task

NAME = "compare.noop"


@task(name=NAME, max_attempts=1)
def noop(tenant: str, seq: int) -> None:
    stamp(tenant, seq)

"""django-fairqueue, this project: one channel per tenant, real ``runfairworker`` processes.

Workers: ``python -m django runfairworker --concurrency T --batch-size 100 --prefetch F`` (T
handler threads per process; a claim takes at most as many messages as there are free threads,
plus F). Enqueue goes
through the public API, ``enqueue()`` and ``enqueue_many()``. Backlogs for the throughput and
fairness cells are bulk-loaded with the bench app's ``db.load_ready_messages`` (the same
rows and channel counters ``enqueue_many`` writes), which is not timed.

The sybil scenario puts each tenant's channels in a channel group of its own (tenant A's 100
channels ``A/c00`` ... ``A/c99``, B's burst in ``B/c00``): the claim is fair across groups
first, so A's hundred channels weigh as one tenant. The weights scenario sets the channel's
``weight`` (fairness by time, ``FAIRQUEUE["FAIRNESS"] = "time"``).

Runs with Django set up (``benchmarks.compare.django_settings``, ``COMPARE_DJANGO_APP=fairqueue``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from multiprocessing.synchronize import Barrier

from django.db import connections, transaction

import django_fairqueue
from benchmarks.compare.common import Backlog, WorkerConfig, timed_calls
from benchmarks.compare.system import BATCH, DjangoSystem, python
from benchmarks.compare.tasks_fairqueue import NAME
from django_fairqueue import EnqueueRequest, conf, enqueue, enqueue_many

try:
    from django_fairqueue.contrib.bench import db
    from django_fairqueue.db import channel_store
except ImportError:  # ``--baseline`` at a commit whose one store module ran all the SQL
    from django_fairqueue import store as db  # type: ignore[attr-defined,no-redef]

    channel_store = db  # type: ignore[assignment]

LOAD_CHUNK = 200_000


class Fairqueue(DjangoSystem):
    name = "django-fairqueue"
    django_app = "fairqueue"
    variants = ("fair",)
    #: the timeshare scenario: fairness by count (the default) and by time
    timeshare_variants = ("fair", "by-time")
    configs = (
        WorkerConfig(1, 8),
        WorkerConfig(2, 16),
        WorkerConfig(2, 32),
        WorkerConfig(2, 64),
        WorkerConfig(2, 100),
        # a claim may take that many messages beyond the free threads (leased, heartbeated,
        # counted against the caps): fewer, larger claims
        WorkerConfig(2, 32, prefetch=68),
        WorkerConfig(2, 64, prefetch=136),
    )
    fair_config = WorkerConfig(2, 64, prefetch=136)
    concurrency_unit = "handler threads per worker (--concurrency)"
    pickup_config = WorkerConfig(1, 1)
    wakeup = "LISTEN/NOTIFY (the default), polling as a fallback"
    version = f"django-fairqueue {django_fairqueue.__version__}"
    weights = True

    def reset(self) -> None:
        db.truncate_queue_tables()
        if hasattr(channel_store, "forget_groups"):  # (a baseline before channel groups)
            channel_store.forget_groups()  # the channel groups went with the tables

    def load(self, tenant: str, count: int, variant: str) -> None:
        done = 0
        while done < count:
            done += db.load_ready_messages(
                [tenant],
                min(LOAD_CHUNK, count - done),
                task_name=NAME,
                payload={"args": [tenant, 0], "kwargs": {}},
                defaults=conf.get().CHANNEL_DEFAULTS,
            )
        self._settle()

    def _settle(self) -> None:
        while channel_store.fold_channel_deltas(10_000) > 0:
            pass
        db.analyze_queue_tables()

    def key(self, tenant: str, index: int | None = None) -> str:
        # the sybil scenario: a tenant's channels are one channel group
        return tenant if index is None else f"{tenant}/c{index:02d}"

    def load_backlog(self, backlog: Backlog, variant: str) -> None:
        """Each tenant's messages, round-robin over its channels (the order between tenants
        does not matter to a fair claim)."""
        for tenant, keys in zip(backlog.tenants, backlog.key_counts(), strict=True):
            channels = [tenant] if keys == 1 else [self.key(tenant, i) for i in range(keys)]
            if keys > 1:
                channel_store.ensure_groups([tenant])
            done = 0
            while done < backlog.count:
                done += db.load_ready_messages(
                    channels,
                    min(LOAD_CHUNK, backlog.count - done),
                    task_name=NAME,
                    payload={"args": [tenant, 0], "kwargs": {}},
                    defaults=conf.get().CHANNEL_DEFAULTS,
                )
        self._settle()

    def set_weight(self, key: str, weight: int) -> None:
        from django_fairqueue.models import Channel

        if not Channel.objects.filter(name=key).update(weight=weight):
            raise ValueError(f"no channel {key!r} to weigh")

    def enqueue_loop(self, mode: str, duration: float, start: Barrier) -> tuple[int, float, float]:
        seq = 0

        def call() -> int:
            nonlocal seq
            if mode == "single":
                seq += 1
                enqueue(NAME, "E", seq, channel="E")
                return 1
            enqueue_many(EnqueueRequest(NAME, ("E", seq + j), channel="E") for j in range(BATCH))
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
            channel = key or tenant
            enqueue_many(EnqueueRequest(NAME, (tenant, s), channel=channel) for s in seqs)
        return time.time()

    def worker_commands(self, config: WorkerConfig, variant: str) -> list[list[str]]:
        return [
            python(
                "-m",
                "django",
                "runfairworker",
                "--concurrency",
                str(config.concurrency),
                "--batch-size",
                "100",
                "--prefetch",
                str(config.prefetch),
                "--worker-id",
                f"compare-{i}",
                "--verbosity",
                "0",
            )
            for i in range(config.processes)
        ]

"""A ready backlog for the scripts here, loaded in bulk and counted on the channel rows."""

from __future__ import annotations

from django_fairqueue import conf
from django_fairqueue.contrib.bench import db as bench_db
from django_fairqueue.contrib.bench.harness import NOOP_PAYLOAD
from django_fairqueue.contrib.bench.tasks import NOOP_TASK_NAME
from django_fairqueue.db import channel_store


def load_counted(channels: list[str], total: int) -> None:
    """``total`` ready no-op messages spread over ``channels``, their deltas folded (as a
    claim would count them) and the tables analysed."""
    bench_db.load_ready_messages(
        channels,
        total,
        task_name=NOOP_TASK_NAME,
        payload=NOOP_PAYLOAD,
        defaults=conf.get().CHANNEL_DEFAULTS,
    )
    while channel_store.fold_channel_deltas(10_000) > 0:
        pass
    bench_db.analyze_queue_tables()

"""Statistics: per-channel wait histograms, per-minute counts, and worker time per tenant."""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import F
from django.utils.translation import gettext_lazy as _

from django_fairqueue.limits import CHANNEL_NAME_MAX_LENGTH
from django_fairqueue.models.channels import Channel

#: Upper bounds (milliseconds) of the wait-time histogram buckets in ChannelStat.wait_histogram;
#: the last bucket is everything above the last bound.
WAIT_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000)


class _ArrayIndex(models.Transform):
    """``field__3``: the element at index 3 (0-based in Python, 1-based in PostgreSQL)."""

    def __init__(self, index: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.index = index

    def as_sql(  # type: ignore[override]  # a Transform needs no function/template
        self, compiler: Any, connection: Any
    ) -> tuple[str, tuple[Any, ...]]:
        lhs, params = compiler.compile(self.lhs)
        return f"({lhs})[%s]", (*params, self.index + 1)

    @property
    def output_field(self) -> models.Field:  # type: ignore[type-arg]
        return models.IntegerField()


class IntegerArrayField(models.Field):  # type: ignore[type-arg]
    """A PostgreSQL ``integer[]`` column, read and written as a list of ints.

    Not ``django.contrib.postgres``'s ArrayField: since Django 6.1 that requires
    ``django.contrib.postgres`` in INSTALLED_APPS (check postgres.E005), and a reusable app must
    not impose it. psycopg adapts lists to arrays and back by itself.
    """

    description = "Array of integers"

    def db_type(self, connection: Any) -> str:
        return "integer[]"

    def get_prep_value(self, value: Any) -> Any:
        return None if value is None else [int(v) for v in value]

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        return None if value is None else list(value)

    def get_transform(self, name: str) -> Any:
        transform = super().get_transform(name)
        if transform is None and name.isdigit():
            index = int(name)
            return lambda *args, **kwargs: _ArrayIndex(index, *args, **kwargs)
        return transform


class ChannelStat(models.Model):
    """Per channel and minute: what was claimed and settled, and how long messages waited.

    Workers aggregate in memory and flush one upsert per (channel, minute) every few seconds,
    so the claim itself writes nothing extra. Feeds the admin dashboard (served shares, wait
    p50/p95, finished in the last minutes). Rows older than a day are pruned.
    """

    channel = models.ForeignKey(  # no FK constraint: see Message.channel
        Channel, on_delete=models.CASCADE, related_name="+", db_index=False, db_constraint=False
    )
    minute = models.DateTimeField()
    claimed = models.IntegerField(default=0)
    succeeded = models.IntegerField(default=0)
    failed = models.IntegerField(default=0)
    retried = models.IntegerField(default=0)
    # of the attempts counted in failed and retried, those that ran out of time (past their
    # task's time limit, or their lease expired and the rescuer took them back); the others
    # raised
    timed_out = models.IntegerField(default=0, db_default=0)
    wait_ms_sum = models.BigIntegerField(default=0)
    wait_ms_max = models.IntegerField(default=0)
    # counts per WAIT_BUCKETS_MS bucket (len(WAIT_BUCKETS_MS) + 1 entries)
    wait_histogram = IntegerArrayField(default=list)
    run_ms_sum = models.BigIntegerField(default=0)

    class Meta:
        db_table = "fairqueue_channel_stat"
        constraints = [
            models.UniqueConstraint(fields=["channel", "minute"], name="fq_stat_channel_minute"),
        ]
        indexes = [models.Index(F("minute"), name="fq_stat_minute_idx")]

    def __str__(self) -> str:
        return f"channel {self.channel_id} @ {self.minute:%H:%M}: {self.claimed} claimed"


class MinuteStat(models.Model):
    """Per minute, all channels together: the sums of that minute's ChannelStat rows.

    Written by the same flush as the channel rows, in the same transaction, so the two always
    agree. The dashboard's per-minute series and its overall wait and outcome figures read
    these (one row a minute) instead of summing the rows of every channel. Pruned with them.
    """

    minute = models.DateTimeField(primary_key=True)
    claimed = models.BigIntegerField(default=0)
    succeeded = models.BigIntegerField(default=0)
    failed = models.BigIntegerField(default=0)
    retried = models.BigIntegerField(default=0)
    timed_out = models.BigIntegerField(default=0)
    wait_ms_sum = models.BigIntegerField(default=0)
    wait_ms_max = models.IntegerField(default=0)
    # summed element by element, as ChannelStat.wait_histogram
    wait_histogram = IntegerArrayField(default=list)
    run_ms_sum = models.BigIntegerField(default=0)

    class Meta:
        db_table = "fairqueue_minute_stat"

    def __str__(self) -> str:
        return f"{self.minute:%H:%M}: {self.claimed} claimed"


#: Most errors a message keeps in ``Message.errors`` (the oldest are dropped first).
ERROR_HISTORY = 20


class UsageHour(models.Model):
    """Per channel and hour: the worker time its attempts took and how they ended.

    Written by the workers' statistics flush (:func:`django_fairqueue.db.stats_store.record_usage`,
    in the transaction of the per-minute statistics), kept ``FAIRQUEUE['USAGE_RETENTION']``
    (pruned by maintenance), read by the admin's usage page, ``fairqueue usage`` and the
    metrics. The channel's and its group's names are copied in: usage outlives a deleted
    channel (no foreign key), as a bill does.
    """

    hour = models.DateTimeField()
    channel_id = models.BigIntegerField()
    #: the channel row's name (``<queue><U+001F><name>`` outside the default queue)
    channel_name = models.CharField(max_length=CHANNEL_NAME_MAX_LENGTH)
    #: the channel's group when the attempts ran ("" for none)
    group_name = models.CharField(max_length=CHANNEL_NAME_MAX_LENGTH, blank=True, default="")
    #: attempts settled: succeeded, failed for good, or failed and retried
    attempts = models.BigIntegerField(default=0)
    succeeded = models.BigIntegerField(default=0)
    #: attempts that failed (raised, ran past their time limit or lost their lease)
    failures = models.BigIntegerField(default=0)
    #: of ``failures``, those that ran out of time
    timeouts = models.BigIntegerField(default=0)
    #: the time the attempts ran, in milliseconds
    worker_ms = models.BigIntegerField(default=0)

    class Meta:
        db_table = "fairqueue_usage"
        verbose_name = _("usage hour")
        verbose_name_plural = _("usage per tenant")
        constraints = [
            # the flush's upsert key; its leading hour serves the date ranges and the pruner
            models.UniqueConstraint(fields=["hour", "channel_id"], name="fq_usage_hour_channel"),
        ]

    def __str__(self) -> str:
        return f"{self.channel_name} @ {self.hour:%Y-%m-%d %H}h: {self.worker_ms} ms"


class UsageTotal(models.Model):
    """Per channel, the usage since it was first recorded: never pruned, so the Prometheus
    counters read from it only grow. Written with :class:`UsageHour`, one row a channel."""

    channel_id = models.BigIntegerField(primary_key=True)
    attempts = models.BigIntegerField(default=0)
    succeeded = models.BigIntegerField(default=0)
    failures = models.BigIntegerField(default=0)
    timeouts = models.BigIntegerField(default=0)
    worker_ms = models.BigIntegerField(default=0)

    class Meta:
        db_table = "fairqueue_usage_total"

    def __str__(self) -> str:
        return f"channel {self.channel_id}: {self.worker_ms} ms in {self.attempts} attempts"

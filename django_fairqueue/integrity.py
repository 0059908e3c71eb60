"""Keep the scheduler's counters true whatever Django path writes the queue's tables.

The queue's own statements (``django_fairqueue.db``) change rows and counters together. Django's ORM
cannot: it knows nothing of the counters. So:

* The scheduler's columns of a channel are no model fields at all (see ``models.Channel``):
  saving, updating or loading a ``Channel`` writes its configuration only.
* Deleting a channel through the ORM (``channel.delete()``, a queryset's ``delete()``, the
  admin) first takes the channel's name lock
  (:func:`django_fairqueue.db.channel_store.lock_channel_names`), so enqueues in flight
  finish first and their messages go with the channel, and a later enqueue creates the
  channel anew: no message is left behind pointing at no channel.
* Any ORM write of messages, counter deltas or work batches (``save()``, ``delete()``,
  ``QuerySet.update()``/``delete()``, ``bulk_create()``/``bulk_update()``, and ``loaddata``,
  which saves raw rows) schedules a recount of the channels it touched, run when the
  transaction commits (:func:`django_fairqueue.db.integrity_store.repair_channel_counters`,
  each channel under its row lock). A fixture or a ``dumpdata`` taken while workers ran
  therefore loads into consistent counters.

The maintenance loop also recounts every channel now and then (``maintenance.CounterVerifier``)
and logs what it had to repair: the last line of defence for a write nobody foresaw.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from django.db import DEFAULT_DB_ALIAS, router, transaction
from django.db.models import Model, QuerySet
from django.db.models.signals import post_save, pre_delete

from django_fairqueue.queues import display_name

logger = logging.getLogger("django_fairqueue.integrity")

_pending = threading.local()


def schedule_recount(channel_ids: Iterable[int | None], using: str) -> None:
    """Recount these channels when the current transaction commits (at once in autocommit).

    Ids gather in one set per database until the commit, so a ``loaddata`` of a million
    messages recounts each channel once.
    """
    ids = {cid for cid in channel_ids if cid is not None}
    if not ids:
        return
    pending: dict[str, set[int]] = _pending.__dict__.setdefault("by_alias", {})
    pending.setdefault(using, set()).update(ids)
    # A callback flushes whatever is pending: a set left by a transaction that rolled back
    # (its callbacks are dropped) is then recounted by the next commit, which is harmless.
    # One callback per transaction is enough, unless it was registered inside a savepoint
    # that may still roll back without the rest of the transaction.
    if not _flush_already_queued(using):
        flusher = _flusher(using)
        flusher.queued = True
        transaction.on_commit(flusher, using=using)


class _Flusher:
    """The on-commit callback for one database, one per thread (as connections are), so the
    queue of callbacks can be searched for it."""

    def __init__(self, using: str) -> None:
        self.using = using
        #: registered and not run yet (a test's captured callbacks run without a commit)
        self.queued = False

    def __call__(self) -> None:
        self.queued = False
        _flush(self.using)


def _flusher(using: str) -> _Flusher:
    flushers: dict[str, _Flusher] = _pending.__dict__.setdefault("flushers", {})
    if using not in flushers:
        flushers[using] = _Flusher(using)
    return flushers[using]


def _flush_already_queued(using: str) -> bool:
    """Whether this transaction already holds a flush that nothing but the whole
    transaction's rollback can drop: one not run yet, registered at this savepoint level or
    outside it. (A ``loaddata`` of a million rows would otherwise queue a million callbacks.)"""
    conn = transaction.get_connection(using)
    flusher = _flusher(using)
    if not flusher.queued or not conn.in_atomic_block:
        return False
    current = set(conn.savepoint_ids)
    for entry in getattr(conn, "run_on_commit", ()):
        sids, func = entry[0], entry[1]
        if func is flusher and set(sids) <= current:
            return True
    return False


def _flush(using: str) -> None:
    from django_fairqueue.db import integrity_store

    pending: dict[str, set[int]] = _pending.__dict__.get("by_alias", {})
    ids = pending.pop(using, None)
    if not ids:
        return
    drift = integrity_store.repair_channel_counters(sorted(ids), using=using)
    for d in drift:
        logger.info(
            "recounted channel %r after a write through the ORM: %s was %s, is %s",
            display_name(d.channel),
            d.counter,
            d.recorded,
            d.actual,
        )


class TrackedQuerySet(QuerySet[Any]):
    """A queryset whose bulk writes recount the channels of the rows they touch."""

    def _channels(self) -> set[int]:
        return set(self.order_by().values_list("channel_id", flat=True).distinct())

    def update(self, **kwargs: Any) -> int:
        using = router.db_for_write(self.model)
        with transaction.atomic(using=using, savepoint=False):
            before = self._channels()
            count = super().update(**kwargs)
            after = self._channels() if "channel" in kwargs or "channel_id" in kwargs else set()
            schedule_recount(before | after, using)
        return count

    def delete(self) -> tuple[int, dict[str, int]]:
        using = router.db_for_write(self.model)
        with transaction.atomic(using=using, savepoint=False):
            channels = self._channels()
            result = super().delete()
            schedule_recount(channels, using)
        return result

    def bulk_create(self, objs: Iterable[Any], *args: Any, **kwargs: Any) -> list[Any]:
        objs = list(objs)
        created = super().bulk_create(objs, *args, **kwargs)
        schedule_recount((o.channel_id for o in objs), router.db_for_write(self.model))
        return created

    def bulk_update(self, objs: Iterable[Any], fields: Any, batch_size: Any = None) -> int:
        objs = list(objs)
        using = router.db_for_write(self.model)
        with transaction.atomic(using=using, savepoint=False):
            # the channels the rows had before, and the ones they have now
            ids = [o.pk for o in objs]
            before = set(
                self.model._default_manager.using(using)
                .filter(pk__in=ids)
                .values_list("channel_id", flat=True)
            )
            count = super().bulk_update(objs, fields, batch_size=batch_size)
            schedule_recount(before | {o.channel_id for o in objs}, using)
        return count


class TrackedModel(Model):
    """A model of rows the counters count: its own saves and deletes recount its channel."""

    class Meta:
        abstract = True

    def save(self, *args: Any, **kwargs: Any) -> None:
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        with transaction.atomic(using=using, savepoint=False):
            old = None
            if self.pk is not None:
                # every concrete subclass has a channel (an abstract base: mypy cannot see it)
                rows = type(self)._base_manager.using(using).filter(pk=self.pk)
                old = rows.values_list("channel_id", flat=True).first()  # type: ignore[misc]
            super().save(*args, **kwargs)
            schedule_recount([old, getattr(self, "channel_id", None)], using)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        with transaction.atomic(using=using, savepoint=False):
            result = super().delete(*args, **kwargs)
            schedule_recount([getattr(self, "channel_id", None)], using)
        return result


def _raw_saved(sender: type[Model], instance: Any, raw: bool, using: str, **kwargs: Any) -> None:
    """``loaddata`` saves rows raw (``save_base(raw=True)``), bypassing ``save()``."""
    if not raw:
        return
    channel_id = instance.pk if sender._meta.model_name == "channel" else instance.channel_id
    schedule_recount([channel_id], using or DEFAULT_DB_ALIAS)


def _channel_deleting(sender: type[Model], instance: Any, using: str, **kwargs: Any) -> None:
    from django_fairqueue.db import channel_store

    channel_store.lock_channel_names([instance.name], using=using)


def connect() -> None:
    """Connect the receivers (from ``AppConfig.ready``)."""
    from django_fairqueue.models import Channel, ChannelDelta, Message, WorkBatch

    for model in (Channel, Message, ChannelDelta, WorkBatch):
        post_save.connect(_raw_saved, sender=model, dispatch_uid=f"fairqueue.raw.{model.__name__}")
    pre_delete.connect(_channel_deleting, sender=Channel, dispatch_uid="fairqueue.channel.delete")

"""Channels and channel groups: the names and limits operators edit, and the writes of the
model that lift what they release (the scheduler's state shares the rows but is no field)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any, TypeVar

from django.core.exceptions import FieldError
from django.db import models
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from django_fairqueue.limits import (
    CHANNEL_NAME_MAX_LENGTH,
    GROUP_NAME_MAX_LENGTH,
    MAX_CONCURRENCY_LIMIT,
    MAX_RELEASE_INTERVAL,
    MAX_WEIGHT,
    QUEUE_NAME_MAX_LENGTH,
)
from django_fairqueue.queues import DEFAULT_QUEUE, display_name, split_row_name

_M = TypeVar("_M", bound=models.Model)


class _LiftingQuerySet(models.QuerySet[_M]):
    """A queryset whose ``update()`` lifts the rows it writes when it can release them
    (:func:`_lifts`, :func:`_lift`); ``bulk_update()`` writes through ``update()``."""

    def update(self, **kwargs: Any) -> int:
        if not _lifts(kwargs, pauses=kwargs.get("paused") is True, limits=_limits_of(self.model)):
            return super().update(**kwargs)
        # the ids first: the write may take its rows out of the filter
        # (``filter(paused=True).update(paused=False)``)
        ids = list(self.order_by().values_list("pk", flat=True))
        updated = super().update(**kwargs)
        _lift(self.model, ids, self.db)
        return updated


class ChannelGroupQuerySet(_LiftingQuerySet["ChannelGroup"]):
    """``ChannelGroup.objects``: a bulk write that can release groups lifts them."""


class ChannelGroup(models.Model):
    """A group of channels (a tenant whose channels are its users, projects or task kinds).

    The claim is fair across groups first (each ungrouped channel counts as a group of its
    own), then across the channels of a group; a group's weight, cap and rate limit hold for
    all its channels together, fleet-wide. A channel named ``"<group>/<rest>"`` belongs to the
    group of that name when the group exists (``enqueue(channel=("acme", "alice"))`` creates
    it, as does adding it here). As with :class:`Channel`, the model maps only what operators
    edit: the group's scheduler state (``ready_count``, ``running_count``, ``claimable``,
    ``next_turn_at``, ``turn_used``, ``vtime``, ``last_claimed_at``) shares the row but is
    written only by the queue's SQL functions, so no ORM save can overwrite it. Read it with
    :func:`django_fairqueue.db.channel_store.select_group_state`. See docs/explanation/fairness.md.
    """

    name = models.CharField(
        max_length=GROUP_NAME_MAX_LENGTH,
        help_text=_("Channels named <group>/<anything> belong to this group."),
    )
    weight = models.SmallIntegerField(
        default=1,
        help_text=_(
            "Share of the workers while backlogged, against other groups and ungrouped "
            "channels: weight 2 gets twice weight 1."
        ),
    )
    max_concurrency = models.IntegerField(
        null=True,
        blank=True,
        help_text=_(
            "Most messages of all this group's channels running at once, fleet-wide. "
            "Empty: no limit."
        ),
    )
    release_interval = models.DurationField(
        default=timedelta(0),
        help_text=_(
            "Minimum time between two releases of this group's channels together (rate "
            "limit). 0: no limit."
        ),
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    # The queue of the group's channels: set from the row's name by the database (a group of
    # queue "reports" is the row named "reports<U+001F><group>"); see docs/howto/queues.md.
    queue = models.CharField(
        max_length=QUEUE_NAME_MAX_LENGTH,
        default=DEFAULT_QUEUE,
        db_default=DEFAULT_QUEUE,
        editable=False,
    )

    objects = ChannelGroupQuerySet.as_manager()

    class Meta:
        db_table = "fairqueue_channel_group"
        ordering = ["name"]
        verbose_name = _("channel group")
        constraints = [
            models.UniqueConstraint(fields=["name"], name="fq_group_name_uniq"),
            models.CheckConstraint(
                condition=Q(name__regex=r"^[^/\s]([^/]*[^/\s])?$"),
                name="fq_group_name_valid",
            ),
            models.CheckConstraint(
                condition=Q(max_concurrency__isnull=True)
                | Q(max_concurrency__gte=1, max_concurrency__lte=MAX_CONCURRENCY_LIMIT),
                name="fq_group_max_concurrency_range",
            ),
            models.CheckConstraint(
                condition=Q(release_interval__gte=timedelta(0))
                & Q(release_interval__lte=MAX_RELEASE_INTERVAL),
                name="fq_group_release_interval_range",
            ),
            models.CheckConstraint(
                condition=Q(weight__gte=1, weight__lte=MAX_WEIGHT),
                name="fq_group_weight_range",
            ),
        ]

    def __str__(self) -> str:
        return display_name(self.name)

    def save(self, *args: Any, **kwargs: Any) -> None:
        adding = self._state.adding
        if adding:
            _check_new_name(self.name, group=True)
        _check_limits(self, f"channel group {self.name!r}")
        super().save(*args, **kwargs)
        if not adding:
            _lift_saved(self, kwargs.get("update_fields"), paused=False)

    @property
    def short_name(self) -> str:
        """The group's name within its queue (the row's name without its queue)."""
        return split_row_name(self.name)[1]


def _check_limits(obj: Channel | ChannelGroup, where: str) -> None:
    """Check the limits of a channel or group about to be saved as the API checks them
    (:func:`django_fairqueue.conf.validate_channel_limits`), raising
    :class:`~django_fairqueue.exceptions.InvalidChannel` instead of the database's CHECK error;
    a release interval given in seconds is stored as that duration."""
    from django_fairqueue.conf import validate_channel_limits
    from django_fairqueue.exceptions import InvalidChannel

    limits: dict[str, Any] = {
        "max_concurrency": obj.max_concurrency,
        "release_interval": obj.release_interval,
        "weight": obj.weight,
    }
    if isinstance(obj, Channel):
        limits["max_backlog"] = obj.max_backlog
    try:
        checked = validate_channel_limits(**limits, where=where)
    except ValueError as exc:
        raise InvalidChannel(str(exc)) from None
    obj.release_interval = checked.release_interval


#: A channel's columns the database derives from its name: its group ("<group>/<rest>" once that
#: group exists) and its queue. Writing them would move the channel's running and waiting
#: messages out of its group's cap, or say a queue the row is not in.
_FOLLOWS_FROM_NAME = frozenset({"group", "group_id", "queue"})


def _check_new_name(row: str, *, group: bool) -> None:
    """A new channel's or group's row name as an enqueue checks it: a bad one raises
    :class:`~django_fairqueue.exceptions.InvalidChannel` naming what is wrong, rather than the
    database's IntegrityError or DataError. ``row`` holds the queue outside the default one."""
    from django_fairqueue.api import check_channel_in_queue  # (the API imports the models)

    queue, name = split_row_name(row)
    # a group is checked as the group part of a channel of it, with its row in the queue
    check_channel_in_queue((name, "-") if group else name, queue)


def _refuse_derived(fields: Iterable[str]) -> None:
    """Raise :class:`~django.core.exceptions.FieldError` if an ORM write names a column of
    ``_FOLLOWS_FROM_NAME``."""
    named = sorted(_FOLLOWS_FROM_NAME.intersection(fields))
    if named:
        raise FieldError(
            f"a channel's {named[0].removesuffix('_id')} cannot be written: it follows from its "
            "name (a channel named '<group>/<rest>' is in that group once the group exists, and "
            "in the queue it was enqueued to). To move a tenant's work, enqueue to a channel of "
            "the new name."
        )


#: The limits whose change can make a channel claimable again or served sooner (resumed, its
#: cap raised, its rate limit removed, its weight raised); a group's are the same but the
#: pause, which a group has not.
_LIFTING_LIMITS = frozenset({"paused", "max_concurrency", "release_interval", "weight"})
_GROUP_LIFTING_LIMITS = _LIFTING_LIMITS - {"paused"}


def _limits_of(model: type[models.Model]) -> frozenset[str]:
    """The lifting limits of ``model``'s rows (a channel's or a group's)."""
    return _GROUP_LIFTING_LIMITS if issubclass(model, ChannelGroup) else _LIFTING_LIMITS


def _lifts(fields: Iterable[str], *, pauses: bool, limits: frozenset[str]) -> bool:
    """Whether a write of the columns ``fields`` must lift the rows it writes (:func:`_lift`):
    when it writes one of ``limits``, by time only (by count the tags are unused), and not when
    it pauses them (they are lifted when resumed)."""
    from django_fairqueue.db.channel_store import fairness_by_time

    return bool(limits.intersection(fields)) and not pauses and fairness_by_time(None)


def _lift(model: type[models.Model], ids: Iterable[int], using: str | None) -> None:
    """Lift the channels (or channel groups, by ``model``) of ``ids`` to the others' virtual
    time after a write of their limits, as the admin does: one just resumed, or freed from its
    cap or rate limit, kept the low tag it had while held back, and would take every start
    until it caught up. The workers' fold cannot lift it: the write made it claimable before
    any fold runs."""
    from django_fairqueue.db.channel_store import fold_deltas_of_channel, lift_group

    lift = lift_group if issubclass(model, ChannelGroup) else fold_deltas_of_channel
    for pk in sorted(ids):  # rows in id order (fairness.md, "Lock order")
        lift(pk, using=using)


def _lift_saved(obj: Channel | ChannelGroup, fields: Iterable[str] | None, *, paused: bool) -> None:
    """Lift ``obj`` after its ``save()`` wrote its existing row (``fields``: the save's
    ``update_fields``, None for all) if that can release it (``paused``: the row's pause)."""
    limits = _limits_of(type(obj))
    written = limits if fields is None else frozenset(fields)
    if _lifts(written, pauses="paused" in written and paused, limits=limits):
        _lift(type(obj), [obj.pk], obj._state.db)


class ChannelQuerySet(_LiftingQuerySet["Channel"]):
    """``Channel.objects``: bulk writes of the limits; one naming a column that follows from the
    name is refused. A write that can release channels lifts them (:class:`_LiftingQuerySet`)."""

    def update(self, **kwargs: Any) -> int:
        _refuse_derived(kwargs)
        return super().update(**kwargs)

    def bulk_update(self, objs: Iterable[Channel], fields: Any, batch_size: Any = None) -> int:
        _refuse_derived(fields)
        return super().bulk_update(objs, fields, batch_size=batch_size)


class _BaseChannelQuerySet(models.QuerySet["Channel"]):
    """The base manager's, which Django's own code writes through: ``group.channels.add()``
    sets a group there, refused as above; ``SET_NULL`` when a group is deleted clears one, which
    stays allowed (the group is gone, so its channels are in none)."""

    def update(self, **kwargs: Any) -> int:
        _refuse_derived(key for key, value in kwargs.items() if value is not None)
        return super().update(**kwargs)


class Channel(models.Model):
    """A tenant's virtual queue: its name and the limits operators edit.

    The scheduler's state lives in the same table row but is deliberately *not* mapped here:
    counters (``ready_count``, ``scheduled_count``, ``running_count``, ``failed_count``,
    ``succeeded_total``), the round-robin turn (``next_turn_at``, ``turn_used``,
    ``last_claimed_at``), the virtual tag of fairness by time (``vtime``, ``mean_run``) and the
    work-batch turn (``batch_turn_at``, ``batch_turn_used``, ``batch_pending``) are written only
    by the queue's SQL functions and have database defaults; ``claimable``, which the walk
    indexes' predicates read, is a stored column PostgreSQL generates from the counters and
    the limits. So the ORM never loads them and can
    never write them back: ``save()`` of an instance loaded an hour ago, ``QuerySet.update()``,
    ``bulk_update()``, admin edits and ``loaddata`` all write configuration columns only, and an
    UPDATE of those (under READ COMMITTED) re-reads the row a claim just changed instead of
    overwriting it. Read the state with
    :func:`django_fairqueue.db.channel_store.select_channel_counters` or the admin. The two
    partial indexes the claims walk are created by migrations, not declared here, for the
    same reason (and the two of ``vtime``). See docs/explanation/fairness.md, "Lock order".

    ``group`` and ``queue`` are mapped to be read: the database sets them from the name, and no
    ORM write changes them on an existing row (see :class:`ChannelQuerySet` and ``_do_update``).
    """

    # Unique through Meta.constraints, not unique=True: that would also create a
    # varchar_pattern_ops index for LIKE, which every claim (it rewrites channel rows) would
    # maintain for nothing.
    name = models.CharField(max_length=CHANNEL_NAME_MAX_LENGTH)
    # -- limits, editable by operators; each takes effect on the next claim --
    # (Plain integer fields: their ranges are Meta.constraints. A Positive*Field adds a weaker
    # CHECK of its own, and PostgreSQL evaluates every CHECK of a row at each update of it,
    # the claim's and the fold's counter updates included.)
    max_concurrency = models.IntegerField(
        null=True,
        blank=True,
        help_text=_("Most messages of this channel running at once, fleet-wide. Empty: no limit."),
    )
    release_interval = models.DurationField(
        default=timedelta(0),
        help_text=_("Minimum time between two releases (rate limit). 0: no limit."),
    )
    weight = models.SmallIntegerField(
        default=1,
        help_text=_("Share of the workers while backlogged: weight 2 gets twice weight 1."),
    )
    paused = models.BooleanField(default=False)
    max_backlog = models.IntegerField(
        null=True,
        blank=True,
        help_text=_(
            "Most messages waiting (ready + scheduled). Enqueue past it fails. Empty: no limit."
        ),
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    # Set when the channel is created (its name, "<group>/<rest>", names an existing group) or
    # when its group is created; the claim and the group's sums follow it in SQL.
    group = models.ForeignKey(
        ChannelGroup,
        null=True,
        blank=True,
        editable=False,
        on_delete=models.SET_NULL,
        related_name="channels",
        db_constraint=False,
        db_index=False,  # fq_channel_group_idx, created by the migration
    )
    # The queue the channel's work belongs to, set from the row's name by the database: the
    # channel "acme" of queue "reports" is the row named "reports<U+001F>acme" (one row per
    # tenant and queue, each with its own turn and limits); see docs/howto/queues.md.
    queue = models.CharField(
        max_length=QUEUE_NAME_MAX_LENGTH,
        default=DEFAULT_QUEUE,
        db_default=DEFAULT_QUEUE,
        editable=False,
    )

    objects = ChannelQuerySet.as_manager()
    base_objects = _BaseChannelQuerySet.as_manager()

    class Meta:
        db_table = "fairqueue_channel"
        base_manager_name = "base_objects"
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(fields=["name"], name="fq_channel_name_uniq"),
            models.CheckConstraint(
                condition=Q(name__regex=r"^\S") & Q(name__regex=r"\S$"),
                name="fq_channel_name_trimmed",
            ),
            models.CheckConstraint(
                condition=Q(max_concurrency__isnull=True)
                | Q(max_concurrency__gte=1, max_concurrency__lte=MAX_CONCURRENCY_LIMIT),
                name="fq_channel_max_concurrency_range",
            ),
            models.CheckConstraint(
                condition=Q(release_interval__gte=timedelta(0))
                & Q(release_interval__lte=MAX_RELEASE_INTERVAL),
                name="fq_channel_release_interval_range",
            ),
            models.CheckConstraint(
                condition=Q(weight__gte=1, weight__lte=MAX_WEIGHT),
                name="fq_channel_weight_range",
            ),
            models.CheckConstraint(
                condition=Q(max_backlog__isnull=True) | Q(max_backlog__gte=1),
                name="fq_channel_max_backlog_positive",
            ),
        ]

    def __str__(self) -> str:
        return display_name(self.name)

    def save(self, *args: Any, **kwargs: Any) -> None:
        adding = self._state.adding
        if adding:
            _check_new_name(self.name, group=False)
        _check_limits(self, f"channel {self.name!r}")
        fields = kwargs.get("update_fields")
        if fields is not None:
            _refuse_derived(fields)
        super().save(*args, **kwargs)
        if not adding:
            _lift_saved(self, fields, paused=self.paused is True)

    def _do_update(self, base_qs: Any, using: Any, pk_val: Any, values: Any, *args: Any) -> Any:
        # The UPDATE of a save() leaves out the group and the queue, which an INSERT still
        # writes: the instance's may be stale (loaded before its group was created, that took
        # the channel in), and writing them back would take the channel out of its group.
        values = [v for v in values if v[0].name not in _FOLLOWS_FROM_NAME]
        return super()._do_update(base_qs, using, pk_val, values, *args)

    @property
    def short_name(self) -> str:
        """The channel's name within its queue (the name enqueue takes)."""
        return split_row_name(self.name)[1]

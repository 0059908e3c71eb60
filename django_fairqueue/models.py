"""Tables of django-fairqueue.

The models own the DDL (tables, named partial indexes, CHECK constraints), so ``makemigrations`` is
the single source of truth for the schema. Every statement that *moves* queue state lives in
``db/statements/`` and the server functions (``db/functions/``) and is run by
``django_fairqueue.db``; nothing here writes queue state through the ORM.

How the pieces fit (see docs/explanation/fairness.md):

* ``Channel`` is a tenant's virtual queue. Its model maps the name and the limits operators
  edit; the scheduler's state (counters and turns) shares the row but is written only by the
  SQL functions and is not a model field (see the class docstring). ``next_turn_at`` is both
  the earliest moment the channel may release again (rate limit) and its place in the
  round-robin: serving a channel moves it to the back by setting ``next_turn_at`` to the
  claim time.
* ``Message`` rows are the work. Only the claim, complete/fail/release and the rescuer change
  their state.
* ``ChannelDelta`` rows are counter changes written by everything *except* the claims
  (enqueue, complete, fail, rescue, admin actions, work-batch settlements). The claims fold
  them into the channel row. This keeps enqueue and completion from ever locking a channel
  row, so a view's long transaction cannot stall workers.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any, TypeVar

from django.core.exceptions import FieldError, ValidationError
from django.db import models
from django.db.models import F, Q
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from django_fairqueue.integrity import TrackedModel, TrackedQuerySet
from django_fairqueue.limits import (
    CHANNEL_NAME_MAX_LENGTH,
    GROUP_NAME_MAX_LENGTH,
    MAX_CONCURRENCY_LIMIT,
    MAX_PRIORITY,
    MAX_RELEASE_INTERVAL,
    MAX_WEIGHT,
    MIN_PRIORITY,
    QUEUE_NAME_MAX_LENGTH,
    TASK_NAME_MAX_LENGTH,
    UNIQUE_KEY_MAX_LENGTH,
    priority_error,
)
from django_fairqueue.queues import DEFAULT_QUEUE, display_name, split_row_name

_M = TypeVar("_M", bound=models.Model)


class MessageState(models.TextChoices):
    SCHEDULED = "scheduled", _("scheduled")  # waits for run_at
    READY = "ready", _("ready")  # claimable now
    RUNNING = "running", _("running")  # claimed, under a lease
    SUCCEEDED = "succeeded", _("succeeded")  # kept only when keep_result is set
    FAILED = "failed", _("failed")  # dead letter: out of attempts, or not runnable
    CANCELLED = "cancelled", _("cancelled")  # taken off the queue before it ran
    ABORTED = "aborted", _("aborted")  # stopped while running, on request


class UniqueScope(models.TextChoices):
    """How long a message's ``unique_key`` keeps other messages with that key out."""

    QUEUED = "queued", _("while queued")  # ready or scheduled (retries included)
    ACTIVE = "active", _("while queued or running")


#: States whose messages hold their unique key in ``fq_message_unique_idx`` (``UniqueScope.ACTIVE``
#: ones hold it while running too, through :class:`UniqueHold`).
UNIQUE_HELD_STATES = ("ready", "scheduled")


class BatchState(models.TextChoices):
    PENDING = "pending", _("pending")
    RUNNING = "running", _("running")
    SUCCEEDED = "succeeded", _("succeeded")
    FAILED = "failed", _("failed")


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


class Message(TrackedModel):
    """One unit of work for one channel.

    Write messages with the queue's API; an ORM write (``save()``, ``update()``, ``delete()``,
    bulk operations, ``loaddata``) is allowed and recounts its channels when it commits
    (:mod:`django_fairqueue.integrity`).
    """

    objects = TrackedQuerySet.as_manager()

    # No FK index from the field: the one index of all a channel's messages is
    # fq_message_channel_idx below, (channel_id, id), for the admin. No FK constraint either:
    # its check runs per inserted row and takes a KEY SHARE lock on the channel row, which the
    # claim holds FOR UPDATE: PostgreSQL then builds a MultiXact per row. Channels are only
    # deleted through Django, which cascades in Python.
    channel = models.ForeignKey(
        Channel,
        on_delete=models.CASCADE,
        related_name="messages",
        db_index=False,
        db_constraint=False,
    )
    task_name = models.CharField(max_length=TASK_NAME_MAX_LENGTH)
    payload = models.JSONField(default=dict)
    priority = models.SmallIntegerField(default=0)
    state = models.CharField(max_length=16, choices=MessageState.choices)
    run_at = models.DateTimeField(default=timezone.now)
    enqueued_at = models.DateTimeField(default=timezone.now)
    attempts = models.PositiveIntegerField(default=0)
    max_attempts = models.IntegerField(default=1)  # >= 1: fq_message_max_attempts_positive
    keep_result = models.BooleanField(default=False)
    # -- lease: set by the claim; every later write must present lease_token --
    lease_token = models.UUIDField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    worker_id = models.CharField(max_length=200, blank=True, default="")
    finished_at = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)
    last_error = models.JSONField(null=True, blank=True)
    #: every failed attempt's error, oldest first, at most ERROR_HISTORY of them: written by
    #: the database (the trigger fairqueue_message_errors_v1 appends each new last_error), so
    #: every path that fails an attempt (a raise, a time limit, an expired lease) keeps it
    errors = models.JSONField(null=True, blank=True, editable=False)
    # -- unique jobs: at most one message per (channel, unique_key) in the states of its scope
    # (the partial unique index fq_message_unique_idx). NULL, not "", for "no key": the
    # index holds only rows with a key, and an empty key is refused --
    unique_key = models.CharField(  # noqa: DJ001
        max_length=UNIQUE_KEY_MAX_LENGTH, null=True, blank=True
    )
    unique_scope = models.CharField(  # noqa: DJ001
        max_length=8, choices=UniqueScope.choices, null=True, blank=True
    )
    # -- abort: set by abort() on a running message; the worker's heartbeat reads it --
    abort_requested_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "fairqueue_message"
        ordering = ["id"]
        indexes = [
            # Head of each channel: highest priority first, then FIFO. Only ready rows, so the
            # index stays as small as the claimable backlog.
            models.Index(
                F("channel"),
                F("priority").desc(),
                F("id"),
                name="fq_message_ready_idx",
                condition=Q(state=MessageState.READY),
            ),
            # Delayed messages and retries waiting for their backoff: promoted when due.
            models.Index(
                F("run_at"),
                F("id"),
                name="fq_message_due_idx",
                condition=Q(state=MessageState.SCHEDULED),
            ),
            # The rescuer's scan for expired leases; also lists what is running (there is no
            # second index on running rows: every claim would pay for it).
            models.Index(
                F("lease_expires_at"),
                name="fq_message_lease_idx",
                condition=Q(state=MessageState.RUNNING),
            ),
            # Dead letters per channel (admin, retry, delete).
            models.Index(
                F("channel"),
                F("id"),
                name="fq_message_failed_idx",
                condition=Q(state=MessageState.FAILED),
            ),
            # Scheduled messages per channel (admin, purge).
            models.Index(
                F("channel"),
                F("run_at"),
                name="fq_message_sched_chan_idx",
                condition=Q(state=MessageState.SCHEDULED),
            ),
            # Retries waiting out their backoff, per channel: the admin's and status's
            # "retrying" counts them without reading the delayed messages (scheduled, never
            # run) beside them. As small as the retries waiting.
            models.Index(
                F("channel"),
                name="fq_message_retrying_idx",
                condition=Q(state=MessageState.SCHEDULED, attempts__gt=0),
            ),
            # Every message of a channel, newest or oldest first: the admin's channel filter
            # and its sort by channel, paged by (channel_id, id). A full index: each enqueue
            # and each state change writes an entry in it.
            models.Index(F("channel"), F("id"), name="fq_message_channel_idx"),
            # Every message in a state, newest or oldest first: the admin's state filter. The
            # partial indexes above order each state by something else (the claim's order, the
            # due time, the lease), and ids follow enqueue order, so without it a filter on an
            # old state walks the primary key past every newer message. Written on each enqueue
            # and each state change, except into running: a claim would write an entry for
            # every message it takes, and the running few (at most the fleet's slots) are read
            # from fq_message_lease_idx.
            models.Index(
                F("state"),
                F("id"),
                name="fq_message_state_idx",
                condition=~Q(state=MessageState.RUNNING),
            ),
            # Pruning finished rows by age.
            models.Index(
                F("finished_at"),
                name="fq_message_finished_idx",
                condition=Q(
                    state__in=[
                        MessageState.SUCCEEDED,
                        MessageState.CANCELLED,
                        MessageState.ABORTED,
                    ]
                ),
            ),
        ]
        # The database holds four of these CHECKs in equivalent, cheaper-to-read forms (same
        # names, same rows accepted; migration 0018_faster_enqueue): PostgreSQL re-reads
        # them at the start of every statement that writes messages. A change here needs a
        # migration that writes the new form the same way.
        constraints = [
            models.CheckConstraint(
                condition=Q(state__in=MessageState.values), name="fq_message_state_valid"
            ),
            models.CheckConstraint(
                condition=Q(max_attempts__gte=1), name="fq_message_max_attempts_positive"
            ),
            # A lease token exists exactly while the message runs. Settle statements rely on
            # it: matching (id, token) alone proves the row is running under that claim.
            models.CheckConstraint(
                condition=Q(
                    state=MessageState.RUNNING,
                    lease_token__isnull=False,
                    lease_expires_at__isnull=False,
                )
                | (~Q(state=MessageState.RUNNING) & Q(lease_token__isnull=True)),
                name="fq_message_lease_iff_running",
            ),
            models.CheckConstraint(condition=~Q(task_name=""), name="fq_message_task_name"),
            # What enqueue accepts, for every other writer too (Model.save(), update()).
            models.CheckConstraint(
                condition=Q(priority__gte=MIN_PRIORITY, priority__lte=MAX_PRIORITY),
                name="fq_message_priority_range",
            ),
            # Unique jobs. Only keyed rows are in the index (an enqueue without a key writes
            # no entry), and only while they wait (ready or scheduled), whatever their scope:
            # the claim takes a message out of it, so a claim writes no entry of it. A running
            # message of scope 'active' holds its key through UniqueHold, written at enqueue.
            # The enqueue's ON CONFLICT repeats this predicate word for word
            # (db/functions/enqueue.sql), so it must not change without the SQL.
            models.UniqueConstraint(
                F("channel"),
                F("unique_key"),
                name="fq_message_unique_idx",
                condition=Q(unique_key__isnull=False, state__in=UNIQUE_HELD_STATES),
            ),
            models.CheckConstraint(
                condition=Q(unique_key__isnull=True, unique_scope__isnull=True)
                | Q(unique_key__isnull=False, unique_scope__in=UniqueScope.values),
                name="fq_message_unique_scope",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.task_name}#{self.pk} ({self.state})"

    def clean(self) -> None:
        super().clean()
        error = priority_error(self.priority)
        if error is not None:
            raise ValidationError({"priority": error})

    def save(self, *args: Any, **kwargs: Any) -> None:
        # the range every enqueue checks: a priority past it would sort the channel's head wrongly
        error = priority_error(self.priority)
        if error is not None:
            raise ValueError(f"message {self.pk or '(new)'}: {error}")
        super().save(*args, **kwargs)


class ChannelDelta(TrackedModel):
    """A pending change to a channel's counters, folded into the channel row by the claim.

    Writers other than the claim append here instead of updating the channel row, so they
    never wait on (or block) a channel lock. The true counter is the channel's column plus the
    sum of its pending deltas.
    """

    objects = TrackedQuerySet.as_manager()

    channel = models.ForeignKey(  # no FK constraint: see Message.channel
        Channel, on_delete=models.CASCADE, related_name="+", db_index=False, db_constraint=False
    )
    ready = models.IntegerField(default=0, db_default=0)
    scheduled = models.IntegerField(default=0, db_default=0)
    running = models.IntegerField(default=0, db_default=0)
    failed = models.IntegerField(default=0, db_default=0)
    succeeded = models.IntegerField(default=0, db_default=0)
    # True when folding this delta may make the channel claimable: it adds ready messages to a
    # channel that counts none, or frees slots of a channel with a concurrency cap. The claim
    # folds waking deltas before it picks channels; the others (completions on uncapped
    # channels, and an enqueue's to a channel that already counts ready messages, which
    # change no eligibility) wait for the workers' maintenance loop, which folds everything.
    wake = models.BooleanField(default=True, db_default=True)
    # A marker (all counts zero, wake false): something brought the channel's count to zero or
    # below (a claim took all it counted, a fold of removals) while quiet enqueue deltas
    # (wake false) may count what waits, some perhaps of enqueues still in flight. A claim's
    # fold adds them once no enqueue holds the channel's name (db/functions/fold_counters.sql,
    # fairqueue_fold_deltas_v1's drained mode); one per channel at most.
    drained = models.BooleanField(default=False, db_default=False)
    # The channel may have pending work batches now (planned, retried, failed or released
    # ones): the fold sets the channel's batch_pending flag.
    batch_pending = models.BooleanField(default=False, db_default=False)
    # Written by an enqueue to a channel with max_backlog: a deferred constraint trigger checks
    # the bound when the enqueuing transaction commits (db/functions/backlog.sql).
    backlog_check = models.BooleanField(default=False, db_default=False)
    # Fairness by time: seconds the settled messages ran (as their workers measured them,
    # bounded by the database's clock), and how many messages the claim charged an estimate
    # for that this delta settles; the fold puts the channel's virtual tag right with both.
    run_seconds = models.FloatField(default=0.0, db_default=0.0)
    run_count = models.IntegerField(default=0, db_default=0)

    class Meta:
        db_table = "fairqueue_channel_delta"
        indexes = [
            models.Index(F("channel"), name="fq_delta_channel_idx"),
            # Waking deltas and `drained` markers: what a claim's housekeeping has to fold,
            # found by one probe.
            models.Index(
                F("id"), name="fq_delta_wake_idx", condition=Q(wake=True) | Q(drained=True)
            ),
            # Deltas that take ready messages out (a cancel, purge, delete or abort not folded
            # yet): an enqueue's wake-up decision subtracts them from the channel's counted
            # ready messages, with one probe of an index that is almost always empty.
            models.Index(F("channel"), name="fq_delta_lowered_idx", condition=Q(ready__lt=0)),
            # Quiet enqueue deltas (ready messages for a channel that counted some already):
            # what a claim that drains a channel, or the fold of its marker, adds first.
            models.Index(
                F("channel"), name="fq_delta_quiet_idx", condition=Q(ready__gt=0, wake=False)
            ),
        ]
        constraints = [
            # one `drained` marker per channel (writers insert it ON CONFLICT DO NOTHING)
            models.UniqueConstraint(
                fields=["channel"], condition=Q(drained=True), name="fq_delta_drained_uniq"
            ),
        ]

    def __str__(self) -> str:
        return f"channel {self.channel_id}: ready {self.ready:+d}, running {self.running:+d}"


class UniqueHold(models.Model):
    """Which message of scope ``active`` last took a channel's unique key.

    ``fq_message_unique_idx`` admits one waiting (ready or scheduled) message per channel and
    key; a message of scope ``active`` also keeps the key while it runs, through this row,
    written when it enters the queue (its enqueue, a replace that gives it the scope, an
    operator's retry), never by the claim. The row holds only while its message is of scope
    ``active`` and ready, scheduled or running: an enqueue that meets it checks that after
    inserting its own message, and takes over a row whose message holds no more. Rows whose
    message finished or is gone are deleted by the pruner (``db/functions/unique_holds.sql``,
    ``fairqueue_unique_holder_v1``).
    """

    pk = models.CompositePrimaryKey("channel_id", "unique_key")
    # No foreign keys: a hold names ids and is checked against the message row it names.
    channel_id = models.BigIntegerField()
    unique_key = models.CharField(max_length=UNIQUE_KEY_MAX_LENGTH)
    message_id = models.BigIntegerField()

    class Meta:
        db_table = "fairqueue_unique_hold"

    def __str__(self) -> str:
        return f"channel {self.channel_id} key {self.unique_key!r}: message {self.message_id}"


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


class WorkBatch(TrackedModel):
    """A contiguous id range of a big table, processed as one unit by one worker."""

    objects = TrackedQuerySet.as_manager()

    channel = models.ForeignKey(  # no FK constraint: see Message.channel
        Channel,
        on_delete=models.CASCADE,
        related_name="work_batches",
        db_index=False,
        db_constraint=False,
    )
    job_name = models.CharField(max_length=200)
    start_id = models.BigIntegerField()
    end_id = models.BigIntegerField(help_text=_("Inclusive."))
    row_count = models.BigIntegerField(default=0, help_text=_("Rows in the range when planned."))
    state = models.CharField(max_length=16, choices=BatchState.choices, default=BatchState.PENDING)
    run_at = models.DateTimeField(default=timezone.now)
    attempts = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField(default=3)
    lease_token = models.UUIDField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    worker_id = models.CharField(max_length=200, blank=True, default="")
    last_error = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    rows_processed = models.BigIntegerField(default=0)

    class Meta:
        db_table = "fairqueue_work_batch"
        verbose_name_plural = _("work batches")
        ordering = ["job_name", "start_id"]
        indexes = [
            models.Index(
                F("channel"),
                F("run_at"),
                F("id"),
                name="fq_batch_pending_idx",
                condition=Q(state=BatchState.PENDING),
            ),
            models.Index(
                F("lease_expires_at"),
                name="fq_batch_lease_idx",
                condition=Q(state=BatchState.RUNNING),
            ),
            # The batch claim counts a channel's running batches against its max_concurrency.
            models.Index(
                F("channel"),
                name="fq_batch_running_idx",
                condition=Q(state=BatchState.RUNNING),
            ),
            models.Index(F("job_name"), F("state"), name="fq_batch_job_idx"),
        ]
        constraints = [
            # Planning the same job twice must not duplicate batches.
            models.UniqueConstraint(
                fields=["job_name", "start_id"], name="fq_batch_job_start_uniq"
            ),
            models.CheckConstraint(condition=Q(end_id__gte=F("start_id")), name="fq_batch_range"),
            models.CheckConstraint(
                condition=Q(state__in=BatchState.values), name="fq_batch_state_valid"
            ),
            models.CheckConstraint(
                condition=Q(max_attempts__gte=1), name="fq_batch_max_attempts_positive"
            ),
            # A lease exists exactly while the batch runs: settling under a token can then
            # never touch a batch that is pending, finished or claimed again under a new one.
            models.CheckConstraint(
                condition=(Q(state=BatchState.RUNNING) & Q(lease_token__isnull=False))
                | (~Q(state=BatchState.RUNNING) & Q(lease_token__isnull=True)),
                name="fq_batch_lease_iff_running",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.job_name}[{self.start_id}..{self.end_id}] ({self.state})"


class WorkerState(models.TextChoices):
    RUNNING = "running", _("running")
    STOPPED = "stopped", _("stopped")  # deregistered on a graceful stop
    DEAD = "dead", _("dead")  # no beat for WORKER_DEAD_AFTER; its leases were expired


class WorkerRecord(models.Model):
    """A worker process in the registry (:mod:`django_fairqueue.runtime.worker_registry`).

    Written only by the registry's statements (:mod:`django_fairqueue.db.worker_store`): a worker
    registers before it claims, beats every ``WORKER_HEARTBEAT`` seconds and marks itself stopped on
    a graceful stop; the maintenance loop marks a silent one dead. Rows of stopped and dead workers
    are kept for a day (the pruner), so an operator can see what ran where.
    """

    worker_id = models.CharField(max_length=200, unique=True)
    host = models.CharField(max_length=255)
    pid = models.IntegerField()
    version = models.CharField(max_length=50)
    concurrency = models.IntegerField()
    #: channel filters (--channels / --exclude-channels); empty lists: every channel
    channels = models.JSONField(default=list)
    exclude_channels = models.JSONField(default=list)
    #: the queues it claims from (--queues), in its order; NULL: every queue
    queues = models.JSONField(null=True, blank=True, default=None)
    state = models.CharField(max_length=16, choices=WorkerState.choices)
    started_at = models.DateTimeField()
    heartbeat_at = models.DateTimeField()
    last_claim_at = models.DateTimeField(null=True, blank=True)
    #: messages running at the last beat, and handled since the process started
    running = models.IntegerField(default=0)
    handled = models.BigIntegerField(default=0)
    stopped_at = models.DateTimeField(null=True, blank=True)
    #: how it learns of new messages: "notify" (its LISTEN was seen to work), "polling: <why>"
    #: (it checked, no notification came through: it polls on purpose), "" (not known: it
    #: was started with --no-listen, or has not checked yet)
    wakeups = models.CharField(max_length=300, blank=True, default="", db_default="")
    #: ``host:pid`` of the ``runfairworker --processes`` supervisor that started it ("" for a
    #: worker started on its own): the admin lists a supervisor's children together
    supervisor = models.CharField(max_length=300, blank=True, default="", db_default="")
    #: a supervised worker's slot as its supervisor saw it when starting this process
    #: (``runfairworker --processes``): {"slot", "restarts", "young_deaths", "crash_loop",
    #: "exits": the last few, newest last}; NULL: not supervised
    supervision = models.JSONField(null=True, blank=True, default=None)

    class Meta:
        db_table = "fairqueue_worker"
        ordering = ["-heartbeat_at"]
        indexes = [
            # the dead-worker check: registered workers by their last beat
            models.Index(
                F("heartbeat_at"),
                name="fq_worker_beat_idx",
                condition=Q(state=WorkerState.RUNNING),
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(state__in=WorkerState.values), name="fq_worker_state_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.worker_id} ({self.state})"


_now = timezone.now  # the Schedule model has a field named timezone


class MissedPolicy(models.TextChoices):
    LATEST = "latest", _("run once (the latest missed slot)")
    SKIP = "skip", _("skip missed slots")
    CATCH_UP = "catch_up", _("catch up (each missed slot, up to a bound)")


class ScheduleSource(models.TextChoices):
    CODE = "code", _("code")  # @periodic or FAIRQUEUE['SCHEDULES']: synced by workers
    ADMIN = "admin", _("admin")  # an operator's schedule for one channel


class Schedule(models.Model):
    """A periodic schedule: which task to enqueue into which channel, on what cron.

    The model maps what operators and code declare. The firing state shares the row but is not
    mapped, exactly like a channel's counters: ``next_fire_at``, ``last_slot_at``,
    ``last_fired_at``, ``last_message_id`` and ``fired_spec`` are written only by the firing
    statements (``db/statements/schedules.sql``), so an admin save or an ORM ``update()`` can never
    move a schedule's slots. ``spec`` is a generated column (cron, timezone, enabled); when an edit
    changes it, the schedule no longer matches the ``fired_spec`` its state was computed for, and
    the next firing pass computes its next slot afresh from the database's clock (no catching up
    over an edit or a pause). Read the state with :func:`django_fairqueue.schedules.states`. See
    docs/howto/periodic-tasks.md.
    """

    name = models.CharField(max_length=200)
    channel = models.ForeignKey(  # no FK constraint: see Message.channel
        Channel,
        on_delete=models.CASCADE,
        related_name="schedules",
        db_index=False,
        db_constraint=False,
    )
    task_name = models.CharField(max_length=TASK_NAME_MAX_LENGTH)
    args = models.JSONField(default=list, blank=True)
    kwargs = models.JSONField(default=dict, blank=True)
    cron = models.CharField(
        max_length=200,
        help_text=_("Five fields: minute hour day-of-month month day-of-week, or @daily etc."),
    )
    timezone = models.CharField(
        max_length=64,
        default="UTC",
        help_text=_("IANA name, e.g. Europe/Berlin: the cron is read in this timezone."),
    )
    missed = models.CharField(
        max_length=16,
        choices=MissedPolicy.choices,
        default=MissedPolicy.LATEST,
        help_text=_("What to do with slots that passed while nothing fired."),
    )
    catch_up_max = models.PositiveSmallIntegerField(
        default=10, help_text=_("With catch up: at most this many missed slots are fired.")
    )
    jitter = models.DurationField(
        default=timedelta(0),
        help_text=_("Delay each slot's message by a fixed fraction of this (0: none)."),
    )
    priority = models.SmallIntegerField(
        null=True, blank=True, help_text=_("Empty: the task's priority.")
    )
    enabled = models.BooleanField(default=True)
    source = models.CharField(
        max_length=8,
        choices=ScheduleSource.choices,
        default=ScheduleSource.ADMIN,
        editable=False,
    )
    created_at = models.DateTimeField(default=_now, editable=False)

    class Meta:
        db_table = "fairqueue_schedule"
        ordering = ["channel__name", "name"]
        constraints = [
            models.UniqueConstraint(fields=["channel", "name"], name="fq_schedule_channel_name"),
            # code schedules are synced by name
            models.UniqueConstraint(
                fields=["name"],
                condition=Q(source=ScheduleSource.CODE),
                name="fq_schedule_code_name",
            ),
            models.CheckConstraint(
                condition=Q(missed__in=MissedPolicy.values), name="fq_schedule_missed_valid"
            ),
            models.CheckConstraint(
                condition=Q(catch_up_max__gte=1, catch_up_max__lte=1000),
                name="fq_schedule_catch_up_range",
            ),
            models.CheckConstraint(
                condition=Q(jitter__gte=timedelta(0), jitter__lte=timedelta(hours=24)),
                name="fq_schedule_jitter_range",
            ),
            models.CheckConstraint(
                condition=Q(source__in=ScheduleSource.values), name="fq_schedule_source_valid"
            ),
            models.CheckConstraint(condition=~Q(task_name=""), name="fq_schedule_task_name"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.cron} {self.timezone})"

    def clean(self) -> None:
        super().clean()
        # what firing checks: a priority the enqueue would refuse never fires
        if self.priority is not None:
            error = priority_error(self.priority)
            if error is not None:
                raise ValidationError({"priority": error})


class ScheduleFire(models.Model):
    """One fired slot of a schedule: the unique key that makes a slot fire once.

    The firing statement inserts ``(schedule, slot_at)`` with ``ON CONFLICT DO NOTHING`` in
    the transaction that enqueues the slot's message, so however many workers fire at once,
    and whatever they restart or lose, the database lets one of them have each slot.
    ``message_id`` is the slot's message. Rows are pruned after a day; a schedule's slots
    only move forward, so an old slot is never fired again.
    """

    # No FK constraint: its check would take a KEY SHARE lock on the schedule row, which
    # deleting a channel (its schedules cascade) then waits on while holding the channel's
    # name lock, that the firing transaction waits for in turn.
    schedule = models.ForeignKey(
        Schedule,
        on_delete=models.CASCADE,
        related_name="fires",
        db_index=False,
        db_constraint=False,
    )
    slot_at = models.DateTimeField()
    fired_at = models.DateTimeField()
    message_id = models.BigIntegerField(null=True, blank=True)

    class Meta:
        db_table = "fairqueue_schedule_fire"
        ordering = ["-slot_at"]
        constraints = [
            models.UniqueConstraint(fields=["schedule", "slot_at"], name="fq_fire_schedule_slot"),
        ]
        indexes = [models.Index(F("fired_at"), name="fq_fire_fired_idx")]

    def __str__(self) -> str:
        return f"schedule {self.schedule_id} @ {self.slot_at:%Y-%m-%d %H:%M}"

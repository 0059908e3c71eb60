"""Messages, the counter deltas that everything but the claims writes, and the holds of unique
jobs."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import F, Q
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from django_fairqueue.integrity import TrackedModel, TrackedQuerySet
from django_fairqueue.limits import (
    MAX_PRIORITY,
    MIN_PRIORITY,
    TASK_NAME_MAX_LENGTH,
    UNIQUE_KEY_MAX_LENGTH,
    priority_error,
)
from django_fairqueue.models.channels import Channel


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

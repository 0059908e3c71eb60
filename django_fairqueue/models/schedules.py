"""Periodic schedules and the slots they fired."""

from __future__ import annotations

from datetime import timedelta

from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import F, Q
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from django_fairqueue.limits import TASK_NAME_MAX_LENGTH, priority_error
from django_fairqueue.models.channels import Channel

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

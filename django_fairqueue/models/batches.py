"""Work batches: id ranges of a big table, each processed as one unit."""

from __future__ import annotations

from django.db import models
from django.db.models import F, Q
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from django_fairqueue.integrity import TrackedModel, TrackedQuerySet
from django_fairqueue.models.channels import Channel


class BatchState(models.TextChoices):
    PENDING = "pending", _("pending")
    RUNNING = "running", _("running")
    SUCCEEDED = "succeeded", _("succeeded")
    FAILED = "failed", _("failed")


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

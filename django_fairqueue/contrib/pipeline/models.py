"""The pipeline's model: a planned job and the formula set it is pinned to.

Its table, ``fairqueue_pipeline_job``, was created by the queue's own migrations before the
pipeline became an app of its own; this app took the model over without moving the table.
"""

from __future__ import annotations

from typing import Any

from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from django_fairqueue.models import BatchState


class PipelineJob(models.Model):
    """A planned pipeline job (``pipeline:tenant``) and the formula set it is pinned to.

    Planning pins the tenant's formulas as they are (their content hash is the ``version``)
    and the date ``TODAY()`` gives; every batch of the job computes with exactly those, even
    if the tenant edits a formula meanwhile. Batches add their rules' error counts.

    A run is the job's batches since it was last planned from the start. Once all of them
    succeeded, the run's formula version, output and watermark become the job's *last
    successful run* (``succeeded_*``), which ``fairpipeline recompute`` compares the tenant's
    formulas and changed rows with.
    """

    job_name = models.CharField(max_length=200, unique=True)
    pipeline = models.CharField(max_length=100)
    tenant = models.CharField(max_length=200)
    version = models.CharField(max_length=16, help_text=_("Content hash of the formula set."))
    formulas = models.JSONField(
        null=True, blank=True, help_text=_("The pinned formulas: [name, expression] pairs.")
    )
    today = models.DateField(help_text=_("What TODAY() is for every batch of the job."))
    errors = models.JSONField(
        default=dict, blank=True, help_text=_("Error values written, per rule.")
    )
    aggregates = models.JSONField(
        null=True, blank=True, help_text=_("The tenant aggregates its batches use (phase one).")
    )
    created_at = models.DateTimeField(default=timezone.now)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    output = models.CharField(
        max_length=10,
        default="sink",
        help_text=_("Where the job writes: the pipeline's sink, or its long sink (long)."),
    )
    changed_since = models.TextField(  # noqa: DJ001  (NULL: none, unlike any text)
        null=True,
        blank=True,
        help_text=_(
            "A recompute of changed rows: only rows whose changed column is above this. "
            "Empty: every row."
        ),
    )
    watermark = models.TextField(  # noqa: DJ001  (NULL: none, unlike any text)
        null=True,
        blank=True,
        help_text=_("The highest value of the source's changed column when the run was planned."),
    )
    succeeded_version = models.CharField(
        max_length=16, blank=True, help_text=_("The formula version of the last successful run.")
    )
    succeeded_output = models.CharField(max_length=10, blank=True)
    succeeded_watermark = models.TextField(  # noqa: DJ001  (NULL: none, unlike any text)
        null=True,
        blank=True,
        help_text=_("The watermark of the last successful run: later changes are not in it."),
    )
    succeeded_at = models.DateTimeField(
        null=True, blank=True, help_text=_("When the last successful run was seen complete.")
    )

    class Meta:
        db_table = "fairqueue_pipeline_job"
        ordering = ["job_name"]

    def __str__(self) -> str:
        return f"{self.job_name} @ {self.version}"

    def record_success(self, batches: Any, *, save: bool = True) -> None:
        """Make the job's run its last successful run if the run is complete: the job is not
        cancelled and every batch of ``batches`` (a queryset of the run's work batches, or of
        those still to succeed) succeeded. Call with the job's row locked. ``save=False`` sets
        the fields without writing them (what a dry run decides with)."""
        # the states other than succeeded by name: each is a probe of the (job, state) index
        unsettled = [state for state in BatchState.values if state != BatchState.SUCCEEDED]
        if self.cancelled_at is not None or batches.filter(state__in=unsettled).exists():
            return
        seen = (self.succeeded_version, self.succeeded_output, self.succeeded_watermark)
        if (
            self.succeeded_at is not None
            and self.succeeded_at >= self.created_at  # recorded for this run already
            and seen == (self.version, self.output, self.watermark)
        ):
            return
        self.succeeded_version = self.version
        self.succeeded_output = self.output
        self.succeeded_watermark = self.watermark
        self.succeeded_at = timezone.now()
        if save:
            self.save(
                update_fields=[
                    "succeeded_version",
                    "succeeded_output",
                    "succeeded_watermark",
                    "succeeded_at",
                ]
            )

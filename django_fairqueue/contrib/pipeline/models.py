"""The pipeline's model: a planned job and the formula set it is pinned to.

Its table, ``fairqueue_pipeline_job``, was created by the queue's own migrations before the
pipeline became an app of its own; this app took the model over without moving the table.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _


class PipelineJob(models.Model):
    """A planned pipeline job (``pipeline:tenant``) and the formula set it is pinned to.

    Planning pins the tenant's formulas as they are (their content hash is the ``version``)
    and the date ``TODAY()`` gives; every batch of the job computes with exactly those, even
    if the tenant edits a formula meanwhile. Batches add their rules' error counts.
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

    class Meta:
        db_table = "fairqueue_pipeline_job"
        ordering = ["job_name"]

    def __str__(self) -> str:
        return f"{self.job_name} @ {self.version}"

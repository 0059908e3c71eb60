from __future__ import annotations

from django.db import models


class Document(models.Model):
    """A tenant's uploaded document, processed in the background by ``documents.process``."""

    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        PROCESSING = "processing", "Processing"
        DONE = "done", "Done"
        FAILED = "failed", "Failed"

    #: The fairness key: each tenant's documents form one channel of the queue.
    tenant = models.CharField(max_length=100)
    title = models.CharField(max_length=200)
    body = models.TextField(blank=True)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING)
    created_at = models.DateTimeField(auto_now_add=True)
    processed_at = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "status"], name="document_tenant_status")]

    def __str__(self) -> str:
        return f"{self.tenant}: {self.title}"

"""Background work of the example site. Workers import this module (each app's ``tasks``)."""

from __future__ import annotations

import hashlib
import time

from django.utils import timezone

from django_fairqueue import task
from documents.models import Document

#: Simulated processing time per document (OCR, thumbnails...), seconds.
PROCESSING_SECONDS = 0.01


@task(name="documents.process", max_attempts=3)
def process_document(document_id: int) -> dict[str, object]:
    """'Process' one document: count its words and fingerprint it."""
    document = Document.objects.filter(pk=document_id).first()
    if document is None:  # deleted since upload: nothing to do
        return {"skipped": True}
    Document.objects.filter(pk=document_id).update(status=Document.Status.PROCESSING)
    time.sleep(PROCESSING_SECONDS)
    result = {
        "words": len(document.body.split()),
        "sha256": hashlib.sha256(document.body.encode()).hexdigest()[:16],
    }
    Document.objects.filter(pk=document_id).update(
        status=Document.Status.DONE, processed_at=timezone.now(), result=result
    )
    return result

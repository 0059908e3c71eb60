from __future__ import annotations

from django.contrib import messages
from django.db import transaction
from django.db.models import Count, Max, Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods

from django_fairqueue import ChannelFull, EnqueueRequest, InvalidChannel, enqueue_many
from documents.forms import UploadForm
from documents.models import Document

RECENT = 50


@require_GET
def document_list(request: HttpRequest) -> HttpResponse:
    """Per-tenant progress, and the most recent documents (of one tenant with ?tenant=)."""
    Status = Document.Status
    tenants = (
        Document.objects.values("tenant")
        .annotate(
            total=Count("id"),
            **{
                status.value: Count("id", filter=Q(status=status))
                for status in (Status.PENDING, Status.PROCESSING, Status.DONE, Status.FAILED)
            },
            last_processed=Max("processed_at"),
        )
        .order_by("tenant")
    )
    recent = Document.objects.defer("body", "result")
    tenant = request.GET.get("tenant")
    if tenant and "\x00" in tenant:
        # no tenant's name holds a NUL (PostgreSQL text cannot): nobody's documents
        recent = recent.none()
    elif tenant:
        recent = recent.filter(tenant=tenant)
    return render(
        request,
        "documents/list.html",
        {"tenants": tenants, "recent": recent[:RECENT], "tenant": tenant, "form": UploadForm()},
    )


@require_http_methods(["GET", "POST"])
def upload(request: HttpRequest) -> HttpResponse:
    """Store the documents and queue their processing in one transaction: both or neither."""
    form = UploadForm(request.POST or None, request.FILES or None)
    if request.method == "POST" and form.is_valid():
        tenant = form.cleaned_data["tenant"]
        try:
            with transaction.atomic():
                documents = Document.objects.bulk_create(form.documents())
                # One round trip for the whole upload, in the same transaction as the rows.
                enqueue_many(
                    [
                        EnqueueRequest("documents.process", [d.pk], channel=d.tenant)
                        for d in documents
                    ]
                )
        except ChannelFull:
            messages.error(request, f"{tenant} has too much work queued already; try again later.")
        except InvalidChannel as exc:  # a name the queue refuses (say, a control character)
            form.add_error("tenant", str(exc))
        else:
            messages.success(request, f"Queued {len(documents)} document(s) for {tenant}.")
            return redirect("documents:list")
    return render(request, "documents/upload.html", {"form": form})

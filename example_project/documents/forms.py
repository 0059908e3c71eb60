from __future__ import annotations

from typing import Any

from django import forms
from django.core.files.uploadedfile import UploadedFile

from documents.models import Document


class MultipleFileInput(forms.ClearableFileInput):
    allow_multiple_selected = True


class MultipleFileField(forms.FileField):
    """A file field that accepts several files (Django's documented recipe)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("widget", MultipleFileInput())
        super().__init__(*args, **kwargs)

    def clean(self, data: Any, initial: Any = None) -> list[UploadedFile]:
        if isinstance(data, list | tuple):
            return [super(MultipleFileField, self).clean(item, initial) for item in data]
        cleaned = super().clean(data, initial)
        return [cleaned] if cleaned else []


class UploadForm(forms.Form):
    """One document typed in, or many uploaded as files; all for one tenant."""

    tenant = forms.CharField(max_length=100, help_text="Who the documents belong to.")
    title = forms.CharField(max_length=200, required=False)
    body = forms.CharField(widget=forms.Textarea(attrs={"rows": 4}), required=False)
    files = MultipleFileField(required=False, help_text="Each file becomes one document.")

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        if not cleaned.get("files") and not cleaned.get("title"):
            raise forms.ValidationError("Give a title (and text), or choose files.")
        return cleaned

    def documents(self) -> list[Document]:
        """Unsaved documents for the cleaned data."""
        tenant = self.cleaned_data["tenant"]
        files: list[UploadedFile] = self.cleaned_data["files"]
        if not files:
            title, body = self.cleaned_data["title"], self.cleaned_data["body"]
            return [Document(tenant=tenant, title=title, body=body)]
        return [
            Document(
                tenant=tenant,
                title=_text(upload.name or "untitled")[:200],
                body=_text(upload.read().decode("utf-8", errors="replace")),
            )
            for upload in files
        ]


def _text(value: str) -> str:
    """``value`` storable in a PostgreSQL text column, which cannot hold NUL: a binary upload
    (a PDF) has them. Each becomes U+FFFD, as undecodable bytes already do."""
    return value.replace("\x00", "\ufffd")

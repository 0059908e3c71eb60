from django.contrib import admin

from documents.models import Document


@admin.register(Document)
class DocumentAdmin(admin.ModelAdmin):
    list_display = ["title", "tenant", "status", "created_at", "processed_at"]
    list_filter = ["status", "tenant"]
    search_fields = ["title", "tenant"]
    readonly_fields = ["created_at", "processed_at", "result"]

import json

from django.contrib import admin
from django.utils.html import format_html

from .models import DataResult, DataResultLong, TenantFormula


@admin.register(TenantFormula)
class TenantFormulaAdmin(admin.ModelAdmin):
    list_display = ["tenant", "position", "target", "expression"]
    list_filter = ["tenant"]


@admin.register(DataResult)
class DataResultAdmin(admin.ModelAdmin):
    """The pipeline's output, row by row: typed columns and every other rule's value."""

    list_display = ["id", "tenant", "subtotal", "total", "band", "rules"]
    list_filter = ["tenant"]
    readonly_fields = ["id", "tenant", "subtotal", "total", "band", "results_display"]
    exclude = ["results"]
    show_full_result_count = False

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    @admin.display(description="rules in results")
    def rules(self, obj):
        return len(obj.results or {})

    @admin.display(description="results")
    def results_display(self, obj):
        return format_html("<pre>{}</pre>", json.dumps(obj.results, indent=2, sort_keys=True))


@admin.register(DataResultLong)
class DataResultLongAdmin(admin.ModelAdmin):
    """The pipeline's long output (plan --output long): one row per data object and rule."""

    list_display = ["row_id", "tenant", "rule", "value", "number"]
    list_filter = ["tenant"]
    search_fields = ["=rule"]
    show_full_result_count = False

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

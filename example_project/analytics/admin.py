from django.contrib import admin

from .models import TenantFormula


@admin.register(TenantFormula)
class TenantFormulaAdmin(admin.ModelAdmin):
    list_display = ["tenant", "position", "target", "expression"]
    list_filter = ["tenant"]

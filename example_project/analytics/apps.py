from django.apps import AppConfig


class AnalyticsConfig(AppConfig):
    """Seed 002's workload: per-tenant formulas over a big data-objects table, on Spark."""

    name = "analytics"
    default_auto_field = "django.db.models.BigAutoField"

from django.apps import AppConfig


class PipelineTestConfig(AppConfig):
    """Tables and a pipeline for tests/test_pipeline.py (no migrations: created by syncdb)."""

    name = "tests.pipelineapp"
    label = "pipelinetest"
    default_auto_field = "django.db.models.BigAutoField"

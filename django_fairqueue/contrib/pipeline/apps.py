from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class FairQueuePipelineConfig(AppConfig):
    """The Spark data pipeline: ``manage.py fairpipeline``, the *Pipeline jobs* admin, and
    ``runfairworker --pipelines`` (a companion of the worker, see
    :mod:`django_fairqueue.worker.extensions`). Install it after ``"django_fairqueue"``."""

    name = "django_fairqueue.contrib.pipeline"
    label = "fairqueue_pipeline"
    verbose_name = _("Fair queue pipeline")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_fairqueue.contrib.pipeline import (
            checks,  # noqa: F401  (registers the system checks)
        )
        from django_fairqueue.contrib.pipeline.worker import PipelineExtension
        from django_fairqueue.worker import extensions

        extensions.register(PipelineExtension())

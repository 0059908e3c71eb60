from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class FairQueueBenchConfig(AppConfig):
    """``manage.py fairbench``; no models."""

    name = "django_fairqueue.contrib.bench"
    label = "fairqueue_bench"
    verbose_name = _("Fair queue benchmark")

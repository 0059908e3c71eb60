from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class FairQueueConfig(AppConfig):
    name = "django_fairqueue"
    label = "fairqueue"
    verbose_name = _("Fair queue")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_fairqueue import (
            checks,  # noqa: F401  (registers the system checks)
            integrity,
        )

        integrity.connect()

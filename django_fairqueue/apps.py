from django.apps import AppConfig
from django.conf import settings
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

        # Django registers its task checks (each backend's check(): fairqueue.E102, bad
        # OPTIONS) when its tasks framework is first imported, which a project's task modules
        # may not be before `manage.py check` runs: import it here when the backend is used.
        tasks = getattr(settings, "TASKS", None)
        if isinstance(tasks, dict) and any(
            str(entry.get("BACKEND", "")).startswith("django_fairqueue.")
            for entry in tasks.values()
            if isinstance(entry, dict)
        ):
            import django_fairqueue.tasks.django_compat  # noqa: F401

        from django.db.models.signals import post_delete

        from django_fairqueue.models import ChannelGroup

        # however a group is deleted (admin, ORM, queryset), this process stops assuming it
        # exists, so the next enqueue naming it creates it again
        post_delete.connect(
            _forget_groups, sender=ChannelGroup, dispatch_uid="fairqueue_forget_groups"
        )


def _forget_groups(**kwargs: object) -> None:
    from django_fairqueue.db import channel_store

    channel_store.forget_groups()

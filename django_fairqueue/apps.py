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

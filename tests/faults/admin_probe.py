"""Load the admin's pages in a process of its own, against DATABASE_URL (PgBouncer in the
pooler scenario), and print {page: HTTP status} as JSON; ``python -m tests.faults.admin_probe``.

A superuser is created (or reused) in that database, and the pages are requested through
Django's test client: every query of a page goes through the database the URL names."""

from __future__ import annotations

import json
import os


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.test import Client
    from django.urls import reverse

    user = User.objects.filter(username="pooled-admin").first()
    if user is None:
        user = User.objects.create_superuser("pooled-admin", password="pw")
    client = Client()
    client.force_login(user)
    pages = [
        "admin:index",
        "admin:fairqueue_channel_changelist",
        "admin:fairqueue_channel_dashboard",
        "admin:fairqueue_channel_dashboard_data",
        "admin:fairqueue_message_changelist",
        "admin:fairqueue_workbatch_changelist",
        "admin:fairqueue_workerrecord_changelist",
    ]
    print(json.dumps({name: client.get(reverse(name)).status_code for name in pages}))


if __name__ == "__main__":
    main()

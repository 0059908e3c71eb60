"""Use the queue in a database of its own, in a process of its own (tests/owndb_settings.py):
enqueue, drain with a worker, read the admin's lists and ``fairqueue status``; print what was
seen as JSON. ``python -m tests.owndb_probe`` (tests/test_own_database.py runs it)."""

from __future__ import annotations

import io
import json
import os


def main() -> None:
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.owndb_settings"
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import Client
    from django.urls import reverse

    from django_fairqueue.models import Channel, Message
    from django_fairqueue.testing import drain
    from tests import fairtasks

    ids = [fairtasks.record.enqueue(f"m{i}", channel=f"own-{i % 3}") for i in range(12)]
    ran = drain()
    user = User.objects.filter(username="own-admin").first()
    if user is None:
        user = User.objects.create_superuser("own-admin", password="pw")
    client = Client()
    client.force_login(user)
    page = client.get(reverse("admin:fairqueue_message_changelist") + "?state__exact=succeeded")
    status = io.StringIO()
    call_command("fairqueue", "status", "--json", stdout=status)
    print(
        json.dumps(
            {
                "ids": ids,
                "ran": ran,
                "succeeded": Message.objects.filter(pk__in=ids, state="succeeded").count(),
                "message_db": Message.objects.db,
                "channels": sorted(Channel.objects.values_list("name", flat=True)),
                "admin_status": page.status_code,
                "admin_lists_them": all(f">{i}<" in page.content.decode() for i in ids),
                "status_channels": json.loads(status.getvalue())["totals"]["channels"],
            }
        )
    )


if __name__ == "__main__":
    main()

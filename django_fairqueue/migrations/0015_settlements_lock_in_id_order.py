"""Completions lock their rows in id order (an ``abort()`` waiting for the same rows could
deadlock with them), and ``fairqueue_unique_key_held_v1`` is new: the ``settle`` and
``unique_holds`` families.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0014_periodic_schedules")]

    operations = [
        migrations.RunSQL(
            migrations.RunSQL.noop, "DROP FUNCTION fairqueue_unique_key_held_v1(bigint, text);"
        ),
        InstallFunctions("unique_holds", "settle"),
    ]

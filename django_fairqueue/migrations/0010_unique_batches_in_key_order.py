"""Unique batches in key order: ``fairqueue_enqueue_unique_v1`` inserts keyed messages, and
handles keys already held, in (channel, key) order, and starts over (in a subtransaction)
when a key is freed between the two, so that concurrent batches of the same keys cannot
deadlock. The signatures are unchanged.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0009_unique_jobs_and_abort")]

    operations = [
        InstallFunctions("enqueue"),
    ]

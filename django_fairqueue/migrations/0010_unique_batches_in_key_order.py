"""Unique batches in key order: ``fairqueue_enqueue_unique_v1`` inserts keyed messages, and
handles keys already held, in (channel, key) order, and starts over (in a subtransaction)
when a key is freed between the two, so that concurrent batches of the same keys cannot
deadlock. Installed from this migration's own copy (``sql/0010_*.sql``); the signatures are
unchanged, so going back installs 0009's copy again.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import migration_sql


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0009_unique_jobs_and_abort")]

    operations = [
        migrations.RunSQL(
            migration_sql("0010_unique_batches_in_key_order"),
            migration_sql("0009_unique_jobs_and_abort"),
        ),
    ]

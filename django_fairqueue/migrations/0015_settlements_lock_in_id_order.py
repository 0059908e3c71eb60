"""Completions lock their rows in id order.

``fairqueue_complete_v1`` locked a batch's rows in id order only when it mixed kept-result and
plain messages; otherwise in the order its plan visited them (a sequential or bitmap scan
follows the table's physical order). An ``abort()`` waiting for the same rows in id order could
then deadlock with it. The function now locks every batch of more than one row in id order
first, as every statement that waits for message rows does.

``fairqueue_unique_key_held_v1`` is new: whether another message holds a unique key, the test
that the settlements, the rescue and an operator's retry of a unique job each spelled out.

The functions are installed again from this migration's own copy (``sql/0015_*.sql``).
"""

from django.db import migrations

from django_fairqueue.migrations._sql import migration_sql


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0014_periodic_schedules")]

    operations = [
        migrations.RunSQL(
            migration_sql("0015_settlements_lock_in_id_order"),
            "DROP FUNCTION fairqueue_unique_key_held_v1(bigint, text);\n"
            + migration_sql("0013_fairness_by_time"),
        ),
    ]

"""Names that do not change, and priorities in range, whatever writes the rows.

* ``fairqueue_keep_name_v1`` and the triggers ``fairqueue_channel_keep_name`` and
  ``fairqueue_group_keep_name`` refuse a statement that changes a channel's or a group's name
  (``Model.save()``, ``QuerySet.update()``, ``bulk_update()``, ``loaddata``): enqueues find a
  channel by its name, and the name says which group it belongs to. The functions are
  installed again from this migration's own copy (``sql/0023_*.sql``); reversing installs the
  previous copy and drops the triggers and their function.
* ``fq_message_priority_range``: a message's priority is within -100..100, as ``enqueue()``
  checks, also when the ORM writes it. Rows out of range (only an ORM write could have stored
  one) are first brought to the nearest end of the range, the order the claim gave them
  already. Added ``NOT VALID`` and validated in a statement of its own, which scans the table
  without blocking writes.
"""

from django.db import migrations, models
from django.db.models import Q

from django_fairqueue.migrations._sql import migration_sql

PREVIOUS = "0022_unique_active_off_the_claim"

DROP_NEW = """
DROP TRIGGER IF EXISTS fairqueue_channel_keep_name ON fairqueue_channel;
DROP TRIGGER IF EXISTS fairqueue_group_keep_name ON fairqueue_channel_group;
DROP FUNCTION IF EXISTS fairqueue_keep_name_v1();
"""


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("fairqueue", "0022_unique_active_off_the_claim"),
    ]

    operations = [
        migrations.RunSQL(
            migration_sql("0023_names_and_priorities_hold"),
            DROP_NEW + migration_sql(PREVIOUS),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddConstraint(
                    model_name="message",
                    constraint=models.CheckConstraint(
                        condition=Q(priority__gte=-100, priority__lte=100),
                        name="fq_message_priority_range",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    "UPDATE fairqueue_message SET priority = greatest(-100, least(100, priority))"
                    " WHERE priority NOT BETWEEN -100 AND 100;",
                    migrations.RunSQL.noop,
                ),
                migrations.RunSQL(
                    "ALTER TABLE fairqueue_message ADD CONSTRAINT fq_message_priority_range"
                    " CHECK (priority >= -100 AND priority <= 100) NOT VALID;",
                    "ALTER TABLE fairqueue_message DROP CONSTRAINT fq_message_priority_range;",
                ),
                migrations.RunSQL(
                    "ALTER TABLE fairqueue_message VALIDATE CONSTRAINT fq_message_priority_range;",
                    migrations.RunSQL.noop,
                ),
            ],
        ),
    ]

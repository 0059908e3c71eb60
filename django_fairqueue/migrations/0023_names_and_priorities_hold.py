"""Names that do not change, and priorities in range, whatever writes the rows.

* The triggers ``fairqueue_channel_keep_name`` and ``fairqueue_group_keep_name`` refuse a
  statement that renames a channel or a group (the ``groups`` family).
* ``fq_message_priority_range`` (-100..100): rows out of range are first brought to the
  nearest end; added ``NOT VALID``, then validated without blocking writes.
"""

from django.db import migrations, models
from django.db.models import Q

from django_fairqueue.migrations._sql import InstallFunctions


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
        migrations.RunSQL(migrations.RunSQL.noop, DROP_NEW),
        InstallFunctions("groups"),
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

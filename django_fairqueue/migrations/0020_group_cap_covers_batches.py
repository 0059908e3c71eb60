"""A channel group's cap covers its channels' work batches too.

The batch claim counted a batch toward its group's running total (the group sums its
channels' ``running_count``, which counts batches) but did not check the group's
``max_concurrency``, so batches could take a group over its cap. It now locks the group row
after the channel, without waiting, and passes over a group at its cap. The batch function is
installed again from this migration's own copy (``sql/0020_*.batches.sql``).
"""

from django.db import migrations

from django_fairqueue.migrations._sql import migration_sql


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0019_pipeline_job_to_its_app")]

    operations = [
        migrations.RunSQL(
            migration_sql("0020_group_cap_covers_batches.batches"),
            migration_sql("0006_channel_state_outside_the_model.batches"),
        ),
    ]

"""The pipeline job model leaves the queue for the optional pipeline app.

``PipelineJob`` is now ``fairqueue_pipeline.PipelineJob`` (``django_fairqueue.contrib.pipeline``).
This migration removes it from the queue's migration state only: its table,
``fairqueue_pipeline_job``, stays with its rows, and the pipeline app's first migration takes
it over (in its state only, with the same table). A project without the pipeline app keeps the
table, unused.
"""

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [("fairqueue", "0017_channel_groups")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="PipelineJob")],
            database_operations=[],
        ),
    ]

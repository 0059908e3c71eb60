"""A channel group's cap covers its channels' work batches too.

The batch claim counted a batch toward its group's running total (the group sums its
channels' ``running_count``, which counts batches) but did not check the group's
``max_concurrency``, so batches could take a group over its cap. It now locks the group row
after the channel, without waiting, and passes over a group at its cap (the ``batches``
family).
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0019_pipeline_job_to_its_app")]

    operations = [
        InstallFunctions("batches"),
    ]

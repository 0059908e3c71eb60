"""The worker registry records the queues each worker claims from (``runfairworker
--queues``): ``fairqueue_worker.queues``, a JSON list in the worker's order, NULL for every
queue (what every worker registered before this migration served)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0026_claim_every_queue_as_one")]

    operations = [
        migrations.AddField(
            model_name="workerrecord",
            name="queues",
            field=models.JSONField(blank=True, default=None, null=True),
        ),
    ]

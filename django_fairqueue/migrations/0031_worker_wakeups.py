"""The worker registry records how each worker learns of new messages:
``fairqueue_worker.wakeups``, "notify" when its listener saw a notification of its own arrive,
"polling: <why>" when none did (behind a transaction pooler, say) and it polls on purpose,
empty when unknown (started with --no-listen, or not checked yet)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0030_one_claim")]

    operations = [
        migrations.AddField(
            model_name="workerrecord",
            name="wakeups",
            field=models.CharField(blank=True, db_default="", default="", max_length=300),
        ),
    ]

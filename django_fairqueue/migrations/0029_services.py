"""Two changes of the worker services:

* a pause, a resume or an edit of a schedule's cron or timezone clears its ``fired_spec`` in the
  UPDATE that makes it (the trigger ``fq_schedule_edited``, the ``schedules`` family of
  ``db/functions/``), so an edit undone before any firing pass ran still counts as one: no slot
  of the pause, nor of the other cron, fires;
* the worker registry records what a supervisor knew of a worker's slot when it started the
  process (``fairqueue_worker.supervision``: restarts, a crash loop, the last exits).
"""

from django.db import migrations, models

from django_fairqueue.migrations._sql import InstallFunctions

DROP = """
DROP TRIGGER IF EXISTS fq_schedule_edited ON fairqueue_schedule;
DROP FUNCTION IF EXISTS fairqueue_schedule_edited_v1();
"""


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0028_usage")]

    operations = [
        migrations.AddField(
            model_name="workerrecord",
            name="supervision",
            field=models.JSONField(blank=True, default=None, null=True),
        ),
        # Backwards: the trigger and its function go.
        migrations.RunSQL(migrations.RunSQL.noop, DROP),
        InstallFunctions("schedules"),
    ]

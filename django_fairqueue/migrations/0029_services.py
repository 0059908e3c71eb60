"""Two changes of the worker services:

* a pause, a resume or an edit of a schedule's cron or timezone clears its ``fired_spec`` in the
  UPDATE that makes it (a trigger), so an edit undone before any firing pass ran still counts
  as one: no slot of the pause, nor of the other cron, fires (sql/functions_schedules_v1.sql);
* the worker registry records what a supervisor knew of a worker's slot when it started the
  process (``fairqueue_worker.supervision``: restarts, a crash loop, the last exits).
"""

from django.db import migrations, models

from django_fairqueue.migrations._sql import migration_sql

TRIGGER = """
CREATE TRIGGER fq_schedule_edited
    BEFORE UPDATE OF cron, timezone, enabled ON fairqueue_schedule
    FOR EACH ROW
    WHEN (OLD.cron IS DISTINCT FROM NEW.cron
          OR OLD.timezone IS DISTINCT FROM NEW.timezone
          OR OLD.enabled IS DISTINCT FROM NEW.enabled)
    EXECUTE FUNCTION fairqueue_schedule_edited_v1();
"""


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0027_worker_queues")]

    operations = [
        migrations.AddField(
            model_name="workerrecord",
            name="supervision",
            field=models.JSONField(blank=True, default=None, null=True),
        ),
        migrations.RunSQL(
            migration_sql("0029_services") + TRIGGER,
            "DROP TRIGGER IF EXISTS fq_schedule_edited ON fairqueue_schedule;"
            "DROP FUNCTION IF EXISTS fairqueue_schedule_edited_v1();",
        ),
    ]

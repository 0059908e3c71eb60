"""Three things for the admin at scale (docs/performance.md, "The admin at a million messages"):

* ``timed_out`` in the per-minute channel statistics: of the failed attempts counted there, those
  that ran out of time (past the task's time limit, or a lease that expired and was rescued), so
  the admin, ``fairqueue status`` and the metrics show timeouts apart from failures (the task
  raised). Existing rows get 0: their attempts count as failures. The column has a database
  default, so workers still running the previous version during a deploy insert their rows
  without it.
* ``fairqueue_minute_stat``, the per-minute sums of the channel statistics over all channels,
  written by the workers' flush with the channel rows: the dashboard's series and overall
  figures read one row a minute instead of every channel's. Filled here from the channel rows
  already kept, so the dashboard's history does not start empty. During a rolling deploy, what
  workers of the previous version flush reaches the channel rows only: the per-minute sums of
  those minutes (the dashboard's series, its overall wait) miss it.
* ``fq_message_retrying_idx``, the retries waiting out their backoff per channel (scheduled
  rows with attempts > 0), for the "retrying" figure: without it the count reads every
  scheduled row of the channels, delayed messages included.

The index is built CONCURRENTLY, so enqueue, claims and completions go on while it builds;
hence not atomic. Reversing drops all three.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models

import django_fairqueue.models

# Element-wise sums of the histograms: unnest each with its position, sum per position.
BACKFILL_MINUTES = """
INSERT INTO fairqueue_minute_stat (
    minute, claimed, succeeded, failed, retried, timed_out, wait_ms_sum, wait_ms_max,
    wait_histogram, run_ms_sum
)
SELECT s.minute, sum(s.claimed), sum(s.succeeded), sum(s.failed), sum(s.retried),
       sum(s.timed_out), sum(s.wait_ms_sum), max(s.wait_ms_max),
       ARRAY(
           SELECT sum(h.v)::integer
           FROM fairqueue_channel_stat x, unnest(x.wait_histogram) WITH ORDINALITY AS h(v, i)
           WHERE x.minute = s.minute
           GROUP BY h.i
           ORDER BY h.i
       ),
       sum(s.run_ms_sum)
FROM fairqueue_channel_stat s
GROUP BY s.minute
"""


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("fairqueue", "0015_settlements_lock_in_id_order"),
    ]

    operations = [
        migrations.AddField(
            model_name="channelstat",
            name="timed_out",
            field=models.IntegerField(default=0, db_default=0),
        ),
        migrations.CreateModel(
            name="MinuteStat",
            fields=[
                ("minute", models.DateTimeField(primary_key=True, serialize=False)),
                ("claimed", models.BigIntegerField(default=0)),
                ("succeeded", models.BigIntegerField(default=0)),
                ("failed", models.BigIntegerField(default=0)),
                ("retried", models.BigIntegerField(default=0)),
                ("timed_out", models.BigIntegerField(default=0)),
                ("wait_ms_sum", models.BigIntegerField(default=0)),
                ("wait_ms_max", models.IntegerField(default=0)),
                ("wait_histogram", django_fairqueue.models.IntegerArrayField(default=list)),
                ("run_ms_sum", models.BigIntegerField(default=0)),
            ],
            options={"db_table": "fairqueue_minute_stat"},
        ),
        migrations.RunSQL(BACKFILL_MINUTES, migrations.RunSQL.noop),
        AddIndexConcurrently(
            model_name="message",
            index=models.Index(
                models.F("channel"),
                condition=models.Q(("attempts__gt", 0), ("state", "scheduled")),
                name="fq_message_retrying_idx",
            ),
        ),
    ]

"""Three things for the admin at scale (docs/performance.md, "The admin at a million messages"):

``timed_out`` in the per-minute channel statistics; ``fairqueue_minute_stat``, the per-minute
sums over all channels (filled from the channel rows); ``fq_message_retrying_idx``.

The index is built CONCURRENTLY, so the queue goes on while it builds; hence not atomic.
Reversing drops all three.
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

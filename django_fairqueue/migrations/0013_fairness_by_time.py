"""Fairness by time: a virtual tag per channel, run time in the deltas.

* ``fairqueue_channel`` gains ``vtime`` (its virtual start tag) and ``mean_run`` (its mean run
  time per message), scheduler state outside the model, and the tag indexes.
* ``fairqueue_channel_delta`` gains ``run_seconds`` and ``run_count``.
* ``fairqueue_claim_v1``, ``fairqueue_fold_deltas_v1`` and ``fairqueue_complete_v1`` take one
  more argument with a default: their old signatures are dropped first (old callers reach the
  new functions, which then behave as before); the families this migration changed are
  installed.
"""

from django.db import migrations, models

from django_fairqueue.migrations._sql import InstallFunctions

COLUMNS = """
ALTER TABLE fairqueue_channel
    ADD COLUMN vtime double precision NOT NULL DEFAULT 0,
    ADD COLUMN mean_run double precision;
CREATE INDEX fq_channel_vtime_idx ON fairqueue_channel (vtime, id)
WHERE ready_count > 0 AND NOT paused
  AND (max_concurrency IS NULL OR running_count < max_concurrency);
CREATE INDEX fq_channel_vtime_max_idx ON fairqueue_channel (vtime) WHERE vtime > 0;
"""

UNCOLUMNS = """
DROP INDEX IF EXISTS fq_channel_vtime_max_idx;
DROP INDEX IF EXISTS fq_channel_vtime_idx;
ALTER TABLE fairqueue_channel DROP COLUMN IF EXISTS vtime, DROP COLUMN IF EXISTS mean_run;
"""

DROP_OLD = """
DROP FUNCTION IF EXISTS fairqueue_claim_v1(integer, interval, text, bigint[], bigint[], integer,
    boolean, integer);
DROP FUNCTION IF EXISTS fairqueue_fold_deltas_v1(integer, boolean);
DROP FUNCTION IF EXISTS fairqueue_complete_v1(bigint[], uuid[], jsonb[]);
"""

DROP_NEW = """
DROP FUNCTION IF EXISTS fairqueue_claim_v1(integer, interval, text, bigint[], bigint[], integer,
    boolean, integer, boolean);
DROP FUNCTION IF EXISTS fairqueue_fold_deltas_v1(integer, boolean, boolean);
DROP FUNCTION IF EXISTS fairqueue_complete_v1(bigint[], uuid[], jsonb[], double precision[]);
DROP FUNCTION IF EXISTS fairqueue_virtual_time_v1(bigint);
DROP FUNCTION IF EXISTS fairqueue_lift_v1(double precision, double precision, boolean, boolean);
DROP FUNCTION IF EXISTS fairqueue_mean_run_v1(double precision, double precision, bigint);
DROP FUNCTION IF EXISTS fairqueue_run_seconds_v1(double precision, timestamptz);
DROP FUNCTION IF EXISTS fairqueue_default_run_v1();
"""


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0012_pipeline_job")]

    operations = [
        migrations.RunSQL(COLUMNS, UNCOLUMNS),
        migrations.AddField(
            model_name="channeldelta",
            name="run_seconds",
            field=models.FloatField(db_default=0.0, default=0.0),
        ),
        migrations.AddField(
            model_name="channeldelta",
            name="run_count",
            field=models.IntegerField(db_default=0, default=0),
        ),
        # Backwards: the new functions go.
        migrations.RunSQL(DROP_OLD, DROP_NEW),
        InstallFunctions("locks_clocks", "fold_counters", "claim", "settle"),
    ]

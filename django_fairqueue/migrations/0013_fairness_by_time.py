"""Fairness by time: a virtual tag per channel, run time in the deltas.

* ``fairqueue_channel`` gains ``vtime`` (the channel's virtual start tag: seconds of worker
  time charged, divided by its weight) and ``mean_run`` (its mean run time per message, the
  estimate a claim charges before the settlement says what really ran). Scheduler state, so
  not model fields (see the Channel docstring). ``fq_channel_vtime_idx`` is the claim's walk
  in tag order (the predicate of ``fq_channel_turn_idx``); ``fq_channel_vtime_max_idx``
  answers the largest tag, the system's virtual time when no channel is claimable (tags above
  0 only: fairness by count leaves every tag at 0, so its writes never touch this index).
* ``fairqueue_channel_delta`` gains ``run_seconds`` and ``run_count``: settlements record the
  run time there, never in the channel row.
* The functions are installed again from this migration's own copy (``sql/0013_*.sql``).
  ``fairqueue_claim_v1`` (``p_by_time``), ``fairqueue_fold_deltas_v1`` (``p_by_time``) and
  ``fairqueue_complete_v1`` (``p_runs``) take one more argument with a default, so their old
  signatures are dropped first (a caller passing the old arguments reaches the new function,
  which then behaves as before).
"""

from django.db import migrations, models

from django_fairqueue.migrations._sql import migration_sql

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
        # Backwards: the new functions go and the previous migration's are installed again.
        migrations.RunSQL(
            DROP_OLD + migration_sql("0013_fairness_by_time"),
            DROP_NEW + migration_sql("0010_unique_batches_in_key_order"),
        ),
    ]

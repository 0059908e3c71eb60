"""Server-side functions and storage settings for the queue tables.

The functions are functions_v1.sql as it stood before migration 0003 (sql/0002_functions_v1.sql).
fairqueue_complete_v1 and fairqueue_complete_and_claim_v1 came later, with 0004's copy; the
reverse drops them too, so that going back to 0001 from any later state leaves no function.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import migration_sql

# Queue tables churn: every claim rewrites channel rows and every settlement deletes or updates
# a message. Vacuum them after a fixed number of dead rows instead of a fraction of the table,
# without cost-based throttling, so dead index entries never pile up in front of the claim.
STORAGE = """
ALTER TABLE fairqueue_channel SET (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0, autovacuum_analyze_scale_factor = 0.05
);
ALTER TABLE fairqueue_channel_delta SET (
    autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0
);
ALTER TABLE fairqueue_message SET (
    fillfactor = 90,
    autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);
ALTER TABLE fairqueue_work_batch SET (
    autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0
);
"""

UNSTORAGE = """
ALTER TABLE fairqueue_channel RESET (fillfactor, autovacuum_vacuum_scale_factor,
    autovacuum_vacuum_threshold, autovacuum_vacuum_cost_delay, autovacuum_analyze_scale_factor);
ALTER TABLE fairqueue_channel_delta RESET (autovacuum_vacuum_scale_factor,
    autovacuum_vacuum_threshold, autovacuum_vacuum_cost_delay);
ALTER TABLE fairqueue_message RESET (fillfactor, autovacuum_vacuum_scale_factor,
    autovacuum_vacuum_threshold, autovacuum_vacuum_insert_scale_factor,
    autovacuum_analyze_scale_factor, autovacuum_vacuum_cost_delay);
ALTER TABLE fairqueue_work_batch RESET (autovacuum_vacuum_scale_factor,
    autovacuum_vacuum_cost_delay);
"""

DROP_V1 = """
DROP FUNCTION IF EXISTS fairqueue_enqueue_v1(text[], text[], jsonb[], smallint[], timestamptz[],
    integer[], boolean[], integer, interval, integer, integer, text);
DROP FUNCTION IF EXISTS fairqueue_claim_v1(integer, interval, text, bigint[], bigint[], integer,
    boolean);
DROP FUNCTION IF EXISTS fairqueue_complete_and_claim_v1(bigint[], uuid[], jsonb[], integer,
    interval, text, bigint[], bigint[], integer);
-- the signatures as of migration 0004 (p_wait_ms)
DROP FUNCTION IF EXISTS fairqueue_claim_v1(integer, interval, text, bigint[], bigint[], integer,
    boolean, integer);
DROP FUNCTION IF EXISTS fairqueue_complete_and_claim_v1(bigint[], uuid[], jsonb[], integer,
    interval, text, bigint[], bigint[], integer, integer);
DROP FUNCTION IF EXISTS fairqueue_complete_v1(bigint[], uuid[], jsonb[]);
DROP FUNCTION IF EXISTS fairqueue_fold_deltas_v1(integer, boolean);
DROP FUNCTION IF EXISTS fairqueue_promote_due_v1(timestamptz, integer);
DROP FUNCTION IF EXISTS fairqueue_lock_key_v1();
"""


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0001_initial")]

    operations = [
        migrations.RunSQL(STORAGE, UNSTORAGE),
        migrations.RunSQL(migration_sql("0002_functions_v1"), DROP_V1),
    ]

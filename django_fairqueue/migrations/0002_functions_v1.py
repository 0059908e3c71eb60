"""Server-side functions and storage settings for the queue tables.

The functions of the families this migration first installed (replaced by the squashed initial
migration; see migrations/_sql.py). The reverse drops every function, so that going back to
0001 from any later state leaves none.
"""

import importlib

from django.db import migrations

from django_fairqueue.migrations._sql import DROP_ALL_FUNCTIONS, InstallFunctions

SQUASHED = importlib.import_module("django_fairqueue.migrations.0001_squashed_0027_worker_queues")

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


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0001_initial")]

    operations = [
        migrations.RunSQL(SQUASHED.STORAGE, UNSTORAGE),
        migrations.RunSQL(migrations.RunSQL.noop, DROP_ALL_FUNCTIONS),
        InstallFunctions("locks_clocks", "fold_counters", "claim", "enqueue"),
    ]

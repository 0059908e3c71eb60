"""The claim's housekeeping: probes first, and the fold deletes by primary key.

fairqueue_promote_due_v1 and fairqueue_fold_deltas_v1 (which every claim calls first) start
with one index probe each and return 0 when nothing is due or waiting to be folded, and the
fold deletes the deltas it folds by primary key alone (a plan through the channel index read
every pending delta of the channels). The same signatures and results, so the v1 names stay,
and functions_v1.sql as it then was is installed again (sql/0005_maintenance_probes.sql,
CREATE OR REPLACE).
"""

from django.db import migrations

from django_fairqueue.migrations._sql import migration_sql


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0004_claim_wait")]

    operations = [
        # Backwards: the bodies 0004 installed differ only in speed; 0002's reverse drops them.
        migrations.RunSQL(migration_sql("0005_maintenance_probes"), migrations.RunSQL.noop),
    ]

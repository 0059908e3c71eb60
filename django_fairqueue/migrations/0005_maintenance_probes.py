"""The claim's housekeeping: probes first, and the fold deletes by primary key.

fairqueue_promote_due_v1 and fairqueue_fold_deltas_v1 (which every claim calls first) start
with one index probe each and return 0 when nothing is due or waiting to be folded, and the
fold deletes the deltas it folds by primary key alone (a plan through the channel index read
every pending delta of the channels). The same signatures and results, so the v1 names stay.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0004_claim_wait")]

    operations = [
        InstallFunctions("fold_counters", "claim"),
    ]

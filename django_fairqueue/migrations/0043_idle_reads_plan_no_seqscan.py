"""What an idle worker asks plans no sequential scan: when a claim could next take something
(after a claim came back empty) and whether waking counter deltas are backed up (after a
work-batch claim found nothing) are server functions now. As prepared statements, a plan made
while the delta table had no pages read the whole table on every call, the first once per
channel with ready messages. A group's turn once woken is one function
(fairqueue_woken_turn_v1) where seven statements wrote it out. Installs the locks_clocks,
groups, fold_counters and next_due families.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0042_index_scans_only")]

    operations = [InstallFunctions("locks_clocks", "groups", "fold_counters", "next_due")]

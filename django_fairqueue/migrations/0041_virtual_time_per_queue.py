"""Fairness by time: a channel is lifted to its queue's virtual time, which leaves out rate-limited
flows and channels in slow start (their low tags had a new or returning channel come back far
ahead of the backlogged ones), and a channel leaving slow start is lifted too. Installs the
families it changes; drops the two functions ``fairqueue_queue_virtual_time_v1`` replaces.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions

DROP_REPLACED = """
DROP FUNCTION IF EXISTS fairqueue_virtual_time_v1(bigint);
DROP FUNCTION IF EXISTS fairqueue_top_virtual_time_v1(bigint, bigint);
"""


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0040_unique_supersede_and_full")]

    operations = [InstallFunctions("locks_clocks", "groups", "fold_counters", first=DROP_REPLACED)]

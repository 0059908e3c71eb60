"""A claim that does its housekeeping only when there is some: one statement probes for due
scheduled messages and waking deltas and reads the queues of claimable flows (the highest ones
only when there is a lowest), and the promotion and the fold are called only when their probe
found work (an idle poll called both to find nothing, then probed the queues and the deltas
again).

Installs only the family it changes: claim.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0031_worker_wakeups")]

    operations = [InstallFunctions("claim")]

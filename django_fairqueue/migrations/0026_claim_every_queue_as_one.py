"""A claim of every queue (``p_queues`` NULL, the default worker's) costs what a claim cost
before queues: the one statement that reads the lowest and highest queue with claimable work
also stands in for the group probe (skipped when no group is claimable in any queue), whether
one queue has work is decided by PL/pgSQL comparisons instead of another statement, and an
idle poll (nothing claimable in any queue) makes no walk: it goes straight to the wait for a
channel a concurrent claim has just folded (then walks that channel's queue), or returns.

The ``claim`` family is installed; no signature changes.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0025_lift_within_one_charge")]

    operations = [
        InstallFunctions("claim"),
    ]

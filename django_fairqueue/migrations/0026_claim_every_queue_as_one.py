"""A claim of every queue (``p_queues`` NULL, the default worker's) costs what a claim cost
before queues: the one statement that reads the lowest and highest queue with claimable work
also stands in for the group probe (skipped when no group is claimable in any queue), whether
one queue has work is decided by PL/pgSQL comparisons instead of another statement, and an
idle poll (nothing claimable in any queue) makes no walk: it goes straight to the wait for a
channel a concurrent claim has just folded (then walks that channel's queue), or returns.

The functions are installed again from this migration's own copy (``sql/0026_*.sql``); no
signature changes. Reversing installs 0025's copy.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import migration_sql


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0025_lift_within_one_charge")]

    operations = [
        migrations.RunSQL(
            migration_sql("0026_claim_every_queue_as_one"),
            migration_sql("0025_lift_within_one_charge"),
        ),
    ]

"""Fairness by time: a channel that becomes claimable starts within one message's charge of
the virtual time (docs/explanation/fairness.md, "No banked credit").

``fairqueue_lift_v1`` takes the channel's charge per message (the four-argument signature is
dropped) and ``fairqueue_charge_v1`` is new; the families this migration changed are
installed. Reversing drops the new signatures.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions

DROP_OLD = """
DROP FUNCTION IF EXISTS fairqueue_lift_v1(double precision, double precision, boolean, boolean);
"""

DROP_NEW = """
DROP FUNCTION IF EXISTS fairqueue_lift_v1(double precision, double precision, boolean, boolean,
    double precision);
DROP FUNCTION IF EXISTS fairqueue_charge_v1(double precision, integer);
"""


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0024_queues")]

    operations = [
        # Backwards: the new functions go.
        migrations.RunSQL(DROP_OLD, DROP_NEW),
        InstallFunctions("locks_clocks", "groups", "fold_counters", "settle"),
    ]

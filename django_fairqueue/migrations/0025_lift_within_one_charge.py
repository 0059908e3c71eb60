"""Fairness by time: a channel that becomes claimable starts within one message's charge of
the virtual time (docs/explanation/fairness.md, "No banked credit").

* ``fairqueue_lift_v1`` takes the channel's charge per message (``p_charge``, last): a waking
  channel's tag becomes at least the virtual time, as before, and now at most one charge past
  it. The four-argument signature is dropped.
* ``fairqueue_charge_v1(mean_run, weight)``: the charge per message the claim uses.
* The first settlements of a channel (no ``mean_run`` yet) wake the claim, which folds them,
  so a new channel is charged its own run time from its next claim on.
* The functions are installed again from this migration's own copy (``sql/0025_*.sql``).
  Reversing drops the new signatures and installs 0024's copy.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import migration_sql

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
        # Backwards: the new functions go and the previous full copy is installed again.
        migrations.RunSQL(
            DROP_OLD + migration_sql("0025_lift_within_one_charge"),
            DROP_NEW + migration_sql("0024_queues"),
        ),
    ]

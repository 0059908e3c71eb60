"""The claim may queue behind a concurrent claim holding the only eligible channels.

fairqueue_claim_v1 and fairqueue_complete_and_claim_v1 gain a last parameter, ``p_wait_ms
integer DEFAULT 0``: a compatible change (a caller passing the old arguments gets the old
behaviour), so the functions keep their v1 names. The old signatures are dropped first, else a call with
the old arguments would match both; then the families this migration changed are installed.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions

DROP_OLD_SIGNATURES = """
DROP FUNCTION IF EXISTS fairqueue_complete_and_claim_v1(bigint[], uuid[], jsonb[], integer,
    interval, text, bigint[], bigint[], integer);
DROP FUNCTION IF EXISTS fairqueue_claim_v1(integer, interval, text, bigint[], bigint[], integer,
    boolean);
"""


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0003_work_batch_claim")]

    operations = [
        # Backwards: 0002's reverse drops the functions (both signatures); nothing to undo here.
        migrations.RunSQL(DROP_OLD_SIGNATURES, migrations.RunSQL.noop),
        InstallFunctions("fold_counters", "claim", "settle"),
    ]
